"""One vocabulary of dtype names, used in errors, the bench, tuning keys and the peaks table.

``fp16``, ``bf16``, ``fp32``, ``tf32`` (fp32 operands through the tensor cores), ``fp8_e4m3``, ``fp8_e5m2``;
other torch dtypes keep torch's own name (``int32``, ``uint8``, ``float64``).
"""

from __future__ import annotations

import torch

NAMES: dict[torch.dtype, str] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
TF32 = "tf32"
# Names of tilegemm-tuned/1 files (torch's names) and what they are now.
_OLD_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
              "float8_e5m2": "fp8_e5m2"}


def dtype_name(dtype) -> str:
    """``fp16`` for ``torch.float16`` etc.; a string passes through (``"tf32"``)."""
    if isinstance(dtype, str):
        return dtype
    return NAMES.get(dtype) or str(dtype).replace("torch.", "")


def rename_old(name: str) -> str:
    """A dtype label of the first tuning-file schema (``float16``, ``float8_e4m3fnxfloat8_e5m2+fast``) in
    today's vocabulary (``fp16``, ``fp8_e4m3xfp8_e5m2+fast``)."""
    label, plus, suffix = name.partition("+")
    parts = [_OLD_NAMES.get(part, part) for part in label.split("x")] if label.startswith("float8") else \
        [_OLD_NAMES.get(label, label)]
    return "x".join(parts) + plus + suffix


# How fp32 operands enter a dot, by the names torch.set_float32_matmul_precision takes, and two of our own.
_PRECISIONS = {"ieee": "ieee", "highest": "ieee", "tf32": "tf32", "high": "tf32", "medium": "tf32"}


def resolve_precision(precision: str | None, dtype: torch.dtype) -> str:
    """``ieee`` or ``tf32``: how fp32 operands enter the dot. Only fp32 has a choice.

    ``None`` (or ``"default"``) reads ``torch.get_float32_matmul_precision()``; the op does that when it
    runs, not when torch.compile traces it, so a compiled graph follows the setting at run time.
    """
    if precision is None or precision == "default":
        if dtype != torch.float32:
            return "ieee"
        precision = torch_fp32_precision()
    check_precision(precision)
    return _PRECISIONS[precision.lower()] if dtype == torch.float32 else "ieee"


def torch_fp32_precision() -> str:
    """torch's setting for fp32 matmuls, set through either of its APIs."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        # torch raises when its newer per-backend API (``torch.backends.cuda.matmul.fp32_precision``,
        # ``torch.backends.fp32_precision``) has been used: read that one, the matmul's own setting first
        value = torch.backends.cuda.matmul.fp32_precision
        if value == "none":
            value = torch.backends.fp32_precision
        return "tf32" if value == "tf32" else "ieee"


def check_precision(precision) -> None:
    if not isinstance(precision, str):  # (as a kernel name that is no str: the wrong type, not an unknown name)
        raise TypeError(f"precision must be a str, one of: {', '.join(_PRECISIONS)}; got {type(precision).__name__}")
    if precision.lower() not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of: {', '.join(_PRECISIONS)}")


# What autocast casts for the ops on its lower-precision list (torch.matmul, F.linear, F.conv2d): 16- and 32-bit
# floats. fp8 (a scaled product, not autocast's) and float64 stay as they are.
_AUTOCAST_FROM = (torch.float16, torch.bfloat16, torch.float32)


def autocast_inputs(*tensors):
    """``tensors`` as ``torch.autocast`` casts those of an op on its lower-precision list: each 16- or 32-bit
    tensor on the autocast device in the autocast dtype; None and anything else as it is. Unchanged unless
    autocast is on for the first tensor's device type, and when either of the first two (the operands) is of a
    dtype autocast leaves alone (an fp8 product keeps its bias as given: bf16, or its output's dtype)."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return tensors
    kind = first.device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return tensors
    if any(getattr(t, "dtype", None) not in _AUTOCAST_FROM for t in tensors[:2]):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_FROM and t.device.type == kind
                 else t for t in tensors)


def narrowed_gradient(grad: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``grad`` in ``dtype`` for a backward product whose operands are of ``dtype``, and the power of two to scale
    that product's (fp32) result by, or None where ``grad`` is cast as it is. An fp32 gradient of an fp16 product
    (``out_dtype=torch.float32``) whose largest magnitude lies past fp16's range (or below its normal numbers) is
    first divided by a power of two that brings it to [2**14, 2**15): cast as it is, the large entries became inf
    and the small ones zero, where the gradients they make may well fit. A gradient inside the range is cast as
    it is (scale 1: the same bits as a cast). The scale stays on the device (no host sync) and is exact."""
    if dtype != torch.float16 or grad.dtype != torch.float32 or grad.numel() == 0:
        return grad.to(dtype), None
    amax = grad.detach().abs().amax()
    # outside fp16's normal range, and neither zero, inf nor NaN (those cast as they are: inf and NaN stay so)
    outside = ((amax > 65504) | (amax < 2.0**-14)) & (amax > 0) & torch.isfinite(amax)
    scale = torch.where(outside, torch.exp2(torch.floor(torch.log2(amax)) - 14), torch.ones_like(amax))
    return (grad / scale).to(dtype), scale


def unscaled(result: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A backward product's ``result`` (computed in fp32 where ``scale`` is given) times ``scale``, in ``dtype``."""
    return result if scale is None else (result * scale).to(dtype)
