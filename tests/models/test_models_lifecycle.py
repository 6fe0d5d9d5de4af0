"""A quantized transformers model through its life: dtype conversions of 4-bit experts, dequantized copies,
tied output layers, save_pretrained, and loading a checkpoint into a model quantized already; checked against
plain-torch models holding the weights (the tests' own writer, ckpt_writer.py). The models that run kernels go to the
``device`` fixture's device (the CPU under the interpreter, the GPU otherwise); the plain-torch references stay on the
CPU."""

from __future__ import annotations

import copy
import io
import os
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

from conftest import hide_broken_torchvision  # noqa: E402

hide_broken_torchvision()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.models.pretrained import dequantized_copy  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_, quantize_  # noqa: E402

IDS = torch.tensor([[3, 17, 200, 5, 96]])
TOL = 3e-3  # fp16 activations through the 4-bit layers against a model computing in fp32
_interface = getattr(pytest.importorskip("transformers.integrations.moe"), "ALL_EXPERTS_FUNCTIONS", None)


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()  # (a model on the GPU against a reference on the CPU)
    return float((a - b).norm() / b.norm())


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids.to(model.device)).logits


def _snapshot(model) -> dict:
    """What a model computes from: the module type under every name and each state-dict tensor (a copy)."""
    return dict(types=[(n, type(m)) for n, m in model.named_modules()],
                tensors={k: v.detach().clone() for k, v in model.state_dict().items()})


def _assert_same_state(model, other) -> None:
    """``other`` holds what ``model`` (or a :func:`_snapshot` of one) holds: module types, every state-dict tensor
    (names, dtypes, values); so it computes the same logits, compared without running both under the interpreter."""
    a, b = model if isinstance(model, dict) else _snapshot(model), _snapshot(other)
    assert dict(b["types"]) == dict(a["types"])
    assert sorted(b["tensors"]) == sorted(a["tensors"])
    for name, t in a["tensors"].items():
        assert b["tensors"][name].dtype == t.dtype and torch.equal(b["tensors"][name], t), name


def _eager_copy(model):
    """The plain-torch model of the same weights (experts run by transformers' eager loop): a reference that
    costs no kernel launch."""
    dense = dequantized_copy(model)
    if hasattr(dense, "set_experts_implementation"):
        dense.set_experts_implementation("eager")
    return dense


# --- 4-bit experts under .float() / .half() -----------------------------------------------------------------


@pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface (transformers >= 5)")
def test_moe_experts_scales_stay_16_bit_under_float(device):
    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm")
    model = model.eval().to(torch.bfloat16).to(device)
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    experts = model.model.layers[0].mlp.experts
    assert experts.tilegemm_gate_up_proj_scales.dtype == torch.bfloat16
    dense = dequantized_copy(model)  # what the 4-bit model computes, as plain torch
    dense.set_experts_implementation("eager")
    reference = _logits(dense.float())

    twin = copy.deepcopy(model)  # the guard follows the copy, not the original
    model.float()
    scale_dtypes = {n: b.dtype for n, b in experts.named_buffers() if n.endswith(("_scales", "_zeros"))}
    assert set(scale_dtypes.values()) == {torch.bfloat16}, scale_dtypes
    assert model.model.embed_tokens.weight.dtype == torch.float32
    out = _logits(model)
    assert out.dtype == torch.float32 and _rel(out, reference) < 2e-2  # (activations rounded to bf16)
    assert twin.model.layers[0].mlp.experts.tilegemm_gate_up_proj_scales.dtype == torch.bfloat16
    twin.half()  # 16-bit conversions do convert them
    assert twin.model.layers[0].mlp.experts.tilegemm_down_proj_scales.dtype == torch.float16
    assert _rel(_logits(twin), reference) < 2e-2  # (bf16 scales rounded to fp16)
    buf = io.BytesIO()  # the whole model pickles with its guard
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    again.half().float()
    assert again.model.layers[0].mlp.experts.tilegemm_gate_up_proj_scales.dtype == torch.float16
    # its experts hold the half copy's fp16 scales (whose logits are checked above), kept so under .float()
    for name, b in twin.model.layers[0].mlp.experts.named_buffers():
        assert torch.equal(again.model.layers[0].mlp.experts.get_buffer(name), b), name
    assert again.model.embed_tokens.weight.dtype == torch.float32


# --- dequantized_copy ---------------------------------------------------------------------------------------


def test_dequantized_copy_of_an_fp32_model_is_fp32(device):
    model = cw.random_model(cw.tiny_config("llama", hidden=64, layers=1)).to(device)  # fp32, as from_config builds it
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    dense = dequantized_copy(model)
    assert {p.dtype for p in dense.parameters()} == {torch.float32}
    q = model.model.layers[0].self_attn.q_proj
    assert torch.equal(dense.model.layers[0].self_attn.q_proj.weight, q.dequantize().float())
    assert _rel(_logits(model), _logits(dense)) < TOL  # the 4-bit model rounds its activations to fp16
    assert dense.config is not model.config  # settings changed on the copy stay there
    dense.config.use_cache = not model.config.use_cache
    assert dense.config.use_cache != model.config.use_cache


def _bert():
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=256, d_model=64, d_kv=32, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0))


def _llama_classifier():
    config = cw.tiny_config("llama", hidden=64, layers=1)
    config.num_labels, config.pad_token_id = 3, 0
    return transformers.LlamaForSequenceClassification(config)


@pytest.mark.parametrize("build, kwargs, output", [
    (_bert, {}, "last_hidden_state"),
    (_t5, {"decoder_input_ids": IDS[:, :3]}, "logits"),
    (_llama_classifier, {}, "logits"),
])
def test_dequantized_copy_of_a_model_that_is_not_a_causal_lm_is_of_its_class(build, kwargs, output, device):
    # not every quantized transformers model is a causal LM: the copy is the model's own class, outputs alike
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build().float().eval().to(device)
    _quiet(quantize_, model, group_size=32)
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    dense = dequantized_copy(model)
    assert type(dense) is type(model)
    assert not any(isinstance(m, Int4Linear) for m in dense.modules())
    ids, kwargs = IDS.to(device), {k: v.to(device) for k, v in kwargs.items()}
    with torch.no_grad():
        out, ref = model(ids, **kwargs)[output], dense(ids, **kwargs)[output]
    assert out.shape == ref.shape and _rel(out, ref) < TOL


# --- tied output layers and save_pretrained ----------------------------------------------------------------


def test_quantizing_a_tied_lm_head_unties_it_in_the_config(tmp_path, device):
    from safetensors.torch import load_file

    model = cw.random_model(cw.tiny_config("llama", hidden=64, layers=1, tie=True)).half().to(device)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _quiet(quantize_, model, group_size=32)
    assert isinstance(model.lm_head, Int4Linear) and model.config.tie_word_embeddings is False
    held = _snapshot(model)
    model.tie_weights()  # a no-op now, not a KeyError
    _assert_same_state(held, model)  # (the same logits)
    before = _logits(model)
    # saved, then loaded into a model of the saved config quantized alike: the same logits
    _quiet(model.save_pretrained, tmp_path)
    again = transformers.AutoModelForCausalLM.from_config(
        _quiet(transformers.AutoConfig.from_pretrained, tmp_path)).half().eval().to(device)
    assert again.config.tie_word_embeddings is False
    _quiet(quantize_, again, group_size=32)
    again.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert torch.equal(_logits(again), before)


def test_loaded_tied_checkpoint_with_a_quantized_lm_head_unties(tmp_path, monkeypatch, device):
    # a checkpoint that stores lm_head quantized though its config says tied: loaded untied, tie_weights() keeps it
    import json

    names = cw.linear_names
    monkeypatch.setattr(cw, "linear_names", lambda model, quantize_lm_head=False, not_convert=():
                        names(model, True, not_convert))
    config = cw.tiny_config("llama", hidden=64, layers=1, tie=False)
    reference = cw.write_model(tmp_path, cw.random_model(config), "gptq", 32)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(saved))
    model = _quiet(from_pretrained, tmp_path, device=device)
    assert isinstance(model.lm_head, Int4Linear) and model.config.tie_word_embeddings is False
    model.tie_weights()
    assert _rel(_logits(model), _logits(cw.reference_model(config, reference))) < TOL


_RESIZE_REFUSED = (r"resize_token_embeddings\(300\): the output layer of this LlamaForCausalLM is a "
                   r"tilegemm.nn.Int4Linear \(4-bit, out_features=256\), which transformers cannot resize; resize the "
                   r"token embeddings before quantizing")


def _check_resize_refused(model):
    before, embed, head = _snapshot(model), model.get_input_embeddings(), model.lm_head
    with pytest.raises(ValueError, match=_RESIZE_REFUSED):
        model.resize_token_embeddings(300)
    with pytest.raises(ValueError, match=r"resize_token_embeddings\(264\).*Int4Linear"):
        model.resize_token_embeddings(260, pad_to_multiple_of=8)
    # refused before anything changed: the embedding, the config and the outputs are as they were
    assert model.get_input_embeddings() is embed and embed.weight.shape[0] == 256
    assert model.config.vocab_size == 256 and model.lm_head is head and head.out_features == 256
    _assert_same_state(before, model)  # (so the outputs are as they were)
    # calls that change nothing return the input embedding, as transformers documents
    assert model.resize_token_embeddings() is embed and model.resize_token_embeddings(256) is embed
    assert model.resize_token_embeddings(250, pad_to_multiple_of=64) is embed
    assert copy.deepcopy(model).resize_token_embeddings() is not embed  # a copy's guard reads the copy
    with pytest.raises(ValueError, match=_RESIZE_REFUSED):
        copy.deepcopy(model).resize_token_embeddings(300)


@pytest.mark.parametrize("tie", [False, True])
def test_resize_token_embeddings_of_a_4_bit_lm_head_is_refused_clearly(tie, device):
    model = cw.random_model(cw.tiny_config("llama", hidden=64, layers=1, tie=tie)).half().to(device)
    _quiet(quantize_, model, group_size=32)
    assert isinstance(model.lm_head, Int4Linear)
    _check_resize_refused(model)


def test_resize_token_embeddings_of_a_loaded_4_bit_lm_head_is_refused_clearly(tmp_path, monkeypatch, device):
    names = cw.linear_names  # a checkpoint that stores lm_head quantized
    monkeypatch.setattr(cw, "linear_names", lambda model, quantize_lm_head=False, not_convert=():
                        names(model, True, not_convert))
    cw.write_model(tmp_path, cw.random_model(cw.tiny_config("llama", hidden=64, layers=1)), "gptq", 32)
    model = _quiet(from_pretrained, tmp_path, device=device)
    assert isinstance(model.lm_head, Int4Linear)
    _check_resize_refused(model)


def test_resize_token_embeddings_with_a_16_bit_lm_head_resizes_as_transformers_does(device):
    model = cw.random_model(cw.tiny_config("llama", hidden=64, layers=1)).half().to(device)
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    _quiet(model.resize_token_embeddings, 264)
    assert model.get_input_embeddings().weight.shape[0] == 264 and model.lm_head.out_features == 264
    assert model.config.vocab_size == 264
    # (three tokens: the interpreter runs one or two rows through its slower one-row kernel)
    assert _logits(model, torch.tensor([[3, 17, 263]])).shape == (1, 3, 264)


def test_save_pretrained_of_a_loaded_model_is_not_a_gptq_checkpoint(tmp_path, device):
    from safetensors.torch import load_file

    config = cw.tiny_config("llama", hidden=64, layers=1)
    cw.write_model(tmp_path / "ckpt", cw.random_model(config), "gptq", 32, act_order=True)
    model = _quiet(from_pretrained, tmp_path / "ckpt", device=device)
    q = model.config.quantization_config
    assert q["quant_method"] == "tilegemm" and q["group_size"] == 32 and q["converted_from"] == "gptq"
    _quiet(model.save_pretrained, tmp_path / "saved")
    stored = load_file(tmp_path / "saved" / "model.safetensors")
    assert "model.layers.0.mlp.up_proj.zeros" in stored and "model.layers.0.mlp.up_proj.qzeros" not in stored
    # from_pretrained takes it back in one call: the same layers (act-order orders too), the same logits
    again = from_pretrained(tmp_path / "saved", device=device)
    assert again.config.quantization_config == q  # what it was converted from is kept
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            other = again.get_submodule(name)
            assert isinstance(other, Int4Linear) and torch.equal(other.perm, m.perm)
            assert other.perm.numel() == other.in_features
            assert torch.equal(other.dequantize(), m.dequantize()), name
    _assert_same_state(model, again)  # (so the same logits)
    logits = _logits(model)
    # and the way documented before: a model of the saved config, quantized alike, given the saved tensors
    built = transformers.AutoModelForCausalLM.from_config(
        _quiet(transformers.AutoConfig.from_pretrained, tmp_path / "saved")).half().eval().to(device)
    _quiet(quantize_, built, group_size=32, filter=lambda n, m: "lm_head" not in n)
    built.load_state_dict(stored)
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            assert torch.equal(built.get_submodule(name).dequantize(), m.dequantize()), name
    assert _rel(_logits(built), logits) < TOL  # (its rotary tables rounded by .half())
    dense = dequantized_copy(model)  # the dense copy claims no quantization
    assert getattr(dense.config, "quantization_config", None) is None


@pytest.mark.parametrize("tie", [False, True])
def test_a_quantized_model_saved_loads_in_one_call(tmp_path, device, tie):
    """quantize_ (group 64, lm_head included when tied: then untied), save_pretrained in shards, from_pretrained:
    every 4-bit layer and tensor as it was; the logits of the plain-torch model of the original's weights within
    fp16's error."""
    config = cw.tiny_config("llama", hidden=128, layers=1, tie=tie)
    model = cw.random_model(config).half().to(device)
    _quiet(quantize_, model, group_size=64, filter=None if tie else (lambda n, m: "lm_head" not in n))
    _quiet(model.save_pretrained, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    again = from_pretrained(tmp_path, device=device)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 7 * config.num_hidden_layers + tie and isinstance(again.lm_head, Int4Linear) == tie
    for name, m in layers.items():
        other = again.get_submodule(name)
        assert other.group_size == 64 and torch.equal(other.dequantize(), m.dequantize()), name
    assert "converted_from" not in again.config.quantization_config
    _assert_same_state(model, again)
    assert _rel(_logits(again), _logits(_eager_copy(model))) < TOL


def test_a_quantized_encoder_decoder_keeps_its_shared_embeddings_when_saved_and_loaded(tmp_path, device):
    """BART ties its encoder's and decoder's embeddings to one shared embedding and its output layer to it: the 4-bit
    output layer is untied (tie_word_embeddings False), which in transformers >= 5 unties the embeddings of a model
    built from that config too, and save_pretrained writes the shared one only. The saved config lists the tied
    names, so the loaded model holds one embedding under the three names again (it lacked the encoder's and the
    decoder's) and gives the same logits, saved and loaded a second time too."""
    config = transformers.AutoConfig.for_model(
        "bart", d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).half().to(device).eval()
    _quiet(quantize_, model, group_size=32)
    assert isinstance(model.lm_head, Int4Linear)
    ids = torch.randint(0, 128, (2, 6), device=device)
    with torch.no_grad():
        want = model(input_ids=ids, decoder_input_ids=ids).logits
    for step in range(2):
        _quiet(model.save_pretrained, tmp_path / str(step))
        model = from_pretrained(tmp_path / str(step), device=device, model_class=transformers.AutoModelForSeq2SeqLM)
        shared = model.model.shared.weight
        assert model.model.encoder.embed_tokens.weight is shared and model.model.decoder.embed_tokens.weight is shared
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, decoder_input_ids=ids).logits, want), step


def test_a_saved_config_with_malformed_tied_names_is_named(tmp_path):
    import json

    config = cw.tiny_config("llama", hidden=64, layers=1, tie=True)
    model = cw.random_model(config).half()
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    assert model.config.quantization_config["tied_parameters"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    _quiet(model.save_pretrained, tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    stored["quantization_config"]["tied_parameters"] = "lm_head.weight"
    (tmp_path / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="tied_parameters must be a list of lists of parameter names"):
        from_pretrained(tmp_path, device="cpu")


def test_a_saved_model_with_wrong_shapes_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("llama", hidden=64, layers=1)
    model = cw.random_model(config).half()
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    _quiet(model.save_pretrained, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    stored["model.layers.0.mlp.up_proj.scales"] = stored["model.layers.0.mlp.up_proj.scales"][:1].repeat(3, 1)
    del stored["model.layers.0.mlp.down_proj.zeros"]
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.scales: the checkpoint's shape \[3, 128\] does not match "
                                         r"\[1, 128\] or \[2, 128\]"):
        from_pretrained(tmp_path, device="cpu")
    stored["model.layers.0.mlp.up_proj.scales"] = stored["model.layers.0.mlp.up_proj.scales"][:2]
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) the model needs: model.layers.0.mlp.down_proj.zeros"):
        from_pretrained(tmp_path, device="cpu")


@pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface (transformers >= 5)")
@pytest.mark.parametrize("source", ["quantize_", "gptq-act-order"])
def test_a_saved_moe_model_loads_in_one_call(tmp_path, device, source):
    """4-bit experts saved as tilegemm's stacked buffers (group 32; act-order experts with their orders) load back
    into the block as they were."""
    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)
    if source == "quantize_":
        model = cw.random_model(config).half().to(device)
        _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    else:
        cw.write_model(tmp_path / "ckpt", cw.random_model(config), "gptq", 32, act_order=True)
        model = _quiet(from_pretrained, tmp_path / "ckpt", device=device)
    _quiet(model.save_pretrained, tmp_path / "saved")
    again = from_pretrained(tmp_path / "saved", device=device)
    block, other = model.model.layers[0].mlp.experts, again.model.layers[0].mlp.experts
    assert other.tilegemm_group_sizes == block.tilegemm_group_sizes == {"gate_up_proj": 32, "down_proj": 32}
    assert again.config._experts_implementation == "tilegemm"
    for part in ("qweight", "scales", "zeros"):
        for w in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(other, f"tilegemm_{w}_{part}"), getattr(block, f"tilegemm_{w}_{part}"))
    perm = getattr(block, "tilegemm_gate_up_proj_perm", None)
    assert (perm is not None) == (source != "quantize_")
    if perm is not None:
        assert torch.equal(other.tilegemm_gate_up_proj_perm, perm)
    _assert_same_state(model, again)
    assert _rel(_logits(again), _logits(_eager_copy(model))) < TOL


def _llama4_config():
    return transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        num_local_experts=3, num_experts_per_tok=1, intermediate_size_mlp=128, head_dim=16, attention_chunk_size=64)


@pytest.mark.parametrize("source", ["quantize_", "gptq-act-order"])
def test_a_saved_llama4_model_loads_in_one_call(tmp_path, device, source):
    """Llama-4's experts run in tilegemm's block for it (4-bit, stacked): saved as its buffers, they load back into
    that block, not into transformers' block whose forward reads 16-bit weights."""
    if "llama4_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no llama4_text")
    config = _llama4_config()
    if source == "quantize_":
        model = cw.random_model(config).half().to(device)
        _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n and "router" not in n)
    else:
        not_convert = [n for n, m in cw.random_model(config).named_modules() if n.endswith("router")]
        cw.write_model(tmp_path / "ckpt", cw.random_model(config), "gptq", 32, act_order=True,
                       not_convert=not_convert)
        model = _quiet(from_pretrained, tmp_path / "ckpt", device=device)
    block = model.model.layers[0].feed_forward
    assert type(block).__name__ == "Llama4MoeBlock"
    _quiet(model.save_pretrained, tmp_path / "saved")
    again = from_pretrained(tmp_path / "saved", device=device)
    other = again.model.layers[0].feed_forward
    assert type(other).__name__ == "Llama4MoeBlock"
    for part in ("qweight", "scales", "zeros"):
        for w in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(other.experts, f"tilegemm_{w}_{part}"),
                               getattr(block.experts, f"tilegemm_{w}_{part}"))
    _assert_same_state(model, again)
    assert _rel(_logits(again), _logits(_eager_copy(model))) < TOL


@pytest.mark.parametrize("kind", ["dbrx", "jetmoe"])
def test_saved_dbrx_and_jetmoe_models_load_in_one_call(tmp_path, device, kind):
    """DBRX's and JetMoE's experts run in tilegemm's blocks for them (convert_ and quantize_ make those): saved as
    their stacked buffers, they load back into those blocks (the loader took Llama-4's only)."""
    if kind not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {kind}")
    if kind == "dbrx":
        config = transformers.AutoConfig.for_model(
            "dbrx", d_model=32, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=64,
            attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))
    else:
        config = transformers.AutoConfig.for_model(
            "jetmoe", hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_key_value_heads=2,
            kv_channels=16, vocab_size=64, num_local_experts=4, num_experts_per_tok=2)
    model = cw.random_model(config).half().to(device)
    _quiet(quantize_, model, group_size=32)
    _quiet(model.save_pretrained, tmp_path / "saved")
    again = _quiet(from_pretrained, tmp_path / "saved", device=device)
    _assert_same_state(model, again)
    ids = torch.tensor([[3, 17, 40]])
    assert torch.equal(_logits(again, ids), _logits(model.eval(), ids))


def test_one_group_layers_keep_their_group_size_when_saved_and_loaded(tmp_path, device):
    """A layer stored as one group was quantized with group_size -1 or with its own K: the saved config's group
    sizes say which, so each layer, each experts weight and the config come back as they were."""
    model = cw.random_model(cw.tiny_config("llama", hidden=64, layers=1)).half().to(device)
    _quiet(quantize_, model, group_size=-1, filter=lambda n, m: "lm_head" not in n)
    _quiet(model.save_pretrained, tmp_path / "linears")
    again = from_pretrained(tmp_path / "linears", device=device)
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            assert again.get_submodule(name).group_size == m.group_size == -1, name
    assert again.config.quantization_config["group_size"] == model.config.quantization_config["group_size"] == -1
    if _interface is None:
        return
    # experts whose down projection (K = 32) is below the group size: one group, -1; gate_up (K = 64) keeps 64
    moe = cw.random_model(cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)).half().to(device)
    _quiet(quantize_, moe, group_size=64, filter=lambda n, m: "lm_head" not in n)
    _quiet(moe.save_pretrained, tmp_path / "moe")
    again = from_pretrained(tmp_path / "moe", device=device)
    block, other = moe.model.layers[0].mlp.experts, again.model.layers[0].mlp.experts
    assert other.tilegemm_group_sizes == block.tilegemm_group_sizes == {"gate_up_proj": 64, "down_proj": -1}
    assert again.model.layers[0].self_attn.q_proj.group_size == 64
    assert again.config.quantization_config["group_size"] == moe.config.quantization_config["group_size"]
    _assert_same_state(moe, again)  # (so the same logits)


# --- load_quantized_ into a model quantized already -------------------------------------------------------------


@pytest.mark.parametrize("built_group", [32, 64])
def test_load_quantized_into_a_quantized_model_rebuilds_its_int4_layers(tmp_path, built_group, device):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    reference = cw.write_model(tmp_path, cw.random_model(config), "gptq", 32, act_order=True)
    model = cw.random_model(config, seed=2).half().to(device)
    _quiet(quantize_, model, group_size=built_group, filter=lambda n, m: "lm_head" not in n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stored tensor is skipped
        warnings.filterwarnings("ignore", category=UserWarning, message=".*interpreter.*")
        load_quantized_(model, tmp_path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 7
    for name, layer in layers.items():  # each layer is the checkpoint's (act-order: g_idx read, perm made)
        assert layer.group_size == 32 and layer.perm.numel() == layer.in_features, name
        assert torch.equal(layer.dequantize().float().cpu(), reference[f"{name}.weight"].float()), name
    assert _rel(_logits(model), _logits(cw.reference_model(config, reference))) < TOL


def test_load_quantized_refuses_a_16_bit_layer_into_an_int4_one(tmp_path, device):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    cw.write_model(tmp_path, cw.random_model(config), "gptq", 32, not_convert=("o_proj",))
    model = cw.random_model(config, seed=2).half().to(device)
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj is an Int4Linear \(the model was quantized "
                                         r"already\) but the checkpoint stores it 16-bit"):
        load_quantized_(model, tmp_path)
    _assert_same_state(before, model)  # refused before anything changed


def test_load_quantized_refuses_a_model_with_joined_projections(tmp_path, device):
    """A model whose projections fuse_projections_ joined is refused, naming the joined parts and what to do, before
    anything changes (its joined product is no layer the checkpoint stores)."""
    from tilegemm.nn import fuse_projections_

    config = cw.tiny_config("llama", hidden=64, layers=1)
    model = cw.random_model(config).half().to(device)
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    _quiet(model.save_pretrained, tmp_path)
    fuse_projections_(model)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"\(model.layers.0.self_attn: q_proj, k_proj, v_proj; model.layers.0.mlp: "
                                         r"gate_proj, up_proj\) by tilegemm.nn.fuse_projections_.*load the "
                                         r"checkpoint before joining"):
        load_quantized_(model, tmp_path)
    _assert_same_state(before, model)


@pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface (transformers >= 5)")
def test_load_quantized_into_quantized_moe_experts_rebuilds_them(tmp_path, device):
    from tilegemm.nn import moe
    from tilegemm.ops.w4a16 import dequantize

    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)
    reference = cw.write_model(tmp_path, cw.random_model(config), "gptq", 32, sym=True)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm")
    model = model.eval().half().to(device)
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    block = model.model.layers[0].mlp.experts
    assert "gate_up_proj" not in block._parameters
    _quiet(load_quantized_, model, tmp_path)
    for w in ("gate_up_proj", "down_proj"):  # the checkpoint's experts, not those quantize_ made
        assert torch.equal(dequantize(moe._int4(block, w)).cpu(), reference[f"model.layers.0.mlp.experts.{w}"])
    ref = cw.reference_model(copy.deepcopy(config), reference)  # (a config of its own: eager there only)
    ref.set_experts_implementation("eager")
    assert _rel(_logits(model), _logits(ref)) < TOL


@pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface (transformers >= 5)")
def test_load_quantized_of_a_saved_moe_model_into_experts_of_another_group_size(tmp_path, device):
    """A directory tilegemm saved (act-order experts, group 32) loads into a model quantized with group 64: its
    experts are rebuilt as saved (their 4-bit buffers are not checked or loaded as the model's plain tensors)."""
    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)
    cw.write_model(tmp_path / "ckpt", cw.random_model(config), "gptq", 32, act_order=True)
    saved = _quiet(from_pretrained, tmp_path / "ckpt", device=device)
    _quiet(saved.save_pretrained, tmp_path / "saved")
    with torch.random.fork_rng():
        torch.manual_seed(2)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm")
    model = model.eval().half().to(device)
    _quiet(quantize_, model, group_size=64, filter=lambda n, m: "lm_head" not in n)
    _quiet(load_quantized_, model, tmp_path / "saved")
    block, other = saved.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    assert other.tilegemm_group_sizes == block.tilegemm_group_sizes
    for name, t in block.named_buffers():
        if name.endswith(("_qweight", "_scales", "_zeros", "_perm")):
            assert torch.equal(getattr(other, name), t), name
    _assert_same_state(saved, model)
    assert _rel(_logits(model), _logits(_eager_copy(saved))) < TOL


@pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface (transformers >= 5)")
def test_load_quantized_refuses_16_bit_experts_into_4_bit_ones(tmp_path):
    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32, experts=3)
    cw.write_model(tmp_path, cw.random_model(config), "gptq", 32, dense_experts=("model.layers.0.mlp.experts",))
    with torch.random.fork_rng():
        torch.manual_seed(2)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm")
    model = model.eval().half()
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts holds 4-bit experts \(the model was quantized "
                                         r"already\) but the checkpoint stores them 16-bit"):
        load_quantized_(model, tmp_path)
