"""Weight gradient on Hopper in Gluon: both operands moved by TMA, the pixel reduction split over programs.

Per filter tap (r, s) and group the weight gradient is the GEMM ``dw[K, C] = dy^T[K, pixels] @ x_tap[pixels, C]``
over the N*P*Q output pixels, where row ``(n, p, q)`` of ``x_tap`` is the input pixel the tap reads for output
pixel (p, q). A program owns a [BLOCK_M output channels, BLOCK_N input channels] tile of one tap and walks
patches of output pixels (the forward's patches, :func:`tilegemm.ops.conv2d.configs._patch`): each step
loads the patch's output gradients, a box of the channels-last ``dy`` seen as ``[N, P, Q, K]``, and the input
pixels under it, a box of the strided 5-D view of ``x`` (:mod:`tilegemm.ops.conv2d.tma_fwd`: padding and
stride by TMA coordinates, zeros outside the image). Both land as [pixels, channels] tiles; wgmma reads the
first transposed (output channels contiguous) and the second as it lies. Pixels past the image's edge in a
patch have zero output gradients (TMA's fill), so they add nothing; but ``0 * inf`` is NaN: an inf or NaN in the
input under such a pixel makes the tap's whole gradient NaN where ``F.conv2d``'s would be NaN in part.

The pixels are split into ``SPLIT`` slices over programs; each stores its fp32 partial tile and the last to
arrive at the tile adds them in order and stores the result (as the pointer kernel does,
:func:`tilegemm.ops.conv2d.implicit_gemm.conv2d_wgrad_kernel`): one launch, deterministic, replayable.
Takes 16-bit channels-last ``x`` and ``dy`` with channel counts multiples of 8 (16-byte TMA strides),
image sizes divisible by the stride. Written against Triton 3.6's Gluon API for sm_90.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilegemm.core.runtime import cdiv
from tilegemm.ops.conv2d.tma_fwd import _strides, input_descriptor, tap_offsets

BLOCK = 64  # output and input channels of the default tile: one 128-byte swizzled box row each


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
def conv2d_wgrad_tma_kernel(
    dy_desc, x_desc, dw_ptr, ws_ptr, count_ptr,
    Kg, Cg, C_ROW, tiles_p, tiles_q, slice_len, patches,
    stride_dk, stride_dc, stride_dr, stride_ds,
    pad_h, pad_w, dil_h, dil_w, off_h, off_w,
    R: gl.constexpr, S: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr,
    BI: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr,
):
    PIX: gl.constexpr = BI * BH * BW
    # Which tile: [output channels, input channels] (axis 0) of one tap and group (axis 1), one pixel slice
    # (axis 2).
    tiles_n = gl.cdiv(Cg, BLOCK_N)
    pid = gl.program_id(0)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    tap = gl.program_id(1)
    part = gl.program_id(2)
    grp = tap // (R * S)
    r = (tap % (R * S)) // S
    s = tap % S
    # The tap's shift split by the stride (off_* make it non-negative first; see tma_fwd._issue).
    eh = r * dil_h - pad_h + off_h
    ew = s * dil_w - pad_w + off_w
    dh = eh // SH - off_h // SH
    ah = eh % SH
    dw = ew // SW - off_w // SW
    aw = ew % SW
    k_col = grp * Kg + pid_m * BLOCK_M
    c_col = grp * Cg + pid_n * BLOCK_N
    begin = part * slice_len
    steps = gl.minimum(begin + slice_len, patches) - begin

    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BI, BH, BW, BLOCK_M], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BI, BH, 1, BW, BLOCK_N], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    flat: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue(dy_desc, x_desc, a_bufs.index(i), b_bufs.index(i), ready.index(i), begin + i, tiles_p, tiles_q,
                   k_col, c_col, dh, ah, dw, aw, C_ROW, BI, BH, BW)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for it in range(steps):
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = a_bufs.index(slot)._reinterpret(dy_desc.dtype, [PIX, BLOCK_M], flat).permute((1, 0))
        b = b_bufs.index(slot)._reinterpret(x_desc.dtype, [PIX, BLOCK_N], flat)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        nxt = it + STAGES - 1
        if nxt < steps:
            fill = nxt % STAGES
            _issue(dy_desc, x_desc, a_bufs.index(fill), b_bufs.index(fill), ready.index(fill), begin + nxt,
                   tiles_p, tiles_q, k_col, c_col, dh, ah, dw, aw, C_ROW, BI, BH, BW)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))  # output channels
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))  # input channels
    inside = (offs_m < Kg)[:, None] & (offs_n < Cg)[None, :]
    k_all = grp * Kg + offs_m
    dw_tile = dw_ptr + r * stride_dr + s * stride_ds + (k_all * stride_dk)[:, None] + (offs_n * stride_dc)[None, :]
    if SPLIT == 1:
        gl.store(dw_tile, acc.to(dw_ptr.dtype.element_ty), mask=inside)
    else:
        # This slice's partial tile into plane ``part`` of [SPLIT, tiles, BM, BN]; the program that arrives last
        # at the tile adds the planes in order and stores the result, then resets the tile's counter.
        tile = tap * gl.num_programs(0) + pid
        local = (gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))[:, None] * BLOCK_N
                 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))[None, :])
        plane = (gl.num_programs(0) * gl.num_programs(1)).to(gl.int64) * (BLOCK_M * BLOCK_N)
        ws_tile = ws_ptr + tile.to(gl.int64) * (BLOCK_M * BLOCK_N) + local
        gl.store(ws_tile + part * plane, acc)
        gl.thread_barrier()  # every thread's stores before the (one-thread) release
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            gl.thread_barrier()  # and every thread's loads after the acquire
            # Two planes' loads at a time (one at a time waits out SPLIT memory latencies in a row; four spilled).
            total = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for sl0 in range(0, SPLIT, 2):
                for j in gl.static_range(2):
                    more = (local < BLOCK_M * BLOCK_N) & (sl0 + j < SPLIT)  # (a whole-tile mask, true or false)
                    total += gl.load(ws_tile + (sl0 + j) * plane, mask=more, other=0.0, cache_modifier=".cg")
            gl.store(count_ptr + tile, 0)
            gl.store(dw_tile, total.to(dw_ptr.dtype.element_ty), mask=inside)


# --- host side ---------------------------------------------------------------------------------------------


def why_not(dy: torch.Tensor, x: torch.Tensor, g) -> str | None:
    """None when this kernel takes the weight gradient; otherwise why not (in words)."""
    from tilegemm.ops.conv2d import tma_fwd

    if dy.dtype != x.dtype:
        return "dtypes differ"
    if g.Cg % 8 or g.Kg % 8:
        return "channels per group not multiples of 8"
    return why_not_dy(dy, g) or tma_fwd.why_not_input(x, None, g, channel_step=8)


def why_not_dy(dy: torch.Tensor, g) -> str | None:
    """None when the kernel's descriptor ``[N, P, Q, K]`` can describe ``dy``; otherwise why not."""
    if dy.stride(1) != 1:
        return "output gradient not channels-last"
    if min(_strides(dy)) <= 0:
        return "broadcast or negative strides"
    if any((st * dy.element_size()) % 16 for st in _strides(dy)) or dy.data_ptr() % 16:
        return "output gradient not 16-byte aligned"
    if g.N * g.K * g.P * g.Q >= 2**31:
        return "2^31 elements or more (the pointer kernels take those, with 64-bit offsets)"
    return None


def config(g, sms: int, bm: int = BLOCK, bn: int = BLOCK) -> dict:
    """Patches of 128 output pixels, ``bm`` x ``bn`` channel tiles (64x64 unless asked: 128-wide ones ran slower,
    docs/conv2d.md; 8 warps from 128 output channels), 3 ring slots (32 KB each at 64x64: two programs an SM, one
    at wider tiles), and the pixel split (1..64, slices of 8 patches or more) of least modelled cost: rounds of
    programs at once (a round just overfilled costs a whole slice) against the partial tiles each slice adds;
    timed at every split, its splits ran close to each layer's best (docs/conv2d.md, "Configs")."""
    from tilegemm.ops.conv2d.configs import _patch

    bi, bh, bw, patches = _patch(g, 128)
    tiles = cdiv(g.Kg, bm) * cdiv(g.Cg, bn) * g.R * g.S * g.groups
    split = split_for(tiles, patches, slots(sms, bm, bn))
    return dict(BI=bi, BH=bh, BW=bw, BM=bm, BN=bn, STAGES=3, SPLIT=split, num_warps=8 if bm >= 128 else 4)


# The split's cost model, in 128-pixel steps: each round of programs costs its slice and FILL steps more (ring
# fill, epilogue), and each slice past the first PER_SLICE (its partial tile stored, then added by the last).
FILL, PER_SLICE = 4, 6


def slots(sms: int, bm: int, bn: int) -> int:
    """Programs that run at once: as many a SM as their 3-slot rings of 128-pixel boxes fit in shared memory."""
    from tilegemm.ops.conv2d.configs import _SMEM

    return sms * max(1, _SMEM // (3 * 128 * (bm + bn) * 2 + 1024))


def split_for(tiles: int, patches: int, slots: int, fill: float = FILL, per_slice: float = PER_SLICE) -> int:
    """The pixel split of least modelled cost (1..64, slices of 8 patches or more; ties: fewer slices)."""

    def cost(split):
        steps = cdiv(patches, split)
        parts = cdiv(patches, steps)  # the slices run() launches
        return cdiv(tiles * parts, slots) * (steps + fill) + per_slice * (parts - 1)

    return min(range(1, max(1, min(64, patches // 8)) + 1), key=cost)


def run(dy: torch.Tensor, x: torch.Tensor, g, out_dtype: torch.dtype, cfg: dict | None = None,
        memory_format: torch.memory_format = torch.contiguous_format, x_channels: int | None = None,
        dy_channels: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """grad of the weight, ``[K, C/groups, R, S]`` in ``memory_format``, for ``dy`` and ``x`` that :func:`why_not`
    takes. Channels-last is the fast one: a tile's rows (one output channel, one tap) are then contiguous, where
    contiguous ones scatter every element R*S elements apart (slower: docs/conv2d.md, "Configs"). ``x_channels``,
    ``dy_channels``: the channels of ``x``'s and ``dy``'s pixels where they are more than C and K (copies padded
    with zero channels, :func:`tilegemm.ops.conv2d.padded.wgrad`; the tiles past C/groups are computed and not
    stored). ``out``: a ``[K, C/groups, R, S]`` tensor of ``out_dtype`` (any strides; a workspace's view) written
    instead of a new one in ``memory_format``."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import current_stream, launch
    from tilegemm.core.workspace import split_workspace
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    if out is not None and (tuple(out.shape) != (g.K, g.Cg, g.R, g.S) or out.dtype != out_dtype
                            or out.device != dy.device):
        raise ValueError(f"tma_wgrad: out must be [{g.K}, {g.Cg}, {g.R}, {g.S}] of {out_dtype} on {dy.device}; "
                         f"got {list(out.shape)} of {out.dtype} on {out.device}")
    cfg = dict(cfg or config(g, sm_count(dy.device)))
    bi, bh, bw = cfg["BI"], cfg["BH"], cfg["BW"]
    bm, bn = cfg.get("BM", BLOCK), cfg.get("BN", BLOCK)
    patches = cdiv(g.N, bi) * cdiv(g.P, bh) * cdiv(g.Q, bw)
    slice_len = cdiv(patches, cfg["SPLIT"])
    split = cdiv(patches, slice_len)
    dw = out if out is not None else empty_4d((g.K, g.Cg, g.R, g.S), out_dtype, dy.device, memory_format)
    grid = (cdiv(g.Kg, bm) * cdiv(g.Cg, bn), g.R * g.S * g.groups, split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws, count = split_workspace(dy.device, split * tiles * bm * bn, tiles)
    else:
        ws, count = dw, dw  # unused
    sh, sw = g.stride
    layout4 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    layout5 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=5)
    sn, sp, sq = _strides(dy)
    dy_desc = TensorDescriptor(dy, [g.N, g.P, g.Q, dy_channels or g.K], [sn, sp, sq, 1], [bi, bh, bw, bm], layout4)
    cx = x_channels or g.C
    x_desc = input_descriptor(x, g, [bi, bh, 1, bw, bn], layout5, cx)
    off_h, off_w = tap_offsets(g)
    args = (dy_desc, x_desc, dw, ws, count, g.Kg, g.Cg, cx, cdiv(g.P, bh), cdiv(g.Q, bw), slice_len, patches,
            *dw.stride(), g.padding[0], g.padding[2], g.dilation[0], g.dilation[1], off_h, off_w)
    kwargs = dict(R=g.R, S=g.S, SH=sh, SW=sw, BI=bi, BH=bh, BW=bw, BLOCK_M=bm, BLOCK_N=bn,
                  STAGES=cfg["STAGES"], SPLIT=split, num_warps=cfg["num_warps"])
    launch(conv2d_wgrad_tma_kernel, grid, args, kwargs, keep=(ws, count) if split > 1 else (),
           stream=current_stream() if split > 1 else None)
    return dw
