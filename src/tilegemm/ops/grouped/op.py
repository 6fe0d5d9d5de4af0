"""The ``torch.library`` op ``tilegemm::grouped_mm``: its forward, fake (shapes only) and autograd.

Each gradient of a grouped product is itself one (the layouts are closed under the backward), so the backward
runs the same op on transposed views, and a compiled graph's backward traces as well as its forward:

- 2-D x 3-D: ``dA = grouped(dY, B^T)`` (2-D x 3-D), ``dB = grouped(A^T, dY)`` (2-D x 2-D, groups along K).
- 3-D x 3-D: ``dA = dY @ B^T``, ``dB = A^T @ dY`` (both 3-D x 3-D).
- 2-D x 2-D: ``dA = grouped(dY, B^T)`` (3-D x 2-D), ``dB = grouped(A^T, dY)`` (2-D x 3-D).
- 3-D x 2-D: ``dA = grouped(dY, B^T)`` (2-D x 2-D), ``dB = grouped(A^T, dY)`` (3-D x 2-D).
"""

from __future__ import annotations

from typing import Optional

import torch

from tilegemm.core.dtypes import resolve_precision
from tilegemm.core.runtime import new_output
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.problem import make_problem, out_shape


def _groups(layout: str, a, b, offs) -> int:
    if layout == "2d3d":
        return b.shape[0]
    if layout == "3d2d" or layout == "3d3d":
        return a.shape[0]
    return offs.shape[0]


def forward(a, b, offs, bias, out_dtype, precision: str, kernel: str) -> torch.Tensor:
    """Allocate the output and launch (arguments checked by the caller)."""
    layout = f"{a.dim()}d{b.dim()}d"
    groups = _groups(layout, a, b, offs)
    out = new_output(out_shape(layout, a.shape, b.shape, groups), out_dtype or a.dtype, a.device)
    if out.numel() == 0:
        return out
    if a.shape[-1] == 0 and layout != "2d2d" or layout == "2d2d" and groups == 0:
        return out.zero_()
    p = make_problem(layout, groups, a, b, offs, bias, out, resolve_precision(precision, a.dtype))
    dispatch.launch(p, kernel)
    return out


@torch.library.custom_op("tilegemm::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  out_dtype: Optional[torch.dtype], precision: str, kernel: str) -> torch.Tensor:
    return forward(a, b, offs, bias, out_dtype, precision, kernel)


@grouped_mm_op.register_fake
def _fake(a, b, offs, bias, out_dtype, precision, kernel):
    layout = f"{a.dim()}d{b.dim()}d"
    return a.new_empty(out_shape(layout, a.shape, b.shape, _groups(layout, a, b, offs)), dtype=out_dtype or a.dtype)


def _setup_context(ctx, inputs, output):
    a, b, offs, bias, out_dtype, precision, kernel = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.bias_shape = None if bias is None else tuple(bias.shape)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.precision = precision


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def _bias_grad(layout: str, dy: torch.Tensor, offs, shape, dtype, precision: str) -> torch.Tensor:
    """The bias's gradient: dY summed over each group's rows (only the rows groups hold)."""
    if layout == "2d3d":
        ones = dy.new_ones((1, dy.shape[0]))
        per_group = grouped_mm_op(ones, dy, offs, None, None, precision, "auto")[:, 0, :]  # [G, N]
        return (per_group if len(shape) == 2 else per_group.sum(0)).to(dtype)
    if layout == "3d2d":
        cols = torch.arange(dy.shape[1], device=dy.device) < offs[-1:].to(torch.int64)
        return (dy.sum(0) * cols).to(dtype)
    per_group = dy.sum(1)  # 3d3d, 2d2d: out [G, M, N]
    return (per_group if len(shape) == 2 else per_group.sum(0)).to(dtype)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    layout = f"{a.dim()}d{b.dim()}d"
    p = ctx.precision
    dy = grad.to(a.dtype)
    ga = gb = gbias = None
    if ctx.needs_input_grad[0]:
        ga = grouped_mm_op(dy, _t(b), offs, None, None, p, "auto")
    if ctx.needs_input_grad[1]:
        gb = grouped_mm_op(_t(a), dy, offs, None, None, p, "auto")
    if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
        gbias = _bias_grad(layout, grad, offs, ctx.bias_shape, ctx.bias_dtype, p)
    return ga, gb, None, gbias, None, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
lean_autograd(grouped_mm_op)  # a compiled graph's plain calls skip the custom op's Python layers
