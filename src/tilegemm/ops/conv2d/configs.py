"""Block sizes, warps and pipeline depths for the conv2d kernels: a small table by shape class, no timing.

Every config is a plain dict of the kernel's constexprs plus ``num_warps``/``num_stages``. Under the
interpreter the tiles are small enough that tests cross tile edges, and few enough that they run in seconds
(the interpreter's cost is per program and loop step, nearly whatever the block size).
"""

from __future__ import annotations

import torch

from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d.problem import Geometry


def _cfg(bm, bn, bk, warps, stages, group_m=8, **extra) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages, **extra)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n, clamped to [lo, hi]."""
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def _gemm_tile(M: int, N: int, K_inner: int, dtype: torch.dtype) -> dict:
    """A tile for an implicit GEMM of M rows (pixels), N columns (channels) and a K loop whose inner step walks
    ``K_inner`` contiguous channels. 16-bit: 64-wide K steps where the channels allow (16-byte loads, full
    wgmma K); fp32 takes twice the shared memory per element, so 32-wide ones."""
    wide = 2 if dtype == torch.float32 else 1
    bk = _pow2_at_least(K_inner, 16, 64 // wide)
    bn = _pow2_at_least(N, 16, 128)
    bm = 128 if M >= 4096 else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 3 if wide == 2 else 4
    return _cfg(bm, bn, bk, warps, stages)


def forward_config(g: Geometry, dtype: torch.dtype) -> dict:
    """Implicit-GEMM forward. With fewer than 16 channels per group (the stem's C=3) the K loop walks
    (r, s, c) as one flat index, so a 7x7x3 filter takes three 64-wide steps instead of 49 mostly-masked ones."""
    flat = g.Cg < 16
    if interpreting():
        return _cfg(64, 32, 16, 4, 1, FLAT_K=flat)
    M = g.N * g.P * g.Q
    cfg = _gemm_tile(M, g.Kg, 32 if flat else g.Cg, dtype)
    if flat:
        # every element of the [BM, BK] tile computes its own (r, s, c) and address: with 4 warps the 7x7x3
        # stem spilled 1.2 KB a thread (ptxas, sm_90, 128x64x64 fp16); 8 warps and BK=32 halve the per-thread share
        cfg["num_warps"] = 8
    cfg["FLAT_K"] = flat
    return cfg


def dgrad_config(g: Geometry, dtype: torch.dtype) -> dict:
    """Data gradient: M = N*H*W input pixels, N = C/groups, the K loop over (r, s, K/groups)."""
    if interpreting():
        return _cfg(64, 32, 16, 4, 1)
    return _gemm_tile(g.N * g.H * g.W, g.Cg, g.Kg, dtype)


def wgrad_config(g: Geometry, dtype: torch.dtype, sms: int) -> dict:
    """Weight gradient: a [K/groups, C/groups] tile per (r, s, group), the K loop over N*P*Q pixels, split
    over ``SPLIT`` programs (fp32 partial tiles, added in order by the last to arrive) so that small filters
    still fill the GPU."""
    if interpreting():
        cfg = _cfg(32, 32, 64, 4, 1)
    else:
        wide = 2 if dtype == torch.float32 else 1
        bm = _pow2_at_least(g.Kg, 16, 128)
        bn = _pow2_at_least(g.Cg, 16, 128)
        # 8 warps: its pointer tiles run along the pixels (no contiguity), and with 4 warps the 64x64 fp16 tile
        # spilled (ptxas, sm_90)
        cfg = _cfg(bm, bn, 64 // wide, 8, 3 if wide == 2 else 4)
    tiles = -(-g.Kg // cfg["BLOCK_M"]) * -(-g.Cg // cfg["BLOCK_N"]) * g.R * g.S * g.groups
    pixels = g.N * g.P * g.Q
    # Enough programs for two waves, but each slice at least 8 K steps long (fewer and the partial sums cost
    # more memory traffic than they save).
    want = max(1, -(-2 * sms // tiles))
    most = max(1, pixels // (8 * cfg["BLOCK_K"]))
    cfg["SPLIT"] = min(want, most, 64)
    return cfg


def depthwise_config(g: Geometry, dtype: torch.dtype) -> dict:
    """Direct depthwise kernel: a [BLOCK_M pixels, BLOCK_N channels] tile, channels contiguous."""
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    bn = _pow2_at_least(g.K, 16, 64)
    return dict(BLOCK_M=64 if bn == 64 else 128, BLOCK_N=bn, num_warps=4, num_stages=2)
