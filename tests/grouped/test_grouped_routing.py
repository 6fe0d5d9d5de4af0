"""The MoE routing kernels (tilegemm.ops.grouped.routing): moe_route's permutation, counts and gathered rows
against torch's stable sort, moe_combine against an fp64 sum, both paths of moe_route, autograd, opcheck, and
bad inputs."""

from __future__ import annotations

import pytest
import torch

from tilegemm.ops.grouped import routing
from tilegemm.ops.grouped.routing import moe_combine, moe_route, route_torch


def draw_ids(T, k, E, device, outside=0):
    """[T, k] expert ids, distinct per token (as top-k gives them), ``outside`` of them replaced by ids out of
    range (-1 or E: experts another rank holds)."""
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.int64)
    flat = ids.view(-1)
    if outside:
        at = torch.randperm(flat.numel())[:outside]
        flat[at] = torch.where(torch.rand(outside) < 0.5, -1, E)
    return ids.to(device)


def check_route(x, ids, E, xs, offs, pos):
    """The contract of moe_route, from its definition (no sort): pos a permutation ordering pairs by expert, then
    pair index; offs the cumulative counts; rows copied."""
    P, k = ids.numel(), ids.shape[1]
    flat = ids.reshape(-1).cpu().long()
    key = torch.where((flat < 0) | (flat >= E), E, flat)
    p = pos.cpu().long()
    assert sorted(p.tolist()) == list(range(P))
    order = torch.empty(P, dtype=torch.long)
    order[p] = torch.arange(P)
    assert all((key[order[i]], order[i]) < (key[order[i + 1]], order[i + 1]) for i in range(P - 1))
    expected = torch.tensor([int((key <= e).sum()) for e in range(E)], dtype=torch.int32)
    assert torch.equal(offs.cpu(), expected)
    assert torch.equal(xs.cpu(), x.cpu()[order // k])


@pytest.mark.parametrize("T,k,E,outside", [(1, 1, 4, 0), (1, 8, 128, 0), (3, 2, 8, 1), (17, 8, 64, 5),
                                           (40, 6, 64, 0), (130, 2, 8, 3)])
def test_route_kernel(T, k, E, outside, device):
    x = torch.randn(T, 33, device=device)
    ids = draw_ids(T, k, E, device, outside)
    xs, offs, pos = moe_route(x, ids, E)
    check_route(x, ids, E, xs, offs, pos)
    ref = route_torch(x, ids, E)
    for got, want in zip((xs, offs, pos), ref):
        assert torch.equal(got, want)


def test_route_int32_ids_and_wide_rows(device):
    """int32 ids; rows wider than one copy step (COPY_COLUMNS), more pairs than one rank chunk."""
    T, k, E = 300, 4, 16
    x = torch.randn(T, routing.COPY_COLUMNS + 7, device=device)
    ids = draw_ids(T, k, E, device).to(torch.int32)
    check_route(x, ids, E, *moe_route(x, ids, E))


def test_route_above_kernel_limit_uses_sort(monkeypatch, device):
    monkeypatch.setattr(routing, "KERNEL_MAX_PAIRS", 4)
    calls = []
    monkeypatch.setattr(routing, "kernels", lambda: calls.append(1))
    x = torch.randn(5, 8, device=device)
    ids = draw_ids(5, 2, 4, device, outside=1)
    check_route(x, ids, 4, *moe_route(x, ids, 4))
    assert not calls


def test_route_no_tokens(device):
    x = torch.randn(0, 8, device=device)
    xs, offs, pos = moe_route(x, torch.empty(0, 2, dtype=torch.int64, device=device), 4)
    assert xs.shape == (0, 8) and pos.shape == (0,)
    assert torch.equal(offs.cpu(), torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("T,k,H,dtype", [(1, 8, 2048, torch.float32), (5, 2, 17, torch.float16),
                                         (9, 3, 1030, torch.float32), (4, 1, 64, torch.float16)])
def test_combine(T, k, H, dtype, device):
    y = torch.randn(T * k, H, device=device).to(dtype)
    pos = torch.randperm(T * k).to(torch.int32).to(device)
    w = torch.rand(T, k, device=device)
    out = moe_combine(y, pos, w)
    ref = (w.double().unsqueeze(-1) * y.double()[pos.long()].view(T, k, H)).sum(1)
    assert out.dtype == dtype and out.shape == (T, H)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= tol


def test_combine_strided_weights(device):
    y = torch.randn(6, 40, device=device)
    pos = torch.randperm(6).to(torch.int32).to(device)
    w = torch.rand(2, 3, device=device).t()  # [3, 2], not contiguous
    ref = (w.unsqueeze(-1) * y[pos.long()].view(3, 2, 40)).sum(1)
    torch.testing.assert_close(moe_combine(y, pos, w), ref)


def test_route_then_combine_is_a_weighted_sum_over_chosen_rows(device):
    """The round trip: combine(route(x)) with weights summing to one per token gives x back."""
    T, k, E = 7, 3, 5
    x = torch.randn(T, 24, device=device)
    ids = draw_ids(T, k, E, device)
    w = torch.rand(T, k, device=device)
    w = w / w.sum(1, keepdim=True)
    xs, offs, pos = moe_route(x, ids, E)
    torch.testing.assert_close(moe_combine(xs, pos, w), x, rtol=1e-5, atol=1e-5)


def test_autograd_matches_torch(device):
    T, k, E, H = 6, 2, 4, 16
    ids = draw_ids(T, k, E, device)
    x = torch.randn(T, H, device=device, requires_grad=True)
    w = torch.rand(T, k, device=device, requires_grad=True)
    scale = torch.randn(T * k, H, device=device)
    xs, offs, pos = moe_route(x, ids, E)
    out = moe_combine(xs * scale, pos, w)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), g)

    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    xs2, _, pos2 = route_torch(x2, ids, E)
    y2 = xs2 * scale
    out2 = (w2.unsqueeze(-1) * y2[pos2.long()].view(T, k, H)).sum(1)
    gx2, gw2 = torch.autograd.grad(out2, (x2, w2), g)
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(gx, gx2)
    torch.testing.assert_close(gw, gw2)


def test_opcheck(device):
    T, k, E, H = 4, 2, 4, 8
    ids = draw_ids(T, k, E, device)
    x = torch.randn(T, H, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.tilegemm.moe_route.default, (x, ids, E))
    y = torch.randn(T * k, H, device=device, requires_grad=True)
    pos = torch.randperm(T * k).to(torch.int32).to(device)
    w = torch.rand(T, k, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.tilegemm.moe_combine.default, (y, pos, w))


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(3), torch.zeros(3, 2, dtype=torch.int64), 4), "2-D tensor"),
    ((torch.zeros(3, 4), torch.zeros(2, 2, dtype=torch.int64), 4), "tokens"),
    ((torch.zeros(3, 4), torch.zeros(3, 2), 4), "int32 or int64"),
    ((torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64), 0), "positive int"),
    ((torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64), True), "positive int"),  # routed as one expert
])
def test_route_refuses(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        moe_route(*args)
    # the registered op called directly checks the same (a top_k_index of more tokens than x's rows read past x;
    # a 1-D one raised IndexError, num_experts -1 torch's negative-size RuntimeError); its schema reads True as 1
    if args[2] is not True:
        with pytest.raises((ValueError, TypeError), match=match):
            torch.ops.tilegemm.moe_route(*args)


def test_route_names_a_num_experts_of_another_type():
    import numpy as np

    with pytest.raises(ValueError, match=r"got np.int64\(4\) \(int64, not a Python int\)"):
        moe_route(torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64), np.int64(4))


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(3, 4), torch.zeros(6, 2, dtype=torch.int64), 4), "with x's 3 tokens, got \\(6, 2\\)"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64), 4), "top_k_index must be \\[tokens, k\\]"),
    ((torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64), -1), "positive int, got -1"),
])
def test_route_op_called_directly_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.tilegemm.moe_route(*args)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 3), torch.zeros(4, dtype=torch.int32), torch.zeros(2)), "y \\[T\\*k, H\\]"),
    ((torch.zeros(4, 3), torch.zeros(3, dtype=torch.int32), torch.zeros(2, 2)), "all must be T\\*k"),
    ((torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64), torch.zeros(2, 2)), "int32"),
    ((torch.zeros(4, 3), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)), "floating"),
    ((torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2)),
     "y must be floating point"),  # (it was summed in fp32 and rounded back: 100000001 -> 100000000)
])
def test_combine_refuses(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        moe_combine(*args)
    with pytest.raises((ValueError, TypeError), match=match):  # the op called directly (it took all of these)
        torch.ops.tilegemm.moe_combine(*args)


def test_route_int64_ids_beyond_int32_are_outside(device):
    """int64 ids past int32's range are outside [0, E) too: the kernel must not wrap them into an expert."""
    x = torch.randn(4, 8, device=device)
    ids = torch.tensor([[0, 2**32 + 1], [1, 2], [2**32, 3], [-2**32 + 1, 0]], device=device)
    xs, offs, pos = moe_route(x, ids, 4)
    check_route(x, ids, 4, xs, offs, pos)


@pytest.mark.gpu
def test_combine_weights_offsets_past_int32(device):
    """weights a strided view whose element offsets pass 2**31 (t * stride): the kernel's offsets must be int64.
    On the GPU only: the 4.4 GB storage is a real allocation there, and a CPU's overcommit policy may refuse it."""
    T, k, H, S = 130, 2, 8, 1 << 24
    base = torch.empty(T * S, dtype=torch.bfloat16, device=device)
    w = base.as_strided((T, k), (S, 1))
    w.copy_(torch.rand(T, k, device=device))
    y = torch.randn(T * k, H, device=device)
    pos = torch.randperm(T * k).to(torch.int32).to(device)
    ref = (w.float().unsqueeze(-1) * y[pos.long()].view(T, k, H)).sum(1)
    torch.testing.assert_close(moe_combine(y, pos, w), ref)


def test_combine_backward_with_a_repeated_row(device):
    """pos need not be a permutation (moe_combine takes any int32 pos): a row read twice gets both gradients."""
    T, k, H = 3, 2, 5
    y = torch.randn(T * k, H, device=device, requires_grad=True)
    pos = torch.tensor([0, 0, 1, 2, 5, 5], dtype=torch.int32, device=device)
    w = torch.rand(T, k, device=device, requires_grad=True)
    g = torch.randn(T, H, device=device)
    gy, gw = torch.autograd.grad(moe_combine(y, pos, w), (y, w), g)
    y2, w2 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out2 = (w2.unsqueeze(-1) * y2[pos.long()].view(T, k, H)).sum(1)
    gy2, gw2 = torch.autograd.grad(out2, (y2, w2), g)
    torch.testing.assert_close(gy, gy2)
    torch.testing.assert_close(gw, gw2)


@pytest.mark.parametrize("T,k", [(0, 2), (3, 0)])
def test_combine_backward_with_no_pairs(T, k, device):
    """No tokens, or k = 0: the backward's gradients are empty or zero (reshaping 0 elements with -1 raised)."""
    H = 4
    y = torch.randn(T * k, H, device=device, requires_grad=True)
    pos = torch.arange(T * k, dtype=torch.int32, device=device)
    w = torch.rand(T, k, device=device, requires_grad=True)
    out = moe_combine(y, pos, w)
    gy, gw = torch.autograd.grad(out, (y, w), torch.ones_like(out))
    assert gy.shape == y.shape and gw.shape == w.shape
    torch.library.opcheck(torch.ops.tilegemm.moe_combine.default, (y, pos, w))


def test_combine_pos_outside_rows_reads_nothing(device):
    """Entries of pos outside [0, T*k) (no check on the host: that would sync) add nothing, forward and backward,
    instead of reading out of bounds."""
    T, k, H = 2, 2, 8
    y = torch.randn(T * k, H, device=device, requires_grad=True)
    pos = torch.tensor([0, 10**8, -5, 3], dtype=torch.int32, device=device)
    w = torch.rand(T, k, device=device, requires_grad=True)
    out = moe_combine(y, pos, w)
    keep = torch.tensor([1.0, 0.0, 0.0, 1.0], device=device).view(T, k)
    y2, w2 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = (w2.unsqueeze(-1) * keep.unsqueeze(-1) * y2[pos.long().clamp(0, T * k - 1)].view(T, k, H)).sum(1)
    torch.testing.assert_close(out, ref)
    g = torch.randn(T, H, device=device)
    for got, want in zip(torch.autograd.grad(out, (y, w), g), torch.autograd.grad(ref, (y2, w2), g)):
        torch.testing.assert_close(got, want)
