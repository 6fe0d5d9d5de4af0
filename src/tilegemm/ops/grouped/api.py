"""The public functions of the grouped family: ``tilegemm.grouped_mm`` and the batched-product entry the dense
matmul can route 3-D operands to. Each takes the replay fast path first (keys in :mod:`.checks`), then the
checks, then the op or a plain call that is recorded for the next replay."""

from __future__ import annotations

import contextlib

import torch

from tilegemm.core.launch import plain_call
from tilegemm.core.runtime import any_negative, resolved
from tilegemm.ops.grouped.checks import (call_tensors, check_gated_call, check_grouped, check_int4_call,
                                         check_mm_call, gated_replay_key, int4_replay_key, replay_key)
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.routing import group_columns
from tilegemm.ops.matmul import matmul as dense_matmul
from tilegemm.ops.w4a16 import Int4Weight
from tilegemm.ops.grouped.op import (REPLAYS, forward, forward_gated, forward_int4, grouped_mm_gated_op,
                                     grouped_mm_op, grouped_w4a16_op)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               kernel: str = "auto") -> torch.Tensor:
    """A grouped matrix product with ``torch.nn.functional.grouped_mm``'s semantics.

    Layouts (G groups; ``offs`` int32 ``[G]``, the cumulative ends of the groups, on a's device):

    - a ``[M, K]``, b ``[G, K, N]``, offs: rows ``offs[g-1]:offs[g]`` of a times ``b[g]`` -> ``[M, N]`` (the MoE
      forward: tokens sorted by expert);
    - a ``[G, M, K]``, b ``[G, K, N]``, no offs: a batched product -> ``[G, M, N]``;
    - a ``[M, K]``, b ``[K, N]``, offs splits K: ``a[:, Kg] @ b[Kg]`` -> ``[G, M, N]`` (the weight gradient);
    - a ``[G, M, K]``, b ``[K, N]``, offs splits b's columns: ``a[g] @ b[:, Ng]`` -> ``[M, N]``.

    Rows (columns for 3-D x 2-D) past ``offs[-1]`` are zero; empty groups are allowed. Operands are read in place
    through their strides (b row- or column-major). fp16, bf16, fp32 (tf32 where
    ``torch.get_float32_matmul_precision()`` allows it), accumulated in fp32.

    Args:
        bias: ``[N]`` (added to every group's rows) or ``[G, N]`` (one row per group; ``[N]`` only for 3-D x 2-D),
            of the operands' dtype or the output's. torch's own grouped_mm takes no bias yet; tilegemm adds it in
            the epilogue.
        out_dtype: None (a's dtype) or fp32.
        kernel: ``"auto"`` or a name from ``tilegemm.kernels("grouped")``.

    Differentiable in a, b and bias. ``offs`` stays on the device: nothing on the call's path reads it on the host
    (so a CUDA graph captures the call and replays it with other group sizes); its values are checked only when it
    is on the CPU.

    Raises:
        TypeError, ValueError: naming the bad argument (dtypes, shapes, offs, devices).
    """
    # The fast path: a replay of an earlier plain call with the same key, with this call's tensors (offs' values
    # are read on the device only, so new group sizes replay too).
    key = replay_key(a, b, offs, bias, out_dtype, kernel)
    if key is not None:
        tensors = call_tensors(a, b, offs, bias)
        out = REPLAYS.replayed(key, tensors)
        if out is not None:
            return out  # (None: nothing recorded, or recorded for another stream or device; launched afresh below)
    check_mm_call(a, b, offs, bias, out_dtype, kernel)
    if any_negative(a, b, bias):  # (z.conj().imag: the kernels would read the values negated; never keyed)
        a, b, bias = resolved(a, b, bias)
    precision = "default"
    if not plain_call(a, b, offs, bias):
        return grouped_mm_op(a, b, offs, bias, out_dtype, precision, kernel)
    if key is None:
        return forward(a, b, offs, bias, out_dtype, precision, kernel)
    with REPLAYS.recording(key, tensors) as kept:
        return kept(forward(a, b, offs, bias, out_dtype, precision, kernel))


@contextlib.contextmanager
def _checks_named(call: str, names: str):
    """The shared checks' TypeError / ValueError, which speak of grouped_mm's ``a`` and ``b``, said of ``call``."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if type(err) not in (TypeError, ValueError):  # (subclasses keep their own form)
            raise
        raise type(err)(f"{call} ({names}): {err}") from None


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` of two 3-D operands of one batch size, one launch with the operands read in place
    through their strides; differentiable. fp16/bf16 operands run on ``tilegemm.matmul``'s ``auto``, which
    takes batched 16-bit products to ``persistent_tma`` on Hopper where the batches' tiles fill the GPU (or to
    ``gluon_f16``'s batched launch with ``dispatch.GLUON_F16_BATCHED`` on; docs/rungs/auto.md); other dtypes on
    this family's ``tiled`` kernel (the batch on a grid axis)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 3 or b.dim() != 3:
        raise ValueError("batched_matmul takes two 3-D tensors [B, M, K] and [B, K, N]")
    with _checks_named("batched_matmul", "a [B, M, K] and b [B, K, N], on grouped_mm's checks"):
        check_grouped(a, b, None, None, None)  # the same errors as grouped_mm's (one batch size, K, dtypes, devices)
    if a.dtype in (torch.float16, torch.bfloat16) and b.dtype == a.dtype:
        return dense_matmul(a, b)
    return grouped_mm(a, b)


def grouped_matmul(x: torch.Tensor, w, offs: torch.Tensor, bias: torch.Tensor | None = None,
                   activation: str | None = None, *, kernel: str = "auto") -> torch.Tensor:
    """4-bit experts: ``activation(x[rows of g] @ dequantize(w)[g].T + bias[g])`` for each expert g.

    Args:
        x: ``[M, K]``, fp16 or bf16 (the weight's scales' dtype), rows sorted by expert.
        w: an ``Int4Weight`` of stacked experts ``[E, N, K]`` (``tilegemm.w4a16.quantize`` of a 3-D weight).
        offs: int32 ``[E]``, the cumulative ends of each expert's rows (on x's device; rows past ``offs[-1]``
            come out zero).
        bias: ``[N]`` or ``[E, N]``, of x's dtype.
        activation: None/``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"leaky_relu"``.

    Returns ``[M, N]`` in x's dtype. Differentiable in x and bias (the weight is frozen).
    """
    activation = "none" if activation is None else activation
    return _int4(x, w, offs, bias, activation, False, kernel)


def moe_gate_up_int4(x: torch.Tensor, w, offs: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str = "silu") -> torch.Tensor:
    """4-bit experts' gate/up product with the activation and the gate fused: ``activation(gate) * up`` where
    ``[gate | up] = x[rows of g] @ dequantize(w)[g].T (+ bias[g])``, w stacked ``[E, 2I, K]`` (gate rows first),
    bias ``[E, 2I]`` or ``[2I]``. Returns ``[M, I]``; differentiable in x and bias. ``activation=None`` is
    ``"none"`` (``gate * up``)."""
    activation = "none" if activation is None else activation  # (the op's schema takes a str on every path)
    return _int4(x, w, offs, bias, activation, True, "auto")


def _int4(x, w, offs, bias, activation: str, gated: bool, kernel: str) -> torch.Tensor:
    """The 4-bit experts' call: a replay, or the checks and the op or a recorded plain call. Where kernel ``frag``
    runs, or ``auto`` may pick it, the stacked fragment layout is made (once: the weight keeps it) before the key,
    which holds its layouts, and travels with the call."""
    frag = None
    if type(w) is Int4Weight and len(w.shape) == 3 and isinstance(x, torch.Tensor) and x.dim() == 2 \
            and type(kernel) is str and dispatch.wants_frag(kernel, x, w, gated):
        frag = w.fragments(gated)
    key = int4_replay_key(x, w, offs, bias, activation, gated, kernel, frag)
    if key is not None:
        tensors = call_tensors(x, w.qweight, w.scales, w.zeros, offs, bias, *(frag or ()))
        out = REPLAYS.replayed(key, tensors)
        if out is not None:
            return out
    check_int4_call(x, w, offs, bias, activation, gated, kernel)
    if any_negative(x, bias):  # (as grouped_mm's)
        x, bias = resolved(x, bias)
    if w.perm is not None:  # act-order experts: each expert's rows read through its input order first
        x = group_columns(x, offs, w.perm)
    args = (x, w.qweight, w.scales, w.zeros, offs, bias, w.group_k, activation, gated, kernel, *(frag or (None, None)))
    if not plain_call(x, offs, bias):
        return grouped_w4a16_op(*args)
    if key is None:
        return forward_int4(*args)
    with REPLAYS.recording(key, tensors) as kept:
        return kept(forward_int4(*args))


def moe_gate_up(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str = "silu") -> torch.Tensor:
    """A MoE block's gate/up product with the activation and the gate fused: ``activation(gate) * up`` where
    ``[gate | up] = x[rows of g] @ w[g] (+ bias[g])``, w ``[E, K, 2I]`` (gate columns first; any strides: a
    transformers ``gate_up_proj`` ``[E, 2I, K]`` passes as ``.transpose(1, 2)``), bias ``[E, 2I]`` or ``[2I]``.
    Returns ``[M, I]``; differentiable in x, w and bias. ``activation=None`` is ``"none"`` (``gate * up``)."""
    activation = "none" if activation is None else activation  # (the op's schema takes a str on every path)
    key = gated_replay_key(x, w, offs, bias, activation)
    if key is not None:
        tensors = call_tensors(x, w, offs, bias)
        out = REPLAYS.replayed(key, tensors)
        if out is not None:
            return out
    with _checks_named("moe_gate_up", "x [M, K] and w [E, K, 2I] as a and b"):
        check_gated_call(x, w, offs, bias, activation)
    if any_negative(x, w, bias):  # (as grouped_mm's)
        x, w, bias = resolved(x, w, bias)
    if not plain_call(x, w, offs, bias):
        return grouped_mm_gated_op(x, w, offs, bias, activation, "default")
    if key is None:
        return forward_gated(x, w, offs, bias, activation, "default")
    with REPLAYS.recording(key, tensors) as kept:
        return kept(forward_gated(x, w, offs, bias, activation, "default"))
