"""tilegemm.nn.absorb_act_order_: an act-order down projection's input order moved into the gate and up projections'
output rows. The MLP's outputs stay the same (to rounding); a forward that does not fit is put back; then
fuse_projections_."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from tilegemm import w4a16
from tilegemm.nn import Int4Linear, fuse_projections_
from tilegemm.nn.act_order import absorb_act_order_


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _int4(n, k, perm=None, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = w4a16.quantize(torch.randn(n, k, generator=g, dtype=torch.float32).half(), group_size=32)
    if perm is not None:  # the stored inputs in another order: x[..., perm] multiplies them
        w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape, perm)
    b = torch.randn(n, generator=g).half() if bias else None
    return Int4Linear.from_weight(w, b)


class MLP(nn.Module):
    def __init__(self, h=64, i=64, bias=False, norm=False, input_perm=None, dropout=0.0):  # i: two groups of 32
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.gate_proj = _int4(i, h, input_perm, bias, 1)
        self.up_proj = _int4(i, h, input_perm, bias, 2)
        self.down_proj = _int4(h, i, torch.randperm(i, generator=torch.Generator().manual_seed(3)), bias, 4)
        self.norm = nn.LayerNorm(i).half() if norm else None  # a norm over the intermediate features, with a
        if norm:  # weight of its own a feature (a uniform one would commute with the reordering)
            nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x):
        h = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(self.drop(self.norm(h) if self.norm is not None else h))


@pytest.mark.parametrize("bias, input_perm", [(False, None), (True, None), (False, torch.randperm(64))])
def test_outputs_bit_for_bit_and_no_reorder_left(device, bias, input_perm):
    model = nn.Sequential(MLP(bias=bias, input_perm=input_perm)).to(device)
    ref = copy.deepcopy(model)
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["0"] and model.tilegemm_act_order_kept == []
    assert model[0].down_proj.perm.numel() == 0
    # the gate and up projections keep their own input order
    assert model[0].gate_proj.perm.numel() == (0 if input_perm is None else 64)
    for m in (1, 33):  # gemv's rows, then mma's over two row tiles
        x = torch.randn(m, 64, device=device, dtype=torch.float16)
        with torch.no_grad():
            a, b = model(x), ref(x)  # (bit for bit under the interpreter; a GPU kernel may sum in another order)
            assert (a.float() - b.float()).norm() <= 1e-3 * b.float().norm(), m


def test_biases_being_trained_stay_trainable(device):
    # the reordered gate and up projections were made with frozen biases: a bias fine-tune stopped training them
    model = nn.Sequential(MLP(bias=True)).to(device)
    for part in ("gate_proj", "up_proj", "down_proj"):
        getattr(model[0], part).bias.requires_grad_(True)
    ref = copy.deepcopy(model)
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["0"]
    x = torch.randn(3, 64, device=device, dtype=torch.float16)
    model(x).float().sum().backward()
    ref(x).float().sum().backward()
    perm = ref[0].down_proj.perm.to(device)
    for part in ("gate_proj", "up_proj"):
        bias, bias_ref = getattr(model[0], part).bias, getattr(ref[0], part).bias
        assert bias.requires_grad and bias.grad is not None
        torch.testing.assert_close(bias.grad.float(), bias_ref.grad[perm].float(), rtol=2e-2, atol=2e-2)
    assert model[0].down_proj.bias.requires_grad


def test_a_forward_that_does_not_fit_is_put_back(device):
    model = nn.Sequential(MLP(norm=True)).to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == [] and model.tilegemm_act_order_kept == ["0"]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_natural_order_and_mismatched_widths_are_left(device):
    model = nn.Sequential(MLP()).to(device)
    model[0].down_proj = _int4(64, 64).to(device)  # no perm
    assert absorb_act_order_(model).tilegemm_act_order_absorbed == []
    with pytest.raises(TypeError, match="absorb_act_order_ takes a torch.nn.Module"):
        absorb_act_order_(None)
    with pytest.raises(ValueError, match="three attribute names"):
        absorb_act_order_(model, names=("gate_proj", "up_proj"))


def test_transformers_llama_then_joined(device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=torch.float16).eval()
    for i, layer in enumerate(model.model.layers):  # act-order down projections, as a GPTQ desc_act checkpoint has
        layer.mlp.down_proj = _int4(64, 96, torch.randperm(96), seed=10 + i).to(device)
        layer.mlp.gate_proj = _int4(96, 64, seed=20 + i).to(device)
        layer.mlp.up_proj = _int4(96, 64, seed=30 + i).to(device)
    ref = copy.deepcopy(model)
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["model.layers.0.mlp", "model.layers.1.mlp"]
    fuse_projections_(model)
    assert ("model.layers.0.mlp", ("gate_proj", "up_proj")) in model.tilegemm_fused
    ids = torch.randint(0, 96, (2, 5), device=device)
    with torch.no_grad():
        a, b = model(ids).logits.float(), ref(ids).logits.float()
        assert (a - b).norm() <= 1e-3 * b.norm()


class ExtraArgMLP(MLP):  # a forward taking more than the hidden states (transformers' DiffusionGemma has one)
    def forward(self, x, scale):
        return super().forward(x) * scale


class ThreeDimMLP(MLP):  # a forward reading batch and sequence from the shape (transformers' DogeCDMoE)
    def forward(self, x):
        b, s, h = x.shape
        return super().forward(x.view(b * s, h)).view(b, s, -1)


def test_a_forward_the_probe_cannot_run_is_kept_unchanged(device):
    model = nn.Sequential(MLP(), ExtraArgMLP(), ThreeDimMLP()).to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["0", "2"] and model.tilegemm_act_order_kept == ["1"]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("1."))


def test_a_model_on_the_meta_device_is_kept_unchanged():
    model = nn.Sequential(MLP()).to("meta")
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == [] and model.tilegemm_act_order_kept == ["0"]
    assert model[0].down_proj.perm.shape == (64,) and model[0].gate_proj.perm.numel() == 0


def _experts_block(device):
    """tilegemm's own experts block (the layout flags of transformers' ones) with act-order 4-bit down experts."""
    from tilegemm.nn import moe

    g = torch.Generator().manual_seed(5)
    holder = nn.Module()
    holder.experts = moe.StackedExperts(torch.randn(4, 64, 64, generator=g).half(),
                                        torch.randn(4, 64, 32, generator=g).half(), nn.SiLU(), is_transposed=False)
    holder.to(device)
    assert moe.quantize_experts_(holder, group_size=32) == ["experts"]
    down = moe._int4(holder.experts, "down_proj")
    perms = torch.stack([torch.randperm(32, generator=g) for _ in range(4)]).to(device)
    moe.install_int4_experts_(holder.experts, {"down_proj": w4a16.Int4Weight(
        down.qweight, down.scales, down.zeros, down.group_size, down.shape, perms)})
    return holder


def test_experts_on_the_meta_device_are_kept_unchanged():
    holder = _experts_block("cpu").to("meta")
    absorb_act_order_(holder)
    assert holder.tilegemm_act_order_absorbed == [] and holder.tilegemm_act_order_kept == ["experts"]
    assert holder.experts.tilegemm_down_proj_perm.shape == (4, 32)


def test_a_model_in_training_mode_is_probed_in_eval_mode(device):
    # dropout draws other masks on each run: the probe in eval mode, the model's flags and the global RNG as they were
    model = nn.Sequential(MLP(dropout=0.5)).to(device).train()
    model[0].up_proj.eval()
    rng = torch.random.get_rng_state()
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["0"] and model.tilegemm_act_order_kept == []
    assert torch.equal(rng, torch.random.get_rng_state())
    assert model.training and model[0].drop.training and model[0].gate_proj.training and model[0].down_proj.training
    assert not model[0].up_proj.training


def test_under_inference_mode_the_model_keeps_normal_tensors(device):
    model = nn.Sequential(MLP(bias=True)).to(device)
    holder = _experts_block(device)
    with torch.inference_mode():
        absorb_act_order_(model)
        absorb_act_order_(holder)  # (the experts' buffers made here were inference tensors, which _int4 cannot key)
    assert model.tilegemm_act_order_absorbed == ["0"] and holder.tilegemm_act_order_absorbed == ["experts"]
    assert not any(t.is_inference() for t in [*model.state_dict().values(), *holder.state_dict().values()])
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # (in place: refused on inference tensors)
    holder.load_state_dict(copy.deepcopy(holder.state_dict()))


def test_parts_with_backward_hooks_are_left(device):
    model = nn.Sequential(MLP(), MLP()).to(device)
    model[0].gate_proj.register_full_backward_hook(lambda *args: None)
    model[1].down_proj.register_full_backward_pre_hook(lambda *args: None)
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == []
    assert model[0].gate_proj._backward_hooks and model[1].down_proj._backward_pre_hooks


def test_the_probe_runs_without_the_users_forward_hooks(device):
    """Forward hooks on the MLP and inside it (recording activations, say) do not see the probe's runs, and stay."""
    model = nn.Sequential(MLP()).to(device)
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append("mlp"))
    model[0].drop.register_forward_pre_hook(lambda m, args: seen.append("drop"))
    x = torch.randn(3, 64, device=device).half()
    with torch.no_grad():
        want = model(x)
    assert seen == ["drop", "mlp"]
    seen.clear()
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["0"] and seen == []
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert seen == ["drop", "mlp"]  # the hooks are the module's still


def test_the_probe_runs_without_global_module_hooks(device):
    """Global module hooks (torch.nn.modules.module.register_module_forward_hook / _pre_hook: a profiler's or an
    activation recorder's) do not see the probe's runs either, and see every forward after it, in their order."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    model = nn.Sequential(MLP()).to(device)
    seen = []
    x = torch.randn(3, 64, device=device).half()
    handles = [register_module_forward_pre_hook(lambda m, args: seen.append(("pre", type(m).__name__))),
               register_module_forward_hook(lambda m, args, out: seen.append(("post", type(m).__name__))),
               register_module_forward_hook(lambda m, args, out: seen.append(("post2", type(m).__name__)))]
    try:
        with torch.no_grad():
            want = model(x)
        first = list(seen)
        assert ("pre", "MLP") in first and ("post", "Int4Linear") in first
        seen.clear()
        absorb_act_order_(model)
        assert model.tilegemm_act_order_absorbed == ["0"] and seen == []
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert seen == first  # the same hooks, in the same order
        handles.pop().remove()  # their handles still remove them
        seen.clear()
        with torch.no_grad():
            model(x)
        assert seen and all(kind != "post2" for kind, _ in seen)
    finally:
        for h in handles:
            h.remove()


def test_absorbing_after_joining_says_so(device):
    # joined first, gate and up are one layer's rows: down keeps its order (the values are right), and the call
    # says why instead of doing nothing silently
    from tilegemm.nn import fuse_projections_

    model = fuse_projections_(nn.Sequential(MLP()).to(device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        absorb_act_order_(model)
    assert any("joined already (fuse_projections_)" in str(w.message) and "absorb first, then join" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert model.tilegemm_act_order_absorbed == [] and model[0].down_proj.perm.numel() == 64
