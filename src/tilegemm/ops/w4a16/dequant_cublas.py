"""Kernel ``dequant_cublas``: dequantize the whole weight to 16-bit with a Triton kernel, then torch.matmul.

A candidate for large M, where the GEMM's compute hides the extra pass over the weight (8192 x 8192: 128 MB
written and read again against 2.2 TFLOP at M = 4096).
"""

from __future__ import annotations

import torch
import triton

from tilegemm.core.launch import launch
from tilegemm.core.runtime import cdiv, new_output
from tilegemm.ops.w4a16.common import W4A16Problem

import triton.language as tl  # noqa: E402


@triton.jit
def w4a16_dequant_kernel(qw_ptr, s_ptr, z_ptr, wt_ptr, K, N, group_k,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # This program: packed rows [BLOCK_R] x columns [BLOCK_N] -> dequantized rows [8 * BLOCK_R] of W.T [K, N].
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask = (r[:, None] < K // 8) & (n[None, :] < N)
    q = tl.load(qw_ptr + r[:, None].to(tl.int64) * N + n[None, :], mask=mask, other=0)  # [BR, BN]
    g = (8 * r) // group_k  # [BR]: the eight rows of a packed row share a group
    s = tl.load(s_ptr + g[:, None] * N + n[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + g[:, None] * N + n[None, :], mask=mask, other=0.0)
    dt = s.dtype
    for i in tl.static_range(8):
        # in fp32 (exact), rounded once: the same values as 16-bit arithmetic, and the interpreter's
        # int-to-bf16 cast is wrong
        w = ((((q >> (4 * i)) & 15).to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(dt)
        tl.store(wt_ptr + (8 * r + i)[:, None].to(tl.int64) * N + n[None, :], w, mask=mask)


def dequantize_t(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_k: int,
                 block_r: int = 16, block_n: int = 128, warps: int = 4) -> torch.Tensor:
    """W.T ``[K, N]`` in the scales' dtype (stored order), on the kernels' device; ``block_r`` packed rows by
    ``block_n`` columns a program."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    wt = new_output((K, N), scales.dtype, qweight.device)
    grid = (cdiv(K // 8, block_r), cdiv(N, block_n))
    launch(w4a16_dequant_kernel, grid, (qweight, scales, zeros, wt, K, N, group_k),
           dict(BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps))
    return wt


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    from tilegemm.core.activations import torch_activation

    wt = dequantize_t(p.qweight, p.scales, p.zeros, p.group_k)
    if p.upcast:  # CPU bf16 matmul is slow and not what the GPU does; fp32 holds every product exactly
        y = torch.matmul(p.x.float(), wt.float())
        if p.bias is not None:
            y = y + p.bias.float()
        if p.activation != "none":
            y = torch_activation(y, p.activation)
        p.out.copy_(y)
        return
    # cuBLAS writes the output in place, the bias added by its epilogue: at M = 4096 on 8192 x 8192 a
    # separate bias pass and a copy into ``out`` each moved 2 x 64 MB more
    if p.bias is not None:
        torch.addmm(p.bias.to(p.x.dtype), p.x, wt, out=p.out)
    else:
        torch.matmul(p.x, wt, out=p.out)
    if p.activation != "none":
        p.out.copy_(torch_activation(p.out.float(), p.activation))
