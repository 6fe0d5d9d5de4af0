"""``tilegemm.matmul``, the public function: the replay fast path, the checks, then the op or a direct launch."""

from __future__ import annotations

import torch

from tilegemm.core.dtypes import autocast_inputs
from tilegemm.core.launch import plain_call, recording_active
from tilegemm.core.runtime import any_negative, resolved
from tilegemm.core.torch_ops import shaped_as
from tilegemm.ops.matmul.problem import MatmulCall
from tilegemm.ops.matmul.checks import broadcast, check_inputs, output_shape, replay_key
from tilegemm.ops.matmul.dispatch import forward
from tilegemm.ops.matmul.op import REPLAYS, call_op


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    precision: str | None = None,
    kernel: str = "auto",
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``activation(alpha * scale_a * scale_b * (a @ b) + beta * c + bias)`` in one kernel, accumulated in fp32.

    Args:
        a: ``[..., M, K]``, fp16, bf16, fp32 or fp8 (``float8_e4m3fn``, ``float8_e5m2``), any strides
            (transposed and sliced views are read in place).
        b: ``[..., K, N]``, same dtype as ``a`` (the two fp8 dtypes may mix). Batch dims broadcast like
            ``torch.matmul``.
        bias: ``[N]``, added to every row; of the operands' dtype (bf16 for fp8 operands) or the output's.
        c: broadcasts to the output ``[..., M, N]``; scaled by ``beta``; of the operands' dtype (bf16 for fp8
            operands) or the output's, as the bias (a TypeError names any other).
        activation: ``None``/``"none"``, ``"relu"``, ``"gelu"`` (erf), ``"gelu_tanh"``, ``"silu"``,
            ``"leaky_relu"`` (slope 0.01).
        out_dtype: float16, bfloat16 or float32; by default the input dtype, bfloat16 for fp8 inputs.
        precision: for fp32 inputs, ``"ieee"``/``"highest"`` (IEEE-accurate) or ``"tf32"``/``"high"``/
            ``"medium"``; by default ``torch.get_float32_matmul_precision()``.
        kernel: a name from ``tilegemm.kernels("matmul")``; ``"auto"`` picks one per problem.
        scale_a, scale_b: fp8 dequantization scales, float32: one per tensor (shape ``[]`` or ``[1]``), or
            one per row of ``a`` (``[M]`` or ``[M, 1]``) and per column of ``b`` (``[N]`` or ``[1, N]``),
            shared by every batch. Only with fp8 inputs. fp8 products accumulate in fp32.
        fast_accum: fp8 only. By default the tensor cores' partial sums are added into an fp32
            accumulator every K step (like ``torch._scaled_mm``); True lets them accumulate all of K
            themselves, with fewer bits (like ``use_fast_accum=True``): faster on large products
            (docs/performance.md), less exact for long K.

    Like ``torch.matmul``, a 1-D ``a`` (``[K]``) is read as a row and a 1-D ``b`` as a column, and that dimension
    is dropped from the result; like ``torch.addmm``, ``c`` is not read when ``beta`` is 0 (NaN or inf in it do
    not reach the output; unlike addmm, ``c`` then gets no gradient rather than a zero one), and, as BLAS, ``a``
    and ``b`` are not read when ``alpha`` is 0 (their gradients are zero). Meta tensors give
    an empty meta result of the output's shape and dtype, launching nothing. Under ``torch.autocast`` the 16- and
    32-bit ``a``, ``b``, ``bias`` and ``c`` on the autocast device are cast to its dtype first, as autocast casts
    ``torch.matmul``'s and ``F.linear``'s (fp8 operands and float64 tensors are left as they are).

    Raises:
        TypeError, ValueError: naming the bad argument (shapes, dtypes, devices, unknown names).
    """
    if torch._C._is_any_autocast_enabled():
        a, b, bias, c = autocast_inputs(a, b, bias, c)
    if getattr(a, "ndim", 2) < 2 or getattr(b, "ndim", 2) < 2:
        return _with_vectors(a, b, bias=bias, c=c, alpha=alpha, beta=beta, activation=activation,
                             out_dtype=out_dtype, precision=precision, kernel=kernel, scale_a=scale_a,
                             scale_b=scale_b, fast_accum=fast_accum)
    # alpha = 0 reads neither operand, as BLAS (an inf in a or b leaves beta * c + bias finite): the product of no
    # inputs (K = 0) below; never replayed
    no_product = isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha == 0
    # (Inside another op's recording the launch must happen, to be recorded: no replay then.)
    plain = c is None and not recording_active() and not no_product
    key = replay_key(a, b, alpha, precision, kernel, out_dtype, scale_a, scale_b, fast_accum, bias,
                     activation) if plain else None
    if key is not None:
        # The tensors a replay takes: a, b, the fp8 scales and the bias where given (the output comes last).
        tensors = (a, b) if scale_a is None and scale_b is None else \
            (a, b, *(s for s in (scale_a, scale_b) if s is not None))
        if bias is not None:
            tensors += (bias,)
        out = REPLAYS.replayed(key, tensors)
        if out is not None:
            return out  # (None: nothing recorded, or recorded for another stream; launched afresh below)
    call = MatmulCall(a, b, bias, c, alpha, beta, "none" if activation is None else activation, out_dtype,
                      "default" if precision is None else precision, kernel, scale_a, scale_b, fast_accum)
    check_inputs(call)
    if no_product:
        call = call.without_product()
        a, b = call.a, call.b
    if any_negative(a, b, bias, c, scale_a, scale_b):  # (z.conj().imag: the kernels would read the values negated)
        a, b, bias, c, scale_a, scale_b = resolved(a, b, bias, c, scale_a, scale_b)  # (never keyed: see replay_key)
        call = call.replace(a=a, b=b, bias=bias, c=c, scale_a=scale_a, scale_b=scale_b)
    call = call.replace(alpha=float(alpha), beta=float(beta), c=None if beta == 0 else c)  # addmm: beta 0 skips c
    if not plain_call(a, b, bias, c, scale_a, scale_b):
        return call_op(call)
    if key is None:
        return forward(call)
    with REPLAYS.recording(key, tensors) as kept:
        return kept(forward(call))


def _with_vectors(a, b, c=None, **kw) -> torch.Tensor:
    """torch.matmul's rule for 1-D operands: ``a`` ``[K]`` is the row ``[1, K]``, ``b`` ``[K]`` the column
    ``[K, 1]``; the product of those runs, and the added dimension is dropped from the result."""
    for name, t in (("a", a), ("b", b)):  # (an ndarray has ndim too, but no unsqueeze)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul needs operands with at least 1 dim, got a.shape={tuple(a.shape)}, "
                         f"b.shape={tuple(b.shape)}")
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    full = output_shape(a2.shape, b2.shape)
    shape = full[:-2] + (() if a.ndim == 1 else full[-2:-1]) + (() if b.ndim == 1 else full[-1:])
    if a.ndim == 1 and b.ndim == 1 and kw.get("bias") is not None:
        shape = (1,)  # torch.matmul(a, b) + bias: the scalar broadcast against the bias's [1] (c is checked on it)
    if c is not None and isinstance(c, torch.Tensor):
        if broadcast(tuple(c.shape), shape) != shape:
            raise ValueError(f"c of shape {list(c.shape)} does not broadcast to the output shape {list(shape)}")
        if c.ndim >= 1 and b.ndim == 1:
            c = c.unsqueeze(-1)
        elif c.ndim >= 1 and a.ndim == 1:
            c = c.unsqueeze(-2)
    out = matmul(a2, b2, c=c, **kw)
    # a tensor of its own, as torch.matmul's (a squeezed view made under no_grad could not be written in place)
    return shaped_as(out, shape)

