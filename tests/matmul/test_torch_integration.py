"""The op is a torch.library op: opcheck, torch.compile without graph breaks, and autograd."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tilegemm
from tilegemm.ops.matmul.reference import matmul_reference

from conftest import assert_rel_close


def test_registered_in_the_tilegemm_namespace():
    assert hasattr(torch.ops.tilegemm, "matmul")


def test_opcheck(device):
    a = torch.randn(2, 17, 9, device=device)
    b = torch.randn(9, 13, device=device)
    bias = torch.randn(13, device=device)
    args = (a, b, bias, None, 1.0, 1.0, "relu", None, "ieee", "grouped")
    torch.library.opcheck(torch.ops.tilegemm.matmul.default, args)


def test_torch_compile_fullgraph(device):
    def f(x, w, bias):
        return tilegemm.matmul(x, w, bias=bias, activation="gelu", precision="ieee") * 2.0

    x = torch.randn(24, 16, device=device)
    w = torch.randn(16, 8, device=device)
    bias = torch.randn(8, device=device)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, bias)
    assert_rel_close(out, 2.0 * matmul_reference(x, w, bias=bias, activation="gelu"), 1e-5)


@pytest.mark.parametrize("activation", ["none", "gelu", "silu"])
def test_gradients_match_torch(activation, device):
    a = torch.randn(2, 12, 10, device=device, dtype=torch.float64).float().requires_grad_()
    b = torch.randn(10, 7, device=device).requires_grad_()
    bias = torch.randn(7, device=device).requires_grad_()
    c = torch.randn(12, 1, device=device).requires_grad_()
    kwargs = dict(bias=bias, c=c, alpha=0.7, beta=1.3, activation=activation)
    out = tilegemm.matmul(a, b, precision="ieee", **kwargs)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, b, bias, c), grad)
    ref_out = matmul_reference(a, b, dtype=torch.float32, **kwargs)
    want = torch.autograd.grad(ref_out, (a, b, bias, c), grad)
    for name, g, w in zip("a b bias c".split(), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_double_backward_through_the_activation(activation, device):
    # create_graph=True: the first gradients stay differentiable through the activation's derivative (the
    # recomputed pre-activation was detached, so the Hessian-vector product lost those terms without an error)
    leaves = [torch.randn(5, 16, device=device), torch.randn(16, 8, device=device), torch.randn(8, device=device)]
    vs = [torch.randn_like(t) for t in leaves]

    def second_order(fn, a, b, bias):
        firsts = torch.autograd.grad(fn(a, b, bias).pow(2).sum(), (a, b, bias), create_graph=True)
        return firsts, torch.autograd.grad(sum((f * v).sum() for f, v in zip(firsts, vs)), (a, b, bias))

    got = second_order(lambda a, b, bias: tilegemm.matmul(a, b, bias=bias, activation=activation,
                                                          precision="ieee"),
                       *(t.clone().requires_grad_() for t in leaves))
    want = second_order(lambda a, b, bias: matmul_reference(a, b, bias=bias, activation=activation),
                        *(t.double().requires_grad_() for t in leaves))
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert_rel_close(g.detach(), w.detach(), 1e-5)


def test_torch_compile_with_default_fp32_precision(device):
    # The default precision is read when the op runs, so tracing never calls torch's getter.
    x = torch.randn(20, 12, device=device)
    w = torch.randn(12, 6, device=device)
    compiled = torch.compile(lambda x, w: tilegemm.matmul(x, w), fullgraph=True, backend="aot_eager")
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert_rel_close(compiled(x, w), matmul_reference(x, w), 1e-5)
    finally:
        torch.set_float32_matmul_precision(old)


def test_fast_path_and_op_path_agree(device):
    a = torch.randn(3, 20, 12, device=device)
    b = torch.randn(12, 6, device=device)
    direct = tilegemm.matmul(a, b, precision="ieee")
    via_op = torch.ops.tilegemm.matmul(a, b, None, None, 1.0, 1.0, "none", None, "ieee", "auto")
    torch.testing.assert_close(direct, via_op, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["eager", "meta", "fake"])
@pytest.mark.parametrize("change,error,match", [
    (dict(bias=2), ValueError, r"bias must have shape \[N\] = \[3\], got \[2\]"),  # (read out of bounds, unchecked)
    (dict(c=(2, 3)), ValueError, "does not broadcast"),
    (dict(activation="tanh"), ValueError, "unknown activation 'tanh'"),
    (dict(dtype=torch.int32), TypeError, "integer dtype int32"),
    (dict(b_dtype=torch.float16), TypeError, "dtypes differ"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype int32 is not supported"),
    (dict(kernel="bogus"), ValueError, "unknown matmul kernel 'bogus'"),
    (dict(scale_a=()), ValueError, "scale_a applies to fp8 inputs only"),
])
def test_the_registered_op_checks_its_arguments(change, error, match, where, device):
    # torch.ops.tilegemm.matmul called directly gets tilegemm.matmul's checks, not a launch over bad arguments; its
    # fake (meta tensors, FakeTensorMode under torch.compile) runs the same checks: it returned an output of the
    # bad call's shape and dtype (an int32 one for int32 operands)
    on = "meta" if where == "meta" else device
    mode = FakeTensorMode() if where == "fake" else contextlib.nullcontext()
    with mode:
        a = torch.randn(4, 5, device=on).to(change.get("dtype", torch.float32))
        b = torch.randn(5, 3, device=on).to(change.get("b_dtype", a.dtype))
        bias = torch.randn(change["bias"], device=on) if "bias" in change else None
        c = torch.randn(change["c"], device=on) if "c" in change else None
        scale_a = torch.ones(change["scale_a"], device=on) if "scale_a" in change else None
        with pytest.raises(error, match=match):
            torch.ops.tilegemm.matmul(a, b, bias, c, 1.0, 1.0, change.get("activation", "none"),
                                      change.get("out_dtype"), "ieee", change.get("kernel", "auto"), scale_a)


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_the_fake_gives_the_eager_output_shape_dtype_and_strides(where, device):
    args = dict(a=(2, 1, 4, 5), b=(3, 5, 6), bias=(6,), c=(4, 1))
    eager = {k: torch.randn(v, device=device).half() for k, v in args.items()}
    want = torch.ops.tilegemm.matmul(*eager.values(), 1.0, 1.0, "relu", torch.float32, "ieee", "auto")
    mode = FakeTensorMode() if where == "fake" else contextlib.nullcontext()
    with mode:
        on = "meta" if where == "meta" else device
        got = torch.ops.tilegemm.matmul(*(torch.randn(v, device=on).half() for v in args.values()), 1.0, 1.0,
                                        "relu", torch.float32, "ieee", "auto")
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())


def test_the_registered_op_reads_no_c_at_beta_zero(device):
    # As tilegemm.matmul and torch.addmm: NaN in c stays out of the output and out of a's gradient (the op called
    # directly read c as 0 * NaN, NaN everywhere)
    a = torch.randn(5, 6, device=device, requires_grad=True)
    b = torch.randn(6, 4, device=device)
    c = torch.full((5, 4), float("nan"), device=device, requires_grad=True)
    out = torch.ops.tilegemm.matmul(a, b, None, c, 1.0, 0.0, "gelu", None, "ieee", "auto")
    a64 = a.detach().double().requires_grad_()
    ref = torch.nn.functional.gelu(a64 @ b.double())
    assert_rel_close(out, ref, 1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert_rel_close(a.grad, a64.grad, 1e-5)
    assert torch.equal(c.grad, torch.zeros_like(c))  # addmm's gradient of c at beta 0
