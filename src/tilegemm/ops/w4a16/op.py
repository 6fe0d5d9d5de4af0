"""The ``torch.library`` op ``tilegemm::w4a16_matmul``: its fake, and autograd for x and the bias (the weight is
frozen). torch.compile traces it; :func:`tilegemm.ops.w4a16.api.matmul` calls it when a tracer, mode or autograd
must see the call. :data:`REPLAYS` keeps the plain calls' launches (:mod:`tilegemm.core.replay`)."""

from __future__ import annotations

import sys
from typing import Optional

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.core.replay import ReplayCache
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.w4a16 import dispatch
from tilegemm.core.checked import check_once
from tilegemm.core.runtime import any_negative, resolved
from tilegemm.ops.w4a16 import fragment_records
from tilegemm.ops.w4a16.checks import check_op_args, weight_of_op_args
from tilegemm.ops.w4a16.problem import W4A16Problem

# The host fast path (keys: tilegemm.ops.w4a16.checks.replay_key). REPLAYS keeps the one-launch kernels' whole
# calls. Of a dequant_cublas call DEQUANTS keeps its Triton launch alone, the dequantized weight as its output:
# the family then runs the cuBLAS half itself (tilegemm.ops.w4a16.cublas_half), so core never calls back into it.
REPLAYS = ReplayCache("w4a16")
DEQUANTS = ReplayCache("w4a16_dequant")
# Of an act-order call REORDERS keeps the gather of x's inputs (ops/w4a16/reorder.py), the reordered x as its
# output, under the call's key; the family replays it, then the product (REPLAYS or DEQUANTS) on that x.
REORDERS = ReplayCache("w4a16_reorder")
REPLAYED_KERNELS = ("gemv", "mma", "frag_wgmma")  # whole calls that are one Triton launch


@torch.library.custom_op("tilegemm::w4a16_matmul", mutates_args=())
def _w4a16_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    fweight: Optional[torch.Tensor],
    fzs: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    group_k: int,
    activation: str,
    kernel: str,
    perm: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    qweight, scales, zeros = contiguous_parts(qweight, scales, zeros)
    if fweight is not None and fzs is not None:
        fweight, fzs = fragment_layout(qweight, scales, zeros, fweight, fzs, group_k, kernel)
    # Called directly (torch.ops.tilegemm.w4a16_matmul) nothing checked the arguments: a weight's parts that do
    # not fit N, K and the group length would be read out of bounds. The public function's plain calls skip the op.
    check_once(check_op_args, x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm)
    if any_negative(x, bias):  # (a compiled graph's input may be one: see tilegemm.matmul's op)
        x, bias = resolved(x, bias)
    if bias is not None and bias.dim() == 1 and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernels read the bias as one contiguous vector
    return dispatch.forward(W4A16Problem.of_op_args(x, qweight, scales, zeros, fweight, fzs, bias, group_k,
                                                    activation, kernel, perm))


def contiguous_parts(*parts) -> tuple:
    """A weight's parts as the kernels read them, contiguous: a DTensor's local shard may come as a strided view
    of a shard it redistributed (an uneven split), on one rank only (a refusal there would leave the others waiting
    in their next collective). A plain weight's parts are contiguous already (no copy)."""
    return tuple(t.contiguous() for t in parts)


def fragment_layout(qweight, scales, zeros, fweight, fzs, group_k: int, kernel: str, gated=None,
                    frag_kernels=dispatch.FRAG_KERNELS) -> tuple:
    """``(fweight, fzs)`` an op reads: a module's kept layout only while it stands for these parts (a compiled
    graph, traced with a layer's own, may be called with others or after a write:
    :func:`fragment_records.layout_for`), else none, or where one of ``frag_kernels`` (the calling op's kernels
    that read the layout) is named, the parts' own made for this call. ``gated``: the grouped op's gate/up order
    (None: a single weight)."""
    layout = fragment_records.layout_for((qweight, scales, zeros), (fweight, fzs))
    if layout is not None:
        return layout
    if kernel not in frag_kernels:
        return None, None
    w = weight_of_op_args(qweight, scales, zeros, group_k, stacked=gated is not None)
    return w.fragments() if gated is None else w.fragments(gated)


@_w4a16_op.register_fake
def _w4a16_fake(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm=None):
    # the body's checks (no values read): a meta or traced call with parts that do not fit fails where it is made
    qweight, scales, zeros = contiguous_parts(qweight, scales, zeros)
    check_op_args(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm)
    return x.new_empty((x.shape[0], qweight.shape[1]))


def call(p: W4A16Problem) -> torch.Tensor:
    """The op on call ``p``."""
    return _w4a16_op(*p.op_args())


# --- autograd: the weight is frozen; x's gradient through the dequantized weight (act-order with perm: x is in
# the caller's order, the weight's rows in the stored one, so the gradient goes back through perm) --------------


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm = inputs
    # Kept only what the backward reads, as torch's Linear keeps it: x and bias only to recompute an activation's
    # input, the weight's parts only for x's gradient (an input written in place after the call, a residual's
    # h += layer(h), or one made under inference_mode, is then no autograd error where torch's is none)
    recompute = activation != "none"
    weight = (qweight, scales, zeros, perm) if recompute or ctx.needs_input_grad[0] else (None,) * 4
    ctx.save_for_backward(x if recompute else None, *weight[:3], bias if recompute else None, weight[3])
    ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
    ctx.group_k, ctx.activation = group_k, activation


def _backward(ctx, grad_out):
    x, qweight, scales, zeros, bias, perm = ctx.saved_tensors  # (None where not kept: see _setup_context)
    x_dtype, bias_dtype = ctx.dtypes
    grad = grad_out.float()
    # Grad mode is on here only under create_graph=True (double backward): the activation's derivative is then
    # recorded through the recomputed pre-activation (differentiable in x and bias), else the gradient came back
    # cut from x and a second derivative failed or lost its terms
    create_graph = torch.is_grad_enabled()
    if ctx.activation != "none":
        pre = _w4a16_op(x, qweight, scales, zeros, None, None, bias, ctx.group_k, "none", "auto", perm).float()
        if ctx.activation != "relu":
            # recomputed in x's dtype, a sum past its range reads ±inf, where silu' and gelu' are NaN: the derivative
            # at the range's end is the saturated one the sum has (0 below, 1 above), as the forward's fp32 sum had
            big = torch.finfo(x_dtype).max
            pre = torch.where(pre.isinf(), pre.clamp(-big, big), pre)
        with torch.enable_grad():
            if not (create_graph and pre.requires_grad):
                pre = pre.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(torch_activation(pre, ctx.activation), pre, grad, create_graph=create_graph)
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        if _is_dtensor(qweight):  # DTensor operands: the dequantization runs on each rank's shard
            wt = _dtensor_weight_t(qweight, scales, zeros, perm, ctx.group_k, x_dtype)
            grad_x = (grad.to(x_dtype) @ wt.T).to(x_dtype)
        else:
            wt = _weight_t(qweight, scales, zeros, ctx.group_k, x_dtype)  # [K, N]
            grad_x = (grad.to(x_dtype) @ wt.T).to(x_dtype)  # by the weight's stored inputs
            if perm is not None:  # stored input j is x's input perm[j]
                grad_x = torch.empty_like(grad_x).index_copy_(1, perm.long(), grad_x)
    if bias_dtype is not None and ctx.needs_input_grad[6]:
        grad_bias = grad.sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, None, grad_bias, None, None, None, None


def _weight_t(qweight, scales, zeros, group_k: int, dtype) -> torch.Tensor:
    """The dequantized weight, transposed: ``[K, N]`` from qweight ``[K/8, N]``, scales and zeros ``[K/group_k, N]``."""
    K = qweight.shape[0] * 8
    g = torch.arange(K, device=qweight.device) // max(group_k, 1)  # (group_k is 0 with K: no rows then)
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(K, qweight.shape[1])
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).to(dtype)


def _is_dtensor(t) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # (loaded by whoever made a DTensor: no import here)
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _dtensor_weight_t(qweight, scales, zeros, perm, group_k: int, dtype):
    """:func:`_weight_t` of DTensor parts, with its rows in x's input order (act-order: through ``perm``), as a
    DTensor: each rank dequantizes its shard (``local_map``). The parts are placed alike first: split along N as
    qweight is, or along K where the split holds whole groups (and no perm, which mixes all of K); else
    replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import local_map

    mesh = qweight.device_mesh
    K = qweight.shape[0] * 8
    place = []
    for dim, p in enumerate(qweight.placements):
        n = mesh.size(dim)
        whole_groups = perm is None and 0 < group_k < K and K % (n * group_k) == 0
        place.append(p if isinstance(p, Shard) and (p.dim == 1 or (p.dim == 0 and whole_groups)) else Replicate())
    place = tuple(place)
    parts = [t if t.placements == place else t.redistribute(placements=place) for t in (qweight, scales, zeros)]
    if perm is not None:
        parts.append(perm.redistribute(placements=(Replicate(),) * mesh.ndim))

    def local(qw, sc, ze, pm=None):
        wt = _weight_t(qw, sc, ze, group_k, dtype)
        return wt if pm is None else torch.empty_like(wt).index_copy_(0, pm.long(), wt)  # row perm[j] = row j

    # (lists: local_map reads a tuple of placements as one placement list per output)
    in_place = (list(place),) * 3 + ([Replicate()] * mesh.ndim,) * (len(parts) - 3)
    return local_map(local, out_placements=list(place), in_placements=in_place, device_mesh=mesh)(*parts)


_w4a16_op.register_autograd(_backward, setup_context=_setup_context)
lean_autograd(_w4a16_op)  # a compiled graph's calls skip the custom op's Python layers (core/torch_ops.py)
