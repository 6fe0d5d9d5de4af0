"""Kernel ``dequant_cublas``: dequantize the whole weight to 16-bit with a Triton kernel, then torch.matmul (the
second half: :mod:`.cublas_half`).

A candidate for large M, where the GEMM's compute hides the extra pass over the weight (8192 x 8192: 128 MB
written and read again against 2.2 TFLOP at M = 4096).
"""

from __future__ import annotations

import torch
import triton

from tilegemm.core.launch import launch
from tilegemm.core.runtime import cdiv, new_output
from tilegemm.ops.w4a16.cublas_half import product
from tilegemm.ops.w4a16.problem import W4A16Problem

import triton.language as tl  # noqa: E402


@triton.jit
def w4a16_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, K, N, group_k,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_N: tl.constexpr):
    # This program: packed rows [BLOCK_R] x columns [BLOCK_N] -> the weights of K rows [8 * BLOCK_R] by those
    # columns, written as W [N, K] (ROWS_N: the eight nibbles of a word are 16 contiguous bytes of a row) or
    # as W.T [K, N].
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask = (r[:, None] < K // 8) & (n[None, :] < N)
    q = tl.load(qw_ptr + r[:, None].to(tl.int64) * N + n[None, :], mask=mask, other=0)  # [BR, BN]
    g = (8 * r) // group_k  # [BR]: the eight rows of a packed row share a group
    s = tl.load(s_ptr + g[:, None] * N + n[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + g[:, None] * N + n[None, :], mask=mask, other=0.0)
    dt = s.dtype
    if ROWS_N:
        nib = tl.arange(0, 8)
        # in fp32 (exact), rounded once: the same values as 16-bit arithmetic, and the interpreter's
        # int-to-bf16 cast is wrong
        q8 = ((q[:, :, None] >> (4 * nib)[None, None, :]) & 15).to(tl.float32)  # [BR, BN, 8]
        w = ((q8 - z.to(tl.float32)[:, :, None]) * s.to(tl.float32)[:, :, None]).to(dt)
        w = tl.reshape(tl.permute(w, (1, 0, 2)), (BLOCK_N, BLOCK_R * 8))  # [BN, 8 BR]: rows of W
        k = tl.program_id(0) * BLOCK_R * 8 + tl.arange(0, BLOCK_R * 8)
        tl.store(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], w, mask=(n[:, None] < N) & (k[None, :] < K))
    else:
        for i in tl.static_range(8):
            w = ((((q >> (4 * i)) & 15).to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(dt)
            tl.store(w_ptr + (8 * r + i)[:, None].to(tl.int64) * N + n[None, :], w, mask=mask)


def dequantize_w(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_k: int,
                 rows_n: bool = True, block_r: int = 16, block_n: int = 128, warps: int = 4) -> torch.Tensor:
    """The dequantized weight in the scales' dtype, on the kernels' device: W ``[N, K]`` (``rows_n``, an
    ``nn.Linear``'s layout) or W.T ``[K, N]`` (the stored order); ``block_r`` packed rows by ``block_n``
    columns a program."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    w = new_output((N, K) if rows_n else (K, N), scales.dtype, qweight.device)
    grid = (cdiv(K // 8, block_r), cdiv(N, block_n))
    launch(w4a16_dequant_kernel, grid, (qweight, scales, zeros, w, K, N, group_k),
           dict(BLOCK_R=block_r, BLOCK_N=block_n, ROWS_N=rows_n, num_warps=warps))
    return w


def dequantized(p: W4A16Problem) -> torch.Tensor:
    """The Triton half alone: call ``p``'s weight dequantized to W ``[N, K]`` (one launch; the host fast path keeps
    it, W as its output, and runs the cuBLAS half itself)."""
    return dequantize_w(p.qweight, p.scales, p.zeros, p.group_k)


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    product(p.x, dequantized(p), p.bias, p.activation, p.out, p.upcast)
