"""tilegemm's ops under torch.func: ``vmap`` runs them (torch's per-element fallback: no host fast path or replay
sees its wrapped tensors), and the gradient transforms, for which a ``torch.library`` op with registered autograd
has no rule, refuse with an error that names the op and what to use instead."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm import w4a16
from tilegemm.core import launch
from conftest import assert_rel_close


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_vmap_runs_matmul_over_either_operand_and_both():
    dev = _device()
    dt = torch.float16 if dev == "cuda" else torch.float32
    a, b = torch.randn(3, 5, 24, device=dev, dtype=dt), torch.randn(24, 17, device=dev, dtype=dt)
    bb = torch.randn(3, 24, 17, device=dev, dtype=dt)
    tilegemm.matmul(a[0], b)  # a plain call of the same layout first: recorded where recording runs
    out = torch.func.vmap(lambda x: tilegemm.matmul(x, b))(a)
    assert_rel_close(out, a.float() @ b.float(), 2e-3)
    out = torch.func.vmap(lambda x, y: tilegemm.matmul(x, y, activation="relu"))(a, bb)
    assert_rel_close(out, torch.relu(a.float() @ bb.float()), 2e-3)
    out = torch.func.vmap(lambda y: tilegemm.matmul(a[1], y), in_dims=0)(bb)
    assert_rel_close(out, a[1].float() @ bb.float(), 2e-3)


def test_vmap_runs_w4a16_and_conv2d():
    dev = _device()
    w = w4a16.quantize(torch.randn(40, 256, device=dev, dtype=torch.float16), 128)
    x = torch.randn(3, 2, 256, device=dev, dtype=torch.float16)
    out = torch.func.vmap(lambda t: w4a16.matmul(t, w))(x)
    assert_rel_close(out, x.float() @ w4a16.dequantize(w).float().T, 2e-3)
    img, wt = torch.randn(2, 1, 4, 6, 7, device=dev), torch.randn(5, 4, 3, 3, device=dev)
    out = torch.func.vmap(lambda t: tilegemm.conv2d(t, wt, padding=1))(img)
    want = torch.stack([torch.nn.functional.conv2d(i, wt, padding=1) for i in img])
    assert_rel_close(out, want, 1e-3 if dev == "cuda" else 1e-5)


def test_calls_on_unwatched_inputs_inside_a_transform():
    # vmap: an op whose inputs are not batched runs as a plain call would; grad: refused clearly (its output
    # would be the transform's wrapper, on which nothing can launch)
    dev = _device()
    c, d, xs = torch.randn(4, 16, device=dev), torch.randn(16, 8, device=dev), torch.randn(3, 4, 8, device=dev)
    out = torch.func.vmap(lambda x: x + tilegemm.matmul(c, d))(xs)
    assert_rel_close(out, xs + c @ d, 2e-3)
    with pytest.raises(NotImplementedError, match="tilegemm::matmul does not run inside torch.func's gradient"):
        torch.func.grad(lambda x: (x * tilegemm.matmul(c, d)).sum())(xs[0])


def test_calls_inside_a_transform_take_the_op():
    seen = []
    torch.func.vmap(lambda x: seen.append(launch.plain_call(x)) or x)(torch.randn(2, 3))
    assert seen == [False]
    assert launch.plain_call(torch.randn(2, 3))


@pytest.mark.parametrize("which", ["matmul", "conv2d", "w4a16"])
def test_gradient_transforms_refuse_clearly(which):
    dev = _device()
    if which == "matmul":
        b = torch.randn(16, 8, device=dev)
        fn, x = (lambda t: tilegemm.matmul(t, b).sum()), torch.randn(4, 16, device=dev)
    elif which == "conv2d":
        wt = torch.randn(3, 2, 3, 3, device=dev)
        fn, x = (lambda t: tilegemm.conv2d(t, wt).sum()), torch.randn(1, 2, 5, 5, device=dev)
    else:
        w = w4a16.quantize(torch.randn(16, 128, device=dev, dtype=torch.float16), 128)
        fn, x = (lambda t: w4a16.matmul(t, w).float().sum()), torch.randn(2, 128, device=dev, dtype=torch.float16)
    for transform in (torch.func.grad, torch.func.jacrev):
        with pytest.raises(NotImplementedError, match=r"tilegemm::\w+ does not run inside torch.func's gradient.*"
                                                      r"autograd\.grad"):
            transform(fn)(x)
    # outside the transforms the same function differentiates
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(fn(x), x)
    assert g.shape == x.shape and torch.isfinite(g).all()


@pytest.mark.parametrize("which", ["matmul", "conv2d", "w4a16", "grouped_mm", "w4a16.grouped_matmul"])
def test_forward_mode_dual_tensors_are_refused(which):
    # torch.autograd.forward_ad: a custom op hands back an output without a tangent, which the code after it
    # would read as a zero derivative; refused by name (a dual level without dual inputs still runs)
    import torch.autograd.forward_ad as fwad

    dev = _device()
    dt = torch.float16 if which.startswith("w4a16") else torch.float32
    x = torch.randn(6, 128, device=dev, dtype=dt)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=dev)
    if which == "matmul":
        b = torch.randn(128, 8, device=dev)
        fn = lambda t: tilegemm.matmul(t, b)  # noqa: E731
    elif which == "conv2d":
        wt = torch.randn(3, 2, 3, 3, device=dev)
        fn = lambda t: tilegemm.conv2d(t.reshape(1, 2, 12, 32), wt)  # noqa: E731
    elif which == "w4a16":
        w = w4a16.quantize(torch.randn(16, 128, device=dev, dtype=dt), 128)
        fn = lambda t: w4a16.matmul(t, w)  # noqa: E731
    elif which == "grouped_mm":
        b = torch.randn(3, 128, 8, device=dev)
        fn = lambda t: tilegemm.grouped_mm(t, b, offs=offs)  # noqa: E731
    else:
        w = w4a16.quantize(torch.randn(3, 16, 128, device=dev, dtype=dt), 128)
        fn = lambda t: w4a16.grouped_matmul(t, w, offs)  # noqa: E731
    with fwad.dual_level():
        with pytest.raises(NotImplementedError, match=r"tilegemm::\w+ has no forward-mode derivative.*reverse mode"):
            fn(fwad.make_dual(x, torch.randn_like(x)))
        assert fwad.unpack_dual(fn(x)).tangent is None  # plain inputs inside the level: runs
    assert torch.isfinite(fn(x).float()).all()


def test_vmap_over_the_group_ends():
    # a batched offs (vmap) carries no values to check: each batch element's call is checked and run
    dev = _device()
    a, b = torch.randn(10, 16, device=dev), torch.randn(3, 16, 8, device=dev)
    ends = torch.tensor([[2, 5, 9], [0, 0, 10]], dtype=torch.int32, device=dev)
    out = torch.func.vmap(lambda o: tilegemm.grouped_mm(a, b, offs=o))(ends)
    for got, o in zip(out, ends):
        assert torch.equal(got, tilegemm.grouped_mm(a, b, offs=o))
    if dev == "cpu":  # (the values are checked where that costs no device sync)
        with pytest.raises(ValueError, match="offs must be non-decreasing"):
            torch.func.vmap(lambda o: tilegemm.grouped_mm(a, b, offs=o))(ends.flip(1))


@pytest.mark.parametrize("channels_last", [False, True])
def test_batched_gradients_through_every_op(channels_last):
    # autograd.grad(..., is_grads_batched=True) and jacobian(vectorize=True) batch the gradients with torch's older
    # vmap, whose tensors torch.func's level check does not see: conv2d's backward handed them to the kernels
    dev = _device()
    x = torch.randn(2, 4, 6, 5, device=dev, dtype=torch.float64)
    w = torch.randn(4, 2, 3, 3, device=dev, dtype=torch.float64)
    if channels_last:
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    xs, ws = x.float().requires_grad_(), w.float().requires_grad_()
    y = tilegemm.conv2d(xs, ws, stride=2, padding=1, groups=2)
    v = torch.randn(3, *y.shape, device=dev, dtype=torch.float64)
    got = torch.autograd.grad(y, (xs, ws), v.float(), is_grads_batched=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(torch.nn.functional.conv2d(xr, wr, stride=2, padding=1, groups=2), (xr, wr), v,
                               is_grads_batched=True)
    for g, r in zip(got, want):
        assert_rel_close(g, r, 1e-3 if dev == "cuda" else 1e-5)
    a, b = torch.randn(3, 8, device=dev), torch.randn(8, 5, device=dev)
    jac = torch.autograd.functional.jacobian(lambda t: tilegemm.matmul(t, b), a, vectorize=True)
    assert_rel_close(jac, torch.autograd.functional.jacobian(lambda t: t @ b, a), 1e-3 if dev == "cuda" else 1e-5)
