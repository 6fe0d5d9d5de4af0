"""``torch.ops.tilegemm.matmul``: the ``torch.library`` op, its fake (meta) implementation and its autograd.

The op's schema is flat (tensors, floats, strings); inside, the arguments travel as one
:class:`~tilegemm.ops.matmul.problem.MatmulCall`. The backward pass recomputes the pre-activation and
differentiates the activation with torch; its two GEMMs run through the op again.
"""

from __future__ import annotations

from typing import Optional

import torch

from tilegemm.core.dtypes import narrowed_gradient, unscaled
from tilegemm.core.launch import recording_active
from tilegemm.core.replay import ReplayCache
from tilegemm.core.runtime import any_negative, resolved
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.matmul.problem import FP8_DTYPES, MatmulCall, default_out_dtype
from tilegemm.ops.matmul.checks import check_inputs, refuse_fp8_gradients, replay_key
from tilegemm.ops.matmul.dispatch import forward
from tilegemm.ops.matmul.reference import torch_activation


# Replays of plain calls without c (the public function's and this op's): the key says how tensors alias.
REPLAYS = ReplayCache("matmul", aliases_in_key=True)


@torch.library.custom_op("tilegemm::matmul", mutates_args=())
def matmul_op(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: Optional[torch.Tensor],
    c: Optional[torch.Tensor],
    alpha: float,
    beta: float,
    activation: str,
    out_dtype: Optional[torch.dtype],
    precision: str,
    kernel: str,
    scale_a: Optional[torch.Tensor] = None,
    scale_b: Optional[torch.Tensor] = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    call = MatmulCall(a, b, bias, c, alpha, beta, activation, out_dtype, precision, kernel, scale_a, scale_b,
                      fast_accum)
    # A graph compiled by torch.compile calls this op for every product: replayed like a plain public call (the
    # arguments were checked when the call was traced), so a compiled model's small GEMMs cost the host what
    # eager ones do.
    key = None
    if c is None and not recording_active() and alpha != 0:
        key = replay_key(a, b, alpha, precision, kernel, out_dtype, scale_a, scale_b, fast_accum, bias, activation)
    if key is not None:
        tensors = (a, b, *(t for t in (scale_a, scale_b, bias) if t is not None))  # as the public function's
        out = REPLAYS.replayed(key, tensors)
        if out is not None:
            return out
    # Called directly (torch.ops.tilegemm.matmul) nothing checked the arguments: a bias shorter than N would be
    # read out of bounds. A replay above repeats a call that passed here.
    check_inputs(call)
    if alpha == 0:  # as the public function
        call = call.without_product()
        a, b = call.a, call.b
    if any_negative(a, b, bias, c, scale_a, scale_b):  # (a compiled graph's input may be one: see the public function)
        a, b, bias, c, scale_a, scale_b = resolved(a, b, bias, c, scale_a, scale_b)
        call = call.replace(a=a, b=b, bias=bias, c=c, scale_a=scale_a, scale_b=scale_b)
    if c is not None and beta == 0:
        call = call.replace(c=None)  # as the public function: addmm reads no c at beta 0 (NaN in it stays out)
    if key is None:
        return forward(call)
    with REPLAYS.recording(key, tensors) as kept:
        return kept(forward(call))


@matmul_op.register_fake
def _matmul_fake(*args):
    call = MatmulCall(*args)
    # The real op's checks (no values read): a traced or meta call fails where the eager one would, not later
    shape = check_inputs(call)
    return call.a.new_empty(shape, dtype=call.output_dtype)


def call_op(call: MatmulCall) -> torch.Tensor:
    """Run ``call`` through the registered op (what tracers, dispatch modes and autograd see)."""
    return matmul_op(*call.op_args())


# --- autograd: recompute the pre-activation, differentiate the activation with torch ----------------------


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """Undo broadcasting: sum ``t`` down to ``shape``."""
    shape = tuple(shape)
    lead = t.dim() - len(shape)
    if lead:
        t = t.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


def _setup_context(ctx, inputs, output):
    call = MatmulCall(*inputs)
    if call.a.dtype in FP8_DTYPES:
        # The op's own checks run below autograd, with grad mode off: a direct call on an fp8 operand or a scale
        # that wants a gradient is refused here (its backward ignored the scales; a scale got None)
        wants = ctx.needs_input_grad + (False,) * (len(MatmulCall._fields) - len(ctx.needs_input_grad))  # (defaults)
        refuse_fp8_gradients(True, wants[0], wants[1], wants[10], wants[11])
    # Kept for the backward only what it reads, as torch's addmm keeps them (an operand where the other wants a
    # gradient; bias, c and scales only to recompute an activation's input): a frozen layer keeps no input, and
    # an addend or a bias written in place after the call is no autograd error where torch's is none
    recompute = call.activation != "none"
    want_a, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    kept = (call.a if recompute or want_b else None, call.b if recompute or want_a else None)
    kept += (call.bias, call.c, call.scale_a, call.scale_b) if recompute else (None,) * 4
    ctx.save_for_backward(*kept)
    ctx.parts = tuple(None if t is None else (t.dtype, tuple(t.shape), _column_major(t))
                      for t in (call.a, call.b, call.bias, call.c))
    ctx.call = call.replace(a=None, b=None, bias=None, c=None, scale_a=None, scale_b=None)


def _column_major(t: torch.Tensor) -> bool:
    """Whether ``t``'s last two dims are a transposed row-major matrix (``weight.t()`` of an ``nn.Linear``)."""
    return t.ndim >= 2 and t.shape[-2] > 1 and t.shape[-1] > 1 and t.mT.is_contiguous() and not t.is_contiguous()


def _backward(ctx, grad_out):
    a, b, bias, c, scale_a, scale_b = ctx.saved_tensors  # (a or b None where not kept: see _setup_context)
    (a_dtype, a_shape, a_column_major), (b_dtype, b_shape, b_column_major), bias_of, c_of = ctx.parts
    call: MatmulCall = ctx.call
    # Without an activation the gradient is used as it comes: a round trip through fp32 changes no value.
    grad = grad_out
    # Grad mode is on here only under create_graph=True (double backward): the activation's derivative is then
    # recorded through the recomputed pre-activation, else the second derivative would lose its terms
    create_graph = torch.is_grad_enabled()
    if call.activation != "none":  # (fp8: the pre-activation with the call's scales and accumulation)
        # the bias in fp32, the recompute's output dtype: the call's own may be neither the operands' nor fp32
        pre_bias = None if bias is None else bias.float()
        # c too where it is of the call's output dtype but not the operands' (cast only then: c may be [M, N])
        pre_c = c if c is None or c.dtype in (default_out_dtype(a_dtype), torch.float32) else c.float()
        pre = call_op(MatmulCall(a, b, pre_bias, pre_c, call.alpha, call.beta, "none", torch.float32, call.precision,
                                 "auto", scale_a, scale_b, call.fast_accum))
        with torch.enable_grad():
            if not (create_graph and pre.requires_grad):
                pre = pre.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(torch_activation(pre, call.activation), pre, grad_out.float(),
                                          create_graph=create_graph)
    grad_a = grad_b = grad_bias = grad_c = None
    want_a, want_b, want_bias, want_c = ctx.needs_input_grad[:4]
    # The two GEMMs of the backward pass run in the operands' dtype, like torch's own (an fp32 gradient of fp16
    # operands scaled into fp16's range first, the products then in fp32: narrowed_gradient; not the fp32
    # gradient an activation's recompute makes of a 16-bit one, which a cast keeps in range as torch's would).
    g, scale = narrowed_gradient(grad, a_dtype) if grad_out.dtype == torch.float32 else (grad.to(a_dtype), None)
    wide = None if scale is None else torch.float32
    # A column-major operand gets its gradient column-major, the transposed product's transpose: autograd
    # would otherwise copy a leaf's gradient into the leaf's layout.
    if want_a:
        if a_column_major:
            grad_a = call_op(MatmulCall(b, g.mT, alpha=call.alpha, out_dtype=wide, precision=call.precision)).mT
        else:
            grad_a = call_op(MatmulCall(g, b.mT, alpha=call.alpha, out_dtype=wide, precision=call.precision))
        grad_a = _sum_to(unscaled(grad_a, scale, a_dtype), a_shape)
    if want_b:
        if b_column_major:
            grad_b = call_op(MatmulCall(g.mT, a, alpha=call.alpha, out_dtype=wide, precision=call.precision)).mT
        else:
            grad_b = call_op(MatmulCall(a.mT, g, alpha=call.alpha, out_dtype=wide, precision=call.precision))
        grad_b = _sum_to(unscaled(grad_b, scale, b_dtype), b_shape)
    if want_bias and bias_of is not None:
        # accumulated in fp32 (not reshape(-1, N): N may be 0)
        grad_bias = grad.sum(tuple(range(grad.ndim - 1)), dtype=torch.float32).to(bias_of[0])
    if want_c and c_of is not None:
        grad_c = _sum_to(grad.float() * call.beta, c_of[1]).to(c_of[0])  # scaled and summed in fp32
    return (grad_a, grad_b, grad_bias, grad_c) + (None,) * 9


matmul_op.register_autograd(_backward, setup_context=_setup_context)
lean_autograd(matmul_op)  # a compiled graph's calls skip the custom op's Python layers (core/torch_ops.py)
