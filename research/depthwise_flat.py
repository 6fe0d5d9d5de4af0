"""A depthwise forward over flattened channels-last rows, per output row (exploration kernel).

In channels-last memory an image row is one run of W*C elements. A program owns BLOCK consecutive elements
``o = q*K + k`` of output rows (any mix of pixels and channels: no channel block is padded, whatever C), loads
the weights of its elements (a tuple of R*S vectors), the bias and the masks once, and walks ROWS_PER output
rows of one image, each from R*S [BLOCK] loads (for stride 1 a horizontal tap is a shift of the row by C; for
stride SW the input element is ``q*SW*C + k // MULT``, runs of C with gaps). Any stride, dilation and channel
multiplier.

The stride-1 forms that roll each input row through R accumulators (S loads an input row instead of R*S an
output row) were explored here too and ship as ``tilegemm.ops.conv2d.depthwise.depthwise_rows_kernel``
(``research/explore_depthwise_flat.py`` times them through it, ``--rolls 1,2``). This per-row form is not
shipped: on strided 3x3 layers it beat the pixel kernel on the larger images but lost on 5x5 filters
(``benchmarks/results/2026-11-25-h200/ed547a3/``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.jit.helpers import apply_activation


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "CD", "row_groups", "xn_d", "xh_d", "on_d", "op_d",
                               "pad_h", "pad_w"])
def depthwise_flat_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, CD, row_groups,
    xn_d, xh_d, on_d, op_d,
    stride_on, stride_op, stride_oq, stride_ok,
    stride_wk, stride_wr, stride_ws, pad_h, pad_w,
    MULT: tl.constexpr, R: tl.constexpr, S: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DIV: tl.constexpr, CL_OUT: tl.constexpr,
    BLOCK: tl.constexpr, ROWS_PER: tl.constexpr, STAGES: tl.constexpr,
):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # element of an output row: q * K + k
    n = tl.program_id(1) // row_groups
    p0 = (tl.program_id(1) - n * row_groups) * ROWS_PER
    p1 = tl.minimum(p0 + ROWS_PER, P)
    # Sizes and strides come in units of DIV elements (C = CD * DIV input channels, K = C * MULT output
    # channels): products with the constant DIV are known multiples of it, and whatever is computed from
    # o // DIV is constant over aligned runs of DIV, so masks stay constant and loads contiguous over such
    # runs (16 bytes for DIV = 8).
    C = CD * DIV
    KD = CD * MULT
    K = KD * DIV
    od = o // DIV
    o_ok = od < Q * KD
    q = od // KD  # output column
    k = o - q * K  # output channel
    # Input element of output element o, tap (0, 0), counted from the row's start: (q*SW - pad_w)*C + k // MULT
    # (o - pad_w*C where SW = MULT = 1, a plain shift).
    if MULT == 1:
        x_el = q * (SW * C) + k - pad_w * C
    else:
        x_el = q * (SW * C) + k // MULT - pad_w * C
    ok_s = ()  # tap s's input column q*SW - pad_w + s*DW inside the image
    for s in tl.static_range(S):
        col = q * SW + s * DW
        ok_s = ok_s + (o_ok & (col >= pad_w) & (col < W + pad_w),)
    ws = ()  # once a program, from the [K, 1, R, S] weight as it lies
    for rs in tl.static_range(R * S):
        w_off = k * stride_wk + (rs // S) * stride_wr + (rs % S) * stride_ws
        ws = ws + (tl.load(w_ptr + w_off, mask=o_ok, other=0.0).to(tl.float32),)
    bias = tl.load(bias_ptr + k, mask=o_ok & HAS_BIAS, other=0.0).to(tl.float32)
    stride_xh = xh_d * DIV
    x_img = x_ptr + n.to(tl.int64) * xn_d * DIV + x_el  # [BLOCK] tap (0, 0), row 0
    if CL_OUT:  # channels-last output: the elements of a row are a run like the input's
        out_el = out_ptr + n.to(tl.int64) * on_d * DIV + o
        stride_op = op_d * DIV
    else:
        out_el = out_ptr + n.to(tl.int64) * stride_on + q * stride_oq + k * stride_ok

    for p in tl.range(p0, p1, num_stages=STAGES):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(R):
            h = p * SH - pad_h + r * DH
            row_ok = (h >= 0) & (h < H)
            src = x_img + h * stride_xh
            for s in tl.static_range(S):
                xv = tl.load(src + (s * DW) * C, mask=ok_s[s] & row_ok, other=0.0)
                acc += xv.to(tl.float32) * ws[r * S + s]
        if HAS_BIAS:
            acc += bias
        acc = apply_activation(acc, ACTIVATION)
        tl.store(out_el + p * stride_op, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def run(x: torch.Tensor, w: torch.Tensor, bias, stride, padding, dilation, cfg: dict, activation: str = "none",
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise conv2d (groups = C, K = C * multiplier) of a channels-last ``x`` [N, C, H, W] with ``w``
    [K, 1, R, S] (any strides); into ``out`` (any layout) or a new channels-last output."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    assert x.stride(1) == 1 and (x.stride(3) == C or W == 1), "channels-last x: each row a run of W*C elements"
    assert K % C == 0 and w.shape[1] == 1
    assert bias is None or bias.stride(0) == 1, "a contiguous bias"
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    assert max(H * W * C, P * Q * K) < 2**31, "one image's offsets are 32-bit"
    if out is None:
        out = torch.empty((N, K, P, Q), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    rows_per = min(cfg["ROWS_PER"], P)
    groups = triton.cdiv(P, rows_per)
    div = 8 if C % 8 == 0 else (4 if C % 4 == 0 else (2 if C % 2 == 0 else 1))
    grid = (triton.cdiv(Q * K, cfg["BLOCK"]), N * groups)
    depthwise_flat_kernel[grid](
        x, w, out, bias if bias is not None else out,
        H, W, P, Q, C // div, groups, x.stride(0) // div, x.stride(2) // div, out.stride(0) // div,
        out.stride(2) // div, out.stride(0), out.stride(2), out.stride(3), out.stride(1),
        w.stride(0), w.stride(2), w.stride(3), ph, pw,
        MULT=K // C, R=R, S=S, SH=sh, SW=sw, DH=dh, DW=dw, HAS_BIAS=bias is not None, ACTIVATION=activation,
        DIV=div, CL_OUT=out.stride(1) == 1 and (out.stride(3) == K or Q == 1),
        BLOCK=cfg["BLOCK"], ROWS_PER=rows_per, STAGES=cfg.get("STAGES", 1),
        num_warps=cfg.get("num_warps", 4))
    return out
