"""Kernel ``gluon`` on the GPU (`pytest -m gpu`, an sm_90 GPU with Gluon): fp16 and bf16 against the float64 oracle
with NaN-poisoned outputs, both b layouts, skewed groups (empty ones first, in the middle and last; one row; sizes
off the 128-row tile; a half tile crossing a group's end), the tail past ``offs[-1]`` zeroed, bias ``[G, N]`` and
``[N]``, activations, K and N multiples of 8 but not of the tile, both rings; a strided output; a CUDA graph
replaying it with new group sizes; the same bits as ``tma`` would not hold (another summation order), so both
are held to the oracle."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.hardware import why_not_gluon
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.configs import GLUON_TILES
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_layouts import operands

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or why_not_gluon() is not None,
                                 reason="needs an sm_90 GPU with Gluon")]

SKEWED = [0, 700, 0, 1, 300, 129, 0, 1000, 37, 0]


def run(a, b, offs, bias=None, activation="none", cfg=None, out=None):
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device=a.device, dtype=a.dtype) if out is None else out
    from tilegemm.ops.grouped import gluon

    gluon.run(make_problem("2d3d", b.shape[0], a, b, offs, bias, out, "ieee", activation), cfg)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["b_kn", "b_nk"])
@pytest.mark.parametrize("K, N", [(256, 512), (200, 136), (2056, 72)])
def test_matches_the_reference(dtype, b_transposed, K, N):
    a, b, offs = operands("2d3d", SKEWED, K, N, dtype, "cuda", tail=77, b_transposed=b_transposed)
    bias = torch.randn(len(SKEWED), N, device="cuda", dtype=dtype)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias, kernel="gluon")
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), tolerance(dtype))
    assert torch.equal(out[-77:], torch.zeros_like(out[-77:]))
    plain = tilegemm.grouped_mm(a, b, offs=offs, kernel="gluon")
    assert_rel_close(plain, grouped_mm_reference(a, b, offs), tolerance(dtype))


@pytest.mark.parametrize("ring", range(len(GLUON_TILES)))  # 128 x 256 and 256 x 128 tiles, both rings each
@pytest.mark.parametrize("activation", ["none", "relu", "silu"])
def test_rings_bias_and_activations(ring, activation):
    from tilegemm.ops.grouped import gluon

    a, b, offs = operands("2d3d", [64, 0, 191, 65, 128], 1040, 264, torch.bfloat16, "cuda", tail=3,
                          b_transposed=True)
    bias = torch.randn(264, device="cuda", dtype=torch.bfloat16)  # [N]: every group's
    out = run(a, b, offs, bias, activation, gluon.configs()[ring])
    want = grouped_mm_reference(a, b, offs, bias=bias)
    want = {"none": want, "relu": torch.relu(want), "silu": torch.nn.functional.silu(want)}[activation]
    want[offs[-1]:] = 0
    assert_rel_close(out, want, tolerance(torch.bfloat16))


def test_strided_output_and_all_groups_empty():
    a, b, offs = operands("2d3d", [300, 5, 900], 128, 96, torch.float16, "cuda", b_transposed=True)
    wide = torch.full((a.shape[0], 160), float("nan"), device="cuda", dtype=torch.float16)
    out = run(a, b, offs, out=wide[:, 32:128])
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))
    assert torch.isnan(wide[:, :32]).all() and torch.isnan(wide[:, 128:]).all()  # nothing written outside
    empty = run(a, b, torch.zeros(3, dtype=torch.int32, device="cuda"))
    assert torch.equal(empty, torch.zeros_like(empty))


def test_large_skewed_routing_and_one_expert():
    gen = torch.Generator(device="cuda").manual_seed(3)
    E, K, N = 16, 2048, 1024
    counts = torch.randint(0, 700, (E,), generator=gen, device="cuda")
    counts[3] = 0
    counts[7] = 3000
    offs = counts.cumsum(0).to(torch.int32)
    M = int(offs[-1])
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    assert_rel_close(run(a, b, offs), grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))
    one = run(a[:513], b[:1], torch.tensor([513], dtype=torch.int32, device="cuda"))
    assert_rel_close(one, grouped_mm_reference(a[:513], b[:1], torch.tensor([513], device="cuda")),
                     tolerance(torch.bfloat16))


def test_cuda_graph_replays_with_new_group_sizes():
    E, K, N, M = 6, 256, 136, 1500
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor([100, 100, 500, 1200, 1400, 1500], dtype=torch.int32, device="cuda")
    tilegemm.grouped_mm(a, b, offs=offs, kernel="gluon")  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilegemm.grouped_mm(a, b, offs=offs, kernel="gluon")
    for ends in ([100, 100, 500, 1200, 1400, 1500], [0, 0, 0, 1, 1300, 1400], [1500] * 6):
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))


def test_auto_runs_it_from_256_rows_an_expert():
    E, K, N = 8, 512, 384
    a, b, offs = operands("2d3d", [600, 0, 300, 260, 0, 500, 400, 2048], K, N, torch.bfloat16, "cuda")  # 513 an expert
    p = make_problem("2d3d", E, a, b, offs, None, torch.empty(a.shape[0], N, device="cuda", dtype=torch.bfloat16))
    assert dispatch.choose(p) == "gluon"
    assert_rel_close(tilegemm.grouped_mm(a, b, offs=offs), grouped_mm_reference(a, b, offs),
                     tolerance(torch.bfloat16))


def test_repeated_calls_replay_both_launches():
    # the host fast path: a repeated call (same layouts) replays the plan and the product with the kept table, on
    # new operands and new group sizes
    from tilegemm.ops.grouped import op as grouped_op

    grouped_op.REPLAYS.clear()
    E, K, N, M = 4, 256, 264, 1400
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for ends in ([300, 300, 900, 1400], [0, 1000, 1000, 1300], [1400, 1400, 1400, 1400]):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        out = tilegemm.grouped_mm(a, b, offs=offs, kernel="gluon")
        want = grouped_mm_reference(a, b, offs)
        want[ends[-1]:] = 0
        assert_rel_close(out, want, tolerance(torch.bfloat16))
        assert grouped_op.REPLAYS.count() == 1  # one key: recorded by the first call, replayed by the others
