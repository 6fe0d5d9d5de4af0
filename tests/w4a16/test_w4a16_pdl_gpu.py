"""Dependent launches (PDL) on the GPU: ``frag_wgmma`` at small M copies its first weight words before it waits for
the kernel ahead (the shipped rule: only on x that act-order's gather just wrote, which lets it in at once; here
every small product, to test the launches). Chains where each product reads the one
before (torch's ops between; Inductor's kernels launched as dependents too) must give, captured into a CUDA graph
and replayed on new inputs, the bits of the same chain run eagerly without PDL."""

from __future__ import annotations

import pytest
import torch

from tilegemm import w4a16
from tilegemm.core import replay
from tilegemm.ops.w4a16 import configs

pytestmark = pytest.mark.gpu


@pytest.fixture
def pdl_mode(monkeypatch):
    """Every small product a dependent launch (mode 1 or 2), or none (0)."""
    def set_mode(mode: int) -> None:
        monkeypatch.setattr(configs, "FRAG_WGMMA_PDL", mode)
        monkeypatch.setattr(configs, "FRAG_WGMMA_PDL_CALLS", "all")
        replay.clear()
    yield set_mode
    replay.clear()


def _weights(N, depth, dtype, act_order, gen):
    ws = []
    for _ in range(depth):
        w = w4a16.quantize(torch.randn(N, N, device="cuda", dtype=dtype, generator=gen) * N ** -0.5, group_size=128)
        if act_order:
            perm = torch.randperm(N, device="cuda", generator=gen)
            w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, perm=perm)
        ws.append(w)
    return ws


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,M,depth,act_order", [(4096, 1, 6, False), (4096, 16, 6, False), (2048, 32, 4, False),
                                                 (8192, 3, 4, False), (1024, 200, 3, False), (2048, 1, 4, True),
                                                 (1024, 24, 4, True)])
def test_dependent_chains_as_graphs_match_eager_without_pdl(pdl_mode, mode, dtype, N, M, depth, act_order):
    gen = torch.Generator(device="cuda").manual_seed(N + M)
    ws = _weights(N, depth, dtype, act_order, gen)
    x = torch.randn(M, N, device="cuda", dtype=dtype, generator=gen)

    def chain():
        y = x
        for w in ws:
            y = torch.tanh(w4a16.matmul(y, w)) + 0.25 * y
        chain.out = y

    pdl_mode(mode)
    chain()  # compiles and records
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    for _ in range(3):
        x.copy_(torch.randn(M, N, device="cuda", dtype=dtype, generator=gen))
        pdl_mode(0)
        chain()
        want = chain.out.clone()
        pdl_mode(mode)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(chain.out, want)
        chain()  # eager, with PDL
        assert torch.equal(chain.out, want)


def test_compiled_chain_with_inductors_dependent_launches(pdl_mode):
    # Inductor's kernels launched as dependents (each waits before its first load of what the kernel ahead wrote)
    # between tilegemm's: the compiled chain, as a graph, against the eager chain without PDL
    gen = torch.Generator(device="cuda").manual_seed(7)
    ws = _weights(2048, 4, torch.float16, False, gen) + _weights(2048, 2, torch.float16, True, gen)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.float16, generator=gen)

    def chain(x):
        y = x
        for w in ws:
            y = torch.nn.functional.silu(w4a16.matmul(y * 1.5, w)) + 0.25 * y
        return y

    pdl_mode(0)
    want = chain(x)
    pdl_mode(2)
    torch._dynamo.reset()
    # (torch releases before Inductor's PDL lack the key: the chain is then compiled without it)
    inductor_pdl = {"triton.enable_pdl": True} if hasattr(torch._inductor.config.triton, "enable_pdl") else {}
    with torch._inductor.config.patch(inductor_pdl):
        compiled = torch.compile(chain, dynamic=False, fullgraph=True)
        for _ in range(2):
            compiled(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = compiled(x)
    for _ in range(3):
        x.copy_(torch.randn(4, 2048, device="cuda", dtype=torch.float16, generator=gen))
        pdl_mode(0)
        want = chain(x)
        g.replay()
        torch.cuda.synchronize()
        # Inductor fuses the elementwise work (its own rounding): the same products, within fp16's rounding
        assert (out.float() - want.float()).norm() / want.float().norm() < 2e-3
    torch._dynamo.reset()
