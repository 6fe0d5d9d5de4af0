"""GPTQ act-order on the GPU: ``frag_wgmma`` reading x through ``perm`` (``GATHER``, up to
``dispatch.GATHER_MAX_M`` rows and ``GATHER_MAX_X`` elements of x, or forced up to 64 rows; above, x reordered
first) against ``x @ dequantize(w).T`` in float64 (outputs NaN-poisoned by conftest): fp16 and bf16, M 1..256,
groups 32 / 128 / all of K over a K that is no multiple of 64, bias and activations, sliced and unaligned x,
every loop form and K split, bit for bit (one-hot rows), replays with another perm, the gradient of x, and no
index_select where the kernel gathers.

    python3 -m pytest -q -m gpu -p no:cacheprovider tests/w4a16/test_w4a16_actorder_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close
from w4a16_kit import act_order_weight

from tilegemm import w4a16
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16 import dispatch, op
from tilegemm.ops.w4a16.reference import reference, tolerance

pytestmark = pytest.mark.gpu

MS = [1, 2, 3, 8, 16, 17, 33, 64, 65, 128, 256]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group, N, K", [(128, 1000, 4096), (32, 520, 4128), (-1, 300, 200)])
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("forced", [False, True])
def test_act_order_matches_the_reference(monkeypatch, dtype, group, N, K, M, forced):
    if forced:  # the gather wherever the tile allows (up to 64 rows), whatever x's size
        monkeypatch.setattr(dispatch, "GATHER_MAX_X", 1 << 40)
    w = act_order_weight(N, K, group, dtype, "cuda", seed=M)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    bias = torch.randn(N, dtype=dtype, device="cuda")
    tol = tolerance(dtype)
    assert dispatch.gathers("auto", x, w) == (M <= dispatch.GATHER_MAX_M and M * K <= dispatch.GATHER_MAX_X)
    for kernel in ("auto", "frag_wgmma"):
        assert_rel_close(w4a16.matmul(x, w, kernel=kernel), reference(x, w), tol)
        for act in ("silu", "gelu"):
            assert_rel_close(w4a16.matmul(x, w, bias=bias, activation=act, kernel=kernel),
                             reference(x, w, bias, act), tol)


@pytest.mark.parametrize("M", [1, 16, 48, 49, 65])
def test_no_index_select_where_the_kernel_gathers(monkeypatch, M):
    w = act_order_weight(256, 1024, 128, device="cuda")
    x = torch.randn(M, 1024, dtype=torch.float16, device="cuda")
    assert dispatch.gathers("auto", x, w) == (M <= 48)  # 48 x 1024 elements: GATHER_MAX_X
    calls = []
    real = torch.Tensor.index_select

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    op.REPLAYS.clear()
    for _ in range(3):  # recorded, then replayed
        assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)
    assert (len(calls) == 0) == (M <= 48)
    assert op.REPLAYS.count() == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sliced_and_unaligned_x(dtype):
    # gathered x is read element by element: no copy of x for unaligned rows or start, so the launch is recorded
    w = act_order_weight(384, 1024, 128, dtype, "cuda")
    tol = tolerance(dtype)
    op.REPLAYS.clear()
    wide = torch.randn(17, 1030, dtype=dtype, device="cuda")
    x = wide[:, 3:1027]  # rows 2060 bytes apart, starting 6 bytes in
    for _ in range(2):
        assert_rel_close(w4a16.matmul(x, w), reference(x, w), tol)
    assert op.REPLAYS.count() == 1
    y = torch.randn(2, 40, 1024, dtype=dtype, device="cuda")[:, ::2]  # leading dims, rows 4096 bytes apart
    assert_rel_close(w4a16.matmul(y, w).reshape(-1, 384), reference(y.reshape(-1, 1024), w), tol)
    z = torch.randn(1024, 3, dtype=dtype, device="cuda").T  # inputs strided: made contiguous first
    assert_rel_close(w4a16.matmul(z, w, kernel="frag_wgmma"), reference(z, w), tol)


def test_replays_take_the_calls_perm():
    # two weights of one layout, different perms: one key; the replay reads x through the second weight's perm
    op.REPLAYS.clear()
    w1 = act_order_weight(512, 2048, 128, device="cuda", seed=1)
    w2 = act_order_weight(512, 2048, 128, device="cuda", seed=2)
    for M in (1, 9, 20):  # gathered (x within GATHER_MAX_X)
        for i, w in enumerate((w1, w2, w1)):
            x = torch.randn(M, 2048, dtype=torch.float16, device="cuda")
            assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)
            if i == 0:
                kept = dict(op.REPLAYS.entries)
        # the later calls replayed the first one's entry (a declined replay would have recorded a new one)
        assert all(op.REPLAYS.entries[k] is v for k, v in kept.items())
    assert op.REPLAYS.count() == 3


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
    assert torch.equal(w4a16.matmul(x, w, kernel="frag_wgmma"), w4a16.dequantize(w).T[cols])


@pytest.mark.parametrize("M", [1, 17, 100])
def test_gradient_of_x(M):
    # autograd takes the op (the kernel gathers in the forward at M <= 64); the gradient goes back through perm
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
    # from_gptq sorts the inputs (perm int64, kept as a buffer); the module's calls gather through it
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
