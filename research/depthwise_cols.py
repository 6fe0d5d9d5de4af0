"""A depthwise forward that reuses each loaded input column across the horizontal taps (exploration kernel).

The shipped kernel (``tilegemm.ops.conv2d.depthwise.depthwise_fwd_kernel``) loads one ``[pixels, channels]``
tile per tap: R*S loads per output, and on MobileNetV2's stride-1 layers it is bound by those load
instructions, not by DRAM (``research/explore_depthwise.py``). Here a program owns BLOCK_M groups of COLS
consecutive output columns (of one row each) x BLOCK_N channels, accumulating into ``[BLOCK_M, COLS,
BLOCK_N]``. For filter row r it loads the D = (COLS - 1) * SW + (S - 1) * DW + 1 input columns the groups
cover, once each, and adds input column d to output column j with the weight of tap s = (d - j*SW) / DW
(zero where that is no tap): D loads per COLS outputs instead of COLS * S (6 against 12 for a 3-wide filter
and COLS = 4, 10 against 24 for COLS = 8), at the cost of D * COLS multiply-adds instead of S * COLS, a
share of them by zero. The weight is tap-major ``[R, S, K]``, as the shipped forward reads it (its tap stride K
passed apart from the unspecialized size, so that its loads are 16 bytes wide).

Not shipped: ``research/explore_depthwise.py`` times it beside the shipped kernel; research/tests checks it
against ``F.conv2d`` under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.jit.helpers import apply_activation
from tilegemm.ops.conv2d.implicit_gemm import _below_unspecialized


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "K", "QG", "groups_total", "pad_h", "pad_w"])
def depthwise_cols_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, K, QG, groups_total, MULT, stride_wt,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_on, stride_op, stride_oq, stride_ok,
    str_h, pad_h, pad_w, dil_h,
    R: tl.constexpr, S: tl.constexpr, SW: tl.constexpr, DW: tl.constexpr, COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DIV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    D: tl.constexpr = (COLS - 1) * SW + (S - 1) * DW + 1  # input columns a group of COLS outputs reads
    offs_g = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # groups (n, p, column group)
    qg = offs_g % QG
    p = (offs_g // QG) % P
    n = (offs_g // (QG * P)).to(tl.int64)
    g_ok = offs_g < groups_total
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = _below_unspecialized(offs_n, K, DIV)
    j = tl.arange(0, COLS)
    x_rows = x_ptr + n * stride_xn  # [BM]
    x_cols = (offs_n // MULT) * stride_xc  # [BN]
    w_first = qg * (COLS * SW) - pad_w  # [BM] the input column of output column 0, tap 0
    acc = tl.zeros((BLOCK_M, COLS, BLOCK_N), dtype=tl.float32)
    for r in tl.static_range(R):
        h = p * str_h - pad_h + r * dil_h
        row_ok = g_ok & (h >= 0) & (h < H)
        for d in tl.static_range(D):
            w_in = w_first + d
            ok = row_ok & (w_in >= 0) & (w_in < W)
            # Both loads three-dimensional ([BM, 1, BN] and [1, COLS, BN]), so that the compiler lays them out
            # as the accumulator is (a thread's 8 channels of all COLS columns); as 2-D loads broadcast
            # afterwards they went through shared memory twice a step.
            xv = tl.load((x_rows + h * stride_xh + w_in * stride_xw)[:, None, None] + x_cols[None, None, :],
                         mask=ok[:, None, None] & n_ok[None, None, :], other=0.0).to(tl.float32)  # [BM, 1, BN]
            sd = d - j * SW  # [COLS] how far past output column j's first tap input column d lies
            s = sd // DW
            tap = (sd >= 0) & (sd - s * DW == 0) & (s < S)
            wv = tl.load(w_ptr + ((r * S + s) * stride_wt)[None, :, None] + offs_n[None, None, :],
                         mask=tap[None, :, None] & n_ok[None, None, :], other=0.0).to(tl.float32)  # [1, COLS, BN]
            acc += xv * wv

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, None, :]
    acc = apply_activation(acc, ACTIVATION)
    q = qg[:, None] * COLS + j[None, :]  # [BM, COLS]
    rows = n * stride_on + p * stride_op  # [BM]
    ptrs = out_ptr + rows[:, None, None] + (q * stride_oq)[:, :, None] + (offs_n * stride_ok)[None, None, :]
    mask = (g_ok[:, None] & (q < Q))[:, :, None] & n_ok[None, None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def run(x: torch.Tensor, weight: torch.Tensor, g, cfg: dict, bias=None, activation: str = "none",
        tap_major: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise forward of channels-last ``x`` (geometry ``g``, ``weight`` ``[K, 1, R, S]``) with config
    ``cfg`` (BLOCK_M, COLS, BLOCK_N, num_warps); a channels-last output. ``tap_major``: the weight already as a
    contiguous ``[R, S, K]`` (else made here, a torch copy)."""
    from tilegemm.core.launch import launch
    from tilegemm.core.runtime import cdiv, new_output
    from tilegemm.ops.conv2d.implicit_gemm import _divisor, _nhwc_strides

    assert g.is_depthwise and x.stride(1) == 1
    wt = weight.permute(2, 3, 0, 1).contiguous() if tap_major is None else tap_major  # [R, S, K(, 1)]
    out = new_output((g.N, g.P, g.Q, g.K), x.dtype, x.device).permute(0, 3, 1, 2)
    cols = cfg["COLS"]
    qg = cdiv(g.Q, cols)
    total = g.N * g.P * qg
    args = (x, wt, out, bias if bias is not None else out, g.H, g.W, g.P, g.Q, g.K, qg, total, g.K // g.C, g.K,
            *_nhwc_strides(x), out.stride(0), out.stride(2), out.stride(3), out.stride(1),
            g.stride[0], g.padding[0], g.padding[2], g.dilation[0])
    kw = dict(R=g.R, S=g.S, SW=g.stride[1], DW=g.dilation[1], HAS_BIAS=bias is not None, ACTIVATION=activation,
              DIV=_divisor(g.K), **cfg)
    launch(depthwise_cols_kernel, (cdiv(total, cfg["BLOCK_M"]), cdiv(g.K, cfg["BLOCK_N"])), args, kw)
    return out
