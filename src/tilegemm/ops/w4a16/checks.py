"""The argument checks of ``tilegemm.w4a16.matmul``: TypeError/ValueError naming the problem."""

from __future__ import annotations

import torch

from tilegemm.core import registry
from tilegemm.core.activations import check_activation
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.runtime import check_same_device
from tilegemm.ops.w4a16.format import FLOAT_DTYPES, Int4Weight, validate


def check_inputs(x, w, bias, activation, kernel) -> None:
    """Raise TypeError/ValueError naming the problem."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight (tilegemm.w4a16.quantize / from_gptq / from_awq), "
                        f"got {type(w).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {dtype_name(x.dtype)}; w4a16.matmul takes fp16 or bf16 activations")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {dtype_name(x.dtype)} but the weight's scales are {dtype_name(w.dtype)}: convert one "
                        f"(w.to({x.dtype}))")
    N, K = w.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K] with K = in_features = {K}, got {list(x.shape)}")
    validate(w)
    named = {"x": x, "w": w.qweight}
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        if bias.dtype not in FLOAT_DTYPES:
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected fp16 or bf16")
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"bias must have shape [N] = [{N}], got {list(bias.shape)}")
        named["bias"] = bias
    check_activation(activation)
    if kernel != "auto":
        spec = registry.get("w4a16", kernel)
        reason = spec.unavailable_reason()
        if reason:
            raise registry.NotApplicable(f"w4a16 kernel {kernel!r} cannot run here: {reason}")
    check_same_device(named)
