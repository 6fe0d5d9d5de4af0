"""Launch configs of the W4A16 kernels: a small table keyed by M bucket, the number of K slices computed from the
grid and the GPU's SM count. No timing on the call path. Each rule's measurements: docs/w4a16.md, "Configs".
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


# gemv (M = 1, 2): 128 K per step, 4 warps, the exponent trick in inline assembly (DEQ="exp16asm"), the next step's
# weights loaded before this step's arithmetic (PREFETCH), x's eight values of a packed row in one load (XVEC).
# The kernel is bound by issue slots rather than HBM, so two things set its speed: 128-column tiles where N gives
# at least 64 of them (they spread the per-row work over more weights), 64 below; and one wave: K is split in
# powers of two up to GEMV_PROGRAMS_PER_SM programs per SM, each slice at least two steps (a partial second wave
# costs more than it gains). docs/w4a16.md, "Configs".
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


# mma: by M bucket. Small M: the weights as the MMA's A operand (SWAP) with split-K; at M <= 16, 128 columns go
# with the magic-exponent dequantization (DEQ16="magic": each alone is slower); larger tiles as M grows. The
# gather unpacking never won; BLOCK_N=256 and 128x128x128 with 4 stages run out of shared memory.
# docs/w4a16.md, "Configs".
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


# frag_wgmma (the fragments through wgmma, x from shared memory), each choice measured over M = 1 .. 1024 on the
# llm shapes (docs/w4a16.md, "Configs"):
# - BM, x's rows a program: the smallest of 8 .. 64 that holds M; above 64 rows the largest of 256 / 128 (up to
#   M rounded to a power of two) that still gives about a wave of tiles, else 64 (fewer rows a program, more
#   programs);
# - 128 weight rows a program for BM >= 128 (8 warps x 1 row tile: the accumulator at 64-128 registers a
#   thread); at BM = 32, 64, 4 warps and 2 row tiles when that still makes a wave of tiles, else 1 (more
#   programs); at BM <= 16 always 1 row tile a warp, the K split making up the programs;
# - a ring of 4 slots (3 was slower, 6 no faster);
# - K split in powers of two up to 8 / 4 / 1 programs an SM (BM <= 16 / <= 64 / above), slices of 8 steps or more
#   (4 at BM = 8, M <= 8: the finer split fills the SMs on small weights; docs/w4a16.md, "frag_wgmma", fill);
# - OVERLAP (the next step dequantized during this step's MMA) and PIPE (two MMA groups in flight) from M = 64 on,
#   where the kernel waits on the MMA (below it waits on memory, and they cost a little);
# - above 64 rows (where 128 weight rows make at least FRAG_WGMMA_ROWS128_TILES of a wave, or M > 128): 8 warps
#   x 1 row tile (128 weight rows a program), x's rows BM = 256 where those tiles make FRAG_WGMMA_WIDE_TILES of a
#   wave, else 128, and the K split that fills at most a wave (1, 2 or 4): a partial second wave cost more than
#   idle SMs in the first, and 128 rows with a split beat 64 with more programs.
# - at BM = 32 (M 17 .. 32) the plain loop waits and synchronises once every two K steps (PAIRS) on a ring of 6:
#   it won there on two fitting draws and held on the held-out one; at M <= 16 it lost (docs/w4a16.md,
#   "frag_wgmma", PAIRS).
FRAG_WGMMA_PROGRAMS_PER_SM = (8, 4, 1)  # BM <= 16, <= 64, above
FRAG_WGMMA_MIN_STEPS = (4, 8)  # least 64-deep K steps a slice: BM = 8, above
FRAG_WGMMA_PAIRS_BM = 32
FRAG_WGMMA_PAIRS_STAGES = 6
FRAG_WGMMA_OVERLAP_M = 64
FRAG_WGMMA_WIDE_TILES = 0.65  # share of a wave: BM = 256 from here
FRAG_WGMMA_ROWS128_TILES = 0.4  # share of a wave the 128-row tiles make for the 8-warp rule at M <= 128


def frag_wgmma_config(M: int, N: int, K: int, device, gather: bool = False) -> dict:
    """``gather``: act-order, x's tile gathered through registers (GATHER): one row tile a warp where PIPE is on
    and x's rows at most 128 a program (more spill in sm_90's compile: docs/w4a16.md, "Act-order")."""
    sms = sm_count(device)
    pipe = M >= FRAG_WGMMA_OVERLAP_M
    if M > 64 and (M > 128 or _cdiv(N, 128) >= FRAG_WGMMA_ROWS128_TILES * sms):
        bm = 256 if M > 128 and not gather and _cdiv(N, 128) * _cdiv(M, 256) >= FRAG_WGMMA_WIDE_TILES * sms else 128
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
        warps, rh = 4, 2 if _cdiv(N, 128) * _cdiv(M, bm) >= sms and not (gather and pipe) else 1
    tiles = _cdiv(N, 16 * rh * warps) * _cdiv(M, bm)
    per_sm = FRAG_WGMMA_PROGRAMS_PER_SM[0 if bm <= 16 else 1 if bm <= 64 else 2]
    split = split_within(tiles, _cdiv(K, 64), per_sm * sms, FRAG_WGMMA_MIN_STEPS[0 if bm <= 8 else 1])
    if bm == FRAG_WGMMA_PAIRS_BM and not pipe and not gather:
        return dict(BM=bm, RH=rh, num_warps=warps, STAGES=FRAG_WGMMA_PAIRS_STAGES, SPLIT_K=split, OVERLAP=False,
                    PIPE=False, PAIRS=True)
    return dict(BM=bm, RH=rh, num_warps=warps, STAGES=4, SPLIT_K=split, OVERLAP=pipe, PIPE=pipe)
