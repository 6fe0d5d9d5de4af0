"""The depthwise gradients' pixel strides in units of the power of two dividing them (``DIV_Y``, ``DIV_X``):
right for channel counts that are multiples of 8 but not 16, odd ones, NCHW tensors and views whose strides
share no power of two; compiled offline for sm_90, 16-byte loads of dy and x where C is a multiple of 8 (with
88 and 72 channels every load and store was 2 bytes wide; the walking weight gradient's loads are 8 bytes, its
4 channels a thread)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tilegemm.ops.conv2d import depthwise
from tilegemm.ops.conv2d.problem import geometry_of

from conftest import SM90, assert_rel_close, compile_offline


def _refs(x, w, dy, stride, padding):
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    F.conv2d(xr, wr, None, stride, padding, 1, x.shape[1]).backward(dy.double())
    return xr.grad, wr.grad


@pytest.mark.parametrize("C, layout, stride", [
    (24, "nhwc", 1),  # a multiple of 8, not 16: strides in units of 8
    (12, "nhwc", 2),  # of 4, strided
    (7, "nhwc", 1),  # odd: units of 1
    (24, "nchw", 1),  # NCHW: the pixel strides of dy and dx are W and 1
    (16, "view", 1),  # a channels-last view with a column cut off: pixel strides 16, rows 16*(W+1)
])
def test_depthwise_gradients_with_strides_in_units(C, layout, stride, device):
    N, H, W, R = 2, 4, 6, 3
    x = torch.randn(N, C, H, W + (layout == "view"), device=device)
    if layout != "nchw":
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "view":
        x = x[..., :W]
    w = torch.randn(C, 1, R, R, device=device)
    g = geometry_of(x.shape, w.shape, [stride, stride], [1, 1, 1, 1], [1, 1], C)
    dy = torch.randn(N, C, g.P, g.Q, device=device)
    if layout != "nchw":
        dy = dy.contiguous(memory_format=torch.channels_last)
    fmt = torch.contiguous_format if layout == "nchw" else torch.channels_last
    dx = depthwise.dgrad(dy, w, x.shape, fmt, g)
    dw = depthwise.wgrad(dy, x, g, x.dtype)
    dx_ref, dw_ref = _refs(x, w, dy, stride, 1)
    assert_rel_close(dx, dx_ref, 1e-5)
    assert_rel_close(dw, dw_ref, 1e-5)


def test_depthwise_gradients_load_16_bytes_where_c_is_a_multiple_of_8(tmp_path):
    script = SM90 + (Path(__file__).parent / "_depthwise_bwd_widths.py").read_text()
    got = compile_offline(tmp_path, script, [192, 88, 72])
    for C, ops in got.items():
        wide = sum(v for op, v in ops["dgrad"].items() if op.startswith("ld.global.v4"))
        assert wide > 0, f"C={C} dgrad: no 16-byte loads: {ops['dgrad']}"
        # the walking weight gradient holds 4 channels a thread at 3x3 (its taps' accumulators): 8-byte loads
        # (the .cg loads: the split's fp32 partial sums, read back by the last program)
        loads = {op: v for op, v in ops["wgrad"].items() if op.startswith("ld.global") and ".cg" not in op}
        assert loads and all(".v2." in op or ".v4." in op for op in loads), f"C={C} wgrad: narrow loads: {loads}"
        # the data gradient's stores; its remaining 2-byte loads are the weight's ([K, 1, R, S]: a tap's
        # channels R*S apart), one [BLOCK_N] vector a tap
        assert not any(op.startswith("st.global.b16") for op in ops["dgrad"]), f"C={C}: {ops['dgrad']}"
        assert not any(op.startswith("ld.global.b16") for op in ops["wgrad"]), f"C={C}: {ops['wgrad']}"
