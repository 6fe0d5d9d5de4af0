"""Tile sizes of the grouped kernels, chosen from shapes alone (no value of ``offs`` is read on the host).

Rows per group decide BLOCK_M: a MoE decode step gives each expert a few rows, and a 128-row tile would then be
mostly padding; the average rows per group (``M / G``, known from the shapes) picks the smallest power of two
from 16 (tl.dot's least) up to 128 that holds it. Under the interpreter smaller tiles keep the tests fast.

A decode step also leaves few tiles: 1 token routed to 8 experts makes 8 row tiles, a few hundred programs at
most, some SMs idle and the rest streaming weights with one program each. Row-jagged products (the MoE forward)
then split K (``SPLIT_K`` slices, grid axis 1): each slice stores its fp32 partial tile in a workspace and the
last slice to arrive adds them in slice order (deterministic) and runs the epilogue. The number of tiles is
estimated from shapes: at most ``cdiv(M, BLOCK_M) + G`` and at most M (a tile holds at least one row).
Measurements: docs/grouped.md, "Measured".
"""

from __future__ import annotations

import torch

from tilegemm.core.hardware import sm_count
from tilegemm.core.runtime import cdiv, interpreting

# --- the table (why, one line each) -----------------------------------------------------------------------------
# 16-bit and fp32 operands (kernel ``tiled``):
TILED_BLOCK_N = 128  # wide tiles: each weight byte loaded once per row tile, 16 KB a K step in flight
TILED_BLOCK_N_NARROW = 64  # fp32 operands and the gated product: twice the bytes or two accumulators a tile
TILED_BLOCK_K = 64  # 16-bit: 64 K a step fills the 128-byte lines of a K-contiguous weight; fp32 takes 32
TILED_SPLIT_PROGRAMS_PER_SM = 3  # split K up to the programs an SM holds at once (shared memory): one wave
TILED_SPLIT_MIN_STEPS = 4  # a slice keeps at least 4 K steps, so its pipeline fills before it drains
# 4-bit experts (kernel ``dequant_dot``), by BLOCK_M:
#   (BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP, programs per SM for the K split, min K steps a slice)
INT4 = {
    16: (128, 128, 4, 3, True, 2, 2),  # decode: weights as the MMA's A operand from registers (SWAP), 128 K a step
    32: (128, 128, 4, 3, True, 2, 2),  # a few rows an expert: the same (token rows are the MMA's N, 8 to 256)
    64: (128, 64, 4, 3, False, 2, 4),  # rows enough for wgmma's M of 64: x is the A operand again
    128: (128, 64, 8, 3, False, 1, 8),  # prefill: 8 warps for the 128 x 128 accumulator; tiles fill the GPU
}
INT4_ROWS_FACTOR = 2  # BLOCK_M holds twice the average rows an expert: popular experts dequantize a tile once
INT4_BLOCK_N_GATED = 64  # two weight tiles and two accumulators a program
MAX_SPLIT = 16  # the workspace holds SPLIT_K fp32 planes of the output
# 4-bit experts at decode sizes (kernel ``frag``, W4A16's frag_wgmma machinery): (BM holds this many times the
# average rows an expert, so the skewed routing's busiest expert takes one pass over its weight; BM choices: x's rows
# a program, wgmma's N, at most 32, as 64 ran slower on Mixtral's gate/up; warps; 16-row weight tiles a warp; ring
# slots). One row tile a warp, 64 weight rows a program, 4 slots, as frag_wgmma at BM <= 16: the K split makes up
# the programs (docs/grouped.md, "4-bit experts at decode: `frag`")
INT4_FRAG = (4, (8, 16, 32), 4, 1, 4)
# At BM 32 (64 tokens: the MMA chain, not HBM, bounds a program) the K split rises until no slice passes this many
# K steps: Mixtral's down projection (224 steps) ran 1.8x -> 2.1x the 16-bit baseline; at BM 8 the same split ran
# slower (docs/grouped.md, "4-bit experts at decode: `frag`")
INT4_FRAG_MAX_SLICE_STEPS = 128
# 16-bit MoE forward on Hopper (kernel ``tma``): rows enough an expert that every tile is a full 128-row wgmma
# BLOCK_M, BLOCK_N, BLOCK_K: 48 KB a stage, two warp groups of 64 x 256 each: the dense TMA rung's tile for large
# 16-bit products (docs/rungs/persistent_tma.md)
TMA_BLOCK = (128, 256, 64)
TMA_BLOCK_N_GATED = 128  # two weight tiles and two accumulators a program: the same 48 KB a stage and registers
TMA_STAGES = 4  # 4 x 48 KB of the SM's 227 KB in flight: TMA three steps ahead, faster than 3 at prefill sizes
#   (docs/grouped.md, "Kernels")
TMA_STAGES_GATED = 3  # the gated product (two accumulators) not timed with 4
# Under this many rows an expert on average (M / G), the plain product's tiles are 64 rows on one warp group, 5 stages
# of 40 KB: groups of a few hundred rows then waste less than half a 128-row tile each and make twice the units
# (Mixtral at 512 tokens, 128 rows an expert: the candidates' fastest in both products and dtypes; docs/grouped.md,
# "Kernels"). The gated product keeps its tile (not timed at 64 rows).
TMA_HALF_TILE_MAX_ROWS = 256
TMA_HALF_TILE = dict(BLOCK_M=64, num_warps=4, num_stages=5)
# The plain product's last partial wave of units over the programs cut along K (``TAIL_SPLIT``, off at 1): each of its
# units into up to this many slices, as many as the idle programs of that wave take, every slice keeping at least
# TMA_TAIL_MIN_STEPS K steps; the slices meet through fp32 partial tiles in a workspace, the last to arrive adding
# them in slice order (deterministic). A candidate for products of a few waves of long-K units (Mixtral's down
# projection), where the last wave's few units keep most SMs idle while they run; off until it holds beyond Mixtral's
# shapes (tools/grouped_rule_candidates.py times it; docs/grouped.md, "Kernels", `gluon`)
TMA_TAIL_SPLIT = 1
TMA_TAIL_MIN_STEPS = 8
# 4-bit experts at prefill (kernel ``dequant_grouped``): its dequantizing pass and the slices of a large weight
# packed rows (8 K each), scratch rows (output columns), warps a program: 128 K x 128 columns, 32 KB written (as
# w4a16's dequant_cublas pass)
INT4_DEQUANT_PASS = (16, 128, 4)
INT4_DEQUANT_CHUNK_ALIGN = 256
# 16-bit MoE forward on Hopper (kernel ``gluon``, the dense family's warp-specialized skeleton): a producer warp group
# and two consumers of 64 rows x 256 columns each (tma's tile; a 128-row tile wastes less of a jagged group than
# gluon_f16's 256 x 128), with the output buffer shared by the consumers and a 4-deep ring, or a buffer each and 3
# slots (gluon_f16's two 128 x 256 rings); the shared one from GLUON_LONG_K_STEPS K steps, as gluon_f16's batched rule
GLUON_TILES = (
    dict(BLOCK_M=128, BLOCK_N=256, STAGES=4, SHARED_OUT=True, GROUP_M=8),
    dict(BLOCK_M=128, BLOCK_N=256, STAGES=3, SHARED_OUT=False, GROUP_M=8),
    # candidates only (config() takes GLUON_BLOCK's tiles): cuBLAS's large-product tile, 128 x 128 a consumer, for
    # experts of a thousand rows and more, where a 256-row tile wastes little of a group
    dict(BLOCK_M=256, BLOCK_N=128, STAGES=4, SHARED_OUT=True, GROUP_M=8),
    dict(BLOCK_M=256, BLOCK_N=128, STAGES=3, SHARED_OUT=False, GROUP_M=8),
)
GLUON_BLOCK = (128, 256)  # (BLOCK_M, BLOCK_N) of the tiles config() takes; (256, 128) the candidates' other tile
GLUON_LONG_K_STEPS = 32  # a slice of the output's columns is whole 256-column tiles (tma's BLOCK_N)


def block_m_for(rows_per_group: float) -> int:
    for bm in (16, 32, 64):
        if rows_per_group <= bm:
            return bm
    return 128


def row_tiles(M: int, groups: int, block_m: int) -> int:
    """Row tiles of a row-jagged product, at most: each non-empty group (and the rows past ``offs[-1]``) wastes
    less than one tile, and a tile holds at least one row."""
    return min(cdiv(M, block_m) + groups, M)


def split_k(tiles: int, steps: int, device, programs_per_sm: int, min_steps: int) -> int:
    """K slices (a power of two up to MAX_SPLIT) so that ``tiles * split`` reaches ``programs_per_sm`` programs an
    SM, each slice keeping at least ``min_steps`` K steps."""
    target = programs_per_sm * sm_count(device)
    split = 1
    while tiles * split * 2 <= target and steps // (2 * split) >= min_steps and split < MAX_SPLIT:
        split *= 2
    return split


def choose_config(p) -> dict:
    """``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``num_warps``, ``num_stages`` for a :class:`GroupedProblem`."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=1, num_warps=4, num_stages=1)
    jagged_m = p.layout in ("2d3d", "3d2d")
    M, N = (p.N, p.M) if p.layout == "3d2d" else (p.M, p.N)  # 3d2d runs as its transpose
    bm = block_m_for(M / max(p.groups, 1) if jagged_m else M)
    wide = p.dtype == torch.float32
    bk = 32 if wide else TILED_BLOCK_K
    bn = TILED_BLOCK_N_NARROW if p.gated or wide else TILED_BLOCK_N
    warps = 8 if bm * bn >= 128 * 128 else 4
    split = 1
    if jagged_m and M > 0:
        split = split_k(row_tiles(M, p.groups, bm) * cdiv(N, bn), cdiv(p.K, bk), p.out.device,
                        TILED_SPLIT_PROGRAMS_PER_SM, TILED_SPLIT_MIN_STEPS)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, num_warps=warps,
                num_stages=3 if bm >= 64 else 4)


def int4_block_k(block_k: int, group_k: int, K: int) -> int:
    """BLOCK_K for the 4-bit kernel: at most the group length where groups are shorter than K, so that each K
    step lies in one group and loads one row of scales and zeros."""
    if group_k >= K:
        return block_k
    while block_k > 16 and group_k % block_k:
        block_k //= 2
    return block_k


def int4_config(p) -> dict:
    """The config of a :class:`GroupedInt4Problem`; ``SWAP``: the dequantized weight is the MMA's A operand."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=1, SWAP=False, num_warps=4,
                    num_stages=1)
    bm = block_m_for(INT4_ROWS_FACTOR * p.M / max(p.groups, 1))
    bn, bk, warps, stages, swap, per_sm, min_steps = INT4[bm]
    if p.gated:
        bn = INT4_BLOCK_N_GATED
    bk = int4_block_k(bk, p.group_k, p.K)
    split = split_k(row_tiles(p.M, p.groups, bm) * cdiv(p.N, bn), cdiv(p.K, bk), p.out.device, per_sm, min_steps)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, SWAP=swap, num_warps=warps,
                num_stages=stages)


def tma_config(p) -> dict:
    """The config of kernel ``tma`` (:data:`TMA_BLOCK`); small tiles under the interpreter."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    bm, bn, bk = TMA_BLOCK
    cfg = dict(BLOCK_M=bm, BLOCK_N=TMA_BLOCK_N_GATED if p.gated else bn, BLOCK_K=bk, GROUP_M=8, num_warps=8,
               num_stages=TMA_STAGES_GATED if p.gated else TMA_STAGES)
    if not p.gated and p.M < TMA_HALF_TILE_MAX_ROWS * max(p.groups, 1):
        cfg.update(TMA_HALF_TILE)
    if not p.gated and TMA_TAIL_SPLIT > 1:
        cfg["TAIL_SPLIT"] = TMA_TAIL_SPLIT
    return cfg


def tail_plan(live_units: int, k_steps: int, programs: int, split_max: int,
              min_steps: int = TMA_TAIL_MIN_STEPS) -> tuple[int, int, int, int]:
    """(full, tail, split, per) of ``tma``'s tail split, as its kernel computes them on the device from the live
    units (the groups' tiles, known there only): the units of the whole waves over ``programs``, the units left for
    the last wave, the K slices each of those takes (1: none), and the K steps a slice."""
    full = live_units // programs * programs
    tail = live_units - full
    split = max(1, min(programs // max(tail, 1), split_max, k_steps // max(min_steps, 1)))
    return full, tail, split, cdiv(k_steps, split)
