"""Implicit-GEMM forward on Hopper in Gluon: every operand tile moved by TMA, padding included.

The pointer kernel (:mod:`tilegemm.ops.conv2d.implicit_gemm`) computes an address and a mask for every
element of every A tile; on ResNet-50's 3x3 layers its main loop ran at about half of cuDNN. Here the
output tile is a ``BH x BW`` patch of output pixels of one image, and for each filter tap (r, s) and
channel step the input it needs is one TMA box of the channels-last input seen as the 5-D tensor

    [N, H / SH, SH, W / SW, SW * C]   (strides n, SH * h, h, SW * C, 1)

which splits each spatial index into (index / stride, index % stride): pixel ``p * SH + dh`` of image row
space is element ``(p + dh // SH, dh % SH)``. A box ``[1, BH, 1, BW, BK]`` at ``(n, p0 + dh // SH, dh % SH,
q0 + dw // SW, (dw % SW) * C + c)`` is then exactly the ``BH x BW`` input pixels the tap reads for the
patch, strided by (SH, SW); coordinates may be negative or run past the edge, and TMA fills those elements
with zeros: the convolution's zero padding costs nothing. The box lands in shared memory as ``BH * BW`` rows
of ``BK`` channels, which is the [BM, BK] operand wgmma reads (the same bytes, viewed as 2-D).

The weight, channels-last ``[K, R, S, C/groups]``, is the row-major matrix ``[K, R*S*C/groups]``; its
[BN, BK] box at ``(k0, (r*S + s) * C/groups + c)``. A ring of ``STAGES`` slots keeps TMA ahead of the MMAs;
one MMA group stays in flight. The epilogue adds bias, applies the activation and stores through the
output's strides, masking pixels outside the P x Q image.

It takes what TMA can describe: 16-bit channels-last input, C/groups a multiple of 16 (a channel step
never crosses into the next tap or stride phase), H divisible by the vertical stride and W by the
horizontal one (so the split view covers the image exactly), pixels packed (pixel stride = C) where the
horizontal stride is above 1. Written against Triton 3.6's Gluon API for sm_90; Gluon has no interpreter,
so the suite compiles it for sm_90 without a GPU and the GPU tests run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilegemm.core.runtime import cdiv
from tilegemm.jit.helpers import apply_activation

_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@gluon.jit
def _issue(x_desc, w_desc, a_slot, b_slot, bar, it, c_steps, n, p0, q0, k_row, c_base, Cg, C_ROW,
           off_h, off_w, pad_h, pad_w, dil_h, dil_w,
           S: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr, BLOCK_K: gl.constexpr):
    """The TMA copies of K step ``it`` (tap ``it // c_steps``, channel step ``it % c_steps``) into one slot."""
    rs = it // c_steps
    c = (it - rs * c_steps) * BLOCK_K
    r = rs // S
    s = rs - r * S
    # The tap's offset from the window origin, made non-negative (off_* are multiples of the stride at
    # least the padding) so that // and % split it as floor division does.
    eh = r * dil_h - pad_h + off_h
    ew = s * dil_w - pad_w + off_w
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(
        x_desc, [n, p0 + eh // SH - off_h // SH, eh % SH, q0 + ew // SW - off_w // SW, (ew % SW) * C_ROW + c_base + c],
        bar, a_slot)
    tma.async_copy_global_to_shared(w_desc, [k_row, rs * Cg + c], bar, b_slot)


@gluon.jit
def conv2d_fwd_tma_kernel(
    x_desc, w_desc, out_ptr, bias_ptr,
    N, P, Q, Kg, Cg, C_ROW, Cg_x, tiles_p, tiles_q, out_offset,
    stride_on, stride_op, stride_oq, stride_ok, stride_bias,
    pad_h, pad_w, dil_h, dil_w, off_h, off_w,
    R: gl.constexpr, S: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr,
    HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    BI: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, PIXEL_STORES: gl.constexpr = False,
):
    BM: gl.constexpr = BI * BH * BW
    # Which tile: the channel tile varies fastest, so the programs reading one input patch run together
    # (the weight, read by every patch, stays in L2).
    tiles_n = gl.cdiv(Kg, BLOCK_N)
    pid = gl.program_id(0)
    pid_n = pid % tiles_n
    pix = pid // tiles_n
    tq = pix % tiles_q
    tp = (pix // tiles_q) % tiles_p
    n = pix // (tiles_q * tiles_p) * BI  # the tile's first image
    grp = gl.program_id(1)
    p0 = tp * BH
    q0 = tq * BW
    k_row = grp * Kg + pid_n * BLOCK_N  # first weight row (output channel) of the tile
    c_base = grp * Cg_x  # the group's first channel in x (x's own channels a group, where Cg counts padded ones)

    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BI, BH, 1, BW, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    # The A slot as wgmma reads it: the box's BH * BW rows of BLOCK_K channels (same swizzle, same bytes).
    a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=x_desc.layout.swizzle_byte_width,
                                                  element_bitwidth=16, rank=2)

    c_steps = gl.cdiv(Cg, BLOCK_K)  # a last partial step only where TMA's zero fill ends it (ragged_channel_step)
    steps = R * S * c_steps
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue(x_desc, w_desc, a_bufs.index(i), b_bufs.index(i), ready.index(i), i, c_steps, n, p0, q0,
                   k_row, c_base, Cg, C_ROW, off_h, off_w, pad_h, pad_w, dil_h, dil_w, S, SH, SW, BLOCK_K)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((BM, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for it in range(steps):
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = a_bufs.index(slot)._reinterpret(x_desc.dtype, [BM, BLOCK_K], a_layout)
        b = b_bufs.index(slot).permute((1, 0))
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # At most this step's MMAs in flight: step it - 1's slot has been read; refill it with step
        # it + STAGES - 1.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        nxt = it + STAGES - 1
        if nxt < steps:
            fill = nxt % STAGES
            _issue(x_desc, w_desc, a_bufs.index(fill), b_bufs.index(fill), ready.index(fill), nxt, c_steps, n,
                   p0, q0, k_row, c_base, Cg, C_ROW, off_h, off_w, pad_h, pad_w, dil_h, dil_w, S, SH, SW, BLOCK_K)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    # Epilogue in a layout whose threads hold 8 consecutive channels (16-byte stores along K); for an NCHW output
    # (PIXEL_STORES) one whose warps store 32 consecutive pixels of one channel (64-byte runs along a row).
    if PIXEL_STORES:
        out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
    else:
        TN: gl.constexpr = BLOCK_N // 8 if BLOCK_N // 8 < 32 else 32
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [num_warps, 1], [1, 0])
    acc = gl.convert_layout(acc, out_layout)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    n_ok = offs_n < Kg
    k_out = grp * Kg + offs_n
    if HAS_BIAS:
        acc += gl.load(bias_ptr + k_out * stride_bias, mask=n_ok, other=0.0).to(gl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    img = n + offs_m // (BH * BW)
    p = p0 + (offs_m // BW) % BH
    q = q0 + offs_m % BW
    rows = out_offset + img.to(gl.int64) * stride_on + p * stride_op + q * stride_oq
    ptrs = out_ptr + rows[:, None] + (k_out * stride_ok)[None, :]
    ok = (img < N) & (p < P) & (q < Q)
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


# --- host side ---------------------------------------------------------------------------------------------


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(n, h, w) strides of a channels-last ``[N, C, H, W]`` tensor, those of size-1 dims made what a packed
    tensor would have (torch leaves them arbitrary, and TMA never steps along them)."""
    N, C, H, W = t.shape
    sx = t.stride(3) if W > 1 else C
    sy = t.stride(2) if H > 1 else sx * W
    sn = t.stride(0) if N > 1 else sy * H
    return sn, sy, sx


def input_descriptor(x: torch.Tensor, g, block: list, layout, channels: int | None = None,
                     ragged: bool = False) -> TensorDescriptor:
    """The TMA descriptor of channels-last ``x`` as the strided 5-D view ``[N, H/SH, SH, W/SW, SW*C]`` (see the
    module's docstring), in ``block`` boxes: the forward's and the weight gradient's input tiles. With SW = 1
    the last dim is the C channels at stride 1 and the pixel stride is free. ``channels``: x's own C where ``g``
    counts more (padded channels read as TMA's zero fill: :mod:`tilegemm.ops.conv2d.padded`). ``ragged``: a
    strided 1x1 layer whose channel steps run past C (:func:`~tilegemm.ops.conv2d.configs.ragged_channel_step`):
    the last dim is then C alone, so the box past C reads zeros, not the next pixel's channels (its one tap
    always sits at phase 0)."""
    if ragged:
        from tilegemm.ops.conv2d.configs import ragged_channel_step

        if not ragged_channel_step(g):
            raise ValueError("channel steps past C/groups need a strided 1x1 layer (ragged_channel_step)")
    sh, sw = g.stride
    sn, sy, sx = _strides(x)
    c = channels or g.C
    if ragged:
        return TensorDescriptor(x, [g.N, g.H // sh, sh, g.W // sw, c], [sn, sh * sy, sy, sw * sx, 1], block,
                                layout)
    return TensorDescriptor(x, [g.N, g.H // sh, sh, g.W // sw, sw * c], [sn, sh * sy, sy, sw * sx, 1], block,
                            layout)


def tap_offsets(g) -> tuple[int, int]:
    """(off_h, off_w): multiples of the stride at least the padding, which make every tap's shift from the
    window origin non-negative, so the kernels split it by the stride as floor division does."""
    sh, sw = g.stride
    return cdiv(g.padding[0], sh) * sh, cdiv(g.padding[2], sw) * sw


def why_not_input(x: torch.Tensor, weight, g, channel_step: int = 16) -> str | None:
    """None when this kernel takes the convolution; otherwise why not (in words). ``channel_step``: what
    C/groups must be a multiple of (16: a K step of the forward never crosses a tap; the weight gradient, whose
    channels are an output dim, needs only 8: TMA's 16-byte strides)."""
    from tilegemm.core.runtime import interpreting

    if x.dtype not in _GL:
        return "not 16-bit"
    if weight is not None and weight.dtype != x.dtype:
        return "dtypes differ"
    if not x.is_cuda or interpreting():
        return "not on a GPU (or under the interpreter)"
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not Hopper"
    if x.stride(1) != 1:
        return "input not channels-last"
    if g.Cg % channel_step:
        return f"C/groups not a multiple of {channel_step}"
    sh, sw = g.stride
    if g.H % sh or g.W % sw:
        return "image size not divisible by the stride"
    strides = _strides(x)
    if sw > 1 and strides[2] != g.C:
        return "pixels not packed"
    if min(strides) <= 0:
        return "broadcast or negative strides"
    if any((st * x.element_size()) % 16 for st in strides):
        return "strides not 16-byte aligned"
    if x.data_ptr() % 16:
        return "input not 16-byte aligned"
    if g.N * g.K * g.P * g.Q >= 2**31 or x.numel() >= 2**31:
        return "2^31 elements or more (the pointer kernels take those, with 64-bit offsets)"
    return None


def config(g, dtype: torch.dtype, sms: int = 132) -> dict:
    """The config :func:`tilegemm.ops.conv2d.configs.tma_forward_config` picks (its cost model)."""
    from tilegemm.ops.conv2d.configs import tma_forward_config

    return tma_forward_config(g, sms)


def run(p, config_: dict | None = None) -> torch.Tensor:
    """The forward through this kernel, or :class:`NotApplicable` saying why it does not take ``p``. A stem
    (:func:`why_not_stem`) runs as the merged-pairs convolution of :func:`run_stem`."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import current_stream, launch, sequence_lock
    from tilegemm.core.registry import NotApplicable
    from tilegemm.ops.conv2d.implicit_gemm import allocate_out
    from tilegemm.ops.conv2d.layout import weight_channels_last

    g = p.geo
    reason = why_not_input(p.x, p.weight, g)
    if reason and why_not_stem(p.x, p.weight, g) is None:
        return run_stem(p)
    if reason:
        raise NotApplicable(f"tma_implicit_gemm does not take this convolution: {reason}")
    out = allocate_out(p)
    cfg = config_ or config(g, p.dtype, sm_count(p.x.device))
    with sequence_lock:  # a weight's workspace is shared by the calls on this stream
        w, keep = weight_channels_last(p.weight)
        kernel, grid, args, kwargs = launch_args(p.x, w, out, p.bias, g, p.activation, cfg)
        launch(kernel, grid, args, kwargs, keep=keep, stream=current_stream() if keep else None)
    return out


def why_not(p) -> str | None:
    """None when :func:`run` takes problem ``p`` (directly or as a stem); otherwise why not. (Other channel
    counts: :mod:`tilegemm.ops.conv2d.padded`, which dispatch runs for this kernel's name.)"""
    reason = why_not_input(p.x, p.weight, p.geo)
    if reason and why_not_stem(p.x, p.weight, p.geo) is None:
        return None
    return reason


# --- stems: few channels ----------------------------------------------------------------------------------
#
# A network's first layer (ResNet-50's 7x7 stride-2 over C=3) has too few channels for a TMA box (16 bytes at
# least) and for a K step (16 for wgmma). Padded to CP channels, the S pixels one output pixel's filter row
# covers are S*CP consecutive elements of an input row, and the window of output column q starts SW*CP
# elements after that of column q - 1. So the convolution is another one over a "window image" whose pixel q
# is the CV >= S*CP elements from that start, read through a view whose pixels overlap (pixel stride SW*CP <
# CV): horizontal stride 1, one tap (S = 1) over CV channels, the same rows, vertical stride and padding. The
# weight becomes wv[k, r, j*CP + c] = w[k, c, r, j] (zero for c >= C and for j >= S). CP is the least power of
# two >= C that makes the window step SW*CP a multiple of 8 elements (TMA's 16-byte strides): 4 for ResNet's
# stem, whose 7 x 4 = 28 window elements take one 32-wide K step per filter row (K = 7 x 32 = 224 against the
# 147 of the filter). A copy kernel writes the input channels-last with CP channels and explicit zero columns
# for the left and right padding (TMA's zero fill works per window pixel, not per element); the rows keep
# TMA's fill for the top and bottom padding. The elements of a window past its S pixels (28..31 here) are the
# next pixel's, multiplied by zero weights: an input holding inf or NaN there makes that output NaN, where
# F.conv2d's output pixel would not have read it.

_STEM_MAX_C = 8


def stem_layout(g) -> tuple[int, int, int, int]:
    """(CP, CV, Hp, Wp): channels each input pixel is padded to, window channels, and the rows and columns of
    the padded copy (rows a multiple of the vertical stride; columns the left padding, the image and enough
    zeros that the last window ends inside its row, in whole 16-byte rows)."""
    sw = g.stride[1]
    cp = 1
    while cp < g.C or (sw * cp) % 8:
        cp *= 2
    cv = -(-g.S * cp // 16) * 16
    hp = -(-g.H // g.stride[0]) * g.stride[0]
    left = g.padding[2]
    wp = max(left + g.W, (g.Q - 1) * sw + -(-cv // cp))
    while (wp * cp) % 8:
        wp += 1
    return cp, cv, hp, wp


def why_not_stem(x: torch.Tensor, weight, g) -> str | None:
    """None when the stem route takes the convolution; otherwise why not."""
    from tilegemm.core.runtime import interpreting

    if x.dtype not in _GL or (weight is not None and weight.dtype != x.dtype):
        return "not 16-bit"
    if not x.is_cuda or interpreting() or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not on a Hopper GPU"
    if g.groups != 1 or g.C > _STEM_MAX_C:
        return "more than 8 channels or groups"
    if g.dilation[1] != 1:
        return "a horizontal dilation"
    cp, cv, hp, wp = stem_layout(g)
    if g.N * hp * wp * cp >= 2**31 or g.N * g.K * g.P * g.Q >= 2**31:
        return "2^31 elements or more"
    return None


def stem_geometry(g):
    """The window convolution's geometry (see the comment above): CV channels, Q window pixels a row, one tap
    along the width, stride (SH, 1); the bottom padding counts the copy's extra rows so that P is the same."""
    from tilegemm.ops.conv2d.problem import Geometry

    cp, cv, hp, wp = stem_layout(g)
    top, bottom, _, _ = g.padding
    return Geometry(g.N, cv, hp, g.Q, g.K, g.R, 1, 1, (g.stride[0], 1), (top, bottom - (hp - g.H), 0, 0),
                    (g.dilation[0], 1))


@triton.jit
def stem_input_kernel(x_ptr, out_ptr, pixels, C, H, W, Hp, Wp, left, stride_n, stride_c, stride_h, stride_w,
                      CP: tl.constexpr, BLOCK: tl.constexpr, PLANAR: tl.constexpr):
    """``out[n, h, j, c] = x[n, c, h, j - left]`` inside the image and c < C, else 0: ``[N, Hp, Wp, CP]``.
    PLANAR (an NCHW input): loaded as ``[CP, BLOCK]`` so that the threads of a warp read consecutive pixels of
    one channel, then transposed for the store."""
    pix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.arange(0, CP)
    j = pix % Wp
    h = (pix // Wp) % Hp
    n = pix // (Wp * Hp)
    w = j - left
    src = n.to(tl.int64) * stride_n + h * stride_h + w * stride_w
    inside = (pix < pixels) & (h < H) & (w >= 0) & (w < W)
    if PLANAR:
        v = tl.trans(tl.load(x_ptr + src[None, :] + (c * stride_c)[:, None],
                             mask=inside[None, :] & (c < C)[:, None], other=0.0))
    else:
        v = tl.load(x_ptr + src[:, None] + (c * stride_c)[None, :], mask=inside[:, None] & (c < C)[None, :],
                    other=0.0)
    tl.store(out_ptr + pix.to(tl.int64)[:, None] * CP + c[None, :], v, mask=(pix < pixels)[:, None])


@triton.jit
def stem_weight_kernel(w_ptr, out_ptr, total, C, R, S, CV, stride_k, stride_c, stride_r, stride_s,
                       CP: tl.constexpr, BLOCK: tl.constexpr):
    """``out[k, r, j * CP + c] = w[k, c, r, j]`` (0 for c >= C or j >= S): row-major ``[K, R, CV]``, the window
    convolution's weight channels-last."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = i % CV
    r = (i // CV) % R
    k = i // (CV * R)
    c = e % CP
    j = e // CP
    ok = i < total
    real = ok & (c < C) & (j < S)
    v = tl.load(w_ptr + k * stride_k + c * stride_c + r * stride_r + j * stride_s, mask=real, other=0.0)
    tl.store(out_ptr + i, v, mask=ok)


def stem_operands(x: torch.Tensor, weight: torch.Tensor, g):
    """(the window image ``[N, CV, Hp, Q]`` as an overlapping channels-last view of the padded copy, the
    window weight ``[K, CV, R, 1]`` channels-last, the two workspaces, the window geometry): the two launches
    of a stem's operands (plain Triton; the interpreter runs them too). Call under
    :data:`tilegemm.core.launch.sequence_lock`."""
    from tilegemm.core.launch import current_stream, launch
    from tilegemm.core.workspace import buffer

    cp, cv, hp, wp = stem_layout(g)
    gv = stem_geometry(g)
    stream = current_stream() if x.is_cuda else None
    pixels = g.N * hp * wp
    wsize = g.K * g.R * cv
    xbuf = buffer(x.device, x.dtype, pixels * cp, "conv2d-stem-input")
    wbuf = buffer(x.device, x.dtype, wsize, "conv2d-stem-weight")
    block = 4096 // cp  # 8 KB written a program
    launch(stem_input_kernel, (cdiv(pixels, block),),
           (x, xbuf, pixels, g.C, g.H, g.W, hp, wp, g.padding[2], x.stride(0), x.stride(1), x.stride(2),
            x.stride(3)),
           dict(CP=cp, BLOCK=block, PLANAR=x.stride(3) == 1 and g.C > 1, num_warps=4), keep=(xbuf,), stream=stream)
    launch(stem_weight_kernel, (cdiv(wsize, 1024),),
           (weight, wbuf, wsize, g.C, g.R, g.S, cv, *weight.stride()),
           dict(CP=cp, BLOCK=1024, num_warps=4), keep=(wbuf,), stream=stream)
    row = wp * cp
    xv = xbuf.as_strided((g.N, cv, hp, g.Q), (hp * row, 1, row, g.stride[1] * cp))
    wv = wbuf[:wsize].view(g.K, g.R, 1, cv).permute(0, 3, 1, 2)
    return xv, wv, xbuf, wbuf, gv


def run_stem(p) -> torch.Tensor:
    """The forward of a stem (:func:`why_not_stem` is None) through the window convolution."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import current_stream, launch, sequence_lock
    from tilegemm.ops.conv2d.configs import tma_stem_config
    from tilegemm.ops.conv2d.implicit_gemm import allocate_out

    out = allocate_out(p)
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        xv, wv, xbuf, wbuf, gv = stem_operands(p.x, p.weight, p.geo)
        kernel, grid, args, kwargs = launch_args(xv, wv, out, p.bias, gv, p.activation,
                                                 tma_stem_config(gv, sm_count(p.x.device)))
        launch(kernel, grid, args, kwargs, keep=(xbuf, wbuf), stream=current_stream())
    return out


def dgrad_phases(g) -> list | None:
    """The data gradient as forward convolutions over ``dy``, one per stride phase, or None where the split does
    not apply (a stride above 1 with a dilation above 1). Each entry is ``(a, b, geometry or None, r0, s0)``:
    the output pixels ``(SH*i + a, SW*j + b)`` of dx are ``conv2d(dy, w_ab)`` with that geometry, where
    ``w_ab[c, k, u, v] = w[k, c, r0 - step_h*u, s0 - step_w*v]`` (step = stride, or the dilation at stride 1:
    one phase, the weight flipped); None: no tap reaches the phase, which is zero.

    Derivation (rows; columns alike): output row p reads input row ``p*SH - top + r*dil``. At stride 1 each
    input row h gets ``r`` taps from rows ``p = h + top - r*dil``: a convolution of dy with the flipped weight,
    dilation ``dil``, padding ``dil*(R-1) - top``. At stride SH (dilation 1), row ``h = SH*i + a`` gets the taps
    ``r = a + top - SH*m`` from rows ``p = i + m``, m from ``m0 = floor((a + top - R) / SH) + 1`` to
    ``floor((a + top) / SH)``: a convolution with U = that many taps, ``u = m - m0``, padding ``-m0``."""
    from tilegemm.ops.conv2d.problem import Geometry

    top, bottom, left, right = g.padding
    (sh, sw), (dh, dw) = g.stride, g.dilation
    if (sh, sw) == (1, 1):
        pad = (dh * (g.R - 1) - top, dh * (g.R - 1) - bottom, dw * (g.S - 1) - left, dw * (g.S - 1) - right)
        gt = Geometry(g.N, g.K, g.P, g.Q, g.C, g.R, g.S, g.groups, (1, 1), pad, g.dilation)
        return [(0, 0, gt, g.R - 1, g.S - 1)]
    if (dh, dw) != (1, 1):
        return None

    def taps(a, pad, size, stride, n_out):
        m0 = (a + pad - size) // stride + 1
        count = (a + pad) // stride - m0 + 1
        rows = -(-(n_out - a) // stride)  # output rows of this phase
        return m0, count, rows

    phases = []
    for a in range(sh):
        for b in range(sw):
            mh, U, Ha = taps(a, top, g.R, sh, g.H)
            mw, V, Wb = taps(b, left, g.S, sw, g.W)
            if Ha <= 0 or Wb <= 0:
                continue  # no output pixel in this phase (stride larger than the image)
            if U <= 0 or V <= 0:
                phases.append((a, b, None, Ha, Wb))
                continue
            # padding (top, bottom): -mh, and what makes the output Ha rows: Ha = P + top + bottom - U + 1
            pad = (-mh, Ha - 1 + U - g.P + mh, -mw, Wb - 1 + V - g.Q + mw)
            gt = Geometry(g.N, g.K, g.P, g.Q, g.C, U, V, g.groups, (1, 1), pad, (1, 1))
            phases.append((a, b, gt, a + top - sh * mh, b + left - sw * mw))
    return phases


def dgrad_tma(dy: torch.Tensor, weight: torch.Tensor, g, out_format: torch.memory_format = torch.channels_last):
    """The data gradient of a stride-1 convolution through this kernel (:func:`dgrad_phases`: one forward
    convolution over the flipped weight), or None where it does not take it. The weight is written by
    :func:`phase_weight_kernel` into a per-stream workspace (a replay writes it again, so a weight updated in
    place is read afresh). Returns ``dx`` in ``out_format`` (NCHW: stored so by the epilogue)."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import current_stream, launch, sequence_lock
    from tilegemm.core.runtime import new_output

    if g.stride != (1, 1):
        # Strided data gradients split into stride^2 phase convolutions run faster on the GPU than the pointer
        # kernel, but a call is then up to 8 launches (phase weights, convolutions, zeroed phases) whose host time
        # outweighed the GPU time saved (docs/conv2d.md, "Configs"). They stay on the pointer kernel until the
        # phases take fewer launches.
        return None
    ((_, _, gt, r0, s0),) = dgrad_phases(g)
    if min(gt.padding) < 0 or why_not_input(dy, weight, gt):
        return None
    if out_format == torch.channels_last:
        dx = new_output((g.N, g.H, g.W, g.C), dy.dtype, dy.device).permute(0, 3, 1, 2)
    else:
        dx = new_output((g.N, g.C, g.H, g.W), dy.dtype, dy.device)
    stream = current_stream()
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        buf, wt = flip_weight(weight, g, r0, s0, dy, stream)
        kernel, grid, args, kwargs = launch_args(dy, wt, dx, None, gt, "none",
                                                 config(gt, dy.dtype, sm_count(dy.device)))
        launch(kernel, grid, args, kwargs, keep=(buf,), stream=stream)
    return dx


def flip_weight(weight: torch.Tensor, g, r0: int, s0: int, dy: torch.Tensor, stream, tap_major: bool = False,
                phase=None, slot: int = 0):
    """(the workspace, the data gradient's flipped weight ``[C, K/groups, U, V]`` channels-last in it): one launch
    of :func:`phase_weight_kernel` into this stream's ``conv2d-phase-weight`` buffer number ``slot``, of dy's
    dtype. ``phase``: the geometry of one stride phase of a strided ``g`` (:func:`dgrad_phases`: its U x V taps,
    every stride-th of the weight from ``(r0, s0)``); None: stride 1, the whole weight flipped. The caller holds
    :data:`~tilegemm.core.launch.sequence_lock` until its launches that read the buffer are made, and names the
    buffer in their ``keep`` (a replay of them must know it as a workspace); the phases of one call take a slot
    each. ``tap_major`` (a depthwise layer of one output channel an input channel): the flipped ``[C, 1, U, V]``
    weight laid out as row-major ``[U, V, C]``, as the depthwise kernels read it
    (:func:`~tilegemm.ops.conv2d.depthwise.is_tap_major`; the kernel's same launch seen as one input channel to C
    outputs), so that they need no rewrite of their own."""
    from tilegemm.core.launch import launch
    from tilegemm.core.workspace import buffer

    U, V = (g.R, g.S) if phase is None else (phase.R, phase.S)
    sh, sw = g.stride
    total = g.C * U * V * g.Kg
    buf = buffer(dy.device, dy.dtype, total, ("conv2d-phase-weight", slot, 0))
    if tap_major:
        if not (g.is_depthwise and g.K == g.C):
            raise ValueError(f"a tap-major flipped weight is a depthwise layer's of one output an input; got {g}")
        launch(phase_weight_kernel, (cdiv(g.C, 64), 1, U * V),
               (weight, buf, 1, g.C, g.C, 1, V, r0, s0, sh, sw, *weight.stride()),
               dict(BLOCK_C=64, BLOCK_K=64, num_warps=4), keep=(buf,), stream=stream)
        return buf, buf[:total].view(U, V, g.C).permute(2, 0, 1).unsqueeze(1)
    launch(phase_weight_kernel, (cdiv(g.Kg, 64), cdiv(g.C, 64), U * V),
           (weight, buf, g.C, g.Kg, g.Kg, g.Cg, V, r0, s0, sh, sw, *weight.stride()),
           dict(BLOCK_C=64, BLOCK_K=64, num_warps=4), keep=(buf,), stream=stream)
    return buf, buf[:total].view(g.C, U, V, g.Kg).permute(0, 3, 1, 2)


@triton.jit
def phase_weight_kernel(w_ptr, out_ptr, C, Kg, KP, Cg, V, r0, s0, step_h, step_w,
                        stride_wk, stride_wc, stride_wr, stride_ws, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[c, u, v, k] = w[grp * Kg + k, c - grp * Cg, r0 - step_h*u, s0 - step_w*v]`` with ``grp = c // Cg``:
    one stride phase's weight of the data gradient (at stride 1 the whole weight flipped), row-major
    ``[C, U, V, KP]`` (channels-last ``[C, KP, U, V]``; KP = K/groups, or more: zeros past K/groups, the
    channels of a padded ``dy``, :func:`tilegemm.ops.conv2d.padded.dgrad`). A program moves a ``[BLOCK_C, BLOCK_K]``
    tile of one tap (u, v: axis 2), so that both the reads (along the input channels of a channels-last weight)
    and the writes (along k) are coalesced; Triton turns the tile between the two in shared memory. One
    element a thread with k fastest had read 2 bytes of a 32-byte sector each."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    uv = tl.program_id(2)
    u = uv // V
    v = uv % V
    grp = c // Cg
    src = (((grp * Kg)[:, None] + k[None, :]).to(tl.int64) * stride_wk + ((c - grp * Cg) * stride_wc)[:, None]
           + (r0 - step_h * u) * stride_wr + (s0 - step_w * v) * stride_ws)
    ok = (c < C)[:, None] & (k < Kg)[None, :]
    dst = (c.to(tl.int64) * tl.num_programs(2) + uv)[:, None] * KP + k[None, :]
    tl.store(out_ptr + dst, tl.load(w_ptr + src, mask=ok, other=0.0), mask=(c < C)[:, None] & (k < KP)[None, :])


def launch_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias, g, activation: str, cfg: dict,
                within: torch.Tensor | None = None, x_channels: int | None = None):
    """(kernel, grid, args, constexpr kwargs) for :func:`tilegemm.core.launch.launch`. ``weight`` is
    channels-last contiguous; ``x`` satisfies :func:`why_not_input`. ``within``: a tensor ``out`` is a view into; the
    kernel is then passed ``within`` and the element offset of ``out`` in it (a replay maps the call's tensors
    by their data pointers, and a view at an offset has a pointer of its own). ``x_channels``: x's own channel
    count where ``g`` counts padded ones that only the weight holds
    (:func:`tilegemm.ops.conv2d.padded.reads_in_place`)."""
    sh, sw = g.stride
    bi, bh, bw, bn, bk = cfg["BI"], cfg["BH"], cfg["BW"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if cfg["STAGES"] < 2:
        # the ring refills the slot of the step before the one in flight: with one slot it would wait forever
        raise ValueError(f"tma_implicit_gemm needs a ring of 2 slots at least, got STAGES={cfg['STAGES']}")
    swz = min(128, bk * x.element_size())
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=swz, element_bitwidth=16, rank=5)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=swz, element_bitwidth=16, rank=2)
    cx = x_channels or g.C
    x_desc = input_descriptor(x, g, [bi, bh, 1, bw, bk], x_layout, cx, ragged=g.Cg % bk != 0)
    kk = g.R * g.S * g.Cg
    w_desc = TensorDescriptor(weight, [g.K, kk], [kk, 1], [bn, bk], w_layout)
    tiles_p, tiles_q = cdiv(g.P, bh), cdiv(g.Q, bw)
    off_h, off_w = tap_offsets(g)
    base = out if within is None else within
    offset = (out.data_ptr() - base.data_ptr()) // out.element_size()
    args = (x_desc, w_desc, base, bias if bias is not None else base,
            g.N, g.P, g.Q, g.Kg, g.Cg, cx, cx // g.groups, tiles_p, tiles_q, offset,
            out.stride(0), out.stride(2), out.stride(3), out.stride(1), bias.stride(0) if bias is not None else 0,
            g.padding[0], g.padding[2], g.dilation[0], g.dilation[1], off_h, off_w)
    kwargs = dict(R=g.R, S=g.S, SH=sh, SW=sw, HAS_BIAS=bias is not None, ACTIVATION=activation,
                  BI=bi, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["STAGES"], num_warps=cfg["num_warps"],
                  PIXEL_STORES=out.stride(1) != 1 and out.stride(3) == 1)
    grid = (cdiv(g.N, bi) * tiles_p * tiles_q * cdiv(g.Kg, bn), g.groups)
    return conv2d_fwd_tma_kernel, grid, args, kwargs
