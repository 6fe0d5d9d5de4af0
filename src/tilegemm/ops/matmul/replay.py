"""The host fast path of ``tilegemm.matmul``: replays of earlier plain calls.

A plain call (no ``c``; no tracer, dispatch mode or autograd watching; a bias and an activation are part of
the key) is keyed by everything Triton specializes a launch on; its launches are recorded the first time and
replayed on later calls with the same key, skipping the checks, the ``auto`` choice and Triton's launch
wrapper.

:func:`clear` and :func:`count` are the documented hooks to observe the cache (tests use them).
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import ReplayCache, plain_call, plain_tensor, tensor_key
from tilegemm.core.runtime import interpreting
from tilegemm.core.dtypes import resolve_precision

# Replays of earlier calls without c, keyed by everything Triton specializes a launch on.
_cache = ReplayCache()


def replay_key(a, b, alpha, precision, kernel, out_dtype=None, scale_a=None, scale_b=None, fast_accum=False,
               bias=None, activation=None):
    """The replay key of a call, or None when the call may not be replayed.

    Calls with scales (fp8) replay too: their shapes, strides, dtypes and alignment are in the key, and
    the call's scale tensors take the recorded ones' parameter slots. Which of a, b and the scales share
    a data pointer is in the key too (``x @ x.mT``; one scale tensor passed for both), so a call that
    aliases replays a launch recorded from a call that aliased the same way.
    """
    if not plain_tensor(a) or not plain_tensor(b) or not a.is_cuda or interpreting():
        return None
    if bias is not None:  # the bias: its layout in the key, its pointer among the aliases, a slot of its own
        if not plain_tensor(bias) or bias.device != a.device or bias.requires_grad and torch.is_grad_enabled():
            return None
    if activation is not None and type(activation) is not str:
        return None
    if a.device != b.device or type(alpha) not in (float, int):
        return None
    if scale_a is None and scale_b is None:  # the common case, kept short: host time is the point here
        if not plain_call(a, b):
            return None
        scale_keys = None
    else:
        scales = [s for s in (scale_a, scale_b) if s is not None]
        if any(not plain_tensor(s) or s.device != a.device for s in scales) or not plain_call(a, b, *scales):
            return None
        scale_keys = tuple(None if s is None else tensor_key(s) for s in (scale_a, scale_b))
    if fast_accum is not False and fast_accum is not True:
        return None
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        return None
    try:
        resolved = resolve_precision(precision, a.dtype)
    except ValueError:
        return None
    ptrs = [a.data_ptr(), b.data_ptr()]
    if scale_keys is not None:
        ptrs += [s.data_ptr() for s in (scale_a, scale_b) if s is not None]
    if bias is not None:
        ptrs.append(bias.data_ptr())
    aliases = tuple(ptrs.index(p) for p in ptrs)  # for each tensor, the first one sharing its data pointer
    return (kernel, alpha, resolved, out_dtype, fast_accum, a.dtype, b.dtype, a.shape, b.shape, a.stride(),
            b.stride(), a.device, ptrs[0] % 16 == 0, ptrs[1] % 16 == 0, aliases, scale_keys,
            None if bias is None else tensor_key(bias), activation)


def lookup(key):
    """The replay recorded under ``key``, or None."""
    return _cache.get(key)


def store(key, launches, tensors, shape) -> None:
    _cache.store(key, launches, tensors, shape=shape, aliases_in_key=True)


def clear() -> None:
    """Forget every recorded replay."""
    _cache.clear()


def count() -> int:
    """How many calls' launches are recorded."""
    return len(_cache.entries)
