"""Kernel ``tma_k`` on the GPU (`pytest -m gpu`, an sm_90 GPU): fp16 and bf16 against the float64 oracle with
NaN-poisoned outputs, skewed token counts with empty groups (first, middle, last), one token, counts off the 64-K
step, M and N off the 128 x 256 tile, bias, fp32 output; a CUDA graph replaying it with new group sizes; the
autograd backward of the MoE product (2-D x 3-D) taking dB to it, in autograd's own thread."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core import registry
from tilegemm.core.hardware import why_not_tma
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_tma_k import bwd_operands

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or why_not_tma() is not None,
                                 reason="needs a Hopper GPU for TMA")]

# token counts an expert, as routing makes them: empty experts (first, middle, last), one token, off the 64-K step
SKEWED = [0, 700, 0, 1, 300, 129, 0, 1000, 37, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N", [(256, 512), (200, 136), (1032, 72), (17, 33)])
def test_matches_the_reference(dtype, M, N):
    a, b, offs = bwd_operands(SKEWED, M, N, dtype, "cuda", tail=77)
    out = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(dtype))
    for g, n in enumerate(SKEWED):
        if n == 0:
            assert torch.equal(out[g], torch.zeros_like(out[g])), g
    bias = torch.randn(len(SKEWED), N, device="cuda", dtype=dtype)
    with_bias = tilegemm.grouped_mm(a, b, offs=offs, bias=bias, kernel="tma_k")
    assert_rel_close(with_bias, grouped_mm_reference(a, b, offs, bias=bias), tolerance(dtype))
    assert torch.equal(with_bias[0], tilegemm.grouped_mm(a, b, offs=offs, bias=bias, kernel="tiled")[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_output(dtype):
    a, b, offs = bwd_operands(SKEWED, 384, 264, dtype, "cuda")
    out = tilegemm.grouped_mm(a, b, offs=offs, out_dtype=torch.float32, kernel="tma_k")
    assert out.dtype == torch.float32
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(dtype))


def test_exact_on_small_integers():
    # every product and sum exact in fp32: a K step read twice, skipped or from another group would show
    sizes = [0, 333, 1, 0, 640, 65, 0]
    T = sum(sizes) + 9
    x = torch.randint(-3, 4, (T, 264), device="cuda").to(torch.bfloat16)
    dy = torch.randint(-3, 4, (T, 520), device="cuda").to(torch.bfloat16)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    out = tilegemm.grouped_mm(x.T, dy, offs=offs, out_dtype=torch.float32, kernel="tma_k")
    assert torch.equal(out, grouped_mm_reference(x.T, dy, offs).float())


def test_cuda_graph_replays_with_new_group_sizes():
    G, M, N = 6, 264, 520
    a, b, offs = bwd_operands([250] * G, M, N, torch.bfloat16, "cuda")  # 1500 tokens
    tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")
    for ends in ([100, 100, 500, 1200, 1400, 1500], [0, 0, 0, 0, 0, 1500], [1500] * 6, [0] * 6,
                 [1, 2, 3, 4, 5, 6], [0, 900, 900, 901, 901, 1300]):
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))


def test_no_host_sync_on_the_call():
    a, b, offs = bwd_operands([300, 0, 700], 128, 256, torch.bfloat16, "cuda")
    tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_of_the_moe_product_runs_on_it(monkeypatch, dtype):
    # tokens enough an expert on average: auto takes dB = grouped(A^T, dY) to tma_k, inside autograd's device
    # thread (whose context has no Triton allocator until the launch sets one)
    calls = []
    real = registry.launcher("grouped", "tma_k")
    monkeypatch.setitem(registry._LAUNCHERS, ("grouped", "tma_k"), lambda p, *a: (calls.append(p), real(p, *a))[1])
    sizes, K, N = [0, 1400, 600, 1, 1800, 0, 800, 0], 512, 384
    assert sum(sizes) >= dispatch.TMA_K_MIN_TOKENS_PER_GROUP * len(sizes)  # the rule's side the test is about
    x = torch.randn(sum(sizes) + 5, K, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(len(sizes), N, K, device="cuda", dtype=dtype) / K ** 0.5).transpose(1, 2).requires_grad_()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    out = tilegemm.grouped_mm(x, w, offs=offs)
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    assert [p.layout for p in calls] == ["2d2d"], calls
    assert dispatch.choose(calls[0]) == "tma_k"
    wx, ww = torch.autograd.grad(grouped_mm_reference(x, w, offs), (x, w), grad.double())
    assert_rel_close(gw, ww, tolerance(dtype))
    assert_rel_close(gx, wx, tolerance(dtype))
    for g, n in enumerate(sizes):
        if n == 0:
            assert torch.equal(gw[g], torch.zeros_like(gw[g])), g


def test_auto_keeps_tiled_below_the_threshold():
    a, b, offs = bwd_operands([100, 0, 200], 128, 128, torch.bfloat16, "cuda")
    p = make_problem("2d2d", 3, a, b, offs, None, torch.empty(3, 128, 128, device="cuda", dtype=torch.bfloat16))
    assert dispatch.choose(p) == "tiled"
