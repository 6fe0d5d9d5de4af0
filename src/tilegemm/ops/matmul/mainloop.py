"""The K loop that every tile-per-program GEMM rung shares.

A program owns one [BLOCK_M, BLOCK_N] output tile; this loop walks its range of K in steps of BLOCK_K,
loading a [BLOCK_M, BLOCK_K] tile of A and a [BLOCK_K, BLOCK_N] tile of B through their strides (any
layout) and accumulating their product in fp32. The rungs differ in which tile a program gets, which
part of K (``split_k`` takes a slice) and how they are tuned, not in this loop.
"""

from tilegemm.jit.helpers import below, mma_ordered, offsets_2d_div
from tilegemm.core.runtime import ensure_backend

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def tile_rows_cols(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr,
                   DIVISORS: tl.constexpr):
    """Row and column indices of a tile: exact ones for the store, wrapped ones for the loads.

    Wrapping out-of-range rows/columns back into the matrix keeps A/B loads unmasked along M and N (the
    extra rows are computed and then dropped by the store's mask). A wrapped tile is contiguous only in
    runs that end where M (or N) ends: the hints claim runs of the largest power of two dividing M (N), at
    most the tile. Claiming whole tiles is wrong when an operand is contiguous along M (N) and M (N) is not
    a multiple of the vector width: at 257 rows the run [256, 0, 1, ...] would be read as 256..263 and
    the next vector would start at row 7, a misaligned 16-byte load on the GPU.
    """
    RUN_M: tl.constexpr = min(BLOCK_M, DIVISORS[8])
    RUN_N: tl.constexpr = min(BLOCK_N, DIVISORS[9])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    load_m = tl.max_contiguous(tl.multiple_of(offs_m % M, RUN_M), RUN_M)
    load_n = tl.max_contiguous(tl.multiple_of(offs_n % N, RUN_N), RUN_N)
    return offs_m, offs_n, load_m, load_n


@triton.jit
def dot_k_loop(
    a_ptr, b_ptr, k_begin, k_end,
    stride_am, stride_ak, stride_bk, stride_bn,
    load_m, load_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, DIVISORS: tl.constexpr,
):
    """``A[rows, k_begin:k_end] @ B[k_begin:k_end, cols]`` in fp32, as a [BLOCK_M, BLOCK_N] tile.

    ``MMA_OPERANDS`` says how the operands meet the tensor cores (see
    :func:`tilegemm.ops.matmul.problem.mma_operands`): ``"ab"`` as loaded; ``"reg_a"`` with the A tile
    passed through registers; ``"swap"`` computing the transposed tile ``B^T @ A^T`` with the B^T tile in
    registers, transposed back at the end.

    ``DIVISORS`` (:attr:`tilegemm.ops.matmul.problem.GemmProblem.divisors`) lets Triton vectorize the loads
    where a leading dimension or K is a multiple of 2, 4 or 8 elements but not of 16. ``k_begin`` must be
    a multiple of BLOCK_K, and ``k_end`` either K or ``k_begin`` plus a multiple of BLOCK_K.
    """
    DIV_AM: tl.constexpr = DIVISORS[0]
    DIV_AK: tl.constexpr = DIVISORS[1]
    DIV_BK: tl.constexpr = DIVISORS[2]
    DIV_BN: tl.constexpr = DIVISORS[3]
    DIV_K: tl.constexpr = DIVISORS[10]
    offs_k = tl.arange(0, BLOCK_K)
    SWAP: tl.constexpr = MMA_OPERANDS == "swap"
    if SWAP:
        a_ptrs = a_ptr + offsets_2d_div(k_begin + offs_k, load_m, stride_ak, stride_am, DIV_AK, DIV_AM)  # [BK, BM]
        b_ptrs = b_ptr + offsets_2d_div(load_n, k_begin + offs_k, stride_bn, stride_bk, DIV_BN, DIV_BK)  # [BN, BK]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a_ptrs = a_ptr + offsets_2d_div(load_m, k_begin + offs_k, stride_am, stride_ak, DIV_AM, DIV_AK)  # [BM, BK]
        b_ptrs = b_ptr + offsets_2d_div(k_begin + offs_k, load_n, stride_bk, stride_bn, DIV_BK, DIV_BN)  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        in_k = below(offs_k, k_end - k, DIV_K)
        if SWAP:
            a = tl.load(a_ptrs, mask=in_k[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None], other=0.0)
        if UPCAST:
            # Triton 3.6's interpreter computes bf16 dots wrongly; fp32 dots there are exact.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP:  # the tiles were loaded transposed; mma_ordered takes them as [BM, BK] and [BK, BN]
            a = a.T
            b = b.T
        acc = mma_ordered(a, b, acc, MMA_OPERANDS, INPUT_PRECISION, FAST_ACCUM)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SWAP:
        acc = tl.trans(acc)
    return acc

