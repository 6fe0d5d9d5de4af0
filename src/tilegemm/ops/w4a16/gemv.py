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

from tilegemm.core.launch import current_stream, launch
from tilegemm.core.runtime import cdiv, interpreting
from tilegemm.ops.w4a16.common import block_k_for, reduce_and_store, workspace
from tilegemm.ops.w4a16.problem import W4A16Problem
from tilegemm.ops.w4a16.configs import gemv_config

import triton.language as tl  # noqa: E402


@triton.jit
def nibble_value(q, i: tl.constexpr, DEQ: tl.constexpr):
    """Nibble ``i`` of every int32 of ``q`` as fp32: ``q_i`` ("i2f", "magic") or ``16 + q_i`` ("exp16")."""
    if DEQ == "exp16" or DEQ == "exp16asm":
        # Move the nibble to mantissa bits 19..22 under the exponent of 16.0: the float is 16 + q_i, exact.
        # One shift and one LOP3 (and, or) per weight, no conversion and no subtraction: the 16 is taken
        # out once per packed row with the zero point (zs = (z + 16) * s), and x * (16 + q) is exact in fp32.
        if 4 * i <= 19:
            v = q << (19 - 4 * i)
        else:
            v = q >> (4 * i - 19)
        if DEQ == "exp16asm":
            # ptxas keeps (v & m) | e as two LOP3s (seen in the sm_90 SASS); one lop3 with the table
            # (a & b) | c = 0xEA does both. Not under the interpreter (the launcher sends "exp16" there).
            v = tl.inline_asm_elementwise("lop3.b32 $0, $1, 7864320, 1098907648, 234;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            v = (v & 0x00780000) | 0x41800000
        w = v.to(tl.float32, bitcast=True)
    elif DEQ == "magic":
        # 2^23 + v as fp32 bits, minus 2^23: integer ops and an FADD instead of an I2F.
        w = (((q >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        w = ((q >> (4 * i)) & 15).to(tl.float32)
    return w


@triton.jit
def x_columns(x0, kx, x_ok, R: tl.constexpr):
    """``x[8r + i]`` for i = 0..7 and every packed row r of a step, as eight [R] vectors, from one 16-byte load
    a row (``[R, 8]``, split in registers) instead of eight strided 2-byte gathers. K is a multiple of 8, so a
    row is whole or absent (``x_ok``)."""
    k = kx[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
    x8 = tl.load(x0 + k, mask=x_ok[:, None], other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x8, (R, 4, 2)))  # [R, 4]: columns 0, 2, 4, 6 and 1, 3, 5, 7
    c04, c26 = tl.split(tl.reshape(even, (R, 2, 2)))  # [R, 2]: columns 0, 4 and 2, 6
    c15, c37 = tl.split(tl.reshape(odd, (R, 2, 2)))
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def load_step(qw_ptr, s_ptr, z_ptr, k0, k_end, rows, offs_n, n_ok, N, K, group_k,
              BLOCK_K: tl.constexpr, DEQ: tl.constexpr):
    """One K step's packed weights [BK/8, BN], scales s [BN] and zero term zs [BN] (all zero past k_end)."""
    r = k0 // 8 + rows
    step_ok = k0 < k_end
    r_ok = (r < K // 8) & step_ok
    q = tl.load(qw_ptr + r[:, None].to(tl.int64) * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0)
    g = k0 // group_k
    sz_ok = n_ok & step_ok
    s = tl.load(s_ptr + g * N + offs_n, mask=sz_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + offs_n, mask=sz_ok, other=0.0).to(tl.float32)
    if DEQ == "exp16" or DEQ == "exp16asm":
        z += 16.0
    return q, s, z * s


@triton.jit
def w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, group_k,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K,
    DEQ: tl.constexpr = "magic", PREFETCH: tl.constexpr = False, ROWS: tl.constexpr = 1,
    XVEC: tl.constexpr = False, STAGES: tl.constexpr = None,
):
    # This program: columns pid_n of rows m0 .. m0 + ROWS - 1, one slice of K (whole BLOCK_K steps).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    m0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    rows = tl.arange(0, BLOCK_K // 8)  # [BK/8] packed rows of one step
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    k_begin = split * per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + per_split * BLOCK_K)
    # Row j of this program reads x row m0 + j; rows past M read zeros and store nothing.
    x0 = x_ptr + m0.to(tl.int64) * stride_xm
    ok0 = m0 < M
    ok1 = m0 + 1 < M
    ok2 = m0 + 2 < M
    ok3 = m0 + 3 < M

    # 2-D throughout ([BK/8, BN] and its row vectors): a 3-D [BM, BK/8, BN] form with several rows of x per
    # program ran far slower (layout conversions per nibble, spills; docs/w4a16.md, "First measurements").
    # Several rows (ROWS) are separate 2-D accumulators sharing each dequantized nibble.
    acc0 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    if ROWS > 1:
        acc1 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    if ROWS > 2:
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        # Non-dot loads are not software-pipelined by Triton (num_stages has no effect here): the next step's
        # weights are loaded into registers before this step's arithmetic, so HBM latency overlaps it.
        q, s, zs = load_step(qw_ptr, s_ptr, z_ptr, k_begin, k_end, rows, offs_n, n_ok, N, K, group_k, BLOCK_K, DEQ)
    # STAGES > 1: Triton's pipeliner copies the loads of the next STAGES - 1 steps into shared memory
    # (cp.async) while this step computes: more bytes in flight than PREFETCH's registers hold, and no
    # registers spent on them (None: the kernel's num_stages decides, which the configs set to 1: the loop as
    # written, loads waited for in place).
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        if PREFETCH:
            q_next, s_next, zs_next = load_step(qw_ptr, s_ptr, z_ptr, k0 + BLOCK_K, k_end, rows, offs_n, n_ok, N,
                                                K, group_k, BLOCK_K, DEQ)
        else:
            q, s, zs = load_step(qw_ptr, s_ptr, z_ptr, k0, k_end, rows, offs_n, n_ok, N, K, group_k, BLOCK_K, DEQ)
        # Per int32, t = sum_i x[8r+i] * w_i and u = sum_i x[8r+i]; then acc += s * t - zs * u.
        kx = k0 + 8 * rows  # [BK/8] the first K index of each packed row
        x_ok = kx < K
        t0 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        u0 = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        if ROWS > 1:
            t1 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            u1 = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        if ROWS > 2:
            t2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            u2 = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
            t3 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            u3 = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        if XVEC:  # one 16-byte load of x a packed row (first row only), not eight 2-byte gathers
            xs = x_columns(x0, kx, x_ok & ok0, BLOCK_K // 8)
        for i in tl.static_range(8):
            w = nibble_value(q, i, DEQ)  # [BK/8, BN]
            if XVEC:
                xi = xs[i]
            else:
                xi = tl.load(x0 + kx + i, mask=x_ok & ok0, other=0.0).to(tl.float32)  # [BK/8]
            t0 += xi[:, None] * w
            u0 += xi
            if ROWS > 1:
                xi = tl.load(x0 + stride_xm + kx + i, mask=x_ok & ok1, other=0.0).to(tl.float32)
                t1 += xi[:, None] * w
                u1 += xi
            if ROWS > 2:
                xi = tl.load(x0 + 2 * stride_xm + kx + i, mask=x_ok & ok2, other=0.0).to(tl.float32)
                t2 += xi[:, None] * w
                u2 += xi
                xi = tl.load(x0 + 3 * stride_xm + kx + i, mask=x_ok & ok3, other=0.0).to(tl.float32)
                t3 += xi[:, None] * w
                u3 += xi
        acc0 += t0 * s[None, :] - u0[:, None] * zs[None, :]
        if ROWS > 1:
            acc1 += t1 * s[None, :] - u1[:, None] * zs[None, :]
        if ROWS > 2:
            acc2 += t2 * s[None, :] - u2[:, None] * zs[None, :]
            acc3 += t3 * s[None, :] - u3[:, None] * zs[None, :]
        if PREFETCH:
            q, s, zs = q_next, s_next, zs_next

    # Each row is its own output tile of the split-K reduction.
    tiles_n = tl.num_programs(0)
    row = m0 + tl.arange(0, 1)  # [1]
    reduce_and_store(tl.sum(acc0, axis=0)[None, :], out_ptr, bias_ptr, ws_ptr, count_ptr, m0 * tiles_n + pid_n,
                     split, row, offs_n, M, N, stride_om, HAS_BIAS, ACTIVATION, SPLIT_K)
    if ROWS > 1:
        reduce_and_store(tl.sum(acc1, axis=0)[None, :], out_ptr, bias_ptr, ws_ptr, count_ptr,
                         (m0 + 1) * tiles_n + pid_n, split, row + 1, offs_n, M, N, stride_om, HAS_BIAS, ACTIVATION,
                         SPLIT_K)
    if ROWS > 2:
        reduce_and_store(tl.sum(acc2, axis=0)[None, :], out_ptr, bias_ptr, ws_ptr, count_ptr,
                         (m0 + 2) * tiles_n + pid_n, split, row + 2, offs_n, M, N, stride_om, HAS_BIAS, ACTIVATION,
                         SPLIT_K)
        reduce_and_store(tl.sum(acc3, axis=0)[None, :], out_ptr, bias_ptr, ws_ptr, count_ptr,
                         (m0 + 3) * tiles_n + pid_n, split, row + 3, offs_n, M, N, stride_om, HAS_BIAS, ACTIVATION,
                         SPLIT_K)


def launch_args(p: W4A16Problem, cfg: dict | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, args, kwargs) of the launch for problem ``p`` (``cfg``: a config to use instead of the table's)."""
    cfg = dict(cfg or gemv_config(p.M, p.N, p.K, p.x.device))
    cfg["BLOCK_K"] = block_k_for(cfg["BLOCK_K"], p.group_k, p.K)
    tiles_n = cdiv(p.N, cfg["BLOCK_N"])
    rows = cfg.setdefault("ROWS", 1)
    if cfg.get("DEQ") == "exp16asm" and interpreting():
        cfg["DEQ"] = "exp16"  # the same arithmetic without inline PTX
    tiles_m = cdiv(p.M, rows) * rows  # the counters cover the rows past M of the last program too
    split = max(1, min(cfg["SPLIT_K"], cdiv(p.K, cfg["BLOCK_K"])))
    cfg["SPLIT_K"] = split
    if split > 1:
        ws, count = workspace(p.x.device, split * p.M * p.N, tiles_m * tiles_n)
    else:
        ws, count = p.out, p.out  # unused
    grid = (tiles_n, split, tiles_m // rows)
    bias = p.bias if p.bias is not None else p.out
    args = (p.x, p.qweight, p.scales, p.zeros, bias, p.out, ws, count, p.M, p.N, p.K, p.group_k,
            p.x.stride(0), p.out.stride(0))
    kwargs = dict(HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, **cfg)
    return grid, args, kwargs


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    grid, args, kwargs = launch_args(p, cfg)
    # With split-K, the workspace (args 6, 7) is the launcher's, made for the current stream: a replay passes it
    # as recorded and declines on another stream.
    split = kwargs["SPLIT_K"] > 1
    launch(w4a16_gemv_kernel, grid, args, kwargs, keep=args[6:8] if split else (),
           stream=current_stream() if split and p.x.is_cuda else None)
