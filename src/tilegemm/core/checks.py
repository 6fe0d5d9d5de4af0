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


def tile_errors(out: torch.Tensor, ref: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """:func:`relative_error` of every ``[block_m, block_n]`` tile of a 2-D result, as a float64 tensor of
    shape [tiles along M, tiles along N] (edge tiles are what is left of the matrix; inf where a tile holds
    NaN or inf). A kernel that spoils one tile of many barely moves the whole matrix's error; this sees it."""
    if out.dim() != 2 or out.shape != ref.shape:
        raise ValueError(f"tile_errors needs two 2-D tensors of one shape, got {tuple(out.shape)} and {tuple(ref.shape)}")
    M, N = out.shape
    pad = (0, -N % block_n, 0, -M % block_m)
    o = torch.nn.functional.pad(out.to(torch.float64), pad)
    r = torch.nn.functional.pad(ref.to(torch.float64), pad)
    shape = (o.shape[0] // block_m, block_m, o.shape[1] // block_n, block_n)
    o, r = o.reshape(shape), r.reshape(shape)
    finite = torch.isfinite(o).all(dim=3).all(dim=1)
    diff = torch.linalg.vector_norm(torch.nan_to_num(o - r), dim=(1, 3))
    denom = torch.linalg.vector_norm(r, dim=(1, 3))
    err = torch.where(denom > 0, diff / torch.where(denom > 0, denom, 1.0), diff)
    return torch.where(finite, err, torch.full_like(err, float("inf")))


def worst_tile_error(out: torch.Tensor, ref: torch.Tensor, block_m: int, block_n: int) -> float:
    """The largest :func:`tile_errors` of a result."""
    return tile_errors(out, ref, block_m, block_n).max().item()
