"""The host fast path of ``tilegemm.matmul``: replays of earlier plain calls.

A plain call (no ``c``; no tracer, dispatch mode or autograd watching; a bias and an activation are part of
the key) is keyed by everything Triton specializes a launch on; its launches are recorded the first time and
replayed on later calls with the same key, skipping the checks, the ``auto`` choice and Triton's launch
wrapper.

:func:`clear` and :func:`count` are the documented hooks to observe the cache (tests use them).
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import (PLAIN_TENSOR_TYPES, ReplayCache, dispatch_stack_depth, function_mode_on, plain_call,
                                  plain_tensor, recording, tensor_key)
from tilegemm.core.runtime import interpreting, new_output
from tilegemm.ops.matmul.call import default_out_dtype
from tilegemm.core.dtypes import resolve_precision
from tilegemm.core.workspace import in_graph_tree

# Replays of earlier calls without c, keyed by everything Triton specializes a launch on.
_cache = ReplayCache()


def replay_key(a, b, alpha, precision, kernel, out_dtype=None, scale_a=None, scale_b=None, fast_accum=False,
               bias=None, activation=None):
    """The replay key of a call, or None when the call may not be replayed.

    Calls with scales (fp8) replay too: their shapes, strides, dtypes and alignment are in the key, and
    the call's scale tensors take the recorded ones' parameter slots. Which of a, b and the scales share
    a data pointer is in the key too (``x @ x.mT``; one scale tensor passed for both), so a call that
    aliases replays a launch recorded from a call that aliased the same way.

    Written for host time (about 2 us on the H200's host for a plain 16-bit call): both devices are in the key
    rather than compared (a call whose operands are on two devices is refused on the full path, so it is
    never recorded), and the plain-call test of :func:`plain_call` is spelled out for the two operands.
    """
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest
        return None
    if type(a) not in PLAIN_TENSOR_TYPES or type(b) not in PLAIN_TENSOR_TYPES or not a.is_cuda or interpreting():
        return None
    if dispatch_stack_depth() or function_mode_on() or in_graph_tree():
        return None
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return None
    if bias is not None:  # the bias: its layout in the key, its pointer among the aliases, a slot of its own
        if not plain_tensor(bias) or bias.requires_grad and torch.is_grad_enabled():
            return None
    if activation is not None and type(activation) is not str:
        return None
    if type(alpha) not in (float, int):
        return None
    pa, pb = a.data_ptr(), b.data_ptr()
    if scale_a is None and scale_b is None:  # the common case, kept short: host time is the point here
        scale_keys = None
        if bias is None:
            aliases = (0, 0 if pb == pa else 1)
    else:
        scales = [s for s in (scale_a, scale_b) if s is not None]
        if any(not plain_tensor(s) or s.device != a.device for s in scales) or not plain_call(*scales):
            return None
        scale_keys = tuple(None if s is None else tensor_key(s) for s in (scale_a, scale_b))
    if fast_accum is not False and fast_accum is not True:
        return None
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        return None
    dtype = a.dtype
    if (precision is None or precision == "default") and dtype is not torch.float32:
        resolved = "ieee"  # what resolve_precision answers for 16-bit and fp8 operands
    else:
        try:
            resolved = resolve_precision(precision, dtype)
        except ValueError:
            return None
    if scale_keys is not None or bias is not None:
        ptrs = [pa, pb]
        if scale_keys is not None:
            ptrs += [s.data_ptr() for s in (scale_a, scale_b) if s is not None]
        if bias is not None:
            ptrs.append(bias.data_ptr())
        aliases = tuple(ptrs.index(p) for p in ptrs)  # for each tensor, the first one sharing its data pointer
    return (kernel, alpha, resolved, out_dtype, fast_accum, dtype, b.dtype, a.shape, b.shape, a.stride(),
            b.stride(), a.device, b.device, pa % 16 == 0, pb % 16 == 0, aliases, scale_keys,
            None if bias is None else tensor_key(bias), activation)


def lookup(key):
    """The replay recorded under ``key``, or None."""
    return _cache.get(key)


def store(key, launches, tensors, shape) -> None:
    _cache.store(key, launches, tensors, shape=shape, aliases_in_key=True)


def replayed(key, a, b, extra: tuple, out_dtype):
    """The output of a replay of the call recorded under ``key`` with ``a``, ``b`` and ``extra`` (the fp8
    scales given, then the bias), or None: none recorded, or it declined (recorded for another stream)."""
    hit = _cache.get(key)
    if hit is None:
        return None
    out = new_output(hit.shape, out_dtype or default_out_dtype(a.dtype), a.device)
    return out if hit(a, b, out, *extra) else None


def recorded(key, a, b, extra: tuple, run):
    """``run()``'s output, its launches kept under ``key`` for later calls (:func:`replayed`)."""
    with recording() as rec:
        out = run()
    store(key, rec.launches, (a, b, out, *extra), shape=out.shape)
    return out


def clear() -> None:
    """Forget every recorded replay."""
    _cache.clear()


def count() -> int:
    """How many calls' launches are recorded."""
    return len(_cache.entries)
