"""The second launch of a K split whose planes are too many for one program to add: ``split_k``'s
reduction apart, and the rule for when it is used (imported by ``split_k`` and by the cost model)."""

from __future__ import annotations

import triton
import triton.language as tl

from tilegemm.core.hardware import sm_count
from tilegemm.core.launch import launch
from tilegemm.jit.helpers import below, epilogue_store, offsets_2d_div
from tilegemm.core.runtime import cdiv


@triton.jit
def split_k_reduce_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_ob, stride_om, stride_on,
    stride_cb, stride_cm, stride_cn,
    stride_bias, stride_sa, stride_sb,
    alpha, beta,
    ws_ptr, count_ptr,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, DIVISORS: tl.constexpr,
    SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PLANES: tl.constexpr = 4,
):
    """The second launch of a split with ``APART``: each program adds one block's SPLIT_K planes and applies
    the epilogue; a small block ``PLANES`` (8 or more) at once, each chunk summed as a fixed tree and the chunks
    in slice order; a large one (``PLANES`` 4) four planes' loads in flight, added in slice order. Either order
    is fixed for a given block and split (deterministic), but the last bits may differ from the in-launch
    reduction's strict slice order. It takes the split kernel's parameter list as it is (A and B unused), so
    both launches are made from one argument tuple. Many small blocks spread the planes' reads over the SMs,
    and many planes in flight keep a long split from waiting out one load latency after another; the
    last-arriving program of the in-launch reduction reads a whole tile's planes alone."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    pid_b = tl.program_id(2).to(tl.int64)
    out_ptr += pid_b * stride_ob
    c_ptr += pid_b * stride_cb
    ws_ptr += pid_b * SPLIT_K * M * N
    DIV_M: tl.constexpr = DIVISORS[8]
    DIV_N: tl.constexpr = DIVISORS[9]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    inside = below(offs_m, M, DIV_M)[:, None] & below(offs_n, N, DIV_N)[None, :]
    planes = ws_ptr + offsets_2d_div(offs_m, offs_n, N, 1, DIV_N, 1)
    plane = M * N
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PLANES >= 8:
        # Small blocks: PLANES planes as one [PLANES, BM, BN] load, summed as a fixed tree.
        chunk = tl.arange(0, PLANES)
        for s in range(0, SPLIT_K, PLANES):
            idx = s + chunk  # [PLANES] slices
            part = tl.load(planes[None, :, :] + (idx * plane)[:, None, None],
                           mask=inside[None, :, :] & (idx < SPLIT_K)[:, None, None], other=0.0, cache_modifier=".cg")
            total += tl.sum(part, axis=0)
    else:
        # Large blocks (their 3-D chunk would hold too many values and addresses): four planes' loads in
        # flight, added one after another.
        for s in range(0, SPLIT_K, 4):
            p0 = tl.load(planes + s * plane, mask=inside, other=0.0, cache_modifier=".cg")
            p1 = tl.load(planes + (s + 1) * plane, mask=inside & (s + 1 < SPLIT_K), other=0.0, cache_modifier=".cg")
            p2 = tl.load(planes + (s + 2) * plane, mask=inside & (s + 2 < SPLIT_K), other=0.0, cache_modifier=".cg")
            p3 = tl.load(planes + (s + 3) * plane, mask=inside & (s + 3 < SPLIT_K), other=0.0, cache_modifier=".cg")
            total += p0
            total += p1
            total += p2
            total += p3
    epilogue_store(total, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                   stride_om, stride_on, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
                   alpha, beta, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, DIVISORS)


# Above this many bytes of fp32 planes for one tile (SPLIT_K x BLOCK_M x BLOCK_N x 4), the planes are added
# by a second launch (split_k_reduce_kernel) instead of the last-arriving program alone, which reads them one
# after another (docs/rungs/split_k.md). Every shipped tuned split reads 64 KB or less.
APART_BYTES = 128 * 1024


def reduce_apart(cfg: dict) -> bool:
    """Whether a split config's planes are added by the second launch (:data:`APART_BYTES`)."""
    return (cfg["SPLIT_K"] > 1 and cfg.get("SLICES", True)
            and cfg["SPLIT_K"] * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 4 > APART_BYTES)


def reduce_block(M: int, N: int, batch: int, sms: int) -> tuple[int, int]:
    """The reduction's block: the largest of 64x64, 32x64, 16x64, 16x32, 8x32 and 4x32 that still gives every
    SM two blocks, else the smallest."""
    for bm, bn in ((64, 64), (32, 64), (16, 64), (16, 32), (8, 32)):
        if cdiv(M, bm) * cdiv(N, bn) * batch >= 2 * sms:
            return bm, bn
    return 4, 32


# Values a thread of the reduction's four warps holds per chunk of planes: 64 (PLANES x BLOCK_M x BLOCK_N /
# 128 threads), at most 32 planes a chunk.
REDUCE_VALUES = 64 * 128


def reduce_planes(split: int, bm: int, bn: int) -> int:
    """How many planes the reduction loads at once for a ``bm`` x ``bn`` block: as many as the split has (a
    power of two, 8 or more), up to 32 and :data:`REDUCE_VALUES` values in flight; 4 (the four-load loop)
    where fewer than 8 would fit (blocks of 32x64 and 64x64) and for splits of at most 4 planes. Those took one
    chunk of 8 planes, 5 of them masked: 800x536 in 3 planes and 16x64 blocks took 14.4 us (H200, ncu), where
    cuBLAS's reduction of its own split took 6.2."""
    if split <= 4:
        return 4
    planes = min(triton.next_power_of_2(split), 32, REDUCE_VALUES // (bm * bn))
    return max(planes, 8) if REDUCE_VALUES // (bm * bn) >= 8 else 4


def launch_reduction(p, ws, count, split: int, stream) -> None:
    """Launch :func:`split_k_reduce_kernel` over problem ``p``'s ``split`` planes in ``ws`` (its block by
    :func:`reduce_block`), on ``stream``; the caller holds :data:`tilegemm.core.launch.sequence_lock` across
    the split's two launches."""
    bm, bn = reduce_block(p.M, p.N, p.batch, sm_count(p.out.device))
    launch(split_k_reduce_kernel, (cdiv(p.M, bm) * cdiv(p.N, bn), 1, p.batch), (*p.kernel_args(), ws, count),
           {**p.kernel_flags(), "SPLIT_K": split, "BLOCK_M": bm, "BLOCK_N": bn,
            "PLANES": reduce_planes(split, bm, bn), "num_warps": 4},
           keep=(ws, count), stream=stream)
