"""Kernel ``dequant_dot`` of ``grouped_w4a16``: 4-bit experts, dequantized in registers inside the K loop.

Groups of rows are found on the device exactly as in :mod:`tilegemm.ops.grouped.tiled` (a grid bounded by
``cdiv(M, BLOCK_M) + E`` row tiles, each program scanning ``offs``). Each K step loads the packed words of its
``[BLOCK_K, BLOCK_N]`` weight tile (a word holds eight K steps of one column: row ``k // 8``, nibble ``k % 8``),
the scale and zero of each row's quantization group, forms ``(q - zero) * scale`` exactly in fp32 and rounds it
once to the activations' dtype (bit for bit :func:`tilegemm.ops.w4a16.format.dequantize`), and feeds ``tl.dot``
with an fp32 accumulator.
``GATED`` keeps a second accumulator for the up projection's rows, ``UP`` columns further on, and stores
``activation(gate) * up``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import launch
from tilegemm.core.runtime import cdiv, interpreting
from tilegemm.jit.helpers import apply_activation
from tilegemm.ops.grouped.configs import block_m_for
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.tiled import _pow2, find_group_m, swizzle


@triton.jit
def dequant_tile(qw_base, s_base, z_base, offs_k, offs_n, ok, N, group_k, DTYPE: tl.constexpr):
    """The weight tile ``W.T[offs_k, offs_n]`` of one expert, dequantized to DTYPE (zero where not ``ok``)."""
    words = tl.load(qw_base + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=ok, other=0)
    q = (words >> ((offs_k % 8) * 4)[:, None]) & 15
    sz = (offs_k // group_k)[:, None] * N + offs_n[None, :]
    s = tl.load(s_base + sz, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_base + sz, mask=ok, other=0.0).to(tl.float32)
    return ((q.to(tl.float32) - z) * s).to(DTYPE)  # exact in fp32, rounded once, as dequantize does


@triton.jit
def grouped_w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, offs_ptr,
    G, M, N, K, group_k, s_xm, s_om, s_cg, UP,
    GP: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    g, start, m_hi, first_tile, tiles_g = find_group_m(offs_ptr, pid // tiles_n, G, M, GP, BLOCK_M)
    tile_m, tile_n = swizzle(pid - first_tile * tiles_n, tiles_g, tiles_n, GROUP_M)
    m_lo = start + tile_m * BLOCK_M
    live = g < G
    k_hi = tl.where(live, K, 0)  # rows past offs[-1]: zeros
    g = tl.minimum(g, G - 1).to(tl.int64)
    if (m_lo < m_hi) & (tile_n < tiles_n):
        if GATED:  # the weight's rows: the output's N, twice when gated
            width = 2 * N
        else:
            width = N
        qw_base = qw_ptr + g * (K // 8) * width
        s_base = s_ptr + g * tl.cdiv(K, group_k) * width
        z_base = z_ptr + g * tl.cdiv(K, group_k) * width
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_m = offs_m < m_hi
        ok_n = offs_n < N
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok_k = offs_k < K
            x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * s_xm + offs_k[None, :],
                        mask=ok_m[:, None] & ok_k[None, :], other=0.0)
            ok = ok_k[:, None] & ok_n[None, :]
            w = dequant_tile(qw_base, s_base, z_base, offs_k, offs_n, ok, width, group_k, dt)
            if UPCAST:  # the interpreter's bf16 dot is wrong: multiply fp32 copies there
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(x, w, acc)
            if GATED:
                u = dequant_tile(qw_base, s_base, z_base, offs_k, offs_n + UP, ok, width, group_k, dt)
                if UPCAST:
                    acc_up = tl.dot(x.to(tl.float32), u.to(tl.float32), acc_up)
                else:
                    acc_up = tl.dot(x, u, acc_up)
        if HAS_BIAS:
            c_ok = ok_n & live
            acc += tl.load(bias_ptr + g * s_cg + offs_n, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptr + g * s_cg + UP + offs_n, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc = apply_activation(acc, ACTIVATION)
        if GATED:
            acc = acc * acc_up
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok_m[:, None] & ok_n[None, :])


def choose_config(p: GroupedInt4Problem) -> dict:
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    bm = block_m_for(p.M / max(p.groups, 1))
    return dict(BLOCK_M=bm, BLOCK_N=64 if p.gated else 128, BLOCK_K=64,  # (scales gathered per row: any step)
                GROUP_M=8, num_warps=8 if bm >= 128 else 4, num_stages=3)


def run(p: GroupedInt4Problem, config: dict | None = None) -> None:
    if p.M == 0 or p.N == 0:
        return
    cfg = dict(config or choose_config(p))
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
    grid = ((cdiv(p.M, cfg["BLOCK_M"]) + p.groups) * cdiv(p.N, cfg["BLOCK_N"]),)
    bias = p.bias if p.bias is not None else p.out
    s_cg = p.bias.stride(0) if p.bias is not None and p.bias.dim() == 2 else 0
    args = (p.x, p.qweight, p.scales, p.zeros, bias, p.out, p.offs, p.groups, p.M, p.N, p.K, p.group_k,
            p.x.stride(0), p.out.stride(0), s_cg, p.N if p.gated else 0)
    flags = dict(GP=_pow2(p.groups), HAS_BIAS=p.bias is not None, GATED=p.gated, ACTIVATION=p.activation,
                 UPCAST=interpreting() and p.dtype == torch.bfloat16, **cfg, num_warps=warps, num_stages=stages)
    launch(grouped_w4a16_kernel, grid, args, flags)
