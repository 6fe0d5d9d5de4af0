"""``auto`` for ``tilegemm.conv2d`` and its gradients: which kernel takes a call, and the routes that run it (NCHW
inputs through channels-last workspaces; the data and weight gradients through the same kernel files).

On Hopper, for 16-bit channels-last tensors, the TMA kernels: the forward by ``tma_implicit_gemm``, the stride-1
data gradient as a forward convolution, the weight gradient by ``tma_wgrad``; 1x1 layers where they run faster as
GEMMs (tilegemm.matmul, or gluon_f16 with a tile by rule); otherwise the implicit-GEMM pointer kernels, the
depthwise kernels, or GEMMs for 1x1 convolutions. The measurements behind each threshold: docs/conv2d.md, "auto".
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tilegemm.core import registry
from tilegemm.core.dtypes import resolve_precision
from tilegemm.core.hardware import sm_count
from tilegemm.core.launch import into_views, keeping, sequence_lock
from tilegemm.core.runtime import interpreting, on_device
from tilegemm.ops.conv2d import configs, patchify
from tilegemm.ops.conv2d.configs import (
    _patch, _pow2_at_least, gluon_ring, takes_grouped_direct, takes_grouped_packed, tma_forward_config,
)
from tilegemm.ops.conv2d.problem import (
    ConvCall, ConvProblem, DgradCall, Geometry, WgradCall, channels_last, output_format,
)
from tilegemm.ops.matmul import matmul

# auto's thresholds: name = value  # why
STEM_MAX_C = 8  # inputs of at most this many channels are stems: the TMA window route reads them in any layout
STEM_WINDOW_MIN_K = 32  # stems of a channels-last input keep the window route from this many output channels, a
#   multiple of 16; below, or 8 past a multiple of 16, the stem kernel ran 1.2x-2.1x cuDNN where the window 0.4x-0.7x
STEM_WINDOW_MIN_K_PLANAR = 64  # ... of an NCHW input, from this many output channels (the window route's copy)
GEMM_1X1_PIXELS = 16384  # stride-1 1x1 layers over at most this many output pixels: a GEMM beats the TMA kernel
LONG_REDUCTION_STEPS = 32  # a 1x1 layer whose TMA tiles leave SMs idle over this many K steps: split-K GEMM fills them
GLUON_1X1_MIN_CHANNELS = 96  # 1x1 layers with this many output channels take gluon_f16's 128-wide tiles
GLUON_1X1_WAVES = 2.5  # ... where its tiles make this many waves (fewer: its persistent loop gains nothing)
GLUON_1X1_WIDE_FILL = 0.85  # 256x128 tiles where they keep this share of the last round's SMs busy
STRIDED_1X1_TMA_K_MULTIPLE = 16  # strided 1x1 layers whose output channels are 8 past a multiple of this go to the
#   GEMM on the gathered pixels, which ran faster than the TMA kernel on every such zoo layer (docs/conv2d.md,
#   "1x1 layers")
PAD_MIN_CHANNELS = 16  # odd channel counts padded for the TMA kernel from this many a group: below, the pointer
#   kernel's flattened (r, s, c) K steps waste less than padding every pixel's channels to 16
PAD_MIN_TAPS = 2  # ... in filters of at least this many taps: a 1x1 layer's GEMM takes any channel count, and
#   the input's copy would cost about as much as the layer itself (a 3x3 reads each input pixel 9 times)
DGRAD_AS_FORWARD_KINDS = ("depthwise", "grouped")  # data gradients of stride 1 and 2 run as forwards of dy with the
#   flipped weight (:func:`dgrad_as_forward`); measured against the direct kernels in docs/conv2d.md, "Backward"
DGRAD_DIRECT_3X3_PIXELS = 14 * 14  # ... but stride-1 depthwise 3x3 layers on images of at most this many pixels,
#   where the direct kernel's one launch beats the flip and the forward (same page)
DGRAD_PHASES_DIRECT_3X3_ELEMENTS = 128 * 1024  # ... and stride-2 depthwise 3x3 layers whose image holds fewer
#   elements (C*H*W), where the direct kernel's one launch beats four phases' eight (same page)


# --- the choice of kernel -------------------------------------------------------------------------------


def choose_kernel(g: Geometry, x_channels_last: bool = True, tma: bool = False, sms: int = 132,
                  gluon: bool = True, sixteen_bit: bool = True) -> str:
    """``auto``. ``tma``: ``tma_implicit_gemm`` can take the call (a 16-bit channels-last input TMA can describe,
    on Hopper; :func:`tilegemm.ops.conv2d.tma_fwd.why_not`). Then it runs every such convolution but the 1x1 ones
    that run faster as GEMMs (:func:`pointwise_as_gemm`; ``gluon``: the call's tensors let gluon_f16 run it).
    Otherwise: 1x1 stride-1 unpadded single-group convolutions go to ``gemm_1x1`` (tilegemm's GEMM on the
    channels-last view), and so do strided ones with a channels-last input (the kept pixels gathered into a
    matrix first); depthwise ones to ``depthwise``, everything else to ``implicit_gemm``. Before all that, grouped
    layers of few channels a group go to ``grouped_packed`` where its rule takes them (16-bit operands:
    ``sixteen_bit``; :func:`~tilegemm.ops.conv2d.configs.takes_grouped_packed`), else to ``grouped_direct``
    (:func:`~tilegemm.ops.conv2d.configs.takes_grouped_direct`). A ``tma`` layer whose channels the kernel would
    pad (:func:`pads_channels`) takes it only where
    :func:`padding_pays`."""
    if takes_grouped_packed(g, sixteen_bit):  # few channels a group: several groups a tensor-core tile
        return "grouped_packed"
    if takes_grouped_direct(g):  # few channels a group: CUDA cores, not mostly empty MMA tiles
        return "grouped_direct"
    pointwise = g.is_pointwise or (g.is_strided_pointwise and x_channels_last)
    if tma and stem_kernel_pays(g, x_channels_last):
        return "implicit_gemm"  # its stem kernel (configs.takes_stem)
    if tma and not g.is_depthwise and (not pads_channels(g) or padding_pays(g)):
        if not (pointwise and pointwise_as_gemm(g, sms, gluon)):
            return "tma_implicit_gemm"
    if pointwise:
        return "gemm_1x1"
    if g.is_depthwise:
        return "depthwise"
    return "implicit_gemm"


def stem_kernel_pays(g: Geometry, x_channels_last: bool) -> bool:
    """Whether a stem (one group, at most :data:`STEM_MAX_C` channels, a filter of more than one tap) runs faster
    on the pointer kernel's stem kernel (:func:`~tilegemm.ops.conv2d.configs.takes_stem`) than through the
    TMA window route: from a channels-last input, output channels not a multiple of 16 or fewer than
    :data:`STEM_WINDOW_MIN_K`; from any other layout (the window route copies it), fewer than
    :data:`STEM_WINDOW_MIN_K_PLANAR` (docs/conv2d.md, "Stems")."""
    if g.groups != 1 or g.C > STEM_MAX_C or g.R * g.S == 1 or not configs.takes_stem(g):
        return False
    if not x_channels_last:
        return g.K < STEM_WINDOW_MIN_K_PLANAR
    return g.K % 16 != 0 or g.K < STEM_WINDOW_MIN_K


def pads_channels(g: Geometry) -> bool:
    """Whether ``tma_implicit_gemm`` runs ``g`` over zero-padded channels (:mod:`tilegemm.ops.conv2d.padded`):
    C/groups not a multiple of 16, and not a stem (the window route)."""
    return g.Cg % 16 != 0 and not (g.groups == 1 and g.C <= STEM_MAX_C)


def widens_steps(g: Geometry) -> bool:
    """``auto``'s rule for wider K steps (``padded.run(p, wide=True)``): a single-group layer of more than one tap
    whose C is a multiple of 16 but not of 32 (16-wide steps) and :func:`~tilegemm.ops.conv2d.configs.wide_group`
    pads (48 -> 64 channels), at horizontal stride 1 (the steps past C then read TMA's zero fill, not the next
    stride phase's channels: exact whatever the input holds), of at least
    :data:`~tilegemm.ops.conv2d.configs.WIDE_STEP_MIN_FLOPS`: every such zoo layer ran 0.40x-0.81x cuDNN on the
    16-wide steps (docs/conv2d.md, "Odd channel counts"). Grouped ones run 2.7x-4.7x cuDNN as they are; 1x1 layers
    are GEMMs or ragged steps."""
    return (g.groups == 1 and g.R * g.S > 1 and g.stride[1] == 1 and configs.wide_group(g.Cg) > g.Cg
            and 2 * g.N * g.P * g.Q * g.K * g.Cg * g.R * g.S >= configs.WIDE_STEP_MIN_FLOPS)


def padding_pays(g: Geometry) -> bool:
    """``auto``'s rule for padded channels: at least :data:`PAD_MIN_CHANNELS` a group, in a filter of at least
    :data:`PAD_MIN_TAPS` taps, not depthwise."""
    return not g.is_depthwise and g.Cg >= PAD_MIN_CHANNELS and g.R * g.S >= PAD_MIN_TAPS


def pointwise_gluon_tile(g: Geometry, sms: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES) of the gluon_f16 config a stride-1 1x1 layer runs as a GEMM with, or
    None where it does not: over more than :data:`GEMM_1X1_PIXELS` pixels, with at least
    :data:`GLUON_1X1_MIN_CHANNELS` output channels 128-wide tiles (256 rows where they fill the last round, or
    the input channels are few), narrower layers 256 rows by the output channels' power of two; a K step of the
    input channels' power of two (16 to 64); in :data:`GLUON_1X1_WAVES` waves or more; the ring as deep as fits.
    Channel counts must be multiples of 8 (16-bit rows TMA can describe) and at least 16. Geometry only:
    :func:`tilegemm.ops.conv2d.gemm_1x1.gluon_usable` says whether a call's tensors let it run."""
    if not g.is_pointwise or g.C % 8 or g.K % 8 or g.C < 16 or g.K < 16:  # gluon_f16's TMA needs 16 of each
        return None
    m = g.N * g.P * g.Q
    if m <= GEMM_1X1_PIXELS:
        return None
    bk = _pow2_at_least(g.C, 16, 64)
    if g.K >= GLUON_1X1_MIN_CHANNELS:
        if -(-m // 128) * -(-g.K // 128) < GLUON_1X1_WAVES * sms:
            return None
        wide = -(-m // 256) * -(-g.K // 128)
        filled = wide / (-(-wide // sms) * sms)  # the share of the last round's SMs the 256x128 tiles keep busy
        bm, bn = (256, 128) if g.C <= 64 or filled >= GLUON_1X1_WIDE_FILL else (128, 128)
    else:
        bm, bn = 256, _pow2_at_least(g.K, 16, 128)
        if -(-m // bm) * -(-g.K // bn) < GLUON_1X1_WAVES * sms:
            return None
    return bm, bn, bk, gluon_ring(bm, bn, bk)


def pointwise_as_gemm(g: Geometry, sms: int, gluon: bool = True) -> bool:
    """True when a 1x1 convolution does better as a GEMM than through the TMA kernel: stride 1 over at most
    :data:`GEMM_1X1_PIXELS` output pixels or with more than two channel steps narrower than 64, or (``gluon``:
    the call's tensors let gluon_f16 run it) where :func:`pointwise_gluon_tile` gives a tile; or (any stride)
    when the TMA kernel's chosen tiles leave SMs idle over :data:`LONG_REDUCTION_STEPS` K steps or more, where
    the GEMM's split-K fills the GPU (ResNet-50's 2048 -> 512 at 7x7); strided, with output channels 8 past a
    multiple of :data:`STRIDED_1X1_TMA_K_MULTIPLE`."""
    if gluon and pointwise_gluon_tile(g, sms) is not None:
        return True
    if g.Kg % STRIDED_1X1_TMA_K_MULTIPLE == 8 and not g.is_pointwise:
        return True  # a strided 1x1 whose output channels end in a partial 16-wide step: the GEMM on the kept pixels
    if g.is_pointwise:
        bk = 64 if g.Cg % 64 == 0 else 32 if g.Cg % 32 == 0 else 16
        if g.N * g.P * g.Q <= GEMM_1X1_PIXELS or (bk < 64 and g.Cg // bk > 2):
            return True
    cfg = tma_forward_config(g, sms)
    tiles = _patch(g, cfg["BI"] * cfg["BH"] * cfg["BW"])[3] * -(-g.Kg // cfg["BLOCK_N"]) * g.groups
    return tiles < sms and g.R * g.S * -(-g.Cg // cfg["BLOCK_K"]) >= LONG_REDUCTION_STEPS


def transposed_gluon_tile(w2d: torch.Tensor, image: tuple[int, int, int], device) -> tuple | None:
    """The gluon_f16 tile of a 1x1 layer's data gradient ``dy @ w`` over the ``image`` (N, P, Q) of output
    pixels: that of the transposed layer's forward (K -> C channels), by :func:`pointwise_gluon_tile`."""
    (K, C), (n, p, q) = w2d.shape, image
    return pointwise_gluon_tile(Geometry(n, K, p, q, C, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)), sm_count(device))


_TMA_REASON: list = []  # why the TMA kernels cannot run in this process (None: they can), once asked


def _tma_runs_here() -> bool:
    """The GPU and Triton run the Gluon kernels (the registered kernel's requirement, asked once)."""
    if not _TMA_REASON:
        _TMA_REASON.append(registry.get("conv2d", "tma_implicit_gemm").unavailable_reason())
    return _TMA_REASON[0] is None


def _tma_candidate(t: torch.Tensor) -> bool:
    """The cheap part of :func:`_tma_usable`: a 16-bit CUDA tensor, channels-last or a stem's (at most
    :data:`STEM_MAX_C` channels, which the window route copies whatever its layout), not under the interpreter,
    in a process whose GPU and Triton run the Gluon kernels."""
    if not (t.is_cuda and t.dtype != torch.float32 and (t.stride(1) == 1 or t.shape[1] <= STEM_MAX_C)) \
            or interpreting():
        return False
    return _tma_runs_here()


def _tma_usable(p: ConvProblem) -> bool:
    """Whether ``tma_implicit_gemm`` takes the forward problem ``p``, directly, as a stem or over padded channels
    (:func:`_launch`; its modules imported only for a 16-bit channels-last CUDA input)."""
    if not _tma_candidate(p.x):
        return False
    from tilegemm.ops.conv2d import padded, tma_fwd

    return tma_fwd.why_not(p) is None or padded.why_not(p.x, p.weight, p.geo) is None


def _tma_wgrad_usable(dy: torch.Tensor, x: torch.Tensor, g: Geometry) -> bool:
    """Whether the TMA weight-gradient kernel takes the weight gradient of ``g`` for ``dy`` and ``x``."""
    if not _tma_candidate(x):
        return False
    from tilegemm.ops.conv2d import tma_wgrad

    return tma_wgrad.why_not(dy, x, g) is None


def launcher(name: str):
    """The launch function of a registered conv2d kernel (:func:`tilegemm.core.registry.launcher`)."""
    return registry.launcher("conv2d", name)


def _launch(kernel: str, p: ConvProblem) -> torch.Tensor:
    """Run ``p`` on ``kernel``; ``gemm_1x1``'s config is the gluon_f16 tile of :func:`pointwise_gluon_tile`;
    ``tma_implicit_gemm`` over padded channels (:mod:`~tilegemm.ops.conv2d.padded`) where it takes ``p``
    neither directly nor as a stem, and over a weight padded for wider K steps where :func:`widens_steps`."""
    if kernel == "gemm_1x1":
        return launcher(kernel)(p, pointwise_gluon_tile(p.geo, sm_count(p.x.device)))
    if kernel == "tma_implicit_gemm" and (p.geo.Cg % 16 or widens_steps(p.geo)):
        from tilegemm.ops.conv2d import padded, tma_fwd

        if p.geo.Cg % 16:
            if tma_fwd.why_not(p) is not None and padded.why_not(p.x, p.weight, p.geo) is None:
                return padded.run(p)
        elif padded.why_not(p.x, p.weight, p.geo, wide=True) is None:
            return padded.run(p, wide=True)
    return launcher(kernel)(p)


# --- the forward ----------------------------------------------------------------------------------------


def forward(c: ConvCall) -> torch.Tensor:
    """The output of forward call ``c`` (what ``tilegemm::conv2d`` runs)."""
    x = c.x
    g = c.geometry()
    p = ConvProblem(x, c.weight, c.bias, g, c.out_dtype or x.dtype, output_format(x, c.weight), c.activation,
                    resolve_precision(c.precision, x.dtype), x.dtype == torch.bfloat16 and interpreting())
    if x.numel() == 0 or g.N * g.P * g.Q == 0:
        from tilegemm.ops.conv2d.implicit_gemm import empty_4d

        out = empty_4d(g.out_shape, p.out_dtype, x.device, p.out_format)
        return out.zero_() if out.numel() else out
    with on_device(x.device):
        kernel = c.kernel
        if kernel == "auto":
            if _nchw_route(x):
                return _forward_nchw(p)
            kernel = _auto_kernel(p)
        return _launch(kernel, p)


def _auto_kernel(p: ConvProblem) -> str:
    from tilegemm.ops.conv2d.gemm_1x1 import gluon_usable

    tma = _tma_usable(p)
    kernel = choose_kernel(p.geo, channels_last(p.x), tma, sm_count(p.x.device),
                           tma and gluon_usable(p.x, p.weight, p.bias, p.out_dtype), p.x.element_size() == 2)
    if kernel == "grouped_packed" and configs.GROUPED_PACKED_TMA_AUTO and _tma_candidate(p.x):
        from tilegemm.ops.conv2d.grouped_packed import why_not_tma

        if why_not_tma(p, configs.grouped_packed_tma_groups(p.geo)) is None:
            return "grouped_packed_tma"
    return kernel


def _nchw_route(x: torch.Tensor) -> bool:
    """Whether ``auto`` runs an NCHW input through a channels-last copy (:mod:`tilegemm.ops.conv2d.layout`): a
    plain contiguous 16-bit CUDA input of more than :data:`STEM_MAX_C` channels (stems read any layout) in a
    process where the TMA kernels run, so that the copy lets them take the call. The gradients of such layers
    take the same route (:func:`_dgrad_nchw` but for 1x1 stride-1 layers, :func:`_wgrad_nchw`)."""
    from tilegemm.ops.conv2d.layout import planar  # the module imports triton: here, when a call runs

    if not planar(x) or x.shape[1] <= STEM_MAX_C or x.dtype == torch.float32 or not x.is_cuda \
            or interpreting():
        return False
    return _tma_runs_here()


def _forward_nchw(p: ConvProblem) -> torch.Tensor:
    """The forward of an NCHW input (:func:`_nchw_route`). 1x1 stride-1 layers stay one batched GEMM over the NCHW
    tensors as they are (:mod:`~tilegemm.ops.conv2d.gemm_1x1`, no copy: faster than through the TMA kernel with
    NCHW stores; docs/conv2d.md, "NCHW inputs"). The others: x transposed channels-last into a workspace, then
    the TMA kernel where it takes the copy (storing the output in its format from its epilogue), the depthwise or
    the pointer kernel (an NCHW output: into a second workspace, channels-last, then transposed into the output,
    :func:`tilegemm.ops.conv2d.layout.to_nchw`; a channels-last one, as a channels-last weight asks, stored as it
    is). Every launch is Triton's, so the call replays."""
    from tilegemm.ops.conv2d import layout
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    g = p.geo
    if g.is_pointwise:
        return _launch("gemm_1x1", p)
    packed = takes_grouped_packed(g, p.x.element_size() == 2)
    if pads_channels(g) and padding_pays(g) and not takes_grouped_direct(g) and not packed:
        from tilegemm.ops.conv2d import padded

        if padded.why_not(p.x, p.weight, g) is None:
            return padded.run(p)  # the padded channels-last copy made from the NCHW input; NCHW stores
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        xc, xbuf = layout.workspace_view(p.x, "conv2d-nchw-input")
        pc = replace(p, x=xc)
        if g.is_depthwise:
            kernel = "depthwise"
        elif packed:
            kernel = "grouped_packed"
        elif takes_grouped_direct(g):
            kernel = "grouped_direct"
        elif _tma_usable(pc) and not pads_channels(g):  # padded layers that pay took the route above
            kernel = "tma_implicit_gemm"
        else:
            kernel = "implicit_gemm"
        layout.fill(p.x, xc, xbuf)
        with keeping(xbuf):
            if kernel == "tma_implicit_gemm":
                return _launch(kernel, pc)  # stores in the output's format from its epilogue
            if p.out_format == torch.channels_last:  # (a channels-last weight's): stored as it is, no transpose
                return launcher(kernel)(replace(pc, out=empty_4d(g.out_shape, p.out_dtype, p.x.device,
                                                                 torch.channels_last)))
            out = empty_4d(g.out_shape, p.out_dtype, p.x.device, torch.contiguous_format)
            oc, obuf = layout.channels_last_workspace(g.out_shape, p.out_dtype, p.x.device, "conv2d-nchw-output")
            with keeping(obuf):
                launcher(kernel)(replace(pc, out_format=torch.channels_last, out=oc))
                return layout.to_nchw(oc, out, keep=(obuf,))


# --- the data gradient ----------------------------------------------------------------------------------


def _upcast(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and interpreting()


def _as_nhwc_2d(t: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` as the row-major ``[N*H*W, C]`` matrix of its channels-last layout (a view when it is)."""
    N, C, H, W = t.shape
    return t.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(N * H * W, C)


def dgrad(c: DgradCall) -> torch.Tensor:
    """The data gradient of call ``c`` (what ``tilegemm::conv2d_dgrad`` runs)."""
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    dy, weight, x_shape = c.dy, c.weight, c.x_shape
    g = c.geometry()
    fmt = c.x_format
    if dy.numel() == 0:
        return empty_4d(x_shape, dy.dtype, dy.device, fmt).zero_()
    precision = resolve_precision(c.precision, dy.dtype)
    with on_device(dy.device):
        if g.is_pointwise:
            from tilegemm.ops.conv2d.gemm_1x1 import dgrad_product

            w2d = weight.reshape(g.K, g.C)  # [K, C]
            if c.x_channels_last:
                image = (g.N, g.H, g.W)
                dx = dgrad_product(_as_nhwc_2d(dy), w2d, transposed_gluon_tile(w2d, image, dy.device),
                                   precision)  # [NHW, C]
                return dx.view(g.N, g.H, g.W, g.C).permute(0, 3, 1, 2)
            dx = matmul(w2d.t(), dy.reshape(g.N, g.K, g.H * g.W), precision=precision)  # [N, C, HW]
            return dx.view(g.N, g.C, g.H, g.W)
        if patchify.takes(g):  # a patch embedding's stem: one GEMM over the patches
            return patchify.dgrad(dy, weight, x_shape, fmt, g, precision)
        if not c.x_channels_last and _nchw_route(dy):
            return _dgrad_nchw(dy, weight, x_shape, g, precision)
        if g.is_strided_pointwise and c.x_channels_last and dy.is_contiguous(memory_format=torch.channels_last):
            from tilegemm.ops.conv2d.gemm_1x1 import strided_dgrad

            tile = transposed_gluon_tile(weight.reshape(g.K, g.C), (g.N, g.P, g.Q), dy.device)
            return strided_dgrad(dy, weight, g, precision, tile)
        if c.x_channels_last and dgrad_as_forward(g, dy):
            return _dgrad_as_forward(dy, weight, g, precision)
        if g.is_depthwise:
            from tilegemm.ops.conv2d import depthwise

            return depthwise.dgrad(dy, weight, x_shape, fmt, g)
        if takes_grouped_direct(g):
            from tilegemm.ops.conv2d import grouped_direct

            return grouped_direct.dgrad(dy, weight, x_shape, fmt, g)
        if c.x_channels_last and _tma_candidate(dy):
            from tilegemm.ops.conv2d import padded, tma_fwd

            dx = padded.dgrad(dy, weight, g, wide=True) if _dgrad_widens(g) else None
            if dx is None:
                dx = tma_fwd.dgrad_tma(dy, weight, g)
            if dx is None and _dgrad_pads(g):
                dx = padded.dgrad(dy, weight, g)
            if dx is not None:
                return dx
        from tilegemm.ops.conv2d import implicit_gemm

        return implicit_gemm.dgrad(dy, weight, x_shape, fmt, g, precision, _upcast(dy))


def dgrad_as_forward(g: Geometry, dy: torch.Tensor) -> bool:
    """Whether ``auto`` runs the data gradient of ``g`` as forward convolutions of ``dy`` with the flipped weight
    (:func:`_dgrad_as_forward`): 16-bit depthwise layers (one output channel an input channel) and layers of few
    channels a group (:func:`~tilegemm.ops.conv2d.configs.takes_grouped_direct`), in the kinds
    :data:`DGRAD_AS_FORWARD_KINDS` names, of stride 1 (one convolution) or 2 without dilation (four: one a stride
    phase, :func:`~tilegemm.ops.conv2d.tma_fwd.dgrad_phases`), where every phase has taps and no flipped weight's
    padding is negative; but depthwise 3x3 layers on small images (:data:`DGRAD_DIRECT_3X3_PIXELS` at stride 1,
    :data:`DGRAD_PHASES_DIRECT_3X3_ELEMENTS` at stride 2). Their direct data gradient kernels gather every input
    pixel's taps through their own addresses; the forward's depthwise and grouped kernels were tuned against cuDNN
    (docs/conv2d.md, "Backward")."""
    from tilegemm.ops.conv2d.tma_fwd import dgrad_phases

    if g.stride not in ((1, 1), (2, 2)) or dy.dtype not in (torch.float16, torch.bfloat16):
        return False
    if g.is_depthwise:
        if g.R == g.S == 3 and (g.H * g.W <= DGRAD_DIRECT_3X3_PIXELS if g.stride == (1, 1)
                                else g.C * g.H * g.W < DGRAD_PHASES_DIRECT_3X3_ELEMENTS):
            return False
        kind = "depthwise" if g.K == g.C else None
    else:
        kind = "grouped" if takes_grouped_direct(g) else None
    if kind not in DGRAD_AS_FORWARD_KINDS:
        return False
    phases = dgrad_phases(g)
    return bool(phases) and all(gt is not None and min(gt.padding) >= 0 for (_, _, gt, _, _) in phases)


def _dgrad_as_forward(dy: torch.Tensor, weight: torch.Tensor, g: Geometry, precision: str) -> torch.Tensor:
    """The data gradient of ``g`` (:func:`dgrad_as_forward`) as ``conv2d(dy, w')`` with
    ``w'[c, k, r, s] = w[k, c, R-1-r, S-1-s]`` per group, run by the forward's ``auto`` (channels-last ``dx``); at
    stride 2 one such convolution a stride phase, each with its taps of the flipped weight, into that phase's
    pixels of ``dx`` (a strided view: the forward kernels store by the output's strides). Each flipped weight is
    written by :func:`~tilegemm.ops.conv2d.tma_fwd.phase_weight_kernel` into a per-stream workspace, so a replay
    flips an updated weight again; a stride-2 call is eight launches, what a replay holds."""
    from tilegemm.core.launch import current_stream
    from tilegemm.core.runtime import new_output
    from tilegemm.ops.conv2d.tma_fwd import dgrad_phases, flip_weight

    phases = dgrad_phases(g)
    (sh, sw) = g.stride
    dx = None if len(phases) == 1 else new_output((g.N, g.H, g.W, g.C), dy.dtype, dy.device).permute(0, 3, 1, 2)
    stream = current_stream()
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        for slot, (a, b, gt, r0, s0) in enumerate(phases):
            buf, wt = flip_weight(weight, g, r0, s0, dy, stream, tap_major=g.is_depthwise,
                                  phase=None if dx is None else gt, slot=slot)
            p = ConvProblem(dy, wt, None, gt, dy.dtype, torch.channels_last, "none", precision,
                            dy.dtype == torch.bfloat16 and interpreting(),
                            out=None if dx is None else dx[:, :, a::sh, b::sw])
            # The forward's launches read the workspace (a replay must know it as one) and store into the phase's
            # view of dx, which they write whole (every phase has taps: dgrad_as_forward).
            with keeping(buf), into_views():
                out = _launch(_auto_kernel(p), p)
    return out if dx is None else dx


def _as_dgrad_forward(g: Geometry) -> Geometry:
    """The forward convolution of ``dy`` (K/groups channels a group in, C/groups out) a stride-1 data gradient is,
    as far as channel counts go."""
    return Geometry(g.N, g.K, g.P, g.Q, g.C, g.R, g.S, g.groups, g.stride, g.padding, g.dilation)


def _dgrad_pads(g: Geometry) -> bool:
    """Whether the data gradient of ``g`` runs over padded channels of ``dy``
    (:func:`tilegemm.ops.conv2d.padded.dgrad`): that of a forward convolution of ``dy`` (K/groups channels a
    group) whose channels :func:`padding_pays` pads."""
    t = _as_dgrad_forward(g)
    return g.stride == (1, 1) and not g.is_depthwise and pads_channels(t) and padding_pays(t)


def _dgrad_widens(g: Geometry) -> bool:
    """Whether the data gradient of ``g`` takes wider K steps (``padded.dgrad(..., wide=True)``): a stride-1 layer
    whose forward of ``dy`` :func:`widens_steps` (K a multiple of 16 but not of 32, one group, more than one tap)."""
    return g.stride == (1, 1) and widens_steps(_as_dgrad_forward(g))


def _dgrad_nchw(dy, weight, x_shape, g, precision) -> torch.Tensor:
    """The data gradient of an NCHW layer (:func:`_nchw_route` of ``dy``) but a 1x1 stride-1 one, as the forward's
    route: ``dy`` transposed channels-last into a workspace, then the TMA kernel (stride 1; NCHW stores), the
    depthwise or the pointer kernel, each writing the NCHW ``dx``; every launch Triton's, so the call replays."""
    from tilegemm.ops.conv2d import implicit_gemm, layout

    nchw = torch.contiguous_format
    if _dgrad_pads(g) and not takes_grouped_direct(g):
        from tilegemm.ops.conv2d import padded

        dx = padded.dgrad(dy, weight, g, out_format=nchw)  # dy padded channels-last in its one copy
        if dx is not None:
            return dx
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        dyc, buf = layout.to_channels_last(dy, "conv2d-nchw-dy")
        with keeping(buf):
            if g.is_depthwise:
                from tilegemm.ops.conv2d import depthwise

                return depthwise.dgrad(dyc, weight, x_shape, nchw, g)
            if takes_grouped_direct(g):
                from tilegemm.ops.conv2d import grouped_direct

                return grouped_direct.dgrad(dyc, weight, x_shape, nchw, g)
            if _tma_candidate(dyc):
                from tilegemm.ops.conv2d import padded, tma_fwd

                dx = padded.dgrad(dyc, weight, g, out_format=nchw, wide=True) if _dgrad_widens(g) else None
                if dx is None:
                    dx = tma_fwd.dgrad_tma(dyc, weight, g, out_format=nchw)
                if dx is not None:
                    return dx
            w, keep = implicit_gemm.pointer_weight(weight)
            with keeping(*keep):
                return implicit_gemm.dgrad(dyc, w, x_shape, nchw, g, precision, _upcast(dyc))


# --- the weight gradient --------------------------------------------------------------------------------


def wgrad(c: WgradCall) -> torch.Tensor:
    """The weight gradient of call ``c`` (what ``tilegemm::conv2d_wgrad`` runs), in :func:`wgrad_format`."""
    dy, x, w_shape = c.dy, c.x, c.w_shape
    g = c.geometry()
    fmt = c.w_format
    if dy.numel() == 0:
        from tilegemm.ops.conv2d.implicit_gemm import empty_4d

        return empty_4d(w_shape, x.dtype, x.device, fmt).zero_()
    precision = resolve_precision(c.precision, x.dtype)
    with on_device(x.device):
        from tilegemm.ops.conv2d.layout import planar

        if patchify.takes(g):  # a patch embedding's stem: one GEMM over the gathered patches
            return patchify.wgrad(dy, x, g, precision, fmt)
        if _nchw_route(x) and planar(dy):
            return _wgrad_nchw(dy, x, g, precision, fmt)
        return _wgrad_channels_last(dy, x, g, precision, fmt, x.dtype, pads=_wgrad_pads(g) and _tma_candidate(x))


def _wgrad_channels_last(dy, x, g: Geometry, precision: str, fmt, dtype, pads: bool) -> torch.Tensor:
    """The weight gradient from channels-last ``dy`` and ``x`` (``dtype``: the caller's x's), by the first kernel
    that takes the layer (grouped layers of few channels a group first through a coarser grouping's,
    :func:`_coarse_wgrad`); ``pads``: try the padded TMA route (:func:`_wgrad_pads`) before the pointer kernel."""
    if g.is_pointwise:
        from tilegemm.ops.conv2d.gemm_1x1 import pointwise_wgrad

        # [K, NHW] @ [NHW, C]: a few output tiles over a reduction as long as the pixels, split_k's class
        return pointwise_wgrad(_as_nhwc_2d(dy).t(), _as_nhwc_2d(x), precision).view(g.K, g.C, 1, 1)
    if g.groups > 1 and not g.is_depthwise and not takes_grouped_direct(g) and g.R * g.S * g.groups > _max_grid_y():
        return _wgrad_by_groups(dy, x, g, precision, fmt, dtype, pads)
    # few channels a group: in the full tiles of a coarser grouping (docs/conv2d.md, "Grouped weight gradient by
    # a coarser grouping")
    gt = configs.coarse_wgrad_groups(g)
    if gt and dtype in (torch.float16, torch.bfloat16):
        from tilegemm.ops.conv2d.grouped_packed import coarse_geometry

        if _tma_wgrad_usable(dy, x, coarse_geometry(g, gt)):
            return _coarse_wgrad(dy, x, g, gt, fmt, dtype)
    if g.is_depthwise:
        from tilegemm.ops.conv2d import depthwise

        return depthwise.wgrad(dy, x, g, dtype)
    if takes_grouped_direct(g):
        from tilegemm.ops.conv2d import grouped_direct

        return grouped_direct.wgrad(dy, x, g, dtype, fmt)
    if _tma_wgrad_usable(dy, x, g):
        from tilegemm.ops.conv2d import tma_wgrad

        return tma_wgrad.run(dy, x, g, dtype, memory_format=fmt)
    if pads:
        from tilegemm.ops.conv2d import padded

        dw = padded.wgrad(dy, x, g, dtype, fmt)
        if dw is not None:
            return dw
    from tilegemm.ops.conv2d import implicit_gemm

    return implicit_gemm.wgrad(dy, x, g, precision, _upcast(x), dtype, memory_format=fmt)


def _max_grid_y() -> int:
    from tilegemm.ops.conv2d.implicit_gemm import _MAX_GRID_Y

    return _MAX_GRID_Y


def _wgrad_by_groups(dy, x, g: Geometry, precision: str, fmt, dtype, pads: bool) -> torch.Tensor:
    """The weight gradient of a layer whose taps times groups pass the grid's second axis (the TMA and pointer
    kernels put a program per tap and group there): a call per run of groups that fits, on channel slices of
    ``dy`` and ``x``, each copied into its rows of the gradient. The copies are torch's, so the call is not kept
    for replay (:func:`tilegemm.core.launch.spoil`)."""
    from tilegemm.core.launch import spoil
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    spoil()
    dw = empty_4d((g.K, g.Cg, g.R, g.S), dtype, x.device, fmt)
    per = max(1, _max_grid_y() // (g.R * g.S))
    for first in range(0, g.groups, per):
        n = min(per, g.groups - first)
        part = replace(g, C=n * g.Cg, K=n * g.Kg, groups=n)
        k, c = first * g.Kg, first * g.Cg
        dw[k:k + n * g.Kg].copy_(_wgrad_channels_last(dy[:, k:k + n * g.Kg], x[:, c:c + n * g.Cg], part, precision,
                                                      fmt, dtype, pads))
    return dw


def _coarse_wgrad(dy, x, g: Geometry, gt: int, fmt, dtype) -> torch.Tensor:
    """The weight gradient of ``g`` as the diagonal blocks of that of the layer with GT times fewer groups
    (:func:`~tilegemm.ops.conv2d.grouped_packed.coarse_geometry`; ``auto``'s GT:
    :func:`~tilegemm.ops.conv2d.configs.coarse_wgrad_groups`): the coarse gradient by ``tma_wgrad`` into a
    per-stream workspace (channels-last), then :func:`~tilegemm.ops.conv2d.grouped_packed.block_diagonal` into the
    returned gradient in ``fmt``. Both launches name the workspace as theirs, so the call replays."""
    from tilegemm.core.launch import current_stream
    from tilegemm.core.workspace import buffer
    from tilegemm.ops.conv2d import tma_wgrad
    from tilegemm.ops.conv2d.grouped_packed import block_diagonal, coarse_geometry
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    gc = coarse_geometry(g, gt)
    dw = empty_4d((g.K, g.Cg, g.R, g.S), dtype, x.device, fmt)
    total = g.K * gc.Cg * g.R * g.S
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        buf = buffer(x.device, dtype, total, ("conv2d-coarse-wgrad", 0, 0))
        coarse = buf[:total].view(g.K, g.R, g.S, gc.Cg).permute(0, 3, 1, 2)  # [K, GT*C/groups, R, S]
        with keeping(buf):  # the kernels write and read the workspace: a replay of them must know it as one
            tma_wgrad.run(dy, x, gc, dtype, out=coarse)
            return block_diagonal(coarse, g, gt, dw, stream=current_stream(), keep=(buf,))


def _wgrad_pads(g: Geometry) -> bool:
    """Whether the weight gradient of ``g`` runs the TMA kernel over copies of ``x`` or ``dy`` with channels
    rounded up to 8 (:func:`tilegemm.ops.conv2d.padded.wgrad`): one group, C or K not a multiple of 8, in a layer
    whose channels :func:`padding_pays` pads (the copies are passes over x and dy; a 3x3's gradient reads each
    9 times)."""
    return g.groups == 1 and (g.C % 8 != 0 or g.K % 8 != 0) and padding_pays(g)


def _wgrad_nchw(dy, x, g, precision, fmt) -> torch.Tensor:
    """The weight gradient of an NCHW layer (:func:`_nchw_route` of ``x``): ``x`` and ``dy`` transposed
    channels-last into workspaces, then the kernel a channels-last call takes (a 1x1 stride-1 layer's GEMM too),
    the gradient in ``fmt`` (:func:`wgrad_format`: channels-last for a channels-last weight); every launch
    Triton's, so the call replays."""
    from tilegemm.ops.conv2d import layout

    if _wgrad_pads(g) and not g.is_pointwise and not takes_grouped_direct(g):
        from tilegemm.ops.conv2d import padded

        dw = padded.wgrad(dy, x, g, x.dtype, fmt)  # x and dy padded channels-last in their one copy each
        if dw is not None:
            return dw
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        xc, xbuf = layout.to_channels_last(x, "conv2d-nchw-x")
        dyc, dybuf = layout.to_channels_last(dy, "conv2d-nchw-dy")
        with keeping(xbuf, dybuf):
            return _wgrad_channels_last(dyc, xc, g, precision, fmt, x.dtype, pads=False)  # (padded: tried above)
