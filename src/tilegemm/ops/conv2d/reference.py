"""The oracle for every conv2d kernel: ``torch.nn.functional.conv2d`` in float64, and the error bounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilegemm.core.checks import relative_error  # noqa: F401  (re-exported for tests)
from tilegemm.core.activations import torch_activation


def conv2d_reference(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``activation(F.conv2d(x, weight, bias, ...))`` computed in ``dtype`` (float64 by default)."""
    out = F.conv2d(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), stride, padding,
                   dilation, groups)
    return torch_activation(out, activation or "none")


def tolerance(dtype: torch.dtype, precision: str = "ieee") -> float:
    """Bound on :func:`relative_error` for a correct kernel, set by the operands' and output's rounding (fp32
    accumulation; the same bounds as matmul's oracle)."""
    if dtype == torch.float32 and precision == "tf32":
        return 1e-2
    return {torch.float16: 4e-3, torch.bfloat16: 2.5e-2, torch.float32: 1e-4}.get(dtype, 5e-2)
