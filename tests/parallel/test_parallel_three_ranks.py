"""Tensor parallelism over 3 gloo ranks (CPU, kernels under Triton's interpreter): splits of sizes that 2 and 4
divide evenly differ here (act-order inputs scattered over every rank's slice, a replicated bias made a partial by
dividing by 3), and the errors of inputs and meshes a split layer cannot take (Linears, convolutions)."""

from __future__ import annotations

import copy

import pytest
import torch

from tilegemm.core.runtime import interpreting

pytest.importorskip("safetensors")  # (the ranks' harness module needs it)
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU ranks: kernels under Triton's interpreter")

from test_parallel_ranks import FP16_TOL, _act_order_linear, _close, _mlp, spawn  # noqa: E402


def three_ranks(rank, world, mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    plan = {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()}

    # 16-bit: leading batch dims, biases (the row-parallel one a partial of a third each), backward
    ref = _mlp(48, 96, 24)
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref)), mesh, plan)
    x = torch.randn(2, 3, 48, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    model(x).square().sum().backward()
    ref(xr).square().sum().backward()
    _close(x.grad, xr.grad, 1e-4, "x's gradient, 3 ranks")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.grad.full_tensor(), q.grad, 1e-4, f"{name}'s gradient, 3 ranks")
    with torch.no_grad():
        _close(model(xr), ref(xr), 1e-5, "convert_ MLP, 3 ranks")

    # 4-bit, and act-order row-parallel (each rank's sorted rows read inputs from every rank's slice)
    q = tnn.quantize_(_mlp(96, 96, 24).half(), group_size=32)
    xh = torch.randn(2, 3, 96).half()
    want = q(xh)
    parallelize_module(q, mesh, copy.deepcopy(plan))
    assert q[2].in_features == 32 and (q[2].bias is not None) == (rank == 0)
    _close(q(xh), want, FP16_TOL, "quantize_ MLP, 3 ranks")
    lin = _act_order_linear(24, 96, 32)
    xa = torch.randn(4, 96).half()
    row = parallelize_module(torch.nn.Sequential(copy.deepcopy(lin)), mesh, {"0": tnn.RowwiseParallel()})
    _close(row(xa.chunk(world, -1)[rank]), lin(xa), FP16_TOL, "act-order row-parallel, 3 ranks")

    # a plain input of the wrong width: named against the style's input layout (not a K DTensor inferred from it)
    with pytest.raises(ValueError, match=r"Int4Linear split row-parallel over 3 ranks \(in_features K = 96\): x is "
                                         r"\[4, 96\], but input_layouts=\(Shard\(dim=-1\),\) makes a plain x this "
                                         r"rank's slice of K, 32 wide; pass each rank its slice"):
        row(xa)
    with pytest.raises(ValueError, match=r"Linear split row-parallel over 3 ranks \(in_features K = 96\): x is "
                                         r"\[2, 3, 96\]"):
        model[2](torch.randn(2, 3, 96))
    with pytest.raises(ValueError, match=r"Int4Linear split column-parallel .* x is \[3, 32\], but input_layouts="
                                         r"\(Replicate\(\),\) makes a plain x all of K = 96"):
        q[0](torch.randn(3, 32).half())

    # convolutions by channels: an unbatched [C, H, W] input split along C (its dim 0), as a batched one along dim 1;
    # plain inputs of the wrong channel count or rank named against in_channels and the layout
    torch.manual_seed(1)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 1), torch.nn.ReLU(), torch.nn.Conv2d(6, 3, 1))
    convs = parallelize_module(tnn.convert_(copy.deepcopy(conv)), mesh, plan)
    xc = torch.randn(3, 4, 4)
    with torch.no_grad():
        assert convs[0](xc).shape == (2, 4, 4)  # this rank's 2 of 6 output channels
        _close(convs(xc), conv(xc), 1e-5, "Conv2d column then row, unbatched, 3 ranks")
    with pytest.raises(ValueError, match=r"Conv2d split row-parallel over 3 ranks \(in_channels C = 6\): x is "
                                         r"\[2, 6, 4, 4\], but input_layouts=\(Shard\(dim=-3\),\) makes a plain x's "
                                         r"dim 1 this rank's slice of C, 2 wide; pass each rank its slice"):
        convs[2](torch.randn(2, 6, 4, 4))
    with pytest.raises(ValueError, match=r"Conv2d split column-parallel .* x is \[1, 4, 4\], but input_layouts="
                                         r"\(Replicate\(\),\) makes a plain x's dim 0 all of C = 3$"):
        convs[0](torch.randn(1, 4, 4))
    with pytest.raises(ValueError, match=r"Conv2d split row-parallel over 3 ranks: x must be a batched \[N, C, H, W\] "
                                         r"\(4 dims\) or unbatched \[C, H, W\] \(3 dims\) input, got shape \[2, 2\]"):
        convs[2](torch.randn(2, 2))

    # split twice: refused (a second split would cut the shard again), not run on a shard of the shard
    with pytest.raises(ValueError, match=r"this Int4Linear is split already \(column-parallel"):
        parallelize_module(q, mesh, {"0": tnn.ColwiseParallel()})

    # 2-D meshes: the tensor-parallel dim is taken; the whole mesh is refused by name for every layer kind
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    for layer in (tnn.convert_(_mlp(48, 96, 24)), tnn.quantize_(_mlp(96, 96, 24).half(), group_size=32)):
        with pytest.raises(ValueError, match=r"take a 1-D mesh \(the tensor-parallel dim, mesh\['tp'\]\), got a 2-D"):
            parallelize_module(layer, mesh2, {"0": tnn.ColwiseParallel()})
    on_tp = parallelize_module(tnn.quantize_(_mlp(96, 96, 24).half(), group_size=32), mesh2["tp"],
                               {"0": tnn.ColwiseParallel(output_layouts=Replicate())})
    # a DTensor on the same ranks' other 1-D mesh lies the same: taken
    out = on_tp[0](distribute_tensor(xh, mesh, [Shard(0)]))
    assert not isinstance(out, DTensor) and out.shape == (2, 3, 96)
    # a DTensor on another mesh: refused by name (its placements were read against the layer's mesh)
    with pytest.raises(ValueError, match=r"x is a DTensor on DeviceMesh\(\(dp=1, tp=3\).* but the layer is split "
                                         r"over DeviceMesh\(\(3,\)"):
        row(distribute_tensor(xa, mesh2, [Replicate(), Shard(1)]))


def test_parallel_three_ranks():
    spawn(three_ranks, 3)
