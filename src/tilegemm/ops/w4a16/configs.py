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


# gemv (M = 1): 128 K per step, 4 warps, the exponent trick in inline assembly (DEQ="exp16asm"), the next step's
# weights loaded before this step's arithmetic (PREFETCH), x's eight values of a packed row in one load (XVEC).
# Timed with the L2 cleared before each call (research/explore_w4a16_small_m.py, H200, g128 fp16,
# benchmarks/results/2026-11-24-h200/066a2a5/): the kernel issues about six instructions per weight, so it is
# bound by issue slots rather than HBM (ncu: 55% issue, 33% DRAM at 8192 x 8192), and two things set its speed:
# - columns per thread: 128-column tiles spread the per-row work (x, its sums) over twice the weights of 64;
#   they win where N gives at least 64 of them (8192 x 8192: 19.8 us against 21.6; 28672 x 8192: 55.0 / 58.3),
#   64 columns below (4096 x 4096: 8.1 us against 9.4);
# - one wave: a split that makes more programs than the SMs hold at once (7 of these per SM at 72 registers)
#   leaves a partial second wave (8192 x 8192, 64 columns, 1024 programs: 22.7 us; 512 programs: 21.6 us).
#   K is split in powers of two up to GEMV_PROGRAMS_PER_SM programs per SM, each slice at least two steps.
# cuBLAS fp16 at M=1 on the same runs: 47.0, 124.0, 16.4 us. Before this rule (64 columns, 6 programs per SM)
# 8192 x 8192 and 4096 x 4096 ran 22.7 and 10.6 us; the first, 3-D form of this kernel 45 us (f93179c).
GEMV_WIDE_N = 8192  # from this N on, 128-column tiles
GEMV_PROGRAMS_PER_SM = 7
_GEMV = (128, 4, 2, "exp16asm", True)  # BK, num_warps, min steps per slice, DEQ, PREFETCH


def split_within(tiles: int, steps: int, capacity: int, min_steps: int) -> int:
    """The largest power-of-two K split with ``tiles * split <= capacity`` programs and at least ``min_steps``
    steps a slice (1 if even that is too many)."""
    split = 1
    while tiles * split * 2 <= capacity and steps // (2 * split) >= min_steps:
        split *= 2
    return split


def gemv_config(M: int, N: int, K: int, device, rows: int = 1) -> dict:
    bk, warps, min_steps, deq, prefetch = _GEMV
    bn = 128 if N >= GEMV_WIDE_N else 64
    tiles = _cdiv(N, bn) * _cdiv(M, rows)
    split = split_within(tiles, _cdiv(K, bk), GEMV_PROGRAMS_PER_SM * sm_count(device), min_steps)
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, DEQ=deq, PREFETCH=prefetch, ROWS=rows, XVEC=rows == 1,
                num_warps=warps, num_stages=1)


# mma: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP, programs per SM, min steps per slice) by M
# bucket. H100, 8192 x 8192 g128 fp16 (same results): M=16 best 16x64x128, 3 stages, the weights as the MMA's
# A operand (SWAP), 4 slices: 42.5 us (1.41x cuBLAS; 43.6 us without SWAP); M=64 64x128x128, 3 stages, 4
# slices: 53.8 us (1.13x); M=256 128x128x128, 8 warps, 2 slices: 156 us (0.42x); M=4096 256x128x64: 0.43x.
# The gather unpacking (eight loads of each int32) never won; BLOCK_N=256 and 128x128x128 with 4 stages run
# out of shared memory. H200 with the L2 cleared (2026-11-24-h200/b1bfe98/): at M=4 and 16, 128 columns with the
# magic-exponent dequantization (DEQ16, the same 512 programs: 2 per SM) ran 38.0 / 39.2 us at 8192 x 8192 and
# 123.4 / 124.0 at 28672 x 8192, against 40.9 / 41.9 and 125.0 / 125.6 for the 64-column conversion config;
# 128 columns with the conversion ran 156 us at 28672 x 8192 (2026-11-24-h200/b305fb8/): the two go together.
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP, programs per SM, min steps per slice, DEQ16)
_MMA = {
    16: (16, 128, 128, 4, 3, True, 2, 2, "magic"),
    32: (32, 64, 128, 4, 3, True, 4, 2, "cvt"),
    64: (64, 128, 128, 4, 3, False, 2, 4, "cvt"),
    128: (64, 128, 128, 4, 3, False, 2, 4, "cvt"),
    256: (128, 128, 128, 8, 3, False, 1, 8, "cvt"),
    1024: (128, 128, 64, 8, 4, False, 1, 8, "cvt"),
}


def mma_config(M: int, N: int, K: int, device) -> dict:
    bucket = max(b for b in _MMA if b <= max(m_bucket(M), 16))
    bm, bn, bk, warps, stages, swap, per_sm, min_steps, deq16 = _MMA[bucket]
    tiles = _cdiv(M, bm) * _cdiv(N, bn)
    split = split_for(tiles, _cdiv(K, bk), sm_count(device), per_sm, min_steps)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, SWAP=swap, num_warps=warps,
                num_stages=stages, DEQ16=deq16)


# frag (weights pre-shuffled into MMA fragments): 4 warps, 64 x RH rows a program, K steps of 64, one step of
# weights in flight, x's rows in 8 (M <= 8) or 16 columns. H200, g128 fp16, the L2 cleared before each call
# (research/explore_w4a16_frag.py, benchmarks/results/2026-11-24-h200/8fb94d3/): the best configs keep about
# four programs per SM at M <= 8 (3.4-3.9; 7 was 3-20% slower, 2 up to 25% slower at M=1) and about two at
# M=16 (8192^2: 31.5 us against 38+ with four), 256-row programs from N = 8192 on (128 below); a second step
# in flight (DEPTH=2) or 128-long steps (KH=2) were within 5% either way. Measured at M = 1, 4, 16 on 4096^2,
# 8192^2 and 28672 x 8192.
FRAG_WIDE_N = 8192
FRAG_PROGRAMS_PER_SM = (4, 2)  # M <= 8, M > 8


def frag_config(M: int, N: int, K: int, device) -> dict:
    rh = 4 if N >= FRAG_WIDE_N else 2
    tiles = _cdiv(N, 64 * rh) * _cdiv(M, 8 if M <= 8 else 16)
    split = split_within(tiles, _cdiv(K, 64), FRAG_PROGRAMS_PER_SM[M > 8] * sm_count(device), 4)
    return dict(RH=rh, BM=8 if M <= 8 else 16, KH=1, DEPTH=1, SPLIT_K=split)


# frag_wgmma (the fragments through wgmma, x from shared memory). Measured on the H200 with the L2 cleared
# before each call (research/explore_w4a16_wgmma.py, g128 fp16, M = 1 .. 1024 on 4096^2, 8192^2 and 28672 x 8192,
# every config of BM x warps x RH x STAGES x split; benchmarks/results/2026-11-24-h200/d813fbc/):
# - BM, x's rows a program: the smallest of 8 .. 64 that holds M; above 64 rows the largest of 256 / 128 (up to
#   M rounded to a power of two) that still gives about a wave of tiles, else 64 (fewer rows a program, more
#   programs: 4096^2 at M=256 ran 26.7 us with 64 against 29+ with 128);
# - 128 weight rows a program for BM >= 128 (8 warps x 1 row tile: the accumulator at 64-128 registers a
#   thread); at BM = 32, 64, 4 warps and 2 row tiles when that still makes a wave of tiles, else 1 (more
#   programs); at BM <= 16 always 1 row tile a warp, the K split making up the programs. Two row tiles there
#   had run 28672 x 8192 (M = 1, 4, 16) at 64-74 us on the H100 against 55-56 us with one and the split
#   doubled, and 52-55 against 50-54 us on the H200; on the other llm shapes the rule already gave one
#   (H100 2026-11-25-h100/514e465/wgmma-sweep-small-h100.json, H200 d813fbc/wgmma-sweep-small.json);
# - a ring of 4 slots (3 was 3-15% slower, 6 no faster);
# - K split in powers of two up to 8 / 4 / 1 programs an SM (BM <= 16 / <= 64 / above), slices of 8 steps or
#   more; over the 24 measured cases this rule ran 5% slower than the best config of each (geomean; worst 19%);
# - OVERLAP (the next step dequantized during this step's MMA) from M = 64 on: 4-25% faster there, up to 5%
#   slower below (where the kernel waits on memory, not on the MMA).
# - PIPE (two MMA groups in flight) wherever OVERLAP is on; from M = 64 on the GPU time of the best config of
#   each case went 0.845x -> 0.939x cuBLAS over 45 cases (nine (N, K) x M = 64 .. 1024; research/
#   explore_w4a16_pipe.py, 2026-11-28-h200/1a4b3f3/), and the shipped tile rule with it 0.845x -> 0.869x.
# - Above 64 rows (where 128 weight rows make at least FRAG_WGMMA_ROWS128_TILES of a wave, or M > 128): 8 warps
#   x 1 row tile (128 weight rows a program), x's rows BM = 256 where those tiles make FRAG_WGMMA_WIDE_TILES of a
#   wave, else 128, and the K split that fills at most a wave (1, 2 or 4). In that sweep a partial second wave
#   cost more than idle SMs in the first (13824 x 5120 at M = 256: 108 tiles of 256 rows 0.90x, 216 of 128 rows
#   0.71x), and 128 rows with a split beat 64 with more programs (4096 x 14336 at M = 256: 0.82x against 0.64x).
#   Over the 36 cases from M = 128 with PIPE this rule ran 0.917x against the earlier rule's 0.869x (the best
#   config of each 0.939x).
FRAG_WGMMA_PROGRAMS_PER_SM = (8, 4, 1)  # BM <= 16, <= 64, above
FRAG_WGMMA_OVERLAP_M = 64
FRAG_WGMMA_WIDE_TILES = 0.65  # share of a wave: BM = 256 from here
FRAG_WGMMA_ROWS128_TILES = 0.4  # share of a wave the 128-row tiles make for the 8-warp rule at M <= 128


def frag_wgmma_config(M: int, N: int, K: int, device) -> dict:
    sms = sm_count(device)
    pipe = M >= FRAG_WGMMA_OVERLAP_M
    if M > 64 and (M > 128 or _cdiv(N, 128) >= FRAG_WGMMA_ROWS128_TILES * sms):
        bm = 256 if M > 128 and _cdiv(N, 128) * _cdiv(M, 256) >= FRAG_WGMMA_WIDE_TILES * sms else 128
        split = min(4, split_within(_cdiv(N, 128) * _cdiv(M, bm), K // 64, sms, 8))
        return dict(BM=bm, RH=1, num_warps=8, STAGES=4, SPLIT_K=split, OVERLAP=True, PIPE=True)
    if M <= 64:
        bm = next(b for b in (8, 16, 32, 64) if M <= b)
    else:
        bm = next((b for b in (256, 128) if b <= 1 << (M - 1).bit_length() and
                   _cdiv(N, 128) * _cdiv(M, b) >= 0.9 * sms), 64)
    if bm >= 128:
        warps, rh = 8, 1
    elif bm <= 16:
        warps, rh = 4, 1
    else:
        warps, rh = 4, 2 if _cdiv(N, 128) * _cdiv(M, bm) >= sms else 1
    tiles = _cdiv(N, 16 * rh * warps) * _cdiv(M, bm)
    per_sm = FRAG_WGMMA_PROGRAMS_PER_SM[0 if bm <= 16 else 1 if bm <= 64 else 2]
    split = split_within(tiles, _cdiv(K, 64), per_sm * sms, 8)
    return dict(BM=bm, RH=rh, num_warps=warps, STAGES=4, SPLIT_K=split, OVERLAP=pipe, PIPE=pipe)


# auto, by M. On Hopper, where the weight's group length is a multiple of 64, frag_wgmma up to
# FRAG_WGMMA_MAX_M rows: on the H200 it beat frag at M = 1..16 (8192^2: 17.5 / 17.9 / 19.9 us at M = 1 / 4 / 16
# against 18.8 / 23.4 / 31.7), mma everywhere, and dequant_cublas up to M = 1024 on 4096^2 and 8192^2
# (58 / 217 us against 63 / 229; 870 / 829 us at 28672 x 8192). Elsewhere: gemv up to GEMV_MAX_M rows, mma up
# to MMA_MAX_M, dequant_cublas above. On the H100 (f93179c) at M >= 1024 dequant_cublas ran 0.86x-0.90x cuBLAS
# where mma ran 0.38x-0.43x; at M=256 it won 3 of 5 llm shapes. At M=2 the gemv (one program per row, the second
# reading the weight from L2) beat mma on all five llm shapes on the H200 (1.18x-1.35x cuBLAS against
# 0.80x-1.00x); at M=4 mma won all five (2026-11-24-h200/b305fb8/).
GEMV_MAX_M = 2
MMA_MAX_M = 128
FRAG_WGMMA_MAX_M = 1024


def choose(M: int, frag: bool = False) -> str:
    """The kernel for M rows; ``frag``: the fragment kernels can run (Hopper, group length a multiple of 64)."""
    if frag and M <= FRAG_WGMMA_MAX_M:
        return "frag_wgmma"
    if M <= GEMV_MAX_M:
        return "gemv"
    if M <= MMA_MAX_M:
        return "mma"
    return "dequant_cublas"
