"""tilegemm's modules under ``torch.compile(mode="reduce-overhead")``: torch's CUDA graph trees warm up and
record with every allocation routed into their private pool and refuse a call that leaves anything alive there
but its outputs, so inside them the kernels' scratch is the call's own and no call is recorded for replay."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

import tilegemm
from tilegemm.core import workspace

from conftest import assert_rel_close


def _fake_trees(monkeypatch, stream: int):
    """A stand-in for torch._inductor.cudagraph_trees with one tree manager whose stream is ``stream``."""
    manager = types.SimpleNamespace(stream=types.SimpleNamespace(cuda_stream=stream))
    local = types.SimpleNamespace(tree_manager_containers={0: types.SimpleNamespace(tree_manager=manager)})
    fake = types.SimpleNamespace(local=local, get_obj=lambda loc, name: getattr(loc, name))
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", fake)


def test_in_graph_tree_is_true_only_on_a_tree_managers_stream(monkeypatch):
    monkeypatch.setattr(workspace, "current_stream", lambda: 1234)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    assert not workspace.in_graph_tree()  # the trees' module never imported
    _fake_trees(monkeypatch, 1234)
    assert workspace.in_graph_tree()
    _fake_trees(monkeypatch, 99)
    assert not workspace.in_graph_tree()  # a manager exists, but this is another stream (an eager call)
    broken = types.SimpleNamespace(local=None, get_obj=lambda loc, name: 1 / 0)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", broken)
    assert not workspace.in_graph_tree()  # torch's internals changed: behave as before


@pytest.mark.gpu
def test_gpu_replay_keys_are_refused_inside_a_graph_tree(monkeypatch):
    from tilegemm.ops.conv2d import checks as conv_replay
    from tilegemm.ops.matmul import checks as mm_replay
    from tilegemm.ops.w4a16 import checks as w4_replay

    a = torch.randn(16, 256, device="cuda", dtype=torch.float16)
    x = torch.randn(2, 8, 5, 5, device="cuda", dtype=torch.float16)
    wc = torch.randn(8, 8, 3, 3, device="cuda", dtype=torch.float16)
    w4 = tilegemm.w4a16.quantize(torch.randn(64, 256, device="cuda", dtype=torch.float16))
    conv = ([1, 1], [1, 1], [1, 1], 1)

    def keys():
        with torch.no_grad():
            return (mm_replay.replay_key(a, a.T, 1.0, None, "auto"),
                    conv_replay.replay_key("fwd", x, wc, None, conv, "none", "auto"),
                    w4_replay.replay_key(a, w4, None, "none", "auto"))

    assert all(k is not None for k in keys())
    for module in (mm_replay, conv_replay, w4_replay):
        monkeypatch.setattr(module, "in_graph_tree", lambda: True)
    assert keys() == (None, None, None)


@pytest.mark.gpu
def test_gpu_workspaces_inside_a_graph_tree_are_the_calls_own(monkeypatch):
    dev = torch.device("cuda")
    kept = workspace.buffer(dev, torch.float16, 100, "test-tree")
    assert workspace.buffer(dev, torch.float16, 100, "test-tree") is kept  # outside: shared, kept
    monkeypatch.setattr(workspace, "in_graph_tree", lambda: True)
    own = workspace.buffer(dev, torch.float16, 100, "test-tree")
    assert own is not kept and own.numel() >= 100
    planes, counters = workspace.split_workspace(dev, 64, 8, tag="test-tree", zeroed=True)
    assert planes.numel() >= 64 and counters.numel() >= 8
    assert not planes.any() and not counters.any()
    assert workspace.split_workspace(dev, 64, 8, tag="test-tree")[0] is not planes


def _conv_cases():
    cl = torch.channels_last
    return [
        ("3x3", torch.nn.Conv2d(64, 64, 3, padding=1), torch.randn(4, 64, 28, 28).contiguous(memory_format=cl)),
        ("1x1 stride 2 (subsampled)", torch.nn.Conv2d(256, 512, 1, stride=2, bias=False),
         torch.randn(4, 256, 28, 28).contiguous(memory_format=cl)),
        ("1x1 long K (split)", torch.nn.Conv2d(2048, 512, 1, bias=False),
         torch.randn(8, 2048, 7, 7).contiguous(memory_format=cl)),
        ("depthwise", torch.nn.Conv2d(144, 144, 3, padding=1, groups=144),
         torch.randn(4, 144, 28, 28).contiguous(memory_format=cl)),
    ]


def _run_compiled(model, inputs):
    from torch._dynamo.utils import counters

    counters.clear()
    fn = torch.compile(model, mode="reduce-overhead", dynamic=False)
    outs = []
    with torch.no_grad():
        for x in inputs:  # warm-up, recording, then replays of the graph over new inputs
            torch.compiler.cudagraph_mark_step_begin()
            outs.append(fn(x).clone())
    assert not counters["inductor"]["cudagraph_skips"]  # the graphs ran: none skipped
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in _conv_cases()])
def test_gpu_conv2d_under_reduce_overhead(case):
    torch.manual_seed(0)
    _, conv, x = _conv_cases()[case]
    ref = conv.cuda().half().to(memory_format=torch.channels_last)
    model = tilegemm.nn.convert_(torch.nn.Sequential(copy.deepcopy(ref), torch.nn.ReLU()))
    inputs = [torch.randn_like(x).cuda().half().contiguous(memory_format=torch.channels_last) for _ in range(4)]
    for x, out in zip(inputs, _run_compiled(model, inputs)):
        with torch.no_grad():
            want = torch.relu(torch.nn.functional.conv2d(
                x.double(), ref.weight.double(), None if ref.bias is None else ref.bias.double(),
                ref.stride, ref.padding, ref.dilation, ref.groups))
        assert_rel_close(out, want, 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(8, 4096, 4096), (184, 14400, 168), (333, 1000, 333)])
def test_gpu_linear_under_reduce_overhead(m, k, n):
    # a plain product, a long-K one (split-K with its workspace), one with misaligned rows (padded copies)
    torch.manual_seed(0)
    ref = torch.nn.Linear(k, n).cuda().half()
    model = tilegemm.nn.convert_(torch.nn.Sequential(copy.deepcopy(ref)))
    inputs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(4)]
    for x, out in zip(inputs, _run_compiled(model, inputs)):
        want = torch.nn.functional.linear(x.double(), ref.weight.double(), ref.bias.double())
        assert_rel_close(out, want, 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_int4_linear_under_reduce_overhead(m):
    from tilegemm.nn import Int4Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096, bias=False).cuda().half()
    model = torch.nn.Sequential(Int4Linear.from_linear(lin))
    w = model[0].dequantize().double()
    inputs = [torch.randn(m, 4096, device="cuda", dtype=torch.float16) for _ in range(4)]
    for x, out in zip(inputs, _run_compiled(model, inputs)):
        assert_rel_close(out, x.double() @ w.T, 2e-3)
