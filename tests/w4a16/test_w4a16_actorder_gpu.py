"""GPTQ act-order on the GPU: every call reorders x by the Triton gather (``ops/w4a16/reorder.py``) and then runs
the natural order's kernel, so its output is bit for bit the natural-order weight's on ``x[..., perm]`` (fp16 and
bf16, M 1..512, groups 32 / 128 / all of K over a K that is no multiple of 64, bias and activations, every kernel,
sliced, transposed and unaligned x, leading dims); the host fast path replays both launches (``op.REORDERS``, then
``op.REPLAYS`` / ``op.DEQUANTS``) with no index_select; eager and captured calls launch the same compiled kernels,
and a capture right after one eager call replays right. ``frag_wgmma``'s ``GATHER`` (the op called with perm and
``frag_wgmma`` named): every loop form and split, bit for bit. The gradient of x; ``Int4Linear.from_gptq``.
Outputs NaN-poisoned by conftest.

    python3 -m pytest -q -m gpu -p no:cacheprovider tests/w4a16/test_w4a16_actorder_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close
from w4a16_kit import act_order_weight

from tilegemm import w4a16
from tilegemm.core.launch import recording
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16 import op
from tilegemm.ops.w4a16.reference import reference, tolerance

pytestmark = pytest.mark.gpu

MS = [1, 2, 3, 8, 16, 17, 33, 64, 65, 128, 256, 512]
KERNELS = ["auto", "frag_wgmma", "gemv", "mma", "dequant_cublas"]
CACHES = (op.REORDERS, op.REPLAYS, op.DEQUANTS)


def _natural(w):
    """The same stored weight without perm: what x[..., perm] multiplies."""
    return w4a16.Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape)


def _clear():
    for cache in CACHES:
        cache.clear()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group, N, K", [(128, 1000, 4096), (32, 520, 4128), (-1, 300, 200)])
@pytest.mark.parametrize("M", MS)
def test_act_order_is_the_natural_order_on_reordered_x(dtype, group, N, K, M):
    w = act_order_weight(N, K, group, dtype, "cuda", seed=M)
    natural = _natural(w)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    xp = x[:, w.perm]
    bias = torch.randn(N, dtype=dtype, device="cuda")
    tol = tolerance(dtype)
    for kernel in KERNELS:
        if kernel == "gemv" and M > 16:
            continue  # (one program a row: slow, and the same route)
        for _ in range(2):  # recorded, then replayed
            out = w4a16.matmul(x, w, kernel=kernel)
            assert torch.equal(out, w4a16.matmul(xp, natural, kernel=kernel)), kernel
        assert_rel_close(out, reference(x, w), tol)
        for act in ("silu", "gelu"):
            out = w4a16.matmul(x, w, bias=bias, activation=act, kernel=kernel)
            assert torch.equal(out, w4a16.matmul(xp, natural, bias=bias, activation=act, kernel=kernel)), kernel
            assert_rel_close(out, reference(x, w, bias, act), tol)


@pytest.mark.parametrize("M", [1, 16, 65, 300])
def test_both_launches_replayed_and_no_index_select(monkeypatch, M):
    w = act_order_weight(256, 1024, 128, device="cuda")  # a narrow weight: dequant_cublas from 129 rows
    calls = []
    real = torch.Tensor.index_select

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    _clear()
    for i in range(3):  # recorded, then replayed with new tensors
        x = torch.randn(M, 1024, dtype=torch.float16, device="cuda")
        # (x[:, perm] indexes: no index_select)
        assert torch.equal(w4a16.matmul(x, w), w4a16.matmul(x[:, w.perm], _natural(w)))
        if i == 0:
            kept = [dict(cache.entries) for cache in CACHES]
    assert calls == []
    # the later calls replayed the first one's entries (a declined replay would have recorded new ones)
    assert [dict(cache.entries) for cache in CACHES] == kept
    assert op.REORDERS.count() == 1 and op.REPLAYS.count() + op.DEQUANTS.count() == 2  # (the natural order's too)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sliced_transposed_and_unaligned_x(dtype):
    # the gather reads x with its strides and writes an aligned copy: the product's launch is recorded
    w = act_order_weight(384, 1024, 128, dtype, "cuda")
    natural = _natural(w)
    tol = tolerance(dtype)
    _clear()
    wide = torch.randn(17, 1030, dtype=dtype, device="cuda")
    x = wide[:, 3:1027]  # rows 2060 bytes apart, starting 6 bytes in
    for _ in range(2):
        assert torch.equal(w4a16.matmul(x, w), w4a16.matmul(x[:, w.perm], natural))
    assert op.REORDERS.count() == 1 and op.REPLAYS.count() == 2  # (the natural order's call's too)
    assert_rel_close(w4a16.matmul(x, w), reference(x, w), tol)
    y = torch.randn(2, 40, 1024, dtype=dtype, device="cuda")[:, ::2]  # leading dims, rows 4096 bytes apart
    assert_rel_close(w4a16.matmul(y, w).reshape(-1, 384), reference(y.reshape(-1, 1024), w), tol)
    z = torch.randn(1024, 3, dtype=dtype, device="cuda").T  # inputs strided
    for kernel in KERNELS:
        assert torch.equal(w4a16.matmul(z, w, kernel=kernel), w4a16.matmul(z[:, w.perm], natural, kernel=kernel))


def test_replays_take_the_calls_perm():
    # two weights of one layout, different perms: one key; the replays reorder through the second weight's perm
    _clear()
    w1 = act_order_weight(512, 2048, 128, device="cuda", seed=1)
    w2 = act_order_weight(512, 2048, 128, device="cuda", seed=2)
    for M in (1, 9, 20):
        for i, w in enumerate((w1, w2, w1)):
            x = torch.randn(M, 2048, dtype=torch.float16, device="cuda")
            assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)
            if i == 0:
                kept = [dict(cache.entries) for cache in CACHES]
        assert all(cache.entries[k] is v for cache, entries in zip(CACHES, kept) for k, v in entries.items())
    assert op.REORDERS.count() == 3 and op.REPLAYS.count() == 3


def _launched(fn) -> list:
    """The compiled kernels and grids of the Triton launches ``fn`` makes outside the replay caches (emptied)."""
    _clear()
    with recording() as rec:
        fn()
    _clear()
    assert rec.launches is not None
    return [(one.compiled, one.grid) for one in rec.launches]


@pytest.mark.parametrize("N", [4096, 1024])  # 1024: dequant_cublas at 512 rows
@pytest.mark.parametrize("M", [1, 3, 16, 64, 128, 512])
def test_eager_and_captured_calls_launch_the_same_kernels(N, M):
    # a captured call must load no kernel its eager warm-up did not: the same compiled kernels, the same grids
    w = act_order_weight(N, 2048, 128, device="cuda", seed=M)
    w.fragments()
    x = torch.randn(M, 2048, dtype=torch.float16, device="cuda")
    eager = _launched(lambda: w4a16.matmul(x, w))
    torch.cuda.synchronize()
    assert len(eager) >= 2 and eager[0][0].name == "reorder_kernel"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _launched(lambda: w4a16.matmul(x, w))
    torch.cuda.synchronize()
    assert [(c.name, g) for c, g in captured] == [(c.name, g) for c, g in eager]
    assert all(a is b for (a, _), (b, _) in zip(captured, eager))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N", [4096, 1024])
@pytest.mark.parametrize("M", [1, 3, 16, 64, 128, 512])
def test_a_capture_right_after_one_eager_call(dtype, N, M):
    w = act_order_weight(N, 2048, 128, dtype, "cuda", seed=M)
    w.fragments()  # (a first call inside a capture refuses to make them: test_w4a16_graph_capture.py)
    natural = _natural(w)
    x = torch.randn(M, 2048, dtype=dtype, device="cuda")
    w4a16.matmul(x, w)  # the one eager call: compiled, loaded, recorded
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16.matmul(x, w)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w4a16.matmul(x[:, w.perm], natural))
        assert_rel_close(out, reference(x, w), tolerance(dtype))


@pytest.mark.parametrize("cfg", [dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1, OVERLAP=False),
                                 dict(BM=8, RH=1, num_warps=4, STAGES=2, SPLIT_K=5, OVERLAP=False),
                                 dict(BM=16, RH=2, num_warps=4, STAGES=3, SPLIT_K=7, OVERLAP=True),
                                 dict(BM=32, RH=2, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=False),
                                 dict(BM=64, RH=1, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=True, PIPE=True),
                                 dict(BM=64, RH=1, num_warps=4, STAGES=5, SPLIT_K=1, OVERLAP=True, PIPE=True),
                                 dict(BM=128, RH=1, num_warps=8, STAGES=3, SPLIT_K=2, OVERLAP=True, PIPE=True)])
@pytest.mark.parametrize("M, K, group", [(3, 2048, 128), (50, 2080, 32), (64, 320, 64), (7, 200, -1)])
def test_gather_configs_and_splits(cfg, M, K, group):
    # each loop form (plain, OVERLAP, PIPE over few and many steps), uneven splits, launched twice into a
    # NaN-filled output (the split-K counters reset by the last arrival); perm int64 (the weight's) and int32
    from tilegemm.ops.w4a16 import frag_wgmma

    for dtype in (torch.float16, torch.bfloat16):
        w = act_order_weight(520, K, group, dtype, "cuda", seed=K)
        x = torch.randn(M, K, dtype=dtype, device="cuda")
        fw, fzs = w.fragments()
        for perm in (w.perm, w.perm.to(torch.int32)):
            out = torch.full((M, 520), float("nan"), dtype=dtype, device="cuda")
            kernel, grid, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, 520, K, w.group_k, "none",
                                                                cfg, perm)
            assert kwargs["GATHER"]
            for _ in range(2):
                kernel[grid](*args, **kwargs)
                assert_rel_close(out, reference(x, w), tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_gather_dequantizes_bit_for_bit(dtype, group, M):
    # one-hot rows of x: each output is one weight times 1, found through perm; it must equal dequantize's bits
    N, K = 200, 352 if group in (32, -1) else 384
    w = act_order_weight(N, K, group, dtype, "cuda", seed=M)
    cols = torch.arange(M, device="cuda") * 7 % K
    x = torch.zeros(M, K, dtype=dtype, device="cuda")
    x[torch.arange(M, device="cuda"), cols] = 1
    ref = w4a16.dequantize(w).T[cols]
    assert torch.equal(w4a16.matmul(x, w, kernel="frag_wgmma"), ref)  # reordered first
    fw, fzs = w.fragments()  # GATHER: the op called with perm and frag_wgmma named
    assert torch.equal(op._w4a16_op(x, w.qweight, w.scales, w.zeros, fw, fzs, None, w.group_k, "none", "frag_wgmma",
                                    w.perm), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 17, 64, 65, 128])
def test_the_op_gathers_where_frag_wgmma_is_named(dtype, M):
    w = act_order_weight(1000, 4096, 128, dtype, "cuda", seed=M)
    fw, fzs = w.fragments()
    x = torch.randn(M, 4096, dtype=dtype, device="cuda")
    bias = torch.randn(1000, dtype=dtype, device="cuda")
    out = op._w4a16_op(x, w.qweight, w.scales, w.zeros, fw, fzs, bias, w.group_k, "silu", "frag_wgmma", w.perm)
    assert_rel_close(out, reference(x, w, bias, "silu"), tolerance(dtype))


@pytest.mark.parametrize("M", [1, 17, 100])
def test_gradient_of_x(M):
    # autograd takes the op on x reordered by index_select; the gradient goes back through it
    w = act_order_weight(96, 512, 32, device="cuda")
    x = torch.randn(M, 512, dtype=torch.float16, device="cuda", requires_grad=True)
    bias = torch.randn(96, dtype=torch.float16, device="cuda", requires_grad=True)
    out = w4a16.matmul(x, w, bias=bias, activation="silu")
    g = torch.randn_like(out)
    out.backward(g)
    xd, bd = x.detach().double().requires_grad_(True), bias.detach().double().requires_grad_(True)
    ref = reference(xd, w, bd, "silu")
    ref.backward(g.double())
    assert_rel_close(out.detach(), ref, 2e-3)
    assert_rel_close(x.grad, xd.grad, 5e-3)
    assert_rel_close(bias.grad, bd.grad, 5e-3)


def test_int4linear_from_an_act_order_checkpoint():
    # from_gptq sorts the inputs (perm int64, kept as a buffer); the module's calls reorder x through it
    N, K, gs = 256, 1024, 128
    q = torch.randint(0, 16, (K, N), dtype=torch.int64)
    packed = sum(q.reshape(K // 8, 8, N)[:, i] << (4 * i) for i in range(8))
    qweight = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    zeros = torch.randint(0, 15, (K // gs, N), dtype=torch.int64)
    zpacked = sum(zeros.reshape(K // gs, N // 8, 8)[..., i] << (4 * i) for i in range(8))
    qzeros = torch.where(zpacked >= 2**31, zpacked - 2**32, zpacked).to(torch.int32)
    scales = (torch.rand(K // gs, N) * 0.1 + 0.01).half()
    g_idx = (torch.arange(K) // gs)[torch.randperm(K)].to(torch.int32)
    lin = Int4Linear.from_gptq(qweight, qzeros, scales, g_idx).cuda()
    assert lin.perm.numel() == K
    for M in (1, 16, 200):
        x = torch.randn(M, K, dtype=torch.float16, device="cuda")
        assert_rel_close(lin(x), reference(x, lin.weight), 2e-3)
