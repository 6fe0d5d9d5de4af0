"""Gradients through tensor-parallel layers, on 2 gloo ranks on the CPU (kernels under Triton's interpreter).

Each rank's output and input gradient are compared with a single-process fp64 reference: a column-parallel
layer reads all of a replicated input, so the input's gradient is the sum over the ranks of their partial ones;
a row-parallel act-order layer gathers its input and reads only its own inputs of it, alike.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tilegemm.core.runtime import interpreting

pytest.importorskip("safetensors")  # (test_parallel_ranks imports it)
from test_parallel_ranks import _act_order_linear, _close, _mlp, spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU ranks: kernels under Triton's interpreter")

FP16_TOL = 4e-3  # fp16 activations and gradients against fp64
FP32_TOL = 1e-5


def _int4_reference(lin, x, go):
    """(output, x's gradient) of the Int4Linear ``lin`` in fp64 on its dequantized weight."""
    from tilegemm.ops.w4a16.format import dequantize

    w = dequantize(lin.weight).double()
    xr = x.double().requires_grad_()
    out = xr @ w.T + (0 if lin.bias is None else lin.bias.double())
    out.backward(go.double())
    return out.detach(), xr.grad


def _run(model, x, go):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(go)
    return out.detach(), x.grad


def int4_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    torch.manual_seed(0)
    plain = tnn.Int4Linear.from_linear(torch.nn.Linear(64, 32).half(), group_size=32)
    for kind, lin in (("plain", plain), ("act-order", _act_order_linear(16, 128, 32))):
        N, K = lin.out_features, lin.in_features
        x, go = torch.randn(3, K).half(), torch.randn(3, N).half()
        want, want_grad = _int4_reference(lin, x, go)
        mine = slice(rank * K // world, (rank + 1) * K // world)
        for name, style, inp, grad_want in (
            ("column-parallel", tnn.ColwiseParallel(output_layouts=Replicate()), x, want_grad),
            ("row-parallel", tnn.RowwiseParallel(), x[:, mine], want_grad[:, mine]),
            ("row-parallel, replicated input", tnn.RowwiseParallel(input_layouts=Replicate()), x, want_grad),
        ):
            model = parallelize_module(torch.nn.Sequential(copy.deepcopy(lin)), mesh, {"0": style})
            out, grad = _run(model, inp, go)
            _close(out, want, FP16_TOL, f"{kind} {name}: output")
            _close(grad, grad_want, FP16_TOL, f"{kind} {name}: x.grad")
            with torch.no_grad():  # no gradient wanted: the same output (the decode path, no DTensor)
                _close(model(inp), want, FP16_TOL, f"{kind} {name}: output under no_grad")

    # a 4-bit MLP, column- then row-parallel: x's gradient through both
    ref = tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32)
    x, go = torch.randn(4, 64).half(), torch.randn(4, 16).half()
    want, want_grad = _run(ref, x, go)
    model = parallelize_module(copy.deepcopy(ref), mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, grad = _run(model, x, go)
    _close(out, want, FP16_TOL, "int4 MLP: output")
    _close(grad, want_grad, FP16_TOL, "int4 MLP: x.grad")


def dense_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    ref = _mlp(32, 64, 16).double()
    x, go = torch.randn(3, 32), torch.randn(3, 16)
    want, want_grad = _run(ref, x.double(), go.double())
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref).float()), mesh,
                               {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, grad = _run(model, x, go)
    _close(out, want, FP32_TOL, "tilegemm.nn.Linear MLP: output")
    _close(grad, want_grad, FP32_TOL, "tilegemm.nn.Linear MLP: x.grad")
    for i in (0, 2):
        for p in ("weight", "bias"):
            got = getattr(model[i], p).grad.full_tensor()
            _close(got, getattr(ref[i], p).grad, FP32_TOL, f"tilegemm.nn.Linear MLP: [{i}].{p}.grad")


def test_parallel_int4_input_grad():
    spawn(int4_grad_ranks, 2)


def test_parallel_linear_grad():
    spawn(dense_grad_ranks, 2)


def conv_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm
    import tilegemm.nn as tnn

    # output channels, then input channels: the backward runs tilegemm::conv2d_dgrad / conv2d_wgrad on DTensors
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 6, 1)).double()
    x, go = torch.randn(2, 4, 6, 6), torch.randn(2, 6, 6, 6)
    want, want_grad = _run(ref, x.double(), go.double())
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref).float()), mesh,
                               {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, grad = _run(model, x, go)
    _close(out, want, FP32_TOL, "Conv2d column then row: output")
    _close(grad, want_grad, FP32_TOL, "Conv2d column then row: x.grad")
    for i in (0, 2):
        for p in ("weight", "bias"):
            param = getattr(model[i], p)
            assert param.grad.placements == param.placements, (i, p, param.grad.placements, param.placements)
            _close(param.grad.full_tensor(), getattr(ref[i], p).grad, FP32_TOL, f"Conv2d [{i}].{p}.grad")

    # the batch split (a replicated weight), with a fused activation: the weight's gradient a partial sum
    xb = torch.randn(4, 4, 5, 5)
    xr, wr = xb.double().requires_grad_(), ref[0].weight.detach().clone().requires_grad_()
    torch.relu(torch.nn.functional.conv2d(xr, wr, None, padding=1)).sum().backward()
    xd = distribute_tensor(xb, mesh, [Shard(0)]).requires_grad_()
    wd = distribute_tensor(wr.detach().float(), mesh, [Replicate()]).requires_grad_()
    tilegemm.conv2d(xd, wd, None, padding=1, activation="relu").sum().backward()
    _close(xd.grad.full_tensor(), xr.grad, FP32_TOL, "batch-split conv2d: x.grad")
    _close(wd.grad.full_tensor(), wr.grad, FP32_TOL, "batch-split conv2d: weight.grad")


def w4a16_op_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tilegemm.ops.w4a16.format import dequantize, quantize

    torch.manual_seed(0)
    R = Replicate()
    for kind, w4 in (("plain", quantize(torch.randn(16, 128).half(), 32)),
                     ("act-order", _act_order_linear(16, 128, 32).weight)):
        w = dequantize(w4).double()  # [N, K] in x's input order
        x, go = torch.randn(3, 128).half(), torch.randn(3, 16).half()
        # replicated; rows of x split; N split (column-parallel); K split in whole groups (row-parallel)
        for name, px, pw in (("replicated", R, R), ("rows", Shard(0), R), ("N split", R, Shard(1)),
                             ("K split", Shard(1), Shard(0))):
            for activation in ("none", "relu"):
                xr = x.double().requires_grad_()
                want = xr @ w.T
                want = torch.relu(want) if activation == "relu" else want
                want.backward(go.double())
                xd = distribute_tensor(x, mesh, [px]).requires_grad_()
                parts = [distribute_tensor(getattr(w4, k), mesh, [pw]) for k in ("qweight", "scales", "zeros")]
                perm = None if w4.perm is None else distribute_tensor(w4.perm, mesh, [R])
                out = torch.ops.tilegemm.w4a16_matmul(xd, *parts, None, None, None, 32, activation, "auto", perm)
                out.backward(distribute_tensor(go, mesh, [R]))
                what = f"w4a16 op on DTensors, {kind}, {name}, {activation}"
                _close(out.full_tensor(), want, FP16_TOL, f"{what}: output")
                _close(xd.grad.full_tensor(), xr.grad, FP16_TOL, f"{what}: x.grad")


def test_parallel_conv2d_grad():
    spawn(conv_grad_ranks, 2)


def test_parallel_w4a16_op_grad():
    spawn(w4a16_op_grad_ranks, 2)
