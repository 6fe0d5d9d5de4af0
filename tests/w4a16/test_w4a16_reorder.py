"""Act-order's route (docs/w4a16.md, "Act-order"): x's inputs reordered by ``reorder_kernel``
(ops/w4a16/reorder.py), then the kernel auto picks for the natural-order weight, the same in eager calls and calls
captured into a CUDA graph; the host fast path replays both launches (``op.REORDERS``, then ``op.REPLAYS`` or
``op.DEQUANTS``). On the device fixture's tensors (the interpreter's CPU, or the GPU): the gather against
index_select, the route's launches, what each cache keeps and replays (stand-ins for the recorded launches), and
what takes another route. Real replays and captures, and the route at scale, on the GPU:
tests/w4a16/test_w4a16_actorder_gpu.py."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close
from w4a16_kit import act_order_weight

from tilegemm import w4a16
from tilegemm.core import hardware
from tilegemm.core.launch import plain_call
from tilegemm.core.runtime import interpreting
from tilegemm.ops.w4a16 import api, checks, dequant_cublas, dispatch, frag_wgmma, gemv, mma, op, reorder
from tilegemm.ops.w4a16.reference import reference


CACHES = (op.REORDERS, op.REPLAYS, op.DEQUANTS)


def _clear():
    """Empty the act-order calls' caches: on a GPU a call records its launches, and a later call of the same layout
    (another test's too) would replay them rather than launch from Python."""
    for cache in CACHES:
        cache.clear()


def _launched(monkeypatch) -> list:
    """The names of the kernels launched from here on (every module that launches an act-order call's kernels;
    frag_wgmma's where auto takes it, on Hopper)."""
    names = []
    for module in (reorder, gemv, mma, dequant_cublas, frag_wgmma):
        real = module.launch

        def spy(kernel, grid, *args, real=real, **kwargs):
            names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
            return real(kernel, grid, *args, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    return names


# --- the gather -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M, K", [(1, 8), (3, 17), (5, 1030), (9, 2048 + 24), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_equals_index_select(M, K, dtype, monkeypatch, device):
    launched = _launched(monkeypatch)
    perm = torch.randperm(K, device=device)
    wide = torch.randn(M, K + 5, device=device).to(dtype)
    views = {
        "sliced": wide[:, 2:K + 2],  # rows K + 5 apart, starting 4 bytes in
        "transposed": torch.randn(K, M, device=device).to(dtype).T,  # inputs M apart
        "rows strided": torch.randn(2 * M, K, device=device).to(dtype)[::2],
        "contiguous": torch.randn(M, K, device=device).to(dtype),
    }
    for name, x in views.items():
        out = reorder.reorder_columns(x, perm)
        assert out.shape == (M, K) and out.is_contiguous() and out.dtype == dtype, name
        assert torch.equal(out, x.index_select(1, perm)), name
    assert launched == ["reorder_kernel"] * len(views)


def test_gather_grid_spreads_rows_over_as_few_programs_as_fill_the_gpu():
    # (BLOCK_K, blocks_k, chunks a program, programs) on 132 SMs
    assert reorder.gather_grid(1, 5120, 132) == (1024, 5, 1, 5)  # one row: every column block its own program
    assert reorder.gather_grid(16, 11008, 132) == (1024, 11, 1, 176)
    assert reorder.gather_grid(128, 11008, 132) == (1024, 11, 3, 512)  # four programs a row
    assert reorder.gather_grid(512, 11008, 132) == (1024, 11, 6, 1024)  # two
    assert reorder.gather_grid(1024, 11008, 132) == (1024, 11, 11, 1024)  # one program walks a whole row
    assert reorder.gather_grid(3, 40, 132) == (64, 1, 1, 3)
    for M, K in ((1, 8), (7, 3000), (300, 2048), (5000, 64)):
        block_k, blocks_k, chunks, programs = reorder.gather_grid(M, K, 132)
        assert blocks_k * block_k >= K and programs * chunks >= M * blocks_k  # every column block covered


def test_gather_takes_int32_and_strided_perm_and_many_chunks(device, monkeypatch):
    # chunks of 1024 columns, the last one short, several a program
    x = torch.randn(11, 3000, dtype=torch.float16, device=device)
    perm = torch.randperm(3000, device=device)
    strided = torch.stack([perm, perm], 1)[:, 0]  # a valid weight may hold a strided view
    assert strided.stride(0) == 2
    # 4 SMs (the interpreter's count; a GPU's pinned to it): 2 chunks a program
    monkeypatch.setattr(hardware, "sm_count", lambda device: 4)
    assert reorder.gather_grid(11, 3000, hardware.sm_count(x.device))[2] == 2
    for p in (perm, perm.to(torch.int32), strided):
        assert torch.equal(reorder.reorder_columns(x, p), x[:, perm])


def test_gather_of_nothing_launches_nothing(monkeypatch, device):
    launched = _launched(monkeypatch)
    assert reorder.reorder_columns(torch.empty(0, 16, dtype=torch.float16, device=device),
                                   torch.randperm(16, device=device)).shape == (0, 16)
    assert reorder.reorder_columns(torch.empty(3, 0, dtype=torch.float16, device=device),
                                   torch.empty(0, dtype=torch.long, device=device)).shape == (3, 0)
    assert launched == []


def test_gather_refuses_shapes_it_does_not_take():
    x = torch.randn(3, 16, dtype=torch.float16)
    for bad_x, bad_perm in ((x, torch.randperm(15)), (x[0], torch.randperm(16)), (x, torch.randperm(16)[None])):
        with pytest.raises(ValueError, match="reorder_columns"):
            reorder.reorder_columns(bad_x, bad_perm)


# --- the route: the gather, then the natural order's kernel, for every kernel and M --------------------------------


_PRODUCT = {"gemv": "w4a16_gemv_kernel", "mma": "w4a16_mma_kernel", "dequant_cublas": "w4a16_dequant_kernel",
            "frag_wgmma": "frag_wgmma_kernel"}


# 130 rows: past auto's 128-row bound for frag_wgmma; gemv (a program a row) has its many rows at 17
@pytest.mark.parametrize("M,kernel", [(M, k) for M in (1, 3, 17, 130) for k in ("auto", "gemv", "mma", "dequant_cublas")
                                      if (M, k) != (130, "gemv")])
def test_every_kernel_runs_on_x_reordered_by_the_gather(kernel, M, monkeypatch, device):
    _clear()
    launched = _launched(monkeypatch)
    w = act_order_weight(40, 256, 64, device=device)
    natural = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 64, w.shape)
    x = torch.randn(M, 256, dtype=torch.float16, device=device)
    out = w4a16.matmul(x, w, kernel=kernel)
    route = list(launched)
    launched.clear()
    # bit for bit the natural-order weight's call on x[:, perm], through the same kernel
    assert torch.equal(out, w4a16.matmul(x[:, w.perm], natural, kernel=kernel))
    # auto: frag_wgmma where it runs (Hopper, up to 128 rows of this narrow weight); none on the CPU
    frag = dispatch.frag_usable(w.group_k, x.device, 256)
    chosen = dispatch.choose(M, frag, w.shape[0]) if kernel == "auto" else kernel
    assert route == ["reorder_kernel", _PRODUCT[chosen]] and launched == [_PRODUCT[chosen]]


@pytest.mark.parametrize("lead", [(2, 3), (1,), (0, 4)])
def test_batched_and_strided_x(lead, monkeypatch, device):
    _clear()
    launched = _launched(monkeypatch)
    w = act_order_weight(40, 128, 32, device=device)
    natural = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape)
    x = torch.randn(*lead, 256, dtype=torch.float16, device=device)[..., ::2]  # inputs 2 apart, leading dims
    out = w4a16.matmul(x, w)
    assert out.shape == (*lead, 40)
    assert torch.equal(out, w4a16.matmul(x[..., w.perm], natural))
    assert launched.count("reorder_kernel") == (1 if x.numel() else 0)


@pytest.mark.skipif(not interpreting(), reason="a capture stood in for (is_current_stream_capturing patched) where "
                    "there is no GPU; on a GPU real captures are tested: test_w4a16_actorder_gpu.py::"
                    "test_eager_and_captured_calls_launch_the_same_kernels")
def test_eager_and_captured_calls_take_the_same_route(monkeypatch, device):
    # a captured call's kernels must all have run in its eager warm-up (none may first load inside a capture):
    # nothing on the route asks whether a capture is on
    launched = _launched(monkeypatch)
    w = act_order_weight(40, 256, 64, device=device)
    routes = []
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda capturing=capturing: capturing)
        for M in (1, 3, 64, 130):
            w4a16.matmul(torch.randn(M, 256, dtype=torch.float16, device=device), w)
        routes.append(list(launched))
        launched.clear()
    assert routes[0] == routes[1] and routes[0].count("reorder_kernel") == 4


def test_the_op_with_perm_gathers_only_where_frag_wgmma_is_named():
    w = act_order_weight(40, 128, 64)
    p = dict(x=torch.empty(2, 128), qweight=w.qweight, scales=w.scales, zeros=w.zeros, bias=None, out=None,
             group_k=64, activation="none", perm=w.perm)
    from tilegemm.ops.w4a16.problem import W4A16Problem

    assert dispatch.gathers(W4A16Problem(**p, kernel="frag_wgmma"))
    for kernel in ("auto", "gemv", "mma", "dequant_cublas"):
        assert not dispatch.gathers(W4A16Problem(**p, kernel=kernel))
    assert not dispatch.gathers(W4A16Problem(**{**p, "perm": None}, kernel="frag_wgmma"))
    strided = torch.stack([w.perm, w.perm], 1)[:, 0]  # read by the gather, not by frag_wgmma
    assert not dispatch.gathers(W4A16Problem(**{**p, "perm": strided}, kernel="frag_wgmma"))


def test_autograd_sees_index_select_not_the_gather(monkeypatch, device):
    launched = _launched(monkeypatch)
    w = act_order_weight(24, 128, 32, device=device)
    x = torch.randn(3, 128, dtype=torch.float16, device=device, requires_grad=True)
    out = w4a16.matmul(x, w, kernel="mma")
    assert "reorder_kernel" not in launched
    out.float().sum().backward()
    xr = x.detach().float().requires_grad_(True)
    reference(xr, w, dtype=torch.float32).sum().backward()
    assert_rel_close(x.grad, xr.grad, 1e-2)


# --- the host fast path: two replays, keyed by the call (x in the caller's order, perm's layout) -----------------


class _Replayed:
    """A recorded entry's stand-in (a CPU cannot replay a launch; the ``keyed`` fixture keeps none on a GPU either):
    writes ``fill(*tensors)`` into the output the cache allocates, or declines (``runs`` False); notes the tensors
    it was given."""

    def __init__(self, like: torch.Tensor, fill, runs: bool = True):
        self.fill, self.runs, self.calls = fill, runs, []
        self.output = (tuple(like.shape), like.dtype, like.device, False)

    def __call__(self, *tensors) -> bool:
        self.calls.append(tensors)
        if self.runs:
            tensors[-1].copy_(self.fill(*tensors[:-1]))
        return self.runs


@pytest.fixture
def keyed(monkeypatch):
    """Key calls as the GPU's plain calls are (the interpreter's CPU calls too); note what each cache is asked to
    keep rather than keep it (the interpreter's launches are never kept; a GPU's are not either, so what a call
    replays is the stand-ins a test puts in); the caches emptied before and after."""
    monkeypatch.setattr(api, "replay_key", lambda x2, w, bias, act, kernel, perm=None:
                        checks.key_of(x2, w, bias, act, kernel, perm) if plain_call(x2, bias) else None)
    stored = {"REORDERS": [], "REPLAYS": [], "DEQUANTS": []}
    for name, notes in stored.items():
        monkeypatch.setattr(getattr(op, name), "store", lambda key, launches, tensors, out, *rest, notes=notes:
                            notes.append((key, tensors, out)))
    caches = (op.REORDERS, op.REPLAYS, op.DEQUANTS)
    for cache in caches:
        cache.clear()
    yield stored
    for cache in caches:
        cache.clear()


@pytest.mark.parametrize("kernel, M", [("auto", 3), ("gemv", 1), ("dequant_cublas", 5)])
def test_the_first_call_keeps_the_gather_and_the_product_under_its_key(keyed, kernel, M, device):
    stored = keyed
    w = act_order_weight(40, 128, 32, device=device)
    bias = torch.randn(40, dtype=torch.float16, device=device)
    x = torch.randn(M, 128, dtype=torch.float16, device=device)
    y = w4a16.matmul(x, w, bias, "silu", kernel=kernel)
    assert_rel_close(y, reference(x, w, bias, "silu"), 2e-3)
    key = checks.key_of(x, w, bias, "silu", kernel, w.perm)  # x as the caller passed it, perm's layout
    assert [k for k, _, _ in stored["REORDERS"]] == [key]
    _, tensors, xr = stored["REORDERS"][0]
    assert tensors[0] is x and tensors[1] is w.perm and len(tensors) == 2 and torch.equal(xr, x[:, w.perm])
    product = stored["DEQUANTS" if kernel == "dequant_cublas" else "REPLAYS"]
    assert [k for k, _, _ in product] == [key] and product[0][1][0] is xr  # the product takes the gather's x
    assert all(a is b for a, b in zip(product[0][1], checks.call_tensors(xr, w, bias)))
    assert stored["DEQUANTS" if kernel != "dequant_cublas" else "REPLAYS"] == []
    assert checks.key_of(x, w, bias, "silu", kernel) != key  # the natural order's calls are keyed apart


def test_a_replayed_call_launches_nothing_from_python(keyed, monkeypatch, device):
    w = act_order_weight(40, 128, 32, device=device)
    x = torch.randn(3, 128, dtype=torch.float16, device=device)
    w4a16.matmul(x, w)
    key = keyed["REORDERS"][0][0]
    gather = op.REORDERS.entries[key] = _Replayed(x, lambda x2, perm: x2[:, perm])
    product = op.REPLAYS.entries[key] = _Replayed(torch.empty(3, 40, dtype=torch.float16, device=device),
                                                  lambda xr, *weight: reference(xr, w4a16.Int4Weight(
                                                      w.qweight, w.scales, w.zeros, 32, w.shape)))
    launched = _launched(monkeypatch)
    x_new = torch.randn(1, 3, 128, dtype=torch.float16, device=device)  # leading dims: the same key as [3, 128]
    y = w4a16.matmul(x_new, w)
    assert launched == [] and y.shape == (1, 3, 40)
    assert len(gather.calls) == 1 and gather.calls[0][0].shape == (3, 128) and gather.calls[0][1] is w.perm
    assert len(product.calls) == 1 and torch.equal(product.calls[0][0], x_new[0][:, w.perm])
    assert_rel_close(y[0], reference(x_new[0], w), 2e-3)


def test_dequant_cublas_replays_the_gather_then_the_dequantization(keyed, monkeypatch, device):
    w = act_order_weight(40, 128, 32, device=device)
    x = torch.randn(5, 128, dtype=torch.float16, device=device)
    w4a16.matmul(x, w, kernel="dequant_cublas")
    key = keyed["REORDERS"][0][0]
    wd = keyed["DEQUANTS"][0][2]
    gather = op.REORDERS.entries[key] = _Replayed(x, lambda x2, perm: x2[:, perm])
    dequant = op.DEQUANTS.entries[key] = _Replayed(wd, lambda *tensors: wd)
    launched = _launched(monkeypatch)
    x_new = torch.randn(5, 128, dtype=torch.float16, device=device)
    y = w4a16.matmul(x_new, w, kernel="dequant_cublas")
    assert launched == [] and len(gather.calls) == 1 and len(dequant.calls) == 1
    assert torch.equal(dequant.calls[0][0], x_new[:, w.perm])  # its tensors: the call's, x reordered
    assert_rel_close(y, reference(x_new, w), 2e-3)


def test_declined_replays_launch_afresh(keyed, monkeypatch, device):
    w = act_order_weight(40, 128, 32, device=device)
    x = torch.randn(3, 128, dtype=torch.float16, device=device)
    w4a16.matmul(x, w)
    key = keyed["REORDERS"][0][0]
    launched = _launched(monkeypatch)
    # the gather declines (another device or stream): the whole call afresh
    op.REORDERS.entries[key] = _Replayed(x, None, runs=False)
    assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)
    assert launched[0] == "reorder_kernel" and len(launched) == 2
    launched.clear()
    # the gather replayed, the product declines: the product afresh on the replayed gather's x (no second gather)
    op.REORDERS.entries[key] = _Replayed(x, lambda x2, perm: x2[:, perm])
    op.REPLAYS.entries[key] = _Replayed(torch.empty(3, 40, dtype=torch.float16, device=device), None, runs=False)
    assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)
    assert len(launched) == 1 and launched[0] != "reorder_kernel"


def test_calls_under_autograd_keep_nothing(keyed, device):
    w = act_order_weight(40, 128, 32, device=device)
    x = torch.randn(3, 128, dtype=torch.float16, device=device, requires_grad=True)
    w4a16.matmul(x, w)  # autograd: the op, x reordered by index_select
    assert keyed == {"REORDERS": [], "REPLAYS": [], "DEQUANTS": []}
