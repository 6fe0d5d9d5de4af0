"""On a Hopper GPU a compiled model's Int4Linear layers run the fragment kernel on their kept layouts, which the op
checks again where it runs (``tilegemm.ops.w4a16.fragment_records.layout_for``): inductor's graph, a block compiled
on its own (regional compilation) and a CUDA graph captured from the compiled model all read them; a layer written
after tracing runs on its parts, with the product of what it holds (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_rel_close
from tilegemm.core.hardware import why_not_gluon
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16 import dispatch
from tilegemm.ops.w4a16.format import dequantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and why_not_gluon() is not None,
                                 reason="the fragment kernel is Gluon for sm_90")]


@pytest.fixture
def kernels(monkeypatch):
    """The kernel each product runs, in order (a compiled graph's calls included)."""
    seen = []
    real = dispatch.kernel_for
    monkeypatch.setattr(dispatch, "kernel_for", lambda p: seen.append(real(p)) or seen[-1])
    return seen


def _layers(n=3, width=1024):
    torch.manual_seed(0)
    return [Int4Linear.from_linear(nn.Linear(width, width, dtype=torch.float16), group_size=128).cuda()
            for _ in range(n)]


def _compiled_model(rows: int):
    """(layers, the model of them, x of ``rows`` rows, the model compiled by inductor)."""
    layers = _layers()
    model = nn.Sequential(*layers)
    torch.compiler.reset()
    return layers, model, torch.randn(rows, 1024, device="cuda", dtype=torch.float16) / 32, \
        torch.compile(model, fullgraph=True)


def _want(layers, x):
    """The fp64 product of the weights the layers hold now, one after another."""
    y = x.double()
    for layer in layers:
        y = y @ dequantize(layer._weight()).double().T + layer.bias.double()
    return y


def test_compiled_model_reads_its_layouts_until_a_layer_is_written(kernels):
    layers, model, x, compiled = _compiled_model(rows=1)
    with torch.no_grad():
        assert_rel_close(compiled(x), _want(layers, x), 2e-2)
        assert kernels[-3:] == ["frag_wgmma"] * 3
        layers[1].scales.mul_(0.5)  # written after tracing: the same graph runs
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert_rel_close(compiled(x), _want(layers, x), 2e-2)
        assert kernels[-3:][0] == "frag_wgmma" and kernels[-3:][1] != "frag_wgmma" and kernels[-1] == "frag_wgmma"
        model(x)  # an eager call remakes the written layer's layout
        assert_rel_close(compiled(x), _want(layers, x), 2e-2)
        assert kernels[-3:] == ["frag_wgmma"] * 3
    torch.compiler.reset()


def test_a_block_compiled_on_its_own_reads_each_layers_layout(kernels):
    layers = _layers()
    for i, layer in enumerate(layers):
        with torch.no_grad():
            layer.scales.mul_(1 + i / 4)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.float16) / 32
    torch.compiler.reset()
    step = torch.compile(lambda layer, t: layer(t), fullgraph=True)
    with torch.no_grad():
        for layer in layers:
            layer(x)  # remade of the written parts
        y = x
        for layer in layers:  # (traced for each layer: docs/w4a16.md, "The fragment layout ...")
            y = step(layer, y)
    assert_rel_close(y, _want(layers, x), 2e-2)
    assert kernels[-3:] == ["frag_wgmma"] * 3
    torch.compiler.reset()


def test_cuda_graph_of_the_compiled_model_replays_the_fragment_kernel(kernels):
    layers, model, x, compiled = _compiled_model(rows=2)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(x)  # warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x)
        assert kernels[-3:] == ["frag_wgmma"] * 3  # (the capture's calls)
        x.copy_(torch.randn_like(x) / 32)
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, _want(layers, x), 2e-2)
    torch.compiler.reset()
