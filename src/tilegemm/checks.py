"""How a result is judged against its reference, for every op."""

from __future__ import annotations

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN or inf anywhere in ``out`` gives inf."""
    out64 = out.to(torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    ref64 = ref.to(torch.float64)
    denom = torch.linalg.vector_norm(ref64).item()
    diff = torch.linalg.vector_norm(out64 - ref64).item()
    if denom == 0.0:
        return diff
    return diff / denom
