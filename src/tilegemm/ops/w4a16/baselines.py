"""torch's own int4 kernel (tinygemm, ``torch.ops.aten._weight_int4pack_mm``) fed an :class:`Int4Weight`:
the second baseline of the bench (bf16 activations, CUDA only)."""

from __future__ import annotations

import torch

from tilegemm.ops.w4a16.format import Int4Weight, unpacked


def tinygemm_weight(w: Int4Weight, inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed weight, scales_and_zeros ``[G, N, 2]`` bf16, group size) for ``_weight_int4pack_mm``.

    tinygemm computes ``(q - 8) * s + zf``; ``zf = (8 - z) * s`` makes that ``(q - z) * s``.
    """
    if w.perm is not None:
        raise ValueError("tinygemm takes no act-order weight")
    N, K = w.shape
    q = unpacked(w).T.contiguous()  # [N, K] uint8, 0..15
    q2 = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()  # [N, K/2], the even k in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(q2, inner_k_tiles)
    s = w.scales.float()
    zf = (8.0 - w.zeros.float()) * s
    sz = torch.stack([s, zf], dim=2).to(torch.bfloat16).contiguous()  # [G, N, 2]
    return packed, sz, w.group_k


def tinygemm_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x [M, K]`` bf16 times the tinygemm weight: ``[M, N]`` bf16."""
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)
