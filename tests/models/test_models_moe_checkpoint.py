"""tilegemm.models.from_pretrained on 4-bit MoE checkpoints that store each expert as its own quantized Linear
(Qwen3-MoE names, Mixtral's w1/w3/w2 under block_sparse_moe): the experts are stacked into the blocks' 4-bit
experts and run by the "tilegemm" experts implementation; checked against an eager plain-torch model holding the
weights the checkpoint stands for (the tests' own writer, ckpt_writer.py)."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch

from moe_kit import needs_experts_interface, transformers_or_skip

transformers = transformers_or_skip()
pytestmark = needs_experts_interface()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.core.runtime import interpreting  # noqa: E402
from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.models.pretrained import dequantized_copy, empty_model  # noqa: E402
from tilegemm.nn import load_quantized_  # noqa: E402
from tilegemm.nn import Int4Linear  # noqa: E402
from tilegemm.ops.w4a16 import dequantize, quantize  # noqa: E402
from tilegemm.ops.w4a16.format import concat_outputs, stack_experts  # noqa: E402

IDS = torch.tensor([[3, 17, 200, 5, 96]])
TOL = 3e-3  # as the dense loader's tests: fp16 activations through two layers against the fp32 model


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _logits(model, device):
    with torch.no_grad():
        return model(input_ids=IDS.to(device)).logits.float().cpu()


def _assert_forward_agrees(model, config, reference, device) -> None:
    """The loaded model's logits against the writer's reference model on eager experts."""
    ref = cw.reference_model(config, reference)
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        want = ref(input_ids=IDS).logits.float()
        got = model(input_ids=IDS.to(device)).logits.float().cpu()
    assert _rel(got, want) < TOL


def _write(tmp_path, arch="qwen3_moe", layers=2, experts=4, **kw):
    config = cw.tiny_moe_config(arch, layers=layers, experts=experts)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config), mixtral_names=arch == "mixtral", **kw)
    return path, config, reference


# One decoder layer of 3 experts (under the interpreter each layer of a forward costs as much as the first, each
# expert adds programs to its grouped launches), but for a case whose second layer's experts, stored under
# Mixtral's names, must land in the second block.
CASES = {  # name: (arch, writer options)
    "qwen3moe-gptq-v1-sym-g32": ("qwen3_moe", dict(method="gptq", group_size=32, sym=True, layers=1)),
    "qwen3moe-awq-g32-sharded": ("qwen3_moe", dict(method="awq", group_size=32, shard_bytes=40_000, layers=1)),
    "qwen3moe-gptq-v2-asym-wholeK": ("qwen3_moe", dict(method="gptq", group_size=-1, v2=True, layers=1)),
    "mixtral-gptq-v1-sym-g32": ("mixtral", dict(method="gptq", group_size=32, sym=True, layers=2)),
    # GPTQ desc_act: each expert's inputs in its own order (its gate and up projections sharing one)
    "qwen3moe-gptq-v1-act-order-g32": ("qwen3_moe", dict(method="gptq", group_size=32, act_order=True, layers=1)),
    "mixtral-gptq-v2-sym-act-order-g32": ("mixtral", dict(method="gptq", group_size=32, sym=True, act_order=True,
                                                          v2=True, layers=1)),
    # llm-compressor's pack-quantized experts (weight_packed, ...), one Linear an expert as well
    "qwen3moe-ct-sym-g32": ("qwen3_moe", dict(method="compressed-tensors", group_size=32, sym=True, layers=1)),
    "mixtral-ct-asym-act-order-g32": ("mixtral", dict(method="compressed-tensors", group_size=32, sym=False,
                                                      act_order=True, layers=1)),
}

# Cases whose loaded blocks differ from another case's in the stored format only (loaded, every format is one 4-bit
# layout, checked exactly against the writer's experts): the forward under the interpreter is that other case's.
RUN_BY = {"qwen3moe-awq-g32-sharded": "qwen3moe-gptq-v1-sym-g32", "qwen3moe-ct-sym-g32": "qwen3moe-gptq-v1-sym-g32",
          "mixtral-gptq-v2-sym-act-order-g32": "mixtral-ct-asym-act-order-g32"}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_checkpoint_loads_into_stacked_experts(tmp_path, device, name, monkeypatch):
    arch, kw = CASES[name]
    path, config, reference = _write(tmp_path, arch, experts=3, **kw)
    stored = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(path / f), "pt") as h:
                stored |= set(h.keys())
    last_expert = cw.num_experts(config) - 1
    gate = f"block_sparse_moe.experts.{last_expert}.w1" if arch == "mixtral" else f"mlp.experts.{last_expert}.gate_proj"
    packed = "weight_packed" if kw["method"] == "compressed-tensors" else "qweight"
    last = config.num_hidden_layers - 1
    assert f"model.layers.{last}.{gate}.{packed}" in stored
    assert f"model.layers.{last}.mlp.experts.gate_up_proj" not in stored
    if arch == "mixtral":  # the router too under its pre-v5 name
        assert "model.layers.0.block_sparse_moe.gate.weight" in stored
        assert "model.layers.0.mlp.gate.weight" not in stored
    if kw.get("shard_bytes"):
        assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    model = from_pretrained(path, device=device)
    assert model.config._experts_implementation == "tilegemm"
    # attention stays Int4Linear per Linear (q, k, v, o per layer); the router and lm_head stay plain
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp.experts
        assert "gate_up_proj" not in block._parameters and "down_proj" not in block._parameters
        group = kw["group_size"]
        assert block.tilegemm_group_size == group
        # act-order: the gate/up weight reads H = 64 inputs in two groups, in an order an expert (the down
        # projection's 32 inputs make one group of 32, whose order is no permutation at all)
        perm = getattr(block, "tilegemm_gate_up_proj_perm", None)
        assert (perm is not None) == kw.get("act_order", False)
        if perm is not None:
            assert perm.shape == (cw.num_experts(config), config.hidden_size)
            assert torch.equal(perm.sort(1).values.cpu(), torch.arange(perm.shape[1]).expand_as(perm))
            assert not all(torch.equal(p.cpu(), torch.arange(perm.shape[1])) for p in perm)
        assert block.tilegemm_gate_up_proj_qweight.device.type == device
        # the stacked experts are exactly the writer's dequantized experts: gate rows, then up rows
        for w in ("gate_up_proj", "down_proj"):
            w4 = moe._int4(block, w)
            assert w4.shape == tuple(reference[f"model.layers.{i}.mlp.experts.{w}"].shape)
            assert torch.equal(dequantize(w4).cpu(), reference[f"model.layers.{i}.mlp.experts.{w}"]), (i, w)
    if name in RUN_BY and interpreting():
        assert RUN_BY[name] in CASES and RUN_BY[name] not in RUN_BY
        return
    calls = []
    project = moe._project
    monkeypatch.setattr(moe, "_project", lambda *a: calls.append(a[1]) or project(*a))
    with torch.no_grad():
        got = model(input_ids=IDS.to(device)).logits.float().cpu()
    layers = config.num_hidden_layers
    assert calls.count("gate_up_proj") == layers and calls.count("down_proj") == layers  # every block on tilegemm
    ref = cw.reference_model(config, reference)
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        want = ref(input_ids=IDS).logits.float()
    err = _rel(got, want)
    assert err < TOL, f"{name}: logits rel. error {err:.2e}"


# The tests below over both architectures check each loaded block by its weights (exactly the writer's); the
# forward under the interpreter runs for FORWARD_ARCH only: the experts' kernels take a stacked block whatever its
# model, and a Mixtral model's forward on them is test_moe_checkpoint_loads_into_stacked_experts'.
FORWARD_ARCH = "qwen3_moe"


def _runs(arch: str) -> bool:
    return arch == FORWARD_ARCH or not interpreting()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_block_of_16_bit_experts_is_stacked(tmp_path, device, arch):
    # a block whose experts the quantizer left 16-bit (one Linear an expert), beside a 4-bit one
    path, config, reference = _write(tmp_path, arch, experts=3, method="gptq", group_size=32,
                                     dense_experts=("model.layers.0.mlp.experts",))
    model = from_pretrained(path, device=device)
    dense, quant = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    for w in ("gate_up_proj", "down_proj"):  # the block's own 3-D weights, as stored (gate rows, then up rows)
        assert torch.equal(getattr(dense, w).cpu(), reference[f"model.layers.0.mlp.experts.{w}"]), w
    assert hasattr(quant, "tilegemm_gate_up_proj_qweight") and "gate_up_proj" not in quant._parameters
    for w in ("gate_up_proj", "down_proj"):
        assert torch.equal(dequantize(moe._int4(quant, w)).cpu(), reference[f"model.layers.1.mlp.experts.{w}"]), w
    if not _runs(arch):
        return
    _assert_forward_agrees(model, config, reference, device)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_experts_narrower_than_the_group_size_load(tmp_path, device, arch):
    # expert width I = 16 below group_size 32: GPTQ stores down_proj (K = I) as one group, gate/up (K = H) in groups
    # of 32; each stacked weight keeps its own group size
    from tilegemm.nn import quantize_

    config = cw.tiny_moe_config(arch, layers=1, width=16, experts=3)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, mixtral_names=arch == "mixtral")
    model = from_pretrained(path, device=device)
    block = model.model.layers[0].mlp.experts
    assert block.tilegemm_group_sizes == {"gate_up_proj": 32, "down_proj": -1}
    assert block.tilegemm_down_proj_scales.shape == (3, 1, config.hidden_size)
    for w in ("gate_up_proj", "down_proj"):
        assert torch.equal(dequantize(moe._int4(block, w)).cpu(), reference[f"model.layers.0.mlp.experts.{w}"]), w
    if _runs(arch):
        _assert_forward_agrees(model, config, reference, device)
    assert model.config.quantization_config["group_size"] == [-1, 32]  # what save_pretrained writes
    # back the documented way (docs/w4a16.md "Saving"): quantize_ with the same group size makes the same shapes,
    # which read the loaded tensors as the same experts (the kernels' reading of group sizes is checked above)
    again = transformers.AutoModelForCausalLM.from_config(config).half().eval()
    quantize_(again, group_size=32, filter=lambda n, m: "lm_head" not in n, warn=False)
    again.load_state_dict(model.state_dict())
    other = again.model.layers[0].mlp.experts
    assert other.tilegemm_group_sizes == block.tilegemm_group_sizes
    for w in ("gate_up_proj", "down_proj"):
        assert torch.equal(dequantize(moe._int4(other, w)), reference[f"model.layers.0.mlp.experts.{w}"]), w
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            assert torch.equal(again.get_submodule(name).dequantize(), m.dequantize().cpu()), name


@pytest.mark.parametrize("arch, method, act_order, gate_group, group", [
    ("qwen3_moe", "gptq", False, 64, 32), ("qwen3_moe", "gptq", True, 64, 32),
    ("mixtral", "compressed-tensors", False, 64, 32),
    ("qwen3_moe", "gptq", False, -1, 64)])  # one group of all K = 64 inputs, said as -1 and as 64
def test_experts_stored_in_several_group_sizes_load(tmp_path, device, arch, method, act_order, gate_group, group):
    """Per-module settings (GPTQModel's dynamic, compressed-tensors' config groups) that store an expert's gate in
    groups of 64 and its up in 32, and expert 1's down projection in one group, load: each stacked weight holds its
    experts in the finest of their group sizes, every coarser group's scale and zero repeated (the same weights);
    act-order: in the up projection's order, whose groups split the gate's. They were refused in the middle of the
    load, leaving a caller's model half converted."""
    config = cw.tiny_moe_config(arch, layers=1, width=64, experts=3)
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    def own(name):
        return gate_group if name.endswith(f".{gate}") else -1 if name.endswith(f"experts.1.{down}") else group

    path = tmp_path / "c"
    if method == "gptq":
        extra = dict(dynamic={rf"+:.*\.{gate}$": {"group_size": gate_group},
                              rf".*experts\.1\.{down}$": {"group_size": -1}})
    else:
        extra = {}
    reference = cw.write_model(path, cw.random_model(config), method, group, sym=method != "gptq", act_order=act_order,
                               mixtral_names=arch == "mixtral", group_size_of=own, quant_extra=extra)
    if method == "compressed-tensors":
        cfg = json.loads((path / "config.json").read_text())
        groups = cfg["quantization_config"]["config_groups"]
        base = groups["group_0"]
        groups["gates"] = dict(base, targets=[rf"re:.*[.]{gate}$"],
                               weights=dict(base["weights"], group_size=gate_group))
        groups["down1"] = dict(base, targets=[rf"re:.*experts[.]1[.]{down}$"],
                               weights=dict(base["weights"], strategy="channel", group_size=None))
        (path / "config.json").write_text(json.dumps(cfg))
    loaded = {}
    for load in ("from_pretrained", "load_quantized_"):
        if load == "from_pretrained":
            model = from_pretrained(path, device=device)
        else:
            # (a config of its own: the reference's set_experts_implementation would change a shared one)
            model = load_quantized_(transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).half().eval(),
                                    path, device=device)
        block = model.model.layers[0].mlp.experts
        assert block.tilegemm_group_sizes == {"gate_up_proj": group, "down_proj": group}, load
        assert (getattr(block, "tilegemm_gate_up_proj_perm", None) is not None) == act_order
        for w in ("gate_up_proj", "down_proj"):
            assert torch.equal(dequantize(moe._int4(block, w)).cpu(), reference[f"model.layers.0.mlp.experts.{w}"]), \
                (load, w)
        assert model.config._experts_implementation == "tilegemm", load
        loaded[load] = model
    # load_quantized_'s model holds the same tensors (so computes the same logits)
    state, other = loaded["from_pretrained"].state_dict(), loaded["load_quantized_"].state_dict()
    assert sorted(other) == sorted(state)
    for name, t in state.items():
        assert other[name].dtype == t.dtype and torch.equal(other[name], t), name
    if not act_order and interpreting():
        return  # (regrouped without an order: plain groups, checked exactly above, as other tests' blocks run)
    ref = cw.reference_model(config, reference, dtype=torch.float16)  # (the router's choice: in fp16 alike)
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        want = ref(input_ids=IDS).logits.float()
        got = loaded["from_pretrained"](input_ids=IDS.to(device)).logits.float().cpu()
    assert _rel(got, want) < TOL


def test_regroup_keeps_the_weight():
    # finer groups, another input order of a one-group weight, finer groups of one act-order order: the same
    # weight (dequantize gives it in the natural input order); groups a new order would mix are refused
    from tilegemm.ops.w4a16 import from_gptq
    from tilegemm.ops.w4a16.format import regroup

    g = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(16, 128, generator=g), group_size=128)
    for gs in (64, 32):
        finer = regroup(w, gs)
        assert finer.group_size == gs and finer.scales.shape == (128 // gs, 16) and finer.perm is None
        assert torch.equal(dequantize(finer), dequantize(w))
    whole = quantize(torch.randn(16, 96, generator=g), group_size=-1)
    assert regroup(whole, -1) is whole
    order = torch.randperm(96, generator=g)

    moved = regroup(whole, 32, order)
    assert torch.equal(moved.perm, order) and torch.equal(dequantize(moved), dequantize(whole))
    # act-order in groups of 64 (inputs sorted by group: order's first 64, then the rest), split into groups of 32 of
    # a finer act-order quantization of the same order
    stored, _ = cw.quantize_linear(torch.randn(16, 128, generator=g), "gptq", 64, act_order=True,
                                   order=torch.randperm(128, generator=g), generator=g)
    coarse = from_gptq(stored["qweight"], stored["qzeros"], stored["scales"], stored["g_idx"])
    fine_order = torch.cat([coarse.perm[:64][torch.randperm(64, generator=g)], coarse.perm[64:]])
    split = regroup(coarse, 32, fine_order)
    assert split.scales.shape == (4, 16) and torch.equal(dequantize(split), dequantize(coarse))
    with pytest.raises(ValueError, match="act-order input permutation differs from the order asked"):
        regroup(coarse, 32, torch.randperm(128, generator=g))
    with pytest.raises(ValueError, match="group_size 64 does not cut K = 96 into whole groups"):
        regroup(whole, 64)


def test_missing_expert_tensor_is_named(tmp_path, device):
    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    drop = ["model.layers.0.mlp.experts.2.up_proj.qweight", "model.layers.0.mlp.experts.3.down_proj.scales"]
    cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, drop=drop)
    with pytest.raises(ValueError, match=r"lacks tensor.*model\.layers\.0\.mlp\.experts\.2\.up_proj\.qweight.*"
                                         r"model\.layers\.0\.mlp\.experts\.3\.down_proj\.scales"):
        from_pretrained(path, device=device)


def test_a_refused_llama4_load_leaves_the_model_as_it_was(tmp_path, device):
    """load_quantized_ makes a Llama-4 MoE block tilegemm's block for it before its checks (they read the stacked
    experts it holds), and computes the meta buffers of a model built on the meta device: a load the checks refuse
    (a missing tensor) puts both back, leaving the caller's model as it was given."""
    if "llama4_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no llama4_text")
    config = transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128, head_dim=16, attention_chunk_size=64)
    source = cw.random_model(config)
    path = tmp_path / "c"
    cw.write_model(path, source, "gptq", 32, not_convert=[n for n, _ in source.named_modules() if n.endswith("router")],
                   drop=["model.layers.0.feed_forward.experts.1.down_proj.scales"])

    def state(model):
        return ([(n, type(m)) for n, m in model.named_modules()],
                [(n, p, p.device, p.clone() if p.device.type != "meta" else None) for n, p in model.named_parameters()],
                [(n, b, b.device) for n, b in model.named_buffers()])

    def same(before, after):
        assert after[0] == before[0]  # the module types under every name
        assert len(after[1]) == len(before[1]) and len(after[2]) == len(before[2])
        for (n, p, dev, value), (n2, p2, dev2, _) in zip(before[1], after[1]):
            assert n == n2 and p2 is p and dev2 == dev, n  # the same Parameters, where they were
            assert value is None or torch.equal(p2, value), n
        for (n, b, dev), (n2, b2, dev2) in zip(before[2], after[2]):
            assert n == n2 and b2 is b and dev2 == dev, n

    model = cw.random_model(config).half()
    assert type(model.model.layers[0].feed_forward).__name__ == "Llama4TextMoe"
    before = state(model)
    with pytest.raises(ValueError, match=r"lacks tensor.*feed_forward\.experts\.1\.down_proj\.scales"):
        load_quantized_(model, path, device=device)
    same(before, state(model))
    with torch.device("meta"):  # its rotary tables meta too, computed by the load before its checks
        meta = transformers.AutoModelForCausalLM.from_config(config)
    assert any(b.is_meta for b in meta.buffers())
    before = state(meta)
    with pytest.raises(ValueError, match=r"lacks tensor.*feed_forward\.experts\.1\.down_proj\.scales"):
        load_quantized_(meta, path, device=device)
    same(before, state(meta))
    assert type(meta.model.layers[0].feed_forward).__name__ == "Llama4TextMoe"


def test_whole_expert_missing_is_named(tmp_path, device):
    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    drop = [f"model.layers.0.mlp.experts.1.{p}.{part}" for p in ("gate_proj", "up_proj", "down_proj")
            for part in ("qweight", "qzeros", "scales", "g_idx")]
    cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, drop=drop)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1\.gate_proj\.qweight"):
        from_pretrained(path, device=device)


def test_act_order_gate_and_up_in_different_orders_refused(tmp_path, device):
    """A stacked gate/up weight reads one input order an expert: gate and up projections quantized in two orders
    (not what GPTQ makes of two projections of one input) cannot be joined, and the error names the expert."""
    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, act_order=True, shared_gate_up_order=False)
    with pytest.raises(ValueError, match=r"experts\.0 .*act-order input permutation differs"):
        from_pretrained(path, device=device)
    # into a model the caller built: refused before the model changes (its attention stays 16-bit, its experts
    # its own), as every refused load
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).half().eval()
    before = {n: (type(m), [id(p) for p in m.parameters(recurse=False)]) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"experts\.0 .*act-order input permutation differs"):
        load_quantized_(model, path, device=device)
    assert {n: (type(m), [id(p) for p in m.parameters(recurse=False)]) for n, m in model.named_modules()} == before


def test_stored_values_an_importer_refuses_leave_the_model_as_it_was(tmp_path, device):
    # a g_idx naming a group the layer does not have (a value only the importer reads) is refused, by the layer,
    # before any layer of the model is replaced
    from safetensors.torch import load_file, save_file

    config = cw.tiny_config("llama", hidden=64)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, act_order=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.g_idx"][0] = 9
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_config(config).half().eval()
    before = {n: (type(m), [id(p) for p in m.parameters(recurse=False)]) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj \(GPTQ v1, act-order.*g_idx holds groups "
                                         r"outside 0\.\.3"):
        load_quantized_(model, path, device=device)
    assert {n: (type(m), [id(p) for p in m.parameters(recurse=False)]) for n, m in model.named_modules()} == before


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_act_order_down_projection_loads(tmp_path, device, arch):
    """Expert width 64 in groups of 32: the down projections are act-order too (an order an expert of their own)."""
    config = cw.tiny_moe_config(arch, layers=1, width=64, experts=3)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, act_order=True,
                               mixtral_names=arch == "mixtral")
    model = from_pretrained(path, device=device)
    block = model.model.layers[0].mlp.experts
    perm = block.tilegemm_down_proj_perm
    assert perm.shape == (3, 64) and not all(torch.equal(p.cpu(), torch.arange(64)) for p in perm)
    for w in ("gate_up_proj", "down_proj"):
        assert torch.equal(dequantize(moe._int4(block, w)).cpu(), reference[f"model.layers.0.mlp.experts.{w}"]), w
    if not _runs(arch):
        return
    ref = cw.reference_model(config, reference)
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        got, want = model(input_ids=IDS.to(device)).logits.float().cpu(), ref(input_ids=IDS).logits.float()
    assert _rel(got, want) < TOL


def test_desc_act_with_natural_order_loads(tmp_path, device):
    """desc_act in the config but every g_idx in natural order (trivial act-order): nothing to permute."""
    path, config, reference = _write(tmp_path, "qwen3_moe", method="gptq", group_size=32, sym=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device=device)
    w4 = moe._int4(model.model.layers[0].mlp.experts, "gate_up_proj")
    assert torch.equal(dequantize(w4).cpu(), reference["model.layers.0.mlp.experts.gate_up_proj"])


def test_stack_experts_and_concat_outputs():
    torch.manual_seed(0)
    w = torch.randn(3, 16, 64)
    parts = [quantize(w[e], 32) for e in range(3)]
    stacked = stack_experts(parts)
    whole = quantize(w, 32)
    assert stacked.shape == (3, 16, 64)
    for p in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(stacked, p), getattr(whole, p)), p
    a, b = quantize(w[0], 32), quantize(w[1], 32)
    assert torch.equal(dequantize(concat_outputs([a, b])), torch.cat([dequantize(a), dequantize(b)]))
    inter = dequantize(concat_outputs([a, b], interleave=True))
    assert torch.equal(inter[0::2], dequantize(a)) and torch.equal(inter[1::2], dequantize(b))
    with pytest.raises(ValueError, match="group_size"):
        stack_experts([quantize(w[0], 32), quantize(w[1], 64)])
    with pytest.raises(ValueError, match="shapes differ"):
        stack_experts([quantize(w[0], 32), quantize(w[1, :8], 32)])
    with pytest.raises(TypeError, match="non-empty list"):
        stack_experts([])


def test_dequantized_copy_of_moe_model(tmp_path, device):
    """The bench's fp16 reference of a loaded MoE model: its experts' 3-D weights are the dequantized experts."""
    path, config, reference = _write(tmp_path, "qwen3_moe", method="awq", group_size=32)
    model = from_pretrained(path, device=device)
    dense = dequantized_copy(model)
    block = dense.model.layers[1].mlp.experts
    assert block.gate_up_proj.dtype == torch.float16 and not hasattr(block, "tilegemm_group_size")
    assert torch.equal(block.gate_up_proj.cpu(), reference["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(block.down_proj.cpu(), reference["model.layers.1.mlp.experts.down_proj"])
    assert dense.model.layers[0].mlp.gate.weight is model.model.layers[0].mlp.gate.weight  # shared, not copied


def _gpt_oss(layers: int = 1):
    """A tiny gpt-oss: experts with biases, gate and up rows in turn (is_concatenated False), held [E, in, out]."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    config = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=64, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"][:layers],
                                       tie_word_embeddings=False)
    model = cw.random_model(config)
    with torch.no_grad():  # (initialised to zero: a bias the loader dropped would go unseen)
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return config, model


GPT_OSS = {  # name: writer options
    # llm-compressor's and the transformers names: experts.<e>.gate_proj / up_proj / down_proj, a bias each
    "split-gptq": dict(method="gptq"),
    "split-ct": dict(method="compressed-tensors"),
    # GPTQModel's: experts.gate_up.<e> (gate and up rows in turn, as the block holds them) and experts.down.<e>
    "joined-gptq": dict(method="gptq", expert_layout="joined"),
    "joined-awq-stacked-bias": dict(method="awq", expert_layout="joined", stacked_expert_bias=True),
    # the block under its older name (Mixtral's block_sparse_moe), its biases stacked there too
    "joined-gptq-stacked-bias-older-name": dict(method="gptq", expert_layout="joined", stacked_expert_bias=True,
                                                stored_name=lambda n: n.replace(".mlp.", ".block_sparse_moe.")),
}


@pytest.mark.parametrize("name", list(GPT_OSS))
def test_experts_with_biases_load(tmp_path, device, name):
    """gpt-oss's experts add a bias an expert: stored beside each expert's Linears (or stacked as the block holds
    them), they load into the block's biases, which the 4-bit experts add."""
    config, source = _gpt_oss()
    path = tmp_path / "c"
    reference = cw.write_model(path, source, group_size=32, **GPT_OSS[name])
    model = from_pretrained(path, device=device)
    for layer in range(config.num_hidden_layers):
        block = model.model.layers[layer].mlp.experts
        assert moe._int4(block, "gate_up_proj") is not None and moe._int4(block, "down_proj") is not None
        for b in ("gate_up_proj_bias", "down_proj_bias"):
            assert torch.equal(getattr(block, b).cpu(), reference[f"model.layers.{layer}.mlp.experts.{b}"]), b
        for w in ("gate_up_proj", "down_proj"):  # [E, 2I, H] and [E, H, I]: rows as held
            assert torch.equal(dequantize(moe._int4(block, w)).cpu(),
                               reference[f"model.layers.{layer}.mlp.experts.{w}"].transpose(1, 2)), w
    if name == next(iter(GPT_OSS)) or not interpreting():
        # the loaded block is the same whatever the stored layout (its weights and biases checked exactly above):
        # one forward under the interpreter shows the 4-bit experts adding the biases
        err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
        assert err < TOL, f"{name}: logits rel. error {err:.2e}"


def test_a_missing_expert_bias_is_named(tmp_path, device):
    config, source = _gpt_oss(layers=2)
    path = tmp_path / "c"
    drop = ["model.layers.1.mlp.experts.gate_up.2.bias"]
    cw.write_model(path, source, "gptq", 32, expert_layout="joined", drop=drop)
    with pytest.raises(ValueError, match=r"lacks tensor.*model\.layers\.1\.mlp\.experts\.gate_up\.2\.bias"):
        from_pretrained(path, device=device)


def test_stored_expert_biases_the_block_lacks(tmp_path, device):
    """Expert Linears stored with biases the block does not have: zeros load quietly (exporters write them), a
    nonzero one is named in a warning, as a dense layer's is."""
    import warnings

    from safetensors.torch import load_file, save_file

    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True)
    stored = load_file(path / "model.safetensors")
    for e in range(4):
        for p, n in (("gate_proj", 32), ("up_proj", 32), ("down_proj", 64)):
            stored[f"model.layers.0.mlp.experts.{e}.{p}.bias"] = torch.zeros(n).half()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=UserWarning, message=".*interpreter.*")
        from_pretrained(path, device=device)
    stored["model.layers.0.mlp.experts.2.up_proj.bias"][3] = 1.0
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"nonzero model\.layers\.0\.mlp\.experts\.2\.up_proj\.bias, which the "
                                         r"experts of model\.layers\.0\.mlp\.experts do not have"):
        from_pretrained(path, device=device)


# A skip list (modules_to_not_convert, a GPTQModel "-:" dynamic pattern, compressed-tensors' ignore) naming experts
# that the checkpoint stores quantized: the config and the tensors disagree, and the load is refused as it is for a
# dense Linear, one line a block naming the rule, its entry, how many expert Linears and which ones. (An expert
# named by modules_to_not_convert was loaded 4-bit without a word; one a "-:" pattern or ignore names was reported
# "stored 16-bit", and its packed tensors again as belonging to no Linear.)
SKIPPED = {  # name: (arch, writer options, regex of the refusal, how many blocks it names)
    "gptq-modules_to_not_convert-a-block-suffix": (
        "qwen3_moe", dict(method="gptq", group_size=32, sym=True, not_convert=["mlp.experts"]),
        r"model\.layers\.0\.mlp\.experts: 12 of its 12 expert Linears are in quantization_config\."
        r"modules_to_not_convert \('mlp\.experts'\) but the checkpoint stores them quantized \(model\.layers\.0\.mlp"
        r"\.experts\.0\.gate_proj\.qweight \.\.\.\)", 2),
    # Mixtral's experts stored under block_sparse_moe, named as the model names them (mlp) or as stored
    "awq-modules_to_not_convert-one-expert-the-models-name": (
        "mixtral", dict(method="awq", group_size=32, not_convert=["model.layers.1.mlp.experts.2"]),
        r"model\.layers\.1\.mlp\.experts: 3 of its 12 expert Linears are in quantization_config\."
        r"modules_to_not_convert \('model\.layers\.1\.mlp\.experts\.2'\) but the checkpoint stores them quantized "
        r"\(model\.layers\.1\.block_sparse_moe\.experts\.2\.w1\.qweight \.\.\.\): model\.layers\.1\.block_sparse_moe"
        r"\.experts\.2\.w1, model\.layers\.1\.block_sparse_moe\.experts\.2\.w3, "
        r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w2; where the stored tensors are meant, the config needs "
        r"that entry dropped from it", 1),
    "gptq-modules_to_not_convert-one-projection-the-stored-name": (
        "mixtral", dict(method="gptq", group_size=32, not_convert=["block_sparse_moe.experts.3.w2"]),
        r"model\.layers\.0\.mlp\.experts: 1 of its 12 expert Linears is in quantization_config\.modules_to_not_convert"
        r" \('block_sparse_moe\.experts\.3\.w2'\) but the checkpoint stores it quantized \(model\.layers\.0\."
        r"block_sparse_moe\.experts\.3\.w2\.qweight\)", 2),
    "gptq-dynamic-negative-pattern": (
        "qwen3_moe", dict(method="gptq", group_size=32, quant_extra=dict(dynamic={r"-:.*\.experts\.1\.": {}})),
        r"model\.layers\.1\.mlp\.experts: 3 of its 12 expert Linears are left 16-bit by the pattern "
        r"'-:\.\*\\\.experts\\\.1\\\.' of quantization_config\.dynamic but the checkpoint stores them quantized "
        r"\(model\.layers\.1\.mlp\.experts\.1\.gate_proj\.qweight \.\.\.\)", 2),
    "compressed-tensors-ignore": (
        "qwen3_moe", dict(method="compressed-tensors", group_size=32, sym=True,
                          not_convert=["experts.0.down_proj"]),
        r"model\.layers\.1\.mlp\.experts: 1 of its 12 expert Linears is in quantization_config\.ignore "
        r"\('re:\.\*experts\[\.\]0\[\.\]down_proj\$'\) but the checkpoint stores it quantized "
        r"\(model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight_packed\)", 2),
}


@pytest.mark.parametrize("name", list(SKIPPED))
def test_experts_a_skip_list_names_but_stored_quantized_are_refused(tmp_path, device, name):
    arch, kw, needle, blocks = SKIPPED[name]
    path, _, _ = _write(tmp_path, arch, **kw)
    with pytest.raises(ValueError, match=needle) as info:
        from_pretrained(path, device=device)
    message = str(info.value)
    assert "stored 16-bit" not in message  # they are not: their packed tensors are there
    assert "no Linear of" not in message  # (a refused expert's tensors are not reported again as strays)
    # one line a block: every block where the entry names experts, none where it names none
    lines = [line for line in message.splitlines() if "expert Linears" in line]
    assert len(lines) == blocks, lines


def test_a_16_bit_expert_that_a_negative_pattern_names_is_said_stored_16_bit(tmp_path, device):
    # the other way round: a "-:" pattern names an expert that is truly stored 16-bit among quantized ones (what the
    # message said of every expert a "-:" pattern named): refused as a mixed block, saying stored 16-bit
    from safetensors.torch import load_file, save_file

    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True,
                               quant_extra=dict(dynamic={r"-:.*\.experts\.2\.down_proj": {}}))
    stored = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.experts.2.down_proj"
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        del stored[f"{key}.{part}"]
    stored[f"{key}.weight"] = reference["model.layers.0.mlp.experts.down_proj"][2].half()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{key}: stored 16-bit \({key}\.weight\), left 16-bit by the pattern "
                                         r"'-:\.\*\\\.experts\\\.2\\\.down_proj' of quantization_config\.dynamic, but "
                                         r"others of the block are stored quantized"):
        from_pretrained(path, device=device)


def test_experts_stored_16_bit_where_the_config_quantizes_them_are_said_stored_16_bit(tmp_path):
    # AutoAWQ left out every module whose name holds an entry of modules_to_not_convert: "gate" left each expert's
    # gate_proj 16-bit (transformers' reading names only the router). Refused as a mixed block, saying stored 16-bit
    # and how the list is read, not that the quantized tensors are missing
    from safetensors.torch import load_file, save_file

    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "awq", 32, not_convert=["gate"],
                               quant_extra=dict(version="GEMM"))
    stored = load_file(path / "model.safetensors")
    for e in range(cw.num_experts(config)):
        key = f"model.layers.0.mlp.experts.{e}.gate_proj"
        for part in ("qweight", "qzeros", "scales"):
            del stored[f"{key}.{part}"]
        stored[f"{key}.weight"] = reference["model.layers.0.mlp.experts.gate_up_proj"][e].chunk(2)[0].half()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    key = "model.layers.0.mlp.experts.0.gate_proj"
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.experts: 4 of its 12 expert Linears are stored "
                                         rf"16-bit \({key}\.weight \.\.\.\) where the config quantizes them "
                                         r"\(quantization_config\.modules_to_not_convert \['gate'\] names modules by "
                                         r"their names' parts.*others of the block are stored quantized") as err:
        from_pretrained(path, device="cpu")
    assert str(err.value).count("stored 16-bit") == 1  # one line for the block, not one an expert


def test_a_16_bit_experts_block_that_modules_to_not_convert_names_loads(tmp_path, device):
    # named and stored 16-bit, as the entry says: no conflict, the block keeps its 16-bit experts
    path, _, reference = _write(tmp_path, "qwen3_moe", method="gptq", group_size=32,
                                dense_experts=("model.layers.0.mlp.experts",), not_convert=["layers.0.mlp.experts"])
    model = from_pretrained(path, device=device)
    dense, quant = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    assert torch.equal(dense.down_proj.cpu(), reference["model.layers.0.mlp.experts.down_proj"])
    assert hasattr(quant, "tilegemm_down_proj_qweight") and "down_proj" not in quant._parameters


def test_dynamic_patterns_match_the_experts_names_the_checkpoint_holds(tmp_path, device):
    # Mixtral's experts stored as the hub has them (block_sparse_moe.experts.<e>.w2; the model says mlp): a dynamic
    # override written against the stored name applies to those experts (it was matched against the model's name,
    # missed, and the group-size-64 tensors then refused as not group 32)
    config = cw.tiny_moe_config("mixtral", layers=1, width=64)
    path = tmp_path / "c"
    dynamic = {r"+:.*\.block_sparse_moe\.experts\.1\.w2$": {"group_size": 64}}
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, mixtral_names=True,
                               group_size_of=lambda n: 64 if n.endswith("block_sparse_moe.experts.1.w2") else 32,
                               quant_extra=dict(dynamic=dynamic))
    model = from_pretrained(path, device=device)
    block = model.model.layers[0].mlp.experts
    for w in ("gate_up_proj", "down_proj"):
        assert torch.equal(dequantize(moe._int4(block, w)).cpu(), reference[f"model.layers.0.mlp.experts.{w}"]), w


@pytest.mark.parametrize("scale, message", [(20000.0, "weights dequantized in fp16 pass fp16's range"),
                                            (1e5, "bf16 scales .* pass fp16's range once converted")])
def test_saved_stacked_experts_past_fp16s_range_are_refused_in_fp16(tmp_path, scale, message):
    # a model tilegemm saved (stacked 4-bit experts) loaded with dtype=fp16: its bf16 scales were converted with no
    # range check, experts of inf weights loaded without a word (a dense layer's were refused)
    transformers_or_skip()
    from safetensors.torch import load_file, save_file

    config = cw.tiny_moe_config("qwen3_moe", layers=1, experts=3)
    cw.write_model(tmp_path / "src", cw.random_model(config), "gptq", 32, sym=True)
    from_pretrained(tmp_path / "src", dtype=torch.bfloat16, device="cpu").save_pretrained(tmp_path / "saved")
    key = "model.layers.0.mlp.experts.tilegemm_down_proj_scales"
    for f in (tmp_path / "saved").glob("*.safetensors"):
        tensors = load_file(f)
        if key in tensors:
            tensors[key] = torch.full_like(tensors[key], scale)
            save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.experts\.tilegemm_down_proj: its .*{message}"):
        from_pretrained(tmp_path / "saved", dtype=torch.float16, device="cpu")
