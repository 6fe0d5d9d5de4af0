"""Fuzz `tilegemm.conv2d` (``auto``) and its gradients on the GPU (`pytest -m gpu`) with the layers the TMA and
Gluon kernels take: 16-bit activations, channel counts of real CNNs and odd ones, 1x1 to 7x7 filters, strides,
paddings, dilations, groups (depthwise included), both memory formats, bias and activation. Each layer runs
twice with fresh tensors (the second call replays the first's launches), then from an input that is a view
(channels sliced out of a wider tensor, storage starting 2 bytes in, or a batch slice), against F.conv2d in fp32; the property
tests beside this one cover the fp32 and interpreter side on small layers."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.core.checks import relative_error
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance
from conftest import fuzz_draw

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
EXAMPLES = int(os.environ.get("TILEGEMM_FUZZ_EXAMPLES", "40"))
CHANNELS = [1, 3, 8, 16, 17, 24, 32, 48, 64, 96, 128, 144, 160, 256, 320, 512]


@st.composite
def layers(draw):
    kind = draw(st.sampled_from(["dense", "dense", "pointwise", "depthwise", "grouped"]))
    C = draw(st.sampled_from(CHANNELS))
    K = draw(st.sampled_from(CHANNELS))
    groups = 1
    if kind == "depthwise":
        groups, K = C, C * draw(st.sampled_from([1, 1, 2]))
    elif kind == "grouped":
        groups = draw(st.sampled_from([2, 4, 8]))
        C, K = groups * max(1, C // groups), groups * max(1, K // groups)
    R = S = 1 if kind == "pointwise" else draw(st.sampled_from([1, 3, 3, 5, 7]))
    if draw(st.integers(0, 5)) == 0:  # non-square filters
        S = draw(st.sampled_from([1, 3]))
    stride = draw(st.sampled_from([1, 1, 2]))
    dilation = 2 if R > 1 and draw(st.integers(0, 7)) == 0 else 1
    padding = draw(st.sampled_from(["half", "half", "none", "one"]))
    pad = {"half": (dilation * (R // 2), dilation * (S // 2)), "none": (0, 0), "one": (1, 1)}[padding]
    H = draw(st.integers(max(1, dilation * (R - 1) + 1 - 2 * pad[0]), 64))
    W = draw(st.integers(max(1, dilation * (S - 1) + 1 - 2 * pad[1]), 64))
    N = draw(st.sampled_from([1, 2, 3, 8]))
    while N > 1 and N * H * W * C * K * R * S // groups > 2e9:
        N //= 2
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, groups=groups, stride=stride, padding=pad, dilation=dilation,
                dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
                channels_last=draw(st.integers(0, 3)) > 0, bias=draw(st.booleans()),
                activation=draw(st.sampled_from([None, None, "relu", "silu"])), backward=draw(st.integers(0, 2)) == 0,
                view=draw(st.sampled_from(["channels", "offset", "batch"])))


@st.composite
def wide_layers(draw):
    """Layers of every kind a classification CNN holds and the narrow draw above leaves out: filters 1 to 11
    (non-square too), strides 1 to 4 (each side its own), dilation to 3, paddings of either side 0 to 5, groups
    of 2 to 64 channels (ResNeXt's 32 groups of 4, RegNet's groups of 8 to 64), odd channel counts."""
    kind = draw(st.sampled_from(["dense", "grouped", "grouped", "depthwise"]))
    if kind == "grouped":
        per_group = draw(st.sampled_from([2, 3, 4, 8, 16, 24, 32, 64]))
        groups = draw(st.sampled_from([2, 3, 4, 8, 16, 32]))
        while per_group * groups > 1024:
            groups //= 2
        C = per_group * groups
        K = groups * draw(st.sampled_from([1, per_group, 2 * per_group]))
    elif kind == "depthwise":
        groups = C = draw(st.sampled_from([8, 17, 32, 96, 144, 240]))
        K = C * draw(st.sampled_from([1, 1, 2]))
    else:
        groups, C, K = 1, draw(st.integers(1, 160)), draw(st.integers(1, 160))
    R = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 9, 11]))
    S = R if draw(st.integers(0, 3)) else draw(st.sampled_from([1, 3, 5, 7]))
    stride = (draw(st.integers(1, 4)),) * 2 if draw(st.integers(0, 3)) else (draw(st.integers(1, 4)),
                                                                               draw(st.integers(1, 4)))
    dilation = (1, 1) if R == S == 1 or draw(st.integers(0, 4)) else (draw(st.integers(1, 3)),) * 2
    padding = (draw(st.integers(0, 5)), draw(st.integers(0, 5)))
    H = draw(st.integers(max(1, dilation[0] * (R - 1) + 1 - 2 * padding[0]), 48))
    W = draw(st.integers(max(1, dilation[1] * (S - 1) + 1 - 2 * padding[1]), 48))
    N = draw(st.sampled_from([1, 2, 5]))
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, groups=groups, stride=stride, padding=padding,
                dilation=dilation, dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
                channels_last=draw(st.integers(0, 3)) > 0, bias=draw(st.booleans()),
                activation=draw(st.sampled_from([None, None, "relu", "gelu"])), backward=draw(st.integers(0, 1)) == 0,
                view=draw(st.sampled_from(["channels", "offset", "batch"])))


def make_input(c: dict, fmt, view: str | None) -> torch.Tensor:
    """The layer's input in memory format ``fmt``: a tensor of its own, or (``view``) its channels sliced out of
    a wider tensor, its storage starting one element (2 bytes) in, or a batch sliced out of a larger one."""
    N, C, H, W, dtype = c["N"], c["C"], c["H"], c["W"], c["dtype"]
    if view == "channels":
        return torch.randn(N, C + 8, H, W, device=DEVICE, dtype=dtype).contiguous(memory_format=fmt)[:, 3:3 + C]
    if view == "offset":
        flat = torch.randn(N * C * H * W + 1, device=DEVICE, dtype=dtype)[1:]
        return flat.view(N, H, W, C).permute(0, 3, 1, 2) if fmt == torch.channels_last else flat.view(N, C, H, W)
    if view == "batch":
        return torch.randn(N + 1, C, H, W, device=DEVICE, dtype=dtype).contiguous(memory_format=fmt)[1:]
    return torch.randn(N, C, H, W, device=DEVICE, dtype=dtype).contiguous(memory_format=fmt)


def check(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN (an element never written)"
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"


@fuzz_draw
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=layers())
def test_auto_and_gradients_match_f_conv2d(c):
    _auto_and_gradients_match(c)


@fuzz_draw
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=wide_layers())
def test_wide_layers_match_f_conv2d(c):
    _auto_and_gradients_match(c)


def _auto_and_gradients_match(c):
    torch.manual_seed(zlib.crc32(repr(sorted(c.items())).encode()))  # the same values each time it is drawn
    dtype, tol = c["dtype"], tolerance(c["dtype"])
    conv = dict(stride=c["stride"], padding=c["padding"], dilation=c["dilation"], groups=c["groups"])
    fmt = torch.channels_last if c["channels_last"] else torch.contiguous_format
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for call, view in enumerate((None, None, c["view"])):  # recorded, replayed, then from a view
            x = make_input(c, fmt, view)
            w = torch.randn(c["K"], c["C"] // c["groups"], c["R"], c["S"], device=DEVICE, dtype=dtype)
            w = (w / (w[0].numel() ** 0.5)).contiguous(memory_format=fmt)
            b = torch.randn(c["K"], device=DEVICE, dtype=dtype) if c["bias"] else None
            leaves = [t.requires_grad_() for t in (x, w, b) if t is not None] if c["backward"] else []
            out = tilegemm.conv2d(x, w, b, activation=c["activation"], **conv)
            refs = [t.detach().float().requires_grad_() for t in (x, w, b) if t is not None]
            ref = conv2d_reference(*refs[:2], refs[2] if b is not None else None, activation=c["activation"],
                                   dtype=torch.float32, **conv)
            what = f"call {call} of {c}"
            check(out.float(), ref.detach(), tol, what)
            other = torch.contiguous_format if c["channels_last"] else torch.channels_last
            if x.is_contiguous(memory_format=fmt) and not x.is_contiguous(memory_format=other):  # else ambiguous
                assert out.is_contiguous(memory_format=fmt), f"{what}: output not in the input's memory format"
            if not leaves:
                continue
            dy = torch.randn_like(out)
            got = torch.autograd.grad(out, leaves, dy)
            want = torch.autograd.grad(ref, refs, dy.float())
            for name, g, r in zip("xwb", got, want):
                check(g.float(), r, tol, f"{what}, grad {name}")
    finally:
        torch.backends.cudnn.allow_tf32 = old
    if DEVICE == "cuda":
        torch.cuda.synchronize()
