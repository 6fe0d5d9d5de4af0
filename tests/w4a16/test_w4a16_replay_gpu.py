"""The host fast path of ``dequant_cublas`` calls on a GPU: the dequantization launch replayed (``op.DEQUANTS``), then
the family's cuBLAS half, against fresh calls through the op; back to back, inside a CUDA graph, on another stream."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close

from tilegemm import w4a16
from tilegemm.ops.w4a16 import dispatch, op
from tilegemm.ops.w4a16.reference import reference

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def weight(N, K, dtype=torch.float16, g=128):
    return w4a16.quantize(torch.randn(N, K, dtype=dtype, device="cuda"), g)


@pytest.fixture
def dequant_launches(monkeypatch):
    """Counts the dequantizations launched afresh (a replayed call launches none through the family's path)."""
    calls = []
    fresh = dispatch.dequantized

    def counted(p):
        calls.append(p.M)
        return fresh(p)

    monkeypatch.setattr(dispatch, "dequantized", counted)
    op.REPLAYS.clear()
    op.DEQUANTS.clear()
    yield calls
    op.REPLAYS.clear()
    op.DEQUANTS.clear()


def fresh_call(x, w, bias=None, activation=None, kernel="auto"):
    """The same call through the torch.library op (x requires grad: never keyed, never replayed)."""
    return w4a16.matmul(x.clone().requires_grad_(True), w, bias=bias, activation=activation, kernel=kernel).detach()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias, activation", [(False, None), (True, "silu"), (False, "gelu"), (True, None)])
def test_replayed_dequant_cublas_equals_a_fresh_call(dequant_launches, dtype, with_bias, activation):
    N, K, M = 1280, 1152, 1024
    w = weight(N, K, dtype)
    bias = torch.randn(N, dtype=dtype, device="cuda") if with_bias else None
    for trial in range(3):  # the first call records, the later ones replay with new tensors
        x = torch.randn(M, K, dtype=dtype, device="cuda")
        w2 = weight(N, K, dtype) if trial == 2 else w  # another weight of the same layout: its own tensors
        y = w4a16.matmul(x, w2, bias=bias, activation=activation, kernel="dequant_cublas")
        assert_rel_close(y, reference(x, w2, bias, activation), TOL[dtype])
        assert torch.equal(y, fresh_call(x, w2, bias, activation, "dequant_cublas")), \
            "a replay must give the bits of a fresh call"
    assert dequant_launches == [M], "the later calls must replay the dequantization"
    assert op.DEQUANTS.count() == 1 and op.REPLAYS.count() == 0


def test_auto_at_large_m_replays_on_a_small_weight(dequant_launches):
    # the w4-random sweep's host-bound case: 4096 x 1280 x 1152 (auto: dequant_cublas above the frag kernel's rows)
    w = weight(1280, 1152)
    xs = [torch.randn(4096, 1152, dtype=torch.float16, device="cuda") for _ in range(3)]
    ys = [w4a16.matmul(x, w) for x in xs]
    for x, y in zip(xs, ys):
        assert_rel_close(y, reference(x, w), 2e-3)
    assert dequant_launches == [4096] and op.DEQUANTS.count() == 1


def test_back_to_back_replays_keep_their_weights_apart(dequant_launches):
    # two replays queued without a sync, each with a weight of its own: each dequantized weight is a fresh
    # allocation on the call's stream, so the second cannot overwrite the first's before cuBLAS read it
    N, K, M = 2688, 2304, 2048
    wa, wb = weight(N, K), weight(N, K)
    w4a16.matmul(torch.randn(M, K, dtype=torch.float16, device="cuda"), wa, kernel="dequant_cublas")  # records
    xa, xb = (torch.randn(M, K, dtype=torch.float16, device="cuda") for _ in range(2))
    ya = w4a16.matmul(xa, wa, kernel="dequant_cublas")
    yb = w4a16.matmul(xb, wb, kernel="dequant_cublas")
    torch.cuda.synchronize()
    assert_rel_close(ya, reference(xa, wa), 2e-3)
    assert_rel_close(yb, reference(xb, wb), 2e-3)
    assert dequant_launches == [M]


def test_a_cuda_graph_capture_takes_the_calls_own_path(dequant_launches):
    # a capture never replays a recorded call (core/replay.py: the path's workspaces are marked as the graph's);
    # the captured launches then replay right with new inputs
    N, K, M = 1280, 1152, 4096
    w = weight(N, K)
    bias = torch.randn(N, dtype=torch.float16, device="cuda")
    x = torch.randn(M, K, dtype=torch.float16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch asks before a capture
        for _ in range(2):
            w4a16.matmul(x, w, bias=bias, activation="relu", kernel="dequant_cublas")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16.matmul(x, w, bias=bias, activation="relu", kernel="dequant_cublas")
    assert dequant_launches == [M, M], "the captured call launches afresh, not from the recorded replay"
    for _ in range(2):
        x.copy_(torch.randn(M, K, dtype=torch.float16, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(y, reference(x, w, bias, "relu"), 2e-3)


def test_on_another_stream_still_right(dequant_launches):
    # the launch uses no per-stream workspace (the dequantized weight is each call's own allocation), so a replay
    # on another stream is right and replays there too (gemv's split-K replays decline instead:
    # test_w4a16_replay.py)
    w = weight(1280, 1152)
    x = torch.randn(1024, 1152, dtype=torch.float16, device="cuda")
    want = w4a16.matmul(x, w, kernel="dequant_cublas")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            y = w4a16.matmul(x, w, kernel="dequant_cublas")
            assert torch.equal(y, want)
    side.synchronize()
    assert_rel_close(y, reference(x, w), 2e-3)
    assert dequant_launches == [1024] and op.DEQUANTS.count() == 1


def test_the_cache_grows_once_per_key(dequant_launches):
    w = weight(1664, 2432)
    bias = torch.randn(1664, dtype=torch.float16, device="cuda")
    keys = [(M, b, act) for M in (1024, 1536) for b in (None, bias) for act in (None, "silu")]
    for n, (M, b, act) in enumerate(keys, 1):
        for _ in range(3):
            x = torch.randn(M, 2432, dtype=torch.float16, device="cuda")
            y = w4a16.matmul(x, w, bias=b, activation=act, kernel="dequant_cublas")
            assert op.DEQUANTS.count() == n
        assert_rel_close(y, reference(x, w, b, act), 2e-3)
        x3 = x.view(2, M // 2, 2432)  # [..., K]: the key of its 2-D view, replayed, the output shaped as x
        assert torch.equal(w4a16.matmul(x3, w, bias=b, activation=act, kernel="dequant_cublas").view(M, -1), y)
        assert op.DEQUANTS.count() == n
    assert len(dequant_launches) == len(keys) and op.REPLAYS.count() == 0
