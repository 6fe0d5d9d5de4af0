"""Tile sizes of the grouped kernels, chosen from shapes alone (no value of ``offs`` is read on the host).

Rows per group decide BLOCK_M: a MoE decode step gives each expert a few rows, and a 128-row tile would then be
mostly padding; the average rows per group (``M / G``, known from the shapes) picks the smallest power of two
from 16 (tl.dot's least) up to 128 that holds it. Under the interpreter smaller tiles keep the tests fast.
"""

from __future__ import annotations

import torch

from tilegemm.core.runtime import interpreting


def block_m_for(rows_per_group: float) -> int:
    for bm in (16, 32, 64):
        if rows_per_group <= bm:
            return bm
    return 128


def choose_config(p) -> dict:
    """``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` for a :class:`GroupedProblem`."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    if p.layout in ("2d3d", "3d2d"):
        rows = (p.M if p.layout == "2d3d" else p.N) / max(p.groups, 1)
    else:
        rows = p.M
    bm = block_m_for(rows)
    wide = p.dtype == torch.float32
    bk = 32 if wide else 64
    if p.gated:
        bn = 64
    else:
        bn = 64 if wide else 128
    warps = 8 if bm * bn >= 128 * 128 else 4
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=3 if bm >= 64 else 4)
