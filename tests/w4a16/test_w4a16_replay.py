"""The host fast path of w4a16.matmul (tilegemm.core.replay; keys in tilegemm.ops.w4a16.checks): keys on the CPU,
replays on a GPU."""

from __future__ import annotations

import pytest
import torch

from tilegemm.core.runtime import interpreting
from conftest import assert_rel_close

from tilegemm import w4a16
from tilegemm.ops.w4a16 import checks, op
from tilegemm.ops.w4a16.reference import reference


def weight(N=64, K=256, g=64, dtype=torch.float16, device="cpu"):
    return w4a16.quantize(torch.randn(N, K, dtype=dtype, device=device), g)


# --- keys (CPU) -------------------------------------------------------------------------------------------


def test_same_layout_same_key():
    w = weight()
    x1, x2 = torch.randn(3, 256, dtype=torch.float16), torch.randn(3, 256, dtype=torch.float16)
    assert checks.key_of(x1, w, None, "none", "auto") == checks.key_of(x2, w, None, "none", "auto")
    # another weight of the same layout shares the key: the replay takes the call's tensors
    assert checks.key_of(x1, w, None, "none", "auto") == checks.key_of(x1, weight(), None, "none", "auto")


def test_keys_differ_where_triton_specializes():
    w = weight()
    x = torch.randn(4, 256, dtype=torch.float16)
    base = checks.key_of(x, w, None, "none", "auto")
    bias = torch.randn(64, dtype=torch.float16)
    offset = torch.randn(4 * 256 + 1, dtype=torch.float16)[1:].view(4, 256)  # 2-byte aligned only
    wide = torch.randn(4, 512, dtype=torch.float16)[:, :256]  # row stride 512
    others = {
        "M": checks.key_of(torch.randn(5, 256, dtype=torch.float16), w, None, "none", "auto"),
        "dtype": checks.key_of(x.bfloat16(), w.to(torch.bfloat16), None, "none", "auto"),
        "strides": checks.key_of(wide, w, None, "none", "auto"),
        "alignment": checks.key_of(offset, w, None, "none", "auto"),
        "bias": checks.key_of(x, w, bias, "none", "auto"),
        "activation": checks.key_of(x, w, None, "silu", "auto"),
        "kernel": checks.key_of(x, w, None, "none", "gemv"),
        "N": checks.key_of(x, weight(N=72), None, "none", "auto"),
        "group": checks.key_of(x, weight(g=128), None, "none", "auto"),
    }
    for what, key in others.items():
        assert key != base, f"a call differing in {what} must not share the key"
    assert len(set(others.values())) == len(others)


def test_no_replay_on_the_cpu_or_under_autograd():
    w = weight()
    x = torch.randn(2, 256, dtype=torch.float16)
    assert checks.replay_key(x, w, None, "none", "auto") is None  # CPU / interpreter
    op.REPLAYS.clear()
    if not interpreting():  # a GPU is in use: CPU tensors are refused by name
        with pytest.raises(ValueError, match="CUDA GPU is in use"):
            w4a16.matmul(x, w)
        return
    y = w4a16.matmul(x, w)
    assert op.REPLAYS.count() == 0
    assert_rel_close(y, reference(x, w), 2e-3)


# --- replays (GPU) -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "gemv", "mma"])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_replayed_call_equals_a_fresh_one(kernel, M):
    op.REPLAYS.clear()
    w = weight(N=4096, K=4096, g=128, device="cuda")
    bias = torch.randn(4096, dtype=torch.float16, device="cuda")
    for act, b in (("none", None), ("silu", bias)):
        for trial in range(3):  # the first call records, later ones replay with new tensors
            x = torch.randn(M, 4096, dtype=torch.float16, device="cuda")
            w2 = weight(N=4096, K=4096, g=128, device="cuda") if trial == 2 else w  # a new weight, same layout
            y = w4a16.matmul(x, w2, bias=b, activation=act, kernel=kernel)
            assert_rel_close(y, reference(x, w2, b, act), 2e-3)
            fresh = w4a16.matmul(x.clone().requires_grad_(True), w2, bias=b, activation=act, kernel=kernel)
            assert torch.equal(y, fresh.detach()), "a replay must give the bits of a fresh launch"
    assert op.REPLAYS.count() == 2


@pytest.mark.gpu
def test_replay_declines_on_another_stream_and_dequant_cublas_is_not_recorded():
    op.REPLAYS.clear()
    w = weight(N=8192, K=8192, g=128, device="cuda")  # gemv splits K here: a workspace of its own
    x = torch.randn(1, 8192, dtype=torch.float16, device="cuda")
    w4a16.matmul(x, w)
    assert op.REPLAYS.count() == 1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = w4a16.matmul(x, w)
    side.synchronize()
    assert_rel_close(y, reference(x, w), 2e-3)
    w4a16.matmul(torch.randn(300, 8192, dtype=torch.float16, device="cuda"), w, kernel="dequant_cublas")
    assert op.REPLAYS.count() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 128])
def test_act_order_calls_are_replayed(group):
    # an act-order weight (inputs in another order): its calls take the fast path with x's inputs reordered first
    op.REPLAYS.clear()
    w = weight(N=1024, K=2048, g=group, device="cuda")
    w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, group, w.shape, torch.randperm(2048, device="cuda"))
    for M in (1, 9):
        for _ in range(3):
            x = torch.randn(M, 2048, dtype=torch.float16, device="cuda")
            y = w4a16.matmul(x, w)
            assert_rel_close(y, reference(x, w), 2e-3)
            fresh = w4a16.matmul(x.clone().requires_grad_(True), w)  # autograd: the full path
            assert torch.equal(y, fresh.detach())
    assert op.REPLAYS.count() == 2
