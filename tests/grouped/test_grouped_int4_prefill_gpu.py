"""Kernel ``dequant_grouped`` of ``grouped_w4a16`` on the GPU (`pytest -m gpu`): fp16 and bf16 against the fp64
reference of ``x @ dequantize(w)[g].T`` per expert, on Mixtral-like experts scaled down (8 experts, skewed routing
with empty and one-row experts, rows past ``offs[-1]``), gated and not, with bias and activations; the pass bit for
bit ``dequantize``; ``auto`` choosing it at prefill sizes and its product running on ``tma`` on Hopper; slices of a
weight over the memory bound; a CUDA graph replayed after ``offs`` changes, equal to a fresh call; and no record on
the host fast path (the scratch is each call's own)."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core import registry
from tilegemm.core.activations import torch_activation
from tilegemm.core.hardware import why_not_gluon, why_not_tma
from tilegemm.core.runtime import new_output
from tilegemm.ops.grouped import configs, dequant, dispatch
from tilegemm.ops.grouped.api import moe_gate_up_int4
from tilegemm.ops.grouped.op import REPLAYS, forward_int4
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KERNEL = "dequant_grouped"
DTYPES = [torch.float16, torch.bfloat16]
# skewed, as routing makes them: empty experts (first, middle, last), one row, sizes off the 128-row tile; 266 rows an
# expert on average (M / E): auto's prefill route, and tma's share of the 16-bit product on Hopper
SKEWED = [0, 700, 0, 1, 300, 129, 1000, 0]
TAIL = 37


def experts(E, N, K, dtype, group_size=128):
    w = torch.randn(E, N, K, device="cuda", dtype=torch.float32) / K ** 0.5
    return tilegemm.w4a16.quantize(w.to(dtype), group_size=group_size)


def offs_of(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


def reference(x, w, offs, bias=None, activation="none", gated=False):
    full = grouped_mm_reference(x, tilegemm.w4a16.dequantize(w).transpose(1, 2), offs, bias=bias)
    if gated:
        half = full.shape[1] // 2
        return torch_activation(full[:, :half], activation) * full[:, half:]
    return torch_activation(full, activation)


def run(x, w, offs, bias=None, activation="none", gated=False, kernel=KERNEL):
    return forward_int4(x, w.qweight, w.scales, w.zeros, offs, bias, w.group_k, activation, gated, kernel)


def spy(monkeypatch, op, name):
    """The problems the launcher of ``op``/``name`` is called with, from now on."""
    calls = []
    real = registry.launcher(op, name)
    monkeypatch.setitem(registry._LAUNCHERS, (op, name), lambda p, *a: (calls.append(p), real(p, *a))[1])
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size, K", [(128, 512), (-1, 200)])
def test_pass_is_dequantize_bit_for_bit(dtype, group_size, K):
    w = experts(8, 448, K, dtype, group_size)
    x = torch.empty(8, K, device="cuda", dtype=dtype)
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs_of([1, 1, 0, 1, 1, 1, 1, 1]), None,
                           torch.empty(8, 448, device="cuda", dtype=dtype), 8, 8, 448, K, w.group_k)
    scratch = new_output((8, 448, K), dtype, "cuda")
    dequant.dequantize_experts(p, scratch, 0, 448)
    full = tilegemm.w4a16.dequantize(w)
    assert torch.isnan(scratch[2]).all()  # expert 2 gets no rows: skipped
    assert torch.equal(scratch[[0, 1, 3, 4, 5, 6, 7]], full[[0, 1, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("group_size, K", [(128, 512), (-1, 200)])
def test_matches_the_reference(monkeypatch, dtype, gated, group_size, K):
    # Mixtral's layers scaled down: 8 experts, the gate/up product (gated, 2 x 448 rows) or a plain one
    n_w = 896 if gated else 448
    w = experts(8, n_w, K, dtype, group_size)
    x = torch.randn(sum(SKEWED) + TAIL, K, device="cuda", dtype=dtype)
    offs = offs_of(SKEWED)
    bias = torch.randn(8, n_w, device="cuda", dtype=dtype)
    act = "silu" if gated else "gelu"
    calls = spy(monkeypatch, "grouped_w4a16", KERNEL)
    out = run(x, w, offs, bias, act, gated, kernel="auto")
    assert len(calls) == 1  # auto's prefill route
    assert_rel_close(out, reference(x, w, offs, bias, act, gated), tolerance(dtype))
    assert torch.equal(out[-TAIL:], torch.zeros_like(out[-TAIL:]))
    plain = run(x, w, offs, None, "none", gated=False, kernel=KERNEL)
    assert_rel_close(plain, reference(x, w, offs), tolerance(dtype))


@pytest.mark.skipif(why_not_tma() is not None, reason="needs a Hopper GPU for TMA")
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_product_runs_on_tma_on_hopper(monkeypatch, gated):
    # the 16-bit product on the scratch takes the 16-bit forward's rule: the plain one gluon where Gluon runs
    # and the experts have rows enough, the rest tma
    calls = {name: spy(monkeypatch, "grouped", name) for name in ("tma", "gluon")}
    w = experts(8, 512, 512, torch.bfloat16)
    x = torch.randn(sum(SKEWED), 512, device="cuda", dtype=torch.bfloat16)
    offs = offs_of(SKEWED)
    out = run(x, w, offs, None, "silu" if gated else "none", gated)
    want = "gluon" if not gated and why_not_gluon() is None else "tma"
    assert sum(SKEWED) >= configs.TMA_HALF_TILE_MAX_ROWS * 8  # gluon's rows an expert
    assert [len(calls["tma"]), len(calls["gluon"])] == ([1, 0] if want == "tma" else [0, 1])
    assert calls[want][0].b.stride(1) == 1  # the scratch [E, N, K], read column-major
    assert_rel_close(out, reference(x, w, offs, None, "silu" if gated else "none", gated), tolerance(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_sliced_weight(monkeypatch, dtype, gated):
    # a bound of 256 output columns' scratch: 640 columns run as slices of 256, 256 and 128
    K, n_out = 256, 640
    per_column = 8 * K * 2 * (2 if gated else 1)
    monkeypatch.setattr(dispatch, "INT4_DEQUANT_MAX_BYTES", per_column * 256 + 100)
    w = experts(8, 2 * n_out if gated else n_out, K, dtype)
    x = torch.randn(sum(SKEWED) + TAIL, K, device="cuda", dtype=dtype)
    offs = offs_of(SKEWED)
    bias = torch.randn(8, w.shape[1], device="cuda", dtype=dtype)
    slices = []
    real = dequant.dequantize_experts
    monkeypatch.setattr(dequant, "dequantize_experts", lambda p, s, n0, c: (slices.append((n0, c)),
                                                                             real(p, s, n0, c))[1])
    out = run(x, w, offs, bias, "silu", gated)
    assert slices == [(0, 256), (256, 256), (512, 128)]
    assert_rel_close(out, reference(x, w, offs, bias, "silu", gated), tolerance(dtype))
    assert torch.equal(out[-TAIL:], torch.zeros_like(out[-TAIL:]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_cuda_graph_replays_with_new_group_sizes(dtype, gated):
    w = experts(8, 512, 256, dtype)
    bias = torch.randn(8, 512, device="cuda", dtype=dtype)
    M = sum(SKEWED) + TAIL
    x = torch.randn(M, 256, device="cuda", dtype=dtype)
    offs = offs_of(SKEWED)

    def call():
        if gated:
            return moe_gate_up_int4(x, w, offs, bias=bias)
        return tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation="relu")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for sizes in ([300, 0, 0, 900, 1, 0, 929, 0], [2130] + [0] * 7, [266] * 8):
        offs.copy_(offs_of(sizes))
        x.copy_(torch.randn(M, 256, device="cuda", dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        act = "silu" if gated else "relu"
        assert_rel_close(out, reference(x, w, offs, bias, act, gated), tolerance(dtype))
        assert torch.equal(out, run(x, w, offs, bias, act, gated, kernel="auto"))  # the graph = a fresh call
        assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))


def test_not_recorded_for_the_host_fast_path():
    # the scratch is each call's own: nothing is recorded, and each call runs the full path, alike
    REPLAYS.clear()
    w = experts(8, 448, 512, torch.float16)
    x = torch.randn(sum(SKEWED), 512, device="cuda", dtype=torch.float16)
    offs = offs_of(SKEWED)
    first = tilegemm.w4a16.grouped_matmul(x, w, offs)
    again = tilegemm.w4a16.grouped_matmul(x, w, offs)
    assert REPLAYS.count() == 0
    assert torch.equal(first, again)
    small = tilegemm.w4a16.grouped_matmul(x[:64], w, offs_of([8] * 8))  # decode-like: frag on Hopper (else dequant_dot), recorded
    assert REPLAYS.count() == 1
    assert_rel_close(small, reference(x[:64], w, offs_of([8] * 8)), tolerance(torch.float16))
