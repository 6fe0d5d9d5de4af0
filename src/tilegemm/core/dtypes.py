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
