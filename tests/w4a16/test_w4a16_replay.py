"""The host fast path of w4a16.matmul (tilegemm.core.replay; keys in tilegemm.ops.w4a16.checks): keys on the CPU;
what the family keeps and how it replays it (stand-ins for the recorded launches) on the device fixture's tensors;
replays on a GPU."""

from __future__ import annotations

import pytest
import torch

from tilegemm.core.runtime import interpreting
from conftest import assert_rel_close

from tilegemm import w4a16
from tilegemm.core.launch import plain_call
from tilegemm.ops.w4a16 import api, checks, op
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
        "device": checks.key_of(x.to("meta"), w.to("meta"), None, "none", "auto"),
        "bias device": checks.key_of(x, w, bias.to("meta"), "none", "auto"),
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


def test_a_frozen_weight_requiring_grad_keys_like_any():
    # the weight is frozen (no gradient flows to it): its requires_grad neither routes a call through the op nor
    # changes the key; x's does (replay_key then gives None, on the GPU as here)
    w = weight()
    x = torch.randn(2, 256, dtype=torch.float16)
    key = checks.key_of(x, w, None, "none", "auto")
    w.scales.requires_grad_(True)
    assert checks.key_of(x, w, None, "none", "auto") == key
    assert checks.replay_key(x.requires_grad_(True), w, None, "none", "auto") is None


class _StandIn:
    """Stands in for a recorded replay of the dequantization (none is recorded under the interpreter, nor kept on a
    GPU under the ``keyed`` fixture): it writes ``wd`` into the output the cache allocates for it and keeps the
    tensors it was given."""

    def __init__(self, wd: torch.Tensor):
        self.wd, self.calls = wd, []
        self.output = (tuple(wd.shape), wd.dtype, wd.device, False)

    def __call__(self, *tensors) -> bool:
        self.calls.append(tensors)
        tensors[-1].copy_(self.wd)
        return True


@pytest.fixture
def keyed(monkeypatch):
    """Key calls as the GPU's plain calls are (the interpreter's CPU calls too), and note what each cache is asked
    to keep rather than keep it (the interpreter's launches are never kept; a GPU's are not either, so what a call
    replays is the stand-in a test puts in); the caches emptied before and after."""
    monkeypatch.setattr(api, "replay_key", lambda x2, w, bias, act, kernel, perm=None:
                        checks.key_of(x2, w, bias, act, kernel, perm) if plain_call(x2, bias) else None)
    stored = {"REPLAYS": [], "DEQUANTS": []}
    for name, notes in stored.items():
        monkeypatch.setattr(getattr(op, name), "store", lambda key, launches, tensors, out, *rest, notes=notes:
                            notes.append((key, tensors, out)))
    op.REPLAYS.clear()
    op.DEQUANTS.clear()
    yield stored
    op.REPLAYS.clear()
    op.DEQUANTS.clear()


@pytest.mark.parametrize("kernel, M", [("dequant_cublas", 3), ("auto", 130)])  # auto: dequant_cublas above 128 rows
def test_dequant_cublas_calls_are_kept_and_replayed_by_the_family(keyed, kernel, M, device):
    stored = keyed
    N, K = 40, 128
    w = weight(N=N, K=K, g=32, device=device)  # (narrow: auto takes no fragment kernel above 128 rows on Hopper)
    bias = torch.randn(N, dtype=torch.float16, device=device)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    y = w4a16.matmul(x, w, bias, "silu", kernel=kernel)
    assert_rel_close(y, reference(x, w, bias, "silu"), 2e-3)
    # the one Triton launch is kept in DEQUANTS with the weight it wrote as its output, under the call's key
    assert stored["REPLAYS"] == [] and len(stored["DEQUANTS"]) == 1
    key, tensors, wd = stored["DEQUANTS"][0]
    assert key == checks.key_of(x, w, bias, "silu", kernel)
    assert len(tensors) == len(checks.call_tensors(x, w, bias))
    assert all(a is b for a, b in zip(tensors, checks.call_tensors(x, w, bias)))
    assert torch.equal(wd, w4a16.dequantize(w))
    # a replay of it: the family runs cuBLAS on the weight it wrote, with the new call's x, bias and activation
    stand_in = op.DEQUANTS.entries[key] = _StandIn(wd)
    x_new = torch.randn(M, K, dtype=torch.float16, device=device)
    y_new = w4a16.matmul(x_new, w, bias, "silu", kernel=kernel)
    assert len(stand_in.calls) == 1 and stand_in.calls[0][0] is x_new and len(stand_in.calls[0]) == len(tensors) + 1
    fresh = w4a16.matmul(x_new.clone().requires_grad_(True), w, bias, "silu", kernel=kernel)  # the op's full path
    assert torch.equal(y_new, fresh.detach()), "the replay's cuBLAS half must give the bits of a fresh call"
    assert len(stand_in.calls) == 1 and len(stored["DEQUANTS"]) == 1
    # [..., K] activations: the same replay, the output shaped as x
    y3 = w4a16.matmul(x_new.view(1, M, K), w, bias, "silu", kernel=kernel)
    assert y3.shape == (1, M, N) and torch.equal(y3[0], y_new) and len(stand_in.calls) == 2


def test_one_launch_kernels_are_kept_whole(keyed, device):
    stored = keyed
    w = weight(N=40, K=128, g=32, device=device)
    x = torch.randn(2, 128, dtype=torch.float16, device=device)
    y = w4a16.matmul(x, w, kernel="gemv")
    assert stored["DEQUANTS"] == [] and len(stored["REPLAYS"]) == 1
    assert stored["REPLAYS"][0][2] is y  # the call's output, not a scratch tensor
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
def test_replay_declines_on_another_stream_and_dequant_cublas_is_kept_apart():
    op.REPLAYS.clear()
    op.DEQUANTS.clear()
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
    assert op.REPLAYS.count() == 1 and op.DEQUANTS.count() == 1  # (tests/w4a16/test_w4a16_replay_gpu.py)


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
