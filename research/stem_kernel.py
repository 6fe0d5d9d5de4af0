"""A convolution kernel for stems (few input channels, one group) explored by ``research/stem_candidates.py``.

A program computes BQ output pixels of one output row by BN output channels. The K loop walks (r, s, c) as one
index, all of it known when compiling (C, R, S are constexprs): the offsets of a K step's columns are constants,
so a gathered element costs an add and two bound compares, where the pointer kernel ``implicit_gemm``
(``FLAT_K``) multiplies per element; input and weight are read in place, in any layout (one launch).

    TRITON_INTERPRET=1 PYTHONPATH=src python3 research/stem_kernel.py   # checks it against F.conv2d (fp32)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["H", "W", "P", "Q", "K", "str_h", "str_w", "pad_h", "pad_w"])
def stem_rows_kernel(
    x_ptr, wp_ptr, out_ptr, bias_ptr,
    H, W, P, Q, K,
    sxn, sxc, sxh, sxw, swk, swc, swr, sws, son, sop, soq, sok,
    str_h, str_w, pad_h, pad_w,
    C: tl.constexpr, R: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr,
    BQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    row = tl.program_id(0)  # n * P + p
    n = row // P
    p = row - n * P
    q = tl.program_id(1) * BQ + tl.arange(0, BQ)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    h0 = p * str_h - pad_h
    w0 = q * str_w - pad_w  # [BQ]
    x_img = x_ptr + n.to(tl.int64) * sxn
    x_pix = x_img + w0 * sxw  # [BQ] each output pixel's window's first column
    q_ok = (q < Q)[:, None]
    acc = tl.zeros((BQ, BN), dtype=tl.float32)
    for k0 in tl.static_range(0, R * S * C, BK):
        kk = k0 + tl.arange(0, BK)
        r = kk // (S * C)
        s = (kk // C) % S
        c = kk % C
        h = h0 + r  # [BK]
        col_off = h * sxh + s * sxw + c * sxc  # [BK]
        wcol = w0[:, None] + s[None, :]  # [BQ, BK]
        ok = q_ok & ((kk < R * S * C) & (h >= 0) & (h < H))[None, :] & (wcol >= 0) & (wcol < W)
        a = tl.load(x_pix[:, None] + col_off[None, :], mask=ok, other=0.0)
        b = tl.load(wp_ptr + (offs_n * swk)[None, :] + (r * swr + s * sws + c * swc)[:, None],
                    mask=(kk < R * S * C)[:, None] & (offs_n < K)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    n_ok = offs_n < K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o = out_ptr + n.to(tl.int64) * son + p * sop + (q * soq)[:, None] + (offs_n * sok)[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=q_ok & n_ok[None, :])


def run(x, w, bias, stride, padding, BQ=128, BN=None, BK=32, num_warps=4, num_stages=1):
    """``F.conv2d(x, w, bias, stride, padding)`` for ``x`` and ``w`` in any layout; the output channels-last."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    (sh, sw), (ph, pw) = stride, padding
    P = (H + 2 * ph - R) // sh + 1
    Q = (W + 2 * pw - S) // sw + 1
    BN = BN or max(16, triton.next_power_of_2(K))
    out = torch.empty(N, K, P, Q, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    grid = (N * P, triton.cdiv(Q, BQ), triton.cdiv(K, BN))
    stem_rows_kernel[grid](
        x, w, out, bias if bias is not None else out, H, W, P, Q, K,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), *w.stride(),
        out.stride(0), out.stride(2), out.stride(3), out.stride(1),
        sh, sw, ph, pw, C=C, R=R, S=S, HAS_BIAS=bias is not None, BQ=BQ, BN=BN, BK=BK,
        num_warps=num_warps, num_stages=num_stages)
    return out


if __name__ == "__main__":
    import torch.nn.functional as F

    torch.manual_seed(0)
    for (C, K, H, R, st, pd, bias) in [(3, 24, 17, 3, 2, 1, False), (3, 40, 9, 3, 2, 0, True), (3, 20, 12, 7, 2, 3, True),
                                       (3, 16, 10, 3, 1, 1, False), (4, 36, 13, 5, 3, 2, True)]:
        x = torch.randn(2, C, H, H + 3)
        if C == 3:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(K, C, R, R)
        b = torch.randn(K) if bias else None
        out = run(x, w, b, (st, st), (pd, pd), BQ=16, BN=16, BK=16)
        ref = F.conv2d(x, w, b, st, pd)
        err = ((out - ref).norm() / ref.norm()).item()
        print(C, K, H, R, st, pd, "rel err", f"{err:.2e}")
        assert err < 1e-5, err
    print("ok")
