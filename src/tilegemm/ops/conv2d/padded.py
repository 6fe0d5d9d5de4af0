"""Channel counts that are not multiples of 16 on the TMA kernel: the channels zero-padded to one.

``tma_implicit_gemm`` steps through a group's input channels 16 (or 32, 64) at a time, and a step must not run
into the next tap or stride phase; TMA also needs 16-byte aligned pixel strides. A layer from 57 channels meets
neither and ran the pointer kernel with 2-byte loads. Here such a layer runs the TMA kernel over padded operands:

- the weight ``[K, C/groups, R, S]`` is written as ``[K, R, S, Cgp]`` (Cgp = C/groups rounded up to 16, or to 32
  or 64 where that costs few more channels: :func:`~tilegemm.ops.conv2d.configs.padded_group`; the extra
  channels zero) on every call: one
  small launch that reads the weight as it is then, so a replay after an optimizer step reads the new values (a
  cache keyed on the weight's version would go stale inside a replay, which checks no versions);
- the input is copied once into a per-stream workspace ``[N, Hp, Wp, groups * Cgp]``, channels-last, each group's
  channels padded with zeros and the rows and columns rounded up to multiples of the stride (zero pixels, which
  only taps past the bottom or right edge read: padding there anyway). The weight's programs ride in the same
  launch;
- except where the input can be read in place (:func:`reads_in_place`: C/groups a multiple of 8, channels-last
  with 16-byte aligned strides, as TMA needs them): its descriptor is then the kernel's usual view of x's own C
  channels, and a channel step reaching past a group's channels reads TMA's zero fill (the last group's, at
  horizontal stride 1) or the next group's or stride phase's first channels, against the padded weight's zero
  columns either way. Only the weight is written. As for the stems (docs/conv2d.md), an inf or NaN in those
  next channels then makes the output NaN where F.conv2d's would not have read them.

The same in-place reading widens the K steps of groups whose channels are a multiple of 16 but not of 32 (``wide``:
48, 80, 112, ... channels, stepped 16 at a time by the kernel itself): their weight is padded to
:func:`~tilegemm.ops.conv2d.configs.wide_group` channels (48 -> 64), where fewer, deeper steps cost less than the
MMAs the zero columns add (docs/conv2d.md, "Odd channel counts").

The output is the layer's own (K channels, any K: the kernel's stores are masked), in the memory format the
input asks for. The stride-1 data gradient, a forward convolution of ``dy`` with the flipped weight, pads ``dy``
the same way (:func:`dgrad`); the weight gradient of one group copies x or dy with channels rounded up to 8 where
their rows are not 16-byte aligned (:func:`wgrad`). The copy kernel is plain Triton (the interpreter runs it);
``auto``'s rule is in :mod:`~tilegemm.ops.conv2d.dispatch`; docs/conv2d.md, "Odd channel counts".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tilegemm.core.runtime import cdiv
from tilegemm.ops.conv2d.configs import padded_group, wide_group
from tilegemm.ops.conv2d.problem import needs_index_64

_16BIT = (torch.float16, torch.bfloat16)  # the TMA kernels' dtypes

STEP = 16  # the TMA kernel's narrowest K step (one wgmma's depth): channels a group it divides need no padding
BLOCK_P = 64  # pixels and channels a program copies: 8 KB of 16-bit data
BLOCK_C = 64


@dataclass(frozen=True)
class Plan:
    """How a layer's padded operands are laid out: ``geo``, the geometry the TMA kernel runs (Cgp channels a
    group, the image rounded up to the stride, the bottom and right padding less those rows so P and Q stay);
    ``in_place``: the input is read as it is (its ``x_channels`` = C channels), else copied."""

    geo: object
    in_place: bool
    x_channels: int


def reads_in_place(x: torch.Tensor, g) -> bool:
    """Whether the TMA kernel reads ``x`` itself (see the module's docstring): its descriptor's strides are
    16-byte aligned, and so is every box's first channel (a group's first, a stride phase's, plus whole K
    steps: C/groups a multiple of 8)."""
    from tilegemm.ops.conv2d.tma_fwd import why_not_input

    return why_not_input(x, None, g, channel_step=8) is None


def plan(x: torch.Tensor, g, wide: bool = False) -> Plan:
    """The padded layout of layer ``g`` over input ``x`` (:class:`Plan`); ``wide``: the in-place widening of
    16-wide K steps (the module's docstring), which needs an input read in place."""
    if wide:
        if not reads_in_place(x, g):
            raise ValueError("widened channel steps read the input in place; this input cannot be")
        return Plan(replace(g, C=g.groups * wide_group(g.Cg)), True, g.C)
    cgp = padded_group(g.Cg)
    if reads_in_place(x, g):
        return Plan(replace(g, C=g.groups * cgp), True, g.C)
    sh, sw = g.stride
    hp, wp = cdiv(g.H, sh) * sh, cdiv(g.W, sw) * sw
    top, bottom, left, right = g.padding
    geo = replace(g, C=g.groups * cgp, H=hp, W=wp, padding=(top, bottom - (hp - g.H), left, right - (wp - g.W)))
    return Plan(geo, False, g.groups * cgp)


def why_not(x: torch.Tensor, weight, g, wide: bool = False) -> str | None:
    """None when the TMA kernel takes layer ``g`` through padded channels (``wide``: widened K steps over the
    input read in place); otherwise why not (in words)."""
    from tilegemm.core.hardware import why_not_gluon
    from tilegemm.core.runtime import interpreting

    if x.dtype not in _16BIT or (weight is not None and weight.dtype != x.dtype):
        return "not 16-bit"
    if not x.is_cuda or interpreting() or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not on a Hopper GPU"
    if (reason := why_not_gluon()) is not None:
        return reason
    if wide:
        if wide_group(g.Cg) == g.Cg:
            return "no wider channel step pays (configs.wide_group)"
        if not reads_in_place(x, g):
            return "the input cannot be read in place"
    elif g.Cg % STEP == 0:
        return "C/groups a multiple of 16 already"
    p = plan(x, g, wide=wide).geo
    if g.N * p.H * p.W * p.C >= 2**31 or g.N * g.K * g.P * g.Q >= 2**31 or needs_index_64(x):
        return "2^31 elements or more"
    return None


@triton.jit
def _pad_pixels(src_ptr, dst_ptr, n, q0, c0, pixels, Wd, H, W, Cgs, Cgd, CD, stride_n, stride_c, stride_h, stride_w,
                SAME: tl.constexpr, GROUPED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[n, h, w, grp * Cgd + j] = src[n, grp * Cgs + j, h, w]`` for j < Cgs inside the source image, else 0,
    for BLOCK_P pixels of image n from ``q0`` and BLOCK_C channels from ``c0`` (``pixels`` = Hd * Wd a destination
    image): ``dst`` is row-major ``[., Hd, Wd, CD]``. SAME: the destination image is the source's and its pixels
    lie in row-major order at ``stride_w`` (no division: along the pixels the addresses stay contiguous for an
    NCHW source, whose loads then run along them)."""
    q = q0 + tl.arange(0, BLOCK_P)
    c = c0 + tl.arange(0, BLOCK_C)
    real = q < pixels
    if SAME:
        src_pix = q.to(tl.int64) * stride_w
        inside = real
    else:
        h = q // Wd
        w = q - h * Wd
        src_pix = h.to(tl.int64) * stride_h + w.to(tl.int64) * stride_w
        inside = real & (h < H) & (w < W)
    if GROUPED:
        grp = c // Cgd
        j = c - grp * Cgd
        cs = grp * Cgs + j
        ok = j < Cgs
    else:
        cs = c
        ok = c < Cgs
    src = src_ptr + n.to(tl.int64) * stride_n + src_pix[:, None] + (cs.to(tl.int64) * stride_c)[None, :]
    v = tl.load(src, mask=inside[:, None] & ok[None, :], other=0.0)  # [BLOCK_P, BLOCK_C]
    dst = dst_ptr + ((n.to(tl.int64) * pixels + q) * CD)[:, None] + c[None, :]
    tl.store(dst, v, mask=real[:, None] & (c < CD)[None, :])


@triton.jit
def pad_channels_kernel(x_ptr, xp_ptr, w_ptr, wp_ptr, x_programs, x_tiles, w_tiles,
                        x_pixels, Wd, H, W, Cg, Cgp, CX, stride_xn, stride_xc, stride_xh, stride_xw,
                        RS, R, S, stride_wk, stride_wc, stride_wr, stride_ws,
                        X_SAME: tl.constexpr, W_SAME: tl.constexpr, GROUPED: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """The padded operands in one launch: along axis 0 the first ``x_programs`` programs copy the input
    ``[N, C, H, W]`` into ``[N, Hd, Wd, CX]`` (each group's Cg channels at Cgp, zeros around), the rest the weight
    ``[K, Cg, R, S]`` into ``[K, R, S, Cgp]`` (:func:`_pad_pixels` each; a weight's "image" is its R x S taps of one
    output channel); axis 1 steps the channels BLOCK_C at a time (a grid axis, not a loop: the compiler then
    knows each tile's first channel is a multiple of BLOCK_C, and stores 16 bytes at once)."""
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK_C
    if pid < x_programs:
        n = pid // x_tiles
        _pad_pixels(x_ptr, xp_ptr, n, (pid - n * x_tiles) * BLOCK_P, c0, x_pixels, Wd, H, W, Cg, Cgp, CX,
                    stride_xn, stride_xc, stride_xh, stride_xw, X_SAME, GROUPED, BLOCK_P, BLOCK_C)
    else:
        t = pid - x_programs
        k = t // w_tiles
        _pad_pixels(w_ptr, wp_ptr, k, (t - k * w_tiles) * BLOCK_P, c0, RS, S, R, S, Cg, Cgp, Cgp,
                    stride_wk, stride_wc, stride_wr, stride_ws, W_SAME, False, BLOCK_P, BLOCK_C)


def _row_major(t: torch.Tensor) -> bool:
    """The pixels of each image of ``[B, C, H, W]`` ``t`` lie in row-major order at one stride (``_pad_pixels``'
    SAME): NCHW tensors, packed channels-last ones."""
    _, _, H, W = t.shape
    return H == 1 or t.stride(2) == W * t.stride(3)


def _pad_launch(x: torch.Tensor, g, pl: Plan, weight: torch.Tensor | None) -> tuple:
    """(the input the TMA kernel reads, the padded weight ``[K, Cgp, R, S]`` channels-last or None, the workspaces
    to keep): one launch of :func:`pad_channels_kernel` for the input's copy (unless read in place) and the
    weight's (if given), none where neither is wanted."""
    from tilegemm.core.launch import current_stream, launch
    from tilegemm.core.workspace import buffer

    gp, cgp = pl.geo, pl.geo.Cg
    keep, wp = (), None
    if weight is not None:
        wbuf = buffer(x.device, x.dtype, g.K * g.R * g.S * cgp, "conv2d-pad-weight")
        keep = (wbuf,)
        wp = wbuf[:g.K * g.R * g.S * cgp].view(g.K, g.R, g.S, cgp).permute(0, 3, 1, 2)
    if pl.in_place:
        xp, x_pixels, x_programs = x, 1, 0
        if weight is None:
            return x, None, ()
        xbuf = wbuf  # a placeholder: no x programs touch it
    else:
        x_pixels = gp.H * gp.W
        xbuf = buffer(x.device, x.dtype, g.N * x_pixels * gp.C, "conv2d-pad-input")
        keep = (xbuf,) + keep
        x_programs = g.N * cdiv(x_pixels, BLOCK_P)
        xp = xbuf[:g.N * x_pixels * gp.C].as_strided((g.N, gp.C, gp.H, gp.W),
                                                     (x_pixels * gp.C, 1, gp.W * gp.C, gp.C))
    w = weight if weight is not None else x  # a placeholder: no weight programs run without a weight
    w_tiles = cdiv(g.R * g.S, BLOCK_P)
    w_programs = g.K * w_tiles if weight is not None else 0
    same = gp.H == g.H and gp.W == g.W and _row_major(x)
    launch(pad_channels_kernel, (x_programs + w_programs, cdiv(gp.C if x_programs else cgp, BLOCK_C)),
           (x, xbuf, w, wbuf if weight is not None else xbuf, x_programs, cdiv(x_pixels, BLOCK_P), w_tiles,
            x_pixels, gp.W, g.H, g.W, g.Cg, cgp, gp.C, *x.stride(), g.R * g.S, g.R, g.S, *w.stride()),
           dict(X_SAME=same, W_SAME=_row_major(w), GROUPED=g.groups > 1, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C,
                num_warps=4),
           keep=keep, stream=current_stream() if x.is_cuda else None)
    return xp, wp, keep


def operands(x: torch.Tensor, weight: torch.Tensor, g, wide: bool = False) -> tuple:
    """(the input the TMA kernel reads, the padded weight channels-last ``[K, Cgp, R, S]``, the workspaces to keep,
    the :class:`Plan`): one launch (the weight's programs alone where the input is read in place). Call under
    :data:`tilegemm.core.launch.sequence_lock` (the workspaces are the stream's). ``wide``: :func:`plan`'s."""
    pl = plan(x, g, wide=wide)
    return (*_pad_launch(x, g, pl, weight), pl)


def run(p, wide: bool = False) -> torch.Tensor:
    """The forward of ``p`` (:func:`why_not` is None, for the same ``wide``) on the TMA kernel over padded
    operands, into the layer's own output."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import current_stream, launch, sequence_lock
    from tilegemm.ops.conv2d import tma_fwd
    from tilegemm.ops.conv2d.implicit_gemm import allocate_out

    out = allocate_out(p)
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        xp, wp, keep, pl = operands(p.x, p.weight, p.geo, wide=wide)
        cfg = tma_fwd.config(pl.geo, p.dtype, sm_count(p.x.device))
        kernel, grid, args, kwargs = tma_fwd.launch_args(xp, wp, out, p.bias, pl.geo, p.activation, cfg,
                                                         x_channels=pl.x_channels)
        launch(kernel, grid, args, kwargs, keep=keep, stream=current_stream())
    return out


def dgrad(dy: torch.Tensor, weight: torch.Tensor, g, out_format: torch.memory_format = torch.channels_last,
          wide: bool = False):
    """The data gradient of a stride-1 layer whose output channels (``dy``'s) are not a multiple of 16 a group,
    or None where this does not take it: :func:`tilegemm.ops.conv2d.tma_fwd.dgrad_tma`'s forward convolution of
    ``dy`` with the flipped weight, ``dy`` padded as :func:`run` pads an input (or read in place) and the flipped
    weight written with padded rows of zeros past K/groups. ``dx`` in ``out_format``. ``wide``: K/groups a
    multiple of 16 stepped wider, ``dy`` read in place (:func:`plan`'s)."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import current_stream, launch, sequence_lock
    from tilegemm.core.runtime import new_output
    from tilegemm.core.workspace import buffer
    from tilegemm.ops.conv2d import tma_fwd

    if g.stride != (1, 1):
        return None  # strided data gradients stay on the pointer kernel (tma_fwd.dgrad_tma says why)
    ((_, _, gt, r0, s0),) = tma_fwd.dgrad_phases(g)
    if min(gt.padding) < 0 or why_not(dy, weight, gt, wide=wide):
        return None
    if out_format == torch.channels_last:
        dx = new_output((g.N, g.H, g.W, g.C), dy.dtype, dy.device).permute(0, 3, 1, 2)
    else:
        dx = new_output((g.N, g.C, g.H, g.W), dy.dtype, dy.device)
    pl = plan(dy, gt, wide=wide)
    kgp = pl.geo.Cg  # dy's channels a group, padded
    total = g.C * g.R * g.S * kgp
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        dyp, _, keep = _pad_launch(dy, gt, pl, None)
        buf = buffer(dy.device, dy.dtype, total, "conv2d-pad-phase-weight")
        launch(tma_fwd.phase_weight_kernel, (cdiv(kgp, 64), cdiv(g.C, 64), g.R * g.S),
               (weight, buf, g.C, g.Kg, kgp, g.Cg, g.S, r0, s0, 1, 1, *weight.stride()),
               dict(BLOCK_C=64, BLOCK_K=64, num_warps=4), keep=(buf,), stream=current_stream())
        wt = buf[:total].view(g.C, g.R, g.S, kgp).permute(0, 3, 1, 2)
        cfg = tma_fwd.config(pl.geo, dy.dtype, sm_count(dy.device))
        kernel, grid, args, kwargs = tma_fwd.launch_args(dyp, wt, dx, None, pl.geo, "none", cfg,
                                                         x_channels=pl.x_channels)
        launch(kernel, grid, args, kwargs, keep=keep + (buf,), stream=current_stream())
    return dx


def _copy_to_8(t: torch.Tensor, g, tag: str) -> tuple:
    """(``t`` ``[B, C, H, W]`` copied channels-last into the per-stream workspace ``tag`` with its C channels
    rounded up to a multiple of 8 (zeros after them) and its rows and columns to multiples of ``g``'s stride
    (zero pixels), that copy's channels, the workspace): one launch of :func:`pad_channels_kernel` (no weight)."""
    from tilegemm.core.launch import current_stream, launch
    from tilegemm.core.workspace import buffer

    B, C, H, W = t.shape
    c8 = cdiv(C, 8) * 8
    sh, sw = g.stride
    hp, wp = cdiv(H, sh) * sh, cdiv(W, sw) * sw
    pixels = hp * wp
    buf = buffer(t.device, t.dtype, B * pixels * c8, tag)
    tiles = cdiv(pixels, BLOCK_P)
    launch(pad_channels_kernel, (B * tiles, cdiv(c8, BLOCK_C)),
           (t, buf, t, buf, B * tiles, tiles, 1, pixels, wp, H, W, C, c8, c8, *t.stride(), 1, 1, 1, *t.stride()),
           dict(X_SAME=(hp, wp) == (H, W) and _row_major(t), W_SAME=True, GROUPED=False, BLOCK_P=BLOCK_P,
                BLOCK_C=BLOCK_C, num_warps=4),
           keep=(buf,), stream=current_stream() if t.is_cuda else None)
    view = buf[:B * pixels * c8].as_strided((B, c8, hp, wp), (pixels * c8, 1, wp * c8, c8))
    return view, c8, buf


def wgrad(dy: torch.Tensor, x: torch.Tensor, g, out_dtype: torch.dtype, memory_format: torch.memory_format):
    """The weight gradient of a one-group layer whose C or K is not a multiple of 8 (16-byte TMA strides), or None
    where this does not take it (:func:`why_not_wgrad`): :func:`tilegemm.ops.conv2d.tma_wgrad.run` over copies of
    ``x`` and ``dy`` (of those whose rows TMA cannot step) with their channels rounded up to a multiple of 8,
    zeros after them, the image rounded up to the stride. The kernel reads the copies' zero channels past C and K
    (its descriptors describe every channel of the copies' rows: whole 16-byte rows), its tiles past C and K are
    computed and not stored, and no weight is padded."""
    from tilegemm.core.launch import keeping, sequence_lock
    from tilegemm.ops.conv2d import tma_fwd, tma_wgrad

    if why_not_wgrad(dy, x, g) is not None:
        return None
    top, bottom, left, right = g.padding
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        keep, gx, cx, ck = [], g, None, None
        if tma_fwd.why_not_input(x, None, g, channel_step=8) is not None:
            x, cx, buf = _copy_to_8(x, g, "conv2d-pad-wgrad-x")
            keep.append(buf)
            _, _, hp, wp = x.shape
            gx = replace(g, H=hp, W=wp, padding=(top, bottom - (hp - g.H), left, right - (wp - g.W)))
        if tma_wgrad.why_not_dy(dy, g) is not None:
            dy, ck, buf = _copy_to_8(dy, replace(g, stride=(1, 1)), "conv2d-pad-wgrad-dy")
            keep.append(buf)
        with keeping(*keep):
            return tma_wgrad.run(dy, x, gx, out_dtype, memory_format=memory_format, x_channels=cx, dy_channels=ck)


def why_not_wgrad(dy: torch.Tensor, x: torch.Tensor, g) -> str | None:
    """None when :func:`wgrad` takes the weight gradient; otherwise why not. One group only: with several, a
    group's first channel would not start a 16-byte aligned box."""
    from tilegemm.core.hardware import why_not_gluon
    from tilegemm.core.runtime import interpreting

    if g.groups != 1:
        return "groups"
    if x.dtype not in _16BIT or dy.dtype != x.dtype:
        return "not 16-bit"
    if not x.is_cuda or interpreting() or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not on a Hopper GPU"
    if (reason := why_not_gluon()) is not None:
        return reason
    sh, sw = g.stride
    if (g.N * cdiv(g.H, sh) * sh * cdiv(g.W, sw) * sw * cdiv(g.C, 8) * 8 >= 2**31
            or g.N * g.P * g.Q * cdiv(g.K, 8) * 8 >= 2**31 or needs_index_64(x, dy)):
        return "2^31 elements or more"
    return None
