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

Self-contained: the geometry, the TMA descriptors and the patch rule are written here as the shipped kernel
(``ops/conv2d/tma_wgrad.py``, ``tma_fwd.py``) has them, so the exploration uses only tilegemm's public API and
documented internals (``hardware.sm_count``, ``workspace.split_workspace``). The ``LOADS`` / ``MMAS`` /
``EPILOGUE`` flags leave a part out, for ablations. Written against Triton 3.6's Gluon API, for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton import cdiv
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilegemm.core.hardware import sm_count
from tilegemm.core.workspace import split_workspace

BLOCK_M = 128
CONSUMER_REGS = 232
PRODUCER_REGS = 40


@dataclass(frozen=True)
class Geometry:
    """One convolution's sizes, padding as (top, bottom, left, right)."""

    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    groups: int
    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int]

    @property
    def P(self) -> int:
        return (self.H + self.padding[0] + self.padding[1] - self.dilation[0] * (self.R - 1) - 1) // self.stride[0] + 1

    @property
    def Q(self) -> int:
        return (self.W + self.padding[2] + self.padding[3] - self.dilation[1] * (self.S - 1) - 1) // self.stride[1] + 1

    @property
    def Cg(self) -> int:
        return self.C // self.groups

    @property
    def Kg(self) -> int:
        return self.K // self.groups


def geometry(x_shape, w_shape, stride, padding, dilation, groups) -> Geometry:
    """``padding``: four sides (top, bottom, left, right)."""
    N, C, H, W = x_shape
    K, _, R, S = w_shape
    return Geometry(N, C, H, W, K, R, S, groups, tuple(stride), tuple(padding), tuple(dilation))


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(n, h, w) strides of a channels-last ``[N, C, H, W]`` tensor, those of size-1 dims made a packed tensor's
    (torch leaves them arbitrary, and TMA never steps along them)."""
    N, C, H, W = t.shape
    sx = t.stride(3) if W > 1 else C
    sy = t.stride(2) if H > 1 else sx * W
    sn = t.stride(0) if N > 1 else sy * H
    return sn, sy, sx


def input_descriptor(x: torch.Tensor, g: Geometry, block: list, layout) -> TensorDescriptor:
    """Channels-last ``x`` as the strided 5-D view ``[N, H/SH, SH, W/SW, SW*C]``, in ``block`` boxes: a tap's
    input pixels for a patch of output pixels are then one box."""
    sh, sw = g.stride
    sn, sy, sx = _strides(x)
    return TensorDescriptor(x, [g.N, g.H // sh, sh, g.W // sw, sw * g.C], [sn, sh * sy, sy, sw * sx, 1], block,
                            layout)


def tap_offsets(g: Geometry) -> tuple[int, int]:
    """Multiples of the stride at least the padding: every tap's shift from the window origin made non-negative."""
    sh, sw = g.stride
    return cdiv(g.padding[0], sh) * sh, cdiv(g.padding[2], sw) * sw


def patch(g: Geometry, rows: int) -> tuple[int, int, int, int]:
    """(BI, BH, BW, patches): the patch of ``rows`` output pixels (BI images of BH x BW, powers of two) covering
    the N images of P x Q pixels in the fewest patches; ties to the wider patch, then to fewer images."""
    best = None
    bw = 1
    while bw <= min(rows, 64):
        bh = 1
        while bw * bh <= rows:
            bi = rows // (bw * bh)
            tiles = cdiv(g.N, bi) * cdiv(g.P, bh) * cdiv(g.Q, bw)
            key = (tiles, -bw, bi)
            if best is None or key < best[0]:
                best = (key, (bi, bh, bw, tiles))
            bh *= 2
        bw *= 2
    return best[1]


def unusable(dy: torch.Tensor, x: torch.Tensor, g: Geometry) -> str | None:
    """None when the kernel takes the weight gradient; otherwise why not."""
    if x.dtype not in (torch.float16, torch.bfloat16) or dy.dtype != x.dtype:
        return "not 16-bit, or dtypes differ"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not Hopper"
    if x.stride(1) != 1 or dy.stride(1) != 1:
        return "not channels-last"
    if g.Cg % 8 or g.Kg % 8:
        return "channels per group not multiples of 8"
    if g.H % g.stride[0] or g.W % g.stride[1]:
        return "image size not divisible by the stride"
    if g.stride[1] > 1 and _strides(x)[2] != g.C:
        return "pixels not packed"
    strides = _strides(x) + _strides(dy)
    if min(strides) <= 0 or any(st * x.element_size() % 16 for st in strides) or (x.data_ptr() | dy.data_ptr()) % 16:
        return "strides or pointers not 16-byte aligned"
    if g.N * g.K * g.P * g.Q >= 2**31 or x.numel() >= 2**31:
        return "2^31 elements or more"
    return None


@gluon.jit
def _issue(dy_desc, x_desc, a_slot, b_slot, bar, j, tiles_p, tiles_q, k_col, c_col, dh, ah, dw, aw, C_ROW,
           BI: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr):
    """The TMA copies of pixel patch ``j``: its output gradients and the input pixels the tap reads for it."""
    tq = j % tiles_q
    tp = (j // tiles_q) % tiles_p
    n = j // (tiles_q * tiles_p) * BI
    p0 = tp * BH
    q0 = tq * BW
    mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(dy_desc, [n, p0, q0, k_col], bar, a_slot)
    tma.async_copy_global_to_shared(x_desc, [n, p0 + dh, ah, q0 + dw, aw * C_ROW + c_col], bar, b_slot)


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
    bi, bh, bw, patches = patch(g, pix)
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
    units = cdiv(g.Kg, BLOCK_M) * cdiv(g.Cg, bn) * g.R * g.S * g.groups
    return programs * 4 * (BLOCK_M // 2) * bn, units * 2


def run(dy: torch.Tensor, x: torch.Tensor, g, out_dtype, pix: int = 64, bn: int = 128, stages: int = 6,
        programs: int | None = None, memory_format=torch.contiguous_format, **flags) -> torch.Tensor:
    """The weight gradient ``[K, C/groups, R, S]`` of channels-last ``dy`` and ``x``, in ``memory_format``."""
    programs = programs or sm_count(dy.device)
    if memory_format == torch.channels_last:
        dw = torch.empty((g.K, g.R, g.S, g.Cg), dtype=out_dtype, device=dy.device).permute(0, 3, 1, 2)
    else:
        dw = torch.empty((g.K, g.Cg, g.R, g.S), dtype=out_dtype, device=dy.device)
    ws, count = split_workspace(dy.device, *workspace_sizes(g, pix, bn, programs), tag="wgrad-ws")
    kernel, grid, args, kwargs = launch_args(dy, x, g, dw, ws, count, pix, bn, stages, programs, **flags)
    kernel[grid](*args, **kwargs)
    return dw
