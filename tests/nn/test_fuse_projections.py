"""tilegemm.nn.fuse_projections_: sibling 4-bit projections of one input joined into one product. The model computes
what it did (any call order, other inputs, inputs changed in place), keeps its state dict, loads one, copies,
compiles, and leaves the groups it cannot join."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from tilegemm import w4a16
from tilegemm.nn import Int4Linear, fuse_projections_, quantize_
from tilegemm.nn.fuse import FusedProjections, ProjectionPart

from conftest import assert_rel_close


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Attention(nn.Module):
    """q, k, v of one input (GQA widths), o of their product."""

    def __init__(self, d=64, kv=32, bias=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d, bias), nn.Linear(d, kv, bias), nn.Linear(d, kv, bias)
        self.o_proj = nn.Linear(kv, d)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(k * v) + q


def _pair(device, bias=False, dtype=torch.float16, group_size=32):
    torch.manual_seed(0)
    ref = quantize_(Attention(bias=bias).to(device=device, dtype=dtype), group_size=group_size)
    return ref, fuse_projections_(copy.deepcopy(ref))


@pytest.mark.parametrize("bias", [False, True])
def test_same_outputs_and_state_dict(device, bias):
    ref, fused = _pair(device, bias)
    assert fused.tilegemm_fused == [("", ("q_proj", "k_proj", "v_proj"))]
    assert isinstance(fused.q_proj, ProjectionPart) and isinstance(fused.tilegemm_q_proj_k_proj_v_proj,
                                                                   FusedProjections)
    assert type(fused.o_proj) is Int4Linear
    x = torch.randn(3, 5, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), rtol=2e-3, atol=2e-3)
    sd, sr = fused.state_dict(), ref.state_dict()
    assert list(sd) == list(sr) and all(torch.equal(sd[k], sr[k]) for k in sr)
    assert fused.q_proj.out_features == 64 and fused.k_proj.out_features == 32
    assert torch.equal(fused.k_proj.weight.qweight, ref.k_proj.weight.qweight)
    if bias:
        assert torch.equal(fused.v_proj.bias, ref.v_proj.bias)


def test_one_product_for_the_parts_of_one_input(device, monkeypatch):
    ref, fused = _pair(device)
    calls = []
    real = FusedProjections.forward
    monkeypatch.setattr(FusedProjections, "forward", lambda self, x: calls.append(x.shape) or real(self, x))
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        fused(x)
    assert len(calls) == 1 and fused.tilegemm_q_proj_k_proj_v_proj._pending is None  # nothing kept after


def test_hooks_on_the_joined_layer_see_its_calls(device):
    # an activation collector hooks every Int4Linear, the joined one among them: its hooks run once a product
    ref, fused = _pair(device)
    joined, seen = fused.tilegemm_q_proj_k_proj_v_proj, []
    joined.register_forward_hook(lambda mod, args, out: seen.append((args[0].shape, out.shape)))
    joined.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))  # q, k and v of zeros: out = o_proj's bias
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        out = fused(x)
        want = ref.o_proj(torch.zeros(4, 32, device=device, dtype=torch.float16))
    assert seen == [((4, 64), (4, 128))]
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)


def test_any_call_order_other_inputs_and_inputs_changed_in_place(device):
    ref, fused = _pair(device)
    x, y = (torch.randn(4, 64, device=device, dtype=torch.float16) for _ in range(2))
    with torch.no_grad():
        want = {n: getattr(ref, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
        assert_rel_close(fused.v_proj(x), want["v_proj"].double(), 2e-3)  # v first
        assert_rel_close(fused.k_proj(y), ref.k_proj(y).double(), 2e-3)  # another input: a product of its own
        assert_rel_close(fused.q_proj(x), want["q_proj"].double(), 2e-3)
        assert_rel_close(fused.v_proj(x), want["v_proj"].double(), 2e-3)  # twice the same part
        fused.q_proj(x)  # q and k of x kept for their calls ...
        x.mul_(-1.0)  # ... until x changes in place
        assert_rel_close(fused.k_proj(x), ref.k_proj(x).double(), 2e-3)


class InPlaceAttention(Attention):
    """Scales its query in place (as some attention forwards do)."""

    def forward(self, x):
        q = self.q_proj(x)
        q.mul_(0.5)
        k, v = self.k_proj(x), self.v_proj(x)
        k.add_(1.0)
        return self.o_proj(k * v) + q


def test_outputs_changed_in_place_under_autograd(device):
    """A part's output is a view of the joined product: changed in place under autograd it still gives the
    unjoined model's output and input gradient (each part's view is its own, not one of several made together)."""
    _same_output_and_input_gradient(InPlaceAttention, device)


def _same_output_and_input_gradient(model_class, device):
    """The joined model of ``model_class`` gives the unjoined one's output and input gradient."""
    torch.manual_seed(0)
    ref = quantize_(model_class().to(device=device, dtype=torch.float16), group_size=32)
    fused = fuse_projections_(copy.deepcopy(ref))
    assert isinstance(fused.q_proj, ProjectionPart)
    x = torch.randn(3, 64, device=device, dtype=torch.float16)
    grads = []
    for model in (ref, fused):
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.float().square().sum().backward()
        grads.append((out.detach(), xi.grad))
    assert_rel_close(grads[1][0], grads[0][0].double(), 2e-3)
    assert_rel_close(grads[1][1], grads[0][1].double(), 2e-3)


class SavedThenInPlaceAttention(Attention):
    """Uses q and k in a product that keeps them for backward, then changes v in place."""

    def forward(self, x):
        q, k = self.q_proj(x), self.k_proj(x)
        s = q[..., :32] * k
        v = self.v_proj(x)
        v.mul_(2.0)
        return self.o_proj(s * v)


def test_a_part_changed_in_place_leaves_the_others_saved_for_backward(device):
    """One part's output changed in place under autograd does not change another part's saved for backward (as
    unjoined projections' outputs, each has its own version counter)."""
    _same_output_and_input_gradient(SavedThenInPlaceAttention, device)


def test_inference_mode(device):
    # activations made in inference mode have no version counter: the same tensor is taken as unchanged
    ref, fused = _pair(device, bias=True)
    with torch.inference_mode():
        x = torch.randn(4, 64, device=device, dtype=torch.float16)
        torch.testing.assert_close(fused(x), ref(x), rtol=2e-3, atol=2e-3)
        assert fused.tilegemm_q_proj_k_proj_v_proj._pending is None


class CrossAttention(Attention):
    """q of one input, k and v of another (an encoder's output)."""

    def forward(self, x, memory):
        q, k, v = self.q_proj(x), self.k_proj(memory), self.v_proj(memory)
        return self.o_proj(k * v) + q


def test_copies_and_saves_leave_the_kept_outputs_behind(device):
    # cross-attention leaves q's product of the memory kept (its part never asks for it), part of the autograd
    # graph where the input requires grad: a copy of the model neither fails on it nor carries it
    torch.manual_seed(0)
    ref = quantize_(CrossAttention().to(device=device, dtype=torch.float16), group_size=32)
    fused = fuse_projections_(copy.deepcopy(ref))
    x, memory = (torch.randn(3, 64, device=device, dtype=torch.float16, requires_grad=True) for _ in range(2))
    out = fused(x, memory)
    assert fused.tilegemm_q_proj_k_proj_v_proj._pending is not None
    twin = copy.deepcopy(fused)
    assert twin.tilegemm_q_proj_k_proj_v_proj._pending is None
    buf = io.BytesIO()
    torch.save(fused, buf)
    assert torch.load(io.BytesIO(buf.getvalue()), weights_only=False).tilegemm_q_proj_k_proj_v_proj._pending is None
    out.float().sum().backward()  # (which frees the kept outputs' graph: they are dropped)
    assert fused.tilegemm_q_proj_k_proj_v_proj._pending is None
    with torch.no_grad():
        torch.testing.assert_close(twin(x, memory), ref(x, memory), rtol=2e-3, atol=2e-3)


def test_an_fp32_modules_biases_keep_their_dtype(device):
    # an fp32 module's biases are fp32 (its scales 16-bit): saved and loaded as such, not rounded to the scales'
    torch.manual_seed(0)
    ref = quantize_(Attention(bias=True).to(device=device, dtype=torch.float32), group_size=32)
    fused = fuse_projections_(copy.deepcopy(ref))
    sd, sr = fused.state_dict(), ref.state_dict()
    assert all(sd[k].dtype == sr[k].dtype and torch.equal(sd[k], sr[k]) for k in sr)
    other = {k: v + 1e-4 if k.endswith("bias") else v for k, v in sr.items()}
    fused.load_state_dict(other), ref.load_state_dict(other)
    assert torch.equal(fused.k_proj.bias, ref.k_proj.bias) and fused.k_proj.bias.dtype == torch.float32


def test_a_kept_output_is_not_served_in_another_grad_mode(device):
    ref, fused = _pair(device)
    x = torch.randn(4, 64, device=device, dtype=torch.float16, requires_grad=True)
    with torch.no_grad():
        fused.q_proj(x)  # k and v kept, computed without a graph
    k = fused.k_proj(x)  # grad mode on: a product of its own
    assert k.grad_fn is not None
    with torch.no_grad():
        fused.q_proj(x)
    fused.half()  # converted: nothing kept from before
    assert fused.tilegemm_q_proj_k_proj_v_proj._pending is None


def test_a_backward_or_requires_grad_between_two_parts_calls(device):
    # a backward through one part freed the joined product's graph, which the kept outputs shared (the next part's
    # backward failed), and x made to require grad after the first part's call got a kept output without a graph
    ref, fused = _pair(device)
    for model in (ref, fused):
        x = torch.randn(4, 64, device=device, dtype=torch.float16, requires_grad=True)
        model.q_proj(x).float().sum().backward()
        model.k_proj(x).float().sum().backward()
        ones = torch.ones(4, 1, dtype=torch.float64, device=device)
        want = ones * (w4a16.dequantize(ref.q_proj.weight).double().sum(0)
                       + w4a16.dequantize(ref.k_proj.weight).double().sum(0))
        assert_rel_close(x.grad, want, 2e-3)
        x = torch.randn(4, 64, device=device, dtype=torch.float16)
        model.q_proj(x)
        x.requires_grad_(True)
        assert model.k_proj(x).requires_grad


def test_gradients_reach_the_input(device):
    ref, fused = _pair(device, bias=True)
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).float().square().sum().backward()
    fused(xf).float().square().sum().backward()
    assert_rel_close(xf.grad, xr.grad.double(), 5e-3)


def test_load_state_dict_copy_save_and_dtype(device):
    ref, fused = _pair(device)
    torch.manual_seed(1)
    other = quantize_(Attention().to(device=device, dtype=torch.float16), group_size=32)
    fused.load_state_dict(other.state_dict())
    x = torch.randn(2, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        want = other(x)
        torch.testing.assert_close(fused(x), want, rtol=2e-3, atol=2e-3)
        twin = copy.deepcopy(fused)
        assert twin.q_proj.fused is twin.tilegemm_q_proj_k_proj_v_proj
        buf = io.BytesIO()
        torch.save(fused, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        for model in (twin, loaded):
            torch.testing.assert_close(model(x), want, rtol=2e-3, atol=2e-3)
        bf = copy.deepcopy(fused).to(torch.bfloat16)
        assert bf.tilegemm_q_proj_k_proj_v_proj.scales.dtype == torch.bfloat16
    # a state dict of another group size does not fit the joined weight: named, the model unchanged
    coarse = quantize_(Attention().to(device=device, dtype=torch.float16), group_size=64)
    with pytest.raises(RuntimeError, match="q_proj is one part of fused projections .* group size 32; the state dict "
                                           "holds group size 64"):  # (one group of K = 64, recorded as made)
        fused.load_state_dict(coarse.state_dict())
    with torch.no_grad():  # (torch's load put o_proj's bias in place: only the parts are checked)
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(getattr(fused, name)(x), getattr(other, name)(x), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("bias", [False, True])
def test_a_model_built_on_meta_loads_with_assign(device, bias):
    # build on meta, quantize, join, then load real tensors with assign=True (as loaders that skip the first
    # allocation do): the joined tensors are made where the loaded ones are; they stayed meta, the load a no-op
    ref, _ = _pair(device, bias)
    with torch.device("meta"):
        model = Attention(bias=bias).half()
    fuse_projections_(quantize_(model, group_size=32))
    model.load_state_dict(ref.state_dict(), strict=True, assign=True)
    assert not any(t.is_meta for t in model.tilegemm_q_proj_k_proj_v_proj.buffers())
    x = torch.randn(2, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=2e-3, atol=2e-3)
    sd, sr = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], sr[k]) for k in sr)


def test_act_order_projections_of_one_order(device):
    # act-order weights (stored input j is x's input perm[j]) join where they share the permutation, as the
    # projections of one input do; another permutation leaves the group alone
    torch.manual_seed(0)
    K, perm = 64, torch.randperm(64)

    def act_order(n, p):
        w = w4a16.quantize(torch.randn(n, K, dtype=torch.float16), group_size=32)
        return Int4Linear.from_weight(w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape, p))

    block = nn.Module()
    block.gate_proj, block.up_proj = act_order(48, perm), act_order(48, perm)
    ref = copy.deepcopy(block).to(device)
    fused = fuse_projections_(block.to(device))
    assert fused.tilegemm_fused == [("", ("gate_proj", "up_proj"))]
    assert torch.equal(fused.tilegemm_gate_proj_up_proj.perm.cpu(), perm)
    x = torch.randn(3, K, device=device, dtype=torch.float16)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            assert_rel_close(getattr(fused, name)(x), getattr(ref, name)(x).double(), 2e-3)
    other = nn.Module()
    other.gate_proj, other.up_proj = act_order(48, perm), act_order(48, torch.randperm(64))
    assert fuse_projections_(other).tilegemm_fused == []


def test_groups_left_alone(device):
    torch.manual_seed(0)
    m = quantize_(Attention().to(device=device, dtype=torch.float16), group_size=32)
    m.k_proj.register_forward_hook(lambda *a: None)  # hooked
    assert fuse_projections_(m).tilegemm_fused == []
    m = quantize_(Attention().to(device=device, dtype=torch.float16), group_size=32)
    m.v_proj = m.k_proj  # held twice
    assert fuse_projections_(m).tilegemm_fused == []
    m = Attention().to(device=device, dtype=torch.float16)  # not 4-bit
    assert fuse_projections_(m).tilegemm_fused == []
    m = quantize_(Attention(bias=True).to(device=device, dtype=torch.float16), group_size=32)
    m.k_proj.bias = None  # a bias on some only
    assert fuse_projections_(m).tilegemm_fused == []
    m = quantize_(Attention().to(device=device, dtype=torch.float16), group_size=32)
    m.q_proj = Int4Linear.from_linear(nn.Linear(64, 64).to(device=device, dtype=torch.float16), group_size=64)
    assert fuse_projections_(m).tilegemm_fused == []  # another group size
    assert fuse_projections_(_pair(device)[1]).tilegemm_fused == [("", ("q_proj", "k_proj", "v_proj"))]  # once


def test_projections_with_a_trained_bias_are_left(device):
    # the joined bias is a buffer: fusing would drop the biases from parameters() and stop their training silently
    torch.manual_seed(0)
    m = quantize_(Attention(bias=True).to(device=device, dtype=torch.float16), group_size=32)
    m.k_proj.bias.requires_grad_(True)
    assert fuse_projections_(m).tilegemm_fused == []
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["k_proj.bias"]


def test_bad_arguments():
    with pytest.raises(TypeError, match="fuse_projections_ takes a torch.nn.Module"):
        fuse_projections_([])
    with pytest.raises(ValueError, match="groups must be tuples of two or more"):
        fuse_projections_(nn.Linear(2, 2), groups=[("q_proj",)])
    with pytest.raises(TypeError, match="made by tilegemm.nn.fuse_projections_"):
        FusedProjections()


def test_transformers_llama_and_qwen2_and_compiled(device):
    transformers = pytest.importorskip("transformers")
    # llama in two layers (each layer's groups joined), qwen2 in one (compiled below: its one graph is the point)
    for arch, layers in (("llama", 2), ("qwen2", 1)):  # qwen2: q, k, v with biases
        torch.manual_seed(0)
        cfg = transformers.AutoConfig.for_model(arch, vocab_size=96, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=layers, num_attention_heads=4,
                                                num_key_value_heads=2, max_position_embeddings=32)
        ref = quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=torch.float16),
                        group_size=32).eval()
        fused = fuse_projections_(copy.deepcopy(ref))
        assert len(fused.tilegemm_fused) == 2 * layers, fused.tilegemm_fused  # q/k/v and gate/up in each layer
        ids = torch.randint(0, 96, (2, 6), device=device)
        with torch.no_grad():
            want = ref(ids).logits
            assert_rel_close(fused(ids).logits, want.double(), 2e-3)
    # on the CPU aot_eager (as the suite's other CPU compiles): the one graph is the point, and inductor's cold C++
    # build of the model's torch ops takes half a minute there
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    with torch.no_grad():
        assert_rel_close(compiled(ids).logits, want.double(), 2e-3)


def test_dequantized_copy_of_a_joined_model(device):
    # the dense twin the benches compare with: each part's weight and bias, as the unjoined model's
    transformers = pytest.importorskip("transformers")
    from tilegemm.models.pretrained import dequantized_copy

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    ref = quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=torch.float16),
                    group_size=32).eval()
    dense_ref = dequantized_copy(ref)
    dense = dequantized_copy(fuse_projections_(copy.deepcopy(ref)))
    for (name, a), (_, b) in zip(dense_ref.named_parameters(), dense.named_parameters()):
        assert torch.equal(a, b), name


def test_tensor_parallel_styles_refuse_joined_projections():
    import tilegemm.parallel as tp

    _, fused = _pair("cpu")
    for style in (tp.ColwiseParallel(), tp.RowwiseParallel()):
        for module in (fused.k_proj, fused.tilegemm_q_proj_k_proj_v_proj):
            with pytest.raises(TypeError, match="joined by tilegemm.nn.fuse_projections_ cannot be parallelized"):
                style._apply(module, None)


def test_symbolic_trace_of_joined_projections(device):
    """torch.fx.symbolic_trace records each part as a call_module node; the traced module runs the joined product
    once an input, as the model does."""
    ref, fused = _pair(device)
    gm = torch.fx.symbolic_trace(fused)
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["q_proj", "k_proj", "v_proj", "o_proj"]
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(gm(x), fused(x))
        assert_rel_close(gm(x), ref(x).double(), 2e-3)
