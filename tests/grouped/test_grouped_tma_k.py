"""Kernel ``tma_k`` (the Hopper 2-D x 2-D product, groups along K: the MoE weight gradient) under Triton's
interpreter, whose tensor descriptors are emulated (a load past a descriptor's bounds reads zeros, as TMA does):
jagged groups with empty ones (first, middle, last), a group of one token, K off the block, odd M and N, tokens
past offs[-1], bias, fp32 output, several persistent programs; what it refuses; ``auto``'s choice on a Hopper-like
setup and the autograd backward's route to it; its sm_90 code (TMA into wgmma, no spills) compiled offline. The GPU's
own run: test_grouped_tma_k_gpu.py. Outputs start as NaN (conftest), fp16 only (the interpreter's bf16 dot is
wrong)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tilegemm
from tilegemm.core import hardware, registry
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import interpreting
from tilegemm.ops.grouped import dispatch, tma_k
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import SM90, assert_rel_close, compile_offline
from test_grouped_layouts import offs_of

# token counts a group: empty groups first, between and last; one token; sums off the interpreter's 32-K block
SKEWED = [0, 40, 0, 1, 35, 0, 7, 0]


def bwd_operands(sizes, M, N, dtype, device, tail=0):
    """(a, b, offs) as the MoE backward passes dB = grouped(A^T, dY): a the transpose of tokens [T, M], b the
    output gradient [T, N], T = sum(sizes) + tail. Odd M or N are views into storage padded to 8 columns (TMA
    needs 16-byte row strides), as a slice of a wider activation would be."""
    T = sum(sizes) + tail
    pad = lambda n: -(-n // 8) * 8  # noqa: E731
    x = torch.randn(T, pad(M), dtype=dtype, device=device)[:, :M]
    dy = torch.randn(T, pad(N), dtype=dtype, device=device)[:, :N]
    return x.T, dy, offs_of(sizes, device)


def nan_out(G, M, N, dtype, device):
    return torch.full((G, M, N), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("M, N", [(24, 40), (17, 33), (33, 17)])
@pytest.mark.parametrize("sizes", [SKEWED, [70], [1, 1, 0, 1], [0, 0, 0]],
                         ids=["skewed", "one_group", "single_tokens", "all_empty"])
def test_matches_the_reference(M, N, sizes, device):
    a, b, offs = bwd_operands(sizes, M, N, torch.float16, device, tail=5)
    out = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")
    ref = grouped_mm_reference(a, b, offs)
    assert_rel_close(out, ref, tolerance(torch.float16))
    for g, n in enumerate(sizes):
        if n == 0:  # an empty group: exact zeros
            assert torch.equal(out[g], torch.zeros_like(out[g])), g


@pytest.mark.parametrize("bias", ["per_group", "shared"])
def test_bias_and_empty_groups_match_tiled(bias, device):
    # tiled's contract for an empty group is its bias broadcast over the rows (zeros without one): the same here
    a, b, offs = bwd_operands(SKEWED, 24, 40, torch.float16, device, tail=3)
    c = torch.randn(len(SKEWED), 40, dtype=torch.float16, device=device) if bias == "per_group" else \
        torch.randn(40, dtype=torch.float16, device=device)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=c, kernel="tma_k")
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=c), tolerance(torch.float16))
    theirs = tilegemm.grouped_mm(a, b, offs=offs, bias=c, kernel="tiled")
    for g, n in enumerate(SKEWED):
        if n == 0:
            assert torch.equal(out[g], theirs[g]), g


def test_fp32_output(device):
    a, b, offs = bwd_operands(SKEWED, 17, 40, torch.float16, device)
    out = tilegemm.grouped_mm(a, b, offs=offs, out_dtype=torch.float32, kernel="tma_k")
    assert out.dtype == torch.float32
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))


@pytest.mark.parametrize("programs", [1, 3, 7])
def test_units_dealt_to_several_programs(monkeypatch, programs, device):
    # the GPU's persistent grid (here 1, 3 or 7 programs, each walking every group for its units, round-robin):
    # 8 groups of 2 x 3 tiles; a config small enough for the interpreter
    monkeypatch.setattr(tma_k, "interpreting", lambda: False)
    monkeypatch.setattr(tma_k, "sm_count", lambda device: programs)
    a, b, offs = bwd_operands(SKEWED, 17, 40, torch.float16, device, tail=2)
    out = nan_out(len(SKEWED), 17, 40, torch.float16, device)
    tma_k.run(make_problem("2d2d", len(SKEWED), a, b, offs, None, out),
              dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1))
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))


def test_fp32_accumulates_exactly(device):
    # small integers in fp16: every product and sum is exact, so any K step read twice, skipped or taken from
    # another group's tokens changes the result
    sizes = [0, 33, 1, 0, 64, 5, 0]
    T = sum(sizes) + 4
    x = torch.randint(-3, 4, (T, 24), device=device).to(torch.float16)
    dy = torch.randint(-3, 4, (T, 16), device=device).to(torch.float16)
    offs = offs_of(sizes, device)
    out = tilegemm.grouped_mm(x.T, dy, offs=offs, out_dtype=torch.float32, kernel="tma_k")
    assert torch.equal(out, grouped_mm_reference(x.T, dy, offs).float())


# --- what it refuses, clearly --------------------------------------------------------------------------------


def _refusal(a, b, offs, match):
    with pytest.raises(NotApplicable, match=match):
        tilegemm.grouped_mm(a, b, offs=offs, kernel="tma_k")


def test_refuses_k_innermost_operands(device):
    # a group's first token would be the descriptor's innermost coordinate: tiled runs these
    a, b, offs = bwd_operands([8, 8], 16, 16, torch.float16, device)
    _refusal(a.contiguous(), b, offs, "a is not M-contiguous")
    _refusal(a, b.T.contiguous().T, offs, "b is not N-contiguous")


def test_refuses_other_layouts_and_dtypes(device):
    a, b, offs = bwd_operands([8, 8], 16, 16, torch.float16, device)
    _refusal(a.float(), b.float(), offs, "fp16 and bf16")
    x = torch.randn(16, 16, dtype=torch.float16, device=device)
    _refusal(x, torch.randn(2, 16, 16, dtype=torch.float16, device=device), offs, "2-D x 2-D")


def test_refuses_unaligned_and_broadcast(device):
    x = torch.randn(16, 12, dtype=torch.float16, device=device)  # token rows of 24 bytes
    offs = offs_of([8, 8], device)
    _refusal(x.T, torch.randn(16, 16, dtype=torch.float16, device=device), offs, "a's base or K stride")
    _refusal(torch.randn(16, 16, dtype=torch.float16, device=device).T, x, offs, "b's base or K stride")
    _refusal(torch.randn(1, 16, dtype=torch.float16, device=device).expand(16, 16).T,
             torch.randn(16, 16, dtype=torch.float16, device=device), offs, "broadcast")


def test_refuses_without_hopper(monkeypatch):
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 0))
    a, b, offs = bwd_operands([8, 8], 16, 16, torch.float16, "cpu")
    p = make_problem("2d2d", 2, a, b, offs, None, torch.empty(2, 16, 16, dtype=torch.float16))
    assert "Hopper" in tma_k.why_not(p)
    assert dispatch.choose(p) == "tiled"


# --- auto on a Hopper-like setup, and the backward's route --------------------------------------------------


@pytest.fixture
def hopper(monkeypatch):
    """What dispatch sees on an H200: not the interpreter, TMA available."""
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(tma_k, "why_not_tma", lambda: None)


def _problem(T, G, H=256, N=512, dtype=torch.bfloat16, a_km=True):
    a = torch.empty(T, H, dtype=dtype).T if a_km else torch.empty(H, T, dtype=dtype)
    return make_problem("2d2d", G, a, torch.empty(T, N, dtype=dtype), torch.empty(G, dtype=torch.int32), None,
                        torch.empty(1, 1, 1, dtype=dtype).expand(G, H, N))  # (never written)


@pytest.mark.parametrize("T, G, want", [
    (16384 * 2, 8, "tma_k"),  # Mixtral, 16384 tokens: 4096 tokens an expert
    (16384 * 6, 64, "tma_k"),  # DeepSeek-V2-Lite, 16384 tokens: 1536
    (4096 * 6, 64, "tiled"),  # DeepSeek-V2-Lite, 4096 tokens: 384 (tiled ran ahead there)
    (512 * 8, 128, "tiled"),  # Qwen3-30B-A3B, 512 tokens: 32 an expert
    (512 * 2, 8, "tiled"),  # Mixtral, 512 tokens: 128
])
def test_auto_takes_it_for_large_groups(hopper, T, G, want):
    assert dispatch.choose(_problem(T, G)) == want
    assert (T >= dispatch.TMA_K_MIN_TOKENS_PER_GROUP * G) == (want == "tma_k")


def test_auto_keeps_tiled_where_it_refuses(hopper):
    assert dispatch.choose(_problem(32768, 8, a_km=False)) == "tiled"  # a K-contiguous
    assert dispatch.choose(_problem(32768, 8, dtype=torch.float32)) == "tiled"
    assert dispatch.choose(_problem(32768, 8, H=260)) == "tiled"  # token rows not 16-byte aligned


@pytest.mark.skipif(not interpreting(), reason="the interpreter's choice")
def test_auto_stays_on_tiled_under_the_interpreter():
    assert dispatch.choose(_problem(32768, 8)) == "tiled"


def _spy(monkeypatch, name):
    calls = []
    real = registry.launcher("grouped", name)
    monkeypatch.setitem(registry._LAUNCHERS, ("grouped", name), lambda p, *a: (calls.append(p), real(p, *a))[1])
    return calls


def test_backward_of_the_moe_product_runs_on_it(hopper, monkeypatch, device):
    # the MoE forward (2-D x 3-D) at TMA_K_MIN_TOKENS_PER_GROUP+ tokens an expert: its dB = grouped(A^T, dY) goes
    # to tma_k (the bound lowered from 512 to 16 for the interpreter's sake: test_auto_takes_it_for_large_groups
    # holds the shipped one)
    monkeypatch.setattr(dispatch, "TMA_K_MIN_TOKENS_PER_GROUP", 16)
    calls = _spy(monkeypatch, "tma_k")
    sizes, K, N = [0, 40, 30, 0], 32, 40  # 70 tokens: 16+ a group
    x = torch.randn(sum(sizes) + 3, K, dtype=torch.float16, device=device, requires_grad=True)
    w = torch.randn(len(sizes), K, N, dtype=torch.float16, device=device, requires_grad=True)
    offs = offs_of(sizes, device)
    out = tilegemm.grouped_mm(x, w, offs=offs)
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    assert [p.layout for p in calls] == ["2d2d"] and calls[0].a.stride(0) == 1, calls
    wx, ww = torch.autograd.grad(grouped_mm_reference(x, w, offs), (x, w), grad.double())
    assert_rel_close(gw, ww, tolerance(torch.float16))
    assert_rel_close(gx, wx, tolerance(torch.float16))
    assert torch.equal(gw[0], torch.zeros_like(gw[0])) and torch.equal(gw[3], torch.zeros_like(gw[3]))


# --- the sm_90 code ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    script = SM90 + (Path(__file__).parent / "_compile_sm90_tma_k.py").read_text()
    return compile_offline(tmp_path_factory.mktemp("grouped-tma-k-ptx"), script, [], timeout=600)


@pytest.mark.parametrize("name", ["bf16_mixtral_gate_up", "fp16_deepseek_down", "bf16_fp32_out_bias"])
def test_compiles_to_tma_loads_into_wgmma(compiled, name):
    # both operands' 2-D boxes by TMA, the transposed tokens read M-major from shared memory by wgmma (no mma.sync,
    # no cp.async, no per-element operand loads: the global loads are offs' two words and the bias); descriptors
    # made on the device; the 64 x 256 accumulator a warp group in registers; one program an SM
    ops = compiled[name]
    assert any(op.startswith("cp.async.bulk.tensor.2d") for op in ops), ops
    assert any(op.startswith("wgmma.mma_async") and "n256" in op for op in ops), ops
    assert not any(op.startswith("mma.sync") or op.startswith("cp.async.c") for op in ops), ops
    assert any(op.startswith("tensormap.cp_fenceproxy") for op in ops), ops
    assert ops["spilled_bytes"] == 0, ops
    assert ops["config"] == dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=tma_k.TMA_K_STAGES, num_warps=8)
    assert ops["grid"] == 132

