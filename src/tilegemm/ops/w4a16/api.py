"""``tilegemm.w4a16.matmul``: the replay fast path, the checks, then the op or a plain call."""

from __future__ import annotations

import math

import torch

from tilegemm.core.activations import ACTIVATIONS  # noqa: F401 (re-exported as tilegemm.w4a16.ACTIVATIONS)
from tilegemm.core.launch import plain_call
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
        bias: ``[N]``, float16 or bfloat16.
        activation: ``None``/``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"leaky_relu"``.
        kernel: ``"auto"`` (by the number of rows M) or a name from ``tilegemm.kernels("w4a16")``.

    Returns ``[..., N]`` in x's dtype. Differentiable in x and bias (the weight is frozen).

    Raises:
        TypeError, ValueError: naming the bad argument (shapes, dtypes, devices, unknown names).
    """
    activation = "none" if activation is None else activation
    # The fast path: a replay of an earlier plain call with the same key (act-order: with perm, read through it
    # by the kernel, or of x's inputs reordered).
    key = x2 = perm = tensors = None
    if type(w) is Int4Weight and type(x) is torch.Tensor and x.dim() >= 1 and x.shape[-1] == w.shape[1] \
            and (w.perm is None or w.perm.device == x.device):
        x2, perm = _ordered(x if x.dim() == 2 else _rows(x), w, kernel)
        if w._frag is None and dispatch.wants_frag(kernel, x2, w):
            w.fragments()  # before the key, which holds the fragments' layouts
        key = replay_key(x2, w, bias, activation, kernel, perm)
        if key is not None:
            tensors = call_tensors(x2, w, bias, perm)
            out = op.REPLAYS.replayed(key, tensors)
            if out is None:  # dequant_cublas: its dequantization replayed, then cuBLAS on the weight it wrote
                wd = op.DEQUANTS.replayed(key, tensors)
                out = None if wd is None else cublas_half.forward(x2, wd, bias, activation)
            if out is not None:
                return _shaped(out, x)
            # (None: nothing recorded, or recorded for another device or stream; launched afresh below)
    check_inputs(x, w, bias, activation, kernel)
    lead = x.shape[:-1]
    if x2 is None:
        x2, perm = _ordered(_rows(x), w, kernel)
    # The fragment layout goes along when a fragment kernel is asked for, or may be chosen by auto.
    fweight, fzs = w.fragments() if dispatch.wants_frag(kernel, x2, w) else (None, None)
    p = W4A16Problem(x=x2, qweight=w.qweight, scales=w.scales, zeros=w.zeros, bias=bias, out=None,
                     group_k=w.group_k, activation=activation, fweight=fweight, fzs=fzs, kernel=kernel, perm=perm)
    # Dispatch through torch.ops costs tens of microseconds of host time, more than an M=1 kernel; a call that
    # no tracer, mode or autograd needs to see skips it (as tilegemm.matmul does).
    if not plain_call(x2, bias):
        return op.call(p).reshape(*lead, w.shape[0])
    if key is None:
        return _shaped(dispatch.forward(p), x)
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


def _shaped(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The ``[M, N]`` output as ``[..., N]`` for ``x [..., K]`` (no view made for 2-D x: host time)."""
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[1])


def _ordered(x2: torch.Tensor, w: Int4Weight, kernel: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x2, perm)``: act-order weights hold their rows sorted by group, so x's inputs are taken in that order,
    by the kernel through ``perm`` (frag_wgmma at small M: :func:`~tilegemm.ops.w4a16.dispatch.gathers`), or
    else reordered here (``perm`` None); weights in natural order: ``(x2, None)``."""
    if w.perm is None:
        return x2, None
    if dispatch.gathers(kernel, x2, w):
        return x2, w.perm
    return x2.index_select(1, w.perm), None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[M, K]`` (reshape(-1, K) cannot infer M when K is 0)."""
    K = x.shape[-1]
    return x.reshape(-1, K) if K else x.reshape(math.prod(x.shape[:-1]), 0)
