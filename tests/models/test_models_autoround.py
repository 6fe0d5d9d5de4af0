"""tilegemm.models.from_pretrained on Intel AutoRound checkpoints (quant_method "auto-round"): weights packed as GPTQ
v1 ("auto_round:auto_gptq") or AWQ gemm ("auto_round:auto_awq"), block_name_to_quantize and extra_config giving
layers 16-bit or settings of their own; written by the tests' own writer (ckpt_writer.py) and checked against a
plain-torch model holding the weights they stand for."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)
from moe_kit import needs_experts_interface  # noqa: E402

import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.models.pretrained import empty_model  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_  # noqa: E402
from tilegemm.ops.w4a16 import dequantize  # noqa: E402

IDS = torch.tensor([[3, 17, 200]])
TOL = 3e-3  # as test_models_pretrained.py: fp16 activations through two layers against the fp32 model


def _logits(model, device):
    with torch.no_grad():
        return model(input_ids=IDS.to(device)).logits.float().cpu()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _write(tmp_path, method="gptq", group_size=32, sym=False, hidden=64, v2=False, layers=2, **extra):
    """A checkpoint of ``layers`` decoder layers: two where the settings name one of them, else one is enough (each
    layer of a forward under the interpreter costs as much as the first)."""
    config = cw.tiny_config("llama", hidden=hidden, layers=layers)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config), method, group_size, sym, autoround=True, v2=v2,
                               quant_extra=extra)
    return path, config, reference


def _check(model, config, reference, device, quantized, forward=True):
    """The Linears named in ``quantized`` are Int4Linears computing with exactly the writer's dequantized weight,
    every other Linear a 16-bit one holding the stored weight, every other stored tensor as stored; the logits match
    the reference model's (``forward``; a model whose every tensor is checked so against a model whose logits are,
    skips the forward under the interpreter)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Int4Linear))}
    assert {n for n, m in linears.items() if isinstance(m, Int4Linear)} == set(quantized)
    for n, m in linears.items():
        got = m.dequantize() if isinstance(m, Int4Linear) else m.weight
        assert torch.equal(got.cpu(), reference[f"{n}.weight"]), n
    for n, p in model.named_parameters():
        if n.rpartition(".")[0] not in linears:
            assert torch.equal(p.cpu(), reference[n]), n
    if forward:
        err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
        assert err < TOL, f"logits rel. error {err:.2e}"


def _layer_linears(config, layers=None) -> list[str]:
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    return [f"model.layers.{i}.{n}" for i in (range(config.num_hidden_layers) if layers is None else layers)
            for n in names]


CASES = {  # name: (packing method, sym, config keys)
    "auto_gptq-asym": ("gptq", False, {}),
    "auto_gptq-sym": ("gptq", True, {}),
    # an early checkpoint: the method "intel/auto-round", no packing_format (GPTQ's)
    "early-no-packing_format-sym": ("gptq", True, dict(quant_method="intel/auto-round", packing_format=None)),
    "auto_awq-asym": ("awq", False, {}),
    # AutoRound's torch layer (qlinear_torch): GPTQ's layout, each zero stored as it is; ":gptqmodel" adds a g_idx
    "auto_round-asym": ("gptq-v2", False, dict(packing_format="auto_round", act_bits=16)),
    "auto_round:gptqmodel-asym": ("gptq-v2", False, dict(packing_format="auto_round:gptqmodel")),
    # sym: zeros of 8 stored (intel/auto-round export_to_awq packs the scalar zero point), as AWQ's zero_point false
    "auto_awq-sym": ("awq", True, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_autoround_checkpoint_loads(tmp_path, device, name):
    method, sym, extra = CASES[name]
    v2 = method == "gptq-v2"  # (GPTQ's layout, each zero stored as it is)
    path, config, reference = _write(tmp_path, "gptq" if v2 else method, 32, sym, v2=v2, layers=1, **extra)
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] in ("auto-round", "intel/auto-round") and "iters" in q
    assert ("packing_format" in q) == (extra.get("packing_format", "") is not None)
    model = from_pretrained(path, device=device)
    _check(model, config, reference, device, _layer_linears(config))
    assert model.model.layers[0].mlp.up_proj.group_size == 32
    assert type(model.lm_head) is torch.nn.Linear
    # the loaded model says what it holds now (tilegemm's own layers) and where they came from
    saved = model.config.quantization_config
    assert saved["quant_method"] == "tilegemm" and saved["converted_from"] == q["quant_method"]


def test_the_saved_model_reloads(tmp_path, device):
    path, config, reference = _write(tmp_path, "gptq", 32, False, layers=1)
    model = from_pretrained(path, device=device)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "tilegemm" and saved["converted_from"] == "auto-round"
    again = from_pretrained(tmp_path / "saved", device=device)
    # the same layers and tensors (so the same logits)
    assert [(n, type(m)) for n, m in again.named_modules()] == [(n, type(m)) for n, m in model.named_modules()]
    state, other = model.state_dict(), again.state_dict()
    assert sorted(other) == sorted(state)
    for name, t in state.items():
        assert other[name].dtype == t.dtype and torch.equal(other[name], t), name
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            assert again.get_submodule(name).group_size == m.group_size, name


@pytest.mark.parametrize("key, blocks, quantized", [
    ("block_name_to_quantize", "model.layers.1", [1]),
    # a list, under the older key
    ("to_quant_block_names", ["model.layers.0"], [0]),
    ("block_name_to_quantize", "model.layers.0,model.layers.1", [0, 1]),
])
def test_block_name_to_quantize_leaves_the_rest_16_bit(tmp_path, device, key, blocks, quantized):
    path, config, reference = _write(tmp_path, **{key: blocks})
    model = from_pretrained(path, device=device)
    _check(model, config, reference, device, _layer_linears(config, quantized))
    # load_quantized_ into a model built by the caller reads the same settings
    own, _ = empty_model(path, device=device)
    load_quantized_(own, path)
    _check(own, config, reference, device, _layer_linears(config, quantized), forward=False)


def test_a_layer_outside_the_blocks_stored_quantized_is_refused(tmp_path):
    path, _, _ = _write(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["block_name_to_quantize"] = "model.layers.1"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj is left 16-bit by "
                                         r"quantization_config\.block_name_to_quantize \(its name starts with none of "
                                         r"'model\.layers\.1'\) but the checkpoint stores it quantized"):
        from_pretrained(path, device="cpu")


def test_extra_config_gives_a_layer_16_bit_or_its_own_group_size(tmp_path, device):
    extra_config = {"model.layers.0.mlp.down_proj": {"bits": 16, "data_type": "float"},
                    "model.layers.1.mlp.down_proj": {"bits": 4, "group_size": 64, "sym": True}}
    path, config, reference = _write(tmp_path, "gptq", 32, False, extra_config=extra_config)
    model = from_pretrained(path, device=device)
    quantized = [n for n in _layer_linears(config) if n != "model.layers.0.mlp.down_proj"]
    _check(model, config, reference, device, quantized)
    own, other = model.model.layers[1].mlp.down_proj, model.model.layers[1].mlp.up_proj
    assert own.group_size == 64 and other.group_size == 32
    assert own.scales.shape[0] == 2  # K = 128 in groups of 64


def test_extra_config_keys_that_are_regular_expressions(tmp_path, device):
    # newer AutoRound writes its layer_config's patterns as regular expressions (".*mlp\\.gate.*"), which vLLM
    # searches in each layer's name after the exact names; outside the blocks one quantizes a layer by its own bits
    extra_config = {"model.layers.1.mlp.down_proj": {"group_size": 64},  # an exact name comes first
                    r".*mlp\.down_proj.*": {"bits": 16, "data_type": "float"},
                    r".*self_attn\.[qk]_proj$": {"group_size": 64, "sym": True},
                    "^lm_head$": {"bits": 4, "group_size": 32}}
    config = cw.tiny_config("llama", hidden=64)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, False, autoround=True,
                               quantize_lm_head=True, quant_extra=dict(block_name_to_quantize="model.layers",
                                                                       extra_config=extra_config))
    model = from_pretrained(path, device=device)
    quantized = [n for n in _layer_linears(config) if n != "model.layers.0.mlp.down_proj"] + ["lm_head"]
    _check(model, config, reference, device, quantized)
    layer = model.model.layers[0]
    assert (layer.self_attn.q_proj.group_size, layer.self_attn.v_proj.group_size) == (64, 32)
    assert model.model.layers[1].mlp.down_proj.group_size == 64


def test_awq_packing_with_an_extra_config_group_size(tmp_path, device):
    path, config, reference = _write(tmp_path, "awq", 32, False, block_name_to_quantize=["model.layers"],
                                     extra_config={"model.layers.1.self_attn.o_proj": {"group_size": 64}})
    model = from_pretrained(path, device=device)
    _check(model, config, reference, device, _layer_linears(config))
    assert model.model.layers[1].self_attn.o_proj.group_size == 64


@pytest.mark.parametrize("backend, v2", [("auto_round:exllamav2", True), ("auto_round:triton", True),
                                         ("auto_round:gptq:exllamav2", False)])
def test_early_checkpoints_packing_named_by_backend(tmp_path, device, backend, v2):
    # AutoRound's early releases named the packer by "backend" only: its own layers (triton, exllamav2; what they
    # wrote for asymmetric weights) store each zero as it is, not GPTQ v1's zero - 1; read as v1, every weight would
    # be off by one scale
    path, config, reference = _write(tmp_path, "gptq", 32, False, v2=v2, layers=1, quant_method="intel/auto-round",
                                     packing_format=None, backend=backend)
    assert "packing_format" not in json.loads((path / "config.json").read_text())["quantization_config"]
    _check(from_pretrained(path, device=device), config, reference, device, _layer_linears(config))


REFUSED = [  # (config keys changed, the message)
    (dict(packing_format=None, backend="auto_round:marlin"),
     r"quantization_config\.backend 'auto_round:marlin' is not supported; supported: 'auto_round:auto_gptq', "
     r"'auto_round:auto_awq', 'auto_round:exllamav2', 'auto_round:triton', 'auto_round', "
     r"'auto_round:gptqmodel'"),
    (dict(packing_format="auto_round:fp8"), r"quantization_config\.packing_format 'auto_round:fp8' is not "
                                            r"supported; supported: 'auto_round:auto_gptq', 'auto_round:auto_awq'"),
    (dict(packing_format="auto_round", act_bits=8), r"quantization_config\.packing_format 'auto_round' with "
                                                    r"quantization_config\.act_bits = 8 is not supported"),
    (dict(data_type="mx_fp"), r"quantization_config\.data_type 'mx_fp' is not supported; tilegemm loads AutoRound's "
                              r"integer weights"),
    (dict(sym="yes"), r"quantization_config\.sym must be true or false, got 'yes'"),
    (dict(bits=8), r"quantization_config\.bits = 8; tilegemm loads 4-bit checkpoints only"),
    (dict(extra_config={"model.layers.0.mlp.down_proj": {"bits": 8}}),
     r"model\.layers\.0\.mlp\.down_proj: stored with bits = 8 \(quantization_config\.extra_config"
     r"\['model\.layers\.0\.mlp\.down_proj'\]\); tilegemm loads 4-bit layers only"),
    (dict(extra_config={"model.layers.0.mlp.down_proj": {"data_type": "fp8"}}),
     r"quantization_config\.extra_config\['model\.layers\.0\.mlp\.down_proj'\]\.data_type 'fp8' is not supported"),
    (dict(extra_config={"model.layers.(0": {"bits": 16}}),
     r"quantization_config\.extra_config\['model\.layers\.\(0'\]: the key is not a regular expression"),
    (dict(block_name_to_quantize=7), r"quantization_config\.block_name_to_quantize must be a comma-separated string "
                                     r"or a list"),
]


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """An AutoRound checkpoint of one layer, copied by the tests that change its settings."""
    path, _, _ = _write(tmp_path_factory.mktemp("autoround"), layers=1)
    return path


@pytest.mark.parametrize("changes, message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_what_is_not_taken_is_refused_naming_the_key(tmp_path, one_layer, changes, message):
    import shutil

    path = shutil.copytree(one_layer, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        from_pretrained(path, device="cpu")


@needs_experts_interface()
def test_moe_experts_load_stacked(tmp_path, device):
    config = cw.tiny_moe_config("qwen3_moe", layers=1, experts=3)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, False, autoround=True)
    model = from_pretrained(path, device=device)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * config.num_hidden_layers  # attention
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp.experts
        assert "gate_up_proj" not in block._parameters and block.tilegemm_group_size == 32
        for w in ("gate_up_proj", "down_proj"):
            assert torch.equal(dequantize(moe._int4(block, w)).cpu(), reference[f"model.layers.{i}.mlp.experts.{w}"])
    ref = cw.reference_model(config, reference)
    ref.set_experts_implementation("eager")
    err = _rel(_logits(model, device), _logits(ref, "cpu"))
    assert err < TOL, f"logits rel. error {err:.2e}"


_GEMMA3_STORED = [("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                  ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head.")]


def _gemma3_stored_name(name: str) -> str:
    return next((name.replace(new, old, 1) for new, old in _GEMMA3_STORED if name.startswith(new)), name)


def test_rules_naming_modules_by_the_models_names_where_the_checkpoint_stores_older_ones(tmp_path, device):
    # AutoRound names blocks and layers as the model it quantized did (Gemma-3 under transformers >= 4.52:
    # model.language_model.layers.*), while save_pretrained stored the tensors under the older names
    # (language_model.model.layers.*). Its rules apply under either name, as modules_to_not_convert's do: matched
    # against the stored names only, every layer fell outside block_name_to_quantize and the checkpoint was refused.
    config = cw.tiny_gemma3_multimodal_config()
    path = tmp_path / "ckpt"
    o_proj, down = "model.language_model.layers.0.self_attn.o_proj", "model.language_model.layers.1.mlp.down_proj"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, False, autoround=True,
                               stored_name=_gemma3_stored_name, quant_extra=dict(
                                   block_name_to_quantize="model.language_model.layers",
                                   extra_config={o_proj: {"bits": 16}, down: {"group_size": 64}}))
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f"{_gemma3_stored_name(down)}.qweight" in set(f.keys())  # the older names stored
    model = from_pretrained(path, device=device)
    layers = [f"model.language_model.layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]
    int4 = {n for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert int4 == set(layers) - {o_proj}
    assert model.get_submodule(down).group_size == 64
    assert model.get_submodule("model.language_model.layers.0.mlp.down_proj").group_size == 32
    assert torch.equal(model.get_submodule(o_proj).weight.cpu(), reference[f"{o_proj}.weight"])
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"logits rel. error {err:.2e}"
