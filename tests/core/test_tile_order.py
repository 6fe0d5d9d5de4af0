"""The order in which persistent programs walk output tiles (``tilegemm.jit.helpers.tile_grouped``).

Producer and consumers of the warp-specialized kernels each compute it, so it must be a bijection from tile
ids to tiles for any band height, including a last band shorter than the rest (interpreter and GPU).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tilegemm.jit.helpers import tile_grouped


@triton.jit
def _order_kernel(out_m, out_n, tiles_m, tiles_n, GROUP_M: tl.constexpr, SERPENTINE: tl.constexpr,
                  BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    m, n = tile_grouped(t, tiles_m, tiles_n, GROUP_M, SERPENTINE)
    keep = t < tiles_m * tiles_n
    tl.store(out_m + t, m, mask=keep)
    tl.store(out_n + t, n, mask=keep)


def _order(tiles_m, tiles_n, group_m, serpentine, device):
    count = tiles_m * tiles_n
    out_m = torch.full((count,), -1, dtype=torch.int32, device=device)
    out_n = torch.full((count,), -1, dtype=torch.int32, device=device)
    _order_kernel[(1,)](out_m, out_n, tiles_m, tiles_n, group_m, serpentine, triton.next_power_of_2(count))
    return list(zip(out_m.tolist(), out_n.tolist()))


@pytest.mark.parametrize("tiles_m, tiles_n, group_m", [(7, 5, 3), (16, 16, 12), (5, 9, 8), (1, 6, 4), (9, 1, 2)])
@pytest.mark.parametrize("serpentine", [False, True])
def test_every_tile_once(tiles_m, tiles_n, group_m, serpentine, device):
    order = _order(tiles_m, tiles_n, group_m, serpentine, device)
    assert sorted(order) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


def test_serpentine_reverses_every_other_band(device):
    plain, snake = _order(7, 5, 3, False, device), _order(7, 5, 3, True, device)
    # Band 0 (rows 0-2) is walked left to right in both; band 1 (rows 3-5) right to left when serpentine,
    # so its first tiles sit in the last column, next to where band 0 ended; band 2 (row 6) left to right.
    assert snake[:15] == plain[:15]
    assert [n for _, n in snake[15:30]] == [4 - n for _, n in plain[15:30]]
    assert snake[14][1] == snake[15][1] == 4
    assert snake[30:] == plain[30:]
