"""Kernel ``dequant_grouped`` of ``grouped_w4a16`` (4-bit experts at prefill: a pass writes the experts' 16-bit
weight, then the 16-bit grouped product) under the interpreter, fp16 (bf16 products on the GPU:
test_grouped_int4_prefill_gpu.py): the pass bit for bit ``dequantize``; the product against the fp64 reference of
``x @ dequantize(w)[g].T`` per expert with empty and one-row experts, rows past ``offs[-1]``, bias ``[N]`` and
``[E, N]``, activations, the gate, odd N and K; the slices of a weight over the memory bound; the product on
``tma`` where the 16-bit ``auto`` picks it; and ``auto``'s rule. Outputs (and the scratch) start as NaN."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core import registry
from tilegemm.core.activations import torch_activation
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import new_output
from tilegemm.ops.grouped import configs, dequant, dispatch, tma
from tilegemm.ops.grouped.op import forward_int4, grouped_w4a16_op
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close

KERNEL = "dequant_grouped"
TOL = tolerance(torch.float16)


def experts(E, N, K, group_size=32, dtype=torch.float16, device="cpu"):
    return tilegemm.w4a16.quantize(torch.randn(E, N, K, device=device).to(dtype), group_size=group_size)


def offs_of(sizes, device):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def reference(x, w, offs, bias=None, activation="none", gated=False):
    full = grouped_mm_reference(x, tilegemm.w4a16.dequantize(w).transpose(1, 2), offs, bias=bias)
    if gated:
        half = full.shape[1] // 2
        return torch_activation(full[:, :half], activation) * full[:, half:]
    return torch_activation(full, activation)  # (rows past offs[-1] stay 0: every activation keeps 0 at 0)


def run(x, w, offs, bias=None, activation="none", gated=False, kernel=KERNEL):
    return forward_int4(x, w.qweight, w.scales, w.zeros, offs, bias, w.group_k, activation, gated, kernel)


def problem(x, w, offs, bias=None, activation="none", gated=False):
    E, N, K = w.shape
    n_out = N // 2 if gated else N
    out = new_output((x.shape[0], n_out), x.dtype, x.device)
    return GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, bias, out, E, x.shape[0], n_out, K, w.group_k,
                              activation, gated)


# --- the pass ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, K", [(32, 64), (-1, 40), (64, 192)])
def test_pass_is_dequantize_bit_for_bit(dtype, group_size, K, device):
    w = experts(3, 136, K, group_size, dtype, device)  # 136 rows: a partial 128-row block of the pass
    p = problem(torch.empty(3, K, dtype=dtype, device=device), w, offs_of([1, 1, 1], device))
    scratch = new_output((3, 136, K), dtype, device)
    dequant.dequantize_experts(p, scratch, 0, 136)
    assert torch.equal(scratch, tilegemm.w4a16.dequantize(w))


def test_pass_slice_of_a_gated_weight(device):
    # columns [8, 20) of the output: the gate's rows 8..19, then the up projection's 40 + 8..19
    w = experts(2, 80, 64, 32, device=device)
    p = problem(torch.empty(2, 64, dtype=torch.float16, device=device), w, offs_of([1, 1], device), gated=True)
    scratch = new_output((2, 24, 64), torch.float16, device)
    dequant.dequantize_experts(p, scratch, 8, 12)
    full = tilegemm.w4a16.dequantize(w)
    assert torch.equal(scratch, torch.cat((full[:, 8:20], full[:, 48:60]), dim=1))


def test_pass_skips_experts_without_rows(device):
    # offs read on the device: experts 0 and 2 get no rows, so their scratch stays as it was (NaN here)
    w = experts(4, 32, 64, 32, device=device)
    p = problem(torch.empty(9, 64, dtype=torch.float16, device=device), w, offs_of([0, 4, 0, 5], device))
    scratch = new_output((4, 32, 64), torch.float16, device)
    dequant.dequantize_experts(p, scratch, 0, 32)
    full = tilegemm.w4a16.dequantize(w)
    assert torch.isnan(scratch[0]).all() and torch.isnan(scratch[2]).all()
    assert torch.equal(scratch[1], full[1]) and torch.equal(scratch[3], full[3])


# --- the product -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, tail", [([5, 0, 12, 9], 3), ([0, 1, 0, 1], 0), ([0, 0, 0, 0], 4), ([30, 0, 0, 2], 1)],
                         ids=["skewed", "one_row", "all_empty", "one_large"])
@pytest.mark.parametrize("group_size", [32, -1])
def test_matches_the_reference(sizes, tail, group_size, device):
    w = experts(4, 24, 64, group_size, device=device)
    x = torch.randn(sum(sizes) + tail, 64, device=device, dtype=torch.float16)
    offs = offs_of(sizes, device)
    out = tilegemm.w4a16.grouped_matmul(x, w, offs, kernel=KERNEL)
    assert_rel_close(out, reference(x, w, offs), TOL)
    assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))


@pytest.mark.parametrize("per_expert", [False, True], ids=["bias_n", "bias_en"])
@pytest.mark.parametrize("activation", ["none", "silu", "gelu"])
def test_bias_and_activation(per_expert, activation, device):
    w = experts(4, 40, 64, device=device)
    x = torch.randn(23, 64, device=device, dtype=torch.float16)
    offs = offs_of([4, 0, 11, 6], device)
    bias = torch.randn(*((4, 40) if per_expert else (40,)), device=device).half()
    out = tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation=activation, kernel=KERNEL)
    assert_rel_close(out, reference(x, w, offs, bias, activation), TOL)
    assert torch.equal(out[21:], torch.zeros_like(out[21:]))  # rows past offs[-1]: zero, no bias


def test_odd_n_and_k(device):
    w = experts(3, 17, 40, -1, device=device)  # K a multiple of 8 only (one group), N odd
    x = torch.randn(14, 40, device=device, dtype=torch.float16)
    offs = offs_of([6, 1, 5], device)
    assert_rel_close(tilegemm.w4a16.grouped_matmul(x, w, offs, kernel=KERNEL), reference(x, w, offs), TOL)


@pytest.mark.parametrize("N", [32, 34], ids=["even_half", "odd_half"])
def test_gated_with_bias(N, device):
    w = experts(4, N, 64, device=device)
    x = torch.randn(20, 64, device=device, dtype=torch.float16)
    offs = offs_of([6, 0, 3, 9], device)
    bias = torch.randn(4, N, device=device).half()
    out = run(x, w, offs, bias, "silu", gated=True)
    assert_rel_close(out, reference(x, w, offs, bias, "silu", gated=True), TOL)
    assert torch.equal(out[18:], torch.zeros_like(out[18:]))


def test_through_the_op(device):
    w = experts(4, 16, 64, device=device)
    x = torch.randn(9, 64, device=device, dtype=torch.float16)
    torch.library.opcheck(grouped_w4a16_op, (x, w.qweight, w.scales, w.zeros, offs_of([2, 0, 3, 4], device), None,
                                             w.group_k, "none", False, KERNEL))


# --- a weight over the memory bound: slices of the output's columns ----------------------------------------------


@pytest.fixture
def small_bound(monkeypatch):
    """A scratch of 16 output columns (aligned to 8) for the tests' weights of K = 32 over 3 experts."""
    monkeypatch.setattr(configs, "INT4_DEQUANT_CHUNK_ALIGN", 8)
    monkeypatch.setattr(dispatch, "INT4_DEQUANT_MAX_BYTES", 3 * 32 * 2 * 16 + 100)
    slices = []
    real = dequant.dequantize_experts

    def spy(p, w, n_lo, columns):
        slices.append((n_lo, columns))
        real(p, w, n_lo, columns)

    monkeypatch.setattr(dequant, "dequantize_experts", spy)
    return slices


@pytest.mark.parametrize("per_expert", [False, True], ids=["bias_n", "bias_en"])
def test_sliced_weight(small_bound, per_expert, device):
    w = experts(3, 40, 32, device=device)
    x = torch.randn(19, 32, device=device, dtype=torch.float16)
    offs = offs_of([7, 0, 10], device)
    bias = torch.randn(*((3, 40) if per_expert else (40,)), device=device).half()
    out = run(x, w, offs, bias, "gelu")
    assert small_bound == [(0, 16), (16, 16), (32, 8)]  # the last slice narrower
    assert_rel_close(out, reference(x, w, offs, bias, "gelu"), TOL)
    assert torch.equal(out[17:], torch.zeros_like(out[17:]))


def test_sliced_gated_weight(small_bound, device):
    # gated: a slice holds 8 columns (the gate's and the up projection's: the scratch of 16)
    w = experts(3, 40, 32, device=device)
    x = torch.randn(15, 32, device=device, dtype=torch.float16)
    offs = offs_of([2, 9, 1], device)
    bias = torch.randn(3, 40, device=device).half()
    out = run(x, w, offs, bias, "silu", gated=True)
    assert small_bound == [(0, 8), (8, 8), (16, 4)]
    assert_rel_close(out, reference(x, w, offs, bias, "silu", gated=True), TOL)


def test_refuses_where_no_slice_fits(monkeypatch, device):
    monkeypatch.setattr(dispatch, "INT4_DEQUANT_MAX_BYTES", 1000)  # under one 256-column slice
    w = experts(2, 24, 64, device=device)
    x = torch.randn(600, 64, device=device, dtype=torch.float16)
    offs = offs_of([300, 300], device)
    with pytest.raises(NotApplicable, match="INT4_DEQUANT_MAX_BYTES"):
        run(x, w, offs)
    assert dispatch.choose_int4(problem(x, w, offs)) == "dequant_dot"  # auto: the in-loop kernel instead


# --- the 16-bit product's kernel, and auto ----------------------------------------------------------------------


def _spy_launcher(monkeypatch, op, name):
    calls = []
    real = registry.launcher(op, name)
    monkeypatch.setitem(registry._LAUNCHERS, (op, name), lambda p, *a: (calls.append(p), real(p, *a))[1])
    return calls


def test_product_on_tma_where_auto_takes_it(monkeypatch, device):
    # as on a Hopper GPU: 65+ rows an expert take the 16-bit product to tma (the interpreter emulates its
    # descriptors), reading the scratch [E, N, K] through its [G, N, K] descriptor
    monkeypatch.setattr(dispatch, "takes_tma", lambda p: tma.why_not(p) is None)
    calls = _spy_launcher(monkeypatch, "grouped", "tma")
    w = experts(2, 48, 32, device=device)
    x = torch.randn(520, 32, device=device, dtype=torch.float16)
    offs = offs_of([300, 217], device)
    bias = torch.randn(2, 48, device=device).half()
    out = run(x, w, offs, bias, "silu", gated=True)
    assert len(calls) == 1 and calls[0].b.stride(1) == 1  # column-major per expert
    assert_rel_close(out, reference(x, w, offs, bias, "silu", gated=True), TOL)
    assert torch.equal(out[517:], torch.zeros_like(out[517:]))


def test_auto_runs_it_from_the_threshold(monkeypatch, device):
    calls = _spy_launcher(monkeypatch, "grouped_w4a16", KERNEL)
    w = experts(2, 24, 32, device=device)
    rows = dispatch.INT4_DEQUANT_MIN_ROWS_PER_GROUP * 2
    x = torch.randn(rows, 32, device=device, dtype=torch.float16)
    offs = offs_of([200, rows - 203], device)
    out = tilegemm.w4a16.grouped_matmul(x, w, offs)
    assert len(calls) == 1
    assert_rel_close(out, reference(x, w, offs), TOL)
    tilegemm.w4a16.grouped_matmul(x[:-1], w, offs)  # one row under: dequant_dot
    assert len(calls) == 1


def _shapes(M, E, N, K, dtype=torch.float16, gated=False):
    """A problem of these sizes for the rule (the tensors' shapes only; nothing is launched)."""
    one = lambda *s, dt=dtype: torch.empty(1, dtype=dt).expand(*s)  # noqa: E731
    n_w = 2 * N if gated else N
    return GroupedInt4Problem(one(M, K), one(E, K // 8, n_w, dt=torch.int32), one(E, K // 128, n_w),
                              one(E, K // 128, n_w), one(E, dt=torch.int32), None, one(M, N), E, M, N, K, 128,
                              "silu" if gated else "none", gated)


@pytest.mark.parametrize("M, E, N, K, gated, want", [
    (512 * 2, 8, 14336, 4096, True, KERNEL),  # Mixtral gate/up, 512 tokens: 128 rows an expert, 1.9 GB of scratch
    (64 * 2, 8, 14336, 4096, True, "dequant_dot"),  # 64 tokens: 16 rows an expert
    (16384 * 2, 8, 4096, 14336, False, KERNEL),  # Mixtral down, 16384 tokens
    (4096 * 8, 128, 768, 2048, True, KERNEL),  # Qwen3-30B-A3B gate/up, 4096 tokens: 256 rows an expert
    (512 * 8, 128, 768, 2048, True, "dequant_dot"),  # 512 tokens: 32
    (4096 * 6, 64, 2048, 1408, False, KERNEL),  # DeepSeek-V2-Lite down, 4096 tokens: 384
    (127 * 8, 8, 1024, 1024, False, "dequant_dot"),  # one row an expert under the threshold
])
def test_auto_rule(M, E, N, K, gated, want):
    p = _shapes(M, E, N, K, gated=gated)
    assert dispatch.choose_int4(p) == want
    assert dispatch.dequant_chunk(p) == N  # these scratches fit the bound whole


def test_large_weights_slice_or_fall_back():
    # 128 experts, K 4096, 2 x 3072 rows gated: 6 GiB of scratch, sliced into whole 256-column slices
    p = _shapes(16384 * 8, 128, 3072, 4096, gated=True)
    columns = dispatch.dequant_chunk(p)
    assert columns % configs.INT4_DEQUANT_CHUNK_ALIGN == 0 and 0 < columns < 3072
    assert 128 * 4096 * 2 * 2 * columns <= dispatch.INT4_DEQUANT_MAX_BYTES
    assert dispatch.choose_int4(p) == KERNEL
    huge = _shapes(16384 * 8, 4096, 1024, 8192)  # not even 256 columns fit: dequant_dot
    assert dispatch.dequant_chunk(huge) == 0 and dispatch.choose_int4(huge) == "dequant_dot"


def test_marks_its_launches_unrecordable(monkeypatch, device):
    # the scratch is the call's own: the host fast path must not record the pass and the product (a replay would
    # pass the recorded scratch); on the GPU the cache stays empty (test_grouped_int4_prefill_gpu.py)
    spoiled = []
    monkeypatch.setattr(dequant, "spoil", lambda: spoiled.append(1))
    w = experts(2, 16, 32, device=device)
    run(torch.randn(5, 32, device=device, dtype=torch.float16), w, offs_of([2, 3], device))
    assert spoiled == [1]


def test_registered():
    assert KERNEL in tilegemm.kernels("grouped_w4a16")
