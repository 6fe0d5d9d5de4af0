"""Checks of ``tilegemm.matmul``'s arguments: each bad input raises TypeError/ValueError naming the problem."""

from __future__ import annotations

import numbers

import torch

from tilegemm.core import registry
from tilegemm.core.activations import ACTIVATIONS, check_activation
from tilegemm.core.dtypes import check_precision, dtype_name, resolve_precision  # noqa: F401 (re-exported)
from tilegemm.core.launch import (PLAIN_TENSOR_TYPES, dispatch_stack_depth, forward_ad_on, function_mode_on,
                                  jit_tracing, plain_call, plain_tensor, tensor_key)
from tilegemm.core.runtime import check_dense, check_same_device, interpreting
from tilegemm.core.workspace import in_graph_tree
from tilegemm.ops.matmul.problem import DTYPES, FP8_DTYPES, INPUT_DTYPES, MatmulCall

def _check_float(name: str, t: torch.Tensor, allowed=DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)
    if t.dtype not in allowed:
        kind = "unsupported" if t.dtype.is_floating_point or t.dtype.is_complex else \
            "boolean" if t.dtype == torch.bool else "integer"
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name} has {kind} dtype {dtype_name(t.dtype)}; tilegemm.matmul supports {names} here")


def _check_addend_dtype(name: str, t_dtype: torch.dtype, dtype: torch.dtype, fp8: bool, out_dtype) -> None:
    """Refuse a bias or c (``name``) that is neither of the operands' dtype (bf16 for fp8 operands) nor of the
    output's, naming its dtype and those (as torch.addmm refuses an addend of another dtype than its matrices')."""
    own = torch.bfloat16 if fp8 else dtype  # fp8 operands: bf16, the dtype of their default output
    out = out_dtype or own
    if t_dtype is own or t_dtype is out:
        return
    expected = "bf16 (for fp8 operands)" if fp8 else f"the operands' {dtype_name(own)}"
    also = "" if out is own else f" or the output's, {dtype_name(out)}"
    raise TypeError(f"{name} has dtype {dtype_name(t_dtype)}; expected {expected}{also}")


def _type_name(value) -> str:
    """``value``'s type, with its module where that is not Python's own (numpy's bool is also called bool)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def broadcast(x, y) -> tuple[int, ...] | None:
    """torch's broadcasting of two shapes, or None where they clash (plain Python: this is on the hot path)."""
    if len(x) < len(y):
        x, y = y, x
    lead = len(x) - len(y)
    out = list(x[:lead])
    for p, q in zip(x[lead:], y):
        if p == q or q == 1:
            out.append(p)
        elif p == 1:
            out.append(q)
        else:
            return None
    return tuple(out)


def output_shape(a_shape, b_shape) -> tuple[int, ...]:
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(
            f"matmul needs operands with at least 2 dims, got a.shape={tuple(a_shape)}, b.shape={tuple(b_shape)}"
        )
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(
            f"inner dimensions differ: a.shape={tuple(a_shape)} has K={a_shape[-1]}, "
            f"b.shape={tuple(b_shape)} has K={b_shape[-2]}"
        )
    batch = broadcast(a_shape[:-2], b_shape[:-2])
    if batch is None:
        raise ValueError(f"batch dimensions do not broadcast: a.shape={tuple(a_shape)}, b.shape={tuple(b_shape)}")
    return (*batch, a_shape[-2], b_shape[-1])


def _check_scale(name: str, scale, dim_name: str, vector_shapes) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    check_dense(name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {dtype_name(scale.dtype)}")
    if scale.dim() <= 2 and scale.numel() == 1:
        return  # one scale for the whole operand
    if tuple(scale.shape) not in vector_shapes:
        shapes = " or ".join(str(list(s)) for s in vector_shapes)
        raise ValueError(
            f"{name} must hold one scale (shape [] or [1]) or one per {dim_name} (shape {shapes}), "
            f"got {list(scale.shape)}"
        )


def refuse_fp8_gradients(fp8: bool, a: bool, b: bool, scale_a: bool, scale_b: bool) -> None:
    """Raise TypeError where a gradient is asked (each flag: that input wants one) that fp8 matmul has not: of an
    fp8 operand, or of a scale (refused, not left as None)."""
    if fp8 and (a or b):
        raise TypeError("fp8 matmul has no backward; call it under torch.no_grad() or detach the inputs")
    for name, wanted in (("scale_a", scale_a), ("scale_b", scale_b)):
        if wanted:
            raise TypeError(f"fp8 matmul has no gradient for {name}; detach it or call under torch.no_grad()")


def check_inputs(call: MatmulCall) -> tuple[int, ...]:
    """Raise TypeError/ValueError naming the problem; return the output shape."""
    a, b, bias, c, alpha, beta = call.a, call.b, call.bias, call.c, call.alpha, call.beta
    activation, out_dtype, precision, kernel = call.activation, call.out_dtype, call.precision, call.kernel
    scale_a, scale_b, fast_accum = call.scale_a, call.scale_b, call.fast_accum
    _check_float("a", a, INPUT_DTYPES)
    _check_float("b", b, INPUT_DTYPES)
    fp8 = a.dtype in FP8_DTYPES
    if a.dtype != b.dtype and not (fp8 and b.dtype in FP8_DTYPES):
        raise TypeError(f"dtypes differ: a is {dtype_name(a.dtype)}, b is {dtype_name(b.dtype)} "
                        "(only fp8_e4m3 and fp8_e5m2 mix)")
    shape = output_shape(a.shape, b.shape)
    named = {"a": a, "b": b}
    for name, scale, dim_name, vector_shapes in (
        ("scale_a", scale_a, "row of a", ((shape[-2],), (shape[-2], 1))),
        ("scale_b", scale_b, "column of b", ((shape[-1],), (1, shape[-1]))),
    ):
        if scale is None:
            continue
        if not fp8:
            raise ValueError(f"{name} applies to fp8 inputs only; a is {dtype_name(a.dtype)}")
        _check_scale(name, scale, dim_name, vector_shapes)
        named[name] = scale
    if not isinstance(fast_accum, bool):
        raise TypeError(f"fast_accum must be a bool, got {_type_name(fast_accum)}")
    if fast_accum and not fp8:
        raise ValueError(f"fast_accum applies to fp8 inputs only; a is {dtype_name(a.dtype)}")
    if fp8 and torch.is_grad_enabled():  # (scales come with fp8 operands only: refused above otherwise)
        refuse_fp8_gradients(fp8, a.requires_grad, b.requires_grad,
                             *(isinstance(s, torch.Tensor) and s.requires_grad for s in (scale_a, scale_b)))
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):  # ("fp16" is a name, not a dtype)
        raise TypeError(f"out_dtype must be a torch.dtype (torch.float16, torch.bfloat16 or torch.float32) or None, "
                        f"got {type(out_dtype).__name__} {out_dtype!r}")
    if out_dtype is not None and out_dtype not in DTYPES:  # (before the bias, whose accepted dtypes it names)
        raise TypeError(f"out_dtype {dtype_name(out_dtype)} is not supported; choose one of: fp16, bf16, fp32")
    if bias is not None:
        _check_float("bias", bias)
        if bias.dim() != 1 or bias.shape[0] != shape[-1]:
            raise ValueError(f"bias must have shape [N] = [{shape[-1]}], got {list(bias.shape)}")
        _check_addend_dtype("bias", bias.dtype, a.dtype, fp8, out_dtype)
        named["bias"] = bias
    if c is not None:
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"c must be a torch.Tensor, got {type(c).__name__}")
        check_dense("c", c)
        if broadcast(tuple(c.shape), shape) != shape:
            raise ValueError(f"c of shape {list(c.shape)} does not broadcast to the output shape {list(shape)}")
        _check_addend_dtype("c", c.dtype, a.dtype, fp8, out_dtype)  # (c is the output's addend, as the bias)
        named["c"] = c
    for name, value in (("alpha", alpha), ("beta", beta)):
        if type(value) is not float:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
            try:
                float(value)
            except OverflowError:  # (an int past float's range: float() would raise naming neither)
                raise ValueError(f"{name} is too large to be a float (the epilogue scales in float32)") from None
    if activation not in ACTIVATIONS:  # (the check's module entered only for a bad name: the call's route stays short)
        check_activation(activation)
    if fp8 and a.device.type == "cuda" and not interpreting():
        cc = torch.cuda.get_device_capability(a.device)
        if cc < (8, 9):
            raise ValueError(f"fp8 matmul needs a GPU of compute capability 8.9 or newer; {a.device} is "
                             f"{cc[0]}.{cc[1]}")
    if precision is not None and precision != "default":
        check_precision(precision)
    if kernel != "auto":
        spec = registry.get("matmul", kernel)
        reason = spec.unavailable_reason()
        if reason:
            raise registry.NotApplicable(f"matmul kernel {kernel!r} cannot run here: {reason}")
    check_same_device(named)
    return shape


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
    if dispatch_stack_depth() or function_mode_on() or in_graph_tree() or jit_tracing() or forward_ad_on():
        return None
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return None
    if a.is_neg() or b.is_neg():  # a negative view (z.conj().imag): the full path resolves it, a replay would not
        return None
    if bias is not None:  # the bias: its layout in the key, its pointer among the aliases, a slot of its own
        if not plain_tensor(bias) or bias.requires_grad and torch.is_grad_enabled() or bias.is_neg():
            return None
    if activation is not None and type(activation) is not str:
        return None
    if type(alpha) not in (float, int):
        return None
    try:
        pa, pb, sa, sb = a.data_ptr(), b.data_ptr(), a.stride(), b.stride()
        if scale_a is None and scale_b is None:  # the common case, kept short: host time is the point here
            scale_keys = None
            if bias is None:
                aliases = (0, 0 if pb == pa else 1)
        else:
            scales = [s for s in (scale_a, scale_b) if s is not None]
            if any(not plain_tensor(s) or s.device != a.device or s.is_neg() for s in scales) \
                    or not plain_call(*scales):
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
        return (kernel, alpha, resolved, out_dtype, fast_accum, dtype, b.dtype, a.shape, b.shape, sa, sb, a.device,
                b.device, pa % 16 == 0, pb % 16 == 0, aliases, scale_keys, None if bias is None else tensor_key(bias),
                activation)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None
