"""transformers' MoE blocks on tilegemm: experts_implementation="tilegemm" gives the eager model's logits (fp32,
tiny configs, random weights), gradients too, and tilegemm.nn.quantize_ turns the experts into 4-bit ones. Models that
run kernels go to the ``device`` fixture's device: the CPU under the interpreter, the GPU otherwise."""

from __future__ import annotations

import copy
import subprocess
import sys

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilegemm  # noqa: E402
import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.core.runtime import interpreting  # noqa: E402
from tilegemm.nn.convert import ConversionNote  # noqa: E402

from moe_kit import (dbrx, experts_interface, jetmoe, llama4, needs_experts_interface,  # noqa: E402
                     transformers_or_skip)

transformers_or_skip(safetensors=False)
pytestmark = needs_experts_interface()


@pytest.fixture(autouse=True)
def ieee_fp32():
    """fp32 products in full precision on both sides (eager's and tilegemm's read torch's setting): on the GPU, tf32
    would leave about 1e-3 between the models, past the bounds below."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def qwen3_moe(**kw):
    shapes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  decoder_sparse_step=1, max_position_embeddings=64)
    return transformers.Qwen3MoeConfig(**{**shapes, **kw})


def mixtral():
    return transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64)


def pair(cfg, device="cpu"):
    """(eager model, tilegemm model) sharing weights, in eval mode, on ``device``."""
    torch.manual_seed(0)
    # (a config each: from_config sets the implementation on the config object it is given)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation="tilegemm").eval()
    assert eager.config._experts_implementation == "eager"
    ours.load_state_dict(eager.state_dict())
    return eager.to(device), ours.to(device)


def test_registered_under_its_name():
    assert moe.register_experts() is True
    assert moe.register_experts() is True  # idempotent
    assert "tilegemm" in experts_interface()


@pytest.mark.parametrize("make", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_logits_match_eager(make, monkeypatch, device):
    eager, ours = pair(make(), device)
    calls = []
    project = moe._project
    monkeypatch.setattr(moe, "_project", lambda *a: calls.append(a[1]) or project(*a))
    ids = torch.randint(0, 64, (2, 4), device=device)
    with torch.no_grad():
        want, got = eager(ids).logits, ours(ids).logits
    assert calls.count("gate_up_proj") == 2 and calls.count("down_proj") == 2  # every MoE block ran on tilegemm
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unfused_activation_matches_eager(device):
    # gelu (erf) is not fused into the epilogue: the grouped GEMM, then the block's own gate
    eager, ours = pair(qwen3_moe(hidden_act="gelu", num_hidden_layers=1), device)
    assert moe._fused_activation(ours.model.layers[0].mlp.experts) is None
    ids = torch.randint(0, 64, (1, 9), device=device)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=1e-5, atol=1e-5)


def test_gradients_match_eager(device):
    # one layer: the gradients before the experts (attention, embeddings) take the experts' input gradient, as a
    # layer before them would
    eager, ours = pair(qwen3_moe(num_hidden_layers=1), device)
    ids = torch.randint(0, 64, (1, 6), device=device)
    for model in (eager, ours):
        model.train()
        model(ids, labels=ids).loss.backward()
    names = [name for name, _ in eager.named_parameters()]
    assert any("experts" in n for n in names) and any("q_proj" in n for n in names)
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_quantize_turns_experts_int4(device):
    eager, ours = pair(qwen3_moe(num_hidden_layers=1), device)
    tilegemm.nn.quantize_experts_(ours, group_size=32)
    block = ours.model.layers[0].mlp.experts
    assert not hasattr(block, "gate_up_proj") and block.tilegemm_gate_up_proj_qweight.dtype == torch.int32
    assert ours.config._experts_implementation == "tilegemm"
    # the eager model on the dequantized weights is the reference (activations in fp16 on the 4-bit path)
    blocks = zip((layer.mlp.experts for layer in eager.model.layers),
                 (layer.mlp.experts for layer in ours.model.layers))
    for e_block, q_block in blocks:
        for name in ("gate_up_proj", "down_proj"):
            w4 = moe._int4(q_block, name)
            getattr(e_block, name).data.copy_(tilegemm.w4a16.dequantize(w4).float())
    ids = torch.randint(0, 64, (2, 5), device=device)
    with torch.no_grad():
        want, got = eager(ids).logits, ours(ids).logits
    assert (got - want).norm() / want.norm() < 1e-2
    # another implementation cannot read 4-bit experts: refused by name, not an AttributeError inside transformers
    ours.set_experts_implementation("eager")
    with pytest.raises(RuntimeError, match="Qwen3MoeExperts holds 4-bit experts, which only the 'tilegemm' experts "
                                           "implementation runs; the model is set to 'eager'"):
        ours(ids)


@pytest.mark.parametrize("group_size", [0, 48, "32", True])
def test_quantize_experts_refuses_a_bad_group_size(group_size):
    _, ours = pair(qwen3_moe())
    with pytest.raises(ValueError, match=r"quantize_experts_: group_size must be one of 32, 64, 128, 256, -1"):
        tilegemm.nn.quantize_experts_(ours, group_size=group_size)
    assert hasattr(ours.model.layers[0].mlp.experts, "gate_up_proj")  # nothing changed


@pytest.mark.parametrize("hidden_act", ["relu", "gelu_pytorch_tanh"])
def test_the_blocks_own_activation_is_fused(hidden_act, device):
    # Aria's routed experts are SiLU-gated whatever config.hidden_act says (it drives the shared experts only)
    if not hasattr(transformers, "AriaTextConfig"):
        pytest.skip("this transformers has no Aria")
    cfg = transformers.AriaTextConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4, moe_topk=2,
                                      moe_num_shared_experts=1, hidden_act=hidden_act)
    eager, ours = pair(cfg, device)
    if len(inspect.signature(type(eager.model.layers[0].mlp.experts).forward).parameters) < 4:
        pytest.skip("this transformers' Aria experts take no routing (no experts interface): nothing runs on tilegemm")
    x, idx, w = (t.to(device) for t in (torch.randn(10, 32), torch.randint(0, 4, (10, 2)), torch.rand(10, 2)))
    with torch.no_grad():
        want = eager.model.layers[0].mlp.experts(x, idx, w)
        got = ours.model.layers[0].mlp.experts(x, idx, w)
    assert moe._fused_activation(ours.model.layers[0].mlp.experts) == "silu"
    assert (got - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("act_fn, fused", [(torch.nn.functional.silu, "silu"), (torch.relu, "relu"),
                                            (torch.nn.functional.gelu, None), (torch.tanh, None)])
def test_an_activation_function_of_the_block_is_its_own_not_the_configs(act_fn, fused, device):
    # LFM2-MoE's experts hard-code act_fn = F.silu (a function, no module): the config's hidden_act (which its config
    # stores when given) was fused in its place, 25% off the block's own output
    cfg = qwen3_moe(hidden_act="relu")
    eager, ours = pair(cfg, device)
    for m in (eager, ours):
        del m.model.layers[0].mlp.experts.act_fn  # (the config's module, as ACT2FN made it)
        m.model.layers[0].mlp.experts.act_fn = act_fn
    x, idx, w = (t.to(device) for t in (torch.randn(10, 32), torch.randint(0, 4, (10, 2)), torch.rand(10, 2)))
    with torch.no_grad():
        want = eager.model.layers[0].mlp.experts(x, idx, w)
        got = ours.model.layers[0].mlp.experts(x, idx, w)
    assert moe._fused_activation(ours.model.layers[0].mlp.experts) == fused  # (None: the gate applied by torch)
    assert (got - want).norm() / want.norm() < 1e-5


def test_stacked_experts_fuse_an_activation_function_too():
    # a converted block's experts (StackedExperts) read a plain-function act_fn as the transformers block does: fused
    # where the epilogue computes it (it ran unfused: right, slower)
    gate_up, down = torch.randn(2, 16, 8), torch.randn(2, 8, 8)
    assert moe.StackedExperts(gate_up, down, torch.nn.functional.silu, False).fused_activation == "silu"
    assert moe.StackedExperts(gate_up, down, torch.nn.SiLU(), False).fused_activation == "silu"
    assert moe.StackedExperts(gate_up, down, torch.tanh, False).fused_activation is None


OWN_FORWARD = [  # (config, its class in transformers, the state dict keeps its names)
    pytest.param(llama4, "Llama4TextConfig", True, id="llama4"),
    pytest.param(dbrx, "DbrxConfig", False, id="dbrx"),
    pytest.param(jetmoe, "JetMoeConfig", False, id="jetmoe"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make,config_class,same_names", OWN_FORWARD)
def test_experts_with_a_forward_of_their_own_are_converted(make, config_class, same_names, device):
    # Llama-4, DBRX and JetMoE run their experts outside the experts interface: convert_ puts StackedExperts in
    # their place; logits, gradients and the 4-bit experts (against their dequantized weights) as eager's
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    if (device == "cpu") != interpreting():
        pytest.skip("the CPU case runs under the interpreter, the CUDA case on the GPU")
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(make()).eval().to(device)
    with torch.no_grad():
        for p in eager.parameters():  # (Llama-4 builds its experts' gate/up as zeros)
            if not p.abs().sum():
                p.normal_(std=0.05)
    assert tilegemm.nn.quantize_experts_(copy.deepcopy(eager), group_size=32) == []  # not before converting
    ours = tilegemm.nn.convert_(copy.deepcopy(eager), conv=False, linear=False)
    stacked = [m for m in ours.modules() if isinstance(m, moe.StackedExperts)]
    assert len(stacked) == 1 and moe._fused_activation(stacked[0]) == "silu"
    assert (set(ours.state_dict()) == set(eager.state_dict())) is same_names
    ids = torch.randint(0, 64, (2, 4), device=device)
    out_eager, out_ours = eager(ids, output_router_logits=True), ours(ids, output_router_logits=True)
    want, got = out_eager.logits, out_ours.logits
    assert (got - want).norm() / want.norm() < 1e-5
    # the routers' logits recorded as eager's (JetMoE's block computes them without its router's forward)
    routed = getattr(out_eager, "router_logits", None)
    assert (routed is None) == (getattr(out_ours, "router_logits", None) is None)
    if routed is not None:
        assert len(out_ours.router_logits) == len(routed) > 0
        for a, b in zip(out_ours.router_logits, routed):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    want.square().mean().backward()
    got.square().mean().backward()
    grads = dict(eager.named_parameters())
    shared = [n for n, p in ours.named_parameters() if n in grads]
    assert len(shared) >= 8
    for n in shared:
        g, w = dict(ours.named_parameters())[n].grad, grads[n].grad
        assert (g - w).norm() <= 1e-5 * w.norm() + 1e-12, n
    # 4-bit experts: the converted model with its experts' dequantized weights is the reference
    ref = copy.deepcopy(ours)
    assert len(tilegemm.nn.quantize_experts_(ours, group_size=32)) == 1
    four, dense = stacked_of(ours), stacked_of(ref)
    with torch.no_grad():
        for n in ("gate_up_proj", "down_proj"):
            w = tilegemm.w4a16.dequantize(moe._int4(four, n)).float()
            getattr(dense, n).copy_(w.transpose(1, 2) if dense.is_transposed else w)
        got4, want4 = ours(ids).logits, ref(ids).logits
    assert (got4 - want4).norm() / want4.norm() < 1e-4


def stacked_of(model):
    return next(m for m in model.modules() if isinstance(m, moe.StackedExperts))


def test_quantize_names_experts_with_a_forward_of_their_own():
    # a module holding 3-D experts whose class runs its own forward (none of OWN_FORWARD_BLOCKS): quantizing them
    # would break it, so quantize_ leaves them 16-bit and says so
    class OwnExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, 64) / 8)
            self.down_proj = torch.nn.Parameter(torch.randn(4, 32, 64) / 8)

        def forward(self, x):
            return torch.relu(x @ self.gate_up_proj[0])[..., :32] @ self.down_proj[0]

    model = torch.nn.Sequential(OwnExperts()).eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = model(x)
    assert tilegemm.nn.quantize_experts_(model, group_size=32) == []
    with pytest.warns(ConversionNote, match=r"0: OwnExperts holds stacked experts but runs a forward of its own"):
        tilegemm.nn.quantize_(model, group_size=32)
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_quantize_keeps_the_routers_16_bit(device):
    # a router reads its own weight (LongCat's casts it to fp32): quantize_ leaves the MoE blocks' routers alone
    if "longcat_flash" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no LongCat-Flash")
    cfg = transformers.AutoConfig.for_model(
        "longcat_flash", vocab_size=64, hidden_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=4,
        ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
        num_experts_per_tok=2, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
        q_lora_rank=32, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="tilegemm").eval().half()
    model = model.to(device)
    tilegemm.nn.quantize_(model, group_size=32, warn=False)
    mlp = model.model.layers[0].mlp
    assert type(mlp.router.classifier) is torch.nn.Linear
    # the layout flags transformers' use_experts_implementation sets on the experts it dispatches
    if not all(hasattr(mlp.experts, a) for a in ("has_gate", "is_transposed", "is_concatenated")):
        # transformers before the experts interface reached LongCat (5.17: zero experts in gate_up_proj's rows and
        # a forward of its own): the experts are kept 16-bit, and said so
        assert ("model.layers.0.mlp.experts", "LongcatFlashExperts holds stacked experts but runs a forward of its "
                "own, not transformers' experts interface: its experts stay 16-bit") in model.tilegemm_skipped
        assert not hasattr(mlp.experts, "tilegemm_gate_up_proj_qweight")
    else:
        assert hasattr(mlp.experts, "tilegemm_gate_up_proj_qweight")
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 64, (1, 5), device=device)).logits).all()


def test_quantize_keeps_the_shared_experts_gate_16_bit(device):
    # Qwen2-MoE's one-output gate of its shared expert, kept 16-bit as quantizers keep it; the shared expert's
    # own projections are quantized
    cfg = transformers.AutoConfig.for_model(
        "qwen2_moe", vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).half().to(device)
    tilegemm.nn.quantize_(model, group_size=32, warn=False)
    mlp = model.model.layers[0].mlp
    assert type(mlp.shared_expert_gate) is torch.nn.Linear and type(mlp.gate) is not tilegemm.nn.Int4Linear
    assert isinstance(mlp.shared_expert.down_proj, tilegemm.nn.Int4Linear)


def test_nn_quantize_covers_experts(device):
    _, ours = pair(qwen3_moe(num_hidden_layers=1), device)
    ours = ours.half()  # (Int4Linear takes 16-bit activations)
    tilegemm.nn.quantize_(ours, group_size=32)
    assert isinstance(ours.model.layers[0].self_attn.q_proj, tilegemm.nn.Int4Linear)
    assert hasattr(ours.model.layers[0].mlp.experts, "tilegemm_down_proj_qweight")
    with torch.no_grad():
        assert torch.isfinite(ours(torch.randint(0, 64, (1, 4), device=device)).logits).all()


@pytest.fixture(scope="module")
def fresh_import():
    """What a fresh interpreter prints: whether importing tilegemm (and tilegemm.nn) imported transformers, then
    whether transformers' experts table, imported after, holds "tilegemm". One process for both (seconds each)."""
    code = ("import sys, tilegemm, tilegemm.nn; print('transformers' in sys.modules)\n"
            "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as f; print('tilegemm' in f)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_tilegemm_imports_no_transformers(fresh_import):
    assert fresh_import[0] == "False"


def test_experts_block_compiles_fullgraph(device):
    # sort, searchsorted, the grouped ops and the scatter back trace as one graph (no data-dependent host step)
    _, ours = pair(qwen3_moe(), device)
    block = ours.model.layers[0].mlp.experts
    x, idx, weights = (t.to(device) for t in (torch.randn(5, 32), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)))
    with torch.no_grad():
        want = block(x, idx, weights)
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, idx, weights)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_registers_when_transformers_is_imported_later(fresh_import):
    assert fresh_import == ["False", "True"]  # transformers not there before, the experts registered after


def test_quantized_experts_keep_fragments_for_compile(monkeypatch, device):
    # Where the decode kernel runs (faked here: the packing is plain torch), quantizing makes the fragment layouts
    # and keeps them as unsaved buffers: gate/up in the fused gate's order, down as is; a compiled block then
    # passes them to the op (torch.compile traces no packing), which picks its kernel when it runs; a block
    # compiled on its own reads each layer's own layouts.
    import tilegemm.ops.grouped.dispatch as dispatch
    import tilegemm.ops.grouped.op as op

    _, ours = pair(qwen3_moe(), device)
    ours = ours.half()
    with monkeypatch.context() as m:
        m.setattr(dispatch, "frag_usable", lambda group_k, K, device: True)
        tilegemm.nn.quantize_experts_(ours, group_size=32)
    block = ours.model.layers[0].mlp.experts
    names = {n for n, _ in block.named_buffers()}
    assert {"tilegemm_gate_up_proj_gfrag_w", "tilegemm_gate_up_proj_gfrag_zs", "tilegemm_down_proj_frag_w",
            "tilegemm_down_proj_frag_zs"} <= names
    assert not any("frag" in k for k in ours.state_dict())  # derived: never saved
    w = moe._int4(block, "down_proj")
    assert w._frag[0] is block.tilegemm_down_proj_frag_w and w.fragments()[0] is w._frag[0]  # made once

    seen = []
    real = op.forward_int4

    def spy(*args):
        seen.append(args[-2] is not None)  # fweight
        return real(*args)

    monkeypatch.setattr(op, "forward_int4", spy)
    x, idx, weights = (t.to(device) for t in (torch.randn(4, 32).half(), torch.randint(0, 4, (4, 2)),
                                              torch.rand(4, 2).half()))
    other = ours.model.layers[1].mlp.experts
    step = torch.compile(lambda b, *a: b(*a), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want, want_other = block(x, idx, weights), other(x, idx, weights)
        seen.clear()
        got = step(block, x, idx, weights)
        got_other = step(other, x, idx, weights)  # (a block compiled on its own: traced for each layer)
    assert len(seen) == 4 and all(seen), seen  # every compiled 4-bit product took its block's kept fragments
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got_other, want_other, rtol=2e-3, atol=2e-3)


def _two_quantized_models(device="cpu"):
    """Two fp16 Qwen3-MoE models of different random weights, experts made 4-bit (group 32): a saved one, a target;
    on ``device``; one layer (the layers' experts load alike)."""
    cfg = qwen3_moe(num_hidden_layers=1)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).eval().half().to(device)
        tilegemm.nn.quantize_experts_(m, group_size=32)
        models.append(m)
    return models


def test_kept_fragments_follow_loaded_weights(monkeypatch):
    # The kept fragment layouts derive from the 4-bit parts and are not saved: loading another model's 4-bit
    # experts (a saved quantized model) must not leave the block reading the fragments of the weights it had.
    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.ops.w4a16.format import Int4Weight

    monkeypatch.setattr(dispatch, "frag_usable", lambda group_k, K, device: True)
    saved, target = _two_quantized_models()
    target.load_state_dict(saved.state_dict())
    block = target.model.layers[0].mlp.experts
    for name, gated in (("gate_up_proj", True), ("down_proj", False)):
        w = moe._int4(block, name)
        torch.testing.assert_close(w.qweight, moe._int4(saved.model.layers[0].mlp.experts, name).qweight)
        fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments(gated)
        got = w.fragments(gated)
        assert all(torch.equal(a, b) for a, b in zip(got, fresh)), name


def test_kept_fragments_follow_in_place_writes(monkeypatch):
    # _int4 notices parts written in place (their _version): the fragments kept from before must not come back
    # with the rebuilt weight.
    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.ops.w4a16.format import Int4Weight

    monkeypatch.setattr(dispatch, "frag_usable", lambda group_k, K, device: True)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(qwen3_moe()).eval().half()
    tilegemm.nn.quantize_experts_(m, group_size=32)
    block = m.model.layers[0].mlp.experts
    assert moe._int4(block, "down_proj")._frag is not None
    with torch.no_grad():
        block.tilegemm_down_proj_scales.mul_(2)
    w = moe._int4(block, "down_proj")
    fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments()
    assert all(torch.equal(a, b) for a, b in zip(w.fragments(), fresh))


def _kept_fragments_used(block, name="down_proj") -> bool:
    w = moe._int4(block, name)
    return w._frag is not None and w._frag[0] is getattr(block, f"tilegemm_{name}_frag_w", None)


@pytest.mark.skipif(not interpreting(), reason="calls the block on the CPU, where the interpreter runs it; on a "
                    "Hopper GPU test_grouped_frag_gpu.py runs the kept layouts")
def test_the_experts_layouts_follow_the_blocks_device(monkeypatch):
    # Kept only where the decode kernel runs: a block quantized on the CPU holds its parts alone; moved onto such a
    # device it makes them then (a model compiled next traces no packing), moved off it drops them.
    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.ops.w4a16.format import Int4Weight

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(qwen3_moe(num_hidden_layers=1)).eval().half()
    tilegemm.nn.quantize_experts_(m, group_size=32)
    block = m.model.layers[0].mlp.experts
    assert not moe._kept_layouts(block, "down_proj") and not moe._kept_layouts(block, "gate_up_proj")
    x, idx, weights = torch.randn(3, 32).half(), torch.randint(0, 4, (3, 2)), torch.rand(3, 2).half()
    with torch.no_grad():
        before = block(x, idx, weights)
    kept = {"on": True}
    monkeypatch.setattr(dispatch, "keeps_fragments", lambda group_k, K, device: kept["on"])
    block.cpu()
    assert _kept_fragments_used(block) and moe._kept_layouts(block, "gate_up_proj")  # (gate/up's: the gated order)
    w = moe._int4(block, "down_proj")
    fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments()
    assert all(torch.equal(a, b) for a, b in zip(w._frag, fresh))
    kept["on"] = False
    block.cpu()
    assert not moe._kept_layouts(block, "down_proj") and not moe._kept_layouts(block, "gate_up_proj")
    assert moe._int4(block, "down_proj")._frag is None
    with torch.no_grad():
        assert torch.equal(block(x, idx, weights), before)


@pytest.mark.parametrize("change", ["assigned", "data", "functional_call", "compiled after a write",
                                    "written after tracing"])
def test_kept_fragments_are_not_read_for_other_parts(monkeypatch, change, device, keep_fragments):
    # The kept layouts stand for the very parts they were made of: parts replaced (assignment, a .data swap,
    # torch.func.functional_call) or written before a compiled graph runs must not be read through the old layouts
    # (the decode kernel would compute with the weight the block had).
    import pickle

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(qwen3_moe(num_hidden_layers=1)).eval().half().to(device)
    tilegemm.nn.quantize_experts_(m, group_size=32)  # kept as on a Hopper GPU (keep_fragments), run as here
    block = m.model.layers[0].mlp.experts
    assert _kept_fragments_used(block)
    for copied in (copy.deepcopy(block), pickle.loads(pickle.dumps(block)), block.float()):  # copies keep theirs
        assert _kept_fragments_used(copied), copied
    assert moe._fragments_current(block, "down_proj")  # (.float() moved the layouts with the parts)
    seen = []
    real = moe.grouped_matmul

    def spy(x, w, *args, **kwargs):  # down's product
        seen.append(w._frag is not None)
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(moe, "grouped_matmul", spy)
    x, idx, weights = (t.to(device) for t in (torch.randn(3, 32).half(), torch.randint(0, 4, (3, 2)),
                                              torch.rand(3, 2).half()))
    scales = block.tilegemm_down_proj_scales
    with torch.no_grad():
        if change == "assigned":
            block.tilegemm_down_proj_scales = scales * 2
        elif change == "data":
            block.tilegemm_down_proj_scales.data = scales * 2
        elif change == "compiled after a write":
            scales.mul_(2)
        if change == "functional_call":
            parts = {"tilegemm_down_proj_scales": scales * 2}
            got = torch.func.functional_call(block, parts, (x, idx, weights))
            assert seen[-1] is False  # down's product ran on the parts it was given
            block.tilegemm_down_proj_scales = scales * 2
            assert not _kept_fragments_used(block)
            block.tilegemm_down_proj_scales = scales
        elif change == "compiled after a write":
            # the layouts go into the graph (its trace reads no version); the op leaves them when it runs
            import tilegemm.ops.grouped.op as grouped_op

            ran = []
            run = grouped_op.forward_int4
            monkeypatch.setattr(grouped_op, "forward_int4", lambda *a: ran.append(a[10] is not None) or run(*a))
            torch.compiler.reset()
            got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, idx, weights)
            assert ran == [True, False]  # gate/up's unwritten layout read, down's written one not
            torch.compiler.reset()
        elif change == "written after tracing":  # the same graph runs again (it guards no version)
            import tilegemm.ops.grouped.op as grouped_op

            monkeypatch.setattr(moe, "grouped_matmul", real)  # (the spy's list, traced, would be guarded)
            ran = []
            run = grouped_op.forward_int4
            monkeypatch.setattr(grouped_op, "forward_int4", lambda *a: ran.append(a[10] is not None) or run(*a))
            torch.compiler.reset()
            compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
            compiled(x, idx, weights)
            assert ran == [True, True]
            scales.mul_(2)
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled(x, idx, weights)
            assert ran[2:] == [True, False]
            torch.compiler.reset()
        else:
            assert not _kept_fragments_used(block)  # dropped; a decode call remakes them of the new parts
            got = block(x, idx, weights)
            assert seen[-1] is False
        if change != "functional_call":
            from tilegemm.ops.w4a16.format import Int4Weight

            w = moe._int4(block, "down_proj")
            fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape)
            if w._frag is not None:
                assert all(torch.equal(a, b) for a, b in zip(w._frag, fresh.fragments()))
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "swapped twice"])
def test_kept_fragments_of_copies_and_swapped_storages_follow_their_parts(monkeypatch, how):
    # A copy records its layouts again of its own copied parts (then written, they are not read); two .data = swaps
    # in a row, the second storage perhaps at the first's freed address and no version bumped, are seen too.
    import pickle

    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.ops.w4a16.format import Int4Weight

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(qwen3_moe(num_hidden_layers=1)).eval().half()
    with monkeypatch.context() as patched:
        patched.setattr(dispatch, "frag_usable", lambda group_k, K, device: True)
        tilegemm.nn.quantize_experts_(m, group_size=32)
    block = m.model.layers[0].mlp.experts
    assert _kept_fragments_used(block)
    if how == "swapped twice":
        for factor in (2, 3):
            block.tilegemm_down_proj_scales.data = block.tilegemm_down_proj_scales.data * factor
    else:
        block = copy.deepcopy(block) if how == "deepcopy" else pickle.loads(pickle.dumps(block))
        assert _kept_fragments_used(block)  # its own, standing for its own parts
        with torch.no_grad():
            block.tilegemm_down_proj_scales.mul_(2)
    w = moe._int4(block, "down_proj")
    assert w.scales is block.tilegemm_down_proj_scales
    if w._frag is not None:
        fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments()
        assert all(torch.equal(a, b) for a, b in zip(w._frag, fresh))


def _act_order_(model, seed=0):
    """Give every 4-bit experts block of ``model`` an input order an expert (act-order), both weights."""
    from tilegemm.ops.w4a16.format import Int4Weight

    gen = torch.Generator().manual_seed(seed)
    for _, block in moe._experts_modules_all(model):
        ws = {}
        for name in ("gate_up_proj", "down_proj"):
            w = moe._int4(block, name)
            perm = torch.stack([torch.randperm(w.shape[-1], generator=gen) for _ in range(w.shape[0])]).to(w.device)
            ws[name] = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, perm)
        moe.install_int4_experts_(block, ws)


@pytest.mark.parametrize("saved_act_order", [True, False])
def test_load_state_dict_takes_the_saved_input_orders(saved_act_order, device):
    # A saved quantized model's experts load into a quantized one whether or not either is act-order: the
    # perm buffers follow the state dict (none left over, none dropped), so the loaded model computes as the saved.
    saved, target = _two_quantized_models(device)
    _act_order_(saved if saved_act_order else target)
    target.load_state_dict(saved.state_dict())
    assert sorted(target.state_dict()) == sorted(saved.state_dict())
    ids = torch.randint(0, 64, (1, 6), device=device)
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, saved(ids).logits, rtol=0, atol=0)


def test_to_empty_from_meta_packs_no_experts(monkeypatch):
    # to_empty gives the parts memory but no values: the layouts are made by the load that follows, not packed of
    # the empty parts first
    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.ops.w4a16 import format

    monkeypatch.setattr(dispatch, "keeps_fragments", lambda group_k, K, device: device.type != "meta")
    packs = []
    real = format.pack_fragments
    monkeypatch.setattr(format, "pack_fragments", lambda *a, **k: packs.append(1) or real(*a, **k))
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(qwen3_moe(num_hidden_layers=1)).eval().half()
    tilegemm.nn.quantize_experts_(m, group_size=32)
    block = m.model.layers[0].mlp.experts.to_empty(device="cpu")
    assert not packs and not moe._kept_layouts(block, "down_proj")
