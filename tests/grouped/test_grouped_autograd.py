"""Autograd of tilegemm.grouped_mm against the oracle's (a loop of products, differentiated by torch); the
torch.library op under opcheck and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped.op import grouped_mm_op
from tilegemm.ops.grouped.reference import grouped_mm_reference

from conftest import assert_rel_close
from test_grouped_layouts import operands


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_gradients_match_the_reference(layout, device):
    a, b, offs = operands(layout, [3, 0, 17, 1], 12, 10, torch.float32, device, tail=2, b_transposed=True)
    a.requires_grad_()
    b.requires_grad_()
    N = b.shape[-1]
    bias = torch.randn(N if layout == "3d2d" else (4, N), device=device, requires_grad=True)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, b, bias), grad)
    want = torch.autograd.grad(grouped_mm_reference(a, b, offs, bias=bias, dtype=torch.float64),
                               (a, b, bias), grad.double())
    for name, g, w in zip(("a", "b", "bias"), got, want):
        assert g.shape == w.shape, name
        assert_rel_close(g, w, 1e-5)


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d"])
def test_fp32_gradients_of_fp16_operands_keep_their_range(layout, device):
    # out_dtype fp32 of fp16 operands: a gradient past fp16's range whose products fit still gives them (cast to
    # fp16 first, it became inf and the gradients NaN), one below it too (it became zero); one inside the range
    # gives the bits of the fp16 output's backward
    a, b, offs = operands(layout, [3, 0, 5], 16, 8, torch.float16, device)
    for size, b_scale in ((1e5, 1e-3), (1e-7, 1e3)):
        bs = (b.float() * b_scale).half().requires_grad_()
        a_ = a.detach().requires_grad_()
        out = tilegemm.grouped_mm(a_, bs, offs=offs, out_dtype=torch.float32)
        grad = torch.randn(out.shape, device=device) * size
        (ga,) = torch.autograd.grad(out, a_, grad)
        (want,) = torch.autograd.grad(grouped_mm_reference(a_, bs, offs, dtype=torch.float64), a_, grad.double())
        assert ga.dtype == torch.float16 and 2 ** -14 < want.abs().max() < 1e4  # (fp16 holds them)
        assert_rel_close(ga, want, 2e-3)
    a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
    grad = torch.randn(tilegemm.grouped_mm(a, b, offs=offs).shape, device=device).half()
    grad[..., 1:, :] *= 1e-4  # (entries 1e4 times smaller than the largest: inside fp16's range, cast as they are)
    wide = torch.autograd.grad(tilegemm.grouped_mm(a_, b_, offs=offs, out_dtype=torch.float32), (a_, b_), grad.float())
    narrow = torch.autograd.grad(tilegemm.grouped_mm(a_, b_, offs=offs), (a_, b_), grad)
    assert all(torch.equal(w, n) for w, n in zip(wide, narrow))


@pytest.mark.parametrize("layout", ["2d3d", "3d2d"])
def test_a_large_gradient_no_group_reaches_leaves_the_others(layout, device):
    # out_dtype fp32 of fp16 operands: entries past offs[-1] (rows, or 3-D x 2-D's columns) reach no product, so
    # however large they set no scale (one fitted to them pushed every other entry to zero in fp16)
    a, b, offs = operands(layout, [3, 0, 5], 16, 8, torch.float16, device, tail=2)
    a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = tilegemm.grouped_mm(a_, b_, offs=offs, out_dtype=torch.float32)
    grad = torch.randn(out.shape, device=device)
    if layout == "2d3d":
        grad[8:] = 1e12
    else:
        grad[..., 8:] = 1e12
    got = torch.autograd.grad(out, (a_, b_), grad)
    want = torch.autograd.grad(grouped_mm_reference(a_, b_, offs, dtype=torch.float64), (a_, b_), grad.double())
    for g, w in zip(got, want):
        assert_rel_close(g, w, 2e-3)


def test_gradients_with_a_shared_bias(device):
    a, b, offs = operands("2d3d", [4, 0, 6], 8, 8, torch.float32, device, tail=3)
    bias = torch.randn(8, device=device, requires_grad=True)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, (bias,), grad)
    (want,) = torch.autograd.grad(grouped_mm_reference(a, b, offs, bias=bias), (bias,), grad.double())
    assert_rel_close(got, want, 1e-5)


def test_backward_is_grouped_products(device):
    # The backward runs the op itself (one call per gradient), never a loop over groups on the host.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    a, b, offs = operands("2d3d", [5, 0, 3], 8, 8, torch.float32, device)
    a.requires_grad_()
    b.requires_grad_()
    out = tilegemm.grouped_mm(a, b, offs=offs)
    with Count() as mode:
        out.backward(torch.ones_like(out))
    assert sum("tilegemm.grouped_mm" in c for c in mode.calls) == 2, mode.calls
    assert not any("item" in c or "_local_scalar_dense" in c for c in mode.calls), mode.calls


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_opcheck(layout, device):
    a, b, offs = operands(layout, [3, 0, 5], 8, 8, torch.float32, device, tail=1)
    bias = torch.randn(b.shape[-1], device=device)  # [N] (3-D x 2-D: b's 9 columns; an [8] one is refused now)
    torch.library.opcheck(torch.ops.tilegemm.grouped_mm.default,
                          (a.requires_grad_(), b.requires_grad_(), offs, bias, None, "ieee", "auto"))


def test_fake_output_shape_needs_no_values():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(100, 16)
        b = torch.empty(8, 16, 32)
        offs = torch.empty(8, dtype=torch.int32)
        out = grouped_mm_op(a, b, offs, None, None, "ieee", "auto")
        assert tuple(out.shape) == (100, 32)
        assert tuple(grouped_mm_op(a.T, a, offs, None, None, "ieee", "auto").shape) == (8, 16, 16)


@pytest.mark.parametrize("args, text", [
    (((4, 9), (9, 5), None), "offs is required"),  # the fake read offs' length: AttributeError on None
    (((9, 17), (3, 16, 5), 3), "K mismatch"),  # the fake gave a [9, 5] output
    (((2, 9, 17), (2, 3, 17, 5), None), "2-D or 3-D"),
])
def test_fake_refuses_what_the_op_refuses(args, text):
    # torch.ops.tilegemm.grouped_mm traced (or on meta tensors) runs its fake, not its body: the same checks there
    from torch._subclasses.fake_tensor import FakeTensorMode

    a_shape, b_shape, groups = args
    with FakeTensorMode():
        offs = None if groups is None else torch.empty(groups, dtype=torch.int32)
        with pytest.raises(ValueError, match=text):
            grouped_mm_op(torch.empty(a_shape), torch.empty(b_shape), offs, None, None, "ieee", "auto")
    meta = torch.empty(a_shape, device="meta"), torch.empty(b_shape, device="meta")
    offs = None if groups is None else torch.empty(groups, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=text):
        torch.ops.tilegemm.grouped_mm(*meta, offs, None, None, "ieee", "auto")


def test_fakes_of_the_gated_and_int4_ops_check():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        offs = torch.empty(3, dtype=torch.int32)
        with pytest.raises(ValueError, match="an even number of columns"):
            torch.ops.tilegemm.grouped_mm_gated(torch.empty(9, 16), torch.empty(3, 16, 9), offs, None, "silu",
                                                "ieee")
        x = torch.empty(9, 32, dtype=torch.float16)
        q, s = torch.empty(3, 8, 24, dtype=torch.int32), torch.empty(3, 1, 24, dtype=torch.float16)
        with pytest.raises(ValueError, match="K = 64"):  # x's K is 32, the weight's 64
            torch.ops.tilegemm.grouped_w4a16(x, q, s, s, offs, None, 64, "none", False, "auto")


def test_fakes_name_an_unknown_precision():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b, offs = torch.empty(9, 16), torch.empty(3, 16, 8), torch.empty(3, dtype=torch.int32)
        with pytest.raises(ValueError, match="unknown precision 'fast'"):
            torch.ops.tilegemm.grouped_mm(a, b, offs, None, None, "fast", "auto")
        with pytest.raises(ValueError, match="unknown precision 'fast'"):
            torch.ops.tilegemm.grouped_mm_gated(a, b, offs, None, "silu", "fast")


def test_torch_compile_fullgraph(device):
    def f(x, w, offs):
        return tilegemm.grouped_mm(x, w, offs=offs).relu() * 2.0

    a, b, offs = operands("2d3d", [3, 0, 9], 8, 8, torch.float32, device, tail=2)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(a, b, offs)
    assert_rel_close(out, grouped_mm_reference(a, b, offs).relu() * 2.0, 1e-5)
    # other group sizes, same shapes: the same graph
    offs2 = torch.tensor([0, 10, 12], dtype=torch.int32, device=device)
    assert_rel_close(compiled(a, b, offs2), grouped_mm_reference(a, b, offs2).relu() * 2.0, 1e-5)


def test_torch_compile_backward(device):
    a, b, offs = operands("2d3d", [3, 4], 8, 8, torch.float32, device)
    a.requires_grad_()
    b.requires_grad_()
    compiled = torch.compile(lambda x, w, o: tilegemm.grouped_mm(x, w, offs=o).sum(), fullgraph=True,
                             backend="aot_eager")
    ga, gb = torch.autograd.grad(compiled(a, b, offs), (a, b))
    wa, wb = torch.autograd.grad(grouped_mm_reference(a, b, offs).sum(), (a, b))
    assert_rel_close(ga, wa, 1e-5)
    assert_rel_close(gb, wb, 1e-5)


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
def test_gradients_with_no_groups(layout, device):
    # G = 0: the output is all past offs[-1] (zeros, or empty for 2d2d), so every gradient is zero, the bias's too
    E = torch.zeros(0, dtype=torch.int32, device=device)
    a = torch.randn((0, 6, 8) if layout == "3d2d" else (6, 8), device=device, requires_grad=True)
    b = torch.randn({"2d3d": (0, 8, 5), "2d2d": (8, 5), "3d2d": (8, 5)}[layout], device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    out = tilegemm.grouped_mm(a, b, offs=E, bias=bias)
    assert not out.isnan().any() and not out.any()
    grads = torch.autograd.grad(out, (a, b, bias), torch.randn_like(out))
    for t, g in zip((a, b, bias), grads):
        assert g.shape == t.shape and not g.isnan().any() and not g.any()
    torch.library.opcheck(torch.ops.tilegemm.grouped_mm.default, (a, b, E, bias, None, "ieee", "auto"))


def test_bias_gradient_of_columns_past_the_last_offset_is_zero(device):
    # 3-D x 2-D: columns past offs[-1] come out zero, so their bias gradient is exactly zero whatever dY holds there
    # (it was dY's column sums times a 0/1 mask: a NaN in those columns of dY came back as a NaN gradient)
    a, b, offs = operands("3d2d", [3, 0, 4], 8, 8, torch.float32, device, tail=2)
    a.requires_grad_()
    b.requires_grad_()
    bias = torch.randn(b.shape[1], device=device, requires_grad=True)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    grad = torch.randn_like(out)
    grad[:, 7:] = float("nan")
    got = torch.autograd.grad(out, (a, b, bias), grad)
    clean = grad.clone()
    clean[:, 7:] = 0  # the oracle's zeros there multiply dY, so it takes a dY without the NaN
    want = torch.autograd.grad(grouped_mm_reference(a, b, offs, bias=bias), (a, b, bias), clean.double())
    for g, w in zip(got, want):
        assert_rel_close(g, w, 1e-5)
    assert torch.equal(got[2][7:], torch.zeros(2, device=device))


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_double_backward(activation, device):
    # create_graph=True: the gate's and the activation's derivatives were taken on a detached pre-activation, so a
    # Hessian-vector product lost those terms without an error; now every second-order term matches float64
    from tilegemm.core.activations import torch_activation
    from tilegemm.ops.grouped.api import moe_gate_up

    offs = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=device)  # row 5 past offs[-1]
    leaves = [torch.randn(6, 16, device=device), torch.randn(4, 16, 8, device=device) / 4,
              torch.randn(4, 8, device=device)]
    vs = [torch.randn_like(t) for t in leaves]

    def second_order(fn, *ts):
        firsts = torch.autograd.grad(fn(*ts).pow(2).sum(), ts, create_graph=True)
        return firsts, torch.autograd.grad(sum((f * v).sum() for f, v in zip(firsts, vs)), ts)

    def ref(x, w, bias):
        pre = grouped_mm_reference(x, w, offs, bias=bias)
        return torch_activation(pre[:, :4], activation) * pre[:, 4:]

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got = second_order(lambda x, w, bias: moe_gate_up(x, w, offs, bias, activation),
                           *(t.clone().requires_grad_() for t in leaves))
    finally:
        torch.set_float32_matmul_precision(old)
    want = second_order(ref, *(t.double().requires_grad_() for t in leaves))
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert_rel_close(g.detach(), w.detach(), 1e-5)
