"""The oracle of the grouped family: ``torch.nn.functional.grouped_mm``'s four layouts as a plain loop of
products in float64 (or ``dtype``), rows and columns past ``offs[-1]`` zero."""

from __future__ import annotations

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.core.checks import relative_error  # noqa: F401  (re-exported for tests and the bench)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in offs.tolist()]
    return list(zip([0] + ends[:-1], ends))


def _bias_of(bias: torch.Tensor | None, g: int, dtype) -> torch.Tensor | None:
    if bias is None:
        return None
    return (bias[g] if bias.dim() == 2 else bias).to(dtype)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``grouped_mm(a, b, offs=offs, bias=bias)`` computed in ``dtype``; bias ``[N]`` (every group) or ``[G, N]``
    (per group; ``[N_total]`` for 3-D x 2-D) is added to the rows of groups, not to rows past ``offs[-1]``."""
    a, b = a.to(dtype), b.to(dtype)
    if a.dim() == 3 and b.dim() == 3:
        out = torch.matmul(a, b)
        if bias is not None:
            out = out + (bias.to(dtype)[:, None, :] if bias.dim() == 2 else bias.to(dtype))
        return out
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=dtype, device=a.device)
        for g, (lo, hi) in enumerate(_bounds(offs)):
            out[lo:hi] = a[lo:hi] @ b[g]
            if bias is not None:
                out[lo:hi] += _bias_of(bias, g, dtype)
        return out
    if a.dim() == 2 and b.dim() == 2:
        G = offs.shape[0]
        out = torch.zeros(G, a.shape[0], b.shape[1], dtype=dtype, device=a.device)
        for g, (lo, hi) in enumerate(_bounds(offs)):
            out[g] = a[:, lo:hi] @ b[lo:hi]
            if bias is not None:
                out[g] += _bias_of(bias, g, dtype)
        return out
    # 3-D x 2-D: b's columns grouped
    out = torch.zeros(a.shape[1], b.shape[1], dtype=dtype, device=a.device)
    for g, (lo, hi) in enumerate(_bounds(offs)):
        out[:, lo:hi] = a[g] @ b[:, lo:hi]
        if bias is not None:
            out[:, lo:hi] += bias[lo:hi].to(dtype)
    return out


def moe_experts_reference(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu",
                          dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A MoE block's experts, token by token: ``sum_j w_j * down[e_j] @ (act(gate[e_j] x) * up[e_j] x)`` with
    ``gate_up`` ``[E, 2I, H]`` (gate rows first) and ``down`` ``[E, H, I]`` (transformers' layout)."""
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    out = torch.zeros_like(x)
    I = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            h = gate_up[e] @ x[t]
            y = down[e] @ (torch_activation(h[:I], activation) * h[I:])
            out[t] += top_k_weights[t, j].to(dtype) * y
    return out


def tolerance(dtype: torch.dtype, precision: str = "ieee") -> float:
    """Bound on the relative error of a correct kernel, by the operands' rounding."""
    if dtype == torch.float32:
        return 1e-2 if precision == "tf32" else 1e-4
    return {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}.get(dtype, 5e-2)
