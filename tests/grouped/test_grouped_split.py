"""The 16-bit kernel's K split (configs given by hand, as a decode step gets them on the GPU): slices store fp32
partial tiles and the last to arrive adds them and runs the epilogue; the grid's row tiles bounded by M. Outputs
start as NaN, so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

from tilegemm.ops.grouped import configs, tiled
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference

from conftest import assert_rel_close
from test_grouped_layouts import operands


def run(layout, a, b, offs, groups, config, bias=None, gated=False, activation="none"):
    M, N, _ = (a.shape[0], b.shape[2], 0) if layout == "2d3d" else (a.shape[1], b.shape[1], 0)
    out_shape = (M, N // 2 if gated else N) if layout == "2d3d" else (M, N)
    out = torch.full(out_shape, float("nan"), dtype=a.dtype, device=a.device)
    p = make_problem(layout, groups, a, b, offs, bias, out, "ieee", activation, gated)
    tiled.run(p, dict(config, GROUP_M=2, num_warps=4, num_stages=1))
    return out


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("sizes", [[1, 0, 3, 0, 1, 2], [0, 40, 0]], ids=["decode", "one_expert"])
def test_2d3d_split_k(split, sizes, device):
    # 2-D x 3-D, K of 5 steps of 16: slices of 3 + 2 steps, or 2 + 2 + 1 + an empty one; rows past offs[-1]
    a, b, offs = operands("2d3d", sizes, 80, 37, torch.float32, device, tail=2)
    out = run("2d3d", a, b, offs, len(sizes), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLIT_K=split))
    assert_rel_close(out, grouped_mm_reference(a, b, offs), 1e-5)


def test_3d2d_split_k(device):
    a, b, offs = operands("3d2d", [3, 0, 17, 1], 64, 0, torch.float32, device, M=11)
    out = run("3d2d", a, b, offs, 4, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=4))
    assert_rel_close(out, grouped_mm_reference(a, b, offs), 1e-5)


def test_gated_split_k_with_bias(device):
    sizes = [2, 0, 5, 1]
    a, _, offs = operands("2d3d", sizes, 64, 1, torch.float16, device, tail=1)
    b = torch.randn(4, 64, 2 * 24, dtype=torch.float16, device=device)  # gate columns [0, 24), up [24, 48)
    bias = torch.randn(4, 48, dtype=torch.float16, device=device)
    out = run("2d3d", a, b, offs, 4, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=2), bias=bias, gated=True,
              activation="silu")
    full = grouped_mm_reference(a, b, offs, bias=bias)
    assert_rel_close(out, torch.nn.functional.silu(full[:, :24]) * full[:, 24:], 4e-3)


def test_split_k_refused_where_k_is_not_split(device):
    a, b, offs = operands("2d2d", [3, 5], 0, 16, torch.float32, device)
    out = torch.empty(2, a.shape[0], 16, device=device)
    p = make_problem("2d2d", 2, a, b, offs, None, out)
    with pytest.raises(ValueError, match="SPLIT_K=2"):
        tiled.run(p, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, SPLIT_K=2))


def test_row_tiles_bound_every_grouping():
    # the grid's row tiles hold every group's tiles and the rows past offs[-1]: checked against all groupings
    # of M = 6 rows into 3 groups plus a tail, for tiles of 1, 2 and 4 rows
    import itertools

    for bm in (1, 2, 4):
        for sizes in itertools.product(range(7), repeat=4):  # 3 groups and the tail
            if sum(sizes) != 6:
                continue
            need = sum(-(-n // bm) for n in sizes)
            assert need <= configs.row_tiles(6, 3, bm), (bm, sizes)


def test_decode_configs_split_k_on_a_large_gpu(monkeypatch):
    # the GPU's choice for one token routed to 2 of Mixtral's experts (down projection: few tiles, long K)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    a = torch.empty(2, 14336, dtype=torch.bfloat16)
    b = torch.empty(8, 14336, 4096, dtype=torch.bfloat16)
    p = make_problem("2d3d", 8, a, b, torch.empty(8, dtype=torch.int32), None, torch.empty(2, 4096))
    cfg = configs.choose_config(p)
    assert cfg["BLOCK_M"] == 16 and cfg["SPLIT_K"] > 1
    assert configs.row_tiles(2, 8, 16) * 4096 // cfg["BLOCK_N"] * cfg["SPLIT_K"] <= \
        configs.TILED_SPLIT_PROGRAMS_PER_SM * 132
    p = make_problem("2d3d", 8, torch.empty(16384, 14336, dtype=torch.bfloat16), b, p.offs, None,
                     torch.empty(16384, 4096))
    assert configs.choose_config(p)["SPLIT_K"] == 1  # prefill: tiles enough
