"""The inference transforms on a GPU, in 16 bits, eager, replayed from a CUDA graph and compiled: batch norms folded
(fold_batchnorm_), projections joined (fuse_projections_) and act-order orders absorbed (absorb_act_order_). The
interpreter's tests (test_fold_batchnorm.py, test_fuse_projections.py, test_absorb_act_order.py) hold the rest."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tilegemm.nn import absorb_act_order_, convert_, fuse_projections_, quantize_

from conftest import assert_rel_close
from test_absorb_act_order import MLP
from test_fold_batchnorm import Block, _randomize_norms
from test_fuse_projections import Attention

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _graphed(fn, x):
    """``fn(x)`` captured into a CUDA graph after warm-up calls on a side stream; returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    return graph, out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_folded_block_eager_graph_and_compiled(dtype):
    torch.manual_seed(0)
    ref = _randomize_norms(Block()).cuda().eval()
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True).to(dtype).eval()
    folded = folded.to(memory_format=torch.channels_last)
    x = torch.randn(4, 8, 28, 28, device="cuda")
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    with torch.no_grad():
        want = ref(x).double()
        xs = x.to(dtype).contiguous(memory_format=torch.channels_last)
        assert_rel_close(folded(xs), want, tol)
        graph, out = _graphed(folded, xs)
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, want, tol)
        assert_rel_close(torch.compile(folded, fullgraph=True)(xs), want, tol)


def _llama(dtype):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    return quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(device="cuda", dtype=dtype),
                     group_size=128).eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_joined_projections_eager_and_compiled(dtype, tokens):
    ref = _llama(dtype)
    fused = fuse_projections_(copy.deepcopy(ref))
    assert len(fused.tilegemm_fused) == 4
    ids = torch.randint(0, 512, (1, tokens), device="cuda")
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits.double()
        assert_rel_close(fused(ids, use_cache=False).logits, want, tol)
        compiled = torch.compile(lambda i: fused(i, use_cache=False).logits, fullgraph=True)
        assert_rel_close(compiled(ids), want, tol)


@pytest.mark.parametrize("rows", [1, 16, 200])
def test_joined_projections_replayed_from_a_cuda_graph(rows):
    torch.manual_seed(0)
    ref = quantize_(Attention(d=512, kv=128).to(device="cuda", dtype=torch.float16), group_size=128)
    fused = fuse_projections_(copy.deepcopy(ref))
    x = torch.randn(rows, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        graph, out = _graphed(fused, x)
        x.copy_(torch.randn_like(x))  # the graph's input changed in place: the replay reads the new values
        want = ref(x).double()
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, want, 2e-3)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_absorbed_act_order_mlp(rows):
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLP(h=256, i=512)).cuda()
    ref = copy.deepcopy(model)
    absorb_act_order_(model)
    assert model.tilegemm_act_order_absorbed == ["0"]
    x = torch.randn(rows, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        assert_rel_close(model(x), ref(x).double(), 1e-3)
