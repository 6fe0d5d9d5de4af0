"""Kernel ``frag`` of ``grouped_w4a16`` on an sm_90 GPU (``pytest -m gpu``): fp16 and bf16 against the fp64 reference
of ``x @ dequantize(w)[g].T`` per expert, into NaN-poisoned outputs (every element must be written; rows past
``offs[-1]`` zero), over skewed routing with empty experts (first, middle, last), one-row experts and experts of more
rows than a program's row tile; every group length (32, 64, 128, 256, all of K with K no multiple of 64); bias
``[N]`` and ``[E, N]``, activations, the gated gate/up product (its halves no multiple of 16 rows); every row tile
with and without a K split; one-hot rows returning the dequantized weight bit for bit; ``auto`` choosing it at
decode sizes; a CUDA graph replayed with new ``offs``; the host fast path's replays."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core import registry
from tilegemm.core.hardware import why_not_gluon
from tilegemm.core.runtime import new_output
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.api import moe_gate_up_int4
from tilegemm.ops.grouped.op import REPLAYS, forward_int4
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.reference import tolerance

from conftest import assert_rel_close
from test_grouped_int4_prefill_gpu import offs_of, reference  # the 4-bit experts' offsets and fp64 reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
hopper = pytest.mark.skipif(torch.cuda.is_available() and why_not_gluon() is not None,
                            reason="kernel frag is Gluon for sm_90")

KERNEL = "frag"
DTYPES = [torch.float16, torch.bfloat16]
# skewed routing over 8 experts: empty first, middle and last; one-row experts; one of more rows than any row tile
# (64: the program loops over its row blocks); 7 rows past offs[-1]
SKEWED = [0, 1, 70, 0, 3, 1, 17, 0]
TAIL = 7
# every group length the layout takes, K per group length (all of K: 200, no multiple of the 64-step)
GROUPS = [(32, 256), (64, 256), (128, 384), (256, 512), (-1, 200)]


def experts(E, N, K, dtype, group_size=128, symmetric=False):
    w = torch.randn(E, N, K, device="cuda", dtype=torch.float32) / K ** 0.5
    return tilegemm.w4a16.quantize(w.to(dtype), group_size=group_size, symmetric=symmetric)


def run(x, w, offs, bias=None, activation="none", gated=False, kernel=KERNEL):
    """The op's forward with the fragments a call passes (gated: of the gated row order)."""
    fw, fzs = w.fragments(gated)
    return forward_int4(x, w.qweight, w.scales, w.zeros, offs, bias, w.group_k, activation, gated, kernel, fw, fzs)


def run_config(x, w, offs, cfg, bias=None, activation="none", gated=False):
    """The launcher with config ``cfg``, into a NaN-poisoned output."""
    from tilegemm.ops.grouped import frag

    E, N, K = w.shape
    n_out = N // 2 if gated else N
    out = new_output((x.shape[0], n_out), x.dtype, x.device)
    fw, fzs = w.fragments(gated)
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, bias, out, E, x.shape[0], n_out, K, w.group_k,
                           activation, gated, fw, fzs)
    frag.run(p, cfg)
    return out


def spy(monkeypatch, op, name):
    """The problems the launcher of ``op``/``name`` is called with, from now on."""
    calls = []
    real = registry.launcher(op, name)
    monkeypatch.setitem(registry._LAUNCHERS, (op, name), lambda p, *a: (calls.append(p), real(p, *a))[1])
    return calls


def check_tail(out, sizes):
    rows = sum(sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:])), "rows past offs[-1] must be zero"


@hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size, K", GROUPS)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_matches_the_reference(dtype, group_size, K, gated):
    # N = 200 (no multiple of a program's 64 rows); gated 2 x 100 (each half padded to 112 rows)
    n_w = 200
    w = experts(8, n_w, K, dtype, group_size)
    x = torch.randn(sum(SKEWED) + TAIL, K, device="cuda", dtype=dtype)
    offs = offs_of(SKEWED)
    tol = tolerance(dtype)
    out = run(x, w, offs)
    assert_rel_close(out, reference(x, w, offs), tol)
    check_tail(out, SKEWED)
    bias = torch.randn(8, n_w, device="cuda", dtype=dtype)
    act = "silu" if gated else "gelu"
    out = run(x, w, offs, bias, act, gated)
    assert_rel_close(out, reference(x, w, offs, bias, act, gated), tol)
    check_tail(out, SKEWED)
    bias_n = torch.randn(n_w, device="cuda", dtype=dtype)  # one bias row for every expert
    out = run(x, w, offs, bias_n, "relu", gated)
    assert_rel_close(out, reference(x, w, offs, bias_n, "relu", gated), tol)
    check_tail(out, SKEWED)


@hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bm", [8, 16, 32, 64])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_every_row_tile_and_split(dtype, bm, split, gated):
    # experts of 0, 1, bm - 1, bm, bm + 1 and 3 bm + 5 rows: row blocks cut at every place; K = 1024 in 3 slices of
    # 6, 6 and 4 steps (symmetric weights, group 64)
    sizes = [0, 1, bm - 1, bm, 0, bm + 1, 3 * bm + 5, 0]
    w = experts(8, 320 if gated else 192, 1024, dtype, 64, symmetric=True)
    x = torch.randn(sum(sizes) + TAIL, 1024, device="cuda", dtype=dtype)
    offs = offs_of(sizes)
    bias = torch.randn(8, w.shape[1], device="cuda", dtype=dtype)
    act = "silu" if gated else "none"
    cfg = dict(BM=bm, RH=1, num_warps=4, STAGES=4, SPLIT_K=split)
    out = run_config(x, w, offs, cfg, bias, act, gated)
    assert_rel_close(out, reference(x, w, offs, bias, act, gated), tolerance(dtype))
    check_tail(out, sizes)
    again = run_config(x, w, offs, cfg, bias, act, gated)  # the counters were reset; the sum's order is fixed
    assert torch.equal(out, again)


@hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("split", [1, 2])
def test_many_experts_few_rows(dtype, gated, split):
    # fewer rows than experts (COMPACT: a slot per possible non-empty expert): 64 experts, 6 rows (the first, the
    # last, one of two rows) and 3 past offs[-1]; then every row to one expert, and none
    E, K = 64, 512
    w = experts(E, 256, K, dtype, 128)
    bias = torch.randn(E, 256, device="cuda", dtype=dtype)
    act = "silu" if gated else "gelu"
    cfg = dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=split)
    for rows in ({0: 1, 17: 2, 40: 1, 63: 1}, {5: 6}, {}):
        sizes = [rows.get(e, 0) for e in range(E)]
        x = torch.randn(6 + 3, K, device="cuda", dtype=dtype)
        offs = offs_of(sizes)
        out = run_config(x, w, offs, cfg, bias, act, gated)
        if rows:
            assert_rel_close(out, reference(x, w, offs, bias, act, gated), tolerance(dtype))
        check_tail(out, sizes)  # (no rows: all of them zero)


@hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size, K", GROUPS)
@pytest.mark.parametrize("split", [1, 2])
def test_one_hot_rows_return_the_dequantized_weight_bit_for_bit(dtype, group_size, K, split):
    # row k of x one-hot at input k: out[k] = W[:, k] exactly (one product, exact in fp32, rounded once)
    E, N = 3, 72
    w = experts(E, N, K, dtype, group_size)
    ks = torch.arange(0, K, max(1, K // 24), device="cuda")[:24]
    x = torch.zeros(E * len(ks), K, device="cuda", dtype=dtype)
    for e in range(E):
        x[e * len(ks) + torch.arange(len(ks), device="cuda"), ks] = 1
    offs = offs_of([len(ks)] * E)
    out = run_config(x, w, offs, dict(BM=16, RH=1, num_warps=4, STAGES=4, SPLIT_K=split))
    full = tilegemm.w4a16.dequantize(w)  # [E, N, K]
    for e in range(E):
        assert torch.equal(out[e * len(ks):(e + 1) * len(ks)], full[e][:, ks].T), f"expert {e}"


@hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_auto_takes_it_at_decode_sizes(monkeypatch, dtype, gated):
    # one token to 2 of 8 experts (the down projection's shape scaled: K split), and 64 tokens (16 rows an expert)
    REPLAYS.clear()  # (a replay would not pass through the launcher)
    calls = spy(monkeypatch, "grouped_w4a16", KERNEL)
    K = 4096
    w = experts(8, 1024 if gated else 512, K, dtype)
    bias = torch.randn(8, w.shape[1], device="cuda", dtype=dtype)
    for sizes in ([0, 1, 0, 0, 0, 1, 0, 0], [20, 10, 0, 31, 9, 40, 12, 6]):
        x = torch.randn(sum(sizes), K, device="cuda", dtype=dtype)
        offs = offs_of(sizes)
        if gated:
            out = moe_gate_up_int4(x, w, offs, bias=bias)
        else:
            out = tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation="silu")
        assert calls and calls[-1].fweight is not None, "auto did not run frag"
        assert_rel_close(out, reference(x, w, offs, bias, "silu", gated), tolerance(dtype))
    n = len(calls)
    wide = torch.randn(8 * dispatch.INT4_FRAG_MAX_ROWS_PER_GROUP + 8, K, device="cuda", dtype=dtype)
    tilegemm.w4a16.grouped_matmul(wide, w, offs_of([wide.shape[0] // 8] * 8))  # past the rule: dequant_dot
    assert len(calls) == n


def sizes_of(E: int, rows: dict) -> list:
    return [rows.get(e, 0) for e in range(E)]


@hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("E, M", [(8, 23), (64, 9)], ids=["8-experts", "64-experts-compact"])
def test_cuda_graph_replays_with_new_group_sizes(dtype, gated, E, M):
    # captured once, replayed after offs changes: rows moved between experts, all to the first or the last, none
    # (every row past offs[-1]); 64 experts over 9 rows take the compact grid (a slot per possible non-empty expert)
    K = 2048  # a K split at these rows
    w = experts(E, 512, K, dtype, 128)
    bias = torch.randn(E, 512, device="cuda", dtype=dtype)
    plans = [{1: 1, 5: 1}, {0: M}, {E - 1: M - 2}, {}, {e: 1 for e in range(0, E, max(1, E // 8))}, {2: 3, 3: 4}]
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    offs = offs_of(sizes_of(E, plans[0]))
    act = "silu" if gated else "relu"

    def call():
        if gated:
            return moe_gate_up_int4(x, w, offs, bias=bias)
        return tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation="relu")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm up (compiles, makes the fragments) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    assert (w._frag_gated if gated else w._frag) is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for plan in plans:
        sizes = sizes_of(E, plan)
        offs.copy_(offs_of(sizes))
        x.copy_(torch.randn(M, K, device="cuda", dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        if plan:
            assert_rel_close(out, reference(x, w, offs, bias, act, gated), tolerance(dtype))
        assert torch.equal(out, run(x, w, offs, bias, act, gated, kernel="auto"))  # the graph = a fresh call
        check_tail(out, sizes)


@hopper
def test_host_fast_path_replays_with_the_calls_fragments():
    # a replay passes this call's weight's fragments: a second weight of the same layout gives its own product
    REPLAYS.clear()
    dtype = torch.float16
    w1, w2 = experts(8, 512, 1024, dtype), experts(8, 512, 1024, dtype)
    sizes = [0, 3, 1, 0, 0, 2, 0, 2]
    x = torch.randn(sum(sizes) + TAIL, 1024, device="cuda", dtype=dtype)
    offs = offs_of(sizes)
    first = tilegemm.w4a16.grouped_matmul(x, w1, offs)
    assert REPLAYS.count() == 1
    assert torch.equal(first, tilegemm.w4a16.grouped_matmul(x, w1, offs))  # replayed
    other = tilegemm.w4a16.grouped_matmul(x, w2, offs)
    assert REPLAYS.count() == 1
    assert_rel_close(other, reference(x, w2, offs), tolerance(dtype))
    offs2 = offs_of([1, 1, 1, 1, 1, 1, 1, 1])
    assert_rel_close(tilegemm.w4a16.grouped_matmul(x, w1, offs2), reference(x, w1, offs2), tolerance(dtype))
    gated = moe_gate_up_int4(x, w1, offs)
    assert torch.equal(gated, moe_gate_up_int4(x, w1, offs))
    assert_rel_close(gated, reference(x, w1, offs, None, "silu", True), tolerance(dtype))


@hopper
def test_misaligned_and_strided_x():
    # x's rows not 16-byte aligned (a view 1 element in) and a strided view: copied first, still right
    dtype = torch.bfloat16
    w = experts(4, 128, 256, dtype, 64)
    sizes = [2, 0, 5, 1]
    buf = torch.randn(sum(sizes) * 256 + 1, device="cuda", dtype=dtype)
    x = buf[1:].view(sum(sizes), 256)
    offs = offs_of(sizes)
    assert_rel_close(run(x, w, offs), reference(x, w, offs), tolerance(dtype))
    wide = torch.randn(sum(sizes), 300, device="cuda", dtype=dtype)[:, 10:266]
    assert_rel_close(run(wide, w, offs), reference(wide, w, offs), tolerance(dtype))
