"""Edges of tilegemm.models.from_pretrained found against checkpoints written by the tests' own writer
(ckpt_writer.py): layers narrower than the group size (stored as one group), layers whose last group is partial
(loaded in groups of gcd(K, group_size)), a stored bias of the wrong shape, an index that maps a tensor to a shard
that lacks it, a directory holding only pytorch_model.bin, older quantizers' settings files and file names. The
loaded models run on the ``device`` fixture's device (the CPU under the interpreter, the GPU otherwise), the
plain-torch references on the CPU."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from loaded_checks import assert_loaded_exactly  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.nn import Int4Linear  # noqa: E402

IDS = torch.tensor([[3, 17, 200]])


def _rel(model, reference) -> float:
    with torch.no_grad():
        a = model(input_ids=IDS.to(model.device)).logits.float().cpu()
        b = reference(input_ids=IDS).logits.float()
    return float((a - b).norm() / b.norm())


def _set_group_size(path, group_size):
    cfg = json.loads((path / "config.json").read_text())
    q = cfg["quantization_config"]
    if q["quant_method"] == "compressed-tensors":  # each config group's weights say it
        for scheme in q["config_groups"].values():
            scheme["weights"].update(strategy="group", group_size=group_size)
    else:
        q["group_size"] = group_size
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method, act_order", [("gptq", False), ("gptq", True), ("awq", False),
                                               ("compressed-tensors", True)])
def test_layers_narrower_than_the_group_load_as_one_group(tmp_path, method, act_order, device):
    # hidden 64 < group 128: quantizers store ceil(64 / 128) = 1 group for q/k/v/o/gate/up (down: K = 128, 1 group)
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), method, -1, sym=False, act_order=act_order)
    _set_group_size(path, 128)  # what the config of such a checkpoint says
    model = from_pretrained(path, device=device)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7 * config.num_hidden_layers
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


@pytest.mark.parametrize("method, sym, act_order", [("gptq", True, False), ("gptq", False, False),
                                                    ("gptq", False, True), ("awq", False, False),
                                                    ("compressed-tensors", True, False),
                                                    ("compressed-tensors", False, True)])
def test_a_partial_last_group_loads_in_groups_of_the_gcd(tmp_path, method, sym, act_order, device):
    # hidden 96, group 64: q/k/v/o/gate/up store ceil(96 / 64) = 2 groups, the last of 32 inputs (down: K = 192,
    # 3 whole groups); they load as groups of gcd(96, 64) = 32, each taking its stored group's scale and zero
    config = cw.tiny_config("llama", hidden=96, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), method, 64, sym=sym, act_order=act_order)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        scales = "weight_scale" if method == "compressed-tensors" else "scales"
        shape = f.get_slice(f"model.layers.0.self_attn.q_proj.{scales}").get_shape()
    assert 2 in shape  # the writer stored the partial group as the quantizers do
    model = from_pretrained(path, device=device)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.group_size == 32 and layer.mlp.down_proj.group_size == 64
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7 * config.num_hidden_layers
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_a_partial_last_group_whose_gcd_no_kernel_takes_is_refused(tmp_path):
    config = cw.tiny_config("llama", hidden=80, layers=1)  # q_proj: K = 80, group 64: gcd 16, no kernel's group size
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 64)
    with pytest.raises(ValueError, match=r"q_proj: in_features 80 is not divisible by group_size 64: its last group "
                                         r"is partial, and no group length the kernels take \(32, 64, 128, 256\) "
                                         r"divides gcd\(80, 64\) = 16"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("method, sym, act_order", [("gptq", False, False), ("gptq", True, True),
                                                    ("awq", False, False), ("compressed-tensors", False, True)])
@pytest.mark.parametrize("group_size, hidden, loads_as", [(512, 512, {"q_proj": -1, "down_proj": 256}),
                                                         (96, 192, {"q_proj": 32, "down_proj": 32}),
                                                         (1024, 256, {"q_proj": 256, "down_proj": -1})])
def test_group_lengths_the_kernels_do_not_take_load_as_one_they_take(tmp_path, method, sym, act_order, group_size,
                                                                     hidden, loads_as, device):
    # GPTQ and the others quantize in any group length: 512 (down: K = 1024, two groups) loads exactly as groups of
    # 256, each taking its stored group's scale and zero; a layer that is one group of 512 as all of K (-1); 96 as
    # groups of 32; 1024 over a K below it is one group (the kernels' K where they take it, 256, else -1)
    config = cw.tiny_config("llama", hidden=hidden, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), method, group_size, sym=sym, act_order=act_order)
    model = from_pretrained(path, device=device)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.group_size == loads_as["q_proj"]
    assert layer.mlp.down_proj.group_size == loads_as["down_proj"]
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_a_group_length_no_kernel_group_divides_is_refused(tmp_path):
    config = cw.tiny_config("llama", hidden=96, layers=1)  # group 48: gcd(96, 48) = 48, which 32 does not divide
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 48)
    with pytest.raises(ValueError, match=r"q_proj: group_size 48 is not a group length the kernels take, and no "
                                         r"group length the kernels take \(32, 64, 128, 256\) divides "
                                         r"gcd\(96, 48\) = 48"):
        from_pretrained(path, device="cpu")


def test_an_act_order_partial_group_of_other_sizes_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("llama", hidden=96, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 64, act_order=True)
    tensors = load_file(path / "model.safetensors")
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    g_idx[int((g_idx == 0).nonzero()[0])] = 1  # groups of 63 and 33 inputs: no cut into groups of 32 is exact
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj .*g_idx must put group_size = 64 inputs in each group but the "
                                         r"last, which holds the other 32 \(K = 96\)"):
        from_pretrained(path, device="cpu")


def test_a_quantized_layers_bias_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("qwen2", hidden=64, layers=1)  # q/k/v have biases
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(7, dtype=torch.float16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias: the checkpoint's shape \[7\] "
                                         r"does not match \[64\]"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("key, stored", [("model.layers.0.self_attn.q_proj.scales", torch.int32),
                                         ("model.layers.0.self_attn.q_proj.bias", torch.int32),
                                         ("lm_head.weight", torch.bool)])
def test_a_weight_bias_or_scale_stored_as_integers_is_refused(tmp_path, key, stored):
    # cast to 16 bits, integer scales would load as values 1000x off and integer norms as int parameters
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("qwen2", hidden=64, layers=1)  # q/k/v have biases
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    tensors = load_file(path / "model.safetensors")
    tensors[key] = (tensors[key].float() * 1000).round().to(stored)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TypeError, match=rf"stores {key.replace('.', '[.]')} as {str(stored)[6:]}; a weight, bias "
                                        rf"or scale must be a floating-point tensor"):
        from_pretrained(path, device="cpu")


def test_an_index_entry_naming_the_wrong_shard(tmp_path):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = "model.layers.0.self_attn.q_proj.scales"
    wrong = next(f for f in files if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=rf"maps {name} to {wrong}, which does not hold it"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("weight_map", [["a"], None, "x", {"a": ["model-00001.safetensors"]}, {"a": None}])
def test_an_index_whose_weight_map_is_no_map_of_names_is_refused(tmp_path, weight_map):
    # (a list, null or non-string file names crashed with an AttributeError or TypeError)
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, shard_bytes=20_000)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="must be JSON with a 'weight_map' of tensor name -> file"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("outside", ["../elsewhere.safetensors", "/tmp/elsewhere.safetensors"])
def test_an_index_naming_files_outside_the_directory_is_refused(tmp_path, outside):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = outside
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names files outside the checkpoint's directory"):
        from_pretrained(path, device="cpu")


def test_the_checkpoints_generation_config_is_loaded(tmp_path):
    # a chat model's extra end-of-sequence ids and sampling defaults live in generation_config.json, which a model
    # built from config.json alone does not have (generate() would not stop at them)
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    settings = {"eos_token_id": [2, 7, 9], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (path / "generation_config.json").write_text(json.dumps(settings))
    g = from_pretrained(path, device="cpu").generation_config
    assert (g.eos_token_id, g.do_sample, g.temperature, g.top_p) == ([2, 7, 9], True, 0.6, 0.9)
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not a generation config"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("scale, message", [(6000.0, "dequantized in fp16 pass fp16's range"),
                                            (1e5, "bf16 scales .* pass fp16's range once converted")])
def test_bf16_scales_that_pass_fp16s_range_are_refused_in_fp16(tmp_path, scale, message):
    # bf16 scales loaded with dtype=fp16: a finite scale of 1e5 became inf (the error blamed the checkpoint), and
    # scales of 6000 made weights of up to 15 x 6000 = 90000, inf in fp16, loaded without a word
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.scales"
    tensors[key] = torch.full(tensors[key].shape, scale, dtype=torch.bfloat16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model.layers.0.mlp.down_proj: its .*{message}.*dtype=torch.bfloat16"):
        from_pretrained(path, dtype=torch.float16, device="cpu")
    model = from_pretrained(path, dtype=torch.bfloat16, device="cpu")
    assert torch.isfinite(model.model.layers[0].mlp.down_proj.dequantize()).all()


def test_an_index_leaving_out_a_layers_quantized_tensors_names_both_forms(tmp_path):
    # the layer is then neither quantized nor plain in the files: the error names its weight in both forms
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    layer = "model.layers.0.self_attn.q_proj"
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(layer + ".")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"lacks tensor\(s\) the model needs: {layer}\.weight \(nor "
                                         rf"{layer}\.qweight\)"):
        from_pretrained(path, device="cpu")


def test_a_directory_with_pytorch_model_bin_only(tmp_path):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    os.remove(path / "model.safetensors")
    torch.save({}, path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"it holds pytorch_model\.bin: tilegemm reads safetensors "
                                                r"checkpoints only"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("method, awq_file", [("gptq", None), ("awq", "quant_config.json"),
                                              ("awq", "quantize_config.json")])
def test_older_quantizers_settings_files_and_file_names(tmp_path, device, method, awq_file):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (in their own keys; some AWQ checkpoints name
    theirs quantize_config.json, the name AutoGPTQ's has), no quantization_config in config.json, the weights in one
    file of the quantizer's own name: loaded as the same checkpoint written today."""
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), method, 32, act_order=method == "gptq")
    cfg = json.loads((path / "config.json").read_text())
    q = cfg.pop("quantization_config")
    if method == "gptq":  # AutoGPTQ's file: no quant_method key
        sidecar, settings = "quantize_config.json", dict(bits=4, group_size=32, damp_percent=0.01, desc_act=True,
                                                         static_groups=False, sym=q["sym"], true_sequential=True,
                                                         model_name_or_path=None,
                                                         model_file_base_name="gptq_model-4bit-32g")
        name = "gptq_model-4bit-32g.safetensors"
    else:  # AutoAWQ's file and names
        sidecar, settings = awq_file, dict(zero_point=True, q_group_size=32, w_bit=4, version="GEMM")
        name = "awq_model_w4_g32.safetensors"
    (path / "config.json").write_text(json.dumps(cfg))
    (path / sidecar).write_text(json.dumps(settings))
    os.rename(path / "model.safetensors", path / name)
    model = from_pretrained(path, device=device)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7 * config.num_hidden_layers
    assert model.config.quantization_config["converted_from"] == method
    assert_loaded_exactly(model, reference)
    # two files and no index: which tensor is where is not said (AutoGPTQ's settings name their file: read that)
    (path / "extra.safetensors").write_bytes(b"not read")
    if method == "gptq":
        assert_loaded_exactly(from_pretrained(path, device=device), reference)
        return
    with pytest.raises(FileNotFoundError, match=r"but 2 safetensors files \(.*\): which tensor is where needs the "
                                                r"index"):
        from_pretrained(path, device="cpu")


def test_experts_narrower_than_the_group_load_as_one_group(tmp_path, device):
    # Qwen3-MoE, hidden 64 and expert width 32 under group 128: every expert Linear is stored as one group
    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", -1, sym=False)
    _set_group_size(path, 128)
    model = from_pretrained(path, device=device)
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_experts_with_a_partial_last_group_load(tmp_path, device):
    # Qwen3-MoE, hidden 96 under group 64, act-order: every expert's gate and up (K = 96) store a last group of 32
    # inputs and load as groups of 32 in their sorted order (down_proj, K = 64: one whole group of 64)
    config = cw.tiny_moe_config("qwen3_moe", hidden=96, layers=1, width=64, experts=3)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 64, sym=False, act_order=True)
    model = from_pretrained(path, device=device)
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_model_class_builds_other_heads(tmp_path, device):
    """A classifier's checkpoint (BERT, its encoder quantized, the classifier left 16-bit) through
    ``model_class=AutoModelForSequenceClassification``; without it, a config no causal LM takes is refused by name."""
    import transformers

    config = transformers.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config).float().eval()
    path = tmp_path / "c"
    reference = cw.write_model(path, model, "gptq", 32, not_convert=["classifier"])
    # built as the causal LM transformers maps BERT to: the error names the class the checkpoint's config names
    with pytest.raises(ValueError, match=r"a BertLMHeadModel; the checkpoint's config names "
                                         r"BertForSequenceClassification: model_class=transformers."
                                         r"BertForSequenceClassification"):
        from_pretrained(path, device="cpu")
    loaded = from_pretrained(path, device=device, model_class=transformers.AutoModelForSequenceClassification)
    assert type(loaded).__name__ == "BertForSequenceClassification"
    layer = loaded.bert.encoder.layer[0]
    assert isinstance(layer.attention.self.query, Int4Linear) and type(loaded.classifier) is torch.nn.Linear
    ref = transformers.BertForSequenceClassification(config).float().eval()
    ref.load_state_dict({k: v.float() for k, v in reference.items()}, strict=False)
    ids = torch.tensor([[3, 17, 50, 5]])
    with torch.no_grad():
        got = loaded(input_ids=ids.to(device)).logits.float().cpu()
        want = ref(input_ids=ids).logits.float()
    assert float((got - want).norm() / want.norm()) < 3e-3
    with pytest.raises(TypeError, match="model_class must be a transformers auto class or model class"):
        from_pretrained(path, device="cpu", model_class="AutoModelForSequenceClassification")
    # a model class of another config's models: named with both configs, before transformers builds it
    with pytest.raises(TypeError, match=r"model_class LlamaForCausalLM is built from a LlamaConfig, and the "
                                        r"checkpoint's config .* is a BertConfig"):
        from_pretrained(path, device="cpu", model_class=transformers.LlamaForCausalLM)
    # a config no causal LM takes (T5): refused before anything is built, naming model_class
    cfg = json.loads((path / "config.json").read_text())
    t5 = transformers.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4).to_dict()
    t5["quantization_config"] = cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(t5))
    with pytest.raises(ValueError, match=r"AutoModelForCausalLM has no model for T5Config .*pass model_class"):
        from_pretrained(path, device="cpu")


def test_a_stored_copy_of_a_tied_output_layer_is_no_stray(tmp_path, device):
    """AutoGPTQ saves every state_dict key, so a tied model (Qwen2.5-0.5B, Llama-3.2-1B) stores lm_head.weight
    beside the embedding: that is the tied layer's tensor, not one that matches nothing in the model."""
    import warnings

    config = cw.tiny_config("qwen2", hidden=64, layers=1, tie=True)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, store_tied=True)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = from_pretrained(path, device=device)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def _config(arch, **kw):
    transformers = pytest.importorskip("transformers")
    if arch not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {arch}")
    return transformers.AutoConfig.for_model(arch, **{
        **dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False), **kw})


def test_a_linear_subclass_with_a_forward_of_its_own_is_refused(tmp_path):
    """Llama-4's router is an nn.Linear whose forward returns routing scores: stored quantized, it is refused by name
    before anything loads (an Int4Linear in its place computed x @ W.T and broke the block's forward)."""
    config = _config("llama4_text", num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=128,
                     head_dim=16, attention_chunk_size=64)
    cw.write_model(tmp_path / "c", cw.random_model(config), "gptq", 32, sym=True)  # the router too (8 experts)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.feed_forward\.router is stored quantized \(model\.layers"
                                         r"\.0\.feed_forward\.router\.qweight\), but .*Llama4Router is a subclass of "
                                         r"torch\.nn\.Linear.*Llama4ForCausalLM loads with this layer stored 16-bit"):
        from_pretrained(tmp_path / "c", device="cpu")


def test_falcons_linear_subclass_loads(tmp_path, device):
    """FalconLinear, whose forward is the Linear's product, loads as an Int4Linear."""
    config = _config("falcon", num_kv_heads=2, new_decoder_architecture=True)
    source = cw.random_model(config)
    assert type(source.transformer.h[0].self_attention.dense).__name__ == "FalconLinear"
    reference = cw.write_model(tmp_path / "c", source, "awq", 32)
    model = from_pretrained(tmp_path / "c", device=device)
    assert isinstance(model.transformer.h[0].self_attention.dense, Int4Linear)
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_rwkv_rescaled_layers(tmp_path, device):
    """RWKV divides its output layers' weights in place at inference (rescale_every): stored quantized they are
    refused by name; with rescale_every 0 (the same model) they load."""
    config = _config("rwkv", attention_hidden_size=64, num_hidden_layers=2)  # (its initialisation needs two)
    source = cw.random_model(config)
    reference = cw.write_model(tmp_path / "c", source, "gptq", 32, sym=True)
    with pytest.raises(ValueError, match=r"rwkv\.blocks\.0\.attention\.output is stored quantized .*RwkvForCausalLM "
                                         r"divides this layer's weight in place when it runs \(RWKV's rescale_every = "
                                         r"6\).*set rescale_every to 0"):
        from_pretrained(tmp_path / "c", device="cpu")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["rescale_every"] = 0
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(tmp_path / "c", device=device)
    assert isinstance(model.rwkv.blocks[1].feed_forward.value, Int4Linear)
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_a_causal_lm_the_auto_mapping_lacks_is_built_from_the_config(tmp_path, device):
    """Emu3ForCausalLM saves an Emu3TextConfig, which AutoModelForCausalLM has no model for: the class the config's
    architectures names builds it."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Emu3ForCausalLM"):
        pytest.skip("this transformers has no Emu3")
    config = transformers.Emu3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    source = transformers.Emu3ForCausalLM(config).float().eval()
    reference = cw.write_model(tmp_path / "c", source, "gptq", 32)
    model = from_pretrained(tmp_path / "c", device=device)
    assert type(model) is transformers.Emu3ForCausalLM
    ref = transformers.Emu3ForCausalLM(config).float().eval()
    ref.load_state_dict({k: v.float() for k, v in reference.items()})
    assert _rel(model, ref) < 3e-3


def test_the_loaded_model_says_it_is_quantized(tmp_path, device):
    """Every config of a loaded model carries transformers' _is_quantized (what its quantizers set: Jamba's and
    FalconMamba's Mamba layers then call dt_proj rather than read its weight); it is not saved, and the dequantized
    copy does not carry it."""
    from tilegemm.models.pretrained import dequantized_copy

    config = cw.tiny_config("llama", hidden=64, layers=1)
    cw.write_model(tmp_path / "c", cw.random_model(config), "gptq", 32)
    model = from_pretrained(tmp_path / "c", device=device)
    assert model.config._is_quantized is True and model.model.config._is_quantized is True
    model.save_pretrained(tmp_path / "saved")
    assert "_is_quantized" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    assert not hasattr(dequantized_copy(model).config, "_is_quantized")


# --- output widths that are not a multiple of 8 ----------------------------------------------------------------


def _odd_head(tmp_path, method, vocab=259, **kw):
    """A llama whose lm_head (out = ``vocab``, 259 = 32 * 8 + 3) the checkpoint stores quantized."""
    config = cw.tiny_config("llama", hidden=64, layers=1, vocab=vocab)
    path = tmp_path / "c"
    extra = dict(ignore=[]) if method == "compressed-tensors" else None  # (the writer's config ignores lm_head)
    reference = cw.write_model(path, cw.random_model(config), method, 32, quantize_lm_head=True, quant_extra=extra,
                               **kw)
    return path, config, reference


@pytest.mark.parametrize("sym, chunked", [(True, False), (False, False), (False, True)])
def test_compressed_tensors_output_width_not_a_multiple_of_8_loads(tmp_path, device, monkeypatch, sym, chunked):
    # pack-quantized packs the weight along K only, and asymmetric zero points along N in ceil(N/8) rows (the last
    # padded), so a vocabulary of 259 is a valid checkpoint; chunked: the head converted in slices of 256 outputs
    # then 3, the last reading the padded row of zero points alone
    from tilegemm.models import pretrained

    if chunked:
        monkeypatch.setattr(pretrained, "CHUNK_WEIGHTS", 1)
    path, config, reference = _odd_head(tmp_path, "compressed-tensors", sym=sym)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_slice("lm_head.weight_packed").get_shape() == [259, 8]
        assert ("lm_head.weight_zero_point" in f.keys()) == (not sym)
        if not sym:
            assert f.get_slice("lm_head.weight_zero_point").get_shape() == [33, 2]
    model = from_pretrained(path, device=device)
    head = model.lm_head
    assert isinstance(head, Int4Linear) and head.out_features == 259
    assert torch.equal(head.dequantize().cpu(), reference["lm_head.weight"])
    if chunked:  # (the same layers as the unchunked case's, whose forward runs)
        assert_loaded_exactly(model, reference)
    else:
        assert _rel(model, cw.reference_model(config, reference)) < 3e-3


def test_compressed_tensors_one_output_layer_loads(tmp_path, device):
    # a one-output Linear (Qwen2-MoE's shared_expert_gate) stored asymmetric: its packed zero points, int32
    # [ceil(1/8), G] = [1, G], have the shape of unpacked ones ([N, G]); read as packed (zero + 8 in nibble 0)
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=False)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        zp = f.get_tensor("model.layers.0.mlp.shared_expert_gate.weight_zero_point")
    assert zp.dtype == torch.int32 and list(zp.shape) == [1, 2] and bool((zp > 7).any())  # packed: zero + 8
    model = from_pretrained(path, device=device)
    gate = model.model.layers[0].mlp.shared_expert_gate
    assert isinstance(gate, Int4Linear) and gate.out_features == 1
    assert torch.equal(gate.dequantize().cpu(), reference["model.layers.0.mlp.shared_expert_gate.weight"])
    assert _rel(model, cw.reference_model(config, reference)) < 3e-3


@pytest.mark.parametrize("method, why", [
    ("gptq", r"GPTQ's format needs: it packs the zero points along the outputs, eight to an int32 "
             r"\(qzeros \[G, N/8\]\)"),
    ("awq", r"AWQ's format needs: it packs the weight and zero points along the outputs, eight to an int32 "
            r"\(qweight \[K, N/8\], qzeros \[G, N/8\]\)")])
def test_gptq_and_awq_output_width_not_a_multiple_of_8_is_refused(tmp_path, method, why):
    # their formats have no partial word along N (the writer pads one only to show the refusal)
    path, _, _ = _odd_head(tmp_path, method)
    with pytest.raises(ValueError, match=r"lm_head: \[out, in\] = \[259, 64\]: out_features 259 is not a multiple of "
                                         r"8, which " + why):
        from_pretrained(path, device="cpu")


def test_compressed_tensors_input_width_not_a_multiple_of_8_is_refused(tmp_path):
    # K stays a multiple of 8 in every format (the kernels read whole words along K): intermediate 100 refuses
    # down_proj (K = 100) alone; gate/up (N = 100) would load
    config = cw.tiny_config("llama", hidden=64, layers=1)
    config.intermediate_size = 100
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "compressed-tensors", -1, sym=False)
    with pytest.raises(ValueError, match=r"down_proj: \[out, in\] = \[64, 100\]: in_features 100 is not a multiple "
                                         r"of 8") as err:
        from_pretrained(path, device="cpu")
    assert "gate_proj" not in str(err.value) and "up_proj" not in str(err.value)


def test_a_saved_model_with_an_odd_output_width_loads(tmp_path, device):
    # tilegemm's own buffers pack along K only: quantize_ takes a head of 259 outputs, and its save loads again
    import warnings

    from tilegemm.nn import quantize_

    config = cw.tiny_config("llama", hidden=64, layers=1, vocab=259)
    model = cw.random_model(config).half().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, group_size=32)
        model.save_pretrained(tmp_path / "saved")
    assert isinstance(model.lm_head, Int4Linear)
    again = from_pretrained(tmp_path / "saved", device=device)
    assert isinstance(again.lm_head, Int4Linear)
    assert torch.equal(again.lm_head.dequantize(), model.lm_head.dequantize())


def _edit_quant_config(path, **changes):
    """Change keys of the checkpoint's quantization_config; a value of None removes the key."""
    cfg = json.loads((path / "config.json").read_text())
    q = cfg["quantization_config"]
    q.update(changes)
    cfg["quantization_config"] = {k: v for k, v in q.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method, autoround, changes", [
    # desc_act "false" read as Python's truth would ask every layer for the g_idx this checkpoint does not store
    ("gptq", False, dict(desc_act="false", sym="True")),
    # AutoRound's AWQ packing with sym "False": read as true, refused as AWQ without zero points
    ("awq", True, dict(sym="False")),
    ("awq", False, dict(zero_point="TRUE")),
    # 0 / 1 (AutoGPTQ's config dataclass saves desc_act=0 as given): as Python reads them, no longer refused
    ("gptq", False, dict(desc_act=0, sym=0)),
    ("awq", False, dict(zero_point=1)),
])
def test_booleans_written_as_strings_load(tmp_path, device, method, autoround, changes):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    source = cw.random_model(config)
    path = tmp_path / "c"
    no_g_idx = [f"{n}.g_idx" for n in cw.linear_names(source)]
    reference = cw.write_model(path, source, method, 32, sym=False, autoround=autoround, drop=no_g_idx)
    _edit_quant_config(path, **changes)
    model = from_pretrained(path, device=device)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7
    assert_loaded_exactly(model, reference)


@pytest.mark.parametrize("method, changes, message", [
    ("gptq", dict(desc_act="no"), r"quantization_config\.desc_act must be true or false, got 'no'"),
    ("gptq", dict(sym=2), r"quantization_config\.sym must be true or false, got 2"),
    ("awq", dict(zero_point="0"), r"quantization_config\.zero_point must be true or false, got '0'"),
    ("gptq", dict(dynamic={r".*down_proj": {"desc_act": "off"}}),
     r"quantization_config\.dynamic\['\.\*down_proj'\]\.desc_act must be true or false, got 'off'"),
    ("compressed-tensors", None, r"config_groups\['group_0'\]\.weights\.symmetric must be true or false, got 'yes'"),
])
def test_booleans_neither_true_nor_false_are_refused_naming_the_key(tmp_path, method, changes, message):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), method, 32, sym=False)
    if changes is None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = "yes"
        (path / "config.json").write_text(json.dumps(cfg))
    else:
        _edit_quant_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("stored_zeros", [True, False])
def test_awq_without_zero_points(tmp_path, device, stored_zeros):
    """GPTQModel's symmetric AWQ (its default): zero_point false, the signed values stored plus 8 with qzeros of 8
    beside them, its keys as it writes them (format and version both); where no qzeros are stored, each zero is 8."""
    config = cw.tiny_config("llama", hidden=64, layers=1)
    source = cw.random_model(config)
    path = tmp_path / "c"
    drop = [] if stored_zeros else [f"{n}.qzeros" for n in cw.linear_names(source)]
    reference = cw.write_model(path, source, "awq", 32, sym=True, drop=drop)
    _edit_quant_config(path, version=None, format="gemm", checkpoint_format="gemm", pack_dtype="int32",
                       desc_act=False, lm_head=False, meta={"quantizer": ["gptqmodel:5.0.0"]})
    assert json.loads((path / "config.json").read_text())["quantization_config"]["zero_point"] is False
    model = from_pretrained(path, device=device)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7
    assert_loaded_exactly(model, reference)


@pytest.mark.parametrize("changes, message", [
    (dict(version=None, format="gemv_fast"), r"quantization_config\.format 'gemv_fast' is not supported; only 'gemm'"),
    (dict(version="GEMV"), r"quantization_config\.version 'GEMV' is not supported; only 'gemm'"),
    (dict(backend="llm-awq"), r"quantization_config\.backend 'llm-awq' is not supported; only 'gemm'"),
])
def test_awq_packings_other_than_gemm_are_refused(tmp_path, changes, message):
    # transformers v5 reads the packing from "format" where "version" is absent, and backend "llm-awq" as its own
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "awq", 32)
    _edit_quant_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("version", ["exllama", "ExllamaV2", "ipex"])
def test_awq_versions_that_store_gemms_layout_load(tmp_path, version):
    # transformers' AwqConfig names the kernel AutoAWQ loads the file into; these three read GEMM's stored tensors
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "awq", 32)
    _edit_quant_config(path, version=version)
    model = from_pretrained(path, device="cpu")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7
    assert_loaded_exactly(model, reference)


@pytest.mark.parametrize("method, autoround, changes, message", [
    # GPTQModel's rotation: an online Hadamard transform of mlp.down_proj's inputs at inference
    ("gptq", False, dict(rotation="hadamard"), r"quantization_config\.rotation 'hadamard': the weights were rotated"),
    ("awq", False, dict(rotation="random"), r"quantization_config\.rotation 'random': the weights were rotated"),
    # AutoRound's Hadamard rotation, kept as rotation buffers beside the layers
    ("gptq", True, dict(rotation_config={"block_size": 32, "hadamard_type": "hadamard"}),
     r"quantization_config\.rotation_config \{'block_size': 32, 'hadamard_type': 'hadamard'\}: the weights were "
     r"rotated, and the model needs the matching transforms of its activations"),
])
def test_rotated_weights_are_refused(tmp_path, method, autoround, changes, message):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), method, 32, autoround=autoround)
    _edit_quant_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        from_pretrained(path, device="cpu")
    # (GPTQModel writes null where there is none; a placeholder string says the same)
    _edit_quant_config(path, rotation="none", rotation_config=None)
    assert sum(isinstance(m, Int4Linear) for m in from_pretrained(path, device="cpu").modules()) == 7


def _restore_zeros(path, word: int) -> None:
    # every stored qzeros word set to `word` (eight equal nibbles), in every weight file
    from safetensors.torch import load_file, save_file

    for file in path.glob("*.safetensors"):
        t = load_file(file)
        for k in t:
            if k.endswith(".qzeros"):
                t[k] = torch.full_like(t[k], word - (1 << 32) if word >= 1 << 31 else word)
        save_file(t, file, metadata={"format": "pt"})


@pytest.mark.parametrize("label, stored", [("gptq", 0x88888888), ("gptq_v2", 0x77777777)],
                         ids=["v1-storing-8", "v2-storing-7"])
def test_symmetric_zeros_stored_in_the_other_formats_convention_load_as_eight(tmp_path, device, label, stored):
    # GPTQModel from v5 writes symmetric checkpoints labelled "gptq" (v1: zero - 1 stored, 7) with the zero itself
    # (8) stored; read as labelled every weight would be one step off. Symmetric means 8: read so, and warned.
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, v2=label == "gptq_v2")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["checkpoint_format"] == label
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checkpoint as written: no warning
        assert_loaded_exactly(from_pretrained(path, device=device), reference)
    _restore_zeros(path, stored)
    with pytest.warns(UserWarning, match=f"labelled checkpoint_format '{label}' stores zeros of {stored & 15}"):
        model = from_pretrained(path, device=device)
    assert_loaded_exactly(model, reference)


def test_the_other_conventions_zeros_warn_once_a_load_and_other_zeros_load_as_stored(tmp_path):
    # one warning for the load, not one a layer; zeros one step off the other way (6 stored under "gptq": 7 read)
    # are not the other convention's and load as stored, unwarned
    config = cw.tiny_config("llama", hidden=64, layers=2)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True)
    _restore_zeros(path, 0x88888888)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert_loaded_exactly(from_pretrained(path, device="cpu"), reference)
    assert sum("stores zeros of 8" in str(w.message) for w in said) == 1
    _restore_zeros(path, 0x66666666)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = from_pretrained(path, device="cpu")
    assert all(bool((m.weight.zeros == 7).all()) for m in model.modules() if isinstance(m, Int4Linear))


def test_asymmetric_zeros_are_read_as_labelled(tmp_path):
    # an asymmetric checkpoint whose zeros happen to be all 9 (stored 8 in v1) is not symmetric: read as stored
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, sym=False)
    _restore_zeros(path, 0x88888888)
    model = from_pretrained(path, device="cpu")
    assert all(bool((m.weight.zeros == 9).all()) for m in model.modules() if isinstance(m, Int4Linear))


@pytest.mark.parametrize("sidecar", [True, False])
def test_shards_named_after_the_quantizers_base_name(tmp_path, device, sidecar):
    # GPTQModel's sharded save with model_file_base_name: gptq_model-4bit-32g-0000i-of-0000n.safetensors and
    # gptq_model-4bit-32g.safetensors.index.json; found through quantize_config.json's model_file_base_name, or
    # as the directory's one index
    config = cw.tiny_config("llama", hidden=64, layers=2)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    base = "gptq_model-4bit-32g"
    for f in shards:
        os.rename(path / f, path / f.replace("model", base, 1))
    index["weight_map"] = {k: v.replace("model", base, 1) for k, v in index["weight_map"].items()}
    (path / f"{base}.safetensors.index.json").write_text(json.dumps(index))
    os.remove(path / "model.safetensors.index.json")
    if sidecar:
        (path / "quantize_config.json").write_text(json.dumps(dict(bits=4, group_size=32, model_file_base_name=base)))
        (path / "adapter.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))  # another's: not read
    assert_loaded_exactly(from_pretrained(path, device=device), reference)


def _base_named(tmp_path):
    """A tiny GPTQ checkpoint whose one weight file has AutoGPTQ's name: (its directory, the writer's reference)."""
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32)
    os.rename(path / "model.safetensors", path / "gptq_model-4bit-32g.safetensors")
    return path, reference


def test_the_file_the_base_name_names_beside_other_safetensors_files(tmp_path, device):
    # one base-named weight file beside an unrelated one (an adapter): quantize_config.json says which holds the model
    path, reference = _base_named(tmp_path)
    (path / "adapter_model.safetensors").write_bytes((path / "gptq_model-4bit-32g.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="which tensor is where needs the index"):
        from_pretrained(path, device="cpu")
    (path / "quantize_config.json").write_text(json.dumps(dict(bits=4, group_size=32,
                                                               model_file_base_name="gptq_model-4bit-32g")))
    assert_loaded_exactly(from_pretrained(path, device=device), reference)


def test_a_lone_weight_file_of_another_name_is_read_before_an_index_of_another_name(tmp_path, device):
    # an older quantizer's one weight file beside another model's index (a draft model's): the whole file is read;
    # and a settings file that is not JSON, left beside a config.json holding the settings, is not in the way
    path, reference = _base_named(tmp_path)
    (path / "draft_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "draft-00001-of-00002.safetensors"}}))
    (path / "quantize_config.json").write_text("{not json")
    assert_loaded_exactly(from_pretrained(path, device=device), reference)


def test_a_whole_weight_file_is_read_before_an_index_beside_it(tmp_path, device):
    # as transformers reads them: model.safetensors first; an index left beside it (its shards gone) is not read
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    assert_loaded_exactly(from_pretrained(path, device=device), reference)


def test_plain_tensors_past_fp16s_range_are_warned_of(tmp_path):
    # a bf16 or fp32 checkpoint's plain tensor (an lm_head value of 1e5) loaded in fp16 is inf, as transformers'
    # load makes it: said, naming the tensor and the dtype to load with (the 4-bit layers' scales are refused)
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    stored = load_file(path / "model.safetensors")
    stored["lm_head.weight"] = stored["lm_head.weight"].float()
    stored["lm_head.weight"][0, 0] = 1e5
    stored["model.norm.weight"] = stored["model.norm.weight"].float()  # in range: not named
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) of the checkpoint hold values past fp16's range, now inf: "
                                         r"lm_head\.weight; load with dtype=torch\.bfloat16"):
        model = from_pretrained(path, device="cpu")
    assert torch.isinf(model.lm_head.weight[0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isfinite(from_pretrained(path, dtype=torch.bfloat16, device="cpu").lm_head.weight).all()
