"""Kernel ``tiled``: every layout of a grouped product in one launch, the group sizes read on the device.

The four layouts reduce to three ways of finding a program's work (``JAGGED``):

- ``"m"`` (2-D x 3-D, and 3-D x 2-D as its transpose): the rows of a are cut into groups by ``offs``. The grid is an
  upper bound on the tiles, ``cdiv(M, BLOCK_M) + G`` along M (each group wastes less than one tile), so no host ever
  reads ``offs``. A program loads all of ``offs`` as one vector, counts each group's tiles, and finds its own group
  from their running sum; programs past the last group's tiles take the rows after ``offs[-1]`` and write zeros there
  (what torch's grouped_mm leaves), and the rest exit.
- ``"k"`` (2-D x 2-D, the weight gradient): group g is grid axis 1, its K range is ``[offs[g-1], offs[g])``; an empty
  group writes zeros.
- ``"none"`` (3-D x 3-D): a batched product, the batch on grid axis 1.

Operands are read in place through their strides (b row- or column-major, transposed views), accumulated in fp32 by
``tl.dot``. Tiles of one group run next to each other, in bands of GROUP_M row tiles walked column by column
(:func:`swizzle`), so the programs resident at a time share the group's weight and rows in L2. ``GATED`` (the MoE
gate/up product) keeps two accumulators, the gate's columns and the up projection's ``UP`` elements further along b
(``UPC`` along the bias), and stores ``activation(gate) * up``.

``SPLIT_K`` (row-jagged products only: decode steps, whose few tiles leave SMs idle) cuts K into slices on grid
axis 1; each slice stores its fp32 partial tile in a workspace and the last to arrive adds them in slice order
(:func:`split_arrive`, :func:`split_sum`: deterministic) and runs the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import current_stream, launch
from tilegemm.core.runtime import cdiv, interpreting
from tilegemm.core.workspace import split_workspace
from tilegemm.jit.helpers import apply_activation
from tilegemm.ops.grouped.configs import choose_config, row_tiles
from tilegemm.ops.grouped.problem import GroupedProblem


@triton.jit
def swizzle(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile ``t`` of a [tiles_m, tiles_n] grid in grouped order: bands of GROUP_M row tiles walked column by
    column, so programs running together share both operands' panels in L2."""
    width = GROUP_M * tiles_n
    first_m = (t // width) * GROUP_M
    size = tl.maximum(tl.minimum(tiles_m - first_m, GROUP_M), 1)
    return first_m + (t % width) % size, (t % width) // size


@triton.jit
def jagged_groups(offs_ptr, G, M, GP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The groups of an M-jagged product as row tiles, read from ``offs`` once: (starts, ends, tiles, ends_tiles)
    per group (``offs`` clamped to [0, M]; group g's row tiles are ``[ends_tiles[g] - tiles[g], ends_tiles[g])``),
    then the tail's first row tile (every group's tiles) and first row (``offs[-1]``)."""
    gs = tl.arange(0, GP)
    live = gs < G
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + gs, mask=live, other=0), 0), M)
    starts = tl.minimum(tl.maximum(tl.load(offs_ptr + gs - 1, mask=live & (gs > 0), other=0), 0), M)
    tiles = tl.where(live & (ends > starts), (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    ends_tiles = tl.cumsum(tiles, 0)
    return starts, ends, tiles, ends_tiles, tl.sum(tiles, 0), tl.max(tl.where(live, ends, 0), 0)


@triton.jit
def locate_group(tile_m, starts, ends, tiles, ends_tiles, tail_tile, tail_row, G, M, GP: tl.constexpr):
    """(g, first row, end row, first tile) of the group holding global row tile ``tile_m`` (:func:`jagged_groups`'
    arrays); g == G for the rows past ``offs[-1]`` (to be zeroed)."""
    gs = tl.arange(0, GP)
    g = tl.sum((ends_tiles <= tile_m).to(tl.int32), 0)
    here = gs == g
    tail = g >= G
    first_tile = tl.where(tail, tail_tile, tl.sum(tl.where(here, ends_tiles - tiles, 0), 0))
    start = tl.where(tail, tail_row, tl.sum(tl.where(here, starts, 0), 0))
    end = tl.where(tail, M, tl.sum(tl.where(here, ends, 0), 0))
    return g, start, end, first_tile


@triton.jit
def find_group_m(offs_ptr, tile_m, G, M, GP: tl.constexpr, BLOCK_M: tl.constexpr):
    """(g, first row, end row, first tile, tiles) of the group holding global row tile ``tile_m`` of an
    M-jagged product: its rows ``[first row, end row)`` are row tiles ``first tile ..`` of the grid. g == G for
    the rows past ``offs[-1]`` (to be zeroed)."""
    starts, ends, tiles, ends_tiles, tail_tile, tail_row = jagged_groups(offs_ptr, G, M, GP, BLOCK_M)
    g, start, end, first_tile = locate_group(tile_m, starts, ends, tiles, ends_tiles, tail_tile, tail_row, G, M, GP)
    return g, start, end, first_tile, (end - start + BLOCK_M - 1) // BLOCK_M


@triton.jit
def split_range(k_hi, K, split, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_lo, k_hi) of K slice ``split``: whole BLOCK_K steps, the last slice ending at ``k_hi`` (0 for the
    programs that only store zeros)."""
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * per
    return k_lo, tl.minimum(k_hi, k_lo + per)


@triton.jit
def split_arrive(count_ptr, tile, SPLIT_K: tl.constexpr):
    """After this slice stored its partial tile: True for the slice that arrives last at ``tile`` (its
    counter is then reset for the next launch)."""
    # A scalar atomic runs on one thread: the barrier puts every thread's stores before its release.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return arrived == SPLIT_K - 1


@triton.jit
def split_tile(ws_ptr, s, M, width, offs_m, offs_n):
    """Pointers of the tile (offs_m, offs_n) in plane ``s`` of the workspace's fp32 planes ``[SPLIT_K, M, width]``."""
    return ws_ptr + (s * M + offs_m).to(tl.int64)[:, None] * width + offs_n[None, :]


@triton.jit
def split_sum(ws_ptr, M, width, offs_m, offs_n, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SPLIT_K: tl.constexpr):
    """The partial tiles of every slice added in slice order: [BM, BN] fp32."""
    tl.debug_barrier()  # every thread's loads after the last arrival's acquire
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(split_tile(ws_ptr, s, M, width, offs_m, offs_n), mask=mask, other=0.0,
                         cache_modifier=".cg")
    return total


@triton.jit
def split_finish(acc, acc_up, ws_ptr, count_ptr, tile, M, N, offs_m, offs_n, mask, GATED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """The end of one K slice: its partial tile (and, gated, the up projection's, N columns further on) stored in
    the fp32 planes ``[SPLIT_K, M, 2N if gated else N]``; the slice that arrives last at ``tile`` adds every
    slice's in slice order and resets the tile's counter. Returns (finish, acc, acc_up): finish is True in
    that last slice only, which then runs the epilogue on the sums."""
    if GATED:
        width = 2 * N
    else:
        width = N
    split = tl.program_id(1)
    tl.store(split_tile(ws_ptr, split, M, width, offs_m, offs_n), acc, mask=mask)
    if GATED:
        tl.store(split_tile(ws_ptr, split, M, width, offs_m, offs_n + N), acc_up, mask=mask)
    finish = split_arrive(count_ptr, tile, SPLIT_K)
    if finish:
        acc = split_sum(ws_ptr, M, width, offs_m, offs_n, mask, BLOCK_M, BLOCK_N, SPLIT_K)
        if GATED:
            acc_up = split_sum(ws_ptr, M, width, offs_m, offs_n + N, mask, BLOCK_M, BLOCK_N, SPLIT_K)
        tl.store(count_ptr + tile, 0)
    return finish, acc, acc_up


@triton.jit
def end_slice(finish, acc, acc_up, ws_ptr, count_ptr, tile, M, N, offs_m, offs_n, mask, GATED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """(finish, acc, acc_up) after a program's K loop, for the kernels that split K on grid axis 1: as given
    unsplit, else :func:`split_finish`'s (finish then True in the last slice only). Not GATED, ``acc_up`` is a
    stand-in (pass ``acc``), never read."""
    if SPLIT_K > 1:
        finish, acc, acc_up = split_finish(acc, acc_up, ws_ptr, count_ptr, tile, M, N, offs_m, offs_n, mask, GATED,
                                           BLOCK_M, BLOCK_N, SPLIT_K)
    return finish, acc, acc_up


@triton.jit
def grouped_tiled_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, offs_ptr, ws_ptr, count_ptr,
    G, M, N, K,
    s_ag, s_am, s_ak, s_bg, s_bk, s_bn, s_og, s_om, s_on, s_cg, s_cm, s_cn, UP, UPC,
    JAGGED: tl.constexpr, GP: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if JAGGED == "m":
        # the group first (from the global row tile), then this program's tile in the group's own grid
        g, start, m_hi, first_tile, tiles_g = find_group_m(offs_ptr, pid // tiles_n, G, M, GP, BLOCK_M)
        tile_m, tile_n = swizzle(pid - first_tile * tiles_n, tiles_g, tiles_n, GROUP_M)
        m_lo = start + tile_m * BLOCK_M
        live = g < G
        k_lo = 0
        k_hi = tl.where(live, K, 0)  # the tail's tiles multiply nothing: they store zeros
        g = tl.minimum(g, G - 1).to(tl.int64)  # (the tail reads no group's weight or bias)
        if SPLIT_K > 1:  # this program's slice of K (grid axis 1)
            k_lo, k_hi = split_range(k_hi, K, tl.program_id(1), SPLIT_K, BLOCK_K)
    elif JAGGED == "k":
        tile_m, tile_n = swizzle(pid, tl.cdiv(M, BLOCK_M), tiles_n, GROUP_M)
        g = tl.program_id(1).to(tl.int64)
        live = g >= 0
        m_lo = tile_m * BLOCK_M
        m_hi = M
        k_hi = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), K)
        k_lo = tl.minimum(tl.maximum(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 0), k_hi)
    else:
        tile_m, tile_n = swizzle(pid, tl.cdiv(M, BLOCK_M), tiles_n, GROUP_M)
        g = tl.program_id(1).to(tl.int64)
        live = g >= 0
        m_lo = tile_m * BLOCK_M
        m_hi = M
        k_lo = 0
        k_hi = K
    if (m_lo < m_hi) & (tile_n < tiles_n):
        a_base = a_ptr + g * s_ag
        b_base = b_ptr + g * s_bg
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_m = offs_m < m_hi
        ok_n = offs_n < N
        rows = offs_m.to(tl.int64)[:, None] * s_am
        cols = offs_n.to(tl.int64)[None, :] * s_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok_k = offs_k < k_hi
            x = tl.load(a_base + rows + offs_k.to(tl.int64)[None, :] * s_ak, mask=ok_m[:, None] & ok_k[None, :],
                        other=0.0)
            w_ptrs = b_base + offs_k[:, None].to(tl.int64) * s_bk + cols
            w = tl.load(w_ptrs, mask=ok_k[:, None] & ok_n[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong: multiply fp32 copies there
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
            if GATED:
                u = tl.load(w_ptrs + UP, mask=ok_k[:, None] & ok_n[None, :], other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                acc_up = tl.dot(x, u, acc_up, input_precision=INPUT_PRECISION)
        tile_ok = ok_m[:, None] & ok_n[None, :]
        # finish: whether this program runs the epilogue (m_lo < m_hi holds here; the last slice with SPLIT_K)
        finish, acc, acc_up = end_slice(m_lo < m_hi, acc, acc_up if GATED else acc, ws_ptr, count_ptr, pid, M, N,
                                        offs_m, offs_n, tile_ok, GATED, BLOCK_M, BLOCK_N, SPLIT_K)
        if finish:
            if HAS_BIAS:
                c_ptrs = bias_ptr + g * s_cg + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn
                c_ok = tile_ok & live
                acc += tl.load(c_ptrs, mask=c_ok, other=0.0).to(tl.float32)
                if GATED:
                    acc_up += tl.load(c_ptrs + UPC, mask=c_ok, other=0.0).to(tl.float32)
            acc = apply_activation(acc, ACTIVATION)
            if GATED:
                acc = acc * acc_up
            if JAGGED != "m":
                out_ptr += g * s_og
            o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :] * s_on
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


def _pow2(n: int) -> int:
    """The vector length that holds ``offs`` (a power of two, at least 2)."""
    return 2 if n <= 2 else 1 << (n - 1).bit_length()


def canonical(p: GroupedProblem) -> dict:
    """The kernel's view of a problem: which dimension is jagged, the sizes and every stride (element units).

    3-D x 2-D is run as its transpose, a 2-D x 3-D product: ``out.T[cols of g] = b.T[cols of g] @ a[g].T``.
    """
    a, b, out, bias = p.a, p.b, p.out, p.bias
    c = [0, 0, 0]
    if bias is not None:
        c = [bias.stride(0), 0, bias.stride(1)] if bias.dim() == 2 else [0, 0, bias.stride(0)]
    if p.layout == "2d3d":
        return dict(JAGGED="m", M=p.M, N=p.N, K=p.K, a=a, b=b,
                    s=(0, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
                       0, out.stride(0), out.stride(1), *c))
    if p.layout == "3d3d":
        return dict(JAGGED="none", M=p.M, N=p.N, K=p.K, a=a, b=b,
                    s=(a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
                       out.stride(0), out.stride(1), out.stride(2), *c))
    if p.layout == "2d2d":
        return dict(JAGGED="k", M=p.M, N=p.N, K=p.K, a=a, b=b,
                    s=(0, a.stride(0), a.stride(1), 0, b.stride(0), b.stride(1),
                       out.stride(0), out.stride(1), out.stride(2), *c))
    # 3d2d: a' = b.T [N_total, K] grouped by rows, b'[g] = a[g].T [K, M], out' = out.T [N_total, M]
    if bias is not None:
        c = [0, bias.stride(0), 0]  # a bias along the columns of out is along the rows of out'
    return dict(JAGGED="m", M=p.N, N=p.M, K=p.K, a=b, b=a,
                s=(0, b.stride(1), b.stride(0), a.stride(0), a.stride(2), a.stride(1),
                   0, out.stride(1), out.stride(0), *c))


def workspace(out: torch.Tensor, split: int, M: int, width: int, tiles: int):
    """(fp32 planes, arrival counters) for SPLIT_K slices of an [M, width] output over ``tiles`` tiles (the
    launcher's own, per device and stream: :func:`tilegemm.core.workspace.split_workspace`); ``out`` stands in
    for both without a split (never read)."""
    if split == 1:
        return out, out
    return split_workspace(out.device, split * M * width, tiles, tag="grouped")


def workspace_launch(out: torch.Tensor, split: int, ws, count) -> dict:
    """``launch``'s keep and stream for a launch with :func:`workspace`'s tensors: with a split they are the
    launcher's, made for the current stream, so a replay passes them as recorded and declines on another stream
    (where another launch could use them meanwhile); the last slice at a tile resets its counter, so replays on
    their stream find them at zero."""
    if split == 1:
        return {}
    return dict(keep=(ws, count), stream=current_stream() if out.is_cuda else None)


def run(p: GroupedProblem, config: dict | None = None) -> None:
    v = canonical(p)
    if v["M"] == 0 or v["N"] == 0 or p.groups == 0 and v["JAGGED"] != "m":
        return
    cfg = dict(config or choose_config(p))
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
    tiles_n = cdiv(v["N"], cfg["BLOCK_N"])
    split = cfg.setdefault("SPLIT_K", 1)
    if v["JAGGED"] == "m":
        grid = (row_tiles(v["M"], p.groups, cfg["BLOCK_M"]) * tiles_n, split)
    else:
        if split != 1:
            raise ValueError(f"SPLIT_K={split}: the grouped kernel splits K of row-jagged products only")
        grid = (cdiv(v["M"], cfg["BLOCK_M"]) * tiles_n, p.groups)
    ws, count = workspace(p.out, split, v["M"], v["N"] * (2 if p.gated else 1), grid[0])
    offs = p.offs if p.offs is not None else v["a"]  # (never read: a placeholder pointer)
    bias = p.bias if p.bias is not None else p.out
    interp = interpreting()
    up_bias = p.N * p.bias.stride(-1) if p.gated and p.bias is not None else 0  # the up half of a gated bias
    args = (v["a"], v["b"], p.out, bias, offs, ws, count, p.groups, v["M"], v["N"], v["K"], *v["s"], p.up_offset,
            up_bias)
    flags = dict(JAGGED=v["JAGGED"], GP=_pow2(p.groups), HAS_BIAS=p.bias is not None, GATED=p.gated,
                 ACTIVATION=p.activation, INPUT_PRECISION=p.precision,
                 UPCAST=interp and p.dtype == torch.bfloat16,
                 **cfg, num_warps=warps, num_stages=stages)
    launch(grouped_tiled_kernel, grid, args, flags, **workspace_launch(p.out, split, ws, count))
