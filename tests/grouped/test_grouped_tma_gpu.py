"""Kernel ``tma`` on the GPU (`pytest -m gpu`, an sm_90 GPU): fp16 and bf16 against the float64 oracle with
NaN-poisoned outputs, both b layouts, skewed groups with empty ones and sizes off the 128-row tile, K and N
multiples of 8 but not of the tile, bias, the gate; ``auto`` choosing it for large groups; a CUDA graph replaying it
with new group sizes (the descriptors' scratch allocated under capture); a launch from another thread (Triton's
allocator is per context)."""

from __future__ import annotations

import threading

import pytest
import torch

import tilegemm
from tilegemm.core.hardware import why_not_tma
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.api import moe_gate_up
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_layouts import check_backward, operands

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or why_not_tma() is not None,
                                 reason="needs a Hopper GPU for TMA")]

# skewed, as routing makes them: empty experts (first, middle, last), one row, sizes off the 128-row tile
SKEWED = [0, 700, 0, 1, 300, 129, 0, 1000, 37, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["b_kn", "b_nk"])
@pytest.mark.parametrize("K, N", [(256, 512), (200, 136), (1032, 72)])
def test_matches_the_reference(dtype, b_transposed, K, N):
    a, b, offs = operands("2d3d", SKEWED, K, N, dtype, "cuda", tail=77, b_transposed=b_transposed)
    bias = torch.randn(len(SKEWED), N, device="cuda", dtype=dtype)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias, kernel="tma")
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), tolerance(dtype))
    assert torch.equal(out[-77:], torch.zeros_like(out[-77:]))
    plain = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")
    assert_rel_close(plain, grouped_mm_reference(a, b, offs), tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["b_kn", "b_nk"])
def test_gated(dtype, b_transposed):
    N = 200
    a, _, offs = operands("2d3d", SKEWED, 264, 1, dtype, "cuda", tail=9)
    w = torch.randn(len(SKEWED), 2 * N, 264, device="cuda", dtype=dtype)
    b = w.transpose(1, 2) if b_transposed else w.transpose(1, 2).contiguous()
    bias = torch.randn(len(SKEWED), 2 * N, device="cuda", dtype=dtype)
    out = torch.full((a.shape[0], N), float("nan"), device="cuda", dtype=dtype)
    dispatch.launch(make_problem("2d3d", len(SKEWED), a, b, offs, bias, out, "ieee", "silu", True), "tma")
    full = grouped_mm_reference(a, b, offs, bias=bias)
    assert_rel_close(out, torch.nn.functional.silu(full[:, :N]) * full[:, N:], tolerance(dtype))


def test_auto_runs_it_for_large_groups():
    E, K, N = 8, 512, 384
    # 241 rows an expert on average: tma's (from 256, the plain product runs gluon)
    a, b, offs = operands("2d3d", [300, 0, 150, 130, 0, 250, 200, 900], K, N, torch.bfloat16, "cuda")
    p = make_problem("2d3d", E, a, b, offs, None, torch.empty(a.shape[0], N, device="cuda", dtype=torch.bfloat16))
    assert dispatch.choose(p) == "tma"
    assert_rel_close(tilegemm.grouped_mm(a, b, offs=offs), grouped_mm_reference(a, b, offs),
                     tolerance(torch.bfloat16))
    gated = moe_gate_up(a, torch.cat([b, b], 2), offs)  # the MoE integration's gate/up, on tma too
    full = grouped_mm_reference(a, b, offs)
    assert_rel_close(gated, torch.nn.functional.silu(full) * full, tolerance(torch.bfloat16))


def test_cuda_graph_replays_with_new_group_sizes():
    E, K, N, M = 6, 256, 136, 1500
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor([100, 100, 500, 1200, 1400, 1500], dtype=torch.int32, device="cuda")
    tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")
    for ends in ([100, 100, 500, 1200, 1400, 1500], [0, 0, 0, 0, 0, 1500], [1500] * 6, [0] * 6,
                 [1, 2, 3, 4, 5, 6], [0, 900, 900, 901, 901, 1300]):
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))


def test_launch_from_another_thread():
    a, b, offs = operands("2d3d", [300, 0, 200], 128, 128, torch.float16, "cuda", tail=3)
    got = {}

    def work():
        got["out"] = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")
        torch.cuda.synchronize()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert_rel_close(got["out"], grouped_mm_reference(a, b, offs), tolerance(torch.float16))


def test_no_host_sync_on_the_call():
    a, b, offs = operands("2d3d", [300, 0, 700], 128, 128, torch.bfloat16, "cuda")
    tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_backward_runs_it_in_autograds_thread():
    # dA = grouped(dY, B^T) is a 2-D x 3-D product of 256+ rows an expert: auto runs it on tma, inside autograd's
    # device thread, whose context has no allocator until the launch sets one
    K, N = 256, 192
    check_backward(*operands("2d3d", [300, 0, 500, 260], K, N, torch.bfloat16, "cuda", tail=4), torch.bfloat16)
