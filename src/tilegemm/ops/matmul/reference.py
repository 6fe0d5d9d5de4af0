"""The oracle for every dense-GEMM kernel: the same formula in plain torch, in float64."""

from __future__ import annotations

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.core.checks import relative_error  # noqa: F401  (re-exported: tests and docs import it here)


def matmul_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    activation: str | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``activation(alpha * (a @ b) + beta * c + bias)`` computed in ``dtype`` (float64 by default)."""
    out = alpha * torch.matmul(a.to(dtype), b.to(dtype))
    if c is not None:
        out = out + beta * c.to(dtype)
    if bias is not None:
        out = out + bias.to(dtype)
    return torch_activation(out, activation or "none")


def tolerance(dtype: torch.dtype, precision: str = "ieee", out_dtype: torch.dtype | None = None,
              fast_accum: bool = False) -> float:
    """Bound on :func:`relative_error` for a correct kernel, set by the operands' and output's rounding.

    ``fast_accum`` (fp8): the tensor cores' own accumulator keeps fewer bits than fp32 over all of K.
    """
    bounds = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2, torch.float32: 1e-4}
    # fp8 products are exact in fp32: what is left is accumulation order and the output's rounding.
    bounds.update({torch.float8_e4m3fn: 1e-3, torch.float8_e5m2: 1e-3})
    bound = bounds.get(dtype, 5e-2)
    if fast_accum and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        bound = 1e-2
    if dtype == torch.float32 and precision == "tf32":
        bound = 1e-2
    if out_dtype is not None:
        bound = max(bound, bounds.get(out_dtype, bound))
    return bound
