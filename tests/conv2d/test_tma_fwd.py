"""``tma_implicit_gemm`` (Gluon, sm_90): the strided 5-D TMA view of the input, its cost-model configs, its use
by ``auto`` and by the stride-1 data gradient; the TMA weight-gradient kernel. Compiled for sm_90 here without a
GPU; run by the GPU tests."""

from __future__ import annotations

from dataclasses import replace

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import tilegemm
from tilegemm.ops.conv2d.configs import _patch, tma_forward_config
from tilegemm.ops.conv2d.dispatch import pointwise_as_gemm
from tilegemm.ops.conv2d.problem import Geometry
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import SM90, assert_rel_close, compile_offline

CL = torch.channels_last


def _geo(N, C, H, K, R, stride, pad, groups=1, W=None):
    return Geometry(N, C, H, W or H, K, R, R, groups, (stride, stride), (pad,) * 4, (1, 1))


@pytest.mark.parametrize("N,C,H,K,R,stride", [
    (32, 64, 56, 64, 3, 1), (32, 256, 28, 256, 3, 2), (32, 512, 7, 512, 3, 1), (3, 16, 5, 40, 1, 1),
    (1, 32, 1, 8, 3, 1), (7, 48, 17, 100, 5, 2),
])
def test_config_covers_the_output_with_a_patch_that_fits(N, C, H, K, R, stride):
    g = _geo(N, C, H, K, R, stride, R // 2)
    cfg = tma_forward_config(g, 132)
    rows = cfg["BI"] * cfg["BH"] * cfg["BW"]
    assert rows in (64, 128)
    assert g.Cg % cfg["BLOCK_K"] == 0 and cfg["BLOCK_K"] in (16, 32, 64)
    assert cfg["BLOCK_N"] in (16, 32, 64, 128)
    ring = cfg["STAGES"] * (rows + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert ring <= (100 if cfg["STAGES"] == 3 else 200) * 1024  # two programs an SM, or one with a deep ring
    # the patch wastes no more than the best power-of-two patch of that size
    bi, bh, bw, tiles = _patch(g, rows)
    assert tiles * rows >= N * g.P * g.Q
    assert tiles == min(-(-N // (rows // (h * w))) * -(-g.P // h) * -(-g.Q // w)
                        for h in (1, 2, 4, 8, 16, 32, 64, 128) for w in (1, 2, 4, 8, 16, 32, 64)
                        if h * w <= rows and w <= 64)


def test_strided_1x1_layers_step_64_channels_past_c_where_16_divides_it_but_32_does_not():
    from tilegemm.ops.conv2d.configs import ragged_channel_step
    from tilegemm.ops.conv2d.tma_fwd import input_descriptor

    for c in (80, 208, 720, 1232, 1392):  # C % 32 == 16: 16-wide steps before
        g = _geo(32, c, 14, 1024, 1, 2, 0)
        assert ragged_channel_step(g) and tma_forward_config(g, 132)["BLOCK_K"] == 64
    for g in (_geo(32, 1232, 14, 1024, 1, 1, 0),  # stride 1: the descriptor's last dim is already C
              _geo(32, 1232, 14, 1024, 3, 2, 1),  # several taps: the weight's step would cross into the next tap
              _geo(32, 2464, 14, 1024, 1, 2, 0, groups=2),
              _geo(32, 48, 14, 1024, 1, 2, 0)):  # one step of 48: no gain
        assert not ragged_channel_step(g)
        assert g.Cg % tma_forward_config(g, 132)["BLOCK_K"] == 0
    assert tma_forward_config(_geo(32, 1024, 14, 1024, 1, 2, 0), 132)["BLOCK_K"] == 64  # whole steps unchanged
    assert tma_forward_config(_geo(32, 288, 14, 1024, 1, 2, 0), 132)["BLOCK_K"] == 32
    with pytest.raises(ValueError, match="strided 1x1"):
        input_descriptor(torch.empty(0), _geo(2, 208, 14, 96, 3, 2, 1), [1, 8, 1, 8, 64], None, ragged=True)


def test_cost_model_prefers_big_tiles_when_they_fill_the_gpu_and_small_ones_when_they_do_not():
    big = tma_forward_config(_geo(32, 64, 56, 256, 3, 1, 1), 132)  # 100352 pixels: 784 big tiles
    assert (big["BI"] * big["BH"] * big["BW"], big["BLOCK_N"]) == (128, 128)
    # one or two K steps: 64-pixel patches on a ring of two slots (more programs an SM)
    short = tma_forward_config(_geo(32, 64, 56, 256, 1, 1, 0), 132)
    assert (short["BI"] * short["BH"] * short["BW"], short["BLOCK_N"], short["STAGES"]) == (64, 128, 2)
    small = tma_forward_config(_geo(32, 256, 14, 256, 3, 1, 1), 132)  # 6272 pixels x 256: 98 big tiles
    assert (small["BI"] * small["BH"] * small["BW"], small["BLOCK_N"]) == (64, 64)
    # a 1x1 with few tiles and a long reduction is left to the GEMM (split-K fills the GPU)
    assert pointwise_as_gemm(_geo(32, 2048, 7, 512, 1, 1, 0), 132)
    # stride-1 1x1 layers over few pixels (14x14 at batch 32) go to the GEMM too; strided ones not
    assert pointwise_as_gemm(_geo(32, 256, 14, 1024, 1, 1, 0), 132)
    assert not pointwise_as_gemm(_geo(32, 512, 28, 1024, 1, 2, 0), 132)
    # strided ones whose output channels end in a partial 16-wide step: the GEMM on the kept pixels
    assert pointwise_as_gemm(_geo(32, 232, 56, 696, 1, 2, 0), 132, gluon=False)
    assert pointwise_as_gemm(_geo(32, 32, 112, 232, 1, 2, 0), 132, gluon=False)
    assert not pointwise_as_gemm(_geo(32, 32, 112, 224, 1, 2, 0), 132, gluon=False)
    assert not pointwise_as_gemm(_geo(32, 32, 112, 231, 1, 2, 0), 132, gluon=False)  # odd: not measured
    # channels not a multiple of 64 stepped more than twice go to the GEMM; one narrow step or 64-wide steps not
    # (where gluon_f16 cannot run them)
    assert pointwise_as_gemm(_geo(64, 144, 56, 24, 1, 1, 0), 132, gluon=False)
    assert not pointwise_as_gemm(_geo(64, 32, 112, 16, 1, 1, 0), 132, gluon=False)
    assert not pointwise_as_gemm(_geo(64, 192, 28, 32, 1, 1, 0), 132)
    # over many pixels with 2.5 waves of gluon_f16's tiles: its GEMM
    assert pointwise_as_gemm(_geo(32, 64, 56, 256, 1, 1, 0), 132)
    assert pointwise_as_gemm(_geo(32, 512, 28, 256, 1, 1, 0), 132)
    assert not pointwise_as_gemm(_geo(32, 512, 28, 128, 1, 1, 0), 132)  # 196 tiles: the TMA kernel


def test_1x1_layers_over_many_pixels_take_gluon_f16_with_a_tile_cut_to_them():
    from tilegemm.ops.conv2d.dispatch import pointwise_gluon_tile
    from tilegemm.ops.conv2d.gemm_1x1 import gluon_config
    from tilegemm.ops.matmul import gluon_f16

    def tile(*geo, sms=132):
        return pointwise_gluon_tile(_geo(*geo), sms)

    # wide layers: 64-deep K steps over 64 channels or more, the shipped tiles and rings
    assert tile(32, 64, 56, 256, 1, 1, 0) == (256, 128, 64, 3)  # 784 wide tiles: the rounds full
    # 512 -> 256 at 28x28: 196 wide tiles for 132 SMs leave most of the second round idle; 392 narrow ones not
    assert tile(32, 512, 28, 256, 1, 1, 0) == (128, 128, 64, 6)
    assert tile(32, 512, 28, 256, 1, 1, 0, sms=98) == (256, 128, 64, 3)  # with 98 SMs: two full rounds
    # fewer input channels: a K step of their power of two, the ring deeper
    assert tile(64, 16, 112, 96, 1, 1, 0) == (256, 128, 16, 8)
    assert tile(64, 24, 56, 144, 1, 1, 0) == (256, 128, 32, 6)
    # fewer output channels: 256 rows by their power of two
    assert tile(64, 32, 112, 16, 1, 1, 0) == (256, 16, 32, 8)
    assert tile(64, 144, 56, 24, 1, 1, 0) == (256, 32, 64, 5)
    assert tile(64, 192, 28, 32, 1, 1, 0) is None  # 196 such tiles: under 2.5 waves
    assert tile(32, 1024, 14, 512, 1, 1, 0) is None  # 6272 pixels
    assert tile(32, 512, 28, 256, 1, 2, 0) is None  # strided
    assert tile(32, 64, 56, 256, 3, 1, 1) is None  # not a 1x1
    assert tile(32, 64, 56, 260, 1, 1, 0) is None and tile(32, 60, 56, 256, 1, 1, 0) is None  # rows TMA can't step
    assert tile(64, 8, 112, 96, 1, 1, 0) is None and tile(64, 96, 112, 8, 1, 1, 0) is None  # under 16 channels
    for t in ((256, 128, 64, 3), (128, 128, 64, 6)):  # gluon_f16's shipped configs, output buffer unshared
        shipped = [{k: c[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", "SHARED_OUT", "num_warps")}
                   for c in gluon_f16.configs()]
        cfg = gluon_config(t)
        assert cfg["GLUON_F16"] and cfg["BLOCK_K"] == gluon_f16.BLOCK_K
        assert {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", "SHARED_OUT", "num_warps")} in shipped
    # auto leaves such a layer to the TMA kernel when the call's tensors do not let gluon_f16 run it
    assert pointwise_as_gemm(_geo(32, 64, 56, 256, 1, 1, 0), 132, gluon=True)
    assert not pointwise_as_gemm(_geo(32, 64, 56, 256, 1, 1, 0), 132, gluon=False)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 128), c=st.integers(1, 2048), hw=st.integers(1, 128), k=st.integers(1, 2048),
       sms=st.sampled_from([78, 114, 132, 144]))
def test_the_gluon_1x1_rule_gives_a_fitting_config_only_where_its_conditions_hold(n, c, hw, k, sms):
    from tilegemm.ops.conv2d.dispatch import (GEMM_1X1_PIXELS, GLUON_1X1_MIN_CHANNELS, GLUON_1X1_WAVES,
                                              pointwise_gluon_tile)
    from tilegemm.ops.matmul import gluon_f16

    g = _geo(n, c, hw, k, 1, 1, 0)
    tile = pointwise_gluon_tile(g, sms)
    pixels = n * hw * hw
    bm, bn = (128, 128) if k >= GLUON_1X1_MIN_CHANNELS else (256, min(128, max(16, 1 << (k - 1).bit_length())))
    waves = -(-pixels // bm) * -(-k // bn) / sms
    if pixels <= GEMM_1X1_PIXELS or waves < GLUON_1X1_WAVES or c % 8 or k % 8 or c < 16 or k < 16:
        assert tile is None
        return
    bm, bn, bk, stages = tile
    assert pointwise_as_gemm(g, sms)  # auto sends it to gemm_1x1
    assert bk == min(64, max(16, 1 << (c - 1).bit_length()))  # the channels' power of two: one step or 64s
    assert bn >= min(k, 128) and (bn == 128 or bn < 2 * k)  # no wider than the output channels need
    assert gluon_f16._fits(bm, bn, stages, False, bk) and (stages == 8 or not gluon_f16._fits(bm, bn, stages + 1,
                                                                                                False, bk))
    if bm == 128:  # the narrow tile only over more than one K step, when it fills the last round better
        wide = -(-pixels // 256) * -(-k // 128)
        assert c > 64 and wide / (-(-wide // sms) * sms) < 0.85
    assert pointwise_gluon_tile(_geo(n, c, hw, k, 3, 1, 1), sms) is None  # a 3x3: never
    assert pointwise_gluon_tile(_geo(n, c, hw, k, 1, 2, 0), sms) is None  # strided: never


def test_auto_takes_the_tma_kernel_where_it_can():
    from tilegemm.ops.conv2d.dispatch import choose_kernel

    g3 = _geo(32, 64, 56, 64, 3, 1, 1)
    assert choose_kernel(g3, True, tma=True) == "tma_implicit_gemm"
    assert choose_kernel(g3, True, tma=False) == "implicit_gemm"
    g1 = _geo(32, 256, 56, 512, 1, 2, 0)  # strided projection: read in place through the stride-2 view
    assert choose_kernel(g1, True, tma=True) == "tma_implicit_gemm"
    assert choose_kernel(_geo(32, 2048, 7, 512, 1, 1, 0), True, tma=True) == "gemm_1x1"
    dw = Geometry(2, 32, 8, 8, 32, 3, 3, 32, (1, 1), (1,) * 4, (1, 1))
    assert choose_kernel(dw, True, tma=True) == "depthwise"


def test_a_one_slot_ring_is_refused_before_anything_launches():
    # the kernel refills the slot of the step before the one in flight: one slot would hang the GPU
    from tilegemm.ops.conv2d.tma_fwd import launch_args

    cfg = dict(BI=1, BH=8, BW=8, BLOCK_N=16, BLOCK_K=16, STAGES=1, num_warps=4)
    with pytest.raises(ValueError, match="2 slots at least"):
        launch_args(None, None, None, None, _geo(2, 16, 8, 16, 3, 1, 1), "none", cfg)


@pytest.mark.parametrize("C,H,W,R,S,stride,padding,dilation_h", [
    (3, 14, 16, 7, 7, (2, 2), (3, 3, 3, 3), 1),  # ResNet's stem, small
    (3, 15, 17, 7, 7, (2, 2), (3, 3, 3, 3), 1),  # odd image: the copy's extra row and columns
    (1, 9, 10, 3, 3, (1, 2), (1, 1, 1, 1), 1),
    (8, 8, 6, 5, 4, (2, 2), (2, 1, 0, 2), 1),  # even filter, no left padding, asymmetric
    (5, 7, 12, 1, 2, (1, 2), (0, 0, 1, 0), 1),
    (2, 6, 8, 3, 5, (1, 2), (0, 1, 4, 1), 1),  # padding wider than half the filter
    (3, 12, 11, 3, 3, (1, 1), (1, 1, 1, 1), 1),  # stride 1 (VGG's first layer): 8 channels a pixel
    (4, 13, 19, 3, 5, (3, 3), (2, 0, 2, 1), 2),  # stride 3, dilated rows
    (2, 10, 23, 4, 11, (2, 4), (1, 2, 5, 5), 1),  # stride 4: 2 channels a pixel, a window of 3 K steps
])
def test_stem_as_a_window_convolution(C, H, W, R, S, stride, padding, dilation_h, device):
    # conv(x, w) over few channels equals a convolution over overlapping windows of the padded input (one tap
    # along the width, horizontal stride 1): the two operand kernels (plain Triton) and the window geometry,
    # checked with F.conv2d on both sides (the TMA kernel that then runs it is tested on the GPU)
    import torch.nn.functional as F
    from tilegemm.ops.conv2d.tma_fwd import stem_layout, stem_operands

    top, bottom, left, right = padding
    x = torch.randn(2, C, H, W, device=device)
    w = torch.randn(6, C, R, S, device=device)
    g = Geometry(2, C, H, W, 6, R, S, 1, stride, padding, (dilation_h, 1))
    want = F.conv2d(F.pad(x.double(), (left, right, top, bottom)), w.double(), stride=stride,
                    dilation=(dilation_h, 1))
    cp, cv, hp, wp = stem_layout(g)
    assert (stride[1] * cp) % 8 == 0 and cp >= C and cv % 16 == 0 and cv >= S * cp and hp % stride[0] == 0
    xv, wv, xbuf, _, gv = stem_operands(x, w, g)
    # the window image is a view into the copy whose pixels overlap, and every window ends inside the copy
    assert xv.stride() == (hp * wp * cp, 1, wp * cp, stride[1] * cp) and xbuf.numel() >= 2 * hp * wp * cp
    assert (gv.C, gv.W, gv.S, gv.stride) == (cv, g.Q, 1, (stride[0], 1)) and (gv.P, gv.Q) == (g.P, g.Q)
    t, b, l, r = gv.padding
    got = F.conv2d(F.pad(xv.double(), (l, r, t, b)), wv.double(), stride=gv.stride, dilation=gv.dilation)
    assert_rel_close(got, want, 1e-12)
    # a channels-last input (read pixel by pixel, where NCHW is read plane by plane) makes the same windows
    planar = xv.clone()
    xv2, *_ = stem_operands(x.contiguous(memory_format=CL), w, g)
    assert torch.equal(xv2.clone(), planar)


@pytest.mark.parametrize("H,W,R,S,stride,padding,dilation", [
    (9, 9, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
    (8, 7, 3, 2, (1, 1), (1, 2, 0, 1), (2, 1)),  # stride 1: one phase, dilation kept
    (9, 11, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1)),
    (12, 12, 1, 1, (2, 2), (0, 0, 0, 0), (1, 1)),  # three empty phases
    (12, 9, 5, 4, (3, 2), (2, 2, 1, 1), (1, 1)),
    (7, 8, 2, 3, (2, 3), (0, 1, 2, 0), (1, 1)),
])
def test_data_gradient_phases_reassemble_the_transposed_convolution(H, W, R, S, stride, padding, dilation):
    # each stride phase of dx is conv2d(dy, w_ab) with the geometry and weight indices dgrad_phases gives;
    # assembled, the phases equal autograd's data gradient (float64, CPU, torch on both sides). The GPU path
    # takes stride 1 only (one phase): strided splits cost more host time than they save (tma_fwd.dgrad_tma)
    import torch.nn.functional as F
    from tilegemm.ops.conv2d.tma_fwd import dgrad_phases

    N, C, K = 2, 3, 4
    g = Geometry(N, C, H, W, K, R, S, 1, stride, padding, dilation)
    x = torch.randn(N, C, H, W, dtype=torch.float64, requires_grad=True)
    w = torch.randn(K, C, R, S, dtype=torch.float64)
    top, bottom, left, right = padding
    y = F.conv2d(F.pad(x, (left, right, top, bottom)), w, stride=stride, dilation=dilation)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    got = torch.full_like(want, float("nan"))
    for a, b, gt, r0, s0 in dgrad_phases(g):
        part = got[:, :, a::stride[0], b::stride[1]]
        if gt is None:
            part.zero_()
            continue
        step = stride if stride != (1, 1) else (1, 1)
        u, v = torch.arange(gt.R), torch.arange(gt.S)
        wt = w[:, :, r0 - step[0] * u][:, :, :, s0 - step[1] * v].transpose(0, 1)  # [C, K, U, V]
        t, bt, lt, rt = gt.padding
        part.copy_(F.conv2d(F.pad(dy, (lt, rt, t, bt)), wt, dilation=gt.dilation))
    assert_rel_close(got, want, 1e-12)


_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.ops.conv2d import tma_fwd
    from tilegemm.ops.conv2d.problem import Geometry

    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        N, C, H, K, R, st, pad, groups = v["geo"]
        g = Geometry(N, C, H, H, K, R, R, groups, (st, st), (pad,) * 4, (1, 1))
        dt = getattr(torch, v["dtype"])
        x = torch.empty(N, H, H, C, dtype=dt).permute(0, 3, 1, 2)
        w = torch.empty(K, R, R, C // groups, dtype=dt).permute(0, 3, 1, 2)
        out = torch.empty(N, g.P, g.Q, K, dtype=dt).permute(0, 3, 1, 2)
        if v.get("nchw_out"):
            out = torch.empty(N, K, g.P, g.Q, dtype=dt)
        bias = torch.empty(K, dtype=dt) if v["bias"] else None
        cfg = tma_fwd.config(g, dt, 132)
        kernel, grid, args, kwargs = tma_fwd.launch_args(x, w, out, bias, g, v["act"], cfg)
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
        report[name] = dict(
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
            waits=sorted({int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)}),
            tma_loads=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.5d", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            box=list(args[0].block_shape), shared=compiled.metadata.shared, pixel_stores=kwargs["PIXEL_STORES"],
        )
    print(json.dumps(report))
    """
)

_VARIANTS = {
    "3x3-fp16": dict(geo=[32, 64, 56, 64, 3, 1, 1, 1], dtype="float16", bias=False, act="none"),
    "3x3-stride2-bf16-bias-relu": dict(geo=[32, 256, 28, 256, 3, 2, 1, 1], dtype="bfloat16", bias=True, act="relu"),
    "1x1-stride2-groups2-gelu": dict(geo=[8, 64, 14, 128, 1, 2, 0, 2], dtype="float16", bias=True, act="gelu"),
    "5x5-C16": dict(geo=[4, 16, 9, 24, 5, 1, 2, 1], dtype="float16", bias=False, act="none"),
    "3x3-nchw-out-bias": dict(geo=[8, 64, 28, 96, 3, 1, 1, 1], dtype="bfloat16", bias=True, act="none",
                              nchw_out=True),
}


_COMPILE_WGRAD = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.core import launch as launch_module
    from tilegemm.core import workspace
    from tilegemm.ops.conv2d import tma_wgrad
    from tilegemm.ops.conv2d.problem import Geometry

    seen = {}
    launch_module.launch = lambda kernel, grid, args, kwargs, **_: seen.update(kernel=kernel, args=args, kwargs=kwargs)
    workspace.split_workspace = lambda device, floats, counters, *a, **k: (
        torch.empty(floats), torch.empty(counters, dtype=torch.int32))
    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        N, C, H, K, R, st, pad = v[:7]
        g = Geometry(N, C, H, H, K, R, R, 1, (st, st), (pad,) * 4, (1, 1))
        x = torch.empty(N, H, H, C, dtype=torch.float16).permute(0, 3, 1, 2)
        dy = torch.empty(N, g.P, g.Q, K, dtype=torch.float16).permute(0, 3, 1, 2)
        cfg = dict(tma_wgrad.config(g, 132), **(v[7] if len(v) > 7 else {}))
        tma_wgrad.run(dy, x, g, torch.float16, cfg, memory_format=torch.channels_last)  # as op._wgrad runs it
        sig, constexprs, attrs = launch_signature(seen["kernel"], seen["args"], seen["kwargs"])
        compiled, ptx, info = compile_sm90(seen["kernel"], sig, constexprs, attrs, seen["kwargs"]["num_warps"])
        report[name] = dict(split=seen["kwargs"]["SPLIT"], boxes=re.findall(r"cp\\.async\\.bulk\\.tensor\\.(\\d)d", ptx), mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
                            tma_loads=len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)),
                            atomics=len(re.findall(r"atom\\.", ptx)), shared=compiled.metadata.shared,
                            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)])
    print(json.dumps(report))
    """
)


def test_weight_gradient_kernel_compiles_for_sm90(tmp_path):
    cases = {"3x3-split": [32, 64, 56, 64, 3, 1, 1], "3x3-stride2": [32, 256, 28, 256, 3, 2, 1],
             "odd-one-slice": [4, 40, 9, 24, 3, 1, 1],
             "wide-64x128": [32, 256, 14, 256, 3, 1, 1, dict(BM=64, BN=128)],
             "wide-128x128": [32, 256, 14, 256, 3, 1, 1, dict(BM=128, BN=128, num_warps=8)]}
    report = compile_offline(tmp_path, _COMPILE_WGRAD, cases, timeout=600)
    assert report["3x3-split"]["split"] > 1 and report["odd-one-slice"]["split"] == 1
    for name, r in report.items():
        assert r["tma_loads"] >= 4 and r["mmas"] >= 1, name  # two boxes a step, prologue and loop
        assert (r["atomics"] > 0) == (r["split"] > 1), name  # the last-arrival counter only when split
        assert r["shared"] <= (100 if "wide" not in name else 227) * 1024 and r["spills"] in ([], [0]), name


def test_compiles_for_sm90_with_5d_tma_loads_and_async_mmas(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=600)
    for name, r in report.items():
        assert r["tma_loads"] >= 2, name  # the input's 5-D boxes: the prologue's and the loop's
        assert r["mmas"] >= 1 and r["waits"] == [0, 1], f"{name}: {r['waits']}"  # one MMA group in flight
        assert r["spills"] in ([], [0]), f"{name}: spills {r['spills']}"
        assert r["box"][2] == 1 and r["box"][0] * r["box"][1] * r["box"][3] in (64, 128), name
        assert r["shared"] <= 200 * 1024, name
        assert r["pixel_stores"] == name.startswith("3x3-nchw-out"), name  # the epilogue's layout follows the output


# --- on the GPU ------------------------------------------------------------------------------------------


def _inputs(dtype, N, C, H, W, K, R, S, groups=1, bias=True):
    x = torch.randn(N, C, H, W, device="cuda").to(dtype).contiguous(memory_format=CL)
    w = (torch.randn(K, C // groups, R, S, device="cuda") / (C // groups * R * S) ** 0.5).to(dtype)
    b = torch.randn(K, device="cuda").to(dtype) if bias else None
    return x, w, b


GPU_CASES = [  # (N, C, H, W, K, R, S, stride, padding, dilation, groups)
    pytest.param(3, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1, id="resnet-3x3"),
    pytest.param(5, 32, 17, 23, 40, 3, 3, 1, 1, 1, 1, id="odd-image-K40-C32"),
    pytest.param(2, 16, 9, 9, 24, 5, 5, 1, 2, 1, 1, id="5x5-C16"),
    pytest.param(3, 48, 16, 14, 72, 3, 3, 2, 1, 1, 1, id="stride2-odd-channels"),
    pytest.param(2, 64, 12, 20, 96, 1, 1, 2, 0, 1, 1, id="1x1-stride2"),
    pytest.param(3, 208, 14, 14, 96, 1, 1, 2, 0, 1, 1, id="1x1-stride2-ragged-C208"),
    pytest.param(2, 80, 12, 21, 136, 1, 1, (2, 3), 0, 1, 1, id="1x1-stride2x3-ragged-C80"),
    pytest.param(2, 64, 12, 20, 96, 3, 3, (2, 1), (0, 2), 1, 1, id="mixed-stride-padding"),
    pytest.param(1, 32, 11, 13, 32, 3, 3, 1, "same", 2, 1, id="same-dilated"),
    pytest.param(2, 32, 10, 10, 16, 4, 2, 1, "same", 1, 1, id="same-even-filter"),
    pytest.param(2, 64, 9, 9, 64, 3, 3, 1, 1, 1, 2, id="groups2"),
    pytest.param(37, 128, 7, 7, 200, 3, 3, 1, 1, 1, 1, id="7x7-images-many-per-tile"),
    pytest.param(2, 16, 1, 1, 8, 3, 3, 1, 1, 1, 1, id="1x1-image"),
    pytest.param(3, 3, 32, 32, 64, 7, 7, 2, 3, 1, 1, id="stem-C3"),
    pytest.param(2, 5, 18, 10, 24, 4, 3, (1, 2), (2, 1), 1, 1, id="stem-C5-even-filter"),
    pytest.param(2, 3, 33, 31, 64, 3, 3, 1, 1, 1, 1, id="stem-C3-stride1"),
    pytest.param(3, 3, 31, 29, 32, 3, 3, 2, 1, 1, 1, id="stem-C3-odd-image"),
    pytest.param(2, 4, 29, 27, 40, 5, 11, (3, 4), (2, 5), (2, 1), 1, id="stem-C4-stride3x4-dilated-rows"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,padding,dilation,groups", GPU_CASES)
def test_gpu_forward_matches_f_conv2d(N, C, H, W, K, R, S, stride, padding, dilation, groups, dtype):
    x, w, b = _inputs(dtype, N, C, H, W, K, R, S, groups)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, activation="relu", kernel="tma_implicit_gemm")  # outputs poisoned
    assert out.is_contiguous(memory_format=CL)
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), tolerance(dtype))


@pytest.mark.gpu
def test_gpu_ragged_channel_steps_read_zeros_past_c_not_the_skipped_pixels():
    # a strided 1x1 layer whose last 64-channel step runs past C: the pixels the stride skips hold NaN, which
    # the step must never read (TMA fills zeros past C instead of reading the next pixel's channels)
    x, w, b = _inputs(torch.float16, 2, 208, 14, 14, 64, 1, 1)
    x[:, :, 1::2, :] = float("nan")
    x[:, :, :, 1::2] = float("nan")
    out = tilegemm.conv2d(x, w, b, stride=2, kernel="tma_implicit_gemm")
    ref = conv2d_reference(x[:, :, ::2, ::2].contiguous(memory_format=CL), w, b)
    assert not out.isnan().any()
    assert_rel_close(out, ref, tolerance(torch.float16))


@pytest.mark.gpu
def test_gpu_fp32_output_channel_slices_and_a_misaligned_weight():
    from tilegemm.ops.conv2d import tma_fwd
    from tilegemm.ops.conv2d.checks import check_conv
    from tilegemm.ops.conv2d.op import _conv2d_op

    # an fp32 output (what the backward's recomputed pre-activation asks for)
    x, w, b = _inputs(torch.float16, 2, 32, 9, 9, 24, 3, 3)
    out = _conv2d_op(x, w, b, [1, 1], [1, 1, 1, 1], [1, 1], 1, "gelu", "default", "tma_implicit_gemm", torch.float32)
    assert out.dtype == torch.float32
    assert_rel_close(out, conv2d_reference(x, w, b, padding=1, activation="gelu"), tolerance(torch.float16))
    # a channel slice of a bigger channels-last tensor: pixels 96 channels apart, 32 read
    big = torch.randn(2, 96, 10, 10, device="cuda").half().contiguous(memory_format=CL)
    xs = big[:, 16:48]
    assert tma_fwd.why_not_input(xs, w, check_conv(xs, w, None, 1, 1, 1, 1)) is None
    out = tilegemm.conv2d(xs, w, padding=1, kernel="tma_implicit_gemm")
    assert_rel_close(out, conv2d_reference(xs, w, padding=1), tolerance(torch.float16))
    # with stride 2 the phase view needs packed pixels: declined by name, auto falls back
    g2 = check_conv(xs, w, None, 2, 1, 1, 1)
    assert tma_fwd.why_not_input(xs, w, g2) == "pixels not packed"
    assert_rel_close(tilegemm.conv2d(xs, w, stride=2, padding=1), conv2d_reference(xs, w, stride=2, padding=1),
                     tolerance(torch.float16))
    # a 1x1 weight that is a view at an odd element offset of a flat buffer: channels-last already, misaligned
    flat = torch.randn(24 * 32 + 1, device="cuda").half()
    w1 = flat[1:].view(24, 32, 1, 1)
    assert w1.data_ptr() % 16 and w1.is_contiguous(memory_format=CL)
    out = tilegemm.conv2d(x, w1, stride=1, kernel="tma_implicit_gemm")
    assert_rel_close(out, conv2d_reference(x, w1), tolerance(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_stem_with_an_nchw_input_takes_the_window_route(dtype):
    # the window route copies the input whatever its layout: an NCHW stem of 64 output channels is taken by the
    # TMA kernel under auto too (fewer go to the stem kernel: dispatch.stem_kernel_pays), and its output stays NCHW
    from tilegemm.ops.conv2d.checks import check_conv
    from tilegemm.ops.conv2d.dispatch import _tma_usable
    from tilegemm.ops.conv2d.problem import ConvProblem

    x, w, b = _inputs(dtype, 2, 3, 30, 34, 64, 7, 7)
    xn = x.contiguous()
    g = check_conv(xn, w, b, 2, 3, 1, 1)
    assert _tma_usable(ConvProblem(xn, w, b, g, dtype, torch.contiguous_format, "none", "ieee", False))
    for kernel in ("tma_implicit_gemm", "auto"):
        out = tilegemm.conv2d(xn, w, b, stride=2, padding=3, kernel=kernel)
        assert out.is_contiguous()
        assert_rel_close(out, conv2d_reference(xn, w, b, stride=2, padding=3), tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias,act", [(False, "none"), (True, "relu")])
def test_gpu_wide_1x1_through_gluon_f16(dtype, bias, act, monkeypatch):
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d import op as replay
    from tilegemm.ops.conv2d.dispatch import pointwise_gluon_tile
    from tilegemm.ops.conv2d.gemm_1x1 import gluon_config
    from tilegemm.ops.conv2d.problem import geometry_of
    from tilegemm.ops.matmul import gluon_f16

    launched = []
    real = gluon_f16.launch_args
    monkeypatch.setattr(gluon_f16, "launch_args", lambda *a, **k: launched.append(a[1]) or real(*a, **k))
    replay.REPLAYS.clear()
    # 4 x 96 x 96 pixels, 24 -> 144 channels (neither a multiple of 64; K one padded step): the gluon route
    x, w, b = _inputs(dtype, 4, 24, 96, 96, 144, 1, 1, bias=bias)
    g = geometry_of(x.shape, w.shape, (1, 1), (0,) * 4, (1, 1), 1)
    want = gluon_config(pointwise_gluon_tile(g, sm_count(x.device)))
    for trial in range(3):  # the first call records, later ones replay over new inputs and a changed weight
        out = tilegemm.conv2d(x, w, b, activation=act)
        assert out.is_contiguous(memory_format=torch.channels_last)
        ref = conv2d_reference(x, w, b)
        assert_rel_close(out, ref.relu() if act == "relu" else ref, tolerance(dtype))
        x = torch.randn_like(x)
        w.mul_(-1.5)
    assert launched == [want]  # launched once through the Python path, then replayed


@pytest.mark.gpu
def test_gpu_wide_1x1_leaves_gluon_f16_where_the_tensors_do_not_let_it(monkeypatch):
    # the layer of the test above with an NCHW input, or an fp32 output: not the channels-last GEMM on gluon_f16.
    # (The NCHW layer is one batched GEMM over the images, which matmul's auto may give gluon_f16's batched launch.)
    from tilegemm.ops.conv2d import op as replay
    from tilegemm.ops.matmul import gluon_f16

    launched = []
    real = gluon_f16.launch_args
    monkeypatch.setattr(gluon_f16, "launch_args", lambda *a, **k: launched.append(a[0].batch) or real(*a, **k))
    replay.REPLAYS.clear()
    x, w, _ = _inputs(torch.float16, 4, 24, 96, 96, 144, 1, 1, bias=False)
    out = tilegemm.conv2d(x.contiguous(), w)
    assert_rel_close(out, conv2d_reference(x, w), tolerance(torch.float16))
    assert all(batch == 4 for batch in launched), launched
    launched.clear()
    from tilegemm.ops.conv2d.op import _conv2d_op

    out = _conv2d_op(x, w, None, [1, 1], [0, 0, 0, 0], [1, 1], 1, "none", "default", "auto", torch.float32)
    assert out.dtype == torch.float32
    assert_rel_close(out, conv2d_reference(x, w), tolerance(torch.float16))
    assert not launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_wide_1x1_data_gradient_through_gluon_f16(dtype, monkeypatch):
    # 144 -> 24 channels forward: its data gradient is the 24 -> 144 GEMM over 36864 pixels, gluon_f16's class
    from tilegemm.ops.conv2d import op as replay
    from tilegemm.ops.matmul import gluon_f16

    launched = []
    real = gluon_f16.launch_args
    monkeypatch.setattr(gluon_f16, "launch_args", lambda *a, **k: launched.append(a[1]) or real(*a, **k))
    replay.REPLAYS.clear()
    x, w, _ = _inputs(dtype, 4, 144, 96, 96, 24, 1, 1, bias=False)
    x.requires_grad_()
    dy = torch.randn(4, 24, 96, 96, device="cuda").to(dtype).contiguous(memory_format=CL)
    out = tilegemm.conv2d(x, w)
    launched.clear()  # the forward's launches (the GEMM it runs may take gluon_f16's configs too)
    out.backward(dy)
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d.dispatch import pointwise_gluon_tile
    from tilegemm.ops.conv2d.gemm_1x1 import gluon_config
    from tilegemm.ops.conv2d.problem import Geometry

    transposed = Geometry(4, 24, 96, 96, 144, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1))
    assert launched == [gluon_config(pointwise_gluon_tile(transposed, sm_count(x.device)))]
    xr = x.detach().double().requires_grad_()
    torch.nn.functional.conv2d(xr, w.double()).backward(dy.double())
    assert x.grad.is_contiguous(memory_format=CL)
    assert_rel_close(x.grad, xr.grad, tolerance(dtype))


@pytest.mark.gpu
def test_gpu_auto_routes_and_declines_with_reasons():
    x, w, _ = _inputs(torch.float16, 2, 24, 8, 8, 16, 3, 3, bias=False)  # C=24: not a multiple of 16
    from tilegemm.core.registry import NotApplicable

    # taken over padded channels (ops/conv2d/padded.py; tests/conv2d/test_conv2d_padded.py)
    assert_rel_close(tilegemm.conv2d(x, w, padding=1, kernel="tma_implicit_gemm"), conv2d_reference(x, w, padding=1),
                     tolerance(torch.float16))
    x2, w2, _ = _inputs(torch.float16, 2, 32, 9, 9, 16, 1, 1, bias=False)
    with pytest.raises(NotApplicable, match="not divisible by the stride"):
        tilegemm.conv2d(x2, w2, stride=2, kernel="tma_implicit_gemm")
    # auto falls back to the pointer kernels there, and stays right
    for xx, ww, conv in ((x, w, dict(padding=1)), (x2, w2, dict(stride=2))):
        assert_rel_close(tilegemm.conv2d(xx, ww, **conv), conv2d_reference(xx, ww, **conv), tolerance(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,conv", [
    ((3, 64, 14, 14, 96, 3, 3), dict(padding=1)),
    ((2, 32, 11, 9, 48, 3, 3), dict(padding="same", dilation=2)),
    ((2, 64, 10, 10, 64, 3, 3), dict(padding=1, groups=2)),
    ((2, 32, 8, 8, 32, 3, 3), dict(padding=0)),
])
def test_gpu_data_gradient_through_the_tma_kernel(shape, conv):
    from tilegemm.ops.conv2d import op as replay
    from tilegemm.ops.conv2d.op import backward_data
    from tilegemm.ops.conv2d.problem import DgradCall

    N, C, H, W, K, R, S = shape
    groups = conv.get("groups", 1)
    x, w, _ = _inputs(torch.float16, N, C, H, W, K, R, S, groups, bias=False)
    xr, wr = x.double().requires_grad_(), w.double()
    ref = conv2d_reference(xr, wr, **conv)
    dy = torch.randn(ref.shape, device="cuda").half().contiguous(memory_format=CL)
    (want,) = torch.autograd.grad(ref, xr, dy.double(), retain_graph=True)
    from tilegemm.ops.conv2d.checks import check_conv
    from tilegemm.ops.conv2d import tma_fwd

    g = check_conv(x, w, None, conv.get("stride", 1), conv.get("padding", 0), conv.get("dilation", 1), groups)
    c = DgradCall(dy, w, list(x.shape), True, list(g.stride), list(g.padding), list(g.dilation), groups, "ieee")
    direct = tma_fwd.dgrad_tma(dy, w, g)  # the TMA path takes it (None would mean a fallback)
    assert tma_fwd.dgrad_tma(dy, w, check_conv(x, w, None, 2, 1, 1, groups)) is None  # strided: pointer kernel
    assert direct is not None
    assert_rel_close(direct, want, tolerance(torch.float16))
    replay.REPLAYS.clear()
    dy2 = torch.randn_like(dy)  # a replay reads the call's dy, not the recorded one
    (want2,) = torch.autograd.grad(ref, xr, dy2.double())
    first = backward_data(c)
    assert_rel_close(first, want, tolerance(torch.float16))
    assert_rel_close(backward_data(replace(c, dy=dy2)), want2, tolerance(torch.float16))
    assert replay.REPLAYS.count() == 1, "the weight's flip and the convolution are replayed together"
    # a replay with a weight changed in place flips the new weight (into the workspace its descriptor was
    # encoded over once)
    w.mul_(-2.0)
    again = backward_data(c)
    assert_rel_close(again, -2.0 * want, tolerance(torch.float16))


def _wgrad_case(shape, conv, dtype):
    """(dy, x, w, geometry, the float64 weight gradient) for a channels-last convolution ``conv`` of ``shape``."""
    from tilegemm.ops.conv2d.checks import check_conv

    N, C, H, W, K, R, S = shape
    groups = conv.get("groups", 1)
    x, w, _ = _inputs(dtype, N, C, H, W, K, R, S, groups, bias=False)
    xr, wr = x.double(), w.double().requires_grad_()
    ref = conv2d_reference(xr, wr, **conv)
    dy = torch.randn(ref.shape, device="cuda").to(dtype).contiguous(memory_format=CL)
    (want,) = torch.autograd.grad(ref, wr, dy.double())
    g = check_conv(x, w, None, conv.get("stride", 1), conv.get("padding", 0), conv.get("dilation", 1), groups)
    return dy, x, w, g, want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,conv", [
    ((4, 64, 28, 28, 64, 3, 3), dict(padding=1)),
    ((3, 48, 14, 16, 40, 3, 3), dict(stride=2, padding=1)),
    ((2, 32, 11, 9, 24, 3, 3), dict(padding="same", dilation=2)),
    ((2, 64, 10, 10, 96, 3, 3), dict(padding=1, groups=2)),
    ((2, 64, 12, 12, 128, 1, 1), dict(stride=2)),
    ((16, 512, 7, 7, 512, 3, 3), dict(padding=1)),
])
def test_gpu_weight_gradient_through_the_tma_kernel(shape, conv, dtype):
    from tilegemm.ops.conv2d import op as replay
    from tilegemm.ops.conv2d import tma_wgrad
    from tilegemm.ops.conv2d.op import backward_weight
    from tilegemm.ops.conv2d.problem import WgradCall, wgrad_format

    dy, x, w, g, want = _wgrad_case(shape, conv, dtype)
    assert tma_wgrad.why_not(dy, x, g) is None
    c = WgradCall(dy, x, list(w.shape), list(g.stride), list(g.padding), list(g.dilation), g.groups, "ieee")
    replay.REPLAYS.clear()
    for _ in range(2):  # recorded, then replayed (the split's counters must be back at zero)
        got = backward_weight(c)
        # channels-last x: a channels-last gradient where the filter has several taps and channels
        assert got.dtype == dtype and got.is_contiguous(memory_format=wgrad_format(x, w.shape))
        assert got.is_contiguous(memory_format=torch.channels_last) or g.R * g.S == 1
        assert_rel_close(got, want, tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tile", [(64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("shape,conv,split", [
    ((4, 200, 14, 14, 136, 3, 3), dict(padding=1), 1),  # channels past the tile's edge, one slice
    ((8, 256, 14, 14, 256, 3, 3), dict(padding=1), 3),  # an uneven split of the pixels
    ((3, 48, 14, 16, 264, 3, 3), dict(stride=2, padding=1), 2),
    ((2, 256, 10, 10, 128, 3, 3), dict(padding=1, groups=2), 1),
])
def test_gpu_weight_gradient_wide_tiles(shape, conv, split, tile, dtype):
    """128-wide channel tiles: boxes wider than the 128-byte swizzle, copied in two messages."""
    from tilegemm.ops.conv2d import tma_wgrad

    dy, x, _, g, want = _wgrad_case(shape, conv, dtype)
    cfg = dict(tma_wgrad.config(g, 132, *tile), SPLIT=split)
    for _ in range(2):  # the split's counters must be back at zero
        assert_rel_close(tma_wgrad.run(dy, x, g, dtype, cfg), want, tolerance(dtype))


@pytest.mark.parametrize("groups,channels_last", [(1, True), (2, True), (2, False)], ids=["g1-cl", "g2-cl", "g2-nchw"])
def test_flipped_weight_is_every_tap_turned_around(groups, channels_last, device):
    """The stride-1 data gradient's weight, ``out[c, u, v, k] = w[grp*Kg + k, c - grp*Cg, R-1-u, S-1-v]``, made
    in [64, 64] tiles of one tap: channel counts past one tile and not tile multiples, groups, either layout of
    the weight, every element written (the buffer poisoned first)."""
    from tilegemm.core.runtime import cdiv
    from tilegemm.ops.conv2d.tma_fwd import phase_weight_kernel

    Kg, Cg, R, S = 70, 66, 3, 2
    K, C = Kg * groups, Cg * groups
    w = torch.randn(K, Cg, R, S, device=device)
    if channels_last:
        w = w.contiguous(memory_format=torch.channels_last)
    out = torch.full((C * R * S * Kg,), float("nan"), device=device)
    phase_weight_kernel[(cdiv(Kg, 64), cdiv(C, 64), R * S)](w, out, C, Kg, Kg, Cg, S, R - 1, S - 1, 1, 1,
                                                             *w.stride(), BLOCK_C=64, BLOCK_K=64)
    want = torch.empty(C, R, S, Kg, device=device)
    for c in range(C):
        grp = c // Cg
        want[c] = w[grp * Kg:(grp + 1) * Kg, c - grp * Cg].flip(1, 2).permute(1, 2, 0)
    assert torch.equal(out.view(C, R, S, Kg), want)
