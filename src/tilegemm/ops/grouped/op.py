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

from tilegemm.core import registry
from tilegemm.core.activations import torch_activation
from tilegemm.core.dtypes import narrowed_gradient, resolve_precision, unscaled
from tilegemm.core.replay import ReplayCache
from tilegemm.core.runtime import any_negative, new_output, on_device, resolved
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.grouped import dispatch
from tilegemm.core.checked import check_once
from tilegemm.ops.grouped.checks import check_gated_call, check_int4_op_args, check_mm_call
from tilegemm.ops.grouped.problem import GroupedInt4Problem, make_problem, out_shape
from tilegemm.ops.w4a16 import contiguous_parts, fragment_layout

# The host fast path of the family's plain calls (grouped_mm, moe_gate_up, w4a16.grouped_matmul): each is one
# launch whose grid and config follow from shapes, so a replay takes new tensors and new offs values alike.
# Keys: tilegemm.ops.grouped.checks (replay_key, gated_replay_key, int4_replay_key); docs/grouped.md.
REPLAYS = ReplayCache("grouped")



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
    if offs is not None and offs.stride(0) != 1:
        offs = offs.contiguous()  # the kernels read offs as one vector
    p = make_problem(layout, groups, a, b, offs, bias, out, resolve_precision(precision, a.dtype))
    dispatch.launch(p, kernel)
    return out


@torch.library.custom_op("tilegemm::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  out_dtype: Optional[torch.dtype], precision: str, kernel: str) -> torch.Tensor:
    # Called directly (torch.ops.tilegemm.grouped_mm) nothing checked the arguments: the public function's checks
    # (shapes, dtypes, offs, bias, devices), by the same code. The public function's plain calls skip the op.
    check_once(check_mm_call, a, b, offs, bias, out_dtype, kernel)
    if any_negative(a, b, bias):  # (a compiled graph's input may be one: see the public function)
        a, b, bias = resolved(a, b, bias)
    return forward(a, b, offs, bias, out_dtype, precision, kernel)


@grouped_mm_op.register_fake
def _fake(a, b, offs, bias, out_dtype, precision, kernel):
    check_mm_call(a, b, offs, bias, out_dtype, kernel)  # a traced call fails where it is traced (no values read)
    resolve_precision(precision, a.dtype)  # (names an unknown precision)
    layout = f"{a.dim()}d{b.dim()}d"
    return a.new_empty(out_shape(layout, a.shape, b.shape, _groups(layout, a, b, offs)), dtype=out_dtype or a.dtype)


def _setup_context(ctx, inputs, output):
    a, b, offs, bias, out_dtype, precision, kernel = inputs
    # each operand kept only where the other wants a gradient (as torch's products keep them)
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None, offs)
    ctx.layout, ctx.dtypes = f"{a.dim()}d{b.dim()}d", (a.dtype, b.dtype)
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
        # the output's columns past offs[-1] (all of them with no groups) are zeros: their dY reaches no bias
        return _reaching(dy, offs, layout).sum(0).to(dtype)
    per_group = dy.sum(1)  # 3d3d, 2d2d: out [G, M, N]
    return (per_group if len(shape) == 2 else per_group.sum(0)).to(dtype)


def _reaching(grad, offs, layout: str):
    """``grad`` with zeros where it reaches no product: the output's rows (2-D x 3-D) or columns (3-D x 2-D) past
    ``offs[-1]``, which no group holds (where, not a product: NaN there reaches nothing either)."""
    end = (offs[-1:] if offs.shape[0] else offs.new_zeros(1)).to(torch.int64)
    if layout == "2d3d":
        return torch.where((torch.arange(grad.shape[0], device=grad.device) < end)[:, None], grad, 0)
    return torch.where(torch.arange(grad.shape[-1], device=grad.device) < end, grad, 0)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors  # (a or b None where not kept)
    layout, (a_dtype, b_dtype) = ctx.layout, ctx.dtypes
    p = ctx.precision
    if a_dtype == torch.float16 and grad.dtype == torch.float32 and layout in ("2d3d", "3d2d"):
        grad = _reaching(grad, offs, layout)  # (the scale below follows the entries that reach a product)
    dy, scale = narrowed_gradient(grad, a_dtype)  # (out_dtype fp32 of fp16 operands: scaled into fp16's range)
    wide = None if scale is None else torch.float32
    ga = gb = gbias = None
    if ctx.needs_input_grad[0]:
        ga = unscaled(grouped_mm_op(dy, _t(b), offs, None, wide, p, "auto"), scale, a_dtype)
    if ctx.needs_input_grad[1]:
        gb = unscaled(grouped_mm_op(_t(a), dy, offs, None, wide, p, "auto"), scale, b_dtype)
    if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
        gbias = _bias_grad(layout, grad, offs, ctx.bias_shape, ctx.bias_dtype, p)
    return ga, gb, None, gbias, None, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
lean_autograd(grouped_mm_op)  # a compiled graph's plain calls skip the custom op's Python layers


# --- 4-bit experts: tilegemm::grouped_w4a16 ------------------------------------------------------------------


def forward_int4(x, qweight, scales, zeros, offs, bias, group_k: int, activation: str, gated: bool,
                 kernel: str, fweight=None, fzs=None) -> torch.Tensor:
    """Allocate the output and launch (arguments checked by the caller); ``fweight``, ``fzs``: the stacked
    fragment layout (gated: of the gated row order) where kernel ``frag`` may run, else None."""
    E, N, K = qweight.shape[0], qweight.shape[2], x.shape[1]
    N_out = N // 2 if gated else N
    out = new_output((x.shape[0], N_out), x.dtype, x.device)
    if out.numel() == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()  # the kernel reads a bias row as contiguous
    offs = offs if offs.stride(0) == 1 else offs.contiguous()
    p = GroupedInt4Problem(x, qweight, scales, zeros, offs, bias, out, E, x.shape[0], N_out, K, group_k,
                           activation, gated, fweight, fzs)
    with on_device(x.device):
        registry.launcher("grouped_w4a16", dispatch.choose_int4(p) if kernel == "auto" else kernel)(p)
    return out


@torch.library.custom_op("tilegemm::grouped_w4a16", mutates_args=())
def grouped_w4a16_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     offs: torch.Tensor, bias: Optional[torch.Tensor], group_k: int, activation: str, gated: bool,
                     kernel: str, fweight: Optional[torch.Tensor] = None,
                     fzs: Optional[torch.Tensor] = None) -> torch.Tensor:
    qweight, scales, zeros = contiguous_parts(qweight, scales, zeros)
    if fweight is not None and fzs is not None:  # a block's kept layouts only while they stand for these parts
        fweight, fzs = fragment_layout(qweight, scales, zeros, fweight, fzs, group_k, kernel, gated,
                                        dispatch.FRAG_KERNELS)
    check_once(check_int4_op_args, x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel, fweight,
               fzs)
    if any_negative(x, bias):  # (as grouped_mm_op's)
        x, bias = resolved(x, bias)
    return forward_int4(x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel, fweight, fzs)


@grouped_w4a16_op.register_fake
def _fake_int4(x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel, fweight=None, fzs=None):
    qweight, scales, zeros = contiguous_parts(qweight, scales, zeros)
    check_int4_op_args(x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel, fweight, fzs)
    N = qweight.shape[2]
    return x.new_empty((x.shape[0], N // 2 if gated else N))


def dequantized_experts(qweight, scales, zeros, group_k: int, dtype) -> torch.Tensor:
    """The stacked experts' weight ``[E, N, K]`` the 4-bit one stands for (as format.dequantize computes it)."""
    E, R, N = qweight.shape
    K = R * 8
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    q = ((qweight[:, :, None, :] >> shifts[None, None, :, None]) & 15).reshape(E, K, N)
    g = torch.arange(K, device=qweight.device) // group_k
    wt = ((q.float() - zeros.float()[:, g]) * scales.float()[:, g]).to(dtype)  # [E, K, N]
    return wt.transpose(1, 2)


def _setup_int4(ctx, inputs, output):
    x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel = inputs[:10]
    ctx.save_for_backward(x, qweight, scales, zeros, offs, bias)
    ctx.group_k, ctx.activation, ctx.gated = group_k, activation, gated


def _backward_int4(ctx, grad):
    """Gradients of x and bias (the 4-bit weight is frozen), through the pre-activation recomputed in fp32."""
    x, qweight, scales, zeros, offs, bias = ctx.saved_tensors
    create_graph = torch.is_grad_enabled()  # on only under create_graph=True: see _backward_gated
    w = dequantized_experts(qweight, scales, zeros, ctx.group_k, x.dtype)  # [E, N, K]
    pre = grouped_mm_op(x, w.transpose(1, 2), offs, bias, torch.float32, "ieee", "auto")  # [M, N] (2N gated)
    with torch.enable_grad():
        if not (create_graph and pre.requires_grad):
            pre = pre.detach().requires_grad_(True)
        if ctx.gated:
            half = pre.shape[1] // 2
            y = torch_activation(pre[:, :half], ctx.activation) * pre[:, half:]
        else:
            y = torch_activation(pre, ctx.activation)
        (dpre,) = torch.autograd.grad(y, pre, grad.float(), create_graph=create_graph)
    gx = gbias = None
    if ctx.needs_input_grad[0]:
        gx = grouped_mm_op(dpre.to(x.dtype), w, offs, None, None, "ieee", "auto")
    if bias is not None and ctx.needs_input_grad[5]:
        gbias = _bias_grad("2d3d", dpre, offs, tuple(bias.shape), bias.dtype, "ieee")
    return gx, None, None, None, None, gbias, None, None, None, None, None, None


grouped_w4a16_op.register_autograd(_backward_int4, setup_context=_setup_int4)
lean_autograd(grouped_w4a16_op)


# --- the MoE gate/up product with the activation and the gate fused: tilegemm::grouped_mm_gated -------------------


def forward_gated(a, b, offs, bias, activation: str, precision: str) -> torch.Tensor:
    """``activation(a @ b[g][:, :N] + bias[g, :N]) * (a @ b[g][:, N:] + bias[g, N:])`` for 2-D a, 3-D b of 2N
    columns (gate, then up), rows grouped by offs; ``[M, N]``."""
    groups, N = b.shape[0], b.shape[2] // 2
    out = new_output((a.shape[0], N), a.dtype, a.device)
    if out.numel() == 0:
        return out
    offs = offs if offs.stride(0) == 1 else offs.contiguous()
    p = make_problem("2d3d", groups, a, b, offs, bias, out, resolve_precision(precision, a.dtype), activation, True)
    dispatch.launch(p, "auto")
    return out


@torch.library.custom_op("tilegemm::grouped_mm_gated", mutates_args=())
def grouped_mm_gated_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bias: Optional[torch.Tensor],
                        activation: str, precision: str) -> torch.Tensor:
    check_once(check_gated_call, a, b, offs, bias, activation)
    if any_negative(a, b, bias):  # (as grouped_mm_op's)
        a, b, bias = resolved(a, b, bias)
    return forward_gated(a, b, offs, bias, activation, precision)


@grouped_mm_gated_op.register_fake
def _fake_gated(a, b, offs, bias, activation, precision):
    check_gated_call(a, b, offs, bias, activation)
    resolve_precision(precision, a.dtype)
    return a.new_empty((a.shape[0], b.shape[2] // 2))


def _setup_gated(ctx, inputs, output):
    a, b, offs, bias, activation, precision = inputs
    ctx.save_for_backward(a, b, offs, bias)
    ctx.activation, ctx.precision = activation, precision


def _backward_gated(ctx, grad):
    """Through the pre-activation ``[M, 2N]``, recomputed in fp32 (one more grouped product)."""
    a, b, offs, bias = ctx.saved_tensors
    # Grad mode is on here only under create_graph=True (double backward): the gate's and the activation's
    # derivatives are then recorded through the recomputed pre-activation, else the second derivative would
    # lose their terms (the products below are differentiable either way)
    create_graph = torch.is_grad_enabled()
    pre = grouped_mm_op(a, b, offs, bias, torch.float32, ctx.precision, "auto")
    with torch.enable_grad():
        if not (create_graph and pre.requires_grad):
            pre = pre.detach().requires_grad_(True)
        half = pre.shape[1] // 2
        y = torch_activation(pre[:, :half], ctx.activation) * pre[:, half:]
        (dpre,) = torch.autograd.grad(y, pre, grad.float(), create_graph=create_graph)
    dy = dpre.to(a.dtype)
    ga = gb = gbias = None
    if ctx.needs_input_grad[0]:
        ga = grouped_mm_op(dy, _t(b), offs, None, None, ctx.precision, "auto")
    if ctx.needs_input_grad[1]:
        gb = grouped_mm_op(_t(a), dy, offs, None, None, ctx.precision, "auto")
    if bias is not None and ctx.needs_input_grad[3]:
        gbias = _bias_grad("2d3d", dpre, offs, tuple(bias.shape), bias.dtype, ctx.precision)
    return ga, gb, None, gbias, None, None


grouped_mm_gated_op.register_autograd(_backward_gated, setup_context=_setup_gated)
lean_autograd(grouped_mm_gated_op)
