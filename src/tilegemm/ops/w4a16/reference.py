"""The oracle of the w4a16 tests and the bench: ``activation(x @ dequantize(w).T + bias)`` in plain torch."""

from __future__ import annotations

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.ops.w4a16.format import Int4Weight, dequantize


def reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, activation: str | None = "none",
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``activation(x @ dequantize(w).T + bias)`` computed in ``dtype`` (float64 by default)."""
    y = x.to(dtype) @ dequantize(w).to(dtype).T
    if bias is not None:
        y = y + bias.to(dtype)
    return torch_activation(y, activation or "none")


def tolerance(dtype: torch.dtype) -> float:
    """Bound on the relative error of a correct kernel against :func:`reference`: the 16-bit output's rounding and
    fp32 accumulation over K."""
    return 2e-3 if dtype == torch.float16 else 1e-2
