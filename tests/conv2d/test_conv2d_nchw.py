"""NCHW inputs through the channels-last kernels: the transposition into workspaces (interpreter) and the
forward's NCHW route on Hopper (GPU): values, output layout, replays."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d import layout
from tilegemm.ops.conv2d import op as replay
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close

CL = torch.channels_last


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (3, 70, 9, 13), (1, 130, 1, 67), (2, 64, 8, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_to_channels_last_and_back(shape, dtype, device):
    t = torch.randn(shape, device=device).to(dtype)
    assert layout.planar(t) == (t.stride(1) != 1)
    if not layout.planar(t):
        return
    c, buf = layout.to_channels_last(t, "test-nchw")
    assert c.is_contiguous(memory_format=CL)
    assert c.data_ptr() == buf.data_ptr()
    assert torch.equal(c, t)
    out = torch.full_like(t, float("nan"))
    assert layout.to_nchw(c, out) is out
    assert torch.equal(out, t)


# fewer draws under the interpreter (CI's minutes); a GPU run takes the full count
@settings(max_examples=20 if interpreting() else 40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), c=st.integers(2, 140), h=st.integers(1, 70), w=st.integers(1, 9),
       dtype=st.sampled_from(["fp16", "fp32"]))
def test_transposes_round_trip_any_shape(n, c, h, w, dtype, device):
    t = torch.randn(n, c, h, w, device=device).to(torch.float16 if dtype == "fp16" else torch.float32)
    if not layout.planar(t):  # H*W == 1: channels at unit stride already
        assert h * w == 1
        return
    view, buf = layout.to_channels_last(t, "test-nchw-property")
    assert torch.equal(view, t) and view.is_contiguous(memory_format=CL)
    out = torch.full_like(t, float("nan"))
    assert torch.equal(layout.to_nchw(view, out), t)


def test_a_weight_becomes_k_r_s_c(device):
    w = torch.randn(24, 18, 3, 5, device=device)
    c, _ = layout.to_channels_last(w, "test-weight")
    assert c.is_contiguous(memory_format=CL)
    assert torch.equal(c.permute(0, 2, 3, 1).reshape(24, -1), w.permute(0, 2, 3, 1).reshape(24, -1))


def test_what_the_route_takes():  # layout predicates only: no launch
    x = torch.randn(2, 16, 5, 5)
    assert layout.planar(x) and not layout.planar(x.contiguous(memory_format=CL))
    assert not layout.planar(x[:, :, 1:])  # a view: not transposed here
    assert not layout.planar(torch.randn(2, 16, 1, 1))  # channels at unit stride already


# --- on the GPU ------------------------------------------------------------------------------------------

LAYERS = [  # (N, C, H, W, K, R, stride, pad, groups): what auto picks for the channels-last copy varies
    pytest.param(2, 64, 28, 28, 96, 3, 1, 1, 1, id="3x3"),
    pytest.param(3, 32, 17, 23, 40, 3, 2, 1, 1, id="3x3-stride2-odd-image"),
    pytest.param(2, 128, 7, 7, 256, 1, 1, 0, 1, id="1x1-7x7"),
    pytest.param(2, 64, 56, 56, 64, 1, 1, 0, 1, id="1x1-56x56"),
    pytest.param(2, 64, 14, 14, 128, 1, 2, 0, 1, id="1x1-stride2"),
    pytest.param(2, 96, 19, 21, 96, 3, 1, 1, 96, id="depthwise"),
    pytest.param(2, 144, 28, 28, 144, 3, 2, 1, 144, id="depthwise-stride2"),
    pytest.param(2, 24, 15, 15, 40, 3, 1, 1, 1, id="C24-padded"),  # odd channels: the padded route's own copy
    pytest.param(2, 64, 9, 11, 64, 3, 1, 1, 2, id="groups2"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_format", ["nchw", "cl"])
@pytest.mark.parametrize("N,C,H,W,K,R,stride,pad,groups", LAYERS)
def test_gpu_nchw_forward_through_the_route(N, C, H, W, K, R, stride, pad, groups, weight_format, dtype,
                                            monkeypatch):
    from tilegemm.ops.conv2d import dispatch, padded

    taken, padded_runs = [], []
    real, real_padded = layout.workspace_view, padded.run
    monkeypatch.setattr(layout, "workspace_view", lambda t, tag: taken.append(tag) or real(t, tag))
    monkeypatch.setattr(padded, "run", lambda p: padded_runs.append(p) or real_padded(p))
    replay.REPLAYS.clear()
    w = (torch.randn(K, C // groups, R, R, device="cuda") / (C // groups * R * R) ** 0.5).to(dtype)
    if weight_format == "cl":
        w = w.contiguous(memory_format=CL)
    b = torch.randn(K, device="cuda").to(dtype)
    conv = dict(stride=stride, padding=pad, groups=groups)
    assert dispatch._nchw_route(torch.empty(N, C, H, W, device="cuda", dtype=dtype))
    outs = []
    for trial in range(3):  # the first call records, the later ones replay with new tensors
        x = torch.randn(N, C, H, W, device="cuda").to(dtype)
        out = tilegemm.conv2d(x, w, b, **conv, activation="relu")
        # channels-last where the weight is (not a 1x1 or one-channel-a-group weight, which is both), as torch's
        if weight_format == "cl" and R > 1 and C // groups > 1:
            assert out.is_contiguous(memory_format=CL) and not out.is_contiguous()
        else:
            assert out.is_contiguous()
        assert out.dtype == dtype
        assert out.stride() == F.conv2d(x, w, b, **conv).stride()
        assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), tolerance(dtype))
        outs.append(out)
    assert outs[1].data_ptr() != outs[2].data_ptr()
    if R == 1 and stride == 1:  # one batched GEMM over the NCHW tensors, no copy
        assert "conv2d-nchw-input" not in taken
    elif C % 16 and groups == 1:  # channels padded to the TMA kernel's step, from the NCHW input in one pass
        assert padded_runs and "conv2d-nchw-input" not in taken
    else:  # transposed, then a kernel of the channels-last input; every launch Triton's, so the call replays
        assert taken.count("conv2d-nchw-input") == 1  # trials 2 and 3 replayed: no second full path
        assert replay.REPLAYS.count() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("C,K,R,stride,groups", [(32, 48, 3, 1, 1), (32, 48, 3, 2, 1), (48, 48, 3, 1, 48),
                                                 (64, 64, 3, 2, 2), (32, 64, 1, 2, 1), (32, 64, 1, 1, 1)],
                         ids=["3x3", "3x3-stride2", "depthwise", "groups2-stride2", "1x1-stride2", "1x1"])
def test_gpu_nchw_gradients_and_an_fp32_pre_activation(C, K, R, stride, groups, monkeypatch):
    # the backward of a fused activation recomputes the pre-activation in fp32 through the forward's route; the
    # gradients of an NCHW input take the route too, come back NCHW and replay on the second step
    taken = []
    real = layout.workspace_view
    monkeypatch.setattr(layout, "workspace_view", lambda t, tag: taken.append(tag) or real(t, tag))
    replay.REPLAYS.clear()
    w = (torch.randn(K, C // groups, R, R, device="cuda") / (C // groups * R * R) ** 0.5).half().requires_grad_(True)
    conv = dict(stride=stride, padding=R // 2, groups=groups)
    for step in range(2):
        w.grad = None
        x = torch.randn(2, C, 12, 14, device="cuda", dtype=torch.float16, requires_grad=True)
        out = tilegemm.conv2d(x, w, **conv, activation="gelu")
        assert out.is_contiguous()
        ref = F.gelu(F.conv2d(x.double(), w.double(), **conv))
        assert_rel_close(out, ref, tolerance(torch.float16))
        g = torch.randn_like(out)
        out.backward(g)
        xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        F.gelu(F.conv2d(xd, wd, **conv)).backward(g.double())
        assert x.grad.is_contiguous() and w.grad.is_contiguous()
        assert_rel_close(x.grad, xd.grad, 2e-2)
        assert_rel_close(w.grad, wd.grad, 2e-2)
    # each gradient took the full path once, the second step replayed it: the weight gradient's copies of x and
    # dy, the data gradient's copy of dy (1x1 stride-1 layers: a batched GEMM over dy as it is)
    pointwise = R == 1 and stride == 1
    assert taken.count("conv2d-nchw-x") == 1
    assert taken.count("conv2d-nchw-dy") == (1 if pointwise else 2)


@pytest.mark.gpu
def test_gpu_a_weight_torch_must_copy_is_not_replayed_but_stays_right():
    replay.REPLAYS.clear()
    for _ in range(3):
        x = torch.randn(2, 32, 10, 10, device="cuda", dtype=torch.float16)
        w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.float16).transpose(2, 3)  # neither NCHW nor CL
        out = tilegemm.conv2d(x, w, padding=1)
        assert_rel_close(out, F.conv2d(x.double(), w.double(), padding=1), 4e-3)
    assert replay.REPLAYS.count() == 0


# --- the route under the interpreter: forced on, the pointer and depthwise kernels take the copies -------------

ROUTED = [  # (N, C, H, W, K, R, stride, pad, dilation, groups)
    (1, 16, 7, 1, 24, 3, 1, 1, 1, 1), (2, 12, 1, 9, 12, 3, 2, 1, 1, 12), (1, 16, 5, 3, 16, 3, 1, 2, 2, 2),
    (1, 24, 6, 5, 20, 1, 2, 0, 1, 1), (2, 16, 5, 6, 24, 1, 1, 0, 1, 1),
]


@pytest.mark.skipif(not interpreting(), reason="the interpreter's side: on a GPU the route is taken as it is "
                    "(test_gpu_nchw_forward_through_the_route, test_gpu_nchw_gradients_and_an_fp32_pre_activation)")
@pytest.mark.parametrize("N,C,H,W,K,R,stride,pad,dilation,groups", ROUTED,
                         ids=["w1", "h1-depthwise-stride2", "dilated-groups2", "1x1-stride2", "1x1"])
@pytest.mark.parametrize("weight_format", ["nchw", "cl"])
def test_route_forced_on_matches_f_conv2d_with_gradients(N, C, H, W, K, R, stride, pad, dilation, groups,
                                                          weight_format, monkeypatch):
    from tilegemm.ops.conv2d import dispatch

    monkeypatch.setattr(dispatch, "_nchw_route", lambda t: layout.planar(t) and t.shape[1] > 8)
    taken = []
    real = layout.workspace_view
    monkeypatch.setattr(layout, "workspace_view", lambda t, tag: taken.append(tag) or real(t, tag))
    x = torch.randn(N, C, H, W, requires_grad=True)
    w = torch.randn(K, C // groups, R, R) / (C // groups * R * R) ** 0.5
    if weight_format == "cl":  # a channels-last model fed an NCHW image: the output is channels-last, as torch's
        w = w.contiguous(memory_format=CL)
    w.requires_grad_(True)
    b = torch.randn(K, requires_grad=True)
    conv = dict(stride=stride, padding=pad, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, activation="relu")
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), **conv))
    assert out.stride() == F.conv2d(x.detach(), w.detach(), b.detach(), **conv).stride() and out.dtype == x.dtype
    assert out.is_contiguous() != (weight_format == "cl" and R > 1 and C // groups > 1)
    assert_rel_close(out, ref, 1e-4)
    g = torch.randn_like(out)
    out.backward(g)
    xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    F.relu(F.conv2d(xd, wd, bd, **conv)).backward(g.double())
    assert x.grad.is_contiguous()
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert_rel_close(got, want, 1e-4)
    pointwise = R == 1 and stride == 1
    assert ("conv2d-nchw-input" in taken) != pointwise  # 1x1 stride-1 forwards stay the batched GEMM
    # the weight gradient's route copies x and an NCHW dy; a channels-last dy (a channels-last output's) is read
    # as it is, beside x
    assert ("conv2d-nchw-x" in taken) == out.is_contiguous()


def test_workspaces_grow_by_half_and_can_be_released():
    from tilegemm.core import workspace

    a = workspace.buffer(torch.device("cpu"), torch.float32, 100_000, "test-grow")
    b = workspace.buffer(torch.device("cpu"), torch.float32, 100_001, "test-grow")
    assert b.numel() >= 150_000 and workspace.buffer(torch.device("cpu"), torch.float32, 120_000, "test-grow") is b
    workspace.release()
    c = workspace.buffer(torch.device("cpu"), torch.float32, 10, "test-grow")
    assert c is not b and c.numel() == 1 << 16
    assert a.numel() == 100_000
