"""Patch embeddings (a filter that tiles the image: stride = filter, no padding): their gradients as one GEMM over
the patches (``ops/conv2d/patchify.py``), against the float64 reference, in both layouts, over images whose last
rows and columns no patch reads; the route's rule; repeated calls (no replay of a route with torch copies)."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.conv2d import dispatch, patchify
from tilegemm.ops.conv2d.problem import Geometry
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close, crossed

CL = torch.channels_last


def _geo(C, R, stride, pad=0, groups=1, dilation=1, H=16):
    return Geometry(2, C, H, H, 8, R, R, groups, (stride, stride), (pad,) * 4, (dilation, dilation))


def test_the_rule():
    assert patchify.takes(_geo(3, 4, 4))  # ConvNeXt's and Swin's stems
    assert patchify.takes(_geo(3, 14, 14, H=518))  # ViT-H/14
    assert not patchify.takes(_geo(16, 2, 2))  # more channels: the TMA routes
    assert patchify.tiles_image(_geo(96, 2, 2))
    assert not patchify.tiles_image(_geo(3, 3, 2))  # overlapping windows
    assert not patchify.tiles_image(_geo(3, 4, 4, pad=1))
    assert not patchify.tiles_image(_geo(3, 2, 2, dilation=2))
    assert not patchify.tiles_image(_geo(4, 2, 2, groups=2))
    assert not patchify.tiles_image(_geo(3, 1, 1))  # a 1x1 layer: its own route


# every patch shape in both layouts and both dtypes: under the interpreter half the cross, every pair meeting
@crossed("shape,stride,channels_last,dtype", [
    pytest.param((2, 3, 16, 16, 8, 4, 4), 4, id="4x4-whole"),
    pytest.param((2, 3, 18, 17, 8, 4, 4), 4, id="4x4-rows-and-columns-left-over"),
    pytest.param((1, 5, 15, 15, 12, 5, 5), 5, id="5x5-C5"),
    pytest.param((2, 3, 9, 12, 8, 3, 4), (3, 4), id="3x4-non-square"),
], [pytest.param(True, id="nhwc"), pytest.param(False, id="nchw")],
    [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
def test_gradients(shape, stride, channels_last, dtype, device, monkeypatch):
    N, C, H, W, K, R, S = shape
    ran = []
    for name in ("dgrad", "wgrad"):
        fn = getattr(patchify, name)
        monkeypatch.setattr(patchify, name, lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    x = torch.randn(N, C, H, W, device=device).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    w = (torch.randn(K, C, R, S, device=device) / (C * R * S) ** 0.5).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else tolerance(dtype)
    for call in range(2):  # the second call: the same shapes, new values (a replay would reuse the first's)
        xs, ws = (t.detach().clone().requires_grad_() for t in (x, w))
        out = tilegemm.conv2d(xs, ws, None, stride=stride, precision="ieee")
        dy = torch.randn(out.shape, device=device).to(dtype)
        got = torch.autograd.grad(out, (xs, ws), dy)
        xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
        ref = conv2d_reference(xr, wr, None, stride=stride)
        want = torch.autograd.grad(ref, (xr, wr), dy.double())
        for name, g, r in zip(("x", "weight"), got, want):
            assert g.dtype == dtype, name
            assert_rel_close(g, r, tol)
        if H % R or W % S:  # the pixels no patch reads get a zero gradient, not NaN
            assert (got[0][:, :, H - H % R:, :] == 0).all() and (got[0][:, :, :, W - W % S:] == 0).all()
        assert got[0].is_contiguous(memory_format=CL if channels_last else torch.contiguous_format)
        x = torch.randn_like(x)
    assert ran.count("dgrad") == 2 and ran.count("wgrad") == 2, ran


def test_dispatch_sends_only_stems_there(device, monkeypatch):
    """A patch embedding of 16 channels keeps its route (TMA or pointer kernels): the GEMM route is for stems."""
    called = []
    monkeypatch.setattr(patchify, "dgrad", lambda *a: called.append(1))
    monkeypatch.setattr(patchify, "wgrad", lambda *a: called.append(1))
    x = torch.randn(1, 16, 8, 8, device=device).requires_grad_()
    w = torch.randn(8, 16, 2, 2, device=device).requires_grad_()
    tilegemm.conv2d(x, w, None, stride=2, precision="ieee").sum().backward()
    assert not called and x.grad is not None and w.grad is not None
    assert dispatch.patchify is patchify
