"""The data gradient of depthwise layers and of layers of few channels a group, run as the forward convolution of
dy with the flipped weight (``dispatch.dgrad_as_forward``; at stride 2 one convolution a stride phase): against
float64 autograd, the layers the route refuses, and (GPU) bf16, replays of an updated weight and CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tilegemm.core import replay
from tilegemm.ops.conv2d import dispatch
from tilegemm.ops.conv2d import op as conv_op
from tilegemm.ops.conv2d.checks import check_conv
from tilegemm.ops.conv2d.op import backward_data
from tilegemm.ops.conv2d.problem import DgradCall, geometry_of
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close, crossed

CL = torch.channels_last


def _dx(device, dtype, shape, conv, seed=0):
    """(tilegemm's grad of x, float64 autograd's) for one call; x channels-last. Through the backward's plain call,
    the one autograd's backward of ``tilegemm.conv2d`` makes: the forward before it is the forward tests' (the
    interpreter would pay for it here too)."""
    N, C, H, W, K, R, S = shape
    groups = conv.get("groups", 1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, H, W, generator=gen).to(device, dtype).contiguous(memory_format=CL)
    w = (torch.randn(K, C // groups, R, S, generator=gen) / (C // groups * R * S) ** 0.5).to(device, dtype)
    g = check_conv(x, w, None, conv.get("stride", 1), conv.get("padding", 0), conv.get("dilation", 1), groups)
    dy = torch.randn(g.out_shape, generator=gen).to(device, dtype).contiguous(memory_format=CL)
    got = backward_data(DgradCall(dy, w, list(x.shape), True, list(g.stride), list(g.padding), list(g.dilation),
                                  groups, "default"))
    xr = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(conv2d_reference(xr, w.double(), None, **conv), (xr,), dy.double())
    return got, want


@pytest.fixture
def spy(monkeypatch):
    """The calls that took the route, counted; replays forgotten so that every call dispatches. Small 3x3 depthwise
    layers are let onto the route (the rule keeps them off: :func:`test_the_rule`), so that the interpreter's small
    images test it."""
    replay.clear()
    monkeypatch.setattr(dispatch, "DGRAD_DIRECT_3X3_PIXELS", 0)
    monkeypatch.setattr(dispatch, "DGRAD_PHASES_DIRECT_3X3_ELEMENTS", 0)
    calls = []
    real = dispatch._dgrad_as_forward

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "_dgrad_as_forward", counted)
    yield calls
    replay.clear()


LAYERS = [
    pytest.param((2, 8, 7, 7, 8, 3, 3), dict(padding=1, groups=8), id="depthwise-3x3"),
    pytest.param((1, 16, 9, 5, 16, 5, 5), dict(padding=2, groups=16), id="depthwise-5x5-odd-image"),
    pytest.param((2, 8, 8, 7, 8, 3, 3), dict(padding=2, dilation=2, groups=8), id="depthwise-dilated"),
    pytest.param((1, 8, 6, 7, 8, 4, 2), dict(padding="same", groups=8), id="depthwise-same-even-filter"),
    pytest.param((1, 24, 5, 5, 24, 3, 3), dict(padding=0, groups=24), id="depthwise-unpadded"),
    pytest.param((1, 16, 7, 6, 16, 3, 3), dict(padding=1, groups=4), id="grouped-4-a-group"),
    pytest.param((1, 32, 5, 9, 64, 3, 3), dict(padding=1, groups=4), id="grouped-8-to-16-a-group"),
    pytest.param((3, 8, 5, 5, 8, 3, 3), dict(padding=1, groups=4), id="grouped-2-a-group"),
    pytest.param((1, 16, 17, 3, 16, 1, 7), dict(padding=(0, 3), groups=2), id="grouped-1x7"),
    pytest.param((2, 8, 9, 7, 8, 3, 3), dict(stride=2, padding=1, groups=8), id="depthwise-3x3-s2-odd-image"),
    pytest.param((1, 16, 10, 8, 16, 3, 3), dict(stride=2, padding=1, groups=16), id="depthwise-3x3-s2-even-image"),
    pytest.param((1, 8, 11, 9, 8, 5, 5), dict(stride=2, padding=2, groups=8), id="depthwise-5x5-s2"),
    pytest.param((1, 8, 8, 9, 8, 3, 3), dict(stride=2, padding=0, groups=8), id="depthwise-3x3-s2-unpadded"),
    pytest.param((2, 16, 7, 8, 16, 3, 3), dict(stride=2, padding=1, groups=4), id="grouped-4-a-group-s2"),
    pytest.param((1, 8, 9, 6, 8, 4, 4), dict(stride=2, padding=1, groups=8), id="depthwise-4x4-s2-even-filter"),
]


@pytest.mark.parametrize("shape,conv", LAYERS)
def test_the_route_runs_and_agrees_with_float64(shape, conv, device, spy):
    got, want = _dx(device, torch.float16, shape, conv)
    assert len(spy) == 1, "the data gradient took the forward route"
    assert got.dtype == torch.float16 and got.is_contiguous(memory_format=CL)
    assert_rel_close(got, want, tolerance(torch.float16))


@pytest.mark.parametrize("shape,conv", LAYERS[:1] + LAYERS[5:6])
def test_the_direct_kernels_give_the_same_gradient(shape, conv, device, spy, monkeypatch):
    on, _ = _dx(device, torch.float16, shape, conv)
    monkeypatch.setattr(dispatch, "DGRAD_AS_FORWARD_KINDS", ())
    replay.clear()
    off, want = _dx(device, torch.float16, shape, conv)
    assert len(spy) == 1, "only the first call took the route"
    assert_rel_close(off, want, tolerance(torch.float16))
    assert_rel_close(on, off.double(), 2 * tolerance(torch.float16))


@pytest.mark.parametrize("shape,conv,why", [
    ((1, 8, 6, 6, 8, 3, 3), dict(padding=3, groups=8), "padding past the filter: the flipped weight's is negative"),
    ((1, 8, 9, 9, 8, 3, 3), dict(stride=3, padding=1, groups=8), "stride 3: nine phases"),
    ((1, 8, 9, 9, 8, 3, 3), dict(stride=2, padding=2, dilation=2, groups=8), "stride 2 and dilation 2"),
    ((1, 8, 9, 9, 8, 1, 1), dict(stride=2, groups=8), "a strided 1x1 filter: phases no tap reaches"),
    ((1, 8, 9, 9, 8, 3, 3), dict(stride=(2, 1), padding=1, groups=8), "unequal strides"),
    ((1, 4, 6, 6, 8, 3, 3), dict(padding=1, groups=4), "a depthwise multiplier (two outputs an input)"),
    ((1, 64, 6, 6, 64, 3, 3), dict(padding=1, groups=2), "32 channels a group: not few"),
])
def test_layers_the_route_leaves_to_their_kernels(shape, conv, why, device, spy):
    got, want = _dx(device, torch.float16, shape, conv)
    assert spy == [], why
    assert_rel_close(got, want, tolerance(torch.float16))


def test_fp32_keeps_the_direct_kernels(device, spy):
    got, want = _dx(device, torch.float32, (2, 8, 7, 7, 8, 3, 3), dict(padding=1, groups=8))
    assert spy == []
    assert_rel_close(got, want, tolerance(torch.float32))


def test_the_rule():
    def geo(C, K, R, groups, stride=1, padding=1, dilation=1):
        return geometry_of((2, C, 16, 16), (K, C // groups, R, R), (stride,) * 2, (padding,) * 4, (dilation,) * 2,
                           groups)

    dy16 = torch.empty(1, dtype=torch.float16)
    assert dispatch.dgrad_as_forward(geo(8, 8, 3, 8), dy16)
    assert dispatch.dgrad_as_forward(geo(8, 8, 7, 8, padding=3), dy16)
    assert dispatch.dgrad_as_forward(geo(32, 32, 3, 8), dy16)  # 4 channels a group
    assert dispatch.dgrad_as_forward(geo(8, 8, 3, 8), torch.empty(1, dtype=torch.bfloat16))
    assert not dispatch.dgrad_as_forward(geo(8, 8, 3, 8), torch.empty(1))  # fp32
    assert not dispatch.dgrad_as_forward(geo(8, 8, 3, 8, stride=2), dy16)  # a small image's 3x3 at stride 2
    assert dispatch.dgrad_as_forward(geo(8, 8, 5, 8, stride=2, padding=2), dy16)
    assert dispatch.dgrad_as_forward(geo(32, 32, 3, 8, stride=2), dy16)  # 4 channels a group
    assert not dispatch.dgrad_as_forward(geo(8, 8, 3, 8, stride=3), dy16)
    assert not dispatch.dgrad_as_forward(geo(8, 8, 3, 8, stride=2, padding=2, dilation=2), dy16)
    assert not dispatch.dgrad_as_forward(geo(8, 8, 1, 8, stride=2, padding=0), dy16)  # phases without taps
    big = dispatch.DGRAD_PHASES_DIRECT_3X3_ELEMENTS // 64  # pixels of a 64-channel image at the threshold
    assert dispatch.dgrad_as_forward(geometry_of((2, 64, 1, big), (64, 1, 3, 3), (2, 2), (1,) * 4, (1, 1), 64), dy16)
    assert not dispatch.dgrad_as_forward(geometry_of((2, 64, 1, big - 1), (64, 1, 3, 3), (2, 2), (1,) * 4, (1, 1), 64),
                                         dy16)
    assert dispatch.dgrad_as_forward(geo(8, 8, 3, 8, padding=2), dy16)  # the flipped weight unpadded
    assert not dispatch.dgrad_as_forward(geo(8, 8, 3, 8, padding=3), dy16)
    assert not dispatch.dgrad_as_forward(geo(8, 16, 3, 8), dy16)  # multiplier 2
    assert not dispatch.dgrad_as_forward(geo(64, 64, 3, 2), dy16)  # 32 a group
    assert not dispatch.dgrad_as_forward(geo(64, 64, 3, 1), dy16)  # dense
    small = dispatch.DGRAD_DIRECT_3X3_PIXELS
    assert not dispatch.dgrad_as_forward(geometry_of((2, 8, 1, small), (8, 1, 3, 3), (1, 1), (1,) * 4, (1, 1), 8), dy16)
    assert dispatch.dgrad_as_forward(geometry_of((2, 8, 1, small + 1), (8, 1, 3, 3), (1, 1), (1,) * 4, (1, 1), 8), dy16)
    assert dispatch.dgrad_as_forward(geometry_of((2, 8, 1, small), (8, 1, 5, 5), (1, 1), (2,) * 4, (1, 1), 8), dy16)


def _dgrad_padded(device, dtype, shape, groups, pad, dil, w_layout="plain", x_cl=True):
    """(tilegemm's dx through the backward's plain call, float64's) with padding (top, bottom, left, right) given to
    the op as it is; the weight plain, channels-last or a strided view."""
    N, C, H, W, K, R, S = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(K, C // groups, R, S, generator=gen) / (C // groups * R * S) ** 0.5
    if w_layout == "channels_last":
        w = w.contiguous(memory_format=CL)
    elif w_layout == "view":  # a slice of a wider filter bank: strides of its own, not contiguous
        big = torch.randn(K, C // groups, R, S + 3, generator=gen)
        big[..., 1:S + 1] = w
        w = big[..., 1:S + 1]
    w = w.to(device, dtype)
    t, b, l, r = pad
    P, Q = H + t + b - dil[0] * (R - 1), W + l + r - dil[1] * (S - 1)
    dy = torch.randn(N, K, P, Q, generator=gen).to(device, dtype).contiguous(memory_format=CL)
    got = backward_data(DgradCall(dy, w, [N, C, H, W], x_cl, [1, 1], list(pad), list(dil), groups, "ieee"))
    x = torch.zeros(N, C, H, W, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(F.pad(x, (l, r, t, b)), w.cpu().double(), None, 1, 0, dil, groups)
    (want,) = torch.autograd.grad(y, (x,), dy.cpu().double())
    return got, want


PADDED = [
    pytest.param((1, 32, 6, 7, 16, 3, 3), 4, (1, 1, 1, 1), (1, 1), id="grouped-8-to-4"),
    pytest.param((1, 8, 5, 6, 128, 3, 3), 4, (1, 1, 1, 1), (1, 1), id="grouped-2-to-32"),
    pytest.param((1, 32, 6, 7, 64, 3, 3), 4, (0, 2, 2, 1), (1, 1), id="grouped-8-to-16-asymmetric"),
    pytest.param((2, 16, 9, 7, 16, 3, 3), 4, (3, 1, 0, 2), (2, 1), id="grouped-asymmetric-dilation-2x1"),
    pytest.param((1, 8, 7, 9, 8, 3, 3), 8, (2, 0, 1, 3), (1, 2), id="depthwise-asymmetric-dilation-1x2"),
]


@crossed("shape, groups, pad, dil, dtype, w_layout", PADDED, [torch.float16, torch.bfloat16],
         ["plain", "channels_last", "view"], ids=(None, lambda d: str(d)[6:]))
def test_route_geometry_layouts_dtypes(shape, groups, pad, dil, dtype, w_layout, device, spy):
    got, want = _dgrad_padded(device, dtype, shape, groups, pad, dil, w_layout)
    assert len(spy) == 1
    assert_rel_close(got, want.to(got.device), tolerance(dtype))


def test_nchw_x_keeps_the_direct_kernels(device, spy):
    got, want = _dgrad_padded(device, torch.float16, (1, 8, 7, 9, 8, 3, 3), 8, (1, 1, 1, 1), (1, 1), x_cl=False)
    assert spy == [] and got.is_contiguous()
    assert_rel_close(got, want.to(got.device), tolerance(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,conv", [
    ((32, 96, 56, 56, 96, 7, 7), dict(padding=3, groups=96)),  # ConvNeXt-T's first depthwise layer
    ((8, 122, 28, 28, 122, 3, 3), dict(padding=1, groups=122)),  # ShuffleNetV2's, an odd channel count
    ((16, 128, 56, 56, 128, 3, 3), dict(padding=1, groups=32)),  # ResNeXt-50 32x4d's first grouped layer
    ((16, 104, 28, 28, 104, 3, 3), dict(padding=1, groups=13)),  # RegNetY-400MF's, 8 channels a group
], ids=["convnext-7x7", "shufflenet-122", "resnext-4-a-group", "regnet-8-a-group"])
def test_zoo_layers_on_the_gpu(dtype, shape, conv, spy):
    got, want = _dx("cuda", dtype, shape, conv)
    assert len(spy) == 1
    assert_rel_close(got, want, tolerance(dtype))


@pytest.mark.gpu
def test_a_replay_flips_the_weight_as_it_is_now_and_a_graph_replays(monkeypatch):
    replay.clear()
    dispatched = []
    real = dispatch.dgrad
    monkeypatch.setattr(dispatch, "dgrad", lambda c: dispatched.append(c) or real(c))
    x = torch.randn(4, 64, 14, 14, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(64, 1, 3, 3, device="cuda", dtype=torch.float16)
    dy = torch.randn(4, 64, 14, 14, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)

    def dgrad():  # the backward's plain call: replayed once recorded
        return backward_data(DgradCall(dy, w, [4, 64, 14, 14], True, [1, 1], [1, 1, 1, 1], [1, 1], 64, "ieee"))

    def want():
        xr = x.double().requires_grad_()
        return torch.autograd.grad(conv2d_reference(xr, w.double(), None, padding=1, groups=64), (xr,),
                                   dy.double())[0]

    _recorded_replayed_and_graphed(dgrad, want, w, dy, dispatched)


def _recorded_replayed_and_graphed(dgrad, want, w, dy, dispatched):
    """The first call recorded (one entry), a second one replayed with the weight updated in place (the replay
    flips it again), then a CUDA graph of the call replayed over new w and dy into its NaN-poisoned output."""
    first = dgrad()
    assert_rel_close(first, want(), tolerance(torch.float16))
    assert conv_op.REPLAYS.count() == 1, "the route's launches (flips and forwards) are kept"
    w.mul_(-2)
    assert_rel_close(dgrad(), want(), tolerance(torch.float16))
    assert len(dispatched) == 1, "the second call replayed the first one's launches"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dgrad()
    w.copy_(torch.randn_like(w))
    dy.copy_(torch.randn_like(dy))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(out, want(), tolerance(torch.float16))
    replay.clear()


@pytest.mark.gpu
def test_a_capture_after_a_recording_marks_the_route_s_workspace_as_the_graph_s():
    from tilegemm.core import workspace

    replay.clear()
    s = torch.cuda.Stream()
    w = torch.randn(64, 1, 3, 3, device="cuda", dtype=torch.float16)
    dy = torch.randn(4, 64, 16, 16, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)

    def dgrad():
        return backward_data(DgradCall(dy, w, [4, 64, 16, 16], True, [1, 1], [1, 1, 1, 1], [1, 1], 64, "ieee"))

    with torch.cuda.stream(s):
        dgrad()  # recorded on s
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = dgrad()  # the call's own path, not the recorded replay
    buf = workspace._buffers[(torch.device("cuda", torch.cuda.current_device()), s.cuda_stream, torch.float16,
                              ("conv2d-phase-weight", 0, 0))]
    assert id(buf) in workspace._used_in_capture
    graph.replay()
    torch.cuda.synchronize()
    xr = torch.zeros(4, 64, 16, 16, dtype=torch.float64, device="cuda", requires_grad=True)
    want = torch.autograd.grad(conv2d_reference(xr, w.double(), None, padding=1, groups=64), (xr,), dy.double())[0]
    assert_rel_close(out, want, tolerance(torch.float16))
    replay.clear()


def test_a_depthwise_flip_is_written_tap_major_and_equals_the_plain_one(device):
    from tilegemm.core.launch import current_stream
    from tilegemm.ops.conv2d import depthwise
    from tilegemm.ops.conv2d.tma_fwd import dgrad_phases, flip_weight

    w = torch.randn(24, 1, 5, 3, device=device).half()
    g = geometry_of((2, 24, 9, 7), tuple(w.shape), (1, 1), (2, 2, 1, 1), (1, 1), 24)
    ((_, _, _, r0, s0),) = dgrad_phases(g)
    stream = current_stream() if device == "cuda" else None
    plain = flip_weight(w, g, r0, s0, w, stream)[1].clone()
    _, tap_major = flip_weight(w, g, r0, s0, w, stream, tap_major=True)
    assert depthwise.is_tap_major(tap_major) and not depthwise.is_tap_major(plain)
    assert torch.equal(tap_major, plain)
    assert torch.equal(plain, w.flip(2, 3))  # one channel a group: the flip alone
    with pytest.raises(ValueError, match="tap-major flipped weight"):
        flip_weight(torch.randn(8, 2, 3, 3, device=device).half(),
                    geometry_of((1, 16, 5, 5), (8, 2, 3, 3), (1, 1), (1,) * 4, (1, 1), 8), 2, 2, w, stream, True)


@pytest.mark.parametrize("tap_major", [False, True], ids=["plain", "tap-major"])
def test_a_stride_phase_s_flipped_weight_holds_its_taps(tap_major, device):
    from tilegemm.core.launch import current_stream
    from tilegemm.ops.conv2d.tma_fwd import dgrad_phases, flip_weight

    w = torch.randn(16, 1, 5, 3, device=device).half()
    g = geometry_of((2, 16, 11, 9), tuple(w.shape), (2, 2), (2, 2, 1, 1), (1, 1), 16)
    stream = current_stream() if device == "cuda" else None
    phases = dgrad_phases(g)
    assert len(phases) == 4
    for slot, (_, _, gt, r0, s0) in enumerate(phases):
        _, wt = flip_weight(w, g, r0, s0, w, stream, tap_major=tap_major, phase=gt, slot=slot)
        assert tuple(wt.shape) == (16, 1, gt.R, gt.S)
        want = torch.stack([torch.stack([w[:, :, r0 - 2 * u, s0 - 2 * v] for v in range(gt.S)], -1)
                            for u in range(gt.R)], -2)
        assert torch.equal(wt, want)  # [C, K/groups, U, V]: one channel a group, c = k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,conv", [
    ((16, 144, 56, 56, 144, 3, 3), dict(stride=2, padding=1, groups=144)),  # MobileNetV2's
    ((16, 240, 28, 28, 240, 5, 5), dict(stride=2, padding=2, groups=240)),  # EfficientNet-B0's
    ((8, 48, 112, 112, 48, 3, 3), dict(stride=2, padding=1, groups=6)),  # RegNetY-400MF's, 8 channels a group
    ((8, 58, 56, 56, 58, 3, 3), dict(stride=2, padding=1, groups=58)),  # ShuffleNetV2's, an odd channel count
], ids=["mobilenet-3x3-s2", "efficientnet-5x5-s2", "regnet-8-a-group-s2", "shufflenet-58-s2"])
def test_strided_zoo_layers_on_the_gpu(dtype, shape, conv):
    replay.clear()
    got, want = _dx("cuda", dtype, shape, conv)
    assert dispatch.dgrad_as_forward(
        geometry_of(shape[:4], (shape[4], shape[1] // conv["groups"], *shape[5:]), (2, 2), (conv["padding"],) * 4,
                    (1, 1), conv["groups"]), torch.empty(1, dtype=dtype)), "the rule takes these layers"
    assert_rel_close(got, want, tolerance(dtype))


@pytest.mark.gpu
def test_a_strided_call_is_recorded_and_a_replay_and_a_graph_flip_the_weight_as_it_is_now(monkeypatch):
    replay.clear()
    monkeypatch.setattr(dispatch, "DGRAD_PHASES_DIRECT_3X3_ELEMENTS", 0)
    dispatched = []
    real = dispatch.dgrad
    monkeypatch.setattr(dispatch, "dgrad", lambda c: dispatched.append(c) or real(c))
    w = torch.randn(64, 1, 3, 3, device="cuda", dtype=torch.float16)
    dy = torch.randn(4, 64, 8, 7, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    shape = [4, 64, 15, 13]

    def dgrad():
        return backward_data(DgradCall(dy, w, shape, True, [2, 2], [1, 1, 1, 1], [1, 1], 64, "ieee"))

    def want():
        xr = torch.zeros(*shape, dtype=torch.float64, device="cuda", requires_grad=True)
        return torch.autograd.grad(conv2d_reference(xr, w.double(), None, stride=2, padding=1, groups=64), (xr,),
                                   dy.double())[0]

    _recorded_replayed_and_graphed(dgrad, want, w, dy, dispatched)  # four phases' eight launches kept as one
