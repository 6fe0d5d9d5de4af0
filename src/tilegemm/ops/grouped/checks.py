"""Argument checks of ``tilegemm.grouped_mm`` and ``tilegemm.w4a16.grouped_matmul``: TypeError/ValueError naming
the problem.

Checks that need the values of ``offs`` (non-decreasing, within the grouped dimension) are made only where
``offs`` is on the CPU (under the interpreter) and nothing traces the call: on the GPU reading them would stall
the host on the device and break CUDA-graph capture. A kernel clamps every group to the operand's bounds, so
bad values there give wrong numbers, never a fault.
"""

from __future__ import annotations

import torch

from tilegemm.core.activations import check_activation
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.runtime import check_same_device
from tilegemm.ops.w4a16 import Int4Weight, validate

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_offs(offs, groups: int | None, grouped_dim: str, extent: int) -> None:
    """``offs``: int32, 1-D, ``groups`` long (None: any length), the cumulative ends of groups along a
    dimension of ``extent`` (the value checks only where they cost no device sync)."""
    _tensor("offs", offs)
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32 (the cumulative ends of the groups), got {dtype_name(offs.dtype)}")
    if offs.dim() != 1:
        raise ValueError(f"offs must be 1-D [G], got shape {list(offs.shape)}")
    if groups is not None and offs.shape[0] != groups:
        raise ValueError(f"offs has {offs.shape[0]} entries but there are {groups} groups ({grouped_dim})")
    if offs.device.type == "cpu" and offs.numel() and not torch.compiler.is_compiling() \
            and type(offs) in (torch.Tensor, torch.nn.Parameter):
        v = offs.to(torch.int64)
        if int(v[0]) < 0:
            raise ValueError(f"offs[0] = {int(v[0])} is negative")
        if offs.numel() > 1 and bool((v[1:] < v[:-1]).any()):
            raise ValueError(f"offs must be non-decreasing (cumulative ends of the groups), got {offs.tolist()}")
        if int(v[-1]) > extent:
            raise ValueError(f"offs[-1] = {int(v[-1])} is past the end of the grouped dimension ({grouped_dim} = "
                             f"{extent})")


def check_grouped(a, b, offs, bias, out_dtype) -> tuple[str, int]:
    """Check a ``grouped_mm`` call; return its layout (``"2d3d"``, ...) and number of groups."""
    _tensor("a", a)
    _tensor("b", b)
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(t.dtype)}; grouped_mm takes fp16, bf16 or fp32")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got a {dtype_name(a.dtype)} and b {dtype_name(b.dtype)}")
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
        if out_dtype not in (a.dtype, torch.float32):
            raise TypeError(f"out_dtype must be the operands' dtype ({dtype_name(a.dtype)}) or fp32, got "
                            f"{dtype_name(out_dtype)}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"a and b must be 2-D or 3-D, got a {list(a.shape)} and b {list(b.shape)}")
    layout = f"{a.dim()}d{b.dim()}d"
    named = {"a": a, "b": b}
    if layout == "3d3d":
        if offs is not None:
            raise ValueError("offs must be None when a and b are both 3-D (a batched product: one group per batch)")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"a and b have different numbers of groups: a {list(a.shape)}, b {list(b.shape)}")
        if a.shape[2] != b.shape[1]:
            raise ValueError(f"K mismatch: a is [G, M, K] = {list(a.shape)}, b is [G, K, N] = {list(b.shape)}")
        groups = a.shape[0]
    else:
        if offs is None:
            what = {"2d3d": "a's rows", "2d2d": "K", "3d2d": "b's columns"}[layout]
            raise ValueError(f"offs is required for a {a.dim()}-D a and a {b.dim()}-D b: it splits {what} into "
                             f"groups (int32 cumulative ends)")
        if layout == "2d3d":
            if a.shape[1] != b.shape[1]:
                raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)}, b is [G, K, N] = {list(b.shape)}")
            groups = b.shape[0]
            check_offs(offs, groups, "b.shape[0]; offs splits a's rows", a.shape[0])
        elif layout == "2d2d":
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)}, b is [K, N] = {list(b.shape)}")
            check_offs(offs, None, "offs splits K", a.shape[1])
            groups = offs.shape[0]
        else:
            if a.shape[2] != b.shape[0]:
                raise ValueError(f"K mismatch: a is [G, M, K] = {list(a.shape)}, b is [K, N] = {list(b.shape)}")
            groups = a.shape[0]
            check_offs(offs, groups, "a.shape[0]; offs splits b's columns", b.shape[1])
        named["offs"] = offs
    if bias is not None:
        _tensor("bias", bias)
        if bias.dtype not in (a.dtype, out_dtype or a.dtype):
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected {dtype_name(a.dtype)}")
        N = b.shape[-1]
        shapes = [(N,)] if layout == "3d2d" else [(N,), (groups, N)]
        if tuple(bias.shape) not in shapes:
            raise ValueError(f"bias must have shape {' or '.join(str(list(s)) for s in shapes)}, got "
                             f"{list(bias.shape)}")
        named["bias"] = bias
    check_same_device(named)
    return layout, groups


def check_grouped_int4(x, w, offs, bias, activation, gated: bool = False) -> None:
    """Check a ``w4a16.grouped_matmul`` call (w: an ``Int4Weight`` of stacked experts ``[E, N, K]``)."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight of stacked experts (tilegemm.w4a16.quantize of an [E, N, K] "
                        f"weight), got {type(w).__name__}")
    if len(w.shape) != 3:
        raise ValueError(f"w must hold stacked experts [E, N, K]; this Int4Weight is {list(w.shape)} (quantize "
                         f"the 3-D weight)")
    validate(w)
    _tensor("x", x)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x has dtype {dtype_name(x.dtype)}; grouped_matmul takes fp16 or bf16 activations")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {dtype_name(x.dtype)} but the weight's scales are {dtype_name(w.dtype)}: convert one "
                        f"(w.to({x.dtype}))")
    E, N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, K] with K = {K} (the experts' in_features), got {list(x.shape)}")
    if offs is None:
        raise ValueError("offs is required: the int32 cumulative ends of each expert's rows of x")
    check_offs(offs, E, "the experts: w.shape[0]; offs splits x's rows", x.shape[0])
    named = {"x": x, "w": w.qweight, "offs": offs}
    if bias is not None:
        _tensor("bias", bias)
        if bias.dtype != x.dtype:
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected {dtype_name(x.dtype)}")
        if tuple(bias.shape) not in ((N,), (E, N)):
            raise ValueError(f"bias must have shape [{N}] or [{E}, {N}], got {list(bias.shape)}")
        named["bias"] = bias
    if gated and N % 2:
        raise ValueError(f"a gated product needs an even number of weight rows (gate, then up), got {N}")
    check_activation(activation)
    check_same_device(named)
