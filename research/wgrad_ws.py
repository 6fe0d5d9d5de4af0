"""A warp-specialized TMA weight gradient (research): a producer warp group fills a ring of pixel patches, two
consumer warp groups take the two halves of a 128-row tile of output channels, and the work (every tile's
pixel steps, tile after tile) is cut into equal ranges, one per program (as stream-K does for GEMMs).

Per filter tap the weight gradient is ``dw[K, C] = dy^T[K, pixels] @ x_tap[pixels, C]``. A *unit* is one
[128 output channels, BLOCK_N input channels] tile of one tap; its ``patches`` steps each load a patch of
output pixels' gradients (a box of channels-last ``dy`` as ``[N, P, Q, K]``) and the input pixels under it
for the tap (a box of ``tma_fwd``'s strided 5-D view of ``x``), as :mod:`tilegemm.ops.conv2d.tma_wgrad` does.
The ``units * patches`` steps are dealt to the programs in equal consecutive ranges. A unit whose steps one
program covers is stored directly; otherwise each contributing program stores its partial tile (fp32) in its
own plane (one for the first unit of its range, one for the last) and the last to arrive adds the
contributors' planes in program order: deterministic, one launch.

Written against Triton 3.6's Gluon API, for sm_90.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilegemm.core.runtime import cdiv
from tilegemm.ops.conv2d.tma_fwd import _strides, input_descriptor, tap_offsets
from tilegemm.ops.conv2d.tma_wgrad import _issue

BLOCK_M = 128
CONSUMER_REGS = 232
PRODUCER_REGS = 40


@gluon.jit
def _program_of(w, programs, work):
    """The program whose range holds step ``w`` (ranges: [p * work // programs, (p + 1) * work // programs))."""
    return ((w + 1) * programs - 1) // work


@gluon.jit
def _unit(unit, tiles_n, tiles_mn, R: gl.constexpr, S: gl.constexpr):
    """(group, r, s, output-channel tile, input-channel tile) of a unit."""
    tap = unit // tiles_mn
    t = unit % tiles_mn
    return tap // (R * S), (tap % (R * S)) // S, tap % S, t // tiles_n, t % tiles_n


@gluon.jit
def _producer(dy_desc, x_desc, a_bufs, b_bufs, ready, empty, Kg, Cg, C_ROW, tiles_p, tiles_q, patches, tiles_n,
              tiles_mn, work, pad_h, pad_w, dil_h, dil_w, off_h, off_w,
              R: gl.constexpr, S: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr, BI: gl.constexpr,
              BH: gl.constexpr, BW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, LOADS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    start = pid * work // programs
    end = (pid + 1) * work // programs
    count = 0
    for w in range(start, end):
        grp, r, s, pid_m, pid_n = _unit(w // patches, tiles_n, tiles_mn, R, S)
        eh = r * dil_h - pad_h + off_h
        ew = s * dil_w - pad_w + off_w
        slot = count % STAGES
        mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
        if LOADS:
            _issue(dy_desc, x_desc, a_bufs.index(slot), b_bufs.index(slot), ready.index(slot), w % patches, tiles_p,
                   tiles_q, grp * Kg + pid_m * BLOCK_M, grp * Cg + pid_n * BLOCK_N, eh // SH - off_h // SH, eh % SH,
                   ew // SW - off_w // SW, ew % SW, C_ROW, BI, BH, BW)
        else:
            mbarrier.arrive(ready.index(slot), count=1)
        count += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, dw_ptr, ws_ptr, count_ptr, Kg, Cg, patches, tiles_n, tiles_mn, work,
              stride_dk, stride_dc, stride_dr, stride_ds,
              R: gl.constexpr, S: gl.constexpr, BI: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
              MMAS: gl.constexpr, EPILOGUE: gl.constexpr):
    PIX: gl.constexpr = BI * BH * BW
    ROWS: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = WG * ROWS
    PLANE: gl.constexpr = ROWS * BLOCK_N
    dtype: gl.constexpr = a_bufs.dtype
    flat: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    start = pid * work // programs
    end = (pid + 1) * work // programs
    first_unit = start // patches
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    local = rows[:, None] * BLOCK_N + cols[None, :]
    count = 0
    for unit in range(first_unit, (end - 1) // patches + 1):
        lo = gl.maximum(start, unit * patches)
        hi = gl.minimum(end, unit * patches + patches)
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        a = a_bufs.index(slot)._reinterpret(dtype, [PIX, BLOCK_M], flat).slice(ROW0, ROWS, dim=1).permute((1, 0))
        b = b_bufs.index(slot)._reinterpret(dtype, [PIX, BLOCK_N], flat)
        if MMAS:
            acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
        for _ in range(lo + 1, hi):
            prev = slot
            count += 1
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            a = a_bufs.index(slot)._reinterpret(dtype, [PIX, BLOCK_M], flat).slice(ROW0, ROWS, dim=1).permute((1, 0))
            b = b_bufs.index(slot)._reinterpret(dtype, [PIX, BLOCK_N], flat)
            if MMAS:
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(slot), count=1)
        count += 1

        if EPILOGUE:
            grp, r, s, pid_m, pid_n = _unit(unit, tiles_n, tiles_mn, R, S)
            offs_m = pid_m * BLOCK_M + ROW0 + rows
            offs_n = pid_n * BLOCK_N + cols
            inside = (offs_m < Kg)[:, None] & (offs_n < Cg)[None, :]
            dw_tile = (dw_ptr + r * stride_dr + s * stride_ds + ((grp * Kg + offs_m) * stride_dk)[:, None]
                       + (offs_n * stride_dc)[None, :])
            if (lo == unit * patches) & (hi == unit * patches + patches):
                gl.store(dw_tile, acc.to(dw_ptr.dtype.element_ty), mask=inside)
            else:
                # This program's part of the unit into its plane (0: the first unit of its range, 1: the last); the
                # last contributor to arrive adds the contributors' planes in program order.
                mine = (pid * 2 + (unit != first_unit).to(gl.int32)) * 2 + WG
                gl.store(ws_ptr + mine.to(gl.int64) * PLANE + local, acc)
                gl.thread_barrier()  # this warp group's stores before its (one-thread) release
                p_first = _program_of(unit * patches, programs, work)
                p_last = _program_of(unit * patches + patches - 1, programs, work)
                arrived = gl.atomic_add(count_ptr + unit * 2 + WG, 1, sem="acq_rel", scope="gpu")
                if arrived == p_last - p_first:
                    gl.thread_barrier()  # and its loads after the acquire
                    total = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
                    # Two contributors' planes in flight at a time (one at a time waits out their latencies
                    # in a row).
                    for q0 in range(p_first, p_last + 1, 2):
                        for j in gl.static_range(2):
                            q = gl.minimum(q0 + j, p_last)
                            theirs = (q * 2 + (unit != (q * work // programs) // patches).to(gl.int32)) * 2 + WG
                            more = (local < PLANE) & (q0 + j <= p_last)
                            total += gl.load(ws_ptr + theirs.to(gl.int64) * PLANE + local, mask=more, other=0.0,
                                             cache_modifier=".cg")
                    gl.store(count_ptr + unit * 2 + WG, 0)
                    gl.store(dw_tile, total.to(dw_ptr.dtype.element_ty), mask=inside)


@gluon.jit
def conv2d_wgrad_ws_kernel(
    dy_desc, x_desc, dw_ptr, ws_ptr, count_ptr,
    Kg, Cg, C_ROW, tiles_p, tiles_q, patches, tiles_n, tiles_mn, work,
    stride_dk, stride_dc, stride_dr, stride_ds,
    pad_h, pad_w, dil_h, dil_w, off_h, off_w,
    R: gl.constexpr, S: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr,
    BI: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    LOADS: gl.constexpr = True, MMAS: gl.constexpr = True, EPILOGUE: gl.constexpr = True,
):
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BI, BH, BW, BLOCK_M], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BI, BH, 1, BW, BLOCK_N], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, dw_ptr, ws_ptr, count_ptr, Kg, Cg, patches, tiles_n, tiles_mn,
                     work, stride_dk, stride_dc, stride_dr, stride_ds, R, S, BI, BH, BW, BLOCK_M, BLOCK_N, STAGES, 0, MMAS, EPILOGUE)),
        (_consumer, (a_bufs, b_bufs, ready, empty, dw_ptr, ws_ptr, count_ptr, Kg, Cg, patches, tiles_n, tiles_mn,
                     work, stride_dk, stride_dc, stride_dr, stride_ds, R, S, BI, BH, BW, BLOCK_M, BLOCK_N, STAGES, 1, MMAS, EPILOGUE)),
        (_producer, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, Kg, Cg, C_ROW, tiles_p, tiles_q, patches,
                     tiles_n, tiles_mn, work, pad_h, pad_w, dil_h, dil_w, off_h, off_w, R, S, SH, SW, BI, BH, BW,
                     BLOCK_M, BLOCK_N, STAGES, LOADS)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def launch_args(dy, x, g, dw, ws, count, pix: int, bn: int, stages: int, programs: int, **flags):
    """(kernel, grid, args, kwargs) of the weight gradient ``dw`` ([K, C/groups, R, S])."""
    from tilegemm.ops.conv2d.configs import _patch

    bi, bh, bw, patches = _patch(g, pix)
    tiles_n = cdiv(g.Cg, bn)
    tiles_mn = cdiv(g.Kg, BLOCK_M) * tiles_n
    work = tiles_mn * g.R * g.S * g.groups * patches
    programs = min(programs, work)
    layout4 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    layout5 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=5)
    sn, sp, sq = _strides(dy)
    dy_desc = TensorDescriptor(dy, [g.N, g.P, g.Q, g.K], [sn, sp, sq, 1], [bi, bh, bw, BLOCK_M], layout4)
    x_desc = input_descriptor(x, g, [bi, bh, 1, bw, bn], layout5)
    off_h, off_w = tap_offsets(g)
    args = (dy_desc, x_desc, dw, ws, count, g.Kg, g.Cg, g.C, cdiv(g.P, bh), cdiv(g.Q, bw), patches, tiles_n,
            tiles_mn, work, *dw.stride(), g.padding[0], g.padding[2], g.dilation[0], g.dilation[1], off_h, off_w)
    kwargs = dict(R=g.R, S=g.S, SH=g.stride[0], SW=g.stride[1], BI=bi, BH=bh, BW=bw, BLOCK_M=BLOCK_M,
                  BLOCK_N=bn, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    kwargs.update(flags)  # CONSUMER_REGS=104 lets two programs share an SM (research)
    return conv2d_wgrad_ws_kernel, (programs,), args, kwargs


def workspace_sizes(g, pix: int, bn: int, programs: int) -> tuple[int, int]:
    """(fp32 planes, counters) the launch needs."""
    from tilegemm.ops.conv2d.configs import _patch

    units = cdiv(g.Kg, BLOCK_M) * cdiv(g.Cg, bn) * g.R * g.S * g.groups
    return programs * 4 * (BLOCK_M // 2) * bn, units * 2


def run(dy: torch.Tensor, x: torch.Tensor, g, out_dtype, pix: int = 64, bn: int = 128, stages: int = 6,
        programs: int | None = None, memory_format=torch.contiguous_format, **flags) -> torch.Tensor:
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d
    from tilegemm.core.workspace import split_workspace

    programs = programs or sm_count(dy.device)
    dw = empty_4d((g.K, g.Cg, g.R, g.S), out_dtype, dy.device, memory_format)
    ws, count = split_workspace(dy.device, *workspace_sizes(g, pix, bn, programs), tag="wgrad-ws")
    kernel, grid, args, kwargs = launch_args(dy, x, g, dw, ws, count, pix, bn, stages, programs, **flags)
    kernel[grid](*args, **kwargs)
    return dw
