"""The host fast path of ``tilegemm.conv2d`` and of its gradients: replays of earlier plain calls.

A call's Python path (checks, geometry, config, layout of the operands, Triton's launch wrapper) cost 100-300
us of host time on the H200's host, more than most of ResNet-50's layers take on the GPU
(benchmarks/results/2026-11-23-h200/61a6669/). A plain call (CUDA, no tracer, dispatch mode or autograd
watching; tensors or ``nn.Parameter``s) is keyed by everything its launch depends on: the layouts of x, the weight and the bias (dtype,
shape, strides, device, 16-byte alignment), the geometry, the activation, the precision and the kernel asked
for. The first call records its launches; when they are up to eight Triton launches whose tensors are the
call's own (no layout copy made on the way, no torch op after it) or the launchers' workspaces (kept with the
replay, which then runs only on the stream it was recorded on), later calls with the same key replay them with
their own tensors. Anything else (a weight torch had to copy channels-last: one neither NCHW nor channels-last;
a GEMM that made its own output) is simply not kept, and such calls take the full path every time. Inside another op's
recording nothing replays (the launch must happen to be recorded).

:func:`clear` and :func:`count` are the documented hooks to observe the cache (tests use them).
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import (PLAIN_TENSOR_TYPES, ReplayCache, dispatch_stack_depth, function_mode_on, recording,
                                  recording_active, tensor_key)
from tilegemm.core.runtime import interpreting
from tilegemm.core.workspace import in_graph_tree

_cache = ReplayCache()


def replay_key(part: str, x: torch.Tensor, weight: torch.Tensor, bias, conv: tuple, *options):
    """The key of a call, or None when it may not be replayed. ``part``: ``"fwd"`` or ``"dgrad"``; ``x`` is the
    activation the kernel reads (dy for the data gradient); ``conv``: (stride, padding, dilation, groups) as
    lists; ``options``: whatever else selects the launch (activation, precision, kernel, output layout).

    Written for host time, as matmul's: the tests of :func:`plain_call` spelled out, and the devices in the key
    rather than compared (a call on two devices is refused on the full path, so it is never recorded)."""
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest (guards on thread state)
        return None
    if type(x) not in PLAIN_TENSOR_TYPES or type(weight) not in PLAIN_TENSOR_TYPES or not x.is_cuda:
        return None
    if interpreting() or recording_active() or dispatch_stack_depth() or function_mode_on() or in_graph_tree():
        return None
    if bias is not None and type(bias) not in PLAIN_TENSOR_TYPES:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or bias is not None and bias.requires_grad):
        return None
    return key_of(part, x, weight, bias, conv, *options)


_OPTION_TYPES = (str, int, bool, tuple, type(None))


def key_of(part: str, x: torch.Tensor, weight: torch.Tensor, bias, conv: tuple, *options):
    """The key itself (see :func:`replay_key`), or None if an argument cannot be part of one."""
    geometry = []
    for c in conv:  # ints, strings ("same") and sequences of ints, as the public function takes them
        t = type(c)
        if t is list or t is tuple:
            for v in c:
                if type(v) is not int:
                    return None  # something the checks will reject, naming it, on the full path
            c = tuple(c)
        elif t is not int and t is not str:
            return None
        geometry.append(c)
    for o in options:
        if type(o) not in _OPTION_TYPES:
            return None
    precision = torch.get_float32_matmul_precision() if x.dtype == torch.float32 else None
    return (part, tensor_key(x), tensor_key(weight), None if bias is None else tensor_key(bias), tuple(geometry),
            precision, options)


def replayed(key, tensors: tuple):
    """The output of a replay of the call recorded under ``key`` with ``tensors`` (the call's inputs), or None
    when there is none (or it declined: another stream or device)."""
    hit = _cache.get(key)
    if hit is None:
        return None
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    shape, fmt, dtype = hit.shape
    x = tensors[0]
    out = empty_4d(shape, dtype, x.device, fmt)
    return out if hit(*tensors, out) else None


def record(key, run, tensors: tuple, out_format) -> torch.Tensor:
    """``run()``, its launches kept under ``key`` when they can be replayed with ``tensors`` and the output."""
    with recording() as rec:
        out = run()
    # The replay allocates its output like empty_4d; a result laid out otherwise is not kept.
    if out.dim() == 4 and out.is_contiguous(memory_format=out_format):
        _cache.store(key, rec.launches, (*tensors, out), shape=(tuple(out.shape), out_format, out.dtype))
    return out



def replay_or_record(key, tensors: tuple, out_format, run) -> torch.Tensor:
    """The call's output: a replay of the launch recorded under ``key`` with ``tensors``, else ``run()``,
    recorded (:func:`record`); with no key (not a plain call), just ``run()``."""
    if key is None:
        return run()
    out = replayed(key, tensors)
    return out if out is not None else record(key, run, tensors, out_format)


def clear() -> None:
    """Forget every recorded replay."""
    _cache.clear()


def count() -> int:
    """How many calls' launches are recorded."""
    return len(_cache.entries)
