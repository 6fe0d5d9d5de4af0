"""Grouped convolutions with few channels per group (ResNeXt's and RegNet's 3x3s: 2-8 channels a group) as
direct kernels on CUDA cores: the forward and both gradients.

Seen as GEMMs, such a group is a product whose reduction (C/groups * R * S, walked tap by tap in C/groups
steps) and width (K/groups) are far below a ``tl.dot`` tile's 16, so most of every tensor-core tile is padding.
Here the arithmetic is plain fp32 multiply-adds instead: a program owns ``[BLOCK_M pixels, BLOCK_G groups x
K/groups channels]`` of the channels-last output (a ``[BM, BG, KGP]`` accumulator, KGP = K/groups to a power
of two) and, for each filter tap and each of a group's CG input channels, adds the outer product of the pixels'
input value of that channel, one ``[BM, BG]`` load shared by the group's K/groups outputs, and the group's
weights ``[BG, KGP]``. This is :func:`tilegemm.ops.conv2d.depthwise.depthwise_fwd_kernel`'s pattern with a
group's channels for its one channel. The data gradient is the same with the roles of input and output
channels swapped and the taps transposed (each input pixel gathers the output pixels whose window covers
it). The weight gradient sums, for each tap and group, the outer products of a pixel's K/groups output
gradients and its CG input values over the pixels, split over programs. Which layers come here: :func:`tilegemm.ops.conv2d.configs.takes_grouped_direct` (docs/conv2d.md).
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import launch
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv, ensure_backend, interpreting
from tilegemm.ops.conv2d.configs import (GROUPED_DIRECT_MOST_CHANNELS, GROUPED_DIRECT_WGRAD_MIN_STEPS,
                                         GROUPED_DIRECT_WGRAD_PER_SM, _pow2_at_least, pixel_split)
from tilegemm.ops.conv2d.implicit_gemm import _conv_args, _nhwc_strides, allocate_out, empty_4d
from tilegemm.ops.conv2d.problem import ConvProblem, Geometry, needs_index_64

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tilegemm.jit.helpers import apply_activation, store_summed_slices  # noqa: E402

_SIZES = ["H", "W", "P", "Q", "M", "G", "pad_h", "pad_w"]  # not specialized on: a new image compiles nothing


@triton.jit
def _fwd_tap(acc, rs, x_rows, x_grp, w_kc, h0, w0, m_ok, g_ok, wk_ok, H, W, stride_xh, stride_xw, stride_xc,
             stride_wc, stride_wr, stride_ws, dil_h, dil_w, S: tl.constexpr, CG: tl.constexpr):
    """``acc`` plus tap ``rs = r * S + s`` of every group: its CG input channels unrolled."""
    r = rs // S
    s = rs - r * S
    h = h0 + r * dil_h
    w = w0 + s * dil_w
    ok = m_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W)  # [BM] zero padding
    x_tap = x_rows[:, None] + (h * stride_xh + w * stride_xw)[:, None] + x_grp[None, :]  # [BM, BG]
    w_tap = w_kc + r * stride_wr + s * stride_ws  # [BG, KGP]
    for c in tl.static_range(CG):
        xv = tl.load(x_tap + c * stride_xc, mask=ok[:, None] & g_ok[None, :], other=0.0)  # [BM, BG] channel c
        wv = tl.load(w_tap + c * stride_wc, mask=wk_ok, other=0.0)  # [BG, KGP]
        acc += xv.to(tl.float32)[:, :, None] * wv.to(tl.float32)[None, :, :]
    return acc


@triton.jit(do_not_specialize=_SIZES)
def grouped_direct_fwd_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, M, G,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_wk, stride_wc, stride_wr, stride_ws,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_bias,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, CG: tl.constexpr, KG: tl.constexpr, KGP: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
):
    # This program: output pixels [BM] x groups [BG] x each group's output channels [KGP].
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BG]
    kk = tl.arange(0, KGP)  # [KGP] output channel within the group
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        grp = grp.to(tl.int64)
    q = offs_m % Q
    p = (offs_m // Q) % P
    n = offs_m // (P * Q)
    h0 = p * str_h - pad_h  # [BM] the window's corner in the unpadded input
    w0 = q * str_w - pad_w
    m_ok = offs_m < M
    g_ok = grp < G
    k = grp[:, None] * KG + kk[None, :]  # [BG, KGP] output channel
    wk_ok = g_ok[:, None] & (kk < KG)[None, :]
    x_rows = x_ptr + n * stride_xn  # [BM]
    x_grp = grp * CG * stride_xc  # [BG] each group's first input channel
    w_kc = w_ptr + k * stride_wk  # [BG, KGP] each output channel's filter

    # Taps in a loop, a group's channels unrolled within a tap: unrolling the taps too kept every tap's loads
    # live at once and spilled (ptxas for sm_90, 3x3 over 4 channels).
    acc = tl.zeros((BLOCK_M, BLOCK_G, KGP), dtype=tl.float32)
    for rs in range(0, R * S):
        acc = _fwd_tap(acc, rs, x_rows, x_grp, w_kc, h0, w0, m_ok, g_ok, wk_ok, H, W, stride_xh, stride_xw,
                       stride_xc, stride_wc, stride_wr, stride_ws, dil_h, dil_w, S, CG)

    # Epilogue: bias, activation, store through the output's strides (NCHW or channels-last).
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k * stride_bias, mask=wk_ok, other=0.0).to(tl.float32)[None, :, :]
    acc = apply_activation(acc, ACTIVATION)
    out_rows = n * stride_on + p * stride_op + q * stride_oq  # [BM]
    tl.store(out_ptr + out_rows[:, None, None] + (k * stride_ok)[None, :, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None, None] & wk_ok[None, :, :])


@triton.jit
def _dgrad_tap(acc, rs, dy_rows, k_grp, w_ck, hx, wx, m_ok, g_ok, wc_ok, P, Q, stride_yp, stride_yq, stride_yk,
               stride_wk, stride_wr, stride_ws, str_h, str_w, pad_h, pad_w, dil_h, dil_w, S: tl.constexpr,
               KG: tl.constexpr):
    """``acc`` plus tap ``rs = r * S + s`` of every group: its KG output channels unrolled."""
    r = rs // S
    s = rs - r * S
    ph = hx + pad_h - r * dil_h  # [BM] = p * str_h where this tap of output pixel (p, q) reads (hx, wx)
    pw = wx + pad_w - s * dil_w
    p = ph // str_h
    q = pw // str_w
    ok = m_ok & (ph >= 0) & (pw >= 0) & (p * str_h == ph) & (q * str_w == pw) & (p < P) & (q < Q)
    dy_tap = dy_rows[:, None] + (p * stride_yp + q * stride_yq)[:, None] + k_grp[None, :]  # [BM, BG]
    w_tap = w_ck + r * stride_wr + s * stride_ws  # [BG, CGP]
    for kk in tl.static_range(KG):
        dyv = tl.load(dy_tap + kk * stride_yk, mask=ok[:, None] & g_ok[None, :], other=0.0)  # [BM, BG]
        wv = tl.load(w_tap + kk * stride_wk, mask=wc_ok, other=0.0)  # [BG, CGP]
        acc += dyv.to(tl.float32)[:, :, None] * wv.to(tl.float32)[None, :, :]
    return acc


@triton.jit(do_not_specialize=_SIZES)
def grouped_direct_dgrad_kernel(
    dy_ptr, w_ptr, dx_ptr,
    H, W, P, Q, M, G,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_wk, stride_wc, stride_wr, stride_ws,
    stride_xn, stride_xh, stride_xw, stride_xc,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, CG: tl.constexpr, CGP: tl.constexpr, KG: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
):
    # This program: input pixels [BM] x groups [BG] x each group's input channels [CGP].
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cc = tl.arange(0, CGP)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        grp = grp.to(tl.int64)
    wx = offs_m % W
    hx = (offs_m // W) % H
    n = offs_m // (H * W)
    m_ok = offs_m < M
    g_ok = grp < G
    wc_ok = g_ok[:, None] & (cc < CG)[None, :]  # [BG, CGP]
    dy_rows = dy_ptr + n * stride_yn  # [BM]
    k_grp = grp * KG * stride_yk  # [BG] each group's first output channel
    w_ck = w_ptr + (grp * KG * stride_wk)[:, None] + (cc * stride_wc)[None, :]  # [BG, CGP]

    acc = tl.zeros((BLOCK_M, BLOCK_G, CGP), dtype=tl.float32)
    for rs in range(0, R * S):  # taps in a loop, a group's output channels unrolled (as the forward)
        acc = _dgrad_tap(acc, rs, dy_rows, k_grp, w_ck, hx, wx, m_ok, g_ok, wc_ok, P, Q, stride_yp, stride_yq,
                         stride_yk, stride_wk, stride_wr, stride_ws, str_h, str_w, pad_h, pad_w, dil_h, dil_w, S, KG)

    c = grp[:, None] * CG + cc[None, :]  # [BG, CGP] input channel
    x_rows = n * stride_xn + hx * stride_xh + wx * stride_xw  # [BM]
    tl.store(dx_ptr + x_rows[:, None, None] + (c * stride_xc)[None, :, :], acc.to(dx_ptr.dtype.element_ty),
             mask=m_ok[:, None, None] & wc_ok[None, :, :])


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "G", "NPQ", "slice_len", "pad_h", "pad_w"])
def grouped_direct_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr,
    H, W, P, Q, G, NPQ, slice_len,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_dk, stride_dc, stride_dr, stride_ds,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, CG: tl.constexpr, CGP: tl.constexpr, KG: tl.constexpr,
    KGP: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # This program: groups [BG] x their [KGP, CGP] weights of one tap (axis 1), summed over one slice of output
    # pixels (axis 2): dw[k, c, r, s] = sum over pixels of dy[pixel, k] * x[the tap's input pixel, c].
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    tap = tl.program_id(1)
    part = tl.program_id(2)
    r = tap // S
    s = tap - r * S
    kk = tl.arange(0, KGP)
    cc = tl.arange(0, CGP)
    offs_m = tl.arange(0, BLOCK_M)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        grp = grp.to(tl.int64)
    g_ok = grp < G
    k = grp[:, None] * KG + kk[None, :]  # [BG, KGP] output channel
    c = grp[:, None] * CG + cc[None, :]  # [BG, CGP] input channel
    k_ok = g_ok[:, None] & (kk < KG)[None, :]
    c_ok = g_ok[:, None] & (cc < CG)[None, :]
    begin = part * slice_len
    end = tl.minimum(begin + slice_len, NPQ)
    acc = tl.zeros((BLOCK_M, BLOCK_G, KGP, CGP), dtype=tl.float32)
    for m0 in range(begin, end, BLOCK_M):
        pix = m0 + offs_m  # [BM]
        q = pix % Q
        p = (pix // Q) % P
        n = pix // (P * Q)
        h = p * str_h - pad_h + r * dil_h
        w = q * str_w - pad_w + s * dil_w
        in_slice = pix < end
        ok = in_slice & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        dyv = tl.load(dy_ptr + (n * stride_yn + p * stride_yp + q * stride_yq)[:, None, None]
                      + (k * stride_yk)[None, :, :], mask=in_slice[:, None, None] & k_ok[None, :, :],
                      other=0.0)  # [BM, BG, KGP]
        xv = tl.load(x_ptr + (n * stride_xn + h * stride_xh + w * stride_xw)[:, None, None]
                     + (c * stride_xc)[None, :, :], mask=ok[:, None, None] & c_ok[None, :, :],
                     other=0.0)  # [BM, BG, CGP]
        acc += dyv.to(tl.float32)[:, :, :, None] * xv.to(tl.float32)[:, :, None, :]
    total = tl.sum(acc, axis=0)  # [BG, KGP, CGP]
    dw = (dw_ptr + (k * stride_dk)[:, :, None] + (cc * stride_dc)[None, None, :] + r * stride_dr
          + s * stride_ds)
    inside = k_ok[:, :, None] & (cc < CG)[None, None, :]
    # Split: a workspace block per (groups, tap) block, planes [SPLIT, blocks, BG, KGP, CGP].
    tile = tap * tl.num_programs(0) + tl.program_id(0)
    size: tl.constexpr = BLOCK_G * KGP * CGP
    local = ((tl.arange(0, BLOCK_G)[:, None, None] * KGP + kk[None, :, None]) * CGP + cc[None, None, :])
    plane = (tl.num_programs(0) * tl.num_programs(1)).to(tl.int64) * size
    ws = ws_ptr + tile.to(tl.int64) * size + local
    store_summed_slices(total, dw, inside, ws, plane, part, count_ptr, tile, SPLIT)


# --- launchers ------------------------------------------------------------------------------------------


def tile_config(g: Geometry, channels: int) -> dict:
    """The tile: BLOCK_M pixels x BLOCK_G groups of ``channels`` (a power of two) each, about 32 channels a
    program (a [64, 32] fp32 accumulator on 4 warps: 16 values a thread); smaller under the interpreter."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_G=_pow2_at_least(min(g.groups, max(1, 8 // channels)), 1, 8), num_warps=4)
    return dict(BLOCK_M=64, BLOCK_G=_pow2_at_least(min(g.groups, max(1, 32 // channels)), 1, 32), num_warps=4)


def check(g: Geometry) -> None:
    """NotApplicable unless the kernels take ``g``: at most
    :data:`~tilegemm.ops.conv2d.configs.GROUPED_DIRECT_MOST_CHANNELS` input and output channels a group (each
    unrolled into the loop or the tile)."""
    most = GROUPED_DIRECT_MOST_CHANNELS
    if g.Cg > most or g.Kg > 4 * most:
        raise NotApplicable(f"grouped_direct takes at most {most} input and {4 * most} output channels a group; "
                            f"got C/groups={g.Cg}, K/groups={g.Kg}")


def run(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    """Forward; the output in ``p.out_format``. x and the weight are read through their strides as they lie."""
    g = p.geo
    check(g)
    out = allocate_out(p)
    kgp = _pow2_at_least(g.Kg, 1, 1 << 20)
    cfg = dict(config or tile_config(g, kgp))
    M = g.N * g.P * g.Q
    bias = p.bias if p.bias is not None else out
    w = p.weight
    args = (p.x, w, out, bias, g.H, g.W, g.P, g.Q, M, g.groups, *_nhwc_strides(p.x),
            w.stride(0), w.stride(1), w.stride(2), w.stride(3),
            out.stride(0), out.stride(2), out.stride(3), out.stride(1),
            p.bias.stride(0) if p.bias is not None else 0, *_conv_args(g))
    flags = dict(R=g.R, S=g.S, CG=g.Cg, KG=g.Kg, KGP=kgp, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation,
                 INDEX_64=p.index_64 or needs_index_64(out))
    grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(g.groups, cfg["BLOCK_G"]))
    launch(grouped_direct_fwd_kernel, grid, args, {**flags, **cfg})
    return out


def dgrad(dy: torch.Tensor, weight: torch.Tensor, x_shape, x_format, g: Geometry,
          config: dict | None = None) -> torch.Tensor:
    """grad of x for a layer the kernels take (:func:`check`): ``[N, C, H, W]`` in ``x_format``."""
    check(g)
    dx = empty_4d(x_shape, dy.dtype, dy.device, x_format)
    cgp = _pow2_at_least(g.Cg, 1, 1 << 20)
    cfg = dict(config or tile_config(g, cgp))
    M = g.N * g.H * g.W
    args = (dy, weight, dx, g.H, g.W, g.P, g.Q, M, g.groups, *_nhwc_strides(dy),
            weight.stride(0), weight.stride(1), weight.stride(2), weight.stride(3), *_nhwc_strides(dx),
            *_conv_args(g))
    flags = dict(R=g.R, S=g.S, CG=g.Cg, CGP=cgp, KG=g.Kg, INDEX_64=needs_index_64(dy, dx, weight))
    grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(g.groups, cfg["BLOCK_G"]))
    launch(grouped_direct_dgrad_kernel, grid, args, {**flags, **cfg})
    return dx


def wgrad(dy: torch.Tensor, x: torch.Tensor, g: Geometry, out_dtype: torch.dtype,
          memory_format: torch.memory_format = torch.contiguous_format,
          config: dict | None = None) -> torch.Tensor:
    """grad of the weight for a layer the kernels take (:func:`check`): ``[K, C/groups, R, S]`` in
    ``memory_format``, in one launch (the pixel reduction split over programs, the last to arrive at a block
    adding the slices in order)."""
    from tilegemm.core.launch import current_stream
    from tilegemm.core.workspace import split_workspace

    check(g)
    kgp, cgp = _pow2_at_least(g.Kg, 1, 1 << 20), _pow2_at_least(g.Cg, 1, 1 << 20)
    if config is None:
        bm = 8 if interpreting() else 32
        # a [BM, BG, KGP, CGP] fp32 accumulator: about 32 values a thread on 4 warps
        bg = _pow2_at_least(min(g.groups, max(1, 128 // (kgp * cgp))), 1, 128)
        config = dict(BLOCK_M=bm, BLOCK_G=bg, num_warps=4)
    cfg = dict(config)
    npq = g.N * g.P * g.Q
    blocks = cdiv(g.groups, cfg["BLOCK_G"]) * g.R * g.S
    # PER_SM / MIN_STEPS: the slices' count (configs.pixel_split); few slices wait on latency, as the depthwise
    # weight gradient's did (docs/conv2d.md, "Depthwise weight gradient")
    per_sm = cfg.pop("PER_SM", GROUPED_DIRECT_WGRAD_PER_SM)
    steps = cfg.pop("MIN_STEPS", GROUPED_DIRECT_WGRAD_MIN_STEPS)
    split, slice_len = pixel_split(npq, blocks, cfg["BLOCK_M"], dy.device, cfg.pop("SPLIT", None), per_sm, steps)
    dw = empty_4d((g.K, g.Cg, g.R, g.S), out_dtype, dy.device, memory_format)
    grid = (cdiv(g.groups, cfg["BLOCK_G"]), g.R * g.S, split)
    tiles = grid[0] * grid[1]
    size = cfg["BLOCK_G"] * kgp * cgp
    if split > 1:  # fp32 partial sums and arrival counters (tilegemm.core.workspace)
        ws, count = split_workspace(dy.device, split * tiles * size, tiles)
    else:
        ws, count = dw, dw  # unused
    args = (dy, x, dw, ws, count, g.H, g.W, g.P, g.Q, g.groups, npq, slice_len, *_nhwc_strides(dy),
            *_nhwc_strides(x), *dw.stride(), *_conv_args(g))
    flags = dict(R=g.R, S=g.S, CG=g.Cg, CGP=cgp, KG=g.Kg, KGP=kgp, INDEX_64=needs_index_64(dy, x), SPLIT=split, **cfg)
    # The workspace is this stream's: a replay passes it as recorded and declines on another stream.
    launch(grouped_direct_wgrad_kernel, grid, args, flags, keep=(ws, count) if split > 1 else (),
           stream=current_stream() if split > 1 and dy.is_cuda else None)
    return dw
