"""Kernel ``dequant_dot`` of ``grouped_w4a16``: 4-bit experts, dequantized in registers inside the K loop.

Groups of rows are found on the device exactly as in :mod:`tilegemm.ops.grouped.tiled` (a grid bounded by the
row tiles there can be, each program scanning ``offs``). Each K step loads the packed words of its weight tile once,
``[BLOCK_K/8, BLOCK_N]`` int32 (a word holds eight K steps of one column: row ``k // 8``, nibble ``k % 8``;
16-byte vectors along N), unpacks the eight nibbles in registers (``[BLOCK_K/8, 8, BLOCK_N]`` reshaped to
``[BLOCK_K, BLOCK_N]``), dequantizes ``(q - zero) * scale`` in the activations' dtype and feeds ``tl.dot`` with an
fp32 accumulator. The dequantization is bit for bit :func:`tilegemm.ops.w4a16.format.dequantize` (exact in fp32,
rounded once): ``q - zero`` is a small integer, exact in 16 bits, and the 16-bit product of two exact values is
their exact product rounded once. The nibble becomes a 16-bit float without a conversion instruction: OR-ed under
the exponent bits of 1024 (fp16) or 128 (bf16) it is the float ``base + q`` exactly, and ``base + zero`` is taken
away.

``ONE_GROUP`` (BLOCK_K divides the group length, or one group spans K): a step lies in one quantization group,
so it loads one row of scales and zeros, ``[BLOCK_N]``; otherwise each K row's group is gathered. ``SWAP``
(a few rows a program): ``out.T = W @ x.T``, the dequantized weight as the MMA's A operand straight from registers.
``SPLIT_K`` slices K on grid axis 1, reduced as in :mod:`tilegemm.ops.grouped.tiled` (decode steps).
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
from tilegemm.ops.grouped.configs import int4_config, row_tiles
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.tiled import (_pow2, end_slice, find_group_m, split_range, swizzle, workspace,
                                       workspace_launch)


@triton.jit
def unpack_words(words, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [BK/8, BN] -> int32 [BK, BN] of the nibbles 0..15: row 8r + i is nibble i of packed row r."""
    shifts = tl.arange(0, 8) * 4  # [8]
    nibbles = (words[:, None, :] >> shifts[None, :, None]) & 15  # [BK/8, 8, BN]
    return tl.reshape(nibbles, (BLOCK_K, BLOCK_N))


@triton.jit
def dequantize_nibbles(q, s, z, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """``(q - z) * s`` rounded once to DTYPE, as ``format.dequantize`` rounds it: q int32 nibbles [BK, BN], s and
    z in DTYPE ([1, BN] or [BK, BN]). UPCAST (bf16 under the interpreter, whose fp32-to-bf16 cast truncates):
    computed in fp32 (exact), rounded to the nearest bf16 (ties to even) on its bits, returned as fp32."""
    if UPCAST:
        bits = ((q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # the low 16 bits rounded away
        return bits.to(tl.float32, bitcast=True)
    if DTYPE == tl.float16:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
        zb = z + 1024.0  # exact: z is an integer 0..16
    else:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
        zb = z + 128.0
    return (v - zb) * s


@triton.jit
def group_row(s_base, z_base, k0, k_hi, offs_n, ok_n, width, group_k):
    """The scales and zeros of the group holding K step ``k0``, [1, BN] (zeros from ``k_hi`` on: never used)."""
    g = k0 // group_k
    ok = ok_n & (k0 < k_hi)
    s = tl.load(s_base + g * width + offs_n, mask=ok, other=0.0)[None, :]
    z = tl.load(z_base + g * width + offs_n, mask=ok, other=0.0)[None, :]
    return s, z


@triton.jit
def weight_tile(qw_base, s_base, z_base, k0, offs_n, ok_n, K, width, group_k, s, z, DTYPE: tl.constexpr,
                UPCAST: tl.constexpr, ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dequantized tile ``W.T[k0 : k0 + BK, offs_n]`` of one expert, [BK, BN] (zero past K and N). ONE_GROUP:
    ``s`` and ``z`` are the step's group's row, [1, BN]; otherwise each K row's are gathered here."""
    r = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8] packed rows
    words = tl.load(qw_base + r[:, None] * width + offs_n[None, :], mask=(r < K // 8)[:, None] & ok_n[None, :],
                    other=0)  # [BK/8, BN], each word loaded once
    q = unpack_words(words, BLOCK_K, BLOCK_N)  # [BK, BN]
    if not ONE_GROUP:  # groups shorter than the step: each K row's own
        offs_k = k0 + tl.arange(0, BLOCK_K)
        sz = (offs_k // group_k)[:, None] * width + offs_n[None, :]  # [BK, BN]
        ok = (offs_k < K)[:, None] & ok_n[None, :]
        s = tl.load(s_base + sz, mask=ok, other=0.0)
        z = tl.load(z_base + sz, mask=ok, other=0.0)
    return dequantize_nibbles(q, s, z, DTYPE, UPCAST)


@triton.jit
def mma(x, w, acc, UPCAST: tl.constexpr, SWAP: tl.constexpr):
    """acc + x @ w; SWAP: computed as (w.T @ x.T).T, the weight as the MMA's A operand (from registers)."""
    if UPCAST:  # the interpreter's bf16 dot is wrong: multiply fp32 copies there (w is fp32 already)
        return tl.dot(x.to(tl.float32), w, acc)
    if SWAP:
        return tl.trans(tl.dot(tl.trans(w), tl.trans(x), tl.trans(acc)))
    return tl.dot(x, w, acc)


@triton.jit
def grouped_w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, offs_ptr, ws_ptr, count_ptr,
    G, M, N, K, group_k, s_xm, s_om, s_cg, UP,
    GP: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr, ONE_GROUP: tl.constexpr,
):
    # The group and this program's tile in the group's own grid (as in tiled), then its slice of K.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    g, start, m_hi, first_tile, tiles_g = find_group_m(offs_ptr, pid // tiles_n, G, M, GP, BLOCK_M)
    tile_m, tile_n = swizzle(pid - first_tile * tiles_n, tiles_g, tiles_n, GROUP_M)
    m_lo = start + tile_m * BLOCK_M
    live = g < G
    k_lo = 0
    k_hi = tl.where(live, K, 0)  # rows past offs[-1]: zeros
    if SPLIT_K > 1:
        k_lo, k_hi = split_range(k_hi, K, tl.program_id(1), SPLIT_K, BLOCK_K)
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
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * s_xm  # [BM, 1]
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The scales' row of the first step; each step then loads the next step's before its own arithmetic, so
        # the load's latency overlaps a step (Triton pipelines the words and x through shared memory, not these).
        s, z = group_row(s_base, z_base, k_lo, k_hi, offs_n, ok_n, width, group_k)  # [1, BN]
        if GATED:
            s_up, z_up = group_row(s_base, z_base, k_lo, k_hi, offs_n + UP, ok_n, width, group_k)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if ONE_GROUP:
                s_next, z_next = group_row(s_base, z_base, k0 + BLOCK_K, k_hi, offs_n, ok_n, width, group_k)
                if GATED:
                    s_up_next, z_up_next = group_row(s_base, z_base, k0 + BLOCK_K, k_hi, offs_n + UP, ok_n, width,
                                                     group_k)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + offs_k[None, :], mask=ok_m[:, None] & (offs_k < K)[None, :], other=0.0)  # [BM, BK]
            w = weight_tile(qw_base, s_base, z_base, k0, offs_n, ok_n, K, width, group_k, s, z, dt, UPCAST,
                            ONE_GROUP, BLOCK_K, BLOCK_N)
            acc = mma(x, w, acc, UPCAST, SWAP)
            if GATED:
                u = weight_tile(qw_base, s_base, z_base, k0, offs_n + UP, ok_n, K, width, group_k, s_up, z_up, dt,
                                UPCAST, ONE_GROUP, BLOCK_K, BLOCK_N)
                acc_up = mma(x, u, acc_up, UPCAST, SWAP)
            if ONE_GROUP:
                s, z = s_next, z_next
                if GATED:
                    s_up, z_up = s_up_next, z_up_next
        tile_ok = ok_m[:, None] & ok_n[None, :]
        # finish: whether this program runs the epilogue (m_lo < m_hi holds here; the last slice with SPLIT_K)
        finish, acc, acc_up = end_slice(m_lo < m_hi, acc, acc_up if GATED else acc, ws_ptr, count_ptr, pid, M, N,
                                        offs_m, offs_n, tile_ok, GATED, BLOCK_M, BLOCK_N, SPLIT_K)
        if finish:
            if HAS_BIAS:
                c_ok = ok_n & live
                acc += tl.load(bias_ptr + g * s_cg + offs_n, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    acc_up += tl.load(bias_ptr + g * s_cg + UP + offs_n, mask=c_ok,
                                      other=0.0).to(tl.float32)[None, :]
            acc = apply_activation(acc, ACTIVATION)
            if GATED:
                acc = acc * acc_up
            o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


def run(p: GroupedInt4Problem, config: dict | None = None) -> None:
    if p.M == 0 or p.N == 0:
        return
    cfg = dict(config or int4_config(p))
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
    split = cfg.setdefault("SPLIT_K", 1)
    cfg.setdefault("SWAP", False)
    bk = cfg["BLOCK_K"]
    if bk < 16 or bk & (bk - 1) or bk % 8:
        raise ValueError(f"BLOCK_K={bk}: the 4-bit kernel takes a power of two from 16 (whole packed words)")
    cfg["ONE_GROUP"] = p.group_k >= p.K or p.group_k % bk == 0
    tiles = row_tiles(p.M, p.groups, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    ws, count = workspace(p.out, split, p.M, p.N * (2 if p.gated else 1), tiles)
    bias = p.bias if p.bias is not None else p.out
    s_cg = p.bias.stride(0) if p.bias is not None and p.bias.dim() == 2 else 0
    args = (p.x, p.qweight, p.scales, p.zeros, bias, p.out, p.offs, ws, count, p.groups, p.M, p.N, p.K, p.group_k,
            p.x.stride(0), p.out.stride(0), s_cg, p.N if p.gated else 0)
    flags = dict(GP=_pow2(p.groups), HAS_BIAS=p.bias is not None, GATED=p.gated, ACTIVATION=p.activation,
                 UPCAST=interpreting() and p.dtype == torch.bfloat16, **cfg, num_warps=warps, num_stages=stages)
    launch(grouped_w4a16_kernel, (tiles, split), args, flags, **workspace_launch(p.out, split, ws, count))
