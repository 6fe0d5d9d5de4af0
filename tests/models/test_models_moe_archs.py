"""MoE architectures whose checkpoints or quantization met a case of their own (tiny configs, random weights): a
per-expert GPTQ checkpoint written by the tests' writer under the model's own tensor names loads with
from_pretrained into stacked 4-bit experts, and each experts block matches, on the same inputs, the fp32 block
holding the weights the checkpoint stands for; tensors the model keeps in fp32 stay fp32. Also Jamba quantized
whole (its dt_proj a 4-bit layer) and Doge's retrieval experts, which convert_ and quantize_ name."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch

from moe_kit import needs_experts_interface, transformers_or_skip

transformers = transformers_or_skip()
pytestmark = needs_experts_interface()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

import tilegemm.nn  # noqa: E402
import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.nn.convert import ConversionNote  # noqa: E402
from tilegemm.nn.int4 import _router_ids  # noqa: E402
from tilegemm.ops.w4a16 import dequantize  # noqa: E402

IDS = torch.tensor([[3, 17, 100, 5, 96, 42]])
_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
             max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, n_group=1, topk_group=1, n_routed_experts=4)

# (model type, config values over _BASE, auto class, what it checks): one decoder layer where every layer is of
# one kind (each layer of a forward under the interpreter costs as much as the first), else _BASE's two
ARCHS = {
    # a norm transformers renames from the released checkpoints' layer-level name into mlp.: stored under the
    # model's own name, it was renamed a second time (mlp.mlp.post_mlp_layernorm) and reported missing
    "axk1": ("axk1", dict(_MLA, mlp_layer_types=["sparse"], num_hidden_layers=1), "AutoModelForCausalLM"),
    # model.norm was renamed to model.kv_norm; its norms are kept in fp32 (_keep_in_fp32_modules_strict). One
    # layer, of the attention whose Linears and norms are those of heavily_compressed_attention and its indexer's
    "deepseek_v4": ("deepseek_v4", dict(n_routed_experts=4, moe_intermediate_size=64, q_lora_rank=32,
                                        qk_rope_head_dim=16, o_lora_rank=32, sliding_window=16, index_head_dim=16,
                                        index_n_heads=2, index_topk=8, mlp_layer_types=["moe"],
                                        layer_types=["compressed_sparse_attention"], num_hidden_layers=1),
                    "AutoModelForCausalLM"),
    # each expert's Linears (layers.0.mlp.experts.0.gate_proj ...) were renamed into mlp.mlp.experts
    "mistral_large4": ("mistral_large4_text", dict(_MLA, first_k_dense_replace=0, index_head_dim=16, index_n_heads=2,
                                                   index_topk=8, mlp_layer_types=["sparse"], num_hidden_layers=1),
                       "AutoModel"),
    # a router weight the model declares fp32 and multiplies by fp32 activations: it was loaded fp16 and failed
    "inkling2": ("inkling2_text", dict(n_routed_experts=4, moe_intermediate_size=64, sliding_window_size=16,
                                       swa_head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                                       num_hidden_layers=1), "AutoModelForCausalLM"),
    # experts without a gate (up_proj, down_proj), stored one up/down Linear an expert
    "nemotron_h": ("nemotron_h", dict(n_routed_experts=4, moe_shared_expert_intermediate_size=32, mamba_head_dim=16,
                                      mamba_num_heads=4, ssm_state_size=16, chunk_size=16, n_groups=1,
                                      layer_types=["full_attention", "moe"]), "AutoModelForCausalLM"),
    # experts without a gate held transposed ([E, in, out])
    "ergo": ("ergo", dict(num_experts=4, shared_intermediate_size=32, first_dense_intermediate_size=64,
                          sliding_window=16, mlp_layer_types=["sparse"], num_hidden_layers=1), "AutoModelForCausalLM"),
    # its router (mlp.gate.weight) and e_score_correction_bias load fp32, as transformers loads them
    "deepseek_v3": ("deepseek_v3", dict(_MLA, first_k_dense_replace=0, num_hidden_layers=1), "AutoModelForCausalLM"),
}


def _config(model_type: str, values: dict):
    cls = transformers.models.auto.configuration_auto.CONFIG_MAPPING[model_type]
    known = cls().to_dict()
    aliases = getattr(cls, "attribute_map", {})
    kw = {}
    for k, v in {**_BASE, **values}.items():
        name = k if k in known else aliases.get(k)
        if name in known:
            kw[name] = v
    return cls(**kw)


def _model(arch: str):
    model_type, values, auto = ARCHS[arch]
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = _config(model_type, values)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, auto).from_config(config).float().eval()
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # experts large enough to matter (transformers' initialisation leaves them tiny)
            for name, p in model.named_parameters():
                if p.dim() == 3:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model, auto


def _kept_16_bit(model) -> list[str]:
    """What a quantizer leaves 16-bit: the routers, and the Linears 4-bit packing in groups of 32 cannot take."""
    routers = _router_ids(model)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and (id(m) in routers or m.out_features % 8 or m.in_features % 32)]


def _out(model, ids):
    out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _recording_blocks(model) -> tuple[dict, list]:
    """(inputs and output of each 4-bit experts block of ``model`` by name, filled as it runs; the hooks)."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if hasattr(m, "tilegemm_group_size"):
            hooks.append(m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(
                name, ([a.clone() if isinstance(a, torch.Tensor) else a for a in args], out))))
    return seen, hooks


def _blocks_against(seen: dict, ref) -> dict:
    """Each recorded 4-bit experts block against the same block of ``ref`` run on its inputs (in fp32): rel. error
    by name."""
    with torch.no_grad():
        return {name: _rel(out, ref.get_submodule(name)(*[a.float() if isinstance(a, torch.Tensor)
                                                           and a.is_floating_point() else a for a in args]))
                for name, (args, out) in seen.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_checkpoint_loads(tmp_path, device, arch, monkeypatch):
    source, auto = _model(arch)
    reference = cw.write_model(tmp_path, source, "gptq", group_size=32, sym=True, not_convert=_kept_16_bit(source))
    model = from_pretrained(tmp_path, device=device,
                            model_class=None if auto == "AutoModelForCausalLM" else getattr(transformers, auto))
    blocks = [n for n, m in model.named_modules() if hasattr(m, "tilegemm_group_size")]
    assert blocks == [n for n, _ in moe._experts_modules(source)]  # every block's experts stacked 4-bit
    for name in blocks:
        block = model.get_submodule(name)
        for w in ("gate_up_proj", "up_proj", "down_proj"):
            w4 = moe._int4(block, w)
            if w4 is not None:
                want = reference[f"{name}.{w}"]
                want = want.transpose(1, 2) if getattr(block, "is_transposed", False) else want
                assert torch.equal(dequantize(w4).cpu(), want), (name, w)
    # what the model keeps in fp32 (transformers' _keep_in_fp32_modules_strict, or declared so) loads in fp32
    declared = {n: p.dtype for n, p in [*source.named_parameters(), *source.named_buffers()]}
    fp32 = {n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype == torch.float32}
    if arch == "deepseek_v3":
        assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate.e_score_correction_bias"} <= fp32
        assert model.model.layers[0].input_layernorm.weight.dtype == torch.float16  # (not listed: dtype)
    if arch == "deepseek_v4":
        assert "model.norm.weight" in fp32
    if arch == "inkling2":
        assert "model.layers.0.mlp.gate.weight" in fp32 and declared["model.layers.0.mlp.gate.weight"] == torch.float32
    calls = []
    project = moe._project
    monkeypatch.setattr(moe, "_project", lambda *a: calls.append(a[1]) or project(*a))
    ids = IDS.to(device)
    seen, hooks = _recording_blocks(model)
    with torch.no_grad():
        got = _out(model, ids).float().cpu()
    for h in hooks:
        h.remove()
    assert calls.count("down_proj") == len(blocks)  # every block ran on tilegemm
    ref = copy.deepcopy(source)
    ref.load_state_dict({k: v.float() for k, v in reference.items()}, strict=False)
    ref = ref.to(device)
    errs = _blocks_against(seen, ref)
    assert len(errs) == len(blocks) and max(errs.values()) < 3e-3, errs  # fp16 activations against fp32: 4e-4-7e-4 seen
    with torch.no_grad():
        want = _out(ref, ids).float().cpu()
    assert _rel(got, want) < 1e-2  # the logits: fp16 through the layers (the fp32 model in fp16 is 1e-3-5e-3 off)


def test_gpt_oss_checkpoint_with_expert_biases_loads(tmp_path, device):
    # gpt-oss' experts have biases and interleave their gate and up rows: each expert's biases load into the block's
    # (tests/models/test_models_moe_checkpoint.py checks them against nonzero biases in every stored layout)
    if "gpt_oss" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no gpt-oss")
    config = _config("gpt_oss", dict(num_local_experts=4, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=16))
    source = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    reference = cw.write_model(tmp_path, source, "gptq", group_size=32, sym=True, not_convert=_kept_16_bit(source))
    gate_up = reference["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == source.model.layers[0].mlp.experts.gate_up_proj.shape  # rows as the block holds them
    model = from_pretrained(tmp_path, device=device)
    block = model.model.layers[0].mlp.experts
    assert torch.equal(block.gate_up_proj_bias.cpu(), reference["model.layers.0.mlp.experts.gate_up_proj_bias"])
    assert not isinstance(getattr(block, "gate_up_proj", None), torch.Tensor)  # 4-bit: the 16-bit weight dropped


def test_jamba_quantized_whole(device):
    # Jamba's mamba layers multiply dt_proj's weight themselves unless the config says the model is quantized
    # (config._is_quantized, which transformers' quantizers set): with a 4-bit dt_proj that raised a TypeError
    if "jamba" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no Jamba")
    config = _config("jamba", dict(num_experts=4, mamba_dt_rank=32, attn_layer_offset=1, attn_layer_period=2,
                                   expert_layer_offset=0, expert_layer_period=1, use_mamba_kernels=False))
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(config).float().eval().to(device)
    q = tilegemm.nn.quantize_(copy.deepcopy(dense), group_size=32, warn=False)
    assert isinstance(q.model.layers[0].mamba.dt_proj, tilegemm.nn.Int4Linear)
    assert q.config._is_quantized and "_is_quantized" not in q.config.to_dict()  # (not saved)
    ref = copy.deepcopy(dense)  # the reference: the dequantized weights in the fp32 model
    with torch.no_grad():
        for name, m in q.named_modules():
            if isinstance(m, tilegemm.nn.Int4Linear):
                ref.get_submodule(name).weight.copy_(m.dequantize().float())
            if hasattr(m, "tilegemm_group_size"):
                for w in ("gate_up_proj", "down_proj"):
                    getattr(ref.get_submodule(name), w).copy_(dequantize(moe._int4(m, w)).float())
        got, want = _out(q, IDS.to(device)), _out(ref, IDS.to(device))
    assert _rel(got, want) < 3e-3  # fp16 activations on the 4-bit layers


def test_doge_retrieval_experts_are_named(device):
    # Doge's routed experts are embedding rows picked by product keys: no grouped product takes them, and convert_
    # and quantize_ say so instead of passing over the block in silence
    if "doge" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no Doge")
    config = _config("doge", dict(is_moe=True, num_experts=16, sliding_window=16))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval().to(device)
    with torch.no_grad():
        want = _out(model, IDS.to(device))
    with pytest.warns(ConversionNote, match=r"model\.layers\.0\.mlp: DogeCDMoE: its routed experts are rows of two "
                                            r"embedding tables"):
        conv = tilegemm.nn.convert_(copy.deepcopy(model), conv=False, linear=False)
    assert [n for n, _ in conv.tilegemm_skipped] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with torch.no_grad():
        assert torch.equal(_out(conv, IDS.to(device)), want)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = tilegemm.nn.quantize_(copy.deepcopy(model), group_size=32)
    assert any(issubclass(w.category, ConversionNote) and "DogeCDMoE" in str(w.message) for w in caught)
    assert isinstance(q.model.layers[0].mlp.gate_proj, tilegemm.nn.Int4Linear)  # its shared MLP is 4-bit
    assert q.model.layers[0].mlp.up_embed.weight.dtype == torch.float32  # the experts as they were
