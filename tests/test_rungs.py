"""The Hopper and skinny rungs: that their own paths run (not a fallback), and their bookkeeping."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.matmul import persistent_tma, split_k
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close


def _problem(a, b, out, **kw):
    args = dict(c=None, bias=None, alpha=1.0, beta=1.0, activation="none", precision="ieee", upcast=False)
    args.update(kw)
    return make_problems(a, b, out, args["c"], args["bias"], args["alpha"], args["beta"], args["activation"],
                         args["precision"], args["upcast"])[0]


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", [(64, 64, 64), (40, 72, 48), (104, 56, 72)], ids=lambda s: "x".join(map(str, s)))
def test_persistent_tma_path(layout, dtype, shape, device):
    M, N, K = shape
    a = torch.randn(K, M, dtype=dtype, device=device).mT if layout[0] == "T" else torch.randn(M, K, dtype=dtype, device=device)
    b = torch.randn(N, K, dtype=dtype, device=device).mT if layout[1] == "T" else torch.randn(K, N, dtype=dtype, device=device)
    bias = torch.randn(N, dtype=dtype, device=device)
    c = torch.randn(M, 1, dtype=dtype, device=device)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    assert persistent_tma.describable(_problem(a, b, out)) is None, "this shape should take the TMA path"
    got = tilegemm.matmul(a, b, bias=bias, c=c, beta=0.5, activation="silu", kernel="persistent_tma", precision="ieee")
    assert_rel_close(got, matmul_reference(a, b, bias=bias, c=c, beta=0.5, activation="silu"), tolerance(dtype))


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda d: (torch.randn(37, 129, device=d), torch.randn(129, 70, device=d)), "16-byte aligned"),
        (lambda d: (torch.randn(8, 64, device=d), torch.randn(64, 64, device=d)), "smaller than 16"),
        (lambda d: (torch.randn(64, 128, device=d)[:, ::2], torch.randn(64, 64, device=d)), "no unit stride"),
        (lambda d: (torch.randn(2, 32, 32, device=d), torch.randn(32, 32, device=d)), "batched"),
    ],
)
def test_persistent_tma_falls_back_where_tma_cannot_go(make, reason, device):
    a, b = make(device)
    out = torch.empty(*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1], device=device)
    assert reason in persistent_tma.describable(_problem(a, b, out))
    got = tilegemm.matmul(a, b, kernel="persistent_tma", precision="ieee")
    assert_rel_close(got, matmul_reference(a, b), 1e-5)


@pytest.mark.parametrize("slices", [False, True], ids=["atomic", "slices"])
@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_split_k_any_split_and_clean_workspace(split, slices, device):
    a = torch.randn(3, 20, 150, device=device)
    b = torch.randn(150, 45, device=device)
    bias = torch.randn(45, device=device)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, SPLIT_K=split, SLICES=slices, num_warps=4,
               num_stages=1)
    for _ in range(2):  # the second call relies on the first leaving the workspace (or counters) zeroed
        out = torch.full((3, 20, 45), float("nan"), device=device)
        p = make_problems(a, b, out, None, bias, 2.0, 1.0, "relu", "ieee", False)[0]
        split_k.run(p, cfg)
        assert_rel_close(out, matmul_reference(a, b, bias=bias, alpha=2.0, activation="relu"), 1e-5)
    for (_, _, planes), (ws, count) in split_k._workspaces.items():
        assert not count.any(), "split_k must leave its counters at zero"
        assert planes or not ws.any(), "the atomic reduction must leave its workspace at zero"


def test_split_k_picks_more_splits_for_fewer_tiles(device):
    a = torch.randn(16, 8192, dtype=torch.float16, device=device)
    b = torch.randn(8192, 4096, dtype=torch.float16, device=device)
    p = _problem(a, b, torch.empty(16, 4096, dtype=torch.float16, device=device))
    cfg = split_k.pick_config(p)
    assert cfg["SPLIT_K"] >= 1 and cfg["BLOCK_M"] == (16 if device == "cuda" else cfg["BLOCK_M"])
