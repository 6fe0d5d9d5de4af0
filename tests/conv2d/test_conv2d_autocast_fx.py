"""tilegemm.conv2d under torch.autocast (casts as autocast casts F.conv2d) and torch.fx.symbolic_trace (one
call_function node)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_autocast_casts_like_f_conv2d(dtype, bias, device):
    x = torch.randn(2, 4, 7, 7, device=device)
    w = (torch.randn(6, 4, 3, 3, device=device) / 6).requires_grad_()
    b = torch.randn(6, device=device).requires_grad_() if bias else None
    with torch.autocast(device, dtype=dtype):
        ref = F.conv2d(x, w, b, padding=1)
        out = tilegemm.conv2d(x, w, b, padding=1, activation="relu")
    assert out.dtype == ref.dtype == dtype
    # the kernels ran on the cast operands: the oracle of the dtype-rounded inputs
    want = conv2d_reference(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), padding=1,
                            activation="relu")
    assert_rel_close(out, want, tolerance(dtype))
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and (b is None or b.grad.dtype == torch.float32)  # as torch's


def test_autocast_leaves_float64_and_other_devices_alone(device):
    from tilegemm.core.dtypes import autocast_inputs as _autocast

    x64 = torch.randn(1, 2, 4, 4, dtype=torch.float64, device=device)
    x, w = torch.randn(1, 2, 4, 4, device=device), torch.randn(3, 2, 3, 3, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        # an operand autocast leaves alone (float64, fp8) leaves the call as it is: conv2d then names it
        assert [t.dtype for t in _autocast(x64, w, None)[:2]] == [torch.float64, torch.float32]
        assert [t.dtype for t in _autocast(x, w, None)[:2]] == [torch.bfloat16, torch.bfloat16]
        meta = _autocast(x.to("meta"), w.to("meta"), None)  # no autocast on the meta device: as it was
        assert meta[0].dtype == meta[1].dtype == torch.float32
    with torch.autocast(device, enabled=False):
        assert _autocast(x, w, None)[0] is x


def test_autocast_off_runs_in_the_tensors_dtype(device):
    x, w = torch.randn(1, 4, 6, 6, device=device), torch.randn(6, 4, 3, 3, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        with torch.autocast(device, enabled=False):
            assert tilegemm.conv2d(x, w).dtype == torch.float32


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 4, 3, 3) / 6)
        self.b = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        return tilegemm.conv2d(x, self.w, self.b, stride=(2,), padding=1, activation="silu").relu()


def test_symbolic_trace_records_one_node(device):
    net = _Net().to(device)
    gm = torch.fx.symbolic_trace(net)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is tilegemm.conv2d]
    assert len(calls) == 1
    assert calls[0].kwargs == {"precision": None, "kernel": "auto"}
    x = torch.randn(2, 4, 9, 9, device=device)
    torch.testing.assert_close(gm(x), net(x))
