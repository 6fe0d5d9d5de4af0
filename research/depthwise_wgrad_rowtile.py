"""A depthwise weight-gradient kernel with a 3-D pixel tile (open question; timed by depthwise_wgrad_rows.py).

``depthwise_wgrad_kernel`` walks a flat pixel index and recovers ``(n, p, q)`` from it by three runtime divisions
per pixel: about 70 instructions for each pixel a thread holds, against 8 fused multiply-adds per pixel (one
per channel of its 16-byte run). Here a program's block is ``[BR rows of (n, p), BQ columns q, BN channels]``
with ``BQ`` a power of two covering Q (or chunks of it): a row costs one division, a column none. Same
grid (channel blocks, taps, pixel-row slices) and the same in-order reduction of the slices by the last to
arrive. ``wgrad_rowtile(dy, x, g, out_dtype, per_sm=32, min_steps=2)`` is the launcher; ``--check`` runs it
against torch under the interpreter (``TRITON_INTERPRET=1``) or on the GPU.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import launch
from tilegemm.core.runtime import cdiv, new_output
from tilegemm.core.workspace import split_workspace
from tilegemm.ops.conv2d.configs import _pow2_at_least, pixel_split
from tilegemm.ops.conv2d.depthwise import _conv_args, _divisor, _nhwc, _pixel_strides
from tilegemm.ops.conv2d.implicit_gemm import _below_unspecialized


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "K", "NP", "slice_rows", "pad_h", "pad_w"])
def depthwise_wgrad_rowtile_kernel(
    dy_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr,
    H, W, P, Q, K, NP, MULT, slice_rows,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_dk, stride_dr, stride_dss,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, DIV: tl.constexpr, DIV_Y: tl.constexpr, DIV_X: tl.constexpr,
    BR: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    stride_yn = stride_yn * DIV_Y
    stride_yp = stride_yp * DIV_Y
    stride_yq = stride_yq * DIV_Y
    stride_xn = stride_xn * DIV_X
    stride_xh = stride_xh * DIV_X
    stride_xw = stride_xw * DIV_X
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tap = tl.program_id(1)
    part = tl.program_id(2)
    r = tap // S
    s = tap - r * S
    n_ok = _below_unspecialized(offs_n, K, DIV)
    y_chan = (offs_n * stride_yk)[None, None, :]
    x_chan = ((offs_n // MULT) * stride_xc)[None, None, :]
    offs_r = tl.arange(0, BR)
    offs_q = tl.arange(0, BQ)
    begin = part * slice_rows
    end = tl.minimum(begin + slice_rows, NP)
    acc = tl.zeros((BR, BQ, BLOCK_N), dtype=tl.float32)
    for r0 in range(begin, end, BR):
        row = r0 + offs_r  # [BR]: one (n, p) each, the only division
        n = row // P
        p = row - n * P
        h = p * str_h - pad_h + r * dil_h
        row_ok = (row < end) & (h >= 0) & (h < H)
        y_row = (n.to(tl.int64) * stride_yn + p * stride_yp)[:, None, None]
        x_row = (n.to(tl.int64) * stride_xn + h * stride_xh)[:, None, None]
        for q0 in range(0, Q, BQ):
            q = q0 + offs_q  # [BQ]
            w = q * str_w - pad_w + s * dil_w
            y_ok = (row < end)[:, None] & (q < Q)[None, :]
            x_ok = row_ok[:, None] & ((q < Q) & (w >= 0) & (w < W))[None, :]
            dyv = tl.load(dy_ptr + y_row + (q * stride_yq)[None, :, None] + y_chan,
                          mask=y_ok[:, :, None] & n_ok[None, None, :], other=0.0)
            xv = tl.load(x_ptr + x_row + (w * stride_xw)[None, :, None] + x_chan,
                         mask=x_ok[:, :, None] & n_ok[None, None, :], other=0.0)
            acc += dyv.to(tl.float32) * xv.to(tl.float32)
    total = tl.sum(tl.sum(acc, axis=1), axis=0)  # [BN]
    dw = dw_ptr + offs_n * stride_dk + r * stride_dr + s * stride_dss
    if SPLIT == 1:
        tl.store(dw, total.to(dw_ptr.dtype.element_ty), mask=n_ok)
    else:
        tile = tap * tl.num_programs(0) + tl.program_id(0)
        plane = (tl.num_programs(0) * tl.num_programs(1)).to(tl.int64) * BLOCK_N
        ws = ws_ptr + tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(ws + part * plane, total)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            summed = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sl in range(0, SPLIT):
                summed += tl.load(ws + sl * plane, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            tl.store(dw, summed.to(dw_ptr.dtype.element_ty), mask=n_ok)


def rowtile_config(g, pixels: int = 64) -> dict:
    """[BR, BQ, BN]: BQ the power of two covering Q up to 64, BR rows making about ``pixels`` pixels."""
    bn = _pow2_at_least(g.K, 16, 64)
    bq = _pow2_at_least(g.Q, 1, 64)
    return dict(BR=max(1, pixels // bq), BQ=bq, BLOCK_N=bn, num_warps=4, num_stages=2)


def wgrad_rowtile(dy, x, g, out_dtype, per_sm: int = 32, min_steps: int = 2, config: dict | None = None):
    """The depthwise weight gradient ``[K, 1, R, S]`` by :func:`depthwise_wgrad_rowtile_kernel`, one launch."""
    dy, x = _nhwc(dy), _nhwc(x)
    cfg = dict(config or rowtile_config(g))
    np_rows = g.N * g.P
    blocks = cdiv(g.K, cfg["BLOCK_N"]) * g.R * g.S
    split, slice_rows = pixel_split(np_rows, blocks, cfg["BR"], dy.device, cfg.pop("SPLIT", None), per_sm, min_steps)
    dw = new_output((g.K, 1, g.R, g.S), out_dtype, dy.device)
    grid = (cdiv(g.K, cfg["BLOCK_N"]), g.R * g.S, split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws, count = split_workspace(dy.device, split * tiles * cfg["BLOCK_N"], tiles)
    else:
        ws, count = dw, dw
    (ys, div_y), (xs, div_x) = _pixel_strides(dy), _pixel_strides(x)
    args = (dy, x, dw, ws, count, g.H, g.W, g.P, g.Q, g.K, np_rows, g.K // g.C, slice_rows, *ys, *xs,
            dw.stride(0), dw.stride(2), dw.stride(3), *_conv_args(g))
    flags = dict(R=g.R, S=g.S, DIV=_divisor(g.K), DIV_Y=div_y, DIV_X=div_x, SPLIT=split, **cfg)
    launch(depthwise_wgrad_rowtile_kernel, grid, args, flags, keep=(ws, count) if split > 1 else ())
    return dw


def check() -> None:
    """Against torch's gradient: a few shapes (strides, dilation, multiplier, odd channels, Q above 64)."""
    from tilegemm.ops.conv2d.problem import geometry_of

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [(2, 20, 9, 7, 1, 3, 1, 1, 1), (1, 12, 11, 9, 2, 5, 2, 2, 1), (1, 9, 8, 7, 1, 7, 1, 3, 1),
             (1, 8, 6, 70, 1, 3, 1, 2, 2)]
    for N, C, H, W, mult, R, st, pad, dil in cases:
        K = C * mult
        x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=torch.channels_last)
        g = geometry_of(x.shape, (K, 1, R, R), [st, st], [pad] * 4, [dil, dil], C)
        dy = torch.randn(N, K, g.P, g.Q, device=device).contiguous(memory_format=torch.channels_last)
        ref = torch.ops.aten.convolution_backward(dy.double(), x.double(), torch.zeros(K, 1, R, R, device=device,
                                                  dtype=torch.float64), None, [st, st], [pad, pad], [dil, dil],
                                                  False, [0, 0], C, [False, True, False])[1]
        for split in (3, 1):
            cfg = dict(rowtile_config(g, 16), SPLIT=split)
            dw = wgrad_rowtile(dy, x, g, torch.float32, config=cfg)
            err = float((dw.double() - ref).norm() / ref.norm())
            print(f"N{N} C{C} {H}x{W} x{mult} {R}x{R}/{st} pad {pad} dil {dil} split {split}: rel err {err:.1e}")
            assert err < 1e-5, err


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
