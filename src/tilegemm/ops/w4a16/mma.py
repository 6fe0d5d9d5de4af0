"""Kernel ``mma``: tensor-core GEMM with the 4-bit weight dequantized in registers, split along K when the
output has too few tiles to fill the GPU.

Per K step a program loads ``x`` ``[BLOCK_M, BLOCK_K]`` and packed weights ``[BLOCK_K/8, BLOCK_N]`` (16-byte
vectors along N), unpacks each int32 into its eight K rows (``[BLOCK_K/8, 8, BLOCK_N]`` reshaped to
``[BLOCK_K, BLOCK_N]``: row ``8r + i`` is nibble ``i`` of packed row ``r``), dequantizes in the activations'
dtype, ``(q - z) * s`` (exactly :func:`~tilegemm.ops.w4a16.format.dequantize`'s rounding), and feeds
``tl.dot``. BLOCK_K divides the group length, so a step needs one row of scales and zeros (``UNPACK="perm"``
excepted: its steps are 128 or more, and a step that spans groups reads them per packed row).
"""

from __future__ import annotations

import triton

from tilegemm.core.launch import current_stream, launch
from tilegemm.jit.helpers import tile_grouped
from tilegemm.ops.w4a16.common import block_k_for, reduce_and_store, workspace
from tilegemm.ops.w4a16.problem import W4A16Problem
from tilegemm.ops.w4a16.configs import mma_config

import triton.language as tl  # noqa: E402
from tilegemm.core.runtime import cdiv


@triton.jit
def unpack_tile(q, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [BK/8, BN] -> int32 [BK, BN] of 4-bit values, row 8r + i being nibble i of row r."""
    shifts = tl.arange(0, 8) * 4  # [8]
    nibbles = (q[:, None, :] >> shifts[None, :, None]) & 15  # [BK/8, 8, BN]
    return tl.reshape(nibbles, (BLOCK_K, BLOCK_N))


@triton.jit
def dequant_nibble(q, i: tl.constexpr, zm, s, dt: tl.constexpr, UPCAST: tl.constexpr, DEQ16: tl.constexpr):
    """Nibble ``i`` of every int32 of ``q`` dequantized, ``(q_i - z) * s``, rounded once to ``dt`` as
    :func:`~tilegemm.ops.w4a16.format.dequantize` rounds it. ``zm`` is the zero point, plus the magic base for
    ``DEQ16="magic"``: the nibble OR-ed under the exponent bits of 1024 (fp16) or 128 (bf16) is the 16-bit
    float ``base + q_i`` exactly, with no int-to-float conversion (a quarter-rate instruction on Hopper);
    ``(base + q_i) - (base + z)`` is then exact too."""
    qi = (q >> (4 * i)) & 15
    if UPCAST:
        # bf16 under the interpreter: in fp32 (exact), rounded to bf16 as the GPU does, returned as fp32.
        w = ((qi.to(tl.float32) - zm.to(tl.float32)) * s.to(tl.float32)).to(dt).to(tl.float32)
    elif DEQ16 == "magic":
        if dt == tl.float16:
            v = (qi | 0x6400).to(tl.int16).to(dt, bitcast=True)
        else:
            v = (qi | 0x4300).to(tl.int16).to(dt, bitcast=True)
        w = (v - zm) * s
    else:
        w = (qi.to(dt) - zm) * s
    return w


@triton.jit
def magic_zeros(z, dt: tl.constexpr, UPCAST: tl.constexpr, DEQ16: tl.constexpr):
    """The zero points as :func:`dequant_nibble` takes them: plus the magic base (1024 for fp16, 128 for bf16;
    exact, zeros are integers 0..16) where it dequantizes by the magic exponent, as they are otherwise."""
    if DEQ16 == "magic" and not UPCAST:
        if dt == tl.float16:
            z = z + 1024.0
        else:
            z = z + 128.0
    return z


@triton.jit
def mma_perm_loop(acc, x_rows, m_ok, qw_ptr, s_ptr, z_ptr, offs_n, n_ok, N, K, group_k, k_begin, k_end,
                  UPCAST: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, DEQ16: tl.constexpr,
                  GROUP_ROWS: tl.constexpr):
    """The K loop of ``UNPACK="perm"``: no unpacking at all. A dot does not care in which order it walks K,
    so a step of packed rows ``r`` is eight dots of K = BLOCK_K/8, one per nibble ``i``: the weights
    ``w[8r + i, n]`` (nibble ``i`` of ``q[r, n]``, dequantized where the int32 already sits) against the
    activations ``x[m, 8r + i]`` (columns 8 apart). The ``[BK/8, 8, BN] -> [BK, BN]`` reshape, and the
    layout conversion it costs, never happen. ``GROUP_ROWS``: a step spans several groups (group shorter
    than BLOCK_K), so scales and zeros are loaded per packed row."""
    dt = x_rows.dtype.element_ty
    rows = tl.arange(0, BLOCK_K // 8)  # [BK/8]
    for k0 in range(k_begin, k_end, BLOCK_K):
        r = k0 // 8 + rows
        r_ok = r < K // 8
        q = tl.load(qw_ptr + r[:, None].to(tl.int64) * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :],
                    other=0)  # [BK/8, BN]
        if GROUP_ROWS:
            sz = (8 * r // group_k)[:, None] * N + offs_n[None, :]  # [BK/8, BN]
            s = tl.load(s_ptr + sz, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            zm = tl.load(z_ptr + sz, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        else:
            g = k0 // group_k
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)[None, :]  # [1, BN]
            zm = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)[None, :]
        zm = magic_zeros(zm, dt, UPCAST, DEQ16)
        kx = 8 * r  # [BK/8] the first K index of each packed row
        x_ok = m_ok[:, None] & r_ok[None, :]
        for i in tl.static_range(8):
            xi = tl.load(x_rows + (kx + i)[None, :], mask=x_ok, other=0.0)  # [BM, BK/8]
            wi = dequant_nibble(q, i, zm, s, dt, UPCAST, DEQ16)  # [BK/8, BN]
            if UPCAST:
                acc = tl.dot(xi.to(tl.float32), wi, acc, input_precision="ieee")
            elif SWAP:
                # out.T = W @ x.T: the dequantized weights are wgmma's A operand, taken from registers.
                acc = tl.trans(tl.dot(tl.trans(wi), tl.trans(xi), tl.trans(acc)))
            else:
                acc = tl.dot(xi, wi, acc)
    return acc


@triton.jit
def w4a16_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, group_k,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K, UNPACK: tl.constexpr = "reshape", SWAP: tl.constexpr = False, DEQ16: tl.constexpr = "cvt",
    GROUP_ROWS: tl.constexpr = False,
):
    # Which output tile (grouped order, so programs running together share x rows and weight columns in L2)
    # and which slice of K.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    pid_m, pid_n = tile_grouped(tile, tiles_m, tiles_n, GROUP_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    k_begin = split * per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + per_split * BLOCK_K)
    dt = x_ptr.dtype.element_ty

    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if UNPACK == "perm":
        acc = mma_perm_loop(acc, x_rows, m_ok, qw_ptr, s_ptr, z_ptr, offs_n, n_ok, N, K, group_k, k_begin, k_end,
                            UPCAST, BLOCK_K, SWAP, DEQ16, GROUP_ROWS)
    else:
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
            x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
            if UNPACK == "gather":
                # Each of the eight rows of a packed row loads the same int32 (L1 serves the repeats).
                q = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=(offs_k[:, None] < K) & n_ok[None, :], other=0)  # [BK, BN]
                q = (q >> ((offs_k % 8) * 4)[:, None]) & 15
            else:
                r = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8]
                q = tl.load(qw_ptr + r[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=(r[:, None] < K // 8) & n_ok[None, :], other=0)  # [BK/8, BN]
                q = unpack_tile(q, BLOCK_K, BLOCK_N)
            g = k0 // group_k
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)  # [BN]
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)
            # [BK, BN], dequantized (q holds one nibble per element: nibble 0)
            w = dequant_nibble(q, 0, magic_zeros(z, dt, UPCAST, DEQ16)[None, :], s[None, :], dt, UPCAST, DEQ16)
            if UPCAST:
                # bf16 under the interpreter, whose int-to-bf16 casts and bf16 dots are wrong: dequantized in fp32
                # (exact) and rounded to bf16 as the GPU path does, multiplied in fp32 (exact for bf16 values).
                x = x.to(tl.float32)
            if SWAP:
                # out.T = W @ x.T: the dequantized weights are wgmma's A operand, taken from registers.
                acc_t = tl.dot(tl.trans(w), tl.trans(x), tl.trans(acc), input_precision="ieee" if UPCAST else None)
                acc = tl.trans(acc_t)
            else:
                acc = tl.dot(x, w, acc, input_precision="ieee" if UPCAST else None)

    reduce_and_store(acc, out_ptr, bias_ptr, ws_ptr, count_ptr, tile, split, offs_m, offs_n, M, N, stride_om,
                     HAS_BIAS, ACTIVATION, SPLIT_K)


def launch_args(p: W4A16Problem, cfg: dict | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, args, kwargs) of the launch for problem ``p`` (``cfg``: a config to use instead of the table's)."""
    cfg = dict(cfg or mma_config(p.M, p.N, p.K, p.x.device))
    if cfg.get("UNPACK") == "perm":
        # Eight dots of K = BLOCK_K/8 a step (at least 16); a step that spans groups reads scales per row.
        if cfg["BLOCK_K"] < 128:
            raise ValueError(f"UNPACK='perm' needs BLOCK_K >= 128 (eight dots of K = BLOCK_K/8 >= 16), got "
                             f"{cfg['BLOCK_K']}")
        cfg["GROUP_ROWS"] = p.group_k < p.K and p.group_k % cfg["BLOCK_K"] != 0
    else:
        cfg["BLOCK_K"] = block_k_for(cfg["BLOCK_K"], p.group_k, p.K)
    tiles = cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    split = max(1, min(cfg["SPLIT_K"], cdiv(p.K, cfg["BLOCK_K"])))
    cfg["SPLIT_K"] = split
    if split > 1:
        ws, count = workspace(p.x.device, split * p.M * p.N, tiles)
    else:
        ws, count = p.out, p.out  # unused
    bias = p.bias if p.bias is not None else p.out
    args = (p.x, p.qweight, p.scales, p.zeros, bias, p.out, ws, count, p.M, p.N, p.K, p.group_k,
            p.x.stride(0), p.out.stride(0))
    kwargs = dict(HAS_BIAS=p.bias is not None, ACTIVATION=p.activation, UPCAST=p.upcast, **cfg)
    return (tiles, split), args, kwargs


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    grid, args, kwargs = launch_args(p, cfg)
    # With split-K, the workspace (args 6, 7) is the launcher's, made for the current stream: a replay passes it
    # as recorded and declines on another stream.
    split = kwargs["SPLIT_K"] > 1
    launch(w4a16_mma_kernel, grid, args, kwargs, keep=args[6:8] if split else (),
           stream=current_stream() if split and p.x.is_cuda else None)
