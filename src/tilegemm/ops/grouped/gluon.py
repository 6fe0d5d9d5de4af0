"""Kernel ``gluon``: the MoE forward (2-D x 3-D) on the dense family's warp-specialized skeleton (Gluon, sm_90).

``tma`` (Triton) pipelines its K loop in one warp group's program order: the loads, the MMAs and the epilogue take
turns. Here the parts of :mod:`tilegemm.ops.matmul.gluon_f16` run side by side: a producer warp group keeps a ring
of TMA-filled slots ahead, two consumer warp groups take half of each output tile's rows each (``fill_ring``'s and
``_consumer``'s protocol: a "ready" and an "empty" mbarrier a slot), so one tile's epilogue overlaps the next
tile's loads. What is the grouped family's own:

- **The plan.** A small Triton kernel (:func:`plan_kernel`, also run by the interpreter's tests) reads ``offs``
  on the device and writes the row tiles: ``plan[0]`` their number, then per row tile its group, first row and
  end row (the group's end; ``M`` for the tail). Each group's rows start a new tile; the rows past ``offs[-1]``
  make tail tiles of group ``G`` (stored as zeros). Both warp-specialized partitions read the plan, so neither
  scans ``offs`` (a scan needs reductions across warps) and nothing is read on the host.
- **Work units** are (row tile, column tile) pairs in grouped order over the plan's row tiles
  (:func:`tilegemm.jit.helpers.tile_grouped`): programs at work together share a group's weight panels in L2.
- **Operands by TMA from host descriptors**: a as ``[M, K]`` (a tile runs from its group's first row and may read
  the next group's rows, never stored), b as the 3-D ``[G, K, N]`` or ``[G, N, K]`` (column-major experts, torch's
  ``[E, N, K]`` weight transposed) in ``[1, rows, cols]`` boxes: K past its end reads zeros inside the expert.
- **The epilogue**: bias (``[N]`` or ``[G, N]``), activation; a consumer's half tile wholly inside its group goes out
  by a TMA store, a half tile that crosses the group's end by pointer stores masked to the group's rows.

Not here (``tma`` takes them): the gated product, fp32 outputs, K split for decode-sized problems. Measurements:
docs/grouped.md, "Kernels".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma,
)

from tilegemm.core.hardware import ring_fits, sm_count, tma_aligned, why_not_gluon
from tilegemm.core.launch import current_stream, launch, sequence_lock
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv
from tilegemm.core.workspace import buffer
from tilegemm.jit.helpers import apply_activation, tile_grouped
from tilegemm.ops.grouped import configs as table
from tilegemm.ops.grouped.configs import GLUON_LONG_K_STEPS, GLUON_TILES, row_tiles
from tilegemm.ops.grouped.problem import GroupedProblem
from tilegemm.ops.grouped.tiled import _pow2, jagged_groups
from tilegemm.ops.grouped.tma import _stride, operands_reason
from tilegemm.jit.gluon import (
    CONSUMER_REGS, PRODUCER_REGS, batched_host_descriptor, consume_k_steps, host_descriptor, release_ring_barriers,
    ring_barriers,
)

PLAN_FIELDS = 3  # a row tile's group, first row, end row
PLAN_BLOCK = 64  # row tiles a program of the plan kernel


@triton.jit
def plan_kernel(offs_ptr, plan_ptr, G, M, R_MAX, GP: tl.constexpr, BLOCK_M: tl.constexpr, RB: tl.constexpr):
    """Row tiles ``pid * RB ...`` of the plan (see the module's notes); program 0 also stores their number."""
    starts, ends, tiles, ends_tiles, group_tiles, last = jagged_groups(offs_ptr, G, M, GP, BLOCK_M)
    total = group_tiles + tl.cdiv(M - last, BLOCK_M)
    if tl.program_id(0) == 0:
        # at most the R_MAX rows written: offs that decrease (not checked on the device) can count more, and rows
        # past R_MAX would be stale; the launch's grid is sized by R_MAX too
        tl.store(plan_ptr, tl.minimum(total, R_MAX))
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    gs = tl.arange(0, GP)
    # the group holding row tile r; G for the tail (the padded groups' tile counts are 0, so they count too)
    g = tl.minimum(tl.sum((ends_tiles[None, :] <= r[:, None]).to(tl.int32), 1), G)
    here = gs[None, :] == g[:, None]
    tail = g >= G
    first_tile = tl.where(tail, group_tiles, tl.sum(tl.where(here, (ends_tiles - tiles)[None, :], 0), 1))
    start = tl.where(tail, last, tl.sum(tl.where(here, starts[None, :], 0), 1))
    end = tl.where(tail, M, tl.sum(tl.where(here, ends[None, :], 0), 1))
    row = plan_ptr + 1 + r * 3
    ok = (r < total) & (r < R_MAX)
    tl.store(row, g, mask=ok)
    tl.store(row + 1, start + (r - first_tile) * BLOCK_M, mask=ok)
    tl.store(row + 2, end, mask=ok)


@gluon.jit
def _unit(unit, plan_ptr, tiles_m, tiles_n, GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(group, first row, end row, first column) of work unit ``unit`` (the tail's group is G)."""
    tm, tn = tile_grouped(unit, tiles_m, tiles_n, GROUP_M)
    row = plan_ptr + 1 + tm * 3
    return gl.load(row), gl.load(row + 1), gl.load(row + 2), tn * BLOCK_N


@gluon.jit
def _fill(a_desc, b_desc, a_bufs, b_bufs, ready, empty, plan_ptr, G, N, K, programs,
          B_NK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer: every K step of every unit of this program into ring slot ``count % STAGES`` once the slot's
    "empty" barrier says it was read (as :func:`tilegemm.ops.matmul.gluon_f16.fill_ring`); the tail's units load
    nothing."""
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m = gl.load(plan_ptr)
    tiles_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for unit in range(gl.program_id(0), tiles_m * tiles_n, programs):
        g, m0, end, n0 = _unit(unit, plan_ptr, tiles_m, tiles_n, GROUP_M, BLOCK_N)
        for ks in range(steps * (g < G).to(gl.int32)):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            k0 = ks * BLOCK_K
            tma.async_copy_global_to_shared(a_desc, [m0, k0], bar, a_bufs.index(slot))
            if B_NK:
                tma.async_copy_global_to_shared(b_desc, [g, n0, k0], bar, b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [g, k0, n0], bar, b_bufs.index(slot))
            count += 1


@gluon.jit
def _consume(a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, out_ptr, bias_ptr, plan_ptr, G, M, N, K,
             s_om, s_cg, s_cn, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, B_NK: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
             GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, SHARED_OUT: gl.constexpr, WG: gl.constexpr):
    """Consumer warp group ``WG``: the MMAs and epilogue of rows ``WG * BLOCK_M / 2 ...`` of every unit (the
    slot protocol of :mod:`tilegemm.ops.matmul.gluon_f16`'s consumers). With ``SHARED_OUT`` the two take turns
    at one output buffer, whichever way each stores."""
    ROWS: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = WG * ROWS
    o_ty: gl.constexpr = o_desc.dtype
    o_smem = o_bufs.index(0 if SHARED_OUT else WG)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    tiles_m = gl.load(plan_ptr)
    tiles_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    count = 0
    j = 0  # units done
    for unit in range(gl.program_id(0), tiles_m * tiles_n, NUM_SMS):
        g, m0, end, n0 = _unit(unit, plan_ptr, tiles_m, tiles_n, GROUP_M, BLOCK_N)
        live = g < G
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        if live:
            acc, count = consume_k_steps(a_bufs, b_bufs, ready, empty, acc, count, steps, ROW0, ROWS, False, B_NK,
                                         STAGES, False, True)

        offs_m = m0 + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        if HAS_BIAS:
            gg = gl.minimum(g, G - 1).to(gl.int64)  # (the tail reads no group's bias: zeroed below)
            acc += gl.expand_dims(gl.load(bias_ptr + gg * s_cg + offs_n * s_cn, mask=offs_n < N, other=0.0)
                                  .to(gl.float32), 0)
        acc = apply_activation(acc, ACTIVATION)
        acc = gl.where(live, acc, 0.0)  # the tail's rows: zeros, whatever the activation of zero
        whole = m0 + ROW0 + ROWS <= end  # this half tile lies in its group: one TMA store (clipped at M and N)
        if SHARED_OUT:
            # warp group 0 goes first in every unit; each hands the buffer on once its store has read it
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        else:
            tma.store_wait(pendings=0)  # this warp group's previous store has left its buffer
        if whole:
            o_smem.store(acc.to(o_ty))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [m0 + ROW0, n0], o_smem)
        else:
            ok = gl.expand_dims(offs_m < gl.minimum(end, M), 1) & gl.expand_dims(offs_n < N, 0)
            ptrs = out_ptr + gl.expand_dims(offs_m.to(gl.int64) * s_om, 1) + gl.expand_dims(offs_n, 0)
            gl.store(ptrs, acc.to(o_ty), mask=ok)
        if SHARED_OUT:
            tma.store_wait(pendings=0)
            mbarrier.arrive(turn.index(1 - WG), count=1)
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_gluon_kernel(
    a_desc, b_desc, o_desc, out_ptr, bias_ptr, plan_ptr,
    G, M, N, K, s_om, s_cg, s_cn,
    B_NK: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, SHARED_OUT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    # a: [M, K] in [BLOCK_M, BLOCK_K] boxes; b: [G, K, N] (or B_NK [G, N, K]) in [1, BLOCK_K, BLOCK_N] boxes (the
    # slots read as 2-D tiles: jit.gluon.flat_slot); the output [M, N] in [BLOCK_M / 2, BLOCK_N] boxes
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if B_NK:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 1, BLOCK_N, BLOCK_K], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 1, BLOCK_K, BLOCK_N], b_desc.layout)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [1 if SHARED_OUT else 2, BLOCK_M // 2, BLOCK_N], o_desc.layout)
    ready, empty, turn = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consume, (a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, out_ptr, bias_ptr, plan_ptr, G, M, N, K,
                    s_om, s_cg, s_cn, HAS_BIAS, ACTIVATION, B_NK, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                    NUM_SMS, SHARED_OUT, 0)),
        (_consume, (a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, out_ptr, bias_ptr, plan_ptr, G, M, N, K,
                    s_om, s_cg, s_cn, HAS_BIAS, ACTIVATION, B_NK, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                    NUM_SMS, SHARED_OUT, 1)),
        (_fill, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, plan_ptr, G, N, K, NUM_SMS, B_NK, BLOCK_M, BLOCK_N,
                 BLOCK_K, STAGES, GROUP_M)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    release_ring_barriers(ready, empty, turn, STAGES)


# --- host side ---------------------------------------------------------------------------------------------


def why_not(p: GroupedProblem) -> str | None:
    """None when this kernel takes ``p``; otherwise why not (``tma`` and ``tiled`` take the rest)."""
    reason = why_not_gluon()
    if reason is not None:
        return reason
    reason = operands_reason(p)  # tma's: the layout, dtypes, strides and alignment TMA takes
    if reason is not None:
        return reason
    if p.out.dtype != p.dtype:
        return f"stores the operands' dtype ({p.dtype}), not {p.out.dtype}"
    if p.gated:
        return "the gated product (two accumulators) runs on tma"
    out = p.out
    if out.stride(1) != 1 and out.shape[1] > 1:
        return "the output is not row-major"
    if not tma_aligned(out, _stride(out, 0)):
        return "the output's base or row stride is not 16-byte aligned"
    return None


def configs() -> list[dict]:
    """:data:`~tilegemm.ops.grouped.configs.GLUON_TILES` whose rings fit beside their output buffers."""
    def out_bytes(c):  # one output buffer the consumers share, or one each, of [BLOCK_M / 2, BLOCK_N] 16-bit values
        return c["BLOCK_M"] * c["BLOCK_N"] * 2 // (2 if c["SHARED_OUT"] else 1)

    return [dict(c) for c in GLUON_TILES if ring_fits(c["BLOCK_M"], c["BLOCK_N"], 64, c["STAGES"], out_bytes(c))]


def config(p: GroupedProblem) -> dict:
    """The config of ``p``: of :func:`configs` with the tile :data:`~tilegemm.ops.grouped.configs.GLUON_BLOCK`
    (read at the call: a knob of the candidates tool), from GLUON_LONG_K_STEPS K steps the first with the output
    buffer shared (the deeper ring), below it the first with a buffer a consumer (each store overlaps the next
    unit's MMAs)."""
    shared = cdiv(p.K, 64) >= GLUON_LONG_K_STEPS
    options = [c for c in configs() if (c["BLOCK_M"], c["BLOCK_N"]) == tuple(table.GLUON_BLOCK)] or configs()
    return next((c for c in options if c["SHARED_OUT"] == shared), options[0])


def plan(p: GroupedProblem, block_m: int) -> torch.Tensor:
    """Launch :func:`plan_kernel` for ``p``'s row tiles of ``block_m`` rows; the plan (int32, a scratch of the
    stream's, :func:`tilegemm.core.workspace.buffer`: a replay passes it as recorded)."""
    r_max = row_tiles(p.M, p.groups, block_m)
    table = buffer(p.out.device, torch.int32, 1 + PLAN_FIELDS * r_max, tag="grouped_plan")
    launch(plan_kernel, (max(cdiv(r_max, PLAN_BLOCK), 1),),
           (p.offs, table, p.groups, p.M, r_max),
           dict(GP=_pow2(p.groups), BLOCK_M=block_m, RB=PLAN_BLOCK, num_warps=4),
           keep=(table,), stream=current_stream())
    return table


def launch_args(p: GroupedProblem, cfg: dict, table: torch.Tensor, num_sms: int):
    """(kernel, grid, args, constexpr kwargs) of the main launch over ``table`` (:func:`plan`)."""
    a, b, out, bias = p.a, p.b, p.out, p.bias
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("BLOCK_K", 64)
    b_nk = b.stride(2) != 1
    a_desc = host_descriptor(a, [p.M, p.K], _stride(a, 0), [bm, bk])
    if b_nk:  # [G, N, K]: torch's [E, N, K] weight transposed
        b_desc = batched_host_descriptor(b, p.groups, _stride(b, 0), [b.shape[2], p.K], _stride(b, 2), [bn, bk])
    else:
        b_desc = batched_host_descriptor(b, p.groups, _stride(b, 0), [p.K, b.shape[2]], _stride(b, 1), [bk, bn])
    o_desc = host_descriptor(out, [p.M, p.N], _stride(out, 0), [bm // 2, bn])
    c = (0, 0)
    if bias is not None:
        c = (bias.stride(0), bias.stride(1)) if bias.dim() == 2 else (0, bias.stride(0))
    units = row_tiles(p.M, p.groups, bm) * cdiv(p.N, bn)
    args = (a_desc, b_desc, o_desc, out, bias if bias is not None else out, table,
            p.groups, p.M, p.N, p.K, _stride(out, 0), *c)
    kwargs = dict(B_NK=b_nk, HAS_BIAS=bias is not None, ACTIVATION=p.activation, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk, STAGES=cfg["STAGES"], GROUP_M=cfg.get("GROUP_M", 8), NUM_SMS=num_sms,
                  SHARED_OUT=cfg["SHARED_OUT"], CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  num_warps=4)
    return grouped_gluon_kernel, (max(1, min(num_sms, units)),), args, kwargs


def run(p: GroupedProblem, config_: dict | None = None) -> None:
    reason = why_not(p)
    if reason is not None:
        raise NotApplicable(f"grouped kernel 'gluon' does not take this problem: {reason}")
    if p.M == 0 or p.N == 0:
        return
    cfg = dict(config_ or config(p))
    with sequence_lock:  # the plan is the stream's: no other thread's launches between the two
        table = plan(p, cfg["BLOCK_M"])
        kernel, grid, args, kwargs = launch_args(p, cfg, table, sm_count(p.out.device))
        launch(kernel, grid, args, kwargs, keep=(table,), stream=current_stream())
