"""The weight gradient of grouped layers of few channels a group as the block diagonal of a coarser grouping's
(``dispatch._coarse_wgrad``): the block-diagonal copy against a torch gather and as the inverse of the TMA form's
weight expansion, the rule (``configs.coarse_wgrad_groups``) against the GT the measurement took, the route's
plumbing with the TMA kernel replaced by torch's gradient of the coarse layer, and (GPU) fp16 and bf16 zoo layers
against float64, recorded, replayed and captured in a CUDA graph."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tilegemm.core import launch as core_launch
from tilegemm.core import replay, workspace
from tilegemm.ops.conv2d import configs, dispatch, tma_wgrad
from tilegemm.ops.conv2d import op as conv_op
from tilegemm.ops.conv2d.grouped_packed import block_diagonal, coarse_geometry, expand_weight
from tilegemm.ops.conv2d.problem import WgradCall, geometry_of
from tilegemm.ops.conv2d.reference import tolerance

from conftest import assert_rel_close, crossed

CL = torch.channels_last
ROOT = Path(__file__).resolve().parents[2]
TAG = ("conv2d-coarse-wgrad", 0, 0)


def _geo(C, K, groups, R=3, S=3, H=8, W=8, N=1, stride=1, pad=1):
    return geometry_of((N, C, H, W), (K, C // groups, R, S), (stride, stride), (pad,) * 4, (1, 1), groups)


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "cl":
        return t.contiguous(memory_format=CL)
    if how == "view":  # a slice of a wider tensor: strides of its own, neither layout
        wide = torch.zeros(t.shape[0], t.shape[1], t.shape[2], t.shape[3] + 2, dtype=t.dtype, device=t.device)
        wide[..., 1:-1] = t
        return wide[..., 1:-1]
    return t.contiguous()


def _gather(src: torch.Tensor, g, gt: int) -> torch.Tensor:
    """``src[k, ((k // Kg) % GT) * Cg + c, r, s]`` by torch."""
    first = (torch.arange(g.K, device=src.device) // g.Kg % gt) * g.Cg
    idx = (first[:, None] + torch.arange(g.Cg, device=src.device)[None, :])[:, :, None, None]
    return torch.gather(src, 1, idx.expand(g.K, g.Cg, g.R, g.S))


# --- the block-diagonal copy -----------------------------------------------------------------------------------

# (Cg, Kg, groups, GT, R, S, extra channels past GT*Cg in the coarse tensor)
COPIES = [
    pytest.param(4, 4, 8, 4, 3, 3, 0, id="cg4-gt4"),
    pytest.param(3, 5, 6, 3, 3, 1, 0, id="cg3-kg5-gt3-3x1"),
    pytest.param(2, 6, 4, 2, 2, 5, 0, id="cg2-kg6-gt2-2x5"),
    pytest.param(8, 8, 13, 13, 1, 1, 0, id="cg8-gt13-1x1"),
    pytest.param(16, 16, 4, 4, 3, 3, 0, id="cg16-gt4"),
    pytest.param(5, 3, 6, 2, 3, 3, 6, id="cg5-kg3-gt2-wider-coarse"),
]


@pytest.mark.parametrize("src_layout,dst_layout", [("cl", "cl"), ("plain", "cl"), ("cl", "plain"),
                                                   ("plain", "plain"), ("view", "view")])
@pytest.mark.parametrize("cg,kg,groups,gt,R,S,extra", COPIES)
def test_block_diagonal_is_the_gather(cg, kg, groups, gt, R, S, extra, src_layout, dst_layout, device):
    g = _geo(cg * groups, kg * groups, groups, R, S)
    src = _layout(torch.randn(g.K, gt * cg + extra, R, S, device=device).half(), src_layout)
    dst = _layout(torch.full((g.K, cg, R, S), float("nan"), device=device).half(), dst_layout)
    assert block_diagonal(src, g, gt, dst) is dst
    assert torch.equal(dst, _gather(src, g, gt))


@pytest.mark.parametrize("cg,kg,groups,gt,channels", [(8, 8, 13, 13, 112), (16, 16, 4, 2, 32), (4, 8, 6, 3, 16)])
def test_block_diagonal_undoes_the_weight_expansion(cg, kg, groups, gt, channels, device):
    # grouped_packed_tma's block-diagonal weight (zeros off the diagonal, and past GT*Cg channels) and back
    w = torch.randn(kg * groups, cg, 3, 3, device=device).half()
    g = _geo(cg * groups, kg * groups, groups)
    wide = expand_weight(w, g, gt, channels)
    back = torch.full_like(w, float("nan"))
    assert torch.equal(block_diagonal(wide, g, gt, back), w)


def test_block_diagonal_refuses_what_does_not_fit(device):
    g = _geo(32, 32, 8)  # 4 channels a group
    src = torch.randn(32, 16, 3, 3, device=device).half()
    out = torch.empty(32, 4, 3, 3, device=device).half()
    with pytest.raises(ValueError, match="must divide the groups"):
        block_diagonal(src, g, 3, out)
    with pytest.raises(ValueError, match=r"coarse weight must be \[32, >= 32, 3, 3\]"):
        block_diagonal(src, g, 8, out)  # 8 groups of 4 need 32 coarse channels
    with pytest.raises(ValueError, match="out must be"):
        block_diagonal(src, g, 4, torch.empty(32, 4, 3, 3, device=device))  # fp32 out of fp16
    with pytest.raises(ValueError, match="out must be"):
        block_diagonal(src, g, 4, torch.empty(32, 8, 3, 3, device=device).half())


# --- the rule ---------------------------------------------------------------------------------------------------


def test_the_rule():
    rule = configs.coarse_wgrad_groups
    assert rule(_geo(128, 128, 32)) == 16  # 4 a group (ResNeXt-50 32x4d): 64 channels a coarse group
    assert rule(_geo(256, 256, 32)) == 8  # 8 a group
    assert rule(_geo(48, 48, 6)) == 6  # 8 a group, 6 groups: 48 channels, the only GT
    assert rule(_geo(128, 128, 8)) == 4  # 16 a group
    assert rule(_geo(576, 576, 24)) == 3  # 24 a group: 72 channels, nearer 64 than 48
    assert rule(_geo(1024, 1024, 32)) == 2  # 32 a group
    assert rule(_geo(32, 64, 8)) == 8  # 4 in, 8 out a group
    assert rule(_geo(240, 240, 15)) == 3  # 16 a group: 48 and 80 as near 64, the smaller GT
    assert rule(_geo(96, 96, 2)) is None  # 48 a group
    assert rule(_geo(64, 64, 64)) is None  # depthwise
    assert rule(_geo(64, 64, 1)) is None  # dense
    assert rule(_geo(32, 512, 8)) is None  # 4 in, 64 out a group
    assert rule(_geo(168, 168, 7)) is None  # 24 a group, 7 groups: no GT under 128 channels
    assert rule(_geo(24, 24, 3)) is None  # 8 a group, 3 groups: 24 channels at most
    assert rule(_geo(12, 12, 4)) is None  # 3 a group: no coarse group a multiple of 8 within 32-128


def test_the_rule_takes_the_measured_first_candidate():
    # the measurement (research/grouped_wgrad_coarse.py's log) timed each layer's candidate GT, nearest 64 channels
    # first: the rule takes that first one for every layer of at most 32 channels a group, and none for the rest
    log = ROOT / "benchmarks/results/2026-12-04-h200/cad37ac/grouped-wgrad-coarse.log"
    row = re.compile(r"^(\d+)->(\d+) (\d)x(\d) s(\d) (\d+)x(\d+) g(\d+) \((\d+) a group\)\s+\S+us auto \S+(.*)$")
    seen = 0
    for line in log.read_text().splitlines():
        m = row.match(line)
        if not m:
            continue
        C, K, R, S, st, H, W, groups, cg = map(int, m.groups()[:9])
        g = geometry_of((32, C, H, W), (K, cg, R, S), (st, st), (R // 2,) * 4, (1, 1), groups)
        first = re.search(r"gt(\d+)", m.group(10))
        want = int(first.group(1)) if first and not g.is_depthwise and cg <= 32 else None
        assert configs.coarse_wgrad_groups(g) == want, line
        seen += 1
    assert seen == 89


# --- the route, its TMA kernel replaced by torch ------------------------------------------------------------------


@pytest.fixture
def route(monkeypatch, device):
    """The route let run here: tma_wgrad taken as usable, its ``run`` replaced by torch's fp32 gradient written into
    ``out`` (for the route: the workspace, NaN-poisoned first) or a new tensor (the layers the route leaves to the
    per-group TMA kernel); the coarse geometries it ran into a workspace, in order."""
    ran = []

    def coarse_run(dy, x, g, out_dtype, cfg=None, memory_format=torch.contiguous_format, x_channels=None,
                   dy_channels=None, out=None):
        pad = [g.padding[0], g.padding[2]]
        w = torch.empty(g.K, g.Cg, g.R, g.S, device=x.device)
        dw = torch.ops.aten.convolution_backward(dy.float(), x.float(), w, None, list(g.stride), pad,
                                                 list(g.dilation), False, [0, 0], g.groups, [False, True, False])[1]
        if out is None:
            return dw.to(out_dtype).contiguous(memory_format=memory_format)
        assert out.dtype == out_dtype
        buf = workspace.buffer(x.device, out_dtype, out.numel(), TAG)
        assert out.data_ptr() == buf.data_ptr(), "the coarse gradient lands in the per-stream workspace"
        assert any(t is buf for t in core_launch._state.keeping), "the route's launches name the workspace as theirs"
        assert torch.isnan(out).all()
        out.copy_(dw)
        ran.append(g)
        return out

    monkeypatch.setattr(dispatch, "_tma_wgrad_usable", lambda dy, x, g: True)
    monkeypatch.setattr(tma_wgrad, "run", coarse_run)
    replay.clear()
    yield ran
    replay.clear()


def _wgrad(device, dtype, N, C, K, H, W, R, S, stride, pad, groups, x_layout="cl", dilation=1):
    """(dispatch.wgrad's gradient, float64's, the call's geometry) with the workspace NaN-poisoned first."""
    x = _layout(torch.randn(N, C, H, W, device=device).to(dtype), x_layout)
    w_shape = [K, C // groups, R, S]
    g = geometry_of(x.shape, w_shape, (stride, stride), (pad,) * 4, (dilation, dilation), groups)
    dy = _layout(torch.randn(g.out_shape, device=device).to(dtype), x_layout)
    gt = configs.coarse_wgrad_groups(g)
    if gt:
        workspace.buffer(x.device, dtype, K * gt * (C // groups) * R * S, TAG).fill_(float("nan"))
    call = WgradCall(dy, x, w_shape, [stride] * 2, [pad] * 4, [dilation] * 2, groups, "ieee")
    got = dispatch.wgrad(call)
    xr = x.double().requires_grad_()
    wr = torch.zeros(w_shape, dtype=torch.float64, device=device, requires_grad=True)
    torch.nn.functional.conv2d(xr, wr, None, stride, pad, dilation, groups).backward(dy.double())
    return got, wr.grad, g


# (N, C, K, H, W, R, S, stride, pad, groups)
LAYERS = [
    pytest.param(2, 32, 32, 6, 7, 3, 3, 1, 1, 8, id="4-a-group-gt8"),
    pytest.param(1, 128, 128, 5, 5, 3, 3, 1, 1, 32, id="4-a-group-gt16"),
    pytest.param(2, 48, 48, 9, 7, 3, 3, 2, 1, 6, id="8-a-group-stride2-gt6"),
    pytest.param(1, 64, 64, 5, 6, 3, 3, 1, 1, 4, id="16-a-group-gt4"),
    pytest.param(1, 64, 64, 6, 5, 3, 3, 1, 1, 2, id="32-a-group-gt2"),
    pytest.param(1, 32, 64, 5, 5, 3, 3, 1, 1, 8, id="4-in-8-out-gt8"),
    pytest.param(1, 48, 48, 7, 6, 1, 5, 1, 2, 2, id="24-a-group-1x5-gt2"),
]


# every layer in both 16-bit dtypes and both layouts: under the interpreter half the cross, every pair meeting
@crossed("N,C,K,H,W,R,S,stride,pad,groups,dtype,x_layout", LAYERS,
         [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")], ["cl", "plain"])
def test_the_route_gives_the_layer_s_gradient(N, C, K, H, W, R, S, stride, pad, groups, dtype, x_layout, device,
                                             route):
    got, want, g = _wgrad(device, dtype, N, C, K, H, W, R, S, stride, pad, groups, x_layout)
    gt = configs.coarse_wgrad_groups(g)
    assert route == [coarse_geometry(g, gt)], "one coarse gradient, of the rule's GT"
    assert got.dtype == dtype and got.shape == want.shape
    assert got.is_contiguous(memory_format=CL if x_layout == "cl" else torch.contiguous_format)  # wgrad_format's
    assert_rel_close(got, want, tolerance(dtype))


def test_the_dilated_route(device, route):
    got, want, g = _wgrad(device, torch.float16, 1, 32, 32, 9, 8, 3, 3, 1, 2, 8, dilation=2)
    assert len(route) == 1
    assert_rel_close(got, want, tolerance(torch.float16))


@pytest.mark.parametrize("dtype,shape,why", [
    (torch.float32, (1, 32, 32, 4, 4, 3, 3, 1, 1, 8), "fp32: not 16-bit"),
    (torch.float16, (1, 96, 96, 5, 5, 3, 3, 1, 1, 2), "48 a group"),
    (torch.float16, (1, 16, 16, 6, 6, 3, 3, 1, 1, 16), "depthwise"),
    (torch.float16, (1, 16, 16, 6, 6, 3, 3, 1, 1, 1), "dense"),
    (torch.float16, (1, 24, 24, 4, 4, 3, 3, 1, 1, 3), "no GT (8 a group, 3 groups)"),
])
def test_layers_the_route_leaves_to_their_kernels(dtype, shape, why, device, route):
    got, want, _ = _wgrad(device, dtype, *shape)
    assert route == [], why
    assert_rel_close(got, want, tolerance(dtype))


def test_without_the_tma_kernel_the_layer_keeps_its_route(device, monkeypatch):
    # here (no Hopper GPU) tma_wgrad takes nothing: the rule's layers run their kernels as before
    ran = []
    monkeypatch.setattr(dispatch, "_coarse_wgrad", lambda *a: ran.append(a))
    if device == "cuda":
        monkeypatch.setattr(dispatch, "_tma_wgrad_usable", lambda dy, x, g: False)
    got, want, g = _wgrad(device, torch.float16, 1, 32, 32, 4, 4, 3, 3, 1, 1, 8)
    assert configs.coarse_wgrad_groups(g) == 8 and ran == []
    assert_rel_close(got, want, tolerance(torch.float16))


# --- on the GPU ---------------------------------------------------------------------------------------------------

GPU_LAYERS = [
    pytest.param((4, 128, 56, 56, 128, 32, 1), id="resnext-128-g32-4-a-group"),
    pytest.param((8, 48, 112, 112, 48, 6, 2), id="regnet-48-g6-8-a-group-stride2"),
    pytest.param((8, 128, 28, 28, 128, 8, 1), id="regnet-128-g8-16-a-group"),
    pytest.param((8, 1024, 14, 14, 1024, 32, 1), id="resnext-1024-g32-32-a-group"),
]


@pytest.fixture
def counted(monkeypatch):
    """The calls that took the route (dispatched, not replayed), with their GT."""
    calls = []
    real = dispatch._coarse_wgrad

    def spy(dy, x, g, gt, fmt, dtype):
        calls.append(gt)
        return real(dy, x, g, gt, fmt, dtype)

    monkeypatch.setattr(dispatch, "_coarse_wgrad", spy)
    replay.clear()
    yield calls
    replay.clear()


def _gpu_call(dtype, N, C, H, W, K, groups, stride):
    x = torch.randn(N, C, H, W, device="cuda", dtype=dtype).contiguous(memory_format=CL)
    w_shape = [K, C // groups, 3, 3]
    g = geometry_of(x.shape, w_shape, (stride, stride), (1,) * 4, (1, 1), groups)
    dy = torch.randn(g.out_shape, device="cuda", dtype=dtype).contiguous(memory_format=CL)
    return x, dy, WgradCall(dy, x, w_shape, [stride] * 2, [1] * 4, [1, 1], groups, "ieee")


def _want(call: WgradCall) -> torch.Tensor:
    xr = call.x.double().requires_grad_()
    wr = torch.zeros(call.w_shape, dtype=torch.float64, device="cuda", requires_grad=True)
    torch.nn.functional.conv2d(xr, wr, None, call.stride, call.padding[0], call.dilation, call.groups) \
        .backward(call.dy.double())
    return wr.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layer", GPU_LAYERS)
def test_zoo_layers_on_the_gpu_record_and_replay(dtype, layer, counted):
    x, dy, call = _gpu_call(dtype, *layer)
    dw = conv_op.backward_weight(call)  # recorded
    assert counted == [configs.coarse_wgrad_groups(call.geometry())], "the call took the coarse route"
    assert dw.is_contiguous(memory_format=CL)
    assert_rel_close(dw, _want(call), tolerance(dtype))
    assert conv_op.REPLAYS.count() == 1, "the route's launches (the coarse gradient, the copy) are kept"
    x.copy_(torch.randn_like(x))
    dy.copy_(torch.randn_like(dy))
    again = conv_op.backward_weight(call)  # replayed, reading the new values
    assert len(counted) == 1, "the second call replayed the first one's launches"
    assert_rel_close(again, _want(call), tolerance(dtype))


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_route_with_new_inputs(counted):
    x, dy, call = _gpu_call(torch.float16, 4, 128, 28, 28, 128, 32, 1)
    conv_op.backward_weight(call)  # compiled and recorded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = conv_op.backward_weight(call)
    x.copy_(torch.randn_like(x))
    dy.copy_(torch.randn_like(dy))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert counted, "the route ran"
    assert_rel_close(out, _want(call), tolerance(torch.float16))
