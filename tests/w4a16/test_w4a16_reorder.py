"""x's inputs reordered for act-order weights by reorder_kernel (ops/w4a16/reorder.py), as index_select would."""

import pytest
import torch

from tilegemm import w4a16
from tilegemm.ops.w4a16 import dispatch, reorder
from tilegemm.ops.w4a16.reference import reference, tolerance

from conftest import assert_rel_close


def _spy(monkeypatch):
    names = []
    real = reorder.launch

    def spy(kernel, grid, *args, **kwargs):
        names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(reorder, "launch", spy)
    return names


@pytest.mark.parametrize("M, K", [(1, 8), (3, 17), (5, 1030), (2, 2048 + 24)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_equals_index_select(M, K, dtype, device, monkeypatch):
    launched = _spy(monkeypatch)
    wide = torch.randn(M, K + 5, device=device).to(dtype)
    x = wide[:, 2:K + 2]  # rows K + 5 apart: a sliced view
    perm = torch.randperm(K, device=device)
    out = reorder.reorder_columns(x, perm)
    assert launched == ["reorder_kernel"]
    assert out.shape == (M, K) and out.is_contiguous() and torch.equal(out, x.index_select(1, perm))


def test_what_it_leaves_to_index_select(device, monkeypatch):
    launched = _spy(monkeypatch)
    perm = torch.randperm(16, device=device)
    x = torch.randn(4, 16, device=device, requires_grad=True)  # autograd sees index_select
    out = reorder.reorder_columns(x, perm)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    cols = torch.randn(16, 4, device=device).T  # columns not contiguous
    assert torch.equal(reorder.reorder_columns(cols, perm), cols.index_select(1, perm))
    assert reorder.reorder_columns(torch.empty(0, 16, device=device), perm).shape == (0, 16)
    assert launched == []


def test_an_act_order_call_above_the_gather_rows_reorders_by_it(device, monkeypatch):
    # more rows than frag_wgmma gathers: x reordered first, here by reorder_kernel; the product as the reference's
    launched = _spy(monkeypatch)
    N, K, M = 48, 256, dispatch.GATHER_MAX_M + 3
    weight = torch.randn(N, K, device=device)
    g_idx = torch.randperm(K, device=device) % (K // 64)  # act-order: groups of 64 scattered over K
    base = w4a16.quantize(weight.half(), group_size=64)
    order = torch.argsort(g_idx, stable=True)
    w = w4a16.Int4Weight(base.qweight, base.scales, base.zeros, group_size=64, shape=(N, K), perm=order)
    x = torch.randn(M, K, device=device).half()
    out = w4a16.matmul(x, w)
    assert launched == ["reorder_kernel"]
    assert_rel_close(out, reference(x, w), tolerance(torch.float16))


def test_eager_gpu_calls_keep_index_select_and_captures_take_the_kernel(monkeypatch):
    # the kernel's host cost is paid once in a graph, every call in eager: eager GPU calls keep index_select
    launched = _spy(monkeypatch)
    monkeypatch.setattr(reorder, "interpreting", lambda: False)
    x, perm = torch.randn(3, 40), torch.randperm(40)
    monkeypatch.setattr(reorder, "capturing", lambda t: False)
    assert torch.equal(reorder.reorder_columns(x, perm), x.index_select(1, perm)) and launched == []
    monkeypatch.setattr(reorder, "capturing", lambda t: True)
    assert torch.equal(reorder.reorder_columns(x, perm), x.index_select(1, perm)) and launched == ["reorder_kernel"]


def test_captured_calls_do_not_gather_in_the_kernel(device, monkeypatch):
    w = w4a16.quantize(torch.randn(64, 256, device=device).half(), group_size=64)
    w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, group_size=64, shape=(64, 256),
                         perm=torch.randperm(256, device=device))
    x = torch.randn(4, 256, device=device).half()
    monkeypatch.setattr(dispatch, "wants_frag", lambda kernel, x2, w: True)  # as on an H200 at 4 rows
    assert dispatch.gathers("auto", x, w)
    monkeypatch.setattr(dispatch, "capturing", lambda t: True)
    assert not dispatch.gathers("auto", x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 65])
def test_a_captured_act_order_call_replays_right(M):
    from tilegemm.ops.w4a16 import op

    N, K = 256, 1024
    base = w4a16.quantize(torch.randn(N, K, device="cuda").half(), group_size=128)
    w = w4a16.Int4Weight(base.qweight, base.scales, base.zeros, group_size=128, shape=(N, K),
                         perm=torch.randperm(K, device="cuda"))
    w.fragments()  # made before the capture (a first call inside one refuses to make them)
    x = torch.randn(M, K, device="cuda").half()
    op.REPLAYS.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w4a16.matmul(x, w)  # warm: compiled, recorded
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16.matmul(x, w)
    x.copy_(torch.randn(M, K, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(out, reference(x, w), tolerance(torch.float16))
