"""The ``torch.library`` ops of ``tilegemm.conv2d``, their fakes and autograd.

Three custom ops in the ``tilegemm`` namespace, each with a fake (meta) implementation, so torch.compile traces
the forward and the backward without graph breaks: ``tilegemm::conv2d`` (forward with bias and activation fused),
``tilegemm::conv2d_dgrad`` (grad of x) and ``tilegemm::conv2d_wgrad`` (grad of the weight). The backward never
calls cuDNN: it runs tilegemm's kernels (:mod:`tilegemm.ops.conv2d.dispatch` chooses them). :data:`REPLAYS`
keeps plain calls' launches (:mod:`tilegemm.core.replay`; keys: :func:`tilegemm.ops.conv2d.checks.replay_key`);
:func:`backward_data` and :func:`backward_weight` are the gradients' plain calls, which autograd makes outside
tracing."""

from __future__ import annotations

from typing import List, Optional

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.core.checked import check_once
from tilegemm.core.launch import legacy_batched, plain_call
from tilegemm.core.replay import ReplayCache
from tilegemm.core.runtime import any_negative, resolved
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.conv2d import dispatch
from tilegemm.ops.conv2d.checks import check_grad_call, check_op_call, replay_key
from tilegemm.ops.conv2d.configs import takes_grouped_direct
from tilegemm.ops.conv2d.problem import (
    ConvCall, DgradCall, WgradCall, geometry_of, output_format, strides_like_channels_last, wgrad_format,
)

REPLAYS = ReplayCache("conv2d")


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
    # and its full path (geometry, config, Triton's launch wrapper) costs hundreds of microseconds of host a
    # call, more than a compiled network's GPU time per layer (docs/conv2d.md, "Host fast path").
    key = replay_key("fwd", x, weight, bias, (stride, padding, dilation, groups), activation, precision,
                     kernel, "op", None if out_dtype is None else str(out_dtype))

    def run():
        return dispatch.forward(ConvCall(x, weight, bias, stride, padding, dilation, groups, activation, precision,
                                         kernel, out_dtype))

    # Called directly (torch.ops.tilegemm.conv2d) nothing checked the arguments: the public function's checks,
    # once per layout (a replayed call passed them).
    args = (x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel, out_dtype)
    if key is None:
        check_once(check_op_call, *args)
        if any_negative(x, weight, bias):  # (a compiled graph's input may be one: see the public function)
            x, weight, bias = resolved(x, weight, bias)
        return run()
    tensors = (x, weight) if bias is None else (x, weight, bias)
    out = REPLAYS.replayed(key, tensors)
    if out is not None:
        return out
    check_once(check_op_call, *args)
    with REPLAYS.recording(key, tensors, output_format(x, weight)) as kept:
        return kept(run())


@_conv2d_op.register_fake
def _conv2d_fake(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel, out_dtype=None):
    # the body's checks (no values read): a meta or traced call that is no convolution fails where it is made (not
    # on dynamic sizes, where comparing them would guard on them: the public function checked those)
    if all(type(v) is int for v in (*x.shape, *weight.shape)):
        check_op_call(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel, out_dtype)
    g = geometry_of(x.shape, weight.shape, stride, padding, dilation, groups)
    return torch.empty(g.out_shape, dtype=out_dtype or x.dtype, device=x.device,
                       memory_format=output_format(x, weight))


def call(c: ConvCall) -> torch.Tensor:
    """The forward op on call ``c``."""
    return _conv2d_op(*c.op_args())


# --- backward ops ---------------------------------------------------------------------------------------


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
    # called directly (torch.ops.tilegemm.conv2d_dgrad) nothing related x_shape to dy and the weight
    check_once(check_grad_call, "dgrad", dy, weight, tuple(x_shape), stride, padding, dilation, groups)
    return dispatch.dgrad(DgradCall(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups,
                                    precision))


@_dgrad_op.register_fake
def _dgrad_fake(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision):
    check_grad_call("dgrad", dy, weight, x_shape, stride, padding, dilation, groups)
    fmt = torch.channels_last if x_channels_last else torch.contiguous_format
    return torch.empty(x_shape, dtype=dy.dtype, device=dy.device, memory_format=fmt)


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
    w_channels_last: bool = False,
) -> torch.Tensor:
    check_once(check_grad_call, "wgrad", dy, x, tuple(w_shape), stride, padding, dilation, groups)
    return dispatch.wgrad(WgradCall(dy, x, w_shape, stride, padding, dilation, groups, precision, w_channels_last))


@_wgrad_op.register_fake
def _wgrad_fake(dy, x, w_shape, stride, padding, dilation, groups, precision, w_channels_last=False):
    check_grad_call("wgrad", dy, x, w_shape, stride, padding, dilation, groups)
    return torch.empty(w_shape, dtype=x.dtype, device=x.device,
                       memory_format=wgrad_format(x, w_shape, w_channels_last))


# --- the gradients' plain calls, replayed ----------------------------------------------------------------


def backward_data(c: DgradCall) -> torch.Tensor:
    """:func:`tilegemm.ops.conv2d.dispatch.dgrad` for a plain call, replayed when an earlier call with the same key
    was recorded."""
    key = replay_key("dgrad", c.dy, c.weight, None, (c.stride, c.padding, c.dilation, c.groups),
                     tuple(c.x_shape), c.x_channels_last, c.precision)
    if key is None:
        return dispatch.dgrad(c)
    out = REPLAYS.replayed(key, (c.dy, c.weight))
    if out is not None:
        return out
    with REPLAYS.recording(key, (c.dy, c.weight), c.x_format) as kept:
        return kept(dispatch.dgrad(c))


def backward_weight(c: WgradCall) -> torch.Tensor:
    """:func:`tilegemm.ops.conv2d.dispatch.wgrad` for a plain call, replayed when an earlier call with the same key
    was recorded (each path launches only kernels: the 1x1 path's GEMM, the implicit-GEMM and depthwise kernels
    that add their slices in one launch)."""
    key = replay_key("wgrad", c.dy, c.x, None, (c.stride, c.padding, c.dilation, c.groups), tuple(c.w_shape),
                     c.precision, c.w_channels_last)
    if key is None:
        return dispatch.wgrad(c)
    out = REPLAYS.replayed(key, (c.dy, c.x))
    if out is not None:
        return out
    with REPLAYS.recording(key, (c.dy, c.x), c.w_format) as kept:
        return kept(dispatch.wgrad(c))


# --- autograd: recompute the pre-activation, differentiate the activation with torch ----------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel = inputs[:10]
    # the bias only to recompute an activation's input (its gradient needs its dtype alone): written in place after
    # the call, it is then no autograd error, as it is none for torch's convolution
    ctx.save_for_backward(x, weight, bias if activation != "none" else None)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.conv = (list(stride), list(padding), list(dilation), groups)
    ctx.activation, ctx.precision = activation, precision
    # The gradients take the output's memory format (channels-last where x or the weight is), as torch's
    # convolution backward returns them: a channels-last weight fed an NCHW x gets a channels-last grad of x too.
    ctx.layer_channels_last = output_format(x, weight) is torch.channels_last
    ctx.w_channels_last = strides_like_channels_last(weight)


def _copies_dy(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, conv) -> bool:
    """Whether the gradients' routes of a channels-last layer would copy ``dy`` channels-last each (every route
    but grouped_direct's, which reads any strides): ``dy`` of a layout torch's autograd gave, not channels-last
    (a mean's backward gives NCHW)."""
    if dy.dim() != 4 or dy.is_contiguous(memory_format=torch.channels_last):
        return False
    return not takes_grouped_direct(geometry_of(x.shape, weight.shape, *conv))


def _backward(ctx, grad_out):
    x, weight, bias = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    # Grad mode is on here only under create_graph=True (double backward): then every step below is recorded,
    # the ops through their own autograd (below) and the activation's derivative through torch's.
    create_graph = torch.is_grad_enabled()
    grad = grad_out
    if ctx.activation != "none":
        pre = _conv2d_op(x, weight, bias, stride, padding, dilation, groups, "none", ctx.precision, "auto",
                         torch.float32)
        with torch.enable_grad():
            if not (create_graph and pre.requires_grad):
                pre = pre.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(torch_activation(pre, ctx.activation), pre, grad_out.float(),
                                          create_graph=create_graph)
    want_x, want_w, want_bias = ctx.needs_input_grad[:3]
    g = grad.to(x.dtype)  # the two convolutions of the backward pass run in the operands' dtype, like torch's
    batched = legacy_batched(g)  # (batched gradients: their layout is not readable, the registered ops take them)
    if ctx.layer_channels_last and (want_x or want_w) and not batched and _copies_dy(g, x, weight, ctx.conv):
        g = g.contiguous(memory_format=torch.channels_last)  # once here, not once in each gradient's route
    grad_x = grad_w = grad_bias = None
    # Outside tracing the gradients' ops are called as functions: dispatch through a registered op costs
    # tens of microseconds of host time a call (see tilegemm.core.launch.plain_call).
    plain = not batched and plain_call(g, weight, x)
    if want_x:
        c = DgradCall(g, weight, list(x.shape), ctx.layer_channels_last, stride, padding, dilation, groups,
                      ctx.precision)
        grad_x = backward_data(c) if plain else _dgrad_op(*c.op_args())
    if want_w:
        c = WgradCall(g, x, list(weight.shape), stride, padding, dilation, groups, ctx.precision,
                      ctx.w_channels_last)
        grad_w = backward_weight(c) if plain else _wgrad_op(*c.op_args())
    if want_bias and ctx.bias_dtype is not None:
        grad_bias = grad.sum(dim=(0, 2, 3), dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None, None


_conv2d_op.register_autograd(_backward, setup_context=_setup_context)


# --- autograd of the gradients (double backward: gradient penalties, Hessian-vector products) --------------
# Both are bilinear. dgrad(dy, w) is the transposed convolution: its adjoint in dy is the forward convolution
# of the incoming gradient with w, in w the weight gradient of dy against it. wgrad(dy, x) pairs dy with x:
# its adjoint in dy is the forward convolution of x with the incoming gradient, in x the data gradient.


def _dgrad_setup_context(ctx, inputs, output):
    dy, weight, _, _, stride, padding, dilation, groups, precision = inputs
    ctx.save_for_backward(dy, weight)
    ctx.conv = (list(stride), list(padding), list(dilation), groups)
    ctx.precision = precision


def _dgrad_backward(ctx, grad_dx):
    dy, weight = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    g = grad_dx.to(dy.dtype)
    grad_dy = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_dy = _conv2d_op(g, weight.to(dy.dtype), None, stride, padding, dilation, groups, "none",
                             ctx.precision, "auto")
    if ctx.needs_input_grad[1]:
        grad_w = _wgrad_op(dy, g, list(weight.shape), stride, padding, dilation, groups, ctx.precision,
                           strides_like_channels_last(weight)).to(weight.dtype)
    return grad_dy, grad_w, None, None, None, None, None, None, None


def _wgrad_setup_context(ctx, inputs, output):
    dy, x, _, stride, padding, dilation, groups, precision = inputs[:8]
    ctx.save_for_backward(dy, x)
    ctx.conv = (list(stride), list(padding), list(dilation), groups)
    ctx.precision = precision
    # (grad of x in the layer's format, as the first-order backward returns it: channels-last where x or w is)
    ctx.x_channels_last = strides_like_channels_last(x) or bool(inputs[8] if len(inputs) > 8 else False)


def _wgrad_backward(ctx, grad_dw):
    dy, x = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    g = grad_dw.to(x.dtype)
    grad_dy = grad_x = None
    if ctx.needs_input_grad[0]:
        grad_dy = _conv2d_op(x, g, None, stride, padding, dilation, groups, "none", ctx.precision,
                             "auto").to(dy.dtype)
    if ctx.needs_input_grad[1]:
        grad_x = _dgrad_op(dy.to(x.dtype), g, list(x.shape), ctx.x_channels_last, stride, padding, dilation,
                           groups, ctx.precision)
    return grad_dy, grad_x, None, None, None, None, None, None, None


_dgrad_op.register_autograd(_dgrad_backward, setup_context=_dgrad_setup_context)
_wgrad_op.register_autograd(_wgrad_backward, setup_context=_wgrad_setup_context)
for _op in (_conv2d_op, _dgrad_op, _wgrad_op):
    lean_autograd(_op)  # a compiled graph's calls skip the custom op's Python layers (core/torch_ops.py)
