"""Kernel ``frag`` of ``grouped_w4a16``: 4-bit experts at decode sizes on the W4A16 fragment kernel's machinery
(Gluon, sm_90).

The weights are the stacked experts' fragment layout (``Int4Weight.fragments()`` of an ``[E, N, K]`` weight: each
expert's ``[N16, K64, 32, 4]`` words and ``[G', N16, 8, 4]`` scales along a leading E), read exactly as
:mod:`tilegemm.ops.w4a16.frag_wgmma` reads one weight's: the same cp.async ring of x tiles and packed words, the
same inline-PTX dequantization into ``wgmma``'s A fragments (the weight's rows are the MMA's M, so a few token rows
waste no weight bandwidth), the same scale prefetch a group ahead. Those functions are imported from there; this
file holds only the grouped kernel's own body.

Grid ``(weight row tiles, E + 1, K slices)``: a program's expert is grid axis 1, its rows ``offs[e-1]:offs[e]`` are
read on the device (never on the host: a CUDA graph captures the call and replays it with new ``offs``). An empty
expert's programs exit after two loads. With fewer rows than experts (``COMPACT``: one token to 8 of 128 experts)
axis 1 holds ``M + 1`` slots instead, slot j taking the j-th non-empty expert (a scan of ``offs`` in the program),
so the grid is not mostly programs that exit. A program loops over its expert's rows ``BM`` at a time, so any
number of rows is right (a popular expert runs its row blocks one after another, each a pass over its slice of the
weight). The last slot zeroes the rows past ``offs[-1]``.

K is cut into ``SPLIT_K`` slices (grid axis 2; one token to 2 of Mixtral's 8 experts leaves the down projection 2 x
64 row tiles, far from filling 132 SMs). Every slice stores its partial ``[rows, weight rows]`` tile in the
family's split workspace; the last to arrive at a (row block, row tile) adds them in slice order (deterministic),
resets its counter and runs the epilogue: bias (``[N]`` or ``[E, N]``), activation, and for ``GATED`` the gate.

``GATED`` (``moe_gate_up_int4``: ``activation(gate) * up`` over the weight's two halves of rows) reads the
fragments of the rows in :func:`tilegemm.ops.w4a16.format.gate_up_tiles`' order (gate and up rows alternating by
16-row tiles): a program's row tiles hold the gate and the up rows of the same output columns. Their sums meet
through the workspace (even unsplit: one fp32 round trip of the tile through L2), where the epilogue reads the
gate's and the up projection's columns of the output tile as two plain tiles.

docs/grouped.md, "4-bit experts at decode: `frag`".
"""

from __future__ import annotations

import torch

from tilegemm.core.hardware import sm_count, why_not_gluon
from tilegemm.core.launch import current_stream, launch
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv
from tilegemm.core.workspace import split_workspace
from tilegemm.jit.helpers import apply_activation
from tilegemm.ops.grouped.configs import INT4_FRAG, INT4_FRAG_MAX_SLICE_STEPS, MAX_SPLIT, row_tiles
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.w4a16 import FRAG_WGMMA_PROGRAMS_PER_SM, fits_fragments, fragment_kernel, split_within

# frag_wgmma's Gluon pieces, module globals so that this module's kernel calls them as its own (same objects)
_issue, _plain_step, _w_offsets, _zs_start = (getattr(fragment_kernel(), n)
                                               for n in ("_issue", "_plain_step", "_w_offsets", "_zs_start"))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402


@gluon.jit
def grouped_frag_kernel(x_ptr, wf_ptr, zs_ptr, bias_ptr, out_ptr, offs_ptr, ws_ptr, count_ptr,
                        E, SLOTS, M, N, N_OUT, HALF, K, stride_x8, stride_om, stride_we, stride_ze, stride_be,
                        plane, K64, N16, group_k, steps_per_split, k_stop,
                        BM: gl.constexpr, RH: gl.constexpr, STAGES: gl.constexpr, BF16: gl.constexpr,
                        EVEN_K: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr,
                        ACTIVATION: gl.constexpr, GATED: gl.constexpr, COMPACT: gl.constexpr, EP: gl.constexpr,
                        num_warps: gl.constexpr, GROUP32: gl.constexpr = False):
    """``N``: the weight's rows as the workspace holds them (gated: ``2 * HALF``, each half padded to 16 rows);
    ``N_OUT``: the output's columns (gated: the up projection's first bias column too); ``plane``: M * N, the
    workspace's elements a K slice. Grid axis 1 has ``SLOTS + 1`` entries: the experts (``COMPACT``: the non-empty
    ones in order, SLOTS = M < E of them at most), then the rows past ``offs[-1]``."""
    RHT: gl.constexpr = num_warps * RH  # 16-row tiles of weights
    BN: gl.constexpr = 16 * RHT
    if GATED:
        BNO: gl.constexpr = BN // 2  # output columns a program: half its rows are the gate's, half the up's
    else:
        BNO: gl.constexpr = BN
    dt: gl.constexpr = x_ptr.dtype.element_ty
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    ql: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [num_warps, 1, 1, 1], [3, 2, 1, 0])
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    # the output tile [columns, rows] of the epilogue from the workspace and of the zeroed tail: columns fastest
    # across a warp's lanes, rows across the warps (BNO >= 32 columns: no element held twice)
    ol: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 64], dt)
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    pid_n = gl.program_id(0)
    slot = gl.program_id(1)
    split = gl.program_id(2)

    # this program's expert and rows, from offs on the device (clamped to [0, M], as the family's other kernels
    # clamp them); expert E: the rows past offs[-1], to be zeroed
    if COMPACT:
        # fewer rows than experts (a decode step over many experts): slot j takes the j-th non-empty expert, so the
        # grid holds M + 1 slots, not E + 1 (most experts get no row: their programs would only exit)
        el: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        gs = gl.arange(0, EP, layout=el)
        live = gs < E
        ends = gl.minimum(gl.maximum(gl.load(offs_ptr + gs, mask=live, other=0), 0), M)
        starts = gl.minimum(gl.maximum(gl.load(offs_ptr + gs - 1, mask=live & (gs > 0), other=0), 0), ends)
        full = live & (ends > starts)
        rank = gl.associative_scan(full.to(gl.int32), 0, _add)  # non-empty experts up to each (inclusive)
        hit = full & (rank == slot + 1)
        tail = slot == SLOTS
        e = gl.where(tail, E, gl.sum(gl.where(hit, gs, 0), axis=0))
        start = gl.where(tail, gl.max(gl.where(live, ends, 0), axis=0), gl.sum(gl.where(hit, starts, 0), axis=0))
        end = gl.where(tail, M, gl.sum(gl.where(hit, ends, 0), axis=0))
    else:
        e = slot
        end = gl.load(offs_ptr + e, mask=e < E, other=M)
        start = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = gl.minimum(gl.maximum(end, 0), M)
        start = gl.minimum(gl.maximum(start, 0), end)

    x_bufs = gl.allocate_shared_memory(dt, [STAGES, BM, 64], x_sl)
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, RHT, 1, 32, 4], w_sl)

    if e == E:
        if split == 0:
            cols = pid_n * BNO + gl.arange(0, BNO, layout=gl.SliceLayout(1, ol))
            rows = gl.arange(0, BM, layout=gl.SliceLayout(0, ol))
            for m0 in range(start, end, BM):
                om = m0 + rows
                ok = gl.expand_dims(cols < N_OUT, 1) & gl.expand_dims(om < end, 0)
                gl.store(out_ptr + gl.expand_dims(om.to(gl.int64) * stride_om, 0) + gl.expand_dims(cols, 1),
                         gl.zeros([BNO, BM], out_ptr.dtype.element_ty, ol), mask=ok)
    else:
        wf_e = wf_ptr + e.to(gl.int64) * stride_we
        zs_e = zs_ptr + e.to(gl.int64) * stride_ze
        t0, i2, w_offs = _w_offsets(pid_n, split, steps_per_split, K64, RHT, ql)  # the slice's first step's words
        kk = gl.arange(0, 64, layout=gl.SliceLayout(0, xl))
        k_first = split * steps_per_split * 64
        k_end = gl.minimum(k_first + steps_per_split * 64, k_stop)
        steps = gl.cdiv(k_end - k_first, 64)
        group_steps = group_k // 64
        for m0 in range(start, end, BM):
            # every warp is done with the previous row block's slots (its MMAs retired) before they are refilled
            gl.thread_barrier()
            mm = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, xl))
            x_offs = gl.expand_dims(mm.to(gl.int64) * stride_x8 * 8, 1) + gl.expand_dims(kk, 0)
            x_ok = gl.expand_dims(mm < end, 1)  # rows past the expert's: zeros (their columns are not stored)
            xr = 0
            pr = 0
            for i in gl.static_range(STAGES - 1):
                xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_e, w_offs, x_bufs, w_bufs, i, k_first, k_end, K,
                                STAGES, EVEN_K, None, xr, pr, False)
            left = 0
            g = k_first // group_k
            zs_row, za, zb, sa, sb, zz, ss = _zs_start(zs_e, t0, i2, N16, g, group_k, k_end, RHT, ql, GROUP32,
                                                       num_warps)
            acc = gl.zeros([BN, BM], gl.float32, acc_l)
            # frag_wgmma's loop below 64 rows (OVERLAP and PIPE off: at decode sizes the kernel waits on memory, not
            # on the MMA)
            for s in range(steps):
                acc, za, zb, sa, sb, zz, ss, left, g, xr, pr = _plain_step(
                    s, acc, x_ptr, x_offs, x_ok, kk, wf_e, w_offs, x_bufs, w_bufs, zs_e, zs_row, N16,
                    za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql, a_l, RHT,
                    STAGES, EVEN_K, BF16, GROUP32, None, xr, pr, False)
            async_copy.wait_group(0)
            _finish(acc, out_ptr, bias_ptr, ws_ptr, count_ptr, e, pid_n, split, m0, end, N, N_OUT, HALF, plane,
                    stride_om, stride_be, BN, BNO, BM, acc_l, ol, SPLIT_K, HAS_BIAS, ACTIVATION, GATED)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _finish(acc, out_ptr, bias_ptr, ws_ptr, count_ptr, e, pid_n, split, m0, end, N, N_OUT, HALF, plane,
            stride_om, stride_be, BN: gl.constexpr, BNO: gl.constexpr, BM: gl.constexpr, acc_l: gl.constexpr,
            ol: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
            GATED: gl.constexpr):
    """The tile ``acc`` ([weight rows, x rows m0 ..]) to the output: stored at once (unsplit, ungated), or through
    the workspace's fp32 planes ``[SPLIT_K, M, N]``, where the last slice to arrive at (row block, row tile)
    adds them in slice order and runs the epilogue on a plain [columns, rows] tile (gated: the gate's columns
    and the up projection's, ``HALF`` further on)."""
    nn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    om = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    bias_e = bias_ptr + e.to(gl.int64) * stride_be
    if (SPLIT_K == 1) and (not GATED):
        inside = gl.expand_dims(nn < N, 1) & gl.expand_dims(om < end, 0)
        if HAS_BIAS:
            acc += gl.expand_dims(gl.load(bias_e + nn, mask=nn < N, other=0.0).to(gl.float32), 1)
        acc = apply_activation(acc, ACTIVATION)
        gl.store(out_ptr + gl.expand_dims(om.to(gl.int64) * stride_om, 0) + gl.expand_dims(nn, 1),
                 acc.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        if GATED:
            # row nn of the program's tiles: tile t = nn // 16 holds row r of the gate (even t) or the up projection
            # (odd t); the padding's rows past both halves (r >= HALF) are not stored, or they would land on the
            # up projection's first columns
            t = nn // 16
            r = (t // 2) * 16 + nn % 16
            col = r + (t % 2) * HALF
            row_ok = r < HALF
        else:
            col = nn
            row_ok = nn < N
        inside = gl.expand_dims(row_ok, 1) & gl.expand_dims(om < end, 0)
        ws_tile = ws_ptr + gl.expand_dims(om.to(gl.int64) * N, 0) + gl.expand_dims(col, 1)
        gl.store(ws_tile + split * plane, acc, mask=inside)
        gl.thread_barrier()  # every thread's stores before the arrival (or, unsplit, before the loads below)
        cols = pid_n * BNO + gl.arange(0, BNO, layout=gl.SliceLayout(1, ol))
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, ol))
        if SPLIT_K == 1:
            _epilogue(out_ptr, bias_e, ws_ptr, cols, rows, end, N, N_OUT, HALF, plane, stride_om, BNO, BM, ol, 1,
                      HAS_BIAS, ACTIVATION, GATED)
        else:
            tile = m0 * gl.num_programs(0) + pid_n  # a row block starts at its own row: one counter each
            arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                gl.thread_barrier()  # every thread's loads after the acquire
                gl.store(count_ptr + tile, 0)
                _epilogue(out_ptr, bias_e, ws_ptr, cols, rows, end, N, N_OUT, HALF, plane, stride_om, BNO, BM,
                          ol, SPLIT_K, HAS_BIAS, ACTIVATION, GATED)


@gluon.jit
def _epilogue(out_ptr, bias_e, ws_ptr, cols, rows, end, N, N_OUT, HALF, plane, stride_om, BNO: gl.constexpr,
              BM: gl.constexpr, ol: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr,
              ACTIVATION: gl.constexpr, GATED: gl.constexpr):
    """out[rows, cols] = activation(sum of the slices + bias) (gated: times the up projection's), from the
    workspace in slice order."""
    ok = gl.expand_dims(cols < N_OUT, 1) & gl.expand_dims(rows < end, 0)
    tile = ws_ptr + gl.expand_dims(rows.to(gl.int64) * N, 0) + gl.expand_dims(cols, 1)
    acc = gl.zeros([BNO, BM], gl.float32, ol)
    for s in range(0, SPLIT_K):
        acc += gl.load(tile + s * plane, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += gl.expand_dims(gl.load(bias_e + cols, mask=cols < N_OUT, other=0.0).to(gl.float32), 1)
    acc = apply_activation(acc, ACTIVATION)
    if GATED:
        up = gl.zeros([BNO, BM], gl.float32, ol)
        for s in range(0, SPLIT_K):
            up += gl.load(tile + HALF + s * plane, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            up += gl.expand_dims(gl.load(bias_e + N_OUT + cols, mask=cols < N_OUT, other=0.0).to(gl.float32), 1)
        acc = acc * up
    gl.store(out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_om, 0) + gl.expand_dims(cols, 1),
             acc.to(out_ptr.dtype.element_ty), mask=ok)


# --- launch ----------------------------------------------------------------------------------------------------


def frag_config(p: GroupedInt4Problem, packed_rows: int) -> dict:
    """The config of a problem whose weight holds ``packed_rows`` rows (gated: both halves): the table
    :data:`tilegemm.ops.grouped.configs.INT4_FRAG` keyed by the rows an expert, the K split that fills the GPU
    (at BM 32 also one that keeps every slice within ``INT4_FRAG_MAX_SLICE_STEPS`` steps)."""
    rows_factor, block_ms, warps, rh, stages = INT4_FRAG
    rows = rows_factor * p.M / max(p.groups, 1)
    bm = next((b for b in block_ms if rows <= b), block_ms[-1])
    tiles = cdiv(packed_rows, 16 * rh * warps) * row_tiles(p.M, p.groups, bm)
    per_sm = FRAG_WGMMA_PROGRAMS_PER_SM[0 if bm <= 16 else 1]
    steps = cdiv(p.K, 64)
    split = split_within(tiles, steps, per_sm * sm_count(p.x.device), 8)
    while bm >= 32 and cdiv(steps, split) > INT4_FRAG_MAX_SLICE_STEPS and split * 2 <= MAX_SPLIT:
        split *= 2
    return dict(BM=bm, RH=rh, num_warps=warps, STAGES=stages, SPLIT_K=split)


def launch_args(x, fw, fzs, bias, out, offs, N_out: int, K: int, group_k: int, activation: str, gated: bool,
                cfg: dict):
    """(kernel, grid, args, kwargs, workspace) for the experts' product from the stacked fragments ``fw``
    ``[E, N16, K64, 32, 4]`` and ``fzs`` ``[E, G', N16, 8, 4]`` (gated: of the rows in ``gate_up_tiles``' order);
    ``out`` ``[M, N_out]``; workspace: the (planes, counters) the launch keeps, or None."""
    M, E = x.shape[0], fw.shape[0]
    if fw.dim() != 5 or fzs.dim() != 5 or fzs.shape[0] != E or fzs.shape[2] != fw.shape[1] \
            or fw.dtype != torch.int32 or fzs.dtype != x.dtype or not fw.is_contiguous() or not fzs.is_contiguous():
        raise ValueError(f"frag: the stacked fragments must be contiguous int32 [E, N16, K64, 32, 4] and "
                         f"[E, G, N16, 8, 4] in x's dtype, got {fw.dtype} {list(fw.shape)} and {fzs.dtype} "
                         f"{list(fzs.shape)}")
    n16, k64 = fw.shape[1], fw.shape[2]
    half = cdiv(N_out, 16) * 16 if gated else 0
    N = 2 * half if gated else N_out  # the weight's rows as the workspace holds them
    if n16 * 16 < N or k64 * 64 < K:
        raise ValueError(f"frag: fragments of {n16 * 16} x {k64 * 64} do not hold a weight of {N} rows and K = {K}")
    rh, bm, split, warps = cfg["RH"], cfg["BM"], cfg["SPLIT_K"], cfg["num_warps"]
    steps = cdiv(K, 64)
    if group_k >= K:  # one group (all of K): it spans every step, the padded last one included
        group_k = steps * 64
    if group_k % 64 and group_k != 32:
        raise ValueError(f"frag: the group length {group_k} must be 32, a multiple of the K step 64, or all of K")
    if fzs.shape[1] * group_k < k64 * 64:
        raise ValueError(f"frag: {fzs.shape[1]} groups of {group_k} do not cover the fragments' {k64 * 64} inputs")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(f"frag: x's rows must be contiguous and 16-byte aligned (row stride a multiple of 8 "
                         f"elements), got strides {x.stride()} at {x.data_ptr() % 16} bytes past 16")
    if cfg["STAGES"] < 2:
        raise ValueError("frag: the ring needs STAGES >= 2 (a step read while the next loads)")
    if bm not in (8, 16, 32, 64):
        raise ValueError(f"frag: BM = {bm} must be 8, 16, 32 or 64 (x's rows a program: wgmma's N, at decode sizes)")
    per_split = cdiv(steps, max(1, min(split, steps)))
    split = cdiv(steps, per_split)
    if 256 % (16 * rh * warps):
        raise ValueError(f"frag: a program's {16 * rh * warps} weight rows must divide the fragments' 256-row padding")
    tiles_n = cdiv(N, 16 * rh * warps)  # (the padding's rows past N hold zeros: no program for them)
    workspace = None
    if split > 1 or gated:  # gated: the two halves meet in the planes even unsplit
        workspace = split_workspace(x.device, split * M * N, M * tiles_n, tag="grouped")
        ws, count = workspace
    else:
        ws, count = out, out  # unused
    stride_be = 0 if bias is None or bias.dim() == 1 else bias.stride(0)
    zs32 = fzs.view(torch.int32)  # a (zero, scale) pair of 16-bit values a word
    slots = min(E, M)  # at most M experts hold rows
    args = (x, fw, zs32, bias if bias is not None else out, out, offs, ws, count, E, slots, M, N, N_out, half, K,
            x.stride(0) // 8, out.stride(0), fw.stride(0), zs32.stride(0), stride_be, M * N, k64, n16, group_k,
            per_split, steps * 64)
    kwargs = dict(BM=bm, RH=rh, STAGES=cfg["STAGES"], BF16=x.dtype == torch.bfloat16, EVEN_K=K % 64 == 0,
                  SPLIT_K=split, HAS_BIAS=bias is not None, ACTIVATION=activation, GATED=gated,
                  COMPACT=slots < E, EP=max(32 * warps, 1 << (E - 1).bit_length()),  # offs' vector: a lane each
                  GROUP32=group_k == 32, num_warps=warps)
    return grouped_frag_kernel, (tiles_n, slots + 1, split), args, kwargs, workspace


def why_not(p: GroupedInt4Problem) -> str | None:
    """None when this kernel takes ``p`` on this machine; otherwise why not."""
    reason = why_not_gluon()
    if reason is not None:
        return reason
    if p.x.device.type != "cuda":
        return f"x is on {p.x.device}, not a CUDA GPU"
    if not fits_fragments(p.group_k, p.K):
        return f"the fragment layout takes groups of 32, a multiple of 64 or all of K, not {p.group_k}"
    if p.fweight is None or p.fzs is None:
        return "the stacked experts' fragment layout was not given (Int4Weight.fragments())"
    return None


def run(p: GroupedInt4Problem, config: dict | None = None) -> None:
    reason = why_not(p)
    if reason is not None:
        raise NotApplicable(f"grouped_w4a16 kernel 'frag' does not take this problem: {reason}")
    if p.M == 0 or p.N == 0:
        return
    # 16-byte copies need x's rows 16-byte aligned: copied where they are not (such a call is not replayed: the
    # copy is no tensor of the call)
    x = p.x if p.x.stride(1) == 1 and p.x.stride(0) % 8 == 0 and p.x.data_ptr() % 16 == 0 else \
        p.x.clone(memory_format=torch.contiguous_format)  # (K is a multiple of 8: the copy's rows are aligned)
    cfg = dict(config or frag_config(p, 2 * cdiv(p.N, 16) * 16 if p.gated else p.N))
    kernel, grid, args, kwargs, workspace = launch_args(x, p.fweight, p.fzs, p.bias, p.out, p.offs, p.N, p.K,
                                                        p.group_k, p.activation, p.gated, cfg)
    if workspace is None:
        launch(kernel, grid, args, kwargs)
    else:  # the launcher's workspace, made for the current stream: a replay passes it and declines elsewhere
        launch(kernel, grid, args, kwargs, keep=workspace, stream=current_stream())
