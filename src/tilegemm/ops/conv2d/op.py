"""``tilegemm.conv2d``: checks, the ``torch.library`` ops (forward, data and weight gradients), autograd, and
the choice of kernel.

Three custom ops in the ``tilegemm`` namespace, each with a fake (meta) implementation, so torch.compile
traces the forward and the backward without graph breaks: ``tilegemm::conv2d`` (forward with bias and
activation fused), ``tilegemm::conv2d_dgrad`` (grad of x) and ``tilegemm::conv2d_wgrad`` (grad of the weight).
The backward never calls cuDNN: it runs tilegemm's kernels (on Hopper, for 16-bit channels-last tensors, the
TMA kernels: the stride-1 data gradient as a forward convolution, the weight gradient by ``tma_wgrad``;
otherwise the implicit-GEMM pointer kernels, the depthwise kernels, or GEMMs for 1x1 convolutions: ``split_k``
for the weight gradient, gluon_f16 or ``auto``'s choice for the data gradient, spread out by
``gemm_1x1.strided_dgrad`` for strided ones).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from tilegemm.core import registry
from tilegemm.ops.conv2d import replay
from tilegemm.core.runtime import interpreting, on_device
from tilegemm.ops.conv2d.problem import (
    ConvProblem, Geometry, channels_last, check_conv, geometry_of, memory_format_of,
)
from tilegemm.core.activations import ACTIVATIONS, check_activation  # noqa: F401
from tilegemm.core.activations import torch_activation
from tilegemm.core.dtypes import check_precision
from tilegemm.core.dtypes import resolve_precision
from tilegemm.core.launch import plain_call
from tilegemm.core.torch_ops import lean_autograd


# --- the choice of kernel -------------------------------------------------------------------------------


def choose_kernel(g: Geometry, x_channels_last: bool = True, tma: bool = False, sms: int = 132,
                  gluon: bool = True) -> str:
    """``auto``. ``tma``: ``tma_implicit_gemm`` can take the call (a 16-bit channels-last input TMA can describe,
    on Hopper; :func:`tilegemm.ops.conv2d.tma_fwd.unusable`). Then it runs every such convolution but the 1x1 ones
    that run faster as GEMMs (few pixels, narrow channel steps, few tiles over a long reduction, or, where
    ``gluon`` says the call's tensors let gluon_f16 run it, wide layers over many pixels:
    :func:`tilegemm.ops.conv2d.configs.pointwise_as_gemm`).
    Otherwise: 1x1 stride-1 unpadded single-group convolutions go to ``gemm_1x1`` (tilegemm's GEMM on the
    channels-last view), and so do strided ones with a channels-last input (the kept pixels gathered into a
    matrix first); depthwise ones to ``depthwise``, everything else to ``implicit_gemm``."""
    pointwise = g.is_pointwise or (g.is_strided_pointwise and x_channels_last)
    if tma and not g.is_depthwise:
        from tilegemm.ops.conv2d.configs import pointwise_as_gemm

        if not (pointwise and pointwise_as_gemm(g, sms, gluon)):
            return "tma_implicit_gemm"
    if pointwise:
        return "gemm_1x1"
    if g.is_depthwise:
        return "depthwise"
    return "implicit_gemm"


_TMA_REASON: list = []  # why the TMA kernels cannot run in this process (None: they can), once asked


def _tma_candidate(t: torch.Tensor) -> bool:
    """The cheap part of :func:`_tma_usable`: a 16-bit CUDA tensor, channels-last or of at most 8 channels (a stem,
    which the window route copies whatever its layout), not under the interpreter, in a process whose GPU and
    Triton run the Gluon kernels (the registered kernel's requirement, asked once)."""
    if not (t.is_cuda and t.dtype != torch.float32 and (t.stride(1) == 1 or t.shape[1] <= 8)) or interpreting():
        return False
    if not _TMA_REASON:
        _TMA_REASON.append(registry.get("conv2d", "tma_implicit_gemm").unavailable_reason())
    return _TMA_REASON[0] is None


def _tma_usable(x: torch.Tensor, weight, g: Geometry, dy: torch.Tensor | None = None) -> bool:
    """Whether ``tma_implicit_gemm`` takes the forward call, or (``dy`` given) the TMA weight-gradient kernel
    the weight gradient (each module imported only for a 16-bit channels-last CUDA input)."""
    if not _tma_candidate(x):
        return False
    if dy is not None:
        from tilegemm.ops.conv2d import tma_wgrad

        return tma_wgrad.unusable(dy, x, g) is None
    from tilegemm.ops.conv2d import tma_fwd

    return tma_fwd.reason_not(x, weight, g) is None


def launcher(name: str):
    """The launch function of a registered conv2d kernel (:func:`tilegemm.core.registry.launcher`)."""
    return registry.launcher("conv2d", name)


def _forward(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel,
             out_dtype=None) -> torch.Tensor:
    g = geometry_of(x.shape, weight.shape, stride, padding, dilation, groups)
    p = ConvProblem(x, weight, bias, g, out_dtype or x.dtype, memory_format_of(x), activation,
                    resolve_precision(precision, x.dtype), x.dtype == torch.bfloat16 and interpreting())
    if x.numel() == 0 or g.N * g.P * g.Q == 0:
        from tilegemm.ops.conv2d.implicit_gemm import empty_4d

        out = empty_4d(g.out_shape, p.out_dtype, x.device, p.out_format)
        return out.zero_() if out.numel() else out
    with on_device(x.device):
        if kernel == "auto":
            if _nchw_route(x):
                return _forward_nchw(p)
            kernel = _auto_kernel(p)
        return launcher(kernel)(p)


def _auto_kernel(p: ConvProblem) -> str:
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d.gemm_1x1 import gluon_usable

    tma = _tma_usable(p.x, p.weight, p.geo)
    return choose_kernel(p.geo, channels_last(p.x), tma, sm_count(p.x.device),
                         tma and gluon_usable(p.x, p.weight, p.bias, p.out_dtype))


def _nchw_route(x: torch.Tensor) -> bool:
    """Whether ``auto`` runs an NCHW input through a channels-last copy (:mod:`tilegemm.ops.conv2d.layout`): a
    plain contiguous 16-bit CUDA input of more than 8 channels (stems read any layout) in a process where the
    TMA kernels run, so that the copy lets them take the call. The gradients of such layers take the same route
    (:func:`_dgrad_nchw` but for 1x1 stride-1 layers, :func:`_wgrad_nchw`)."""
    from tilegemm.ops.conv2d.layout import planar

    if not planar(x) or x.shape[1] <= 8 or x.dtype == torch.float32 or not x.is_cuda or interpreting():
        return False
    if not _TMA_REASON:
        _TMA_REASON.append(registry.get("conv2d", "tma_implicit_gemm").unavailable_reason())
    return _TMA_REASON[0] is None


def _forward_nchw(p: ConvProblem) -> torch.Tensor:
    """The forward of an NCHW input (:func:`_nchw_route`). 1x1 stride-1 layers stay one batched GEMM over the NCHW
    tensors as they are (:mod:`~tilegemm.ops.conv2d.gemm_1x1`, no copy: through the TMA kernel with NCHW stores
    they ran 0.3x-2.8x of it, H200, ``benchmarks/results/2026-11-25-h200/e6b6c92/wip-explore-nchw.json``). The
    others: x transposed channels-last into a workspace, then the TMA kernel where it takes the copy (storing
    the NCHW output from its epilogue), the depthwise or the pointer kernel (into a second workspace,
    channels-last, then transposed into the output: :func:`tilegemm.ops.conv2d.layout.to_nchw`). Every launch is
    Triton's, so the call replays."""
    from dataclasses import replace

    from tilegemm.core.launch import keeping, sequence_lock
    from tilegemm.ops.conv2d import layout
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    g = p.geo
    if g.is_pointwise:
        return launcher("gemm_1x1")(p)
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        xc, xbuf = layout.workspace_view(p.x, "conv2d-nchw-input")
        if g.is_depthwise:
            kernel = "depthwise"
        elif _tma_usable(xc, p.weight, g):
            kernel = "tma_implicit_gemm"
        else:
            kernel = "implicit_gemm"
        layout.fill(p.x, xc, xbuf)
        with keeping(xbuf):
            pc = replace(p, x=xc)
            if kernel == "tma_implicit_gemm":
                return launcher(kernel)(pc)  # NCHW stores from its epilogue
            out = empty_4d(g.out_shape, p.out_dtype, p.x.device, torch.contiguous_format)
            oc, obuf = layout.channels_last_workspace(g.out_shape, p.out_dtype, p.x.device, "conv2d-nchw-output")
            with keeping(obuf):
                launcher(kernel)(replace(pc, out_format=torch.channels_last, out=oc))
                return layout.to_nchw(oc, out, keep=(obuf,))


@torch.library.custom_op("tilegemm::conv2d", mutates_args=())
def _conv2d_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
    activation: str,
    precision: str,
    kernel: str,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    # Replayed like a plain public call: a graph compiled by torch.compile calls this op for every convolution,
    # and its full path (geometry, config, Triton's launch wrapper) cost about 300 us of host a call, which made a
    # compiled ResNet-50 at batch 32 run 20.4 ms where the eager one ran 4.4 (H200,
    # benchmarks/results/2026-11-24-h200/ef944b8/).
    key = replay.replay_key("fwd", x, weight, bias, (stride, padding, dilation, groups), activation, precision,
                            kernel, "op", None if out_dtype is None else str(out_dtype))
    return replay.replay_or_record(key, (x, weight) if bias is None else (x, weight, bias), memory_format_of(x),
                                   lambda: _forward(x, weight, bias, stride, padding, dilation, groups, activation,
                                                    precision, kernel, out_dtype))


@_conv2d_op.register_fake
def _conv2d_fake(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel, out_dtype=None):
    g = geometry_of(x.shape, weight.shape, stride, padding, dilation, groups)
    return torch.empty(g.out_shape, dtype=out_dtype or x.dtype, device=x.device, memory_format=memory_format_of(x))


# --- backward ops ---------------------------------------------------------------------------------------


def _upcast(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and interpreting()


def _as_nhwc_2d(t: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` as the row-major ``[N*H*W, C]`` matrix of its channels-last layout (a view when it is)."""
    N, C, H, W = t.shape
    return t.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(N * H * W, C)


def _dgrad(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision) -> torch.Tensor:
    """The data gradient (what ``tilegemm::conv2d_dgrad`` runs)."""
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    g = geometry_of(x_shape, weight.shape, stride, padding, dilation, groups)
    fmt = torch.channels_last if x_channels_last else torch.contiguous_format
    if dy.numel() == 0:
        return empty_4d(x_shape, dy.dtype, dy.device, fmt).zero_()
    precision = resolve_precision(precision, dy.dtype)
    with on_device(dy.device):
        if g.is_pointwise:
            from tilegemm.ops.matmul.api import matmul

            w2d = weight.reshape(g.K, g.C)  # [K, C]
            if x_channels_last:
                from tilegemm.ops.conv2d.gemm_1x1 import dgrad_product

                dx = dgrad_product(_as_nhwc_2d(dy), w2d, (g.N, g.H, g.W), precision)  # [NHW, C]
                return dx.view(g.N, g.H, g.W, g.C).permute(0, 3, 1, 2)
            dx = matmul(w2d.t(), dy.reshape(g.N, g.K, g.H * g.W), precision=precision)  # [N, C, HW]
            return dx.view(g.N, g.C, g.H, g.W)
        if not x_channels_last and _nchw_route(dy):
            return _dgrad_nchw(dy, weight, x_shape, g, precision)
        if g.is_strided_pointwise and x_channels_last and dy.is_contiguous(memory_format=torch.channels_last):
            from tilegemm.ops.conv2d.gemm_1x1 import strided_dgrad

            return strided_dgrad(dy, weight, g, precision)
        if g.is_depthwise:
            from tilegemm.ops.conv2d import depthwise

            return depthwise.dgrad(dy, weight, x_shape, fmt, g)
        if x_channels_last and _tma_candidate(dy):
            from tilegemm.ops.conv2d import tma_fwd

            dx = tma_fwd.dgrad_tma(dy, weight, g)
            if dx is not None:
                return dx
        from tilegemm.ops.conv2d import implicit_gemm

        return implicit_gemm.dgrad(dy, weight, x_shape, fmt, g, precision, _upcast(dy))


def _dgrad_nchw(dy, weight, x_shape, g, precision) -> torch.Tensor:
    """The data gradient of an NCHW layer (:func:`_nchw_route` of ``dy``) but a 1x1 stride-1 one, as the forward's
    route: ``dy`` transposed channels-last into a workspace, then the TMA kernel (stride 1; NCHW stores), the
    depthwise or the pointer kernel, each writing the NCHW ``dx``; every launch Triton's, so the call replays."""
    from tilegemm.core.launch import keeping, sequence_lock
    from tilegemm.ops.conv2d import implicit_gemm, layout

    nchw = torch.contiguous_format
    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        dyc, buf = layout.to_channels_last(dy, "conv2d-nchw-dy")
        with keeping(buf):
            if g.is_depthwise:
                from tilegemm.ops.conv2d import depthwise

                return depthwise.dgrad(dyc, weight, x_shape, nchw, g)
            if _tma_candidate(dyc):
                from tilegemm.ops.conv2d import tma_fwd

                dx = tma_fwd.dgrad_tma(dyc, weight, g, out_format=nchw)
                if dx is not None:
                    return dx
            w, keep = implicit_gemm.pointer_weight(weight)
            with keeping(*keep):
                return implicit_gemm.dgrad(dyc, w, x_shape, nchw, g, precision, _upcast(dyc))


@torch.library.custom_op("tilegemm::conv2d_dgrad", mutates_args=())
def _dgrad_op(
    dy: torch.Tensor,
    weight: torch.Tensor,
    x_shape: List[int],
    x_channels_last: bool,
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
    precision: str,
) -> torch.Tensor:
    return _dgrad(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision)


@_dgrad_op.register_fake
def _dgrad_fake(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision):
    fmt = torch.channels_last if x_channels_last else torch.contiguous_format
    return torch.empty(x_shape, dtype=dy.dtype, device=dy.device, memory_format=fmt)


def wgrad_format(x: torch.Tensor, w_shape) -> torch.memory_format:
    """The weight gradient's memory format: channels-last where ``x`` is channels-last and the filter has more than
    one tap and channel (where the two differ), as torch's cuDNN path returns it for a channels-last ``x``; else
    contiguous (cuDNN also returns channels-last for an NCHW ``x`` with a channels-last weight; here the layout
    follows ``x`` alone). The kernels store a tile of one tap as whole rows then, not one element every R*S."""
    _, cg, r, s = w_shape
    return torch.channels_last if r * s > 1 and cg > 1 and channels_last(x) else torch.contiguous_format


def _wgrad(dy, x, w_shape, stride, padding, dilation, groups, precision) -> torch.Tensor:
    """The weight gradient (what ``tilegemm::conv2d_wgrad`` runs), in :func:`wgrad_format`."""
    g = geometry_of(x.shape, w_shape, stride, padding, dilation, groups)
    fmt = wgrad_format(x, w_shape)
    if dy.numel() == 0:
        from tilegemm.ops.conv2d.implicit_gemm import empty_4d

        return empty_4d(w_shape, x.dtype, x.device, fmt).zero_()
    precision = resolve_precision(precision, x.dtype)
    with on_device(x.device):
        from tilegemm.ops.conv2d.layout import planar

        if _nchw_route(x) and planar(dy):
            return _wgrad_nchw(dy, x, g, precision, fmt)
        if g.is_pointwise:
            from tilegemm.ops.conv2d.gemm_1x1 import pointwise_wgrad

            # [K, NHW] @ [NHW, C]: a few output tiles over a reduction as long as the pixels, split_k's class
            return pointwise_wgrad(_as_nhwc_2d(dy).t(), _as_nhwc_2d(x), precision).view(w_shape)
        if g.is_depthwise:
            from tilegemm.ops.conv2d import depthwise

            return depthwise.wgrad(dy, x, g, x.dtype)
        if _tma_usable(x, None, g, dy):
            from tilegemm.ops.conv2d import tma_wgrad

            return tma_wgrad.run(dy, x, g, x.dtype, memory_format=fmt)
        from tilegemm.ops.conv2d import implicit_gemm

        return implicit_gemm.wgrad(dy, x, g, precision, _upcast(x), x.dtype, memory_format=fmt)


def _wgrad_nchw(dy, x, g, precision, fmt) -> torch.Tensor:
    """The weight gradient of an NCHW layer (:func:`_nchw_route` of ``x``): ``x`` and ``dy`` transposed
    channels-last into workspaces, then the kernel a channels-last call takes (a 1x1 stride-1 layer's GEMM too),
    the gradient in ``fmt`` (:func:`wgrad_format` of the NCHW ``x``); every launch Triton's, so the call replays."""
    from tilegemm.core.launch import keeping, sequence_lock
    from tilegemm.ops.conv2d import implicit_gemm, layout

    with sequence_lock:  # the workspaces are shared by the calls on this stream: no other thread in between
        xc, xbuf = layout.to_channels_last(x, "conv2d-nchw-x")
        dyc, dybuf = layout.to_channels_last(dy, "conv2d-nchw-dy")
        with keeping(xbuf, dybuf):
            if g.is_pointwise:
                from tilegemm.ops.conv2d.gemm_1x1 import pointwise_wgrad

                return pointwise_wgrad(_as_nhwc_2d(dyc).t(), _as_nhwc_2d(xc), precision).view(g.K, g.C, 1, 1)
            if g.is_depthwise:
                from tilegemm.ops.conv2d import depthwise

                return depthwise.wgrad(dyc, xc, g, x.dtype)
            if _tma_usable(xc, None, g, dyc):
                from tilegemm.ops.conv2d import tma_wgrad

                return tma_wgrad.run(dyc, xc, g, x.dtype, memory_format=fmt)
            return implicit_gemm.wgrad(dyc, xc, g, precision, _upcast(x), x.dtype, memory_format=fmt)


def backward_data(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision):
    """:func:`_dgrad` for a plain call, replayed when an earlier call with the same key was recorded."""
    key = replay.replay_key("dgrad", dy, weight, None, (stride, padding, dilation, groups), tuple(x_shape),
                            x_channels_last, precision)
    fmt = torch.channels_last if x_channels_last else torch.contiguous_format
    return replay.replay_or_record(key, (dy, weight), fmt, lambda: _dgrad(
        dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision))


def backward_weight(dy, x, w_shape, stride, padding, dilation, groups, precision) -> torch.Tensor:
    """:func:`_wgrad` for a plain call, replayed when an earlier call with the same key was recorded (each path
    launches only kernels: the 1x1 path's GEMM, the implicit-GEMM and depthwise kernels that add their slices
    in one launch)."""
    key = replay.replay_key("wgrad", dy, x, None, (stride, padding, dilation, groups), tuple(w_shape), precision)
    return replay.replay_or_record(key, (dy, x), wgrad_format(x, w_shape), lambda: _wgrad(
        dy, x, w_shape, stride, padding, dilation, groups, precision))


@torch.library.custom_op("tilegemm::conv2d_wgrad", mutates_args=())
def _wgrad_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_shape: List[int],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
    precision: str,
) -> torch.Tensor:
    return _wgrad(dy, x, w_shape, stride, padding, dilation, groups, precision)


@_wgrad_op.register_fake
def _wgrad_fake(dy, x, w_shape, stride, padding, dilation, groups, precision):
    return torch.empty(w_shape, dtype=x.dtype, device=x.device, memory_format=wgrad_format(x, w_shape))


# --- autograd: recompute the pre-activation, differentiate the activation with torch ----------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel = inputs[:10]
    ctx.save_for_backward(x, weight, bias)
    ctx.conv = (list(stride), list(padding), list(dilation), groups)
    ctx.activation, ctx.precision = activation, precision
    ctx.x_channels_last = channels_last(x)


def _backward(ctx, grad_out):
    x, weight, bias = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    grad = grad_out
    if ctx.activation != "none":
        pre = _conv2d_op(x, weight, bias, stride, padding, dilation, groups, "none", ctx.precision, "auto",
                         torch.float32)
        with torch.enable_grad():
            pre = pre.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(torch_activation(pre, ctx.activation), pre, grad_out.float())
    want_x, want_w, want_bias = ctx.needs_input_grad[:3]
    g = grad.to(x.dtype)  # the two convolutions of the backward pass run in the operands' dtype, like torch's
    grad_x = grad_w = grad_bias = None
    # Outside tracing the gradients' ops are called as functions: dispatch through a registered op costs
    # tens of microseconds of host time a call (see tilegemm.core.launch.plain_call).
    plain = plain_call(g, weight, x)
    if want_x:
        args = (g, weight, list(x.shape), ctx.x_channels_last, stride, padding, dilation, groups, ctx.precision)
        grad_x = backward_data(*args) if plain else _dgrad_op(*args)
    if want_w:
        args = (g, x, list(weight.shape), stride, padding, dilation, groups, ctx.precision)
        grad_w = backward_weight(*args) if plain else _wgrad_op(*args)
    if want_bias and bias is not None:
        grad_bias = grad.sum(dim=(0, 2, 3), dtype=torch.float32).to(bias.dtype)
    return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None, None


_conv2d_op.register_autograd(_backward, setup_context=_setup_context)
for _op in (_conv2d_op, _dgrad_op, _wgrad_op):
    lean_autograd(_op)  # a compiled graph's calls skip the custom op's Python layers (core/torch_ops.py)


# --- the public function --------------------------------------------------------------------------------


def check_kernel(kernel) -> None:
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
    if kernel != "auto":
        reason = registry.get("conv2d", kernel).unavailable_reason()  # ValueError naming the choices if unknown
        if reason:
            raise registry.NotApplicable(f"conv2d kernel {kernel!r} cannot run here: {reason}")


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    activation: str | None = None,
    *,
    precision: str | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """``activation(F.conv2d(x, weight, bias, stride, padding, dilation, groups))`` in one kernel.

    Args:
        x: ``[N, C, H, W]``, float16, bfloat16 or float32; NCHW or channels-last (the fast path). The output
            ``[N, K, P, Q]`` has the memory format of ``x``. An unbatched ``[C, H, W]`` gives ``[K, P, Q]``, as
            ``F.conv2d``.
        weight: ``[K, C/groups, R, S]``, the dtype of ``x``.
        bias: ``[K]``, added in the epilogue.
        stride, dilation: an int or a pair (>= 1).
        padding: an int, a pair, ``"same"`` (stride 1 only; an odd total pads bottom/right more, as torch) or
            ``"valid"``. Zero padding.
        groups: any divisor of C and K; ``groups = C`` is a depthwise convolution.
        activation: ``None``/``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"leaky_relu"``
            (slope 0.01), applied after the bias.
        precision: for float32 inputs, ``"ieee"``/``"highest"`` or ``"tf32"``/``"high"``/``"medium"``; by default
            ``torch.get_float32_matmul_precision()`` (read when the op runs).
        kernel: ``"auto"`` or a name from ``tilegemm.kernels("conv2d")``.

    Differentiable in x, weight and bias (the backward runs tilegemm's kernels too).

    Raises:
        TypeError, ValueError: naming the bad argument (ranks, dtypes, devices, channel counts, sizes).
    """
    if getattr(x, "ndim", 4) == 3:  # unbatched [C, H, W], as F.conv2d takes it: a batch of one
        return conv2d(x.unsqueeze(0), weight, bias, stride, padding, dilation, groups, activation,
                      precision=precision, kernel=kernel).squeeze(0)
    activation = "none" if activation is None else activation
    key = replay.replay_key("fwd", x, weight, bias, (stride, padding, dilation, groups), activation, precision,
                            kernel)
    if key is not None:
        out = replay.replayed(key, (x, weight) if bias is None else (x, weight, bias))
        if out is not None:
            return out
    check_activation(activation)
    if precision is not None:
        check_precision(precision)
    check_kernel(kernel)
    g = check_conv(x, weight, bias, stride, padding, dilation, groups)
    args = (x, weight, bias, list(g.stride), list(g.padding), list(g.dilation), g.groups, activation,
            precision or "default", kernel)
    if key is not None:
        return replay.record(key, lambda: _forward(*args), (x, weight) if bias is None else (x, weight, bias),
                             memory_format_of(x))
    if plain_call(x, weight, bias):
        return _forward(*args)
    return _conv2d_op(*args)
