"""Rung ``split_k``: several programs share one output tile's K loop, for skinny problems.

With M of 1 to 128 a GEMM has few output tiles (M=16, N=4096 with 64-wide tiles: 64 tiles for 132 SMs),
so one program per tile leaves most of the GPU idle while each walks all of K. Here SPLIT_K programs take
a slice of K each, and the partial tiles are reduced inside the same launch (no memset, no second kernel):

- ``SLICES=True`` (the default): each program stores its fp32 partial tile in its own plane of a
  workspace and bumps the tile's arrival counter; the program that arrives last adds the planes in slice
  order, so the result is the same whichever program finished last (deterministic), and applies the
  epilogue. Costs SPLIT_K x M x N floats of workspace.
- ``SLICES=False``: partial tiles are added into one fp32 plane with atomics; the last program takes the
  sum and swaps zeros back in. Less workspace, not deterministic, and measured slower on an H200.

The tile and the number of slices (1 included: no reduction at all) are tuned per shape
class on first use, like ``autotuned`` (configs persist; H200 defaults ship with the package).
"""

from __future__ import annotations

import torch
import triton

from tilegemm.core import tuning, workspace
from tilegemm.core.workspace import split_workspace
from tilegemm.core.hardware import pipeline_fits, sm_count, smem_per_block
from tilegemm.jit.helpers import below, epilogue_store, offsets_2d_div, tile_grouped
from tilegemm.core.launch import current_stream, launch, sequence_lock
from tilegemm.ops.matmul import grouped, residue
from tilegemm.ops.matmul.mainloop import dot_k_loop, tile_rows_cols
from tilegemm.ops.matmul.cost import fastest
from tilegemm.ops.matmul.problem import GemmProblem, rows_aligned
from tilegemm.ops.matmul.split_reduce import launch_reduction, reduce_apart
from tilegemm.core.runtime import cdiv, interpreting

import triton.language as tl  # noqa: E402


@triton.jit
def matmul_split_k_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_ob, stride_om, stride_on,
    stride_cb, stride_cm, stride_cn,
    stride_bias, stride_sa, stride_sb,
    alpha, beta,
    ws_ptr, count_ptr,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, DIVISORS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K, SLICES: tl.constexpr, ATOMIC_READ: tl.constexpr, APART: tl.constexpr = False,
):
    # Which tile and which slice of K: axis 0 tiles, axis 1 the K slice, axis 2 the batch.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    pid_m, pid_n = tile_grouped(tile, tiles_m, tiles_n, GROUP_M)
    split = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    a_ptr += pid_b * stride_ab
    b_ptr += pid_b * stride_bb
    out_ptr += pid_b * stride_ob
    c_ptr += pid_b * stride_cb
    if SLICES:
        ws_ptr += pid_b * SPLIT_K * M * N
    else:
        ws_ptr += pid_b * M * N
    count_ptr += pid_b * tiles_m * tiles_n

    # This program's K range: a whole number of BLOCK_K steps.
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    k_begin = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + steps_per_split * BLOCK_K)

    offs_m, offs_n, load_m, load_n = tile_rows_cols(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, INDEX_64, DIVISORS)
    acc = dot_k_loop(a_ptr, b_ptr, k_begin, k_end, stride_am, stride_ak, stride_bk, stride_bn, load_m, load_n,
                     BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST, MMA_OPERANDS, FAST_ACCUM, DIVISORS)

    if SPLIT_K == 1:
        epilogue_store(acc, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                       stride_om, stride_on, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
                       alpha, beta, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, DIVISORS)
    elif APART:
        # The planes are added by split_k_reduce_kernel, launched after this one: store this slice's plane.
        DIV_M: tl.constexpr = DIVISORS[8]
        DIV_N: tl.constexpr = DIVISORS[9]
        inside = below(offs_m, M, DIV_M)[:, None] & below(offs_n, N, DIV_N)[None, :]
        tl.store(ws_ptr + offsets_2d_div(offs_m, offs_n, N, 1, DIV_N, 1) + split * M * N, acc, mask=inside)
    else:
        # Reduce across the K slices: hand this partial tile over, then count arrivals at this tile.
        DIV_M: tl.constexpr = DIVISORS[8]
        DIV_N: tl.constexpr = DIVISORS[9]
        inside = below(offs_m, M, DIV_M)[:, None] & below(offs_n, N, DIV_N)[None, :]
        ws_tile = ws_ptr + offsets_2d_div(offs_m, offs_n, N, 1, DIV_N, 1)  # the planes are [M, N], row-major
        if SLICES:
            # Each slice has its own [M, N] plane of the workspace: plain stores, no zeroing needed.
            tl.store(ws_tile + split * M * N, acc, mask=inside)
        else:
            tl.atomic_add(ws_tile, acc, mask=inside, sem="relaxed")
        # A scalar atomic runs on one thread: the barrier puts every thread's writes before its release.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()  # and every thread's reads after the acquire
            if SLICES:
                # Last one here: add the planes in slice order, so the result does not depend on which
                # program came last (deterministic). ".cg" reads from L2, past this SM's L1.
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    total += tl.load(ws_tile + s * M * N, mask=inside, other=0.0, cache_modifier=".cg")
            elif ATOMIC_READ:
                # Take the sum and leave zeros behind. On the GPU the read is an atomic exchange: plain
                # loads were seen (H200, M=16) to miss atomic adds still in flight, by up to 22%.
                zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                total = tl.atomic_xchg(ws_tile, zeros, mask=inside, sem="relaxed")
            else:  # the interpreter runs programs one at a time and has no fp32 exchange
                total = tl.load(ws_tile, mask=inside, other=0.0)
                tl.store(ws_tile, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=inside)
            tl.store(count_ptr + tile, 0)
            epilogue_store(total, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                           stride_om, stride_on, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
                           alpha, beta, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, DIVISORS)


# --- workspace: zeroed once, left zeroed by every launch --------------------------------------------------

def workspaces() -> dict:
    """split_k's workspaces in this process, ``{(device, stream, planes): (planes, counters)}`` (the
    documented hook tests observe them through)."""
    return {(k[0], k[1], k[2][1]): v for k, v in workspace._workspaces.items()
            if isinstance(k[2], tuple) and k[2][0] == "split_k"}


def clear_workspaces() -> None:
    """Forget split_k's workspaces (replays recorded with them keep theirs)."""
    for k in [k for k in workspace._workspaces if isinstance(k[2], tuple) and k[2][0] == "split_k"]:
        del workspace._workspaces[k]


def _workspace(device: torch.device, floats: int, counters: int, planes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (device, stream, reduction) (:func:`tilegemm.core.workspace.split_workspace`). The atomic reduction
    needs its workspace zeroed (every launch leaves it so); the per-slice planes leave partial sums behind, so
    they get a workspace of their own."""
    return split_workspace(device, floats, counters, tag=("split_k", planes), zeroed=not planes)


def make_config(bm, bn, bk, warps, stages, split, slices=True) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, SLICES=slices, num_warps=warps,
                num_stages=stages)


# Tiles per M bucket for 16-bit operands (BLOCK_K is rescaled for other element sizes): the best measured on the
# llm shapes per M bucket (docs/rungs/split_k.md).
_TILES = {
    16: [(16, 128, 128, 4, 4), (16, 64, 256, 4, 3)],
    32: [(32, 128, 128, 4, 4), (32, 64, 128, 4, 4)],
    # 64x64 tiles with a 6-deep pipeline: ahead of 4 stages at M = 128 (docs/rungs/split_k.md).
    64: [(64, 64, 128, 4, 4), (64, 64, 128, 4, 6), (64, 128, 64, 4, 4)],
    128: [(64, 64, 128, 4, 4), (64, 64, 128, 4, 6), (64, 128, 64, 4, 4), (64, 128, 128, 4, 4), (128, 128, 64, 4, 4),
          (128, 256, 64, 8, 3)],
    # M > 128: split_k takes few output tiles with a long K there (tilegemm.ops.matmul.cost ranks these).
    None: [(128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4)],
}
_SPLITS = (1, 2, 3, 4, 8)


def sensible_split(split: int, tiles: int, k_steps: int, sms: int) -> bool:
    """Whether ``split`` K slices of ``tiles`` output tiles are a candidate: one slice, or every slice at least 4
    K steps long and the grid within 4 programs per SM (:func:`configs`, and the survey's choices)."""
    return split == 1 or (k_steps >= 4 * split and tiles * split <= 4 * sms)


def configs(p: GemmProblem) -> list[dict]:
    """The candidates ``split_k`` times for a problem: tiles for its M, each with every sensible split.

    A split is sensible when every slice keeps at least 4 K steps and the grid stays within 4 programs per
    SM. SPLIT_K=1 is a candidate too (one program per tile, no reduction), so where splitting does not pay
    the tuner says so.
    """
    if interpreting():
        return [make_config(16, 32, 16, 4, 1, 3)]
    size = p.a.element_size()
    bucket = next((m for m in (16, 32, 64, 128) if p.M <= m), None)
    sms = sm_count(p.out.device)
    out = []
    for bm, bn, bk, warps, stages in _TILES[bucket]:
        bk = max(32, min(256, bk * 2 // size))  # the same bytes per K step for fp8 and fp32
        if (bm + bn) * bk * size * stages > 200 * 1024 or not pipeline_fits(bm, bn, bk, size, stages, p.out.device):
            continue  # (a GPU with less shared memory a block takes the bucket's smaller tiles: docs/rungs/split_k.md)
        tiles = cdiv(p.M, bm) * cdiv(p.N, bn) * p.batch
        k_steps = cdiv(p.K, bk)
        for split in _SPLITS:
            if sensible_split(split, tiles, k_steps, sms):
                out.append(make_config(bm, bn, bk, warps, stages, split))
        wave = wave_split(tiles, k_steps, sms)
        if wave > _SPLITS[-1]:
            out.append(make_config(bm, bn, bk, warps, stages, wave))
    rule = misaligned_config(p)
    if rule is not None and rule not in out:
        out.append(rule)  # so that timing (tilegemm tune) weighs the untimed rule's config too
    if not out:
        raise ValueError(f"split_k: none of its tiles for M = {p.M} fits the {smem_per_block(p.out.device) // 1024} "
                         f"KB of shared memory a block this GPU has")
    return out


def wave_split(tiles: int, k_steps: int, sms: int) -> int:
    """The K split that makes ``tiles`` output tiles about one wave of programs, each slice at least 4 K steps
    long (at most 256 slices). For small outputs with long K, such as a 1x1 convolution's weight gradient
    (docs/rungs/split_k.md)."""
    return max(1, min(sms // max(tiles, 1), k_steps // 4, 256))


def filled(p: GemmProblem, config: dict) -> dict:
    """An untimed ``config`` (a neighbouring shape class's, or the default) with its K split raised to
    :func:`wave_split` when its own leaves more than half of the SMs idle: a neighbour's split was chosen
    for its K and its number of tiles, not this problem's."""
    tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"]) * p.batch
    sms = sm_count(p.out.device)
    if tiles * config["SPLIT_K"] * 2 > sms:
        return config
    wave = wave_split(tiles, cdiv(p.K, config["BLOCK_K"]), sms)
    return dict(config, SPLIT_K=wave) if wave > config["SPLIT_K"] else config


# Rows not 16-byte aligned with few rows of A (M <= 16, NN or NT, 16-bit): the kernel loads them two bytes at a time,
# so one program keeps few bytes in flight and the product is bound by how many loads the GPU has out. Narrow
# tiles in many K slices (down to one K step a slice) put more programs, and more loads, on each SM (the tiles
# and splits measured, on seen and unseen products: docs/rungs/split_k.md).
MISALIGNED_TILE = (16, 32, 64, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
MISALIGNED_PROGRAMS_PER_SM = 16
MISALIGNED_MAX_SPLIT = 64


def misaligned_config(p: GemmProblem) -> dict | None:
    """The config for a small-M NN or NT 16-bit product whose rows are not 16-byte aligned (see
    :data:`MISALIGNED_TILE`), or None for any other problem."""
    if p.M > 16 or p.layout not in ("NN", "NT") or p.a.element_size() != 2 or interpreting() or rows_aligned(p):
        return None
    bm, bn, bk, warps, stages = MISALIGNED_TILE
    tiles = cdiv(p.M, bm) * cdiv(p.N, bn) * p.batch
    slots = MISALIGNED_PROGRAMS_PER_SM * sm_count(p.out.device)
    steps = cdiv(p.K, bk)
    split = 1
    while split * 2 <= min(MISALIGNED_MAX_SPLIT, steps) and tiles * split * 2 <= slots:
        split *= 2
    return make_config(bm, bn, bk, warps, stages, split)


def pick_config(p: GemmProblem) -> dict:
    """A config without timing: the first tile of the M bucket, in enough K slices for about one wave."""
    cands = configs(p)
    if interpreting():
        return cands[0]
    first = [c for c in cands if (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) ==
             (cands[0]["BLOCK_M"], cands[0]["BLOCK_N"], cands[0]["BLOCK_K"])]
    tiles = cdiv(p.M, first[0]["BLOCK_M"]) * cdiv(p.N, first[0]["BLOCK_N"]) * p.batch
    sms = sm_count(p.out.device)
    fits = [c for c in first if tiles * c["SPLIT_K"] <= sms]
    return fits[-1] if fits else first[0]


def run(p: GemmProblem, config: dict | None = None) -> None:
    """Launch with ``config``; else with the tuned config of this shape class (timing the candidates once)."""
    if config is None:
        if residue.why_not(p) is None:
            # Few rows of A, B's rows not 16 bytes apart: B read in whole vectors by residue class, whatever
            # was tuned for the shape class (tuned on aligned rows, or not at all).
            residue.run(p)
            return
        if interpreting():
            config = pick_config(p)
        else:
            k = p.tuning_key("split_k")
            config = tuning.lookup(k)
            if config is not None and not pipeline_fits(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
                                                        p.a.element_size(), config["num_stages"], p.out.device):
                config = None  # a table's entry for another GPU of the host, too large for this one's blocks
            if config is None and not tuning.timing_enabled():
                # Untimed: a small misaligned product's rule; else a near tuned shape class's config, its split
                # raised to fill a wave, else the config the cost model ranks fastest (tilegemm.ops.matmul.cost).
                config = misaligned_config(p)
                if config is None:
                    config = tuning.choose_untimed(k, lambda: configs(p), lambda options: fastest(options, p),
                                                   tuning.NEAR, variant=rows_aligned(p))
                    config = filled(p, config)
            elif config is None:
                config = tuning.lookup_or_tune(k, lambda: configs(p), lambda cfg: launch_config(p, cfg))
    launch_config(p, config)


def launch_config(p: GemmProblem, config: dict) -> None:
    cfg = dict(config)
    if cfg["SPLIT_K"] == 1 and not interpreting():
        # One slice: exactly the grouped kernel (the split kernel's slice bookkeeping cost up to ~5% there).
        grouped.run(p, {k: v for k, v in cfg.items() if k not in ("SPLIT_K", "SLICES", "APART")})
        return
    # A config without the key (tuned before it existed) gets the default reduction, as candidates do.
    cfg.setdefault("SLICES", True)
    if cfg["SLICES"] and cfg["SPLIT_K"] * p.M * p.N >= 2**31:
        cfg["SLICES"] = False  # plane offsets are 32-bit in the kernel; one atomic plane still fits
    apart = cfg["SPLIT_K"] > 1 and cfg["SLICES"] and cfg.get("APART", reduce_apart(cfg))  # a config may say
    cfg["APART"] = apart
    tiles = cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    planes = cfg["SPLIT_K"] if cfg["SLICES"] else 1
    ws, count = _workspace(p.out.device, p.batch * planes * p.M * p.N, p.batch * tiles, cfg["SLICES"])
    grid = (tiles, cfg["SPLIT_K"], p.batch)
    args = (*p.kernel_args(), ws, count)
    stream = current_stream() if p.out.is_cuda else 0
    flags = {**p.kernel_flags(), **cfg, "ATOMIC_READ": not interpreting()}
    # Replayable, but only on this stream: another stream's launches could use the workspace meanwhile.
    if not apart:
        launch(matmul_split_k_kernel, grid, args, flags, keep=(ws, count), stream=stream)
        return
    with sequence_lock:  # the planes are the stream's: no other thread's launches between the two
        launch(matmul_split_k_kernel, grid, args, flags, keep=(ws, count), stream=stream)
        launch_reduction(p, ws, count, cfg["SPLIT_K"], stream)
