"""Property tests: random small convolutions (any stride, padding, dilation, groups, memory format, inputs that
are views of other tensors) against F.conv2d in float64, forward and, for fewer draws, backward."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d.reference import conv2d_reference

from conftest import assert_rel_close


@st.composite
def convs(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cg = draw(st.integers(1, 5))
    kg = draw(st.integers(1, 6))
    depthwise = draw(st.booleans()) and groups > 1
    if depthwise:
        cg = 1
    R, S = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    same = draw(st.integers(0, 4)) == 0
    stride = (1, 1) if same else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = "same" if same else (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    pad_h = 0 if same else padding[0]
    pad_w = 0 if same else padding[1]
    # big enough that the dilated filter fits the padded input
    H = draw(st.integers(max(1, dil[0] * (R - 1) + 1 - 2 * pad_h), 8))
    W = draw(st.integers(max(1, dil[1] * (S - 1) + 1 - 2 * pad_w), 8))
    N = draw(st.integers(1, 2))
    return dict(N=N, C=cg * groups, H=H, W=W, K=kg * groups, R=R, S=S, groups=groups, stride=stride,
                padding=padding, dilation=dil, channels_last=draw(st.booleans()), bias=draw(st.booleans()),
                activation=draw(st.sampled_from([None, "relu", "silu"])),
                view=draw(st.sampled_from([None, None, "channels", "offset", "batch"])))


def _input(c, device):
    """x in its drawn memory format: a tensor of its own, or (``view``) its channels sliced out of a wider tensor,
    its storage starting one element in, or a batch sliced out of a larger one."""
    N, C, H, W = c["N"], c["C"], c["H"], c["W"]
    fmt = torch.channels_last if c["channels_last"] else torch.contiguous_format
    view = c.get("view")
    if view == "channels":
        return torch.randn(N, C + 3, H, W, device=device).contiguous(memory_format=fmt)[:, 2:2 + C]
    if view == "offset":
        flat = torch.randn(N * C * H * W + 1, device=device)[1:]
        return flat.view(N, H, W, C).permute(0, 3, 1, 2) if c["channels_last"] else flat.view(N, C, H, W)
    if view == "batch":
        return torch.randn(N + 1, C, H, W, device=device).contiguous(memory_format=fmt)[1:]
    return torch.randn(N, C, H, W, device=device).contiguous(memory_format=fmt)


def _make(c, device):
    x = _input(c, device)
    w = torch.randn(c["K"], c["C"] // c["groups"], c["R"], c["S"], device=device)
    b = torch.randn(c["K"], device=device) if c["bias"] else None
    conv = dict(stride=c["stride"], padding=c["padding"], dilation=c["dilation"], groups=c["groups"],
                activation=c["activation"])
    return x, w, b, conv


def _forward_matches(c, device):
    x, w, b, conv = _make(c, device)
    out = tilegemm.conv2d(x, w, b, **conv, precision="ieee")
    assert_rel_close(out, conv2d_reference(x, w, b, **conv), 1e-5)


# fewer draws under the interpreter (CI's minutes, each draw seconds there); a GPU run takes the full count
EXAMPLES = dict(forward=15, backward=5, depthwise=5) if interpreting() else dict(forward=25, backward=8, depthwise=8)


@settings(max_examples=EXAMPLES["forward"], deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=convs())
def test_forward_matches_f_conv2d(c, device):
    _forward_matches(c, device)


@settings(max_examples=EXAMPLES["backward"], deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=convs())
def test_backward_matches_f_conv2d(c, device):
    x, w, b, conv = _make(c, device)
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    out = tilegemm.conv2d(x, w, b, **conv, precision="ieee")
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    xr, wr = ref_leaves[:2]
    br = ref_leaves[2] if b is not None else None
    want = torch.autograd.grad(conv2d_reference(xr, wr, br, **conv), ref_leaves, dy.double())
    for g, r in zip(got, want):
        # a gradient sums products that may cancel (the bias's over every output pixel): fp32's bound for sums as
        # the contract tests hold it; a draw read 1.1e-5 against the forward's 1e-5
        assert_rel_close(g, r, 1e-4)


@st.composite
def depthwise_convs(draw):
    """Depthwise layers over more channels than one channel tile (the forward's weight rewritten tap-major,
    its taps unrolled up to 7x7 and looped above)."""
    C = draw(st.integers(1, 40))
    mult = draw(st.integers(1, 3))
    R, S = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    min_h, min_w = max(1, dil[0] * (R - 1) + 1 - 2 * padding[0]), max(1, dil[1] * (S - 1) + 1 - 2 * padding[1])
    H, W = draw(st.integers(min_h, max(min_h, 12))), draw(st.integers(min_w, max(min_w, 12)))
    return dict(N=draw(st.integers(1, 2)), C=C, H=H, W=W, K=C * mult, R=R, S=S, groups=C, stride=stride,
                padding=padding, dilation=dil, channels_last=draw(st.booleans()), bias=draw(st.booleans()),
                activation=draw(st.sampled_from([None, "relu"])))


@settings(max_examples=EXAMPLES["depthwise"], deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=depthwise_convs())
def test_depthwise_forward_matches_f_conv2d(c, device):
    _forward_matches(c, device)
