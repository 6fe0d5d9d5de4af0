"""Clear errors where tensor-parallel pieces meet what they cannot take: a layer whose forward was replaced on the
instance (transformers' tensor-parallel plan), and DTensors mixed with plain tensors (2 gloo ranks on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tilegemm.core.runtime import interpreting


def _instance_forward(linear: torch.nn.Linear) -> torch.nn.Linear:
    """``linear`` with its forward replaced on the instance, as transformers' ``TensorParallelLayer.install_forward``
    does (a closure over the original bound forward)."""
    original_forward = linear.forward

    def tp_forward(*args, **kwargs):
        return original_forward(*args, **kwargs)

    linear.forward = tp_forward
    return linear


def test_from_linear_refuses_an_instance_forward():
    import tilegemm.nn as tnn

    with pytest.raises(ValueError, match=r"forward was replaced on the instance .* Convert first"):
        tnn.Linear.from_linear(_instance_forward(torch.nn.Linear(8, 4)))
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), _instance_forward(torch.nn.Linear(4, 2)))
    tnn.convert_(model, warn=False)  # convert_ keeps it, saying why
    assert type(model[2]) is torch.nn.Linear and isinstance(model[0], tnn.Linear)
    assert "forward was replaced on the instance" in dict(model.tilegemm_skipped)["2"]
    # a plain one converts and runs tilegemm's forward, as before
    lin = tnn.Linear.from_linear(torch.nn.Linear(8, 4))
    assert "forward" not in vars(lin) and type(lin).forward is tnn.Linear.forward


def mixed_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import tilegemm
    import tilegemm.nn as tnn
    from tilegemm.ops.w4a16.format import Int4Weight, quantize

    w4 = quantize(torch.randn(16, 128).half(), 32)
    wd = Int4Weight(*(distribute_tensor(getattr(w4, k), mesh, [Shard(1)]) for k in ("qweight", "scales", "zeros")),
                    32, (16, 128), None)
    x = torch.randn(3, 128).half()
    xd = distribute_tensor(x, mesh, [Replicate()])
    with pytest.raises(TypeError, match=r"w.qweight, w.scales, w.zeros are DTensors but x is a plain torch.Tensor: "
                                        r"pass all of them as DTensors on one mesh"):
        tilegemm.w4a16.matmul(x, wd)
    with pytest.raises(TypeError, match=r"x is a DTensor but w.qweight, w.scales, w.zeros are plain torch.Tensors"):
        tilegemm.w4a16.matmul(xd, w4)
    out = tilegemm.w4a16.matmul(xd, wd)  # all DTensors: runs, as all plain does
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), tilegemm.w4a16.matmul(x, w4))

    # an uneven split whose redistribution leaves one rank a strided local shard: right on every rank
    w9 = quantize(torch.randn(9, 128).half(), 32)
    parts = (distribute_tensor(w9.qweight, mesh, [Shard(0)]), distribute_tensor(w9.scales, mesh, [Shard(1)]),
             distribute_tensor(w9.zeros, mesh, [Shard(1)]))
    got = tilegemm.w4a16.matmul(xd, Int4Weight(*parts, 32, (9, 128), None)).full_tensor()
    torch.testing.assert_close(got, tilegemm.w4a16.matmul(x, w9))
    with pytest.raises(TypeError, match=r"a is a DTensor but b is a plain torch.Tensor: pass all of them as DTensors"):
        tilegemm.matmul(xd.float(), torch.randn(128, 4))

    lin = tnn.Linear(128, 16)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(TypeError, match=r"tilegemm.nn.Linear: the weight is a DTensor .* but x is a plain "
                                        r"torch.Tensor: parallelize it with parallelize_module"):
        lin(x.float())


@pytest.mark.skipif(not interpreting(), reason="CPU ranks: kernels under Triton's interpreter")
def test_dtensors_mixed_with_plain_tensors_refused():
    pytest.importorskip("safetensors")
    from test_parallel_ranks import spawn

    spawn(mixed_ranks, 2)
