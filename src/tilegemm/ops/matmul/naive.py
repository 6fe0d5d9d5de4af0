"""Rung 1, ``naive``: the textbook tile kernel.

One program per [BLOCK_M, BLOCK_N] output tile, launched in row-major order: program ``p`` computes tile
``(p // tiles_n, p % tiles_n)``. Fixed block sizes, no tuning. Everything the later rungs add is measured
against this one.
"""

import triton

from tilegemm.jit.helpers import epilogue_store, tile_row_major
from tilegemm.core.launch import launch
from tilegemm.ops.matmul.configs import fixed_config
from tilegemm.ops.matmul.mainloop import dot_k_loop, tile_rows_cols
from tilegemm.ops.matmul.problem import GemmProblem

import triton.language as tl  # noqa: E402
from tilegemm.core.runtime import cdiv


@triton.jit
def matmul_naive_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_ob, stride_om, stride_on,
    stride_cb, stride_cm, stride_cn,
    stride_bias, stride_sa, stride_sb,
    alpha, beta,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, DIVISORS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Which tile: row-major over the [tiles_m, tiles_n] grid; axis 1 is the batch.
    pid_m, pid_n = tile_row_major(tl.program_id(0), tl.cdiv(N, BLOCK_N))
    pid_b = tl.program_id(1).to(tl.int64)
    a_ptr += pid_b * stride_ab
    b_ptr += pid_b * stride_bb
    out_ptr += pid_b * stride_ob
    c_ptr += pid_b * stride_cb

    # Accumulate A[rows, :] @ B[:, cols] in fp32.
    offs_m, offs_n, load_m, load_n = tile_rows_cols(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, INDEX_64, DIVISORS)
    acc = dot_k_loop(a_ptr, b_ptr, 0, K, stride_am, stride_ak, stride_bk, stride_bn, load_m, load_n,
                     BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST, MMA_OPERANDS, FAST_ACCUM, DIVISORS)

    # Epilogue: scale, add c and bias, activate, store.
    epilogue_store(acc, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                   stride_om, stride_on, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
                   alpha, beta, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, DIVISORS)


def run(p: GemmProblem, config: dict | None = None) -> None:
    cfg = dict(config or fixed_config(p.dtype))
    cfg.pop("GROUP_M", None)
    grid = (cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"]), p.batch)
    launch(matmul_naive_kernel, grid, p.kernel_args(), {**p.kernel_flags(), **cfg})
