"""Kernel ``gemv``: one row of activations against a 4-bit weight, on the CUDA cores, split along K.

At M = 1 the weight's bytes are the whole cost (8192 x 8192 g128: 34 MB, 8 us at 4.25 TB/s), so the kernel
is built to keep HBM busy:

- Each program takes BLOCK_N columns and one slice of K. It loads ``qweight`` rows ``[BLOCK_K/8, BLOCK_N]``
  (K-major packing: a row is contiguous along N, so a warp's load is 16-byte vectors over 512 bytes), and
  each int32 it holds is eight K steps of its own column: no nibbles move between threads.
- The zero point and scale come out of the inner loop: per int32, ``t = sum_i x[8r+i] * q_i`` and
  ``u = sum_i x[8r+i]``; then ``acc += s * t - (z * s) * u``. That is 4 operations per weight (shift, mask,
  convert, FMA) where dequantizing first costs 6, and at M=1 the CUDA cores, not HBM, would otherwise set
  the pace (one int32 per 4 bytes of HBM traffic feeds 8 weights).
- The accumulator stays ``[BLOCK_K/8, BLOCK_N]`` over the K loop and is summed over its first axis once at
  the end, so the loop has no cross-thread reduction. One row of x per program (``auto`` sends M > 1 to
  ``mma``; a row loop here re-reads the weight from L2).
- Split-K: N = 4096 with 128-column blocks is 32 programs; SPLIT_K slices of K bring the grid to several
  programs per SM (see :mod:`tilegemm.ops.w4a16.configs`). The slices meet in
  :func:`~tilegemm.ops.w4a16.common.reduce_and_store`.
"""

from __future__ import annotations

import triton

from tilegemm.core.launch import launch
from tilegemm.ops.w4a16.common import W4A16Problem, block_k_for, reduce_and_store, workspace
from tilegemm.ops.w4a16.configs import gemv_config

import triton.language as tl  # noqa: E402


@triton.jit
def w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, group_k,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K,
    MAGIC: tl.constexpr = False,
):
    # This program: columns pid_n of row m, one slice of K (whole BLOCK_K steps).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    rows = tl.arange(0, BLOCK_K // 8)  # [BK/8] packed rows of one step
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    k_begin = split * per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + per_split * BLOCK_K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm

    # 2-D throughout ([BK/8, BN] and its row vectors): a 3-D [BM, BK/8, BN] form with several rows of x per
    # program ran 2-100x slower on an H100 (layout conversions per nibble, spills at BM=4; results of f93179c).
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Packed weights [BK/8, BN] and this step's group row of scales and zeros [BN].
        r = k0 // 8 + rows
        r_ok = r < K // 8
        q = tl.load(qw_ptr + r[:, None].to(tl.int64) * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :],
                    other=0)
        g = k0 // group_k
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        zs = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32) * s
        t = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        u = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_row + 8 * r + i, mask=r_ok, other=0.0).to(tl.float32)  # [BK/8]
            if MAGIC:
                # 2^23 + v as fp32 bits, minus 2^23: integer ops and an FADD instead of an I2F.
                qi = (((q >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            else:
                qi = ((q >> (4 * i)) & 15).to(tl.float32)  # [BK/8, BN]
            t += xi[:, None] * qi
            u += xi
        acc += t * s[None, :] - u[:, None] * zs[None, :]

    total = tl.sum(acc, axis=0)[None, :]  # [1, BN]
    tile = m * tl.num_programs(0) + pid_n
    offs_m = m + tl.arange(0, 1)
    reduce_and_store(total, out_ptr, bias_ptr, ws_ptr, count_ptr, tile, split, offs_m, offs_n, M, N, stride_om,
                     HAS_BIAS, ACTIVATION, SPLIT_K)


def launch_args(p: W4A16Problem, cfg: dict | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, args, kwargs) of the launch for problem ``p`` (``cfg``: a config to use instead of the table's)."""
    cfg = dict(cfg or gemv_config(p.M, p.N, p.K, p.x.device))
    cfg["BLOCK_K"] = block_k_for(cfg["BLOCK_K"], p.group_k, p.K)
    tiles_n = triton.cdiv(p.N, cfg["BLOCK_N"])
    tiles_m = p.M  # one row of x per program: M > 1 belongs to mma
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(p.K, cfg["BLOCK_K"])))
    cfg["SPLIT_K"] = split
    if split > 1:
        ws, count = workspace(p.x.device, split * p.M * p.N, tiles_m * tiles_n)
    else:
        ws, count = p.out, p.out  # unused
    grid = (tiles_n, split, tiles_m)
    bias = p.bias if p.bias is not None else p.out
    args = (p.x, p.qweight, p.scales, p.zeros, bias, p.out, ws, count, p.M, p.N, p.K, p.group_k,
            p.x.stride(0), p.out.stride(0))
    kwargs = dict(HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, **cfg)
    return grid, args, kwargs


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    grid, args, kwargs = launch_args(p, cfg)
    launch(w4a16_gemv_kernel, grid, args, kwargs)
