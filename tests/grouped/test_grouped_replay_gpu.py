"""On the GPU (`pytest -m gpu`): the grouped family's host fast path. A plain call is recorded once and later calls
of its key replay its launch with their own tensors: right for every layout, with new group sizes (empty groups
too), with the K split back to back, inside and around a CUDA graph, on another stream; bit for bit what the
full path (the registered op, taken under autograd) gives."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.launch import current_stream
from tilegemm.core.replay import cache
from tilegemm.ops.grouped import checks, configs
from tilegemm.ops.grouped.api import moe_gate_up, moe_gate_up_int4
from tilegemm.ops.grouped.problem import GroupedInt4Problem, make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_layouts import offs_of, operands

pytestmark = pytest.mark.gpu

REPLAYS = cache("grouped")
LAYOUTS = ["2d3d", "3d3d", "2d2d", "3d2d"]
FIRST = [130, 0, 1, 257, 17, 0, 64]  # recorded with these group sizes (469, and a tail of 5: 474 in all) ...
LATER = ([0, 0, 0, 0, 0, 0, 474], [474, 0, 0, 0, 0, 0, 0], [0] * 7, [1, 2, 3, 4, 5, 6, 7], [60] * 7)  # ... replayed


def fresh(*args, **kwargs):
    """The call through the registered op (autograd watching a): never a replay, never recorded."""
    a, rest = args[0], args[1:]
    return kwargs.pop("fn")(a.detach().clone().requires_grad_(True), *rest, **kwargs).detach()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("b_transposed", [False, True])
def test_each_layout_replays_right_with_new_tensors_and_group_sizes(layout, dtype, b_transposed):
    REPLAYS.clear()
    tol = tolerance(dtype)
    for trial, sizes in enumerate((FIRST,) + LATER):
        a, b, offs = operands(layout, FIRST, 200, 136, dtype, "cuda", tail=5, b_transposed=b_transposed, M=129)
        if offs is not None:
            offs = offs_of(sizes, "cuda")  # new values, the same layout: the replay reads them on the device
        bias = torch.randn(b.shape[-1], device="cuda", dtype=dtype)
        out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
        assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), tol)
        assert REPLAYS.count() == 1, "one key, recorded by the first call"
        entry = next(iter(REPLAYS.entries.values()))
        if trial == 0:
            first = entry
        assert entry is first, "later calls replay the first call's entry (a declined replay records anew)"
        want = fresh(a, b, fn=tilegemm.grouped_mm, offs=offs, bias=bias)
        assert torch.equal(out, want), "a replay must give the bits of a fresh launch"


def test_a_new_key_is_recorded_once():
    REPLAYS.clear()
    a, b, offs = operands("2d3d", [5, 0, 70], 64, 96, torch.bfloat16, "cuda")
    calls = [
        lambda: tilegemm.grouped_mm(a, b, offs=offs),
        lambda: tilegemm.grouped_mm(a, b, offs=offs, bias=torch.randn(96, device="cuda", dtype=torch.bfloat16)),
        lambda: tilegemm.grouped_mm(a, b, offs=offs, out_dtype=torch.float32),
        lambda: tilegemm.grouped_mm(a, b, offs=offs, kernel="tiled"),
        lambda: tilegemm.grouped_mm(a[:40], b, offs=offs_of([5, 0, 35], "cuda")),
        lambda: tilegemm.grouped_mm(a.float(), b.float(), offs=offs),
    ]
    for n, call in enumerate(calls, 1):
        for _ in range(3):
            call()
        assert REPLAYS.count() == n
    # torch's fp32 setting is part of the key: tf32 is never served an ieee recording
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        out = tilegemm.grouped_mm(a.float(), b.float(), offs=offs)
    finally:
        torch.set_float32_matmul_precision(old)
    assert REPLAYS.count() == len(calls) + 1
    assert_rel_close(out, grouped_mm_reference(a.float(), b.float(), offs), tolerance(torch.float32, "tf32"))


def test_not_recorded_under_autograd_or_a_capture():
    REPLAYS.clear()
    a, b, offs = operands("2d3d", [5, 0, 70], 64, 96, torch.bfloat16, "cuda")
    tilegemm.grouped_mm(a.requires_grad_(True), b, offs=offs).sum().backward()
    assert REPLAYS.count() == 0
    a = a.detach()
    tilegemm.grouped_mm(a, b, offs=offs)  # compiled (and recorded) outside the capture
    assert REPLAYS.count() == 1
    REPLAYS.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilegemm.grouped_mm(a, b, offs=offs)
    assert REPLAYS.count() == 0, "a call inside a capture is not recorded"
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))


# --- decode sizes: the K split --------------------------------------------------------------------------------

E, K, N, M = 16, 2048, 512, 8  # 8 rows over 16 experts: both kernels split K (asserted below)


def decode_operands():
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # experts stored [E, N, K]
    w4 = tilegemm.w4a16.quantize(torch.randn(E, 2 * N, K, device="cuda", dtype=torch.bfloat16), group_size=128)
    offs = offs_of([1, 0, 0, 2, 0, 1, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0], "cuda")
    return a, b, w4, offs


def decode_calls(a, b, w4, offs):
    """Every replayed entry on the decode problem: 16-bit, 16-bit gated, 4-bit, 4-bit gated."""
    return (tilegemm.grouped_mm(a, b, offs=offs), moe_gate_up(a, torch.cat([b, b], 2), offs),
            tilegemm.w4a16.grouped_matmul(a, w4, offs, activation="silu"), moe_gate_up_int4(a, w4, offs))


def check_decode(outs, a, b, w4, offs):
    tol = tolerance(torch.bfloat16)
    full = grouped_mm_reference(a, b, offs)
    deq = grouped_mm_reference(a, tilegemm.w4a16.dequantize(w4).transpose(1, 2), offs)
    assert_rel_close(outs[0], full, tol)
    assert_rel_close(outs[1], torch.nn.functional.silu(full) * full, tol)
    assert_rel_close(outs[2], torch.nn.functional.silu(deq), tol)
    assert_rel_close(outs[3], torch.nn.functional.silu(deq[:, :N]) * deq[:, N:], tol)


def test_the_decode_problem_splits_k():
    a, b, w4, offs = decode_operands()
    out = torch.empty(M, 2 * N, device="cuda", dtype=torch.bfloat16)
    assert configs.choose_config(make_problem("2d3d", E, a, b, offs, None, out[:, :N]))["SPLIT_K"] > 1
    gated = make_problem("2d3d", E, a, torch.cat([b, b], 2), offs, None, out[:, :N], activation="silu", gated=True)
    assert configs.choose_config(gated)["SPLIT_K"] > 1
    for n_out, is_gated in ((2 * N, False), (N, True)):
        p = GroupedInt4Problem(a, w4.qweight, w4.scales, w4.zeros, offs, None, out[:, :n_out], E, M, n_out, K,
                               w4.group_k, "silu", is_gated)
        assert configs.int4_config(p)["SPLIT_K"] > 1


def test_decode_split_k_replays_back_to_back():
    REPLAYS.clear()
    a, b, w4, offs = decode_operands()
    first = decode_calls(a, b, w4, offs)
    assert REPLAYS.count() == 4
    runs = [decode_calls(a, b, w4, offs) for _ in range(5)]  # replays, no sync between them
    torch.cuda.synchronize()
    check_decode(first, a, b, w4, offs)
    for outs in runs:
        for x, y in zip(first, outs):
            assert torch.equal(x, y), "a replayed K split must give the bits of the recorded call"
    for sizes in ([8] + [0] * 15, [0] * 15 + [8], [0] * 16, [1] * 8 + [0] * 8):  # new group sizes, back to back
        offs2 = offs_of(sizes, "cuda")
        outs = decode_calls(a, b, w4, offs2)
        check_decode(outs, a, b, w4, offs2)
    assert REPLAYS.count() == 4


@pytest.mark.parametrize("same_stream", [False, True], ids=["capture_stream", "recording_stream"])
def test_decode_split_k_in_a_cuda_graph_around_replays(same_stream):
    # Recorded eagerly on a stream, then captured (on torch's capture stream, or on the recording's own stream):
    # the capture takes the full path, its counters zeroed inside the graph; graph replays and eager replays
    # interleave on that stream afterwards.
    REPLAYS.clear()
    a, b, w4, offs = decode_operands()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_calls(a, b, w4, offs)  # compiled and recorded on `side`
        assert REPLAYS.count() == 4
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side if same_stream else None):
            outs = decode_calls(a, b, w4, offs)
        for sizes in ([1, 0, 0, 2, 0, 1, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0], [0] * 15 + [8], [8] * 16, [0] * 16):
            offs.copy_(offs_of(sizes, "cuda"))
            graph.replay()
            eager = decode_calls(a, b, w4, offs)  # replays on `side` between graph replays
            graph.replay()
            side.synchronize()
            check_decode(outs, a, b, w4, offs)
            check_decode(eager, a, b, w4, offs)
    torch.cuda.current_stream().wait_stream(side)


def test_a_split_replay_declines_on_another_stream():
    REPLAYS.clear()
    a, b, w4, offs = decode_operands()
    tilegemm.grouped_mm(a, b, offs=offs)  # recorded on the current stream, its workspace kept for it
    key = checks.replay_key(a, b, offs, None, None, "auto")
    replay = REPLAYS.get(key)
    assert replay is not None and replay.stream == current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        spare = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        assert replay(a, b, offs, spare) is False, "a split replay must not launch on another stream"
        out = tilegemm.grouped_mm(a, b, offs=offs)  # launched afresh there (and recorded for that stream)
        w = tilegemm.w4a16.grouped_matmul(a, w4, offs)
    side.synchronize()
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))
    deq = tilegemm.w4a16.dequantize(w4).transpose(1, 2)
    assert_rel_close(w, grouped_mm_reference(a, deq, offs), tolerance(torch.bfloat16))
    assert REPLAYS.get(key).stream == side.cuda_stream


def test_int4_and_gated_replays_equal_the_full_path():
    REPLAYS.clear()
    w4 = tilegemm.w4a16.quantize(torch.randn(5, 192, 256, device="cuda", dtype=torch.float16), group_size=64)
    bias = torch.randn(5, 192, device="cuda", dtype=torch.float16)
    deq = tilegemm.w4a16.dequantize(w4).transpose(1, 2)
    for sizes in ([30, 0, 1, 60, 9], [0, 0, 0, 0, 100], [20] * 5):
        x = torch.randn(105, 256, device="cuda", dtype=torch.float16)
        offs = offs_of(sizes, "cuda")
        y = tilegemm.w4a16.grouped_matmul(x, w4, offs, bias=bias, activation="gelu")
        want = grouped_mm_reference(x, deq, offs, bias=bias)
        assert_rel_close(y, torch.nn.functional.gelu(want), 4e-3)
        assert torch.equal(y, fresh(x, w4, offs, fn=tilegemm.w4a16.grouped_matmul, bias=bias, activation="gelu"))
        g = moe_gate_up_int4(x, w4, offs, bias=bias)
        assert_rel_close(g, torch.nn.functional.silu(want[:, :96]) * want[:, 96:], 4e-3)
        assert torch.equal(g, fresh(x, w4, offs, fn=moe_gate_up_int4, bias=bias))
        b = deq.contiguous()
        h = moe_gate_up(x, b, offs, bias=bias)
        assert torch.equal(h, fresh(x, b, offs, fn=moe_gate_up, bias=bias))
    assert REPLAYS.count() == 3


@pytest.mark.parametrize("name", ["grouped", "grouped_w4a16"])
def test_bench_host_probe_runs_both_sides_alike(name):
    from tilegemm.bench.base import bench_op

    REPLAYS.clear()
    ours, theirs = bench_op(name).overhead_probe("cuda")
    first, again, want = ours(), ours(), theirs()  # the second call is a replay
    assert REPLAYS.count() == 1
    assert_rel_close(first, want.double(), tolerance(torch.bfloat16))
    assert torch.equal(first, again)
