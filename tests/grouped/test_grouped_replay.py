"""The grouped family's host fast path (tilegemm.core.replay; keys in tilegemm.ops.grouped.checks) without running a
replay: what the keys hold, that nothing is replayed off the GPU, and what the launchers hand a recording. Replays
themselves: test_grouped_replay_gpu.py."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.replay import cache
from tilegemm.core.runtime import interpreting
from tilegemm.ops.grouped import checks
from tilegemm.ops.grouped.api import moe_gate_up
from tilegemm.ops.grouped.reference import grouped_mm_reference
from tilegemm.ops.grouped.tiled import workspace_launch

from conftest import assert_rel_close
from test_grouped_layouts import operands
from test_grouped_int4_unpack import random_experts

SIZES = [3, 0, 5]


def key(a, b, offs, bias=None, out_dtype=None, precision="ieee", kernel="auto"):
    return checks.key_of(a, b, offs, bias, out_dtype, precision, kernel)


def test_same_layout_same_key_whatever_the_values():
    a, b, offs = operands("2d3d", SIZES, 32, 16, torch.float32, "cpu")
    a2, b2, _ = operands("2d3d", SIZES, 32, 16, torch.float32, "cpu")
    other_sizes = torch.tensor([0, 0, 8], dtype=torch.int32)  # other group sizes, the same offs layout
    assert key(a, b, offs) == key(a2, b2, other_sizes)


def test_keys_differ_where_triton_specializes_or_the_config_reads():
    a, b, offs = operands("2d3d", SIZES, 32, 16, torch.float32, "cpu")
    base = key(a, b, offs)
    others = {"base": base}
    for layout in ("3d3d", "2d2d", "3d2d"):
        others[layout] = key(*operands(layout, SIZES, 32, 16, torch.float32, "cpu"))
    others["b column-major"] = key(a, operands("2d3d", SIZES, 32, 16, torch.float32, "cpu", b_transposed=True)[1],
                                   offs)
    others["fp16"] = key(a.half(), b.half(), offs)
    others["bf16"] = key(a.bfloat16(), b.bfloat16(), offs)
    others["rows"] = key(torch.randn(9, 32), b, offs)
    others["K"] = key(torch.randn(8, 48), torch.randn(3, 48, 16), offs)
    others["groups"] = key(a, torch.randn(4, 32, 16), torch.tensor([1, 2, 3, 8], dtype=torch.int32))
    others["bias [N]"] = key(a, b, offs, torch.randn(16))
    others["bias [G, N]"] = key(a, b, offs, torch.randn(3, 16))
    others["out_dtype"] = key(a, b, offs, out_dtype=torch.float32)
    others["tf32"] = key(a, b, offs, precision="tf32")
    others["kernel"] = key(a, b, offs, kernel="tiled")
    others["a misaligned"] = key(torch.randn(8 * 32 + 1)[1:].view(8, 32), b, offs)  # 4-byte aligned only
    others["a row stride"] = key(torch.randn(8, 40)[:, :32], b, offs)
    others["offs strided"] = key(a, b, torch.zeros(6, dtype=torch.int32)[::2])
    assert len(set(others.values())) == len(others), "two different calls share a replay key"
    x, w, o = a, torch.randn(3, 32, 32), offs  # the gated product (b of 2N columns) has keys of its own
    gated = checks.gated_key_of(x, w, o, None, "silu", "ieee")
    assert gated != key(x, w, o)
    assert gated != checks.gated_key_of(x, w, o, None, "gelu", "ieee")
    assert gated != checks.gated_key_of(x, w, o, torch.randn(3, 32), "silu", "ieee")


def test_int4_keys():
    w = random_experts(3, 32, 64, 32, torch.float16)
    x = torch.randn(8, 64, dtype=torch.float16)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    base = checks.int4_key_of(x, w, offs, None, "none", False, "auto")
    # another weight of the same layout, other activations and group sizes: the same key
    assert base == checks.int4_key_of(torch.randn(8, 64, dtype=torch.float16), random_experts(3, 32, 64, 32,
                                      torch.float16), torch.tensor([0, 1, 2], dtype=torch.int32), None, "none",
                                      False, "auto")
    others = {
        "base": base,
        "activation": checks.int4_key_of(x, w, offs, None, "silu", False, "auto"),
        "gated": checks.int4_key_of(x, w, offs, None, "silu", True, "auto"),
        "bias [N]": checks.int4_key_of(x, w, offs, torch.randn(32, dtype=torch.float16), "none", False, "auto"),
        "bias [E, N]": checks.int4_key_of(x, w, offs, torch.randn(3, 32, dtype=torch.float16), "none", False, "auto"),
        "group": checks.int4_key_of(x, random_experts(3, 32, 64, 64, torch.float16), offs, None, "none", False,
                                    "auto"),
        "N": checks.int4_key_of(x, random_experts(3, 48, 64, 32, torch.float16), offs, None, "none", False, "auto"),
        "bf16": checks.int4_key_of(x.bfloat16(), random_experts(3, 32, 64, 32, torch.bfloat16), offs, None, "none",
                                   False, "auto"),
        "rows": checks.int4_key_of(x[:5], w, offs, None, "none", False, "auto"),
        "kernel": checks.int4_key_of(x, w, offs, None, "none", False, "dequant_dot"),
    }
    assert len(set(others.values())) == len(others), "two different calls share a replay key"


def test_nothing_is_replayed_off_the_gpu():
    # CPU tensors have no replay key, on any machine (nothing runs here)
    a, b, offs = operands("2d3d", SIZES, 32, 16, torch.float32, "cpu")
    assert checks.replay_key(a, b, offs, None, None, "auto") is None  # CPU / the interpreter
    assert checks.gated_replay_key(a, torch.randn(3, 32, 32), offs, None, "silu") is None
    w = random_experts(3, 32, 32, 32, torch.float16)
    assert checks.int4_replay_key(a.half(), w, offs, None, "none") is None
    assert checks.int4_replay_key(a.half(), "not a weight", offs, None, "none") is None


@pytest.mark.skipif(not interpreting(), reason="the interpreter's calls (on a GPU the calls are recorded and "
                    "replayed: test_grouped_replay_gpu.py)")
def test_the_interpreters_calls_record_nothing(device):
    a, b, offs = operands("2d3d", SIZES, 32, 16, torch.float32, device)
    w = random_experts(3, 32, 32, 32, torch.float16, device)
    cache("grouped").clear()
    out = tilegemm.grouped_mm(a, b, offs=offs)
    assert_rel_close(out, grouped_mm_reference(a, b, offs), 1e-5)
    moe_gate_up(a, torch.randn(3, 32, 32, device=device), offs)
    tilegemm.w4a16.grouped_matmul(a.half(), w, offs)
    assert cache("grouped").count() == 0


def test_split_launches_keep_their_workspace_for_their_stream(device):
    from tilegemm.core.launch import current_stream

    out = torch.empty(4, 4, device=device)
    ws, count = torch.empty(64, device=device), torch.zeros(8, dtype=torch.int32, device=device)
    assert workspace_launch(out, 1, out, out) == {}  # no split: the output stands in, a call's own tensor
    kw = workspace_launch(out, 2, ws, count)
    assert kw["keep"] == (ws, count)
    # held to the current stream on the GPU; a CPU launch has no stream to hold it to
    assert kw["stream"] == (current_stream() if out.is_cuda else None)


def test_bench_host_probe_only_on_the_gpu():
    from tilegemm.bench.base import bench_op

    assert bench_op("grouped").overhead_probe("cpu") is None
    assert bench_op("grouped_w4a16").overhead_probe("cpu") is None


# --- what a replay of the recorded launch needs, checked on the launch's arguments (no kernel runs; the device
# fixture's tensors, so on a GPU these are the arguments of a GPU launch) ----------------------------------------


def launches(monkeypatch, module):
    """The launches ``module``'s launcher makes, as (grid, args, flags, keep), instead of making them."""
    seen = []
    monkeypatch.setattr(module, "launch", lambda kernel, grid, args, flags, keep=(), stream=None:
                        seen.append((grid, args, flags, keep)))
    return seen


def assert_replayable(seen, tensors):
    """One launch whose every tensor argument is one of the call's ``tensors`` (the output included) or a
    workspace the launcher keeps: what core.launch.Replay puts in its slots."""
    assert len(seen) == 1, "a grouped call is one launch"
    grid, args, flags, keep = seen[0]
    ours = {t.data_ptr() for t in tensors}
    kept = {t.data_ptr() for t in keep}
    assert not ours & kept
    for v in list(args) + list(flags.values()):
        if isinstance(v, torch.Tensor):
            assert v.data_ptr() in ours | kept, "a tensor argument a replay could not supply"


def scalars(launch):
    grid, args, flags, _ = launch
    return grid, [None if isinstance(v, torch.Tensor) else v for v in args], flags


# (layout, K slices): the K split is for the row-jagged products (2-D x 3-D, and 3-D x 2-D as its transpose)
@pytest.mark.parametrize("layout, split", [("2d3d", 1), ("2d3d", 2), ("3d3d", 1), ("2d2d", 1), ("3d2d", 1),
                                           ("3d2d", 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_launch_is_replayable_and_independent_of_offs_values(monkeypatch, layout, split, with_bias, device):
    from tilegemm.ops.grouped import tiled
    from tilegemm.ops.grouped.problem import make_problem, out_shape

    seen = launches(monkeypatch, tiled)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=split, num_warps=4, num_stages=1)
    for sizes in (SIZES, [0, 8, 0]):  # other group sizes, the same layouts
        a, b, _ = operands(layout, SIZES, 32, 16, torch.float32, device)
        offs = None if layout == "3d3d" else torch.tensor(sizes, dtype=torch.int32,
                                                          device=device).cumsum(0, dtype=torch.int32)
        groups = 3
        bias = torch.randn(b.shape[-1], device=device) if with_bias else None
        out = torch.empty(out_shape(layout, a.shape, b.shape, groups), device=device)
        tiled.run(make_problem(layout, groups, a, b, offs, bias, out), config)
        assert_replayable(seen[-1:], [t for t in (a, b, offs, bias, out) if t is not None])
        if split > 1:
            assert seen[-1][3], "the K split's workspace is kept by the launch"
    assert scalars(seen[0]) == scalars(seen[1]), "the launch depends on the values of offs"


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("gated", [False, True])
def test_int4_launch_is_replayable_and_independent_of_offs_values(monkeypatch, split, gated, device):
    from tilegemm.ops.grouped import int4
    from tilegemm.ops.grouped.problem import GroupedInt4Problem

    seen = launches(monkeypatch, int4)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=split, num_warps=4, num_stages=1)
    w = random_experts(3, 32, 64, 32, torch.float16, device)
    n_out = 16 if gated else 32
    for sizes in (SIZES, [8, 0, 0]):
        x = torch.randn(9, 64, dtype=torch.float16, device=device)
        offs = torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
        bias = torch.randn(3, 32, dtype=torch.float16, device=device)
        out = torch.empty(9, n_out, dtype=torch.float16, device=device)
        int4.run(GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, bias, out, 3, 9, n_out, 64, w.group_k,
                                    "silu", gated), config)
        assert_replayable(seen[-1:], (x, w.qweight, w.scales, w.zeros, offs, bias, out))
        if split > 1:
            assert seen[-1][3], "the K split's workspace is kept by the launch"
    assert scalars(seen[0]) == scalars(seen[1]), "the launch depends on the values of offs"


@pytest.mark.parametrize("with_bias", [False, True])
def test_tma_launch_is_replayable_and_independent_of_offs_values(monkeypatch, with_bias, device):
    from tilegemm.ops.grouped import tma
    from tilegemm.ops.grouped.problem import make_problem

    seen = launches(monkeypatch, tma)
    for sizes in (SIZES, [0, 0, 8]):
        a, b, _ = operands("2d3d", SIZES, 32, 32, torch.float16, device, b_transposed=True)
        offs = torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
        bias = torch.randn(3, 32, dtype=torch.float16, device=device) if with_bias else None
        out = torch.empty(8, 32, dtype=torch.float16, device=device)
        tma.run(make_problem("2d3d", 3, a, b, offs, bias, out))
        assert_replayable(seen[-1:], [t for t in (a, b, offs, bias, out) if t is not None])
    assert scalars(seen[0]) == scalars(seen[1]), "the launch depends on the values of offs"
