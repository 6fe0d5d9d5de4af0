"""Depthwise convolution (groups = C, one input channel per group) as direct kernels, with its gradients.

A depthwise filter has C/groups = 1, so its GEMM view is a K=R*S dot per channel: too thin for tensor cores.
The taps are added up elementwise in fp32 over channels-last activations. Output channel k reads input
channel k // MULT (MULT = K / C, the channel multiplier; 1 in MobileNet).

- Stride 1 (:func:`depthwise_rows_kernel`): in channels-last memory an image row is one run of W*C elements,
  and horizontal tap s of output element ``o = q*K + k`` is input element ``o + (s - pad_w)*C`` of a row (for
  MULT = 1): a shift. A program owns BLOCK consecutive elements of output rows, whatever mix of pixels and
  channels (no channel block is padded), loads its weights, bias and masks once, and rolls down its rows:
  each input row is loaded once (S shifted vectors) and added into the R output rows it feeds.
- Any stride and dilation (:func:`depthwise_strided_rows_kernel`; ``auto`` runs strided forwards of up to 5x5
  filters on it: :func:`~tilegemm.ops.conv2d.configs.depthwise_strided_rows_config`): the row kernel's walk
  generalised. Iteration t of a program reads the STR_H input
  rows under its next output row once each (S shifted vectors; in a row an output element's tap s is input
  element ``q*STR_W*C + s*DIL_W*C + k``) and adds each into the output rows in flight that read it, so a 3x3
  stride-2 layer loads 6 vectors an output row where the pixel kernel loads 9 taps and 9 weight vectors.
- Stride 1 by config (:func:`depthwise_window_kernel`; ``auto`` behind ``configs.DEPTHWISE_WINDOW_AUTO``): the row
  walk register-blocked along the row: a thread holds QT adjacent output columns, so an input row costs it
  QT + S - 1 loads (each value feeding up to S taps from registers) and a weight register serves QT outputs.
  The row kernel and it can read the weight rewritten tap-major (config ``TAP_MAJOR``): coalesced weight loads.
- Otherwise (:func:`depthwise_fwd_kernel`): a program owns [BLOCK_M pixels, BLOCK_N channels] and loads each
  tap's [BM, BN] tile; the weight is read tap-major (``[R, S, K]``, rewritten each call by a small kernel) so
  that a tap's weights are one 16-byte load, and the taps are unrolled. Both are bound by load and issue
  slots more than by DRAM (``configs.depthwise_rows_config``, ``configs.depthwise_fwd_config``).
"""

from __future__ import annotations

import contextlib

import torch

from tilegemm.core.launch import current_stream, launch
from tilegemm.core.workspace import split_workspace
from tilegemm.core.runtime import cdiv, ensure_backend, new_output
from tilegemm.ops.conv2d.configs import (
    DEPTHWISE_WGRAD_MIN_STEPS, DEPTHWISE_WGRAD_PER_SM, DEPTHWISE_WGRAD_TAPS_MIN_ROWS, DEPTHWISE_WGRAD_TAPS_PER_SM,
    depthwise_config, depthwise_fwd_config, depthwise_rows_config, depthwise_strided_rows_config,
    depthwise_wgrad_config, depthwise_window_config, pixel_split, walk_column_runs, walk_takes,
)
from tilegemm.ops.conv2d.implicit_gemm import (
    _below_unspecialized,
    _conv_args,
    _divisor,
    _nhwc,
    _nhwc_strides,
    allocate_out,
    empty_4d,
)
from tilegemm.ops.conv2d.problem import ConvProblem, Geometry, _span, needs_index_64

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tilegemm.jit.helpers import apply_activation, store_summed_slices  # noqa: E402


_SIZES = ["H", "W", "P", "Q", "K", "M", "pad_h", "pad_w"]  # not specialized on: see implicit_gemm._SIZES


@triton.jit
def _depthwise_tap(acc, rs, x_rows, x_cols, w_ptr, offs_n, h0, w0, m_ok, n_ok, H, W,
                   stride_xh, stride_xw, stride_wk, stride_wr, stride_ws, dil_h, dil_w, S: tl.constexpr):
    """``acc`` plus tap ``rs`` of the filter over the tile's pixels."""
    r = rs // S
    s = rs - r * S
    h = h0 + r * dil_h
    w = w0 + s * dil_w
    ok = m_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W)  # [BM] zero padding
    xv = tl.load(x_rows[:, None] + (h * stride_xh + w * stride_xw)[:, None] + x_cols[None, :],
                 mask=ok[:, None] & n_ok[None, :], other=0.0)  # [BM, BN]
    wv = tl.load(w_ptr + offs_n * stride_wk + r * stride_wr + s * stride_ws, mask=n_ok, other=0.0)  # [BN]
    return acc + xv.to(tl.float32) * wv.to(tl.float32)[None, :]


@triton.jit(do_not_specialize=_SIZES)
def depthwise_fwd_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, K, M, MULT,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_wk, stride_wr, stride_ws,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_bias,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INDEX_64: tl.constexpr, DIV: tl.constexpr,
    DIV_X: tl.constexpr, DIV_O: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):
    # This program: output pixels [BM] x output channels [BN]. The pixel strides of x and out come in units
    # of DIV_X and DIV_O elements (the powers of two dividing them): written as products with the constants, a
    # pixel's offset is a known multiple of 8 where C is, and its channels load 16 bytes at a time (a stride
    # of 88, say, was 2-byte loads: Triton assumes nothing of an integer not a multiple of 16; docs/conv2d.md,
    # "Depthwise pixel kernel's load widths").
    stride_xn = stride_xn * DIV_X
    stride_xh = stride_xh * DIV_X
    stride_xw = stride_xw * DIV_X
    stride_on = stride_on * DIV_O
    stride_op = stride_op * DIV_O
    stride_oq = stride_oq * DIV_O
    stride_wr = stride_wr * DIV  # the tap-major weight's rows and taps: multiples of K
    stride_ws = stride_ws * DIV
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
    q = offs_m % Q
    p = (offs_m // Q) % P
    n = offs_m // (P * Q)
    h0 = p * str_h - pad_h
    w0 = q * str_w - pad_w
    m_ok = offs_m < M
    n_ok = _below_unspecialized(offs_n, K, DIV)  # constant over aligned runs: 16-byte loads along channels
    x_rows = x_ptr + n * stride_xn  # [BM]
    x_cols = (offs_n // MULT) * stride_xc  # [BN] the input channel of each output channel

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if UNROLL:
        for rs in tl.static_range(0, R * S):
            acc = _depthwise_tap(acc, rs, x_rows, x_cols, w_ptr, offs_n, h0, w0, m_ok, n_ok, H, W,
                                 stride_xh, stride_xw, stride_wk, stride_wr, stride_ws, dil_h, dil_w, S)
    else:
        for rs in range(0, R * S):
            acc = _depthwise_tap(acc, rs, x_rows, x_cols, w_ptr, offs_n, h0, w0, m_ok, n_ok, H, W,
                                 stride_xh, stride_xw, stride_wk, stride_wr, stride_ws, dil_h, dil_w, S)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    out_rows = n * stride_on + p * stride_op + q * stride_oq
    tl.store(out_ptr + out_rows[:, None] + (offs_n * stride_ok)[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def depthwise_weight_kernel(w_ptr, out_ptr, total, K, S, stride_wk, stride_wr, stride_ws, BLOCK: tl.constexpr):
    """``out[(r*S + s)*K + k] = w[k, 0, r, s]``: a ``[K, 1, R, S]`` weight as row-major ``[R, S, K]``, where one
    tap's weights are consecutive (the forward loads them 16 bytes at a time; in ``[K, R, S]`` order the
    channels of a tap lie R*S elements apart and each is its own 2-byte load)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k = i % K
    rs = i // K
    r = rs // S
    s = rs - r * S
    ok = i < total
    tl.store(out_ptr + i, tl.load(w_ptr + k * stride_wk + r * stride_wr + s * stride_ws, mask=ok), mask=ok)


@triton.jit
def _roll_down(accs, R: tl.constexpr, BLOCK: tl.constexpr):
    """The accumulators one row on: a fresh zero row first, the last (finished) one dropped."""
    out = (tl.zeros((BLOCK,), dtype=tl.float32),)
    for r in tl.static_range(R - 1):
        out = out + (accs[r],)
    return out


@triton.jit
def _finish_row(acc, p, p0, out_el, stride_op, o_ok, bias, ACTIVATION: tl.constexpr):
    """Store output row ``p`` (bias and activation applied) if it is one of this program's (p >= p0)."""
    if p >= p0:
        y = apply_activation(acc + bias, ACTIVATION)
        tl.store(out_el + p * stride_op, y.to(out_el.dtype.element_ty), mask=o_ok)


@triton.jit
def _add_row(accs, xs, ws, p, p0, out_el, stride_op, o_ok, bias, ACTIVATION: tl.constexpr, R: tl.constexpr,
             S: tl.constexpr, BLOCK: tl.constexpr):
    """An input row's S shifted vectors ``xs`` added into the R output rows it feeds (``accs[r]`` takes filter
    row r), the completed one (row ``p``) stored, and the accumulators rolled down."""
    new = ()
    for r in tl.static_range(R):
        a = accs[r]
        for s in tl.static_range(S):
            a += xs[s] * ws[r * S + s]
        new = new + (a,)
    _finish_row(new[R - 1], p, p0, out_el, stride_op, o_ok, bias, ACTIVATION)
    return _roll_down(new, R, BLOCK)


@triton.jit
def _flat_elements(o, CD, Q, MULT: tl.constexpr, DIV: tl.constexpr):
    """(C, K, o_ok, q, k) of a flat row kernel's output elements ``o = q*K + k`` (channels-last, a row of Q*K
    elements is one run). Sizes in units of DIV elements (C = CD * DIV input channels, K = C * MULT output
    channels): products with the constant DIV are known multiples of it, and what is computed from o // DIV is
    constant over aligned runs of DIV, so the masks are too and the loads stay contiguous (16 bytes)."""
    C = CD * DIV
    KD = CD * MULT
    K = KD * DIV
    od = o // DIV
    o_ok = od < Q * KD
    q = od // KD
    k = o - q * K
    return C, K, o_ok, q, k


@triton.jit
def _flat_prologue(x_ptr, w_ptr, out_ptr, bias_ptr, x_el, o, k, q, n, o_ok, xn_d, xh_d, on_d, op_d, stride_on,
                   stride_op, stride_oq, stride_ok, stride_wk, stride_wr, stride_ws, stride_b,
                   R: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, DIV: tl.constexpr,
                   CL_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_tile_prologue` of the flat row kernels: the weights of the program's elements, every tap once (fp32,
    from the [K, 1, R, S] weight as it lies), the bias, image n's input elements at ``x_el`` and its row stride,
    the output elements (``o`` channels-last, else column ``q`` and channel ``k`` at any strides) and the output's
    row stride."""
    ws = ()
    for rs in tl.static_range(R * S):
        w_off = k * stride_wk + (rs // S) * stride_wr + (rs % S) * stride_ws
        ws = ws + (tl.load(w_ptr + w_off, mask=o_ok, other=0.0).to(tl.float32),)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + k * stride_b, mask=o_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK,), dtype=tl.float32)
    stride_xh = xh_d * DIV
    x_img = x_ptr + n.to(tl.int64) * xn_d * DIV + x_el
    if CL_OUT:
        out_el = out_ptr + n.to(tl.int64) * on_d * DIV + o
        stride_op = op_d * DIV
    else:
        out_el = out_ptr + n.to(tl.int64) * stride_on + q * stride_oq + k * stride_ok
    return ws, bias, x_img, stride_xh, out_el, stride_op


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "CD", "chunks", "row_groups", "xn_d", "xh_d", "on_d", "op_d",
                               "pad_h", "pad_w"])
def depthwise_rows_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, CD, chunks, row_groups,
    xn_d, xh_d, on_d, op_d,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_wk, stride_wr, stride_ws, stride_b, pad_h, pad_w,
    MULT: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DIV: tl.constexpr, CL_OUT: tl.constexpr,
    BLOCK: tl.constexpr, ROWS_PER: tl.constexpr, PIPELINE: tl.constexpr, STAGES: tl.constexpr,
):
    # Stride 1, dilation 1. This program: BLOCK consecutive elements o = q*K + k of output rows p0 .. p1-1 of
    # image n (channels-last, a row of Q*K elements is one run), whatever mix of pixels and channels that is.
    # One grid axis (a second is capped at 65535 programs): the row's chunks fastest, then row groups, images.
    pid = tl.program_id(0)
    rows = pid // chunks
    o = (pid - rows * chunks) * BLOCK + tl.arange(0, BLOCK)
    n = rows // row_groups
    p0 = (rows - n * row_groups) * ROWS_PER
    p1 = tl.minimum(p0 + ROWS_PER, P)
    C, K, o_ok, q, k = _flat_elements(o, CD, Q, MULT, DIV)  # sizes and strides in units of DIV elements
    # Tap (r, s) of element o reads input element (q - pad_w + s)*C + k // MULT of input row p - pad_h + r:
    # where MULT = 1, element o of the row shifted by (s - pad_w)*C.
    if MULT == 1:
        x_el = q * C + k - pad_w * C
    else:
        x_el = q * C + k // MULT - pad_w * C
    ok_s = ()  # tap s's input column inside the image
    for s in tl.static_range(S):
        ok_s = ok_s + (o_ok & (q + s >= pad_w) & (q + s < W + pad_w),)
    ws, bias, x_img, stride_xh, out_el, stride_op = _flat_prologue(
        x_ptr, w_ptr, out_ptr, bias_ptr, x_el, o, k, q, n, o_ok, xn_d, xh_d, on_d, op_d, stride_on, stride_op,
        stride_oq, stride_ok, stride_wk, stride_wr, stride_ws, stride_b, R, S, HAS_BIAS, DIV, CL_OUT, BLOCK)

    # Rows roll through R accumulators: iteration t reads input row h = p0 - pad_h + t once (S shifted
    # vectors) and adds it into the output rows p0 + t - r it feeds (accs[r]); row p0 + t - (R - 1) is then
    # complete. S loads an input row instead of R*S an output row.
    T = p1 - p0 + R - 1
    accs = ()
    for r in tl.static_range(R):
        accs = accs + (tl.zeros((BLOCK,), dtype=tl.float32),)
    if PIPELINE:
        # Triton's pipeliner keeps STAGES - 1 rows of loads in flight (cp.async through shared memory): the
        # larger images' form (docs/conv2d.md, "Configs").
        for t in tl.range(0, T, num_stages=STAGES):
            h = p0 - pad_h + t
            row_ok = (h >= 0) & (h < H)
            src = x_img + h * stride_xh
            xs = ()
            for s in tl.static_range(S):
                xs = xs + (tl.load(src + s * C, mask=ok_s[s] & row_ok, other=0.0).to(tl.float32),)
            accs = _add_row(accs, xs, ws, p0 + t - (R - 1), p0, out_el, stride_op, o_ok, bias, ACTIVATION, R, S,
                            BLOCK)
    else:
        # Fewer instructions an iteration: the loads STAGES rows ahead in registers and no row mask. The
        # iterations before t_lo read rows above the image (they add nothing; those from R - 1 on finish rows),
        # those from t_hi rows below it (a drain without loads).
        t_lo = tl.maximum(pad_h - p0, 0)
        t_hi = tl.maximum(tl.minimum(T, H + pad_h - p0), t_lo)
        for t in range(tl.minimum(t_lo, R - 1), tl.minimum(t_lo, T)):  # not past this program's rows
            _finish_row(accs[R - 1], p0 + t - (R - 1), p0, out_el, stride_op, o_ok, bias, ACTIVATION)
            accs = _roll_down(accs, R, BLOCK)
        ring = ()
        for j in tl.static_range(STAGES):
            src = x_img + tl.minimum(p0 - pad_h + t_lo + j, H - 1) * stride_xh
            for s in tl.static_range(S):
                ring = ring + (tl.load(src + s * C, mask=ok_s[s], other=0.0),)
        for t in range(t_lo, t_hi):
            xs = ()
            rest = ()
            for j in tl.static_range(STAGES * S):
                if j < S:
                    xs = xs + (ring[j].to(tl.float32),)
                else:
                    rest = rest + (ring[j],)
            src = x_img + tl.minimum(p0 - pad_h + t + STAGES, H - 1) * stride_xh  # clamped: a row of the image
            for s in tl.static_range(S):
                rest = rest + (tl.load(src + s * C, mask=ok_s[s], other=0.0),)
            ring = rest
            accs = _add_row(accs, xs, ws, p0 + t - (R - 1), p0, out_el, stride_op, o_ok, bias, ACTIVATION, R, S,
                            BLOCK)
        for t in range(t_hi, T):
            _finish_row(accs[R - 1], p0 + t - (R - 1), p0, out_el, stride_op, o_ok, bias, ACTIVATION)
            accs = _roll_down(accs, R, BLOCK)


@triton.jit
def _roll_down_like(accs, A: tl.constexpr):
    """:func:`_roll_down` for accumulators of any shape."""
    out = (tl.zeros_like(accs[0]),)
    for i in tl.static_range(A - 1):
        out = out + (accs[i],)
    return out


def _strided_slots(R: int, stride_h: int, dilation_h: int) -> int:
    """Output rows in flight in :func:`depthwise_strided_rows_kernel`: those an input row can feed at once."""
    return (R - 1) * dilation_h // stride_h + 1


@triton.jit
def _add_input_row(accs, xs, ws, J: tl.constexpr, A: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                   STR_H: tl.constexpr, DIL_H: tl.constexpr):
    """Input row ``J`` of an iteration's STR_H (its S tap vectors ``xs``) added into the output rows it feeds:
    filter row r of the output row in slot i reads it where ``r*DIL_H - J == i*STR_H``."""
    new = ()
    for i in tl.static_range(A):
        a = accs[i]
        for r in tl.static_range(R):
            if r * DIL_H - J == i * STR_H:
                for s in tl.static_range(S):
                    a += xs[s] * ws[r * S + s]
        new = new + (a,)
    return new


@triton.jit
def _strided_walk(accs, x_img, stride_xh, ok_s, ws, bias, out_el, stride_op, o_ok, p0, p1, H, C, pad_h,
                  R: tl.constexpr, S: tl.constexpr, STR_H: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                  ROWS_USED: tl.constexpr, A: tl.constexpr, ACTIVATION: tl.constexpr, STAGES: tl.constexpr):
    """The walk of the strided row kernels (flat and tile forms) from A zeroed accumulators ``accs``: iteration t
    reads input rows (p0 + t)*STR_H - pad_h + j, j < STR_H (those some filter row reads: ROWS_USED), each once,
    into the A output rows in flight (slot i: output row p0 + t - i); row p0 + t - (A - 1) is then complete and
    stored."""
    T = p1 - p0 + A - 1
    for t in tl.range(0, T, num_stages=STAGES):
        h0 = (p0 + t) * STR_H - pad_h
        for j in tl.static_range(STR_H):
            if (ROWS_USED >> j) & 1:
                h = h0 + j
                row_ok = (h >= 0) & (h < H)
                src = x_img + h * stride_xh
                xs = ()
                for s in tl.static_range(S):
                    xs = xs + (tl.load(src + s * (DIL_W * C), mask=ok_s[s] & row_ok, other=0.0).to(tl.float32),)
                accs = _add_input_row(accs, xs, ws, j, A, R, S, STR_H, DIL_H)
        _finish_row(accs[A - 1], p0 + t - (A - 1), p0, out_el, stride_op, o_ok, bias, ACTIVATION)
        accs = _roll_down_like(accs, A)


# The output's n, p and q strides are sizes too (an NCHW output's): not specialized on, like the sizes.
@triton.jit(do_not_specialize=["H", "W", "P", "Q", "CD", "chunks", "row_groups", "rows_per", "xn_d", "xh_d", "on_d",
                               "op_d", "stride_on", "stride_op", "stride_oq", "pad_h", "pad_w"])
def depthwise_strided_rows_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, CD, chunks, row_groups, rows_per,
    xn_d, xh_d, on_d, op_d,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_wk, stride_wr, stride_ws, stride_b, pad_h, pad_w,
    MULT: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    STR_H: tl.constexpr, STR_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    ROWS_USED: tl.constexpr, A: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DIV: tl.constexpr, CL_OUT: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    # depthwise_rows_kernel's walk for any stride and dilation. This program: BLOCK consecutive elements
    # o = q*K + k of output rows p0 .. p1-1 of image n (channels-last, whatever mix of pixels and channels).
    pid = tl.program_id(0)
    rows = pid // chunks
    o = (pid - rows * chunks) * BLOCK + tl.arange(0, BLOCK)
    n = rows // row_groups
    p0 = (rows - n * row_groups) * rows_per
    p1 = tl.minimum(p0 + rows_per, P)
    C, K, o_ok, q, k = _flat_elements(o, CD, Q, MULT, DIV)  # sizes in units of DIV, as depthwise_rows_kernel
    # Tap (r, s) of element o reads input element (q*STR_W - pad_w + s*DIL_W)*C + k // MULT of input row
    # p*STR_H - pad_h + r*DIL_H: a per-element offset and, per tap, a constant shift of s*DIL_W*C.
    if MULT == 1:
        x_el = q * (STR_W * C) + k - pad_w * C
    else:
        x_el = q * (STR_W * C) + k // MULT - pad_w * C
    ok_s = ()  # tap s's input column inside the image
    for s in tl.static_range(S):
        col = q * STR_W + s * DIL_W
        ok_s = ok_s + (o_ok & (col >= pad_w) & (col < W + pad_w),)
    ws, bias, x_img, stride_xh, out_el, stride_op = _flat_prologue(
        x_ptr, w_ptr, out_ptr, bias_ptr, x_el, o, k, q, n, o_ok, xn_d, xh_d, on_d, op_d, stride_on, stride_op,
        stride_oq, stride_ok, stride_wk, stride_wr, stride_ws, stride_b, R, S, HAS_BIAS, DIV, CL_OUT, BLOCK)

    # Each input row loaded once into the A output rows in flight (_strided_walk): a 3x3 stride-2 layer loads 6
    # row vectors an output row, not 9 taps (docs/conv2d.md, "Depthwise rows for any stride").
    accs = ()
    for i in tl.static_range(A):
        accs = accs + (tl.zeros((BLOCK,), dtype=tl.float32),)
    _strided_walk(accs, x_img, stride_xh, ok_s, ws, bias, out_el, stride_op, o_ok, p0, p1, H, C, pad_h, R, S, STR_H,
                  DIL_H, DIL_W, ROWS_USED, A, ACTIVATION, STAGES)


@triton.jit
def _tile_prologue(x_ptr, w_ptr, out_ptr, bias_ptr, x_el, k, k_ok, q, n, K, xn_d, xh_d, on_d, op_d, stride_on,
                   stride_op, stride_oq, stride_ok, stride_wk, stride_wr, stride_ws, stride_b,
                   R: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, DIV: tl.constexpr,
                   CL_OUT: tl.constexpr, BLOCK_C: tl.constexpr):
    """What the [columns, channels] tile kernels set up before their row walk: the R*S weights of the program's
    channels (``[1, BC]`` each, fp32), the bias, image n's input elements at ``x_el`` and its row stride, the
    output elements of columns ``q`` and the output's row and column strides (channels-last or any strides)."""
    ws = ()
    for rs in tl.static_range(R * S):
        w_off = k * stride_wk + (rs // S) * stride_wr + (rs % S) * stride_ws
        ws = ws + (tl.load(w_ptr + w_off, mask=k_ok, other=0.0).to(tl.float32)[None, :],)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + k * stride_b, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    else:
        bias = tl.zeros((1, BLOCK_C), dtype=tl.float32)
    stride_xh = xh_d * DIV
    x_img = x_ptr + n.to(tl.int64) * xn_d * DIV + x_el
    if CL_OUT:
        out_el = out_ptr + n.to(tl.int64) * on_d * DIV + (q * K)[:, None] + k[None, :]
        stride_op = op_d * DIV
        stride_oj = K
    else:
        out_el = out_ptr + n.to(tl.int64) * stride_on + (q * stride_oq)[:, None] + (k * stride_ok)[None, :]
        stride_oj = stride_oq
    return ws, bias, x_img, stride_xh, out_el, stride_op, stride_oj


# The 2D-tile form, same walk: a program owns [BLOCK_Q output columns, BLOCK_C channels] of its rows, so a
# thread's channels hold their R*S weights once for all its columns (in the flat form each element carries
# its own): fewer weight registers an output for larger filters, at the price of a channel block padded to a
# power of two. Sizes, n/p/q strides not specialized on, as the flat form.
@triton.jit(do_not_specialize=["H", "W", "P", "Q", "CD", "q_blocks", "c_blocks", "row_groups", "rows_per", "xn_d",
                               "xh_d", "on_d", "op_d", "stride_on", "stride_op", "stride_oq", "pad_h", "pad_w"])
def depthwise_strided_tile_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, CD, q_blocks, c_blocks, row_groups, rows_per,
    xn_d, xh_d, on_d, op_d,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_wk, stride_wr, stride_ws, stride_b, pad_h, pad_w,
    MULT: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    STR_H: tl.constexpr, STR_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    ROWS_USED: tl.constexpr, A: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DIV: tl.constexpr, CL_OUT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr,
):
    # One grid axis: channel blocks fastest, then column blocks, row groups, images.
    pid = tl.program_id(0)
    rest = pid // c_blocks
    k = (pid - rest * c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] output channels
    rows = rest // q_blocks
    q = (rest - rows * q_blocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ] output columns
    n = rows // row_groups
    p0 = (rows - n * row_groups) * rows_per
    p1 = tl.minimum(p0 + rows_per, P)
    C = CD * DIV
    K = CD * MULT * DIV
    k_ok = _below_unspecialized(k, K, DIV)
    q_ok = q < Q
    o_ok = q_ok[:, None] & k_ok[None, :]
    if MULT == 1:
        c = k
    else:
        c = k // MULT
    x_el = (q * (STR_W * C) - pad_w * C)[:, None] + c[None, :]  # [BQ, BC]
    ok_s = ()
    for s in tl.static_range(S):
        col = q * STR_W + s * DIL_W
        ok_s = ok_s + ((q_ok & (col >= pad_w) & (col < W + pad_w))[:, None] & k_ok[None, :],)
    # a channel's weights once for all the program's columns
    ws, bias, x_img, stride_xh, out_el, stride_op, _ = _tile_prologue(
        x_ptr, w_ptr, out_ptr, bias_ptr, x_el, k, k_ok, q, n, K, xn_d, xh_d, on_d, op_d, stride_on, stride_op,
        stride_oq, stride_ok, stride_wk, stride_wr, stride_ws, stride_b, R, S, HAS_BIAS, DIV, CL_OUT, BLOCK_C)

    accs = ()
    for i in tl.static_range(A):
        accs = accs + (tl.zeros((BLOCK_Q, BLOCK_C), dtype=tl.float32),)
    _strided_walk(accs, x_img, stride_xh, ok_s, ws, bias, out_el, stride_op, o_ok, p0, p1, H, C, pad_h, R, S, STR_H,
                  DIL_H, DIL_W, ROWS_USED, A, ACTIVATION, STAGES)


@triton.jit
def _window_row(x_img, h, H, stride_xh, C, ok_i, WIDTH: tl.constexpr):
    """Input row ``h``'s WIDTH window columns as loaded (zeros outside the image)."""
    row_ok = (h >= 0) & (h < H)
    src = x_img + h * stride_xh
    row = ()
    for i in tl.static_range(WIDTH):
        row = row + (tl.load(src + i * C, mask=ok_i[i] & row_ok, other=0.0),)
    return row


# Stride 1, dilation 1, register-blocked along the row: a thread holds QT adjacent output columns of its channels
# (one [BLOCK_G groups, BLOCK_C channels] tensor a column: column g*QT + j of the tuple's entry j), so the QT + S - 1
# input columns under them are loaded once a row and each feeds up to S taps from registers (the row kernels load S
# shifted vectors an output column; the tile form S an output tile), and a thread's R*S weights serve its QT
# columns. Rows roll through R accumulators as in depthwise_rows_kernel. Sizes, n/p/q strides not specialized on.
@triton.jit(do_not_specialize=["H", "W", "P", "Q", "CD", "c_blocks", "g_blocks", "row_groups", "rows_per", "xn_d",
                               "xh_d", "on_d", "op_d", "stride_on", "stride_op", "stride_oq", "pad_h", "pad_w"])
def depthwise_window_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, CD, c_blocks, g_blocks, row_groups, rows_per,
    xn_d, xh_d, on_d, op_d,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_wk, stride_wr, stride_ws, stride_b, pad_h, pad_w,
    MULT: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DIV: tl.constexpr, CL_OUT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, QT: tl.constexpr, STAGES: tl.constexpr, AHEAD: tl.constexpr,
):
    # One grid axis: channel blocks fastest, then column blocks, row groups, images.
    pid = tl.program_id(0)
    rest = pid // c_blocks
    k = (pid - rest * c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] output channels
    rows = rest // g_blocks
    q0 = ((rest - rows * g_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)) * QT  # [BG] each group's first column
    n = rows // row_groups
    p0 = (rows - n * row_groups) * rows_per
    p1 = tl.minimum(p0 + rows_per, P)
    C = CD * DIV
    K = CD * MULT * DIV
    k_ok = _below_unspecialized(k, K, DIV)
    if MULT == 1:
        c = k
    else:
        c = k // MULT
    # Window entry i of group g: input column q0 - pad_w + i, i < QT + S - 1 (output column q0 + j, tap s: i = j + s).
    x_el = ((q0 - pad_w) * C)[:, None] + c[None, :]  # [BG, BC]
    ok_i = ()
    for i in tl.static_range(QT + S - 1):
        col = q0 - pad_w + i
        ok_i = ok_i + (((col >= 0) & (col < W))[:, None] & k_ok[None, :],)
    ok_j = ()
    for j in tl.static_range(QT):
        ok_j = ok_j + ((q0 + j < Q)[:, None] & k_ok[None, :],)
    # a channel's weights once for the program's columns and rows; stride_oj: from one output column to the next
    ws, bias, x_img, stride_xh, out_el, stride_op, stride_oj = _tile_prologue(
        x_ptr, w_ptr, out_ptr, bias_ptr, x_el, k, k_ok, q0, n, K, xn_d, xh_d, on_d, op_d, stride_on, stride_op,
        stride_oq, stride_ok, stride_wk, stride_wr, stride_ws, stride_b, R, S, HAS_BIAS, DIV, CL_OUT, BLOCK_C)

    # Iteration t reads input row h = p0 - pad_h + t (its QT + S - 1 window columns) into the output rows
    # p0 + t - r it feeds (accs[r*QT + j]: filter row r, column j); row p0 + t - (R - 1) is then complete.
    # AHEAD: the next row's window loaded before this row's taps (held in registers as loaded), so its loads are
    # in flight during them: Triton's pipeliner (STAGES) copies only loads of 4 bytes or more a thread.
    T = p1 - p0 + R - 1
    accs = ()
    for a in tl.static_range(R * QT):
        accs = accs + (tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32),)
    ring = ()
    if AHEAD:
        ring = _window_row(x_img, p0 - pad_h, H, stride_xh, C, ok_i, QT + S - 1)
    for t in tl.range(0, T, num_stages=STAGES):
        if AHEAD:
            xs = ()
            for i in tl.static_range(QT + S - 1):
                xs = xs + (ring[i].to(tl.float32),)
            ring = _window_row(x_img, p0 - pad_h + t + 1, H, stride_xh, C, ok_i, QT + S - 1)
        else:
            row = _window_row(x_img, p0 - pad_h + t, H, stride_xh, C, ok_i, QT + S - 1)
            xs = ()
            for i in tl.static_range(QT + S - 1):
                xs = xs + (row[i].to(tl.float32),)
        new = ()
        for r in tl.static_range(R):
            for j in tl.static_range(QT):
                a = accs[r * QT + j]
                for s in tl.static_range(S):
                    a += xs[j + s] * ws[r * S + s]
                new = new + (a,)
        p = p0 + t - (R - 1)
        if p >= p0:
            for j in tl.static_range(QT):
                y = apply_activation(new[(R - 1) * QT + j] + bias, ACTIVATION)
                tl.store(out_el + p * stride_op + j * stride_oj, y.to(out_el.dtype.element_ty), mask=ok_j[j])
        accs = ()
        for j in tl.static_range(QT):
            accs = accs + (tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32),)
        for a in tl.static_range((R - 1) * QT):
            accs = accs + (new[a],)


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "C", "M", "pad_h", "pad_w"])
def depthwise_dgrad_kernel(
    dy_ptr, w_ptr, dx_ptr,
    H, W, P, Q, C, M, MULT,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_wk, stride_wr, stride_ws,
    stride_xn, stride_xh, stride_xw, stride_xc,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, INDEX_64: tl.constexpr, DIV: tl.constexpr,
    DIV_Y: tl.constexpr, DIV_X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # This program: input pixels [BM] x input channels [BN]; each gathers the output pixels covering it.
    # Pixel strides of dy and dx in units of DIV_Y and DIV_X, as depthwise_fwd_kernel's: 16-byte loads and
    # stores along the channels where C is a multiple of 8 but not of 16 (docs/conv2d.md, "Depthwise pixel
    # kernel's load widths").
    stride_yn = stride_yn * DIV_Y
    stride_yp = stride_yp * DIV_Y
    stride_yq = stride_yq * DIV_Y
    stride_xn = stride_xn * DIV_X
    stride_xh = stride_xh * DIV_X
    stride_xw = stride_xw * DIV_X
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
    wx = offs_m % W
    hx = (offs_m // W) % H
    n = offs_m // (H * W)
    m_ok = offs_m < M
    c_ok = _below_unspecialized(offs_n, C, DIV)
    dy_rows = dy_ptr + n * stride_yn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for rs in range(0, R * S):
        r = rs // S
        s = rs - r * S
        ph = hx + pad_h - r * dil_h  # = p * str_h where this tap of output pixel (p, q) reads (hx, wx)
        pw = wx + pad_w - s * dil_w
        p = ph // str_h
        q = pw // str_w
        ok = m_ok & (ph >= 0) & (pw >= 0) & (p * str_h == ph) & (q * str_w == pw) & (p < P) & (q < Q)
        for j in range(0, MULT):
            k = offs_n * MULT + j  # [BN] the output channels fed by input channel offs_n
            dyv = tl.load(dy_rows[:, None] + (p * stride_yp + q * stride_yq)[:, None] + (k * stride_yk)[None, :],
                          mask=ok[:, None] & c_ok[None, :], other=0.0)  # [BM, BN]
            wv = tl.load(w_ptr + k * stride_wk + r * stride_wr + s * stride_ws, mask=c_ok, other=0.0)  # [BN]
            acc += dyv.to(tl.float32) * wv.to(tl.float32)[None, :]

    x_rows = n * stride_xn + hx * stride_xh + wx * stride_xw
    tl.store(dx_ptr + x_rows[:, None] + (offs_n * stride_xc)[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=m_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "K", "NPQ", "slice_len", "pad_h", "pad_w"])
def depthwise_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr,
    H, W, P, Q, K, NPQ, MULT, slice_len,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_dk, stride_dr, stride_dss,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, INDEX_64: tl.constexpr, DIV: tl.constexpr,
    DIV_Y: tl.constexpr, DIV_X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, S_PAD: tl.constexpr = 1,
):
    # This program: channels [BN] of one tap (S_PAD = 1; axis 1 the tap) or of a filter row's S taps (S_PAD, a
    # power of two >= S; axis 1 the row), summed over one slice of output pixels (axis 2). A row's taps share
    # each dy tile and read x's shifted columns from L1: a program a tap re-reads dy and x from L2 R*S times.
    # Pixel strides in units of DIV_Y and DIV_X, as in depthwise_dgrad_kernel.
    stride_yn = stride_yn * DIV_Y
    stride_yp = stride_yp * DIV_Y
    stride_yq = stride_yq * DIV_Y
    stride_xn = stride_xn * DIV_X
    stride_xh = stride_xh * DIV_X
    stride_xw = stride_xw * DIV_X
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tap = tl.program_id(1)
    part = tl.program_id(2)
    if S_PAD == 1:
        r = tap // S
        s0 = tap - r * S
    else:
        r = tap
        s0 = 0
    offs_s = s0 + tl.arange(0, S_PAD)  # [SP]
    s_ok = offs_s < S
    offs_m = tl.arange(0, BLOCK_M)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
    n_ok = _below_unspecialized(offs_n, K, DIV)
    x_chan = ((offs_n // MULT) * stride_xc)[None, None, :]
    begin = part * slice_len
    end = tl.minimum(begin + slice_len, NPQ)
    acc = tl.zeros((S_PAD, BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(begin, end, BLOCK_M):
        pix = m0 + offs_m  # [BM]
        q = pix % Q
        p = (pix // Q) % P
        n = pix // (P * Q)
        h = p * str_h - pad_h + r * dil_h  # [BM]
        w = q[None, :] * str_w - pad_w + offs_s[:, None] * dil_w  # [SP, BM]
        in_slice = pix < end
        ok = (in_slice & (h >= 0) & (h < H))[None, :] & s_ok[:, None] & (w >= 0) & (w < W)  # [SP, BM]
        dyv = tl.load(dy_ptr + (n * stride_yn + p * stride_yp + q * stride_yq)[:, None] + (offs_n * stride_yk)[None, :],
                      mask=in_slice[:, None] & n_ok[None, :], other=0.0)  # [BM, BN]
        xv = tl.load(x_ptr + (n * stride_xn + h * stride_xh)[None, :, None] + (w * stride_xw)[:, :, None] + x_chan,
                     mask=ok[:, :, None] & n_ok[None, None, :], other=0.0)  # [SP, BM, BN]
        acc += dyv.to(tl.float32)[None, :, :] * xv.to(tl.float32)
    total = tl.sum(acc, axis=1)  # [SP, BN]
    out_ok = s_ok[:, None] & n_ok[None, :]
    dw = dw_ptr + (offs_n * stride_dk)[None, :] + r * stride_dr + (offs_s * stride_dss)[:, None]
    # Split: a workspace block per (channels, taps) block, planes [SPLIT, blocks, SP, BN].
    tile = tap * tl.num_programs(0) + tl.program_id(0)
    size: tl.constexpr = S_PAD * BLOCK_N
    plane = (tl.num_programs(0) * tl.num_programs(1)).to(tl.int64) * size
    ws = (ws_ptr + tile.to(tl.int64) * size
          + (tl.arange(0, S_PAD) * BLOCK_N)[:, None] + tl.arange(0, BLOCK_N)[None, :])  # [SP, BN]
    store_summed_slices(total, dw, out_ok, ws, plane, part, count_ptr, tile, SPLIT)


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "K", "NP", "slice_rows", "pad_h", "pad_w"])
def depthwise_wgrad_taps_kernel(
    dy_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr,
    H, W, P, Q, K, NP, MULT, slice_rows,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_dk, stride_dr, stride_dss,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, T_PAD: tl.constexpr, INDEX_64: tl.constexpr, DIV: tl.constexpr,
    DIV_Y: tl.constexpr, DIV_X: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    # This program: channels [BN] of every tap (axis 0 of the tile, R * S padded to T_PAD) over a slice of output
    # rows (n, p), walked row by row and BLOCK_Q columns at a time: each dy tile is read once for all taps, and a
    # row's x tile for its taps' shifted columns and rows, which L1 and L2 hold across taps and neighbouring rows
    # (a program a tap reads dy and x once a tap). No division a pixel: one a row.
    stride_yn = stride_yn * DIV_Y
    stride_yp = stride_yp * DIV_Y
    stride_yq = stride_yq * DIV_Y
    stride_xn = stride_xn * DIV_X
    stride_xh = stride_xh * DIV_X
    stride_xw = stride_xw * DIV_X
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    taps = tl.arange(0, T_PAD)
    tr = taps // S
    ts = taps - tr * S
    t_ok = taps < R * S
    offs_q = tl.arange(0, BLOCK_Q)
    n_ok = _below_unspecialized(offs_n, K, DIV)
    chans = offs_n.to(tl.int64) if INDEX_64 else offs_n  # (an NCHW image of 2^31 elements: channels far apart)
    x_chan = ((chans // MULT) * stride_xc)[None, None, :]
    y_chan = (chans * stride_yk)[None, :]
    row0 = part * slice_rows
    row1 = tl.minimum(row0 + slice_rows, NP)
    acc = tl.zeros((T_PAD, BLOCK_Q, BLOCK_N), dtype=tl.float32)
    for row in range(row0, row1):
        n = row // P
        p = row - n * P
        if INDEX_64:  # (p too: a view's rows may lie 2^31 elements apart within an image)
            n = n.to(tl.int64)
            p = p.to(tl.int64)
        h = p * str_h - pad_h + tr * dil_h  # [T]
        h_ok = t_ok & (h >= 0) & (h < H)
        y_row = dy_ptr + n * stride_yn + p * stride_yp
        x_rows = x_ptr + n * stride_xn + (h * stride_xh)[:, None, None]  # [T, 1, 1]
        for q0 in range(0, Q, BLOCK_Q):
            q = q0 + offs_q  # [BQ]
            q_ok = q < Q
            dyv = tl.load(y_row + (q * stride_yq)[:, None] + y_chan, mask=q_ok[:, None] & n_ok[None, :],
                          other=0.0)  # [BQ, BN]
            w = q[None, :] * str_w - pad_w + (ts * dil_w)[:, None]  # [T, BQ]
            ok = h_ok[:, None] & q_ok[None, :] & (w >= 0) & (w < W)
            xv = tl.load(x_rows + (w * stride_xw)[:, :, None] + x_chan, mask=ok[:, :, None] & n_ok[None, None, :],
                         other=0.0)  # [T, BQ, BN]
            acc += dyv.to(tl.float32)[None, :, :] * xv.to(tl.float32)
    total = tl.sum(acc, axis=1)  # [T, BN]
    out_ok = t_ok[:, None] & n_ok[None, :]
    dw = dw_ptr + (offs_n * stride_dk)[None, :] + (tr * stride_dr + ts * stride_dss)[:, None]
    # Split: a workspace block per channel block, planes [SPLIT, blocks, T, BN].
    tile = tl.program_id(0)
    size: tl.constexpr = T_PAD * BLOCK_N
    plane = tl.num_programs(0).to(tl.int64) * size
    ws = ws_ptr + tile.to(tl.int64) * size + (taps * BLOCK_N)[:, None] + tl.arange(0, BLOCK_N)[None, :]
    store_summed_slices(total, dw, out_ok, ws, plane, part, count_ptr, tile, SPLIT)


@triton.jit
def _walk_loads(dy_ptr, x_ptr, y_off, y_ok, x_off, x_ok, q, Q, W, pad_w, stride_yq, stride_xw,
                R: tl.constexpr, STR_W: tl.constexpr, KEEP: tl.constexpr, NEW: tl.constexpr):
    """Output column q's dy tile and, for each filter row, the input columns it adds to the kept ones (as stored;
    zeros past Q, the end of the program's columns, W and the rows' bounds)."""
    live = q < Q
    dyv = tl.load(dy_ptr + y_off + q * stride_yq, mask=y_ok & live, other=0.0)
    c0 = q * STR_W - pad_w + KEEP
    fresh = ()
    for r in tl.static_range(R):
        for j in tl.static_range(NEW):
            c = c0 + j
            fresh = fresh + (tl.load(x_ptr + x_off[r] + c * stride_xw, mask=x_ok[r] & live & (c >= 0) & (c < W),
                                     other=0.0),)
    return dyv, fresh


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "K", "NP", "slice_rows", "blocks", "pad_h", "pad_w"])
def depthwise_wgrad_walk_kernel(
    dy_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr,
    H, W, P, Q, K, NP, slice_rows, blocks,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_dk, stride_dr, stride_dss,
    str_h, pad_h, pad_w, dil_h,
    R: tl.constexpr, S: tl.constexpr, STR_W: tl.constexpr, T_PAD: tl.constexpr, INDEX_64: tl.constexpr,
    DIV: tl.constexpr, DIV_Y: tl.constexpr, DIV_X: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, AHEAD: tl.constexpr, ROWS: tl.constexpr,
    COLS: tl.constexpr = 1,
):
    # This program: channels [BN] of the taps of ROWS filter rows over a slice of output rows (n, p), BLOCK_P rows
    # at a time (one a thread row of the tile), each row's columns walked one by one. A tap is its own accumulator
    # (a tuple: no padding of R * S to a power of two), and each filter row keeps the input columns the next output
    # column still needs in registers (S - STR_W of them, converted to fp32 once): an x value is loaded and
    # converted once a filter row, where a tile of taps did it once a tap (docs/conv2d.md, "Depthwise weight
    # gradient"). Undilated along w (the kept columns are the next column's); rows take any stride and dilation.
    # ROWS < R: each group of filter rows is its own program (program_id(0) = channel block + blocks x group),
    # re-reading dy, its taps in fewer registers. COLS > 1: the output columns in COLS runs, each its own program
    # (program_id(1) = row slice x COLS + run), for layers of few channel blocks and row tiles (SPLIT counts both).
    stride_yn = stride_yn * DIV_Y
    stride_yp = stride_yp * DIV_Y
    stride_yq = stride_yq * DIV_Y
    stride_xn = stride_xn * DIV_X
    stride_xh = stride_xh * DIV_X
    stride_xw = stride_xw * DIV_X
    KEEP: tl.constexpr = S - STR_W if S > STR_W else 0  # columns carried to the next output column
    NEW: tl.constexpr = S - KEEP  # columns loaded for each output column
    tile = tl.program_id(0)
    r0 = (tile // blocks) * ROWS  # this program's first filter row
    offs_n = (tile % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    if COLS > 1:
        run_len = tl.cdiv(Q, COLS)
        q0 = (part % COLS) * run_len  # this program's output columns [q0, q1)
        q1 = tl.minimum(q0 + run_len, Q)
        row0 = (part // COLS) * slice_rows
    else:
        q0 = 0
        q1 = Q
        row0 = part * slice_rows
    n_ok = _below_unspecialized(offs_n, K, DIV)
    chans = offs_n.to(tl.int64) if INDEX_64 else offs_n  # (an NCHW image of 2^31 elements: channels far apart)
    y_chan = (chans * stride_yk)[None, :]
    x_chan = (chans * stride_xc)[None, :]
    row1 = tl.minimum(row0 + slice_rows, NP)
    acc = ()
    for t in tl.static_range(ROWS * S):
        acc = acc + (tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32),)
    for b in range(row0, row1, BLOCK_P):
        rows = b + tl.arange(0, BLOCK_P)
        r_ok = rows < row1
        n = rows // P
        p = rows - n * P
        if INDEX_64:  # (p too: a view's rows may lie 2^31 elements apart within an image)
            n = n.to(tl.int64)
            p = p.to(tl.int64)
        y_off = (n * stride_yn + p * stride_yp)[:, None] + y_chan  # [BP, BN]
        y_ok = r_ok[:, None] & n_ok[None, :]
        x_off = ()
        x_ok = ()
        win = ()
        for r in tl.static_range(ROWS):
            h = p * str_h - pad_h + (r0 + r) * dil_h
            x_off = x_off + ((n * stride_xn + h * stride_xh)[:, None] + x_chan,)
            x_ok = x_ok + (((r_ok & (h >= 0) & (h < H) & (r0 + r < R))[:, None] & n_ok[None, :]),)
            for j in tl.static_range(KEEP):  # the columns before the first output column's new ones
                c = q0 * STR_W + j - pad_w
                win = win + (tl.load(x_ptr + x_off[r] + c * stride_xw, mask=x_ok[r] & (c >= 0) & (c < W),
                                     other=0.0).to(tl.float32),)
        # Column q's loads are issued AHEAD columns earlier, during those columns' products (registers, not a
        # shared-memory ring): dy streams from memory once, and one column's products do not hide its latency.
        FRESH: tl.constexpr = ROWS * NEW  # the x values a column loads
        dys = ()
        xs = ()
        for i in tl.static_range(AHEAD):
            d, f = _walk_loads(dy_ptr, x_ptr, y_off, y_ok, x_off, x_ok, q0 + i, q1, W, pad_w, stride_yq, stride_xw,
                               ROWS, STR_W, KEEP, NEW)
            dys = dys + (d,)
            xs = xs + f
        for q in range(q0, q1):
            d, f = _walk_loads(dy_ptr, x_ptr, y_off, y_ok, x_off, x_ok, q + AHEAD, q1, W, pad_w, stride_yq,
                               stride_xw, ROWS, STR_W, KEEP, NEW)
            dyf = dys[0].to(tl.float32)
            kept = ()
            for r in tl.static_range(ROWS):
                cols = win[r * KEEP:(r + 1) * KEEP]
                for j in tl.static_range(NEW):
                    cols = cols + (xs[r * NEW + j].to(tl.float32),)
                for s in tl.static_range(S):
                    acc = acc[:r * S + s] + (acc[r * S + s] + dyf * cols[s],) + acc[r * S + s + 1:]
                kept = kept + cols[S - KEEP:]
            win = kept
            dys = dys[1:] + (d,)
            xs = xs[FRESH:] + f
    taps = tl.arange(0, T_PAD)
    total = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    for t in tl.static_range(ROWS * S):
        total = tl.where((taps == t)[:, None], tl.sum(acc[t], axis=0)[None, :], total)
    tr = taps // S
    out_ok = ((taps < ROWS * S) & (r0 + tr < R))[:, None] & n_ok[None, :]
    dw = dw_ptr + (offs_n * stride_dk)[None, :] + ((r0 + tr) * stride_dr + (taps - tr * S) * stride_dss)[:, None]
    # Split: a workspace block per program of a slice, planes [SPLIT, row groups x blocks, T, BN] (as the
    # all-taps kernel's).
    size: tl.constexpr = T_PAD * BLOCK_N
    plane = tl.num_programs(0).to(tl.int64) * size
    ws = ws_ptr + tile.to(tl.int64) * size + (taps * BLOCK_N)[:, None] + tl.arange(0, BLOCK_N)[None, :]
    store_summed_slices(total, dw, out_ok, ws, plane, part, count_ptr, tile, SPLIT)


# --- launchers ------------------------------------------------------------------------------------------


def _w_strides(w: torch.Tensor) -> tuple:
    """(k, r, s) strides of a [K, 1, R, S] weight."""
    return w.stride(0), w.stride(2), w.stride(3)


def is_tap_major(w: torch.Tensor) -> bool:
    """Whether a ``[K, 1, R, S]`` weight lies as row-major ``[R, S, K]`` (what :func:`depthwise_weight_kernel`
    writes), so that a tap's channels are consecutive."""
    K, _, R, S = w.shape
    return K > 1 and _w_strides(w) == (1, S * K, K)


def _row_runs(g: Geometry, x: torch.Tensor) -> bool:
    """The row kernels' input and size conditions: an input whose image rows are runs of W*C elements
    (channels-last, pixels adjacent; the rows may lie apart), and images whose element offsets fit 32 bits (an
    input view with gaps between rows included; the output is new)."""
    return x.stride(1) == 1 and (x.stride(3) == g.C or g.W == 1) and max(_span(x[:1]) + 1, g.P * g.Q * g.K) < 2**31


def rows_apply(g: Geometry, x: torch.Tensor, by_config: bool = False) -> bool:
    """Whether :func:`depthwise_rows_kernel` takes the forward: stride and dilation 1, at most
    :data:`~tilegemm.ops.conv2d.configs.DEPTHWISE_ROWS_MAX_TAPS` taps where ``auto`` picks it (each takes
    registers), :data:`~tilegemm.ops.conv2d.configs.DEPTHWISE_ROWS_CONFIG_MAX_TAPS` where a config names it
    (``by_config``), and the input and size conditions of :func:`_row_runs`."""
    from tilegemm.ops.conv2d.configs import DEPTHWISE_ROWS_CONFIG_MAX_TAPS, DEPTHWISE_ROWS_MAX_TAPS

    most = DEPTHWISE_ROWS_CONFIG_MAX_TAPS if by_config else DEPTHWISE_ROWS_MAX_TAPS
    return g.stride == (1, 1) and g.dilation == (1, 1) and g.R * g.S <= most and _row_runs(g, x)


@contextlib.contextmanager
def _weight_for(p: ConvProblem, x: torch.Tensor, tap_major: bool):
    """(weight, its (k, r, s) strides, launch keywords) for a row kernel's launch: the weight as it lies, or with
    ``tap_major`` rewritten ``[R, S, K]`` first (:func:`depthwise_weight_kernel`, into this stream's workspace, the
    launch that reads it under the same lock), so that a program's weight loads are coalesced runs of channels
    where ``[K, 1, R, S]`` spreads one tap's channels R*S elements apart (a warp's gather touches R*S times the
    lines; docs/conv2d.md, "Depthwise window kernel")."""
    g = p.geo
    if not tap_major or is_tap_major(p.weight):  # (a weight written tap-major already: the data gradient's flip)
        yield p.weight, _w_strides(p.weight), {}
        return
    from tilegemm.core.launch import sequence_lock

    stream = current_stream() if x.is_cuda else None
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        wt = _write_tap_major(p, x, stream)
        yield wt, (1, g.S * g.K, g.K), dict(keep=(wt,), stream=stream)


def _write_tap_major(p: ConvProblem, x: torch.Tensor, stream) -> torch.Tensor:
    """``p``'s weight written row-major ``[R, S, K]`` by :func:`depthwise_weight_kernel` into the workspace of
    ``stream`` (x's device); the caller holds :data:`~tilegemm.core.launch.sequence_lock` until the launch that
    reads it is made."""
    from tilegemm.core.workspace import buffer

    g = p.geo
    taps = g.R * g.S * g.K
    wt = buffer(x.device, p.weight.dtype, taps, "conv2d-depthwise-weight")
    launch(depthwise_weight_kernel, (cdiv(taps, 1024),),
           (p.weight, wt, taps, g.K, g.S, *_w_strides(p.weight)), dict(BLOCK=1024, num_warps=4),
           keep=(wt,), stream=stream)
    return wt


def _row_div(g: Geometry, x: torch.Tensor, out: torch.Tensor, most: int) -> tuple[int, bool]:
    """(DIV, CL_OUT) of a row kernel's launch: CL_OUT where the output's rows are runs of Q*K elements
    (channels-last), DIV the power of two (at most ``most``) dividing C and the n and h strides of the input (and of
    such an output), the unit the kernel takes sizes and those strides in."""
    cl_out = out.stride(1) == 1 and (out.stride(3) == g.K or g.Q == 1)
    div = most
    for v in (g.C, x.stride(0), x.stride(2)) + ((out.stride(0), out.stride(2)) if cl_out else ()):
        div = min(div, _divisor(v))
    return div, cl_out


def _row_strides(p: ConvProblem, x: torch.Tensor, out: torch.Tensor, div: int, w_strides: tuple) -> tuple:
    """A row kernel's arguments from ``xn_d`` on: strides (the n and h ones also in units of ``div``), the
    weight's, the bias's, the padding."""
    return (x.stride(0) // div, x.stride(2) // div, out.stride(0) // div, out.stride(2) // div,
            out.stride(0), out.stride(2), out.stride(3), out.stride(1), *w_strides,
            p.bias.stride(0) if p.bias is not None else 0, p.geo.padding[0], p.geo.padding[2])


def _run_rows(p: ConvProblem, x: torch.Tensor, out: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The forward by :func:`depthwise_rows_kernel`: one launch, the weight read as it lies (with config key
    ``TAP_MAJOR``: rewritten tap-major first, :func:`_weight_for`)."""
    g = p.geo
    tap_major = cfg.pop("TAP_MAJOR", False)
    groups = cdiv(g.P, cfg["ROWS_PER"])  # ROWS_PER not clamped to P: a new image height compiles nothing
    chunks = cdiv(g.Q * g.K, cfg["BLOCK"])
    div, cl_out = _row_div(g, x, out, 8)
    bias = p.bias if p.bias is not None else out
    flags = dict(MULT=g.K // g.C, R=g.R, S=g.S, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, DIV=div,
                 CL_OUT=cl_out, **cfg)
    with _weight_for(p, x, tap_major) as (w, w_strides, kept):
        args = (x, w, out, bias, g.H, g.W, g.P, g.Q, g.C // div, chunks, groups,
                *_row_strides(p, x, out, div, w_strides))
        launch(depthwise_rows_kernel, (chunks * g.N * groups,), args, flags, **kept)
    return out


def strided_rows_apply(g: Geometry, x: torch.Tensor) -> bool:
    """Whether :func:`depthwise_strided_rows_kernel` can take the forward: any stride and dilation, at most
    :data:`~tilegemm.ops.conv2d.configs.DEPTHWISE_STRIDED_ROWS_MAX_TAPS` taps (each takes registers), and the
    input and size conditions of :func:`_row_runs` (image rows that are runs of W*C elements, 32-bit offsets)."""
    from tilegemm.ops.conv2d.configs import DEPTHWISE_STRIDED_ROWS_MAX_TAPS

    return g.R * g.S <= DEPTHWISE_STRIDED_ROWS_MAX_TAPS and _row_runs(g, x)


def _rows_used(R: int, stride_h: int, dilation_h: int) -> int:
    """Bit j set where input row j of each stride_h-row step is read by some filter row (dilation 2 at stride
    2 reads every other row only)."""
    used = 0
    for j in range(stride_h):
        if any(r * dilation_h >= j and (r * dilation_h - j) % stride_h == 0 for r in range(R)):
            used |= 1 << j
    return used


def _run_strided_rows(p: ConvProblem, x: torch.Tensor, out: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The forward by :func:`depthwise_strided_rows_kernel` (config key ``STRIDED_ROWS``: output rows a program
    at most, balanced over the image's; ``BLOCK``) or, where the config has ``BLOCK_Q`` and ``BLOCK_C``, by
    :func:`depthwise_strided_tile_kernel`; one launch, the weight read as it lies."""
    g = p.geo
    most = cfg.pop("STRIDED_ROWS")
    if most < 1:
        raise ValueError(f"STRIDED_ROWS must be at least 1; got {most}")
    groups = cdiv(g.P, most)
    rows_per = cdiv(g.P, groups)  # runtime: any image height and balance compile nothing new
    # VEC: a narrower vector, fewer channels (and their weights) a thread in the tile form
    div, cl_out = _row_div(g, x, out, cfg.pop("VEC", 8))
    bias = p.bias if p.bias is not None else out
    (sh, sw), (dh, dw) = g.stride, g.dilation
    flags = dict(MULT=g.K // g.C, R=g.R, S=g.S, STR_H=sh, STR_W=sw, DIL_H=dh, DIL_W=dw,
                 ROWS_USED=_rows_used(g.R, sh, dh), A=_strided_slots(g.R, sh, dh), HAS_BIAS=p.bias is not None,
                 ACTIVATION=p.activation, DIV=div, CL_OUT=cl_out, **cfg)
    tail = _row_strides(p, x, out, div, _w_strides(p.weight))
    if "BLOCK_Q" in cfg:
        q_blocks, c_blocks = cdiv(g.Q, cfg["BLOCK_Q"]), cdiv(g.K, cfg["BLOCK_C"])
        args = (x, p.weight, out, bias, g.H, g.W, g.P, g.Q, g.C // div, q_blocks, c_blocks, groups, rows_per,
                *tail)
        launch(depthwise_strided_tile_kernel, (c_blocks * q_blocks * g.N * groups,), args, flags)
        return out
    chunks = cdiv(g.Q * g.K, cfg["BLOCK"])
    args = (x, p.weight, out, bias, g.H, g.W, g.P, g.Q, g.C // div, chunks, groups, rows_per, *tail)
    launch(depthwise_strided_rows_kernel, (chunks * g.N * groups,), args, flags)
    return out


def window_apply(g: Geometry, x: torch.Tensor) -> bool:
    """Whether :func:`depthwise_window_kernel` takes the forward: stride and dilation 1, at most
    :data:`~tilegemm.ops.conv2d.configs.DEPTHWISE_WINDOW_MAX_TAPS` taps, and the input and size conditions of
    :func:`_row_runs` (image rows that are runs of W*C elements, 32-bit offsets)."""
    from tilegemm.ops.conv2d.configs import DEPTHWISE_WINDOW_MAX_TAPS

    return g.stride == (1, 1) and g.dilation == (1, 1) and g.R * g.S <= DEPTHWISE_WINDOW_MAX_TAPS and _row_runs(g, x)


def _run_window(p: ConvProblem, x: torch.Tensor, out: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The forward by :func:`depthwise_window_kernel` (config keys ``QT``: output columns a thread, ``BLOCK_G``
    groups of them and ``BLOCK_C`` channels a program, ``WINDOW_ROWS``: output rows a program at most, balanced
    over the image's, ``VEC``: channels a thread's vector at most, ``AHEAD``: the next row loaded before this
    one's taps); one launch, the weight read as it lies (with ``TAP_MAJOR``: rewritten tap-major first,
    :func:`_weight_for`)."""
    g = p.geo
    missing = [key for key in ("QT", "BLOCK_G", "BLOCK_C", "WINDOW_ROWS") if key not in cfg]
    if missing:
        raise ValueError(f"a depthwise_window_kernel config needs {missing}; got {sorted(cfg)}")
    most = cfg.pop("WINDOW_ROWS")
    tap_major = cfg.pop("TAP_MAJOR", False)
    for key in ("QT", "BLOCK_G", "BLOCK_C"):
        if cfg[key] < 1:
            raise ValueError(f"{key} must be at least 1; got {cfg[key]}")
    if most < 1:
        raise ValueError(f"WINDOW_ROWS must be at least 1; got {most}")
    groups = cdiv(g.P, most)
    rows_per = cdiv(g.P, groups)  # runtime: any image height and balance compile nothing new
    cfg.setdefault("AHEAD", False)
    cfg.setdefault("STAGES", 1)
    div, cl_out = _row_div(g, x, out, cfg.pop("VEC", 8))
    bias = p.bias if p.bias is not None else out
    c_blocks = cdiv(g.K, cfg["BLOCK_C"])
    g_blocks = cdiv(cdiv(g.Q, cfg["QT"]), cfg["BLOCK_G"])
    flags = dict(MULT=g.K // g.C, R=g.R, S=g.S, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, DIV=div,
                 CL_OUT=cl_out, **cfg)
    with _weight_for(p, x, tap_major) as (w, w_strides, kept):
        args = (x, w, out, bias, g.H, g.W, g.P, g.Q, g.C // div, c_blocks, g_blocks, groups, rows_per,
                *_row_strides(p, x, out, div, w_strides))
        launch(depthwise_window_kernel, (c_blocks * g_blocks * g.N * groups,), args, flags, **kept)
    return out


def run(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    """Forward; the output in ``p.out_format``. Where
    :func:`~tilegemm.ops.conv2d.configs.depthwise_strided_rows_config` gives a config (strided up to 5x5, and
    stride-1 3x3 on small images), one launch of :func:`depthwise_strided_rows_kernel`; where
    :func:`~tilegemm.ops.conv2d.configs.depthwise_window_config` does (stride-1 filters past 5x5, 5x5 and 3x3 of
    many channels), :func:`depthwise_window_kernel`; other stride-1 layers (:func:`rows_apply`) one launch of
    :func:`depthwise_rows_kernel`; the rest two: the weight rearranged tap-major (:func:`depthwise_weight_kernel`,
    into a per-stream workspace: a replay writes it again, so a weight updated in place is read afresh), then
    :func:`depthwise_fwd_kernel` (the window and row kernels take that first launch too where they read the
    weight tap-major). A ``config`` names its kernel by its keys (``STRIDED_ROWS``: the strided row kernel;
    ``QT``: the window kernel; ``ROWS_PER``: the row kernel)."""
    from tilegemm.core.launch import sequence_lock

    g = p.geo
    if not g.is_depthwise:
        from tilegemm.core.registry import NotApplicable

        raise NotApplicable(f"the depthwise kernel takes groups = C > 1 with one input channel per group (one group "
                            f"is a dense convolution); got C={g.C}, groups={g.groups}")
    x = _nhwc(p.x)
    out = allocate_out(p)
    if config is None:
        config = depthwise_strided_rows_config(g, p.dtype)  # strided up to 5x5, small stride-1 3x3 (else None)
        if config is not None and not strided_rows_apply(g, x):
            config = None
    if config is None and window_apply(g, x):
        config = depthwise_window_config(g, p.dtype)  # None where configs' window rule does not take g
    if config is None and rows_apply(g, x):
        config = depthwise_rows_config(g, p.dtype)
    if config is not None and "STRIDED_ROWS" in config:
        if not strided_rows_apply(g, x):
            raise ValueError(f"depthwise_strided_rows_kernel does not take this convolution ({g}); see "
                             f"strided_rows_apply")
        return _run_strided_rows(p, x, out, dict(config))
    if config is not None and "QT" in config:
        if not window_apply(g, x):
            raise ValueError(f"depthwise_window_kernel does not take this convolution ({g}); see window_apply")
        return _run_window(p, x, out, dict(config))
    if config is not None and "ROWS_PER" in config:
        if not rows_apply(g, x, by_config=True):
            raise ValueError(f"depthwise_rows_kernel does not take this convolution ({g}); see rows_apply")
        return _run_rows(p, x, out, dict(config))
    cfg = dict(config or depthwise_fwd_config(g, p.dtype))
    M = g.N * g.P * g.Q
    bias = p.bias if p.bias is not None else out
    flags = dict(R=g.R, S=g.S, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, INDEX_64=p.index_64,
                 DIV=_divisor(g.K))
    stream = current_stream() if x.is_cuda else None
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        wt = _write_tap_major(p, x, stream)
        xs, os_ = _nhwc_strides(x), (out.stride(0), out.stride(2), out.stride(3))
        # (a stride past 32 bits stays whole: Triton passes it as int64, where the product in the kernel would not be)
        div_x = min(8, *(_divisor(v) for v in xs[:3])) if max(xs[:3]) < 2**31 else 1
        div_o = min(8, *(_divisor(v) for v in os_)) if max(os_) < 2**31 else 1
        flags.update(DIV_X=div_x, DIV_O=div_o)
        args = (x, wt, out, bias, g.H, g.W, g.P, g.Q, g.K, M, g.K // g.C, *(v // div_x for v in xs[:3]), xs[3],
                1, g.S * g.K // flags["DIV"], g.K // flags["DIV"], *(v // div_o for v in os_), out.stride(1),
                p.bias.stride(0) if p.bias is not None else 0, *_conv_args(g))
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(g.K, cfg["BLOCK_N"]))
        launch(depthwise_fwd_kernel, grid, args, {**flags, **cfg}, keep=(wt,), stream=stream)
    return out


def _pixel_strides(t: torch.Tensor) -> tuple:
    """((n, h, w) strides of ``t`` divided by ``div``, its channel stride), ``div``): ``div`` the power of two
    (at most 8) dividing the pixel strides, which a gradient kernel multiplies back as a constant so that its
    channel runs load 16 bytes at a time where C is a multiple of 8 (1 where a stride passes 32 bits: Triton
    passes it as int64, where the product in the kernel would not be)."""
    n, h, w, c = _nhwc_strides(t)
    div = min(8, *(_divisor(v) for v in (n, h, w))) if max(n, h, w) < 2**31 else 1
    return (n // div, h // div, w // div, c), div


def dgrad(dy: torch.Tensor, weight: torch.Tensor, x_shape, x_format, g: Geometry,
          config: dict | None = None) -> torch.Tensor:
    """grad of x for a depthwise convolution: ``[N, C, H, W]`` in ``x_format``."""
    dy = _nhwc(dy)
    dx = empty_4d(x_shape, dy.dtype, dy.device, x_format)
    cfg = dict(config or depthwise_config(g, dy.dtype))
    M = g.N * g.H * g.W
    index_64 = needs_index_64(dx, dy)
    (ys, div_y), (xs, div_x) = _pixel_strides(dy), _pixel_strides(dx)
    args = (dy, weight, dx, g.H, g.W, g.P, g.Q, g.C, M, g.K // g.C, *ys, *_w_strides(weight), *xs,
            *_conv_args(g))
    grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(g.C, cfg["BLOCK_N"]))
    launch(depthwise_dgrad_kernel, grid, args, dict(R=g.R, S=g.S, INDEX_64=index_64, DIV=_divisor(g.C),
                                                    DIV_Y=div_y, DIV_X=div_x, **cfg))
    return dx


def wgrad(dy: torch.Tensor, x: torch.Tensor, g: Geometry, out_dtype: torch.dtype,
          config: dict | None = None) -> torch.Tensor:
    """grad of the weight for a depthwise convolution: ``[K, 1, R, S]`` (contiguous), in one launch."""
    dy, x = _nhwc(dy), _nhwc(x)
    cfg = dict(config or depthwise_wgrad_config(g, dy.dtype))
    if cfg.pop("WALK", False):
        return _wgrad_walk(dy, x, g, out_dtype, cfg)
    if cfg.pop("ALL_TAPS", False):
        return _wgrad_all_taps(dy, x, g, out_dtype, cfg)
    npq = g.N * g.P * g.Q
    sp = cfg.setdefault("S_PAD", 1)
    taps = g.R * g.S if sp == 1 else g.R  # programs along axis 1: one a tap, or one a filter row
    if sp != 1 and sp < g.S:
        raise ValueError(f"S_PAD={sp} holds fewer than the filter's {g.S} columns")
    blocks = cdiv(g.K, cfg["BLOCK_N"]) * taps
    per_sm, steps = cfg.pop("PER_SM", DEPTHWISE_WGRAD_PER_SM), cfg.pop("MIN_STEPS", DEPTHWISE_WGRAD_MIN_STEPS)
    split, slice_len = pixel_split(npq, blocks, cfg["BLOCK_M"], dy.device, cfg.pop("SPLIT", None), per_sm, steps)
    dw = new_output((g.K, 1, g.R, g.S), out_dtype, dy.device)
    grid = (cdiv(g.K, cfg["BLOCK_N"]), taps, split)
    tiles = grid[0] * grid[1]
    if split > 1:  # fp32 partial sums and arrival counters (tilegemm.core.workspace)
        ws, count = split_workspace(dy.device, split * tiles * sp * cfg["BLOCK_N"], tiles)
    else:
        ws, count = dw, dw  # unused
    index_64 = needs_index_64(x, dy)
    (ys, div_y), (xs, div_x) = _pixel_strides(dy), _pixel_strides(x)
    args = (dy, x, dw, ws, count, g.H, g.W, g.P, g.Q, g.K, npq, g.K // g.C, slice_len, *ys, *xs,
            dw.stride(0), dw.stride(2), dw.stride(3), *_conv_args(g))
    flags = dict(R=g.R, S=g.S, INDEX_64=index_64, DIV=_divisor(g.K), DIV_Y=div_y, DIV_X=div_x, SPLIT=split, **cfg)
    # The workspace is this stream's: a replay passes it as recorded and declines on another stream.
    launch(depthwise_wgrad_kernel, grid, args, flags, keep=(ws, count) if split > 1 else (),
           stream=current_stream() if split > 1 and dy.is_cuda else None)
    return dw  # [K, 1, R, S]


def _sms(dy) -> int:
    """The SMs a weight gradient's programs are counted against (4 under the interpreter)."""
    if dy.is_cuda:
        from tilegemm.core.hardware import sm_count

        return sm_count(dy.device)
    return 4


def _row_slices(dy, rows: int, blocks: int, per_sm: int, cap: int, unit: int, given: int | None) -> tuple[int, int]:
    """(slices, rows a slice) of a weight gradient over ``rows`` output rows: enough slices for ``per_sm`` programs
    an SM over ``blocks`` programs each, at most ``cap`` (and 1024), each a whole number of ``unit`` rows
    (``given``: a config's own count)."""
    split = given or max(1, min(cdiv(per_sm * _sms(dy), blocks), cap, 1024))
    slice_rows = cdiv(cdiv(rows, split), unit) * unit
    return cdiv(rows, slice_rows), slice_rows


def _summed_output(g: Geometry, out_dtype, device, split: int, blocks: int, size: int) -> tuple:
    """(the weight gradient ``[K, 1, R, S]``, the split's fp32 partial sums and arrival counters): ``size`` floats a
    block and slice (tilegemm.core.workspace); the gradient itself twice where there is no split (unused)."""
    dw = new_output((g.K, 1, g.R, g.S), out_dtype, device)
    if split > 1:
        ws, count = split_workspace(device, split * blocks * size, blocks)
        return dw, ws, count
    return dw, dw, dw


def _wgrad_walk(dy, x, g: Geometry, out_dtype, cfg: dict) -> torch.Tensor:
    """:func:`wgrad` on :func:`depthwise_wgrad_walk_kernel`: BLOCK_N channels of the taps of ``ROWS`` filter rows
    (default all R) a program over a slice of output rows and ``COLS`` runs of their columns (default: by
    :func:`walk_column_runs`; 1 where the config gives ``SPLIT``), slices enough for ``PER_SM`` programs an SM, each
    at least ``MIN_CHUNKS`` tiles of rows."""
    if not walk_takes(g):
        from tilegemm.core.registry import NotApplicable

        raise NotApplicable("the walking depthwise weight gradient takes one output channel an input channel, "
                            f"no dilation along the width, width strides up to 4 and few taps: {g}")
    rows = g.N * g.P
    if rows == 0:  # an empty batch: nothing to sum
        return torch.zeros((g.K, 1, g.R, g.S), dtype=out_dtype, device=dy.device)
    cfg.setdefault("ROWS", g.R)
    if not 1 <= cfg["ROWS"] <= g.R:
        raise ValueError(f"the walking depthwise weight gradient's ROWS (filter rows a program) must be 1 to R={g.R}, "
                         f"got {cfg['ROWS']}")
    cols = cfg.get("COLS")
    if cols is not None and (not isinstance(cols, int) or cols < 1):
        raise ValueError(f"the walking depthwise weight gradient's COLS (runs of output columns) must be an int >= 1, "
                         f"got {cols!r}")
    t_pad = 1 << max(0, cfg["ROWS"] * g.S - 1).bit_length()
    blocks = cdiv(g.K, cfg["BLOCK_N"])
    tiles = blocks * cdiv(g.R, cfg["ROWS"])  # a program a channel block and group of filter rows, a slice, a run
    bp = cfg["BLOCK_P"]
    per_sm, min_chunks = cfg.pop("PER_SM", 4), cfg.pop("MIN_CHUNKS", 1)
    given = cfg.pop("SPLIT", None)
    if cols is None:  # the rule: runs where the row slices leave SMs without programs
        cols = walk_column_runs(g, tiles * cdiv(rows, bp * min_chunks), per_sm * _sms(dy)) if given is None else 1
    cols = cfg["COLS"] = max(1, min(cols, g.Q))  # (at most a run a column)
    split, slice_rows = _row_slices(dy, rows, tiles * cols, per_sm, cdiv(rows, bp * min_chunks), bp, given)
    split *= cols  # (parts: row slices x column runs, summed alike)
    dw, ws, count = _summed_output(g, out_dtype, dy.device, split, tiles, t_pad * cfg["BLOCK_N"])
    index_64 = needs_index_64(x, dy)
    (ys, div_y), (xs, div_x) = _pixel_strides(dy), _pixel_strides(x)
    args = (dy, x, dw, ws, count, g.H, g.W, g.P, g.Q, g.K, rows, slice_rows, blocks, *ys, *xs,
            dw.stride(0), dw.stride(2), dw.stride(3), g.stride[0], g.padding[0], g.padding[2], g.dilation[0])
    flags = dict(R=g.R, S=g.S, STR_W=g.stride[1], T_PAD=t_pad, INDEX_64=index_64, DIV=_divisor(g.K), DIV_Y=div_y,
                 DIV_X=div_x, SPLIT=split, **cfg)
    launch(depthwise_wgrad_walk_kernel, (tiles, split, 1), args, flags, keep=(ws, count) if split > 1 else (),
           stream=current_stream() if split > 1 and dy.is_cuda else None)
    return dw  # [K, 1, R, S]


def _wgrad_all_taps(dy, x, g: Geometry, out_dtype, cfg: dict) -> torch.Tensor:
    """:func:`wgrad` on :func:`depthwise_wgrad_taps_kernel`: a program every tap of BLOCK_N channels over a slice
    of output rows, slices enough for ``PER_SM`` programs an SM, each at least ``MIN_ROWS`` rows."""
    rows = g.N * g.P
    t_pad = 1 << max(0, g.R * g.S - 1).bit_length()
    blocks = cdiv(g.K, cfg["BLOCK_N"])
    per_sm = cfg.pop("PER_SM", DEPTHWISE_WGRAD_TAPS_PER_SM)
    min_rows = cfg.pop("MIN_ROWS", DEPTHWISE_WGRAD_TAPS_MIN_ROWS)
    split, slice_rows = _row_slices(dy, rows, blocks, per_sm, rows // min_rows, 1, cfg.pop("SPLIT", None))
    dw, ws, count = _summed_output(g, out_dtype, dy.device, split, blocks, t_pad * cfg["BLOCK_N"])
    index_64 = needs_index_64(x, dy)
    (ys, div_y), (xs, div_x) = _pixel_strides(dy), _pixel_strides(x)
    args = (dy, x, dw, ws, count, g.H, g.W, g.P, g.Q, g.K, rows, g.K // g.C, slice_rows, *ys, *xs,
            dw.stride(0), dw.stride(2), dw.stride(3), *_conv_args(g))
    flags = dict(R=g.R, S=g.S, T_PAD=t_pad, INDEX_64=index_64, DIV=_divisor(g.K), DIV_Y=div_y, DIV_X=div_x,
                 SPLIT=split, **cfg)
    launch(depthwise_wgrad_taps_kernel, (blocks, split, 1), args, flags, keep=(ws, count) if split > 1 else (),
           stream=current_stream() if split > 1 and dy.is_cuda else None)
    return dw  # [K, 1, R, S]
