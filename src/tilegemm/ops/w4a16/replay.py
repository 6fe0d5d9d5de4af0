"""The host fast path of ``tilegemm.w4a16.matmul``: replays of earlier plain calls.

A plain call (no tracer, dispatch mode or autograd watching; CUDA, not the interpreter) is keyed by everything
Triton specializes its launch on: the activations' dtype, shape, strides and 16-byte alignment, the same for
the weight's ``qweight``, ``scales`` and ``zeros``, the group length, whether there is a bias (and its
layout), the activation, the kernel asked for and the device. The first such call records its one launch
(:func:`tilegemm.core.launch.recording`); later calls with the same key replay it with their own tensors,
skipping the checks, the choice of kernel and config, and Triton's launch wrapper.

Only the one-launch kernels' calls are kept (``gemv``, ``mma``, ``frag``, ``frag_wgmma``): ``dequant_cublas``
also calls cuBLAS, which a replay of its one Triton launch would skip. Split-K launches use a workspace of the
launcher's own, recorded as kept for the stream it was made for; a replay on another stream declines and the
call launches afresh.

:func:`clear` and :func:`count` are the documented hooks to observe the cache (tests use them).
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import ReplayCache, plain_call, plain_tensor, tensor_key
from tilegemm.core.runtime import interpreting
from tilegemm.core.workspace import in_graph_tree

_cache = ReplayCache()

REPLAYED_KERNELS = ("gemv", "mma", "frag", "frag_wgmma")  # whole calls that are one Triton launch


def key_of(x2: torch.Tensor, w, bias, activation: str, kernel: str) -> tuple:
    """The replay key of a call with 2-D activations ``x2`` (already reshaped and, for act-order, permuted):
    the layouts of every tensor the launch takes and the call's named options."""
    frag = None if w._frag is None else tuple(tensor_key(t) for t in w._frag)
    return (kernel, activation, x2.device, tensor_key(x2), tensor_key(w.qweight), tensor_key(w.scales),
            tensor_key(w.zeros), frag, w.group_k, None if bias is None else tensor_key(bias))


def replay_key(x2, w, bias, activation: str, kernel: str):
    """The replay key of a call, or None when the call may not be replayed (CPU, the interpreter, a tensor
    subclass, autograd or a tracer watching, a bias that is not a tensor on x's device)."""
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest
        return None
    if not plain_tensor(x2) or not x2.is_cuda or interpreting() or in_graph_tree():
        return None
    if bias is not None and (not plain_tensor(bias) or bias.device != x2.device):
        return None
    if w.qweight.device != x2.device or not plain_call(x2, bias, w.qweight, w.scales, w.zeros):
        return None
    return key_of(x2, w, bias, activation, kernel)


def lookup(key):
    """The replay recorded under ``key``, or None."""
    return _cache.get(key)


def call_tensors(x2, w, bias, out) -> tuple:
    """The tensors a replay takes, in the order :func:`store` recorded them (the fragment layout, when made)."""
    parts = (x2, w.qweight, w.scales, w.zeros) + tuple(w._frag or ())
    return parts + (out,) if bias is None else parts + (bias, out)


def store(key, launches, tensors, shape) -> None:
    _cache.store(key, launches, tensors, shape=shape)


def clear() -> None:
    """Forget every recorded replay."""
    _cache.clear()


def count() -> int:
    """How many calls' launches are recorded."""
    return len(_cache.entries)
