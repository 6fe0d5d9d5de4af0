"""Launch configs of the W4A16 kernels: a small table keyed by M bucket, the number of K slices computed
from the grid and the GPU's SM count. No timing on the call path.

The tables come from tools/w4a16_gpu_check.py runs (see docs/w4a16.md for the measurements).
"""

from __future__ import annotations

from tilegemm.core.hardware import sm_count
from tilegemm.core.tuning import m_bucket


def split_for(tiles: int, steps: int, sms: int, programs_per_sm: int, min_steps: int) -> int:
    """K slices (a power of two) so that ``tiles * split`` reaches ``programs_per_sm * sms`` programs while
    each slice keeps at least ``min_steps`` BLOCK_K steps."""
    split = 1
    while tiles * split < programs_per_sm * sms and steps // (2 * split) >= min_steps:
        split *= 2
    return split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# gemv: (BLOCK_N, BLOCK_K, num_warps, programs per SM, min steps per slice) by M bucket.
_GEMV = {1: (128, 128, 4, 8, 2), 2: (128, 128, 4, 8, 2), 4: (128, 128, 4, 8, 2)}


def gemv_config(M: int, N: int, K: int, device) -> dict:
    bm = min(m_bucket(M), 4)
    bn, bk, warps, per_sm, min_steps = _GEMV[bm]
    tiles = _cdiv(N, bn) * _cdiv(M, bm)
    split = split_for(tiles, _cdiv(K, bk), sm_count(device), per_sm, min_steps)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=1)


# mma: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM, min steps per slice) by M bucket.
_MMA = {
    16: (16, 64, 128, 4, 4, 4, 2),
    32: (32, 64, 128, 4, 4, 4, 2),
    64: (64, 64, 128, 4, 4, 2, 4),
    128: (64, 128, 64, 4, 4, 2, 4),
    256: (128, 128, 64, 8, 4, 1, 8),
}


def mma_config(M: int, N: int, K: int, device) -> dict:
    bm, bn, bk, warps, stages, per_sm, min_steps = _MMA[min(max(m_bucket(M), 16), 256)]
    tiles = _cdiv(M, bm) * _cdiv(N, bn)
    split = split_for(tiles, _cdiv(K, bk), sm_count(device), per_sm, min_steps)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, num_warps=warps, num_stages=stages)


# auto: the kernel per M bucket (up to and including the bound).
GEMV_MAX_M = 4
MMA_MAX_M = 1 << 30  # dequant_cublas is not picked unless measured faster


def choose(M: int) -> str:
    if M <= GEMV_MAX_M:
        return "gemv"
    if M <= MMA_MAX_M:
        return "mma"
    return "dequant_cublas"
