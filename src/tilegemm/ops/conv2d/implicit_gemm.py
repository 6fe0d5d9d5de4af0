"""Implicit-GEMM convolution: forward, data gradient and weight gradient, never materialising im2col.

Per group, the forward pass is the GEMM ``out[M, K] = A[M, C*R*S] @ B[C*R*S, K]`` with M = N*P*Q output
pixels; a row of A is the input patch under one output pixel, gathered on the fly. Activations are read
channels-last (NHWC) and the weight as [K, R, S, C] (``torch.channels_last`` on the [K, C, R, S] tensor), so
the K loop walks C contiguously for each filter tap (r, s): 16-byte loads, padding handled by masks.

The data gradient is the same pattern over input pixels (M = N*H*W, N = C/groups, K loop over (r, s) and
K/groups): each input pixel gathers the output-gradient pixels whose window covers it. The weight gradient is
a GEMM per tap and group, ``dw[K, C] = dy^T[K, NPQ] @ x_tap[NPQ, C]``, its pixel reduction split over programs.
All three accumulate in fp32.
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import current_stream, launch
from tilegemm.core.runtime import cdiv, ensure_backend, new_output
from tilegemm.ops.conv2d.configs import dgrad_config, forward_config, takes_stem, wgrad_columns, wgrad_config
from tilegemm.ops.conv2d.problem import ConvProblem, Geometry, needs_index_64

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tilegemm.jit.helpers import (  # noqa: E402
    apply_activation, below, mma_ordered, store_summed_slices, tile_grouped)


@triton.jit
def _below_unspecialized(offs, bound, DIV: tl.constexpr):
    """``offs < bound`` where ``bound`` is a kernel argument Triton does not specialize on (sizes are left
    unspecialized so a new image size compiles nothing) but the host knows ``DIV`` divides it: written as
    ``offs // DIV < bound // DIV`` the mask is visibly constant over aligned runs of DIV, so masked loads
    stay 16 bytes wide (compiled for sm_90, the forward's loads were all two bytes wide without it)."""
    if DIV > 1:
        return (offs // DIV) < (bound // DIV)
    return offs < bound


@triton.jit
def _tap_mma(a, b, acc, UPCAST: tl.constexpr, MMA_OPERANDS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc + a @ b`` for [BM, BK] and [BK, BN] tiles (see :func:`tilegemm.jit.helpers.mma_ordered`)."""
    if UPCAST:
        # Triton 3.6's interpreter computes bf16 dots wrongly; fp32 dots there are exact.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return mma_ordered(a, b, acc, MMA_OPERANDS, INPUT_PRECISION, False)


# Sizes are not specialized on (divisible by 16, equal to 1): each new image size would compile the kernels
# again, and the loads' vector width comes from the strides and the DIV_* constexprs instead.
_SIZES = ["H", "W", "Cg", "P", "Q", "Kg", "M", "pad_h", "pad_w"]
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


@triton.jit(do_not_specialize=_SIZES)
def conv2d_fwd_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, Cg, P, Q, Kg, M,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_wk, stride_wr, stride_ws, stride_wc,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_bias,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    INDEX_64: tl.constexpr, FLAT_K: tl.constexpr, DIV_C: tl.constexpr, DIV_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Which tile: grouped order over [pixels, output channels of this group]; axis 1 is the group.
    pid_m, pid_n = tile_grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(Kg, BLOCK_N), GROUP_M)
    grp = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] output pixels
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels within the group
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        grp = grp.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    # Output pixel m = (n * P + p) * Q + q; its window starts at (h0, w0) in the unpadded input.
    q = offs_m % Q
    p = (offs_m // Q) % P
    n = offs_m // (P * Q)
    h0 = p * str_h - pad_h  # [BM]
    w0 = q * str_w - pad_w
    m_ok = offs_m < M
    # The group's first channel: Cg is not specialized on, so say what the host knows of it (DIV_C divides
    # it); without that no row of A is provably 16-byte aligned and every load is two bytes wide.
    # The group's first channel: Cg is not specialized on, so say what the host knows of it (DIV_C divides
    # it); without that no row of A is provably 16-byte aligned and its loads are two bytes wide.
    x_rows = x_ptr + tl.multiple_of(grp * Cg, DIV_C) * stride_xc + n * stride_xn  # [BM] each pixel's image
    # Columns past Kg wrap into the group (loads stay unmasked along N; the store drops them).
    w_cols = w_ptr + (grp * Kg + offs_n % Kg) * stride_wk  # [BN] pointers to each output channel's filter

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT_K:
        # Few channels (the stem's C=3): K walks (r, s, c) as one index, every element gathered.
        KK = R * S * Cg
        for k0 in range(0, KK, BLOCK_K):
            kk = k0 + offs_k  # [BK]
            c = kk % Cg
            r = kk // (S * Cg)
            s = (kk // Cg) % S
            h = h0[:, None] + (r * dil_h)[None, :]  # [BM, BK]
            w = w0[:, None] + (s * dil_w)[None, :]
            a_ok = m_ok[:, None] & (kk < KK)[None, :] & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            a = tl.load(x_rows[:, None] + h * stride_xh + w * stride_xw + (c * stride_xc)[None, :], mask=a_ok,
                        other=0.0)  # [BM, BK]
            tap = r * stride_wr + s * stride_ws + c * stride_wc  # [BK]
            b = tl.load(w_cols[None, :] + tap[:, None], mask=(kk < KK)[:, None], other=0.0)  # [BK, BN]
            acc = _tap_mma(a, b, acc, UPCAST, "ab", INPUT_PRECISION)
    else:
        # K loop: each tap (r, s), then C in BLOCK_K steps; one flat loop so Triton pipelines it.
        c_steps = tl.cdiv(Cg, BLOCK_K)
        for it in range(0, R * S * c_steps):
            rs = it // c_steps
            c = (it - rs * c_steps) * BLOCK_K + offs_k  # [BK] channels within the group
            r = rs // S
            s = rs - r * S
            h = h0 + r * dil_h  # [BM]
            w = w0 + s * dil_w
            pix_ok = m_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W)  # zero padding
            c_ok = _below_unspecialized(c, Cg, DIV_C)
            a = tl.load(x_rows[:, None] + (h * stride_xh + w * stride_xw)[:, None] + (c * stride_xc)[None, :],
                        mask=pix_ok[:, None] & c_ok[None, :], other=0.0)  # [BM, BK]
            b = tl.load(w_cols[None, :] + (r * stride_wr + s * stride_ws) + (c * stride_wc)[:, None],
                        mask=c_ok[:, None], other=0.0)  # [BK, BN]
            acc = _tap_mma(a, b, acc, UPCAST, "ab", INPUT_PRECISION)

    # Epilogue: bias, activation, store through the output's strides (NCHW or channels-last).
    # Masks and offsets whose divisors the host knows (Kg is not specialized on): 16-byte stores, not 2-byte.
    k_out = tl.multiple_of(grp * Kg, DIV_K) + offs_n  # [BN] channel in the whole output
    n_ok = _below_unspecialized(offs_n, Kg, DIV_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k_out * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    out_rows = n * stride_on + p * stride_op + q * stride_oq  # [BM]
    tl.store(out_ptr + out_rows[:, None] + (k_out * stride_ok)[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "Kg", "pad_h", "pad_w"])
def conv2d_stem_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, Kg,
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wk, stride_wc, stride_wr, stride_ws,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_bias,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    C: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # A stem (few input channels, one group): BLOCK_Q output pixels of one output row by BLOCK_N output channels.
    # C, R and S are constexprs, so a K step's (r, s, c) and their offsets are constants: a gathered element costs
    # an add and its bound compares (docs/conv2d.md, "Stems").
    row = tl.program_id(0)  # n * P + p
    n = row // P
    p = row - n * P
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ]
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    h0 = p * str_h - pad_h
    w0 = q * str_w - pad_w  # [BQ]
    if INDEX_64:
        n = n.to(tl.int64)
        w0 = w0.to(tl.int64)
    x_pix = x_ptr + n * stride_xn + w0 * stride_xw  # [BQ] each output pixel's window's first column
    q_ok = (q < Q)[:, None]
    n_ok = offs_n < Kg
    acc = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, R * S * C, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)  # [BK] (r, s, c) as one index
        r = kk // (S * C)
        s = (kk // C) % S
        c = kk % C
        h = h0 + r * dil_h  # [BK]
        if INDEX_64:
            h = h.to(tl.int64)
        wcol = w0[:, None] + (s * dil_w)[None, :]  # [BQ, BK]
        ok = q_ok & ((kk < R * S * C) & (h >= 0) & (h < H))[None, :] & (wcol >= 0) & (wcol < W)
        a = tl.load(x_pix[:, None] + (h * stride_xh + s * dil_w * stride_xw + c * stride_xc)[None, :], mask=ok,
                    other=0.0)  # [BQ, BK]
        b = tl.load(w_ptr + (offs_n * stride_wk)[None, :] + (r * stride_wr + s * stride_ws + c * stride_wc)[:, None],
                    mask=(kk < R * S * C)[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        acc = _tap_mma(a, b, acc, UPCAST, "ab", INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    out = out_ptr + n * stride_on + p * stride_op + (q * stride_oq)[:, None] + (offs_n * stride_ok)[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=q_ok & n_ok[None, :])


@triton.jit(do_not_specialize=_SIZES + ["phases_h", "phases_w"])
def conv2d_dgrad_kernel(
    dy_ptr, w_ptr, dx_ptr,
    H, W, Cg, P, Q, Kg, M, phases_h, phases_w,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_wk, stride_wr, stride_ws, stride_wc,
    stride_xn, stride_xh, stride_xw, stride_xc,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    DIV_K: tl.constexpr, DIV_C: tl.constexpr, PHASED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Which tile: grouped order over [input pixels, input channels of this group]; axis 1 is the group (and,
    # PHASED, the stride phase: group * phases_h * phases_w + phase; phases_h = min(str_h, H): a stride past the
    # image leaves the phases from H on without pixels).
    pid_m, pid_n = tile_grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(Cg, BLOCK_N), GROUP_M)
    grp = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] input pixels m = (n * H + h) * W + w
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] input channels within the group
    if PHASED:
        # Stride phase (ph_h, ph_w): this program's pixels are h = ph_h + i * str_h, w = ph_w + j * str_w
        # (m = (n * Hs + i) * Ws + j over the phase's Hs x Ws grid, cut to the image). With dilation 1 the
        # taps that land on a whole output pixel are r = r0, r0 + str_h, ... (r = ph_h + pad_h mod str_h),
        # the same for every pixel of the phase: the K loop runs those alone, none masked off.
        phase = grp % (phases_h * phases_w)
        grp = grp // (phases_h * phases_w)
        ph_h = phase // phases_w
        ph_w = phase % phases_w
        Hs = tl.cdiv(H, str_h)
        Ws = tl.cdiv(W, str_w)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        grp = grp.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if PHASED:
        jx = offs_m % Ws
        ix = (offs_m // Ws) % Hs
        n = offs_m // (Hs * Ws)
        hx = ph_h + ix * str_h
        wx = ph_w + jx * str_w
        m_ok = (offs_m < M) & (hx < H) & (wx < W)
    else:
        wx = offs_m % W
        hx = (offs_m // W) % H
        n = offs_m // (H * W)
        m_ok = offs_m < M
    # Offsets the host knows the divisors of (Kg, Cg are not specialized on): 16-byte loads need them seen.
    dy_rows = dy_ptr + tl.multiple_of(grp * Kg, DIV_K) * stride_yk + n * stride_yn  # [BM]
    w_cols = w_ptr + tl.multiple_of(grp * Kg, DIV_K) * stride_wk + offs_n * stride_wc  # [BN]
    c_ok = _below_unspecialized(offs_n, Cg, DIV_C)  # [BN] (masked, not wrapped: a wrap hides contiguity)

    # dx[h, w] = sum over taps (r, s) and channels k of dy[p, q, k] * w[k, r, s], where the tap maps output
    # pixel (p, q) onto (h, w): p * str_h - pad_h + r * dil_h = h (only where that p is a whole number).
    if MMA_OPERANDS == "swap":
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = tl.cdiv(Kg, BLOCK_K)
    if PHASED:
        r0 = (ph_h + pad_h) % str_h
        s0 = (ph_w + pad_w) % str_w
        Rp = (R - r0 + str_h - 1) // str_h  # this phase's taps (0 when r0 >= R: dx is zero there)
        Sp = (S - s0 + str_w - 1) // str_w
        taps = Rp * Sp
    else:
        taps = R * S
    for it in range(0, taps * k_steps):
        rs = it // k_steps
        k = (it - rs * k_steps) * BLOCK_K + offs_k  # [BK] output channels within the group
        if PHASED:
            ri = rs // Sp
            r = r0 + ri * str_h
            s = s0 + (rs - ri * Sp) * str_w
            # h + pad_h - r = (ix + (ph_h + pad_h - r) / str_h) * str_h: the division is exact
            p = ix + (ph_h + pad_h - r) // str_h
            q = jx + (ph_w + pad_w - s) // str_w
            ok = m_ok & (p >= 0) & (q >= 0) & (p < P) & (q < Q)
        else:
            r = rs // S
            s = rs - r * S
            ph = hx + pad_h - r * dil_h  # [BM] = p * str_h where the tap lands on a whole output row
            pw = wx + pad_w - s * dil_w
            p = ph // str_h
            q = pw // str_w
            ok = m_ok & (ph >= 0) & (pw >= 0) & (p * str_h == ph) & (q * str_w == pw) & (p < P) & (q < Q)
        k_ok = _below_unspecialized(k, Kg, DIV_K)
        a = tl.load(dy_rows[:, None] + (p * stride_yp + q * stride_yq)[:, None] + (k * stride_yk)[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols[None, :] + (r * stride_wr + s * stride_ws) + (k * stride_wk)[:, None],
                    mask=k_ok[:, None] & c_ok[None, :], other=0.0)  # [BK, BN]
        acc = _tap_mma(a, b, acc, UPCAST, MMA_OPERANDS, INPUT_PRECISION)
    if MMA_OPERANDS == "swap":
        acc = tl.trans(acc)

    x_rows = n * stride_xn + hx * stride_xh + wx * stride_xw  # [BM]
    c_all = tl.multiple_of(grp * Cg, DIV_C) + offs_n  # (masked by c_ok: 16-byte stores along channels)
    tl.store(dx_ptr + x_rows[:, None] + (c_all * stride_xc)[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=m_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=_SIZES[:6] + ["NPQ", "slice_len", "pad_h", "pad_w"])
def conv2d_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr,
    H, W, Cg, P, Q, Kg, NPQ, slice_len,
    stride_yn, stride_yp, stride_yq, stride_yk,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_dk, stride_dc, stride_dr, stride_dss,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    DIV_K: tl.constexpr, DIV_C: tl.constexpr, FLAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Which tile: [output channels, input channels] of one tap and group (axis 1), one pixel slice (axis 2).
    # FLAT (few channels: the stem's C=3): [output channels, (r, s, c) as one index] of one group (axis 1), so
    # a 7x7x3 filter is 147 columns of one tile row, not 49 taps of 3 useful columns in 16, each re-reading dy.
    n_cols = R * S * Cg if FLAT else Cg
    pid_m, pid_n = tile_grouped(tl.program_id(0), tl.cdiv(Kg, BLOCK_M), tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    tap = tl.program_id(1)
    part = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] output channels within the group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] input channels within the group (FLAT: r, s, c)
    if FLAT:
        grp = tap
        c = offs_n % Cg
        r = offs_n // (S * Cg)  # [BN]
        s = (offs_n // Cg) % S
    else:
        grp = tap // (R * S)
        r = (tap % (R * S)) // S
        s = tap % S
        c = offs_n
    offs_k = tl.arange(0, BLOCK_K)  # [BK] pixels
    if INDEX_64:
        offs_k = offs_k.to(tl.int64)
        grp = grp.to(tl.int64)
    # Channels masked, not wrapped, from offsets whose divisors the host knows: 16-byte loads along channels.
    dy_cols = dy_ptr + (tl.multiple_of(grp * Kg, DIV_K) + offs_m) * stride_yk  # [BM]
    x_cols = x_ptr + (tl.multiple_of(grp * Cg, DIV_C) + c) * stride_xc  # [BN]
    k_ok = _below_unspecialized(offs_m, Kg, DIV_K)  # [BM]
    if FLAT:
        c_ok = offs_n < n_cols
    else:
        c_ok = _below_unspecialized(offs_n, Cg, DIV_C)  # [BN]

    # dw[k, c] (this tap) = sum over output pixels (n, p, q) of dy[n, p, q, k] * x[n, h, w, c], with (h, w) the
    # input pixel the tap reads for (p, q); this program sums pixels [begin, end).
    begin = part * slice_len
    end = tl.minimum(begin + slice_len, NPQ)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(begin, end, BLOCK_K):
        pix = k0 + offs_k  # [BK]
        q = pix % Q
        p = (pix // Q) % P
        n = pix // (P * Q)
        in_slice = pix < end
        a = tl.load(dy_cols[:, None] + (n * stride_yn + p * stride_yp + q * stride_yq)[None, :],
                    mask=k_ok[:, None] & in_slice[None, :], other=0.0)  # [BM, BK]
        if FLAT:
            h = (p * str_h - pad_h)[:, None] + (r * dil_h)[None, :]  # [BK, BN]
            w = (q * str_w - pad_w)[:, None] + (s * dil_w)[None, :]
            x_ok = in_slice[:, None] & c_ok[None, :] & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            b = tl.load(x_cols[None, :] + (n * stride_xn)[:, None] + h * stride_xh + w * stride_xw, mask=x_ok,
                        other=0.0)  # [BK, BN]
        else:
            h = p * str_h - pad_h + r * dil_h
            w = q * str_w - pad_w + s * dil_w
            x_ok = in_slice & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            b = tl.load(x_cols[None, :] + (n * stride_xn + h * stride_xh + w * stride_xw)[:, None],
                        mask=x_ok[:, None] & c_ok[None, :], other=0.0)  # [BK, BN]
        acc = _tap_mma(a, b, acc, UPCAST, MMA_OPERANDS, INPUT_PRECISION)

    k_all = tl.multiple_of(grp * Kg, DIV_K) + offs_m
    inside = k_ok[:, None] & c_ok[None, :]
    if FLAT:
        dw_tile = dw_ptr + (k_all * stride_dk)[:, None] + (c * stride_dc + r * stride_dr + s * stride_dss)[None, :]
    else:
        dw_tile = (dw_ptr + r * stride_dr + s * stride_dss + (k_all * stride_dk)[:, None]
                   + (offs_n * stride_dc)[None, :])
    # Split: planes [SPLIT, tiles, BM, BN] (64-bit offsets).
    tile = tap * tl.num_programs(0) + tl.program_id(0)
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    plane = (tl.num_programs(0) * tl.num_programs(1)).to(tl.int64) * (BLOCK_M * BLOCK_N)
    ws_tile = ws_ptr + tile.to(tl.int64) * (BLOCK_M * BLOCK_N) + local
    store_summed_slices(acc, dw_tile, inside, ws_tile, plane, part, count_ptr, tile, SPLIT)


# --- launchers ------------------------------------------------------------------------------------------


def _divisor(n: int) -> int:
    """The largest power of two dividing n, at most 16 (what ``below`` may assume about a bound)."""
    d = 1
    while d < 16 and n % (2 * d) == 0:
        d *= 2
    return d


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its channels at stride 1 (a copy unless it already is): the layout the K loops walk."""
    return t if t.stride(1) == 1 else t.contiguous(memory_format=torch.channels_last)


def _conv_args(g: Geometry) -> tuple:
    return (g.stride[0], g.stride[1], g.padding[0], g.padding[2], g.dilation[0], g.dilation[1])


def _nhwc_strides(t: torch.Tensor) -> tuple:
    """(n, h, w, c) strides of a [N, C, H, W] tensor; also [K, C, R, S] as (k, r, s, c)."""
    return t.stride(0), t.stride(2), t.stride(3), t.stride(1)


def empty_4d(shape, dtype, device, memory_format) -> torch.Tensor:
    """A new ``[N, C, H, W]`` kernel output in ``memory_format`` (NaN while tests poison outputs)."""
    N, C, H, W = shape
    if memory_format == torch.channels_last:  # (one allocation, not a permuted view: a tensor of its own)
        return new_output((N, C, H, W), dtype, device, memory_format=torch.channels_last)
    return new_output((N, C, H, W), dtype, device)


def allocate_out(p: ConvProblem) -> torch.Tensor:
    """The output ``[N, K, P, Q]`` in ``p.out_format``: ``p.out`` when given, else a new tensor."""
    if p.out is not None:
        return p.out
    return empty_4d(p.geo.out_shape, p.out_dtype, p.x.device, p.out_format)


def run(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    """Forward: ``activation(conv2d(p.x, p.weight) + p.bias)``."""
    from tilegemm.core.launch import sequence_lock

    if config is None and takes_stem(p.geo):
        return _run_stem(p, allocate_out(p))  # x and the weight read in place
    with sequence_lock:  # a weight's workspace is shared by the calls on this stream
        w, keep = pointer_weight(p.weight)
        return _run_forward(p, _nhwc(p.x), w, keep, config)


def pointer_weight(weight: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(the weight as the pointer kernels read it: its channels at stride 1, the workspaces to keep): as it is
    when they are, else :func:`tilegemm.ops.conv2d.layout.weight_channels_last`. Call under
    :data:`tilegemm.core.launch.sequence_lock`."""
    from tilegemm.ops.conv2d.layout import weight_channels_last

    return (weight, ()) if weight.stride(1) == 1 else weight_channels_last(weight)


def _run_forward(p: ConvProblem, x: torch.Tensor, w: torch.Tensor, keep: tuple, config: dict | None):
    g = p.geo
    out = allocate_out(p)
    cfg = dict(config or forward_config(g, p.dtype))
    M = g.N * g.P * g.Q
    bias = p.bias if p.bias is not None else out
    args = (x, w, out, bias, g.H, g.W, g.Cg, g.P, g.Q, g.Kg, M, *_nhwc_strides(x), *_nhwc_strides(w),
            out.stride(0), out.stride(2), out.stride(3), out.stride(1),
            p.bias.stride(0) if p.bias is not None else 0, *_conv_args(g))
    flags = dict(R=g.R, S=g.S, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, INPUT_PRECISION=p.precision,
                 UPCAST=p.upcast, INDEX_64=p.index_64, DIV_C=_divisor(g.Cg), DIV_K=_divisor(g.Kg))
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(g.Kg, cfg["BLOCK_N"]), g.groups)
    launch(conv2d_fwd_kernel, grid, args, {**flags, **cfg}, keep=keep,
           stream=current_stream() if keep else None)
    return out


def _run_stem(p: ConvProblem, out: torch.Tensor) -> torch.Tensor:
    """The forward of a stem (:func:`takes_stem`) on :func:`conv2d_stem_kernel`: x and the weight read in place,
    in any layout; one launch."""
    from tilegemm.ops.conv2d.configs import stem_rows_config

    g, x, w = p.geo, p.x, p.weight
    cfg = stem_rows_config(g, p.dtype)
    bias = p.bias if p.bias is not None else out
    args = (x, w, out, bias, g.H, g.W, g.P, g.Q, g.Kg, *x.stride(), *w.stride(),
            out.stride(0), out.stride(2), out.stride(3), out.stride(1),
            p.bias.stride(0) if p.bias is not None else 0, *_conv_args(g))
    flags = dict(C=g.C, R=g.R, S=g.S, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation,
                 INPUT_PRECISION=p.precision, UPCAST=p.upcast, INDEX_64=p.index_64)
    grid = (g.N * g.P, cdiv(g.Q, cfg["BLOCK_Q"]), cdiv(g.Kg, cfg["BLOCK_N"]))
    launch(conv2d_stem_kernel, grid, args, {**flags, **cfg})
    return out


def _operand_order(dtype: torch.dtype, precision: str, a_k_major: bool, b_k_major: bool) -> str:
    """As matmul's operand order (its problem's ``mma_operands``): tf32 operands must reach wgmma K-major."""
    if dtype != torch.float32 or precision == "ieee" or (a_k_major and b_k_major):
        return "ab"
    return "swap" if a_k_major else "reg_a"


def phases_apply(g: Geometry) -> bool:
    """Whether the data gradient runs per stride phase (``PHASED``): strided, dilation 1. At stride 2 a pixel's
    taps are masked off three times in four otherwise; per phase, each program runs only the taps that land on
    whole output pixels (a 3x3 stride-2 filter: 1, 2, 2 or 4 taps; a 1x1 one: 1 tap or none)."""
    return g.stride != (1, 1) and g.dilation == (1, 1)


def dgrad(dy: torch.Tensor, weight: torch.Tensor, x_shape, x_format, g: Geometry, precision: str, upcast: bool,
          config: dict | None = None, phased: bool | None = None) -> torch.Tensor:
    """grad of x: ``[N, C, H, W]`` in ``x_format``, from ``dy`` ``[N, K, P, Q]`` and the weight. ``phased``
    (default :func:`phases_apply`) runs one stride phase per program along grid axis 1."""
    dy, w = _nhwc(dy), _nhwc(weight)
    dx = empty_4d(x_shape, dy.dtype, dy.device, x_format)
    if dx.numel() == 0:
        return dx
    cfg = dict(config or dgrad_config(g, dy.dtype))
    if phased is None:
        phased = phases_apply(g)
    sh, sw = g.stride
    # The phases that hold pixels (a stride past the image leaves the rest empty: a stride of 2**31 launched
    # 2**62 programs), and none past the grid's second axis (65535 programs): then one program a group.
    ph, pw = min(sh, g.H), min(sw, g.W)
    phased = phased and g.groups * ph * pw <= _MAX_GRID_Y
    # Phased, the pixels are enumerated per stride phase over its cdiv(H, sh) x cdiv(W, sw) grid.
    M = g.N * cdiv(g.H, sh) * cdiv(g.W, sw) if phased else g.N * g.H * g.W
    index_64 = needs_index_64(dx, dy)
    args = (dy, w, dx, g.H, g.W, g.Cg, g.P, g.Q, g.Kg, M, ph, pw, *_nhwc_strides(dy), *_nhwc_strides(w),
            *_nhwc_strides(dx), *_conv_args(g))
    # A (dy, channels at stride 1) is K-major; B (w as [K, C], C at stride 1) is not.
    flags = dict(R=g.R, S=g.S, INPUT_PRECISION=precision, UPCAST=upcast, INDEX_64=index_64,
                 MMA_OPERANDS=_operand_order(dy.dtype, precision, True, False), DIV_K=_divisor(g.Kg),
                 DIV_C=_divisor(g.Cg), PHASED=phased)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(g.Cg, cfg["BLOCK_N"]), g.groups * (ph * pw if phased else 1))
    launch(conv2d_dgrad_kernel, grid, args, {**flags, **cfg})
    return dx


def wgrad(dy: torch.Tensor, x: torch.Tensor, g: Geometry, precision: str, upcast: bool, out_dtype: torch.dtype,
          config: dict | None = None, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """grad of the weight: ``[K, C/groups, R, S]`` in ``memory_format``, from ``dy`` ``[N, K, P, Q]`` and ``x``.

    The pixel reduction is split over ``SPLIT`` programs per tile; the last to arrive adds the fp32 partial
    tiles in a fixed order and stores the result (:mod:`tilegemm.core.workspace`), so the whole gradient is
    one launch that a replay can repeat."""
    from tilegemm.core.launch import current_stream
    from tilegemm.core.workspace import split_workspace

    dy, x = _nhwc(dy), _nhwc(x)
    if config is None:
        from tilegemm.core.hardware import sm_count

        sms = sm_count(dy.device) if dy.is_cuda else 4
        config = wgrad_config(g, dy.dtype, sms)
    cfg = dict(config)
    npq = g.N * g.P * g.Q
    # Slices are whole BLOCK_K steps, so every program but the last starts and ends on a step.
    slice_len = cdiv(cdiv(npq, cfg["SPLIT"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cfg["SPLIT"] = max(1, cdiv(npq, slice_len))
    dw = empty_4d((g.K, g.Cg, g.R, g.S), out_dtype, dy.device, memory_format)
    flat = cfg.pop("FLAT", False)
    cols, taps = wgrad_columns(g, flat)
    grid = (cdiv(g.Kg, cfg["BLOCK_M"]) * cdiv(cols, cfg["BLOCK_N"]), taps * g.groups, split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws, count = split_workspace(dy.device, split * tiles * cfg["BLOCK_M"] * cfg["BLOCK_N"], tiles)
    else:
        ws, count = dw, dw  # unused
    index_64 = needs_index_64(x, dy)
    args = (dy, x, dw, ws, count, g.H, g.W, g.Cg, g.P, g.Q, g.Kg, npq, slice_len, *_nhwc_strides(dy),
            *_nhwc_strides(x), *dw.stride(), *_conv_args(g))
    flags = dict(R=g.R, S=g.S, INPUT_PRECISION=precision, UPCAST=upcast, INDEX_64=index_64,
                 MMA_OPERANDS=_operand_order(dy.dtype, precision, False, False), DIV_K=_divisor(g.Kg),
                 DIV_C=_divisor(g.Cg), FLAT=flat)
    # The workspace is this stream's: a replay passes it as recorded and declines on another stream.
    launch(conv2d_wgrad_kernel, grid, args, {**flags, **cfg}, keep=(ws, count) if split > 1 else (),
           stream=current_stream() if split > 1 and dy.is_cuda else None)
    return dw
