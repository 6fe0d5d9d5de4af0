"""``tilegemm.w4a16.matmul``: the replay fast path, the checks, then the op or a plain call."""

from __future__ import annotations

import math

import torch

from tilegemm.core.activations import ACTIVATIONS  # noqa: F401 (re-exported as tilegemm.w4a16.ACTIVATIONS)
from tilegemm.core.launch import plain_call
from tilegemm.core.runtime import any_negative, check_one_kind, resolved
from tilegemm.core.runtime import on_device
from tilegemm.core.torch_ops import rows_as
from tilegemm.ops.w4a16 import cublas_half, dispatch, op
from tilegemm.ops.w4a16.checks import call_tensors, check_inputs, replay_key
from tilegemm.ops.w4a16.format import Int4Weight
from tilegemm.ops.w4a16.problem import W4A16Problem


def matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, activation: str | None = None,
           *, kernel: str = "auto") -> torch.Tensor:
    """``activation(x @ dequantize(w).T + bias)``, accumulated in fp32, with the 4-bit weight read as is.

    Args:
        x: ``[..., K]``, float16 or bfloat16 (the weight's scales' dtype); any number of rows, from 1.
        w: an :class:`~tilegemm.ops.w4a16.format.Int4Weight` of shape ``[N, K]``.
        bias: ``[N]``, of x's dtype.
        activation: ``None``/``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"leaky_relu"``.
        kernel: ``"auto"`` (by the number of rows M) or a name from ``tilegemm.kernels("w4a16")``.

    Returns ``[..., N]`` in x's dtype. Differentiable in x and bias (the weight is frozen).

    Raises:
        TypeError, ValueError: naming the bad argument (shapes, dtypes, devices, unknown names).
    """
    activation = "none" if activation is None else activation
    if isinstance(bias, torch.Tensor) and bias.layout is torch.strided and bias.dim() == 1 and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernels read the bias as one contiguous vector (before the replay key)
    # The fast path: a replay of an earlier plain call with the same key. Act-order (perm): two replays, x's
    # inputs reordered by the recorded gather (op.REORDERS, a new x each call), then the product on it.
    key = x2 = xr = tensors = None
    if type(w) is Int4Weight and type(x) is torch.Tensor and not x.is_nested and x.dim() >= 1 \
            and x.shape[-1] == w.shape[1] and (w.perm is None or w.perm.device == x.device):
        perm = w.perm
        x2 = x if x.dim() == 2 else _rows(x)
        if w._frag is None and dispatch.wants_frag(kernel, x2, w):
            w.fragments()  # before the key, which holds the fragments' layouts
        key = replay_key(x2, w, bias, activation, kernel, perm)
        if key is not None:
            if perm is not None:
                xr = op.REORDERS.replayed(key, (x2, perm))
            if perm is None or xr is not None:
                tensors = call_tensors(x2 if xr is None else xr, w, bias)
                out = op.REPLAYS.replayed(key, tensors)
                if out is None:  # dequant_cublas: its dequantization replayed, then cuBLAS on the weight it wrote
                    wd = op.DEQUANTS.replayed(key, tensors)
                    out = None if wd is None else cublas_half.forward(tensors[0], wd, bias, activation)
                if out is not None:
                    return _shaped(out, x)
            # (None: nothing recorded, or recorded for another device or stream; launched afresh below, on the
            # reordered x where its gather was replayed)
    if isinstance(w, Int4Weight):
        _check_dtensors(x, w, bias)
    check_inputs(x, w, bias, activation, kernel)
    if any_negative(x, bias):  # (z.conj().imag: the kernels would read the values negated; never keyed)
        (x, bias), x2 = resolved(x, bias), None
    lead, perm = x.shape[:-1], w.perm
    if x2 is None:
        x2 = _rows(x)
    plain = plain_call(x2, bias)
    if perm is not None and xr is None:
        if not plain:  # autograd, a tracer or a mode sees the reorder (and the gradient goes back through it)
            xr = x2.index_select(1, perm)
        elif key is None:
            xr = _reordered(x2, perm)
        else:  # recorded as its own replay: the same route, eager or captured into a CUDA graph
            with op.REORDERS.recording(key, (x2, perm)) as kept:
                xr = kept(_reordered(x2, perm))
    if xr is not None:
        x2 = xr
    # The fragment layout goes along when a fragment kernel is asked for, or may be chosen by auto.
    if kernel in dispatch.FRAG_KERNELS and w._frag is None and torch.compiler.is_compiling():
        raise ValueError(f"kernel={kernel!r} reads the weight's fragment layout, which a traced graph does not make: "
                         f"make it before compiling or exporting (w.fragments(); an Int4Linear keeps it where the "
                         f"kernel runs), or leave the kernel to auto")
    fweight, fzs = w.fragments() if dispatch.wants_frag(kernel, x2, w) else (None, None)
    p = W4A16Problem(x=x2, qweight=w.qweight, scales=w.scales, zeros=w.zeros, bias=bias, out=None,
                     group_k=w.group_k, activation=activation, fweight=fweight, fzs=fzs, kernel=kernel)
    # Dispatch through torch.ops costs tens of microseconds of host time, more than an M=1 kernel; a call that
    # no tracer, mode or autograd needs to see skips it (as tilegemm.matmul does).
    if not plain:
        return rows_as(op.call(p), lead)
    if key is None:
        return _shaped(dispatch.forward(p), x)
    tensors = call_tensors(x2, w, bias)
    chosen = dispatch.kernel_for(p)
    if chosen in op.REPLAYED_KERNELS:
        with op.REPLAYS.recording(key, tensors) as kept:
            out = kept(dispatch.forward(p))
    elif chosen == "dequant_cublas" and x2.numel():
        # the dequantization's launch kept with the weight it writes as its output; cuBLAS runs after it
        with op.DEQUANTS.recording(key, tensors) as kept:
            wd = kept(dispatch.dequantized(p))
        out = cublas_half.forward(x2, wd, bias, activation)
    else:
        out = dispatch.forward(p)
    return _shaped(out, x)


def _check_dtensors(x, w: Int4Weight, bias) -> None:
    """Refuse a call mixing DTensors with plain tensors (the kernels would be handed a DTensor), naming which."""
    named = {"x": x, "w.qweight": w.qweight, "w.scales": w.scales, "w.zeros": w.zeros, "w.perm": w.perm,
             "bias": bias}
    check_one_kind({k: t for k, t in named.items() if isinstance(t, torch.Tensor)}, "tilegemm.w4a16.matmul: ",
                   " (a sharded layer holds an Int4Weight of its local shard: tilegemm.nn.Int4Linear with "
                   "tilegemm.nn.ColwiseParallel / RowwiseParallel)")


def _shaped(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The ``[M, N]`` output as ``[..., N]`` for ``x [..., K]``, a tensor of its own (``rows_as``; nothing done for
    2-D x: host time)."""
    return out if x.dim() == 2 else rows_as(out, x.shape[:-1])


def _reordered(x2: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x2[:, perm]`` as a new contiguous tensor, by the Triton gather (docs/w4a16.md, "Act-order")."""
    from tilegemm.ops.w4a16.reorder import reorder_columns  # (a kernel module: imported when first needed)

    with on_device(x2.device):
        return reorder_columns(x2, perm)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[M, K]`` (reshape(-1, K) cannot infer M when K is 0)."""
    K = x.shape[-1]
    return x.reshape(-1, K) if K else x.reshape(math.prod(x.shape[:-1]), 0)
