"""The host fast path of conv2d and its data gradient (tilegemm.ops.conv2d.replay): keys on the CPU, replays
on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format  # (torch.Tensor has no such method in Python)
from conftest import assert_rel_close

import tilegemm
from tilegemm.core.launch import recording, recording_active
from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d import checks
from tilegemm.ops.conv2d import op as replay

CL = torch.channels_last


def key(x, w, bias=None, conv=(1, 1, 1, 1), *options):
    return checks.key_of("fwd", x, w, bias, conv, *options)


def test_keys_differ_where_the_launch_does():
    x = torch.randn(2, 16, 9, 9, dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(32, 16, 3, 3, dtype=torch.float16).contiguous(memory_format=CL)
    # (replay_key itself declines on the CPU)
    assert checks.replay_key("fwd", x, w, None, (1, 1, 1, 1), "none", None, "auto") is None
    base = key(x, w)
    others = [
        key(x.contiguous(), w), key(x, w.contiguous()), key(x[:1], w), key(x, w, torch.randn(32, dtype=torch.float16)),
        key(x, w, None, (2, 1, 1, 1)), key(x, w, None, (1, 1, 1, 1), "relu"), key(x.float(), w.float()),
    ]
    assert all(k != base for k in others) and len(set(others)) == len(others)
    assert key(torch.randn_like(x), torch.randn_like(w)) == base  # new tensors of the same layouts: one key
    assert key(x, w, None, ([1, 1], "same", 1, 1)) == key(x, w, None, ((1, 1), "same", 1, 1))
    assert key(x, w, None, (torch.ones(2), 1, 1, 1)) is None  # not a geometry: no key (the checks will say why)
    assert key(x, w, None, (1, 1, 1, 1), ["relu"]) is None  # an unhashable option: no key, no TypeError


def test_nested_recordings_pass_their_launches_out():
    with recording() as outer:
        assert recording_active()
        with recording() as inner:
            pass
        assert inner.launches == []
    assert not recording_active() and outer.launches == []


@pytest.mark.skipif(not interpreting(), reason="a CPU call needs the interpreter (with a GPU in use it is refused)")
def test_no_replay_on_the_cpu():
    replay.REPLAYS.clear()
    x = torch.randn(1, 8, 6, 6).contiguous(memory_format=CL)
    w = torch.randn(8, 8, 3, 3)
    out = tilegemm.conv2d(x, w, padding=1)
    assert replay.REPLAYS.count() == 0
    assert_rel_close(out, F.conv2d(x.double(), w.double(), padding=1), 1e-4)


# --- replays (GPU) -----------------------------------------------------------------------------------------

LAYERS = [  # (C, K, R, stride, pad, groups): implicit GEMM, 1x1 (through matmul), strided, depthwise
    (64, 128, 3, 1, 1, 1), (64, 96, 1, 1, 0, 1), (32, 64, 1, 2, 0, 1), (48, 48, 3, 1, 1, 48),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: "c{}k{}r{}s{}p{}g{}".format(*l))
@pytest.mark.parametrize("fmt", ["cl", "nchw"])
def test_replayed_calls_equal_fresh_ones(layer, fmt):
    C, K, R, stride, pad, groups = layer
    replay.REPLAYS.clear()
    memory_format = CL if fmt == "cl" else torch.contiguous_format
    w = (torch.randn(K, C // groups, R, R, device="cuda") / (C * R) ** 0.5).half().contiguous(memory_format=CL)
    bias = torch.randn(K, device="cuda", dtype=torch.float16)
    for act, b in (("none", None), ("relu", bias)):
        outs = []
        for trial in range(3):  # the first call records, later ones replay with new tensors
            x = torch.randn(3, C, 17, 19, device="cuda", dtype=torch.float16).contiguous(memory_format=memory_format)
            out = tilegemm.conv2d(x, w, b, stride, pad, 1, groups, act)
            ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, pad, 1, groups)
            assert_rel_close(out, ref.relu() if act == "relu" else ref, 4e-3)
            # torch's format: channels-last where x or the weight is (an NCHW x with this channels-last weight too)
            want = suggest_memory_format(F.conv2d(x, w, b, stride, pad, 1, groups))
            assert out.is_contiguous(memory_format=want), (fmt, want)
            outs.append(out)
        assert outs[1].data_ptr() != outs[2].data_ptr()
    assert replay.REPLAYS.count() >= (2 if fmt == "cl" else 0)  # channels-last calls are one launch each: kept


@pytest.mark.gpu
def test_an_nchw_weight_is_transposed_by_a_launch_and_the_call_replays_reading_it_afresh():
    replay.REPLAYS.clear()
    x = torch.randn(2, 32, 10, 10, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    for _ in range(3):
        w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.float16)  # NCHW: made [K, R, S, C] in a workspace
        out = tilegemm.conv2d(x, w, padding=1)
        assert_rel_close(out, F.conv2d(x.double(), w.double(), padding=1), 4e-3)
    assert replay.REPLAYS.count() == 1


@pytest.mark.gpu
def test_backward_gradients_replay_and_match_torch():
    replay.REPLAYS.clear()
    w = (torch.randn(64, 32, 3, 3, device="cuda") * 0.05).half().contiguous(memory_format=CL).requires_grad_()
    for _ in range(3):
        x = torch.randn(2, 32, 12, 12, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
        x.requires_grad_()
        dy = torch.randn(2, 64, 12, 12, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
        tilegemm.conv2d(x, w, padding=1).backward(dy)
        xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        F.conv2d(xr, wr, padding=1).backward(dy.double())
        assert_rel_close(x.grad, xr.grad, 4e-3)
        assert_rel_close(w.grad, wr.grad, 4e-3)
        w.grad = None
    assert replay.REPLAYS.count() >= 2  # the data and the weight gradient (the forward under autograd is not plain)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the TMA kernel, and the pointer kernel
def test_channels_last_weight_gradient_replays_in_its_layout(dtype):
    """A channels-last activation's weight gradient is recorded and replayed channels-last, new values each
    call."""
    from tilegemm.ops.conv2d.op import backward_weight
    from tilegemm.ops.conv2d.problem import WgradCall

    replay.REPLAYS.clear()
    args = ([1, 1], [1, 1, 1, 1], [1, 1], 1, "ieee")
    for _ in range(3):
        x = torch.randn(2, 16, 9, 10, device="cuda", dtype=dtype).contiguous(memory_format=CL)
        dy = torch.randn(2, 24, 9, 10, device="cuda", dtype=dtype).contiguous(memory_format=CL)
        dw = backward_weight(WgradCall(dy, x, [24, 16, 3, 3], *args))
        assert dw.is_contiguous(memory_format=CL) and not dw.is_contiguous()
        xr = x.double().requires_grad_()
        wr = torch.zeros(24, 16, 3, 3, dtype=torch.float64, device="cuda", requires_grad=True)
        F.conv2d(xr, wr, padding=1).backward(dy.double())
        assert_rel_close(dw, wr.grad, 4e-3 if dtype == torch.float16 else 1e-5)
    assert replay.REPLAYS.count() == 1  # recorded once, replayed twice


@pytest.mark.gpu
def test_replay_declines_on_another_stream():
    replay.REPLAYS.clear()
    w = torch.randn(32, 16, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    x = torch.randn(2, 16, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    first = tilegemm.conv2d(x, w, padding=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = tilegemm.conv2d(x, w, padding=1)
    torch.cuda.current_stream().wait_stream(side)
    assert_rel_close(again, first.double(), 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("grads", ["none", "x", "x and weight"])
def test_strided_1x1_after_a_bigger_call_reads_its_own_pixels(grads):
    # The kept pixels are gathered into a per-stream workspace that a bigger call replaces; every replay (the
    # inner matmul's own too, kept where autograd watches the conv2d call) must read the current one.
    from tilegemm.core.replay import cache
    matmul_replay = cache("matmul")

    replay.REPLAYS.clear()
    matmul_replay.clear()
    w = (torch.randn(64, 64, 1, 1, device="cuda") / 8).half().contiguous(memory_format=CL)
    w.requires_grad_(grads == "x and weight")
    for shape in [(2, 64, 16, 16)] * 3 + [(2, 64, 64, 64)] + [(2, 64, 16, 16)] * 2:
        x = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
        x.requires_grad_(grads != "none")
        out = tilegemm.conv2d(x, w, stride=2)
        ref = F.conv2d(x.detach().double(), w.detach().double(), stride=2)
        assert_rel_close(out.detach(), ref, 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_strided_1x1_data_gradient_replays_through_its_workspace(dtype):
    # The product over the kept pixels lands in a per-stream workspace that the spread kernel reads; a bigger
    # call in between replaces the workspace, and the replays must keep reading the one they were recorded with.
    from tilegemm.ops.conv2d import op
    from tilegemm.ops.conv2d.problem import DgradCall

    replay.REPLAYS.clear()
    w = (torch.randn(128, 64, 1, 1, device="cuda") / 8).to(dtype).contiguous(memory_format=CL)
    for size in (16, 16, 16, 64, 16, 16):  # at 64 the product (131072 elements) outgrows the first workspace
        x_shape = [2, 64, size, size]
        dy = torch.randn(2, 128, size // 2, size // 2, device="cuda", dtype=dtype).contiguous(memory_format=CL)
        dx = op.backward_data(DgradCall(dy, w, x_shape, True, [2, 2], [0, 0, 0, 0], [1, 1], 1, "ieee"))
        xr = torch.zeros(x_shape, dtype=torch.float64, device="cuda", requires_grad=True)
        F.conv2d(xr, w.double(), stride=2).backward(dy.double())
        assert dx.is_contiguous(memory_format=CL)
        assert_rel_close(dx, xr.grad, 4e-3 if dtype == torch.float16 else 2e-2)
    assert replay.REPLAYS.count() == 2  # one recording a size


@pytest.mark.gpu
def test_depthwise_replays_read_the_weight_as_it_is_now():
    # The forward rewrites the weight tap-major into a per-stream workspace on every call, replays included:
    # a weight changed in place, or a bigger depthwise call in between (which may replace the workspace),
    # must not leave a replay reading stale weights.
    replay.REPLAYS.clear()
    w = (torch.randn(48, 1, 3, 3, device="cuda") / 3).half()
    x = torch.randn(2, 48, 15, 13, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    # 2048 channels x 7 x 7 taps: more than the workspace's first 65536 elements, so it is replaced
    big_w = torch.randn(2048, 1, 7, 7, device="cuda", dtype=torch.float16)
    big_x = torch.randn(1, 2048, 9, 9, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    for trial in range(4):
        out = tilegemm.conv2d(x, w, padding=1, groups=48)
        assert_rel_close(out, F.conv2d(x.double(), w.double(), padding=1, groups=48), 4e-3)
        w.mul_(-1.5)
        if trial == 1:
            big = tilegemm.conv2d(big_x, big_w, padding=3, groups=2048)
            assert_rel_close(big, F.conv2d(big_x.double(), big_w.double(), padding=3, groups=2048), 4e-3)
    assert replay.REPLAYS.count() >= 1


# --- the public forward's flat key (checks.forward_key) -----------------------------------------------------


def fkey(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, activation="none", precision=None,
         kernel="auto"):
    return checks.forward_key_of(x, w, bias, stride, padding, dilation, groups, activation, precision, kernel)


def test_forward_keys_differ_where_the_launch_does():
    x = torch.randn(2, 16, 9, 9, dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(32, 16, 3, 3, dtype=torch.float16).contiguous(memory_format=CL)
    b = torch.randn(32, dtype=torch.float16)
    assert checks.forward_key(x, w, None, 1, 1, 1, 1, "none", None, "auto") is None  # the gate: CPU tensors
    base = fkey(x, w)
    flat = torch.randn(2 * 16 * 9 * 9 + 1, dtype=torch.float16)
    misaligned = flat[1:].view(2, 9, 9, 16).permute(0, 3, 1, 2)  # channels-last, 2 bytes off 16-byte alignment
    others = {
        "NCHW x": fkey(x.contiguous(), w), "NCHW w": fkey(x, w.contiguous()), "batch": fkey(x[:1], w),
        "misaligned x": fkey(misaligned, w), "bias": fkey(x, w, b), "fp32 bias": fkey(x, w, b.float()),
        "bias stride": fkey(x, w, torch.randn(64, dtype=torch.float16)[::2]),
        "stride": fkey(x, w, None, 2), "padding": fkey(x, w, None, 1, 1), "padding pair": fkey(x, w, None, 1, (1, 0)),
        "same": fkey(x, w, None, 1, "same"), "dilation": fkey(x, w, None, 1, 0, 2), "groups": fkey(x, w, None, 1, 0, 1, 2),
        "activation": fkey(x, w, None, activation="relu"), "precision": fkey(x, w, None, precision="ieee"),
        "kernel": fkey(x, w, None, kernel="implicit_gemm"), "fp32": fkey(x.float(), w.float()),
        "bf16 weight": fkey(x, w.bfloat16()), "weight shape": fkey(x, w[:16]),
    }
    assert all(k is not None and k != base for k in others.values())
    assert len(set(others.values())) == len(others)
    assert fkey(torch.randn_like(x), torch.randn_like(w)) == base  # new tensors of the same layouts: one key
    assert fkey(x, w, b) == fkey(x, w, torch.randn_like(b))
    # a list is keyed as its tuple
    assert fkey(x, w, None, [2, 1], [1, 1], [1, 2]) == fkey(x, w, None, (2, 1), (1, 1), (1, 2))
    # the public keys never meet the op's or the gradients' (kept in the same cache)
    assert base != checks.key_of("fwd", x, w, None, (1, 0, 1, 1), "none", None, "auto")


def test_fp32_forward_keys_follow_the_global_precision():
    x, w = torch.randn(1, 8, 5, 5), torch.randn(8, 8, 3, 3)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        highest = fkey(x, w)
        torch.set_float32_matmul_precision("high")
        assert fkey(x, w) != highest
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("args", [
    dict(stride=True), dict(stride=1.0), dict(stride=(1.0, 1)), dict(stride=(1, True)), dict(padding=(1, 1, 1, 1)),
    dict(padding=[1]), dict(dilation=torch.ones(2)), dict(dilation=(1, 1.0)), dict(groups=True),
    dict(groups=1.0), dict(activation=["relu"]), dict(activation=1), dict(kernel=None), dict(precision=1),
    dict(padding=("same", 1)),
], ids=repr)
def test_forward_keys_refuse_what_the_checks_would(args):
    """An argument the checks reject (or that only equals an int: True, 1.0) gets no key, so a call with it
    never replays a call made with the int: it meets the checks on the full path."""
    x = torch.randn(1, 8, 5, 5, dtype=torch.float16)
    w = torch.randn(8, 8, 3, 3, dtype=torch.float16)
    assert fkey(x, w, **args) is None


@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (3, 7, 1, 1), (1, 1, 1, 1)])
@pytest.mark.parametrize("poison", [False, True])
def test_replay_allocates_channels_last_outputs_as_the_permuted_layout(shape, poison):
    """A replay's channels-last output is one allocation with the strides of an NHWC tensor seen as NCHW (what
    the recorded call returned); NaN while poisoning."""
    from tilegemm.core.runtime import new_output, set_poisoning

    n, c, h, w = shape
    old = set_poisoning(poison)
    try:
        out = new_output(shape, torch.float16, torch.device("cpu"), CL)
    finally:
        set_poisoning(old)
    assert out.shape == shape and out.dtype == torch.float16
    assert out.stride() == torch.empty(n, h, w, c).permute(0, 3, 1, 2).stride()
    assert out.is_contiguous(memory_format=CL)
    if poison:
        assert torch.isnan(out).all()


@pytest.mark.skipif(not interpreting(), reason="CPU tensors: the declined call runs on the interpreter")
def test_a_key_hit_replays_without_the_full_path_and_a_declined_one_takes_it(monkeypatch):
    """The public function and the module ask for the key first and, on a hit, only allocate the output and call
    the recorded launches (no checks, no dispatch); a replay that declines (another stream) leaves the call to the
    full path. On the CPU the key is patched in and the recorded launch is a stand-in."""
    from tilegemm.ops.conv2d import api, dispatch

    asked, launched, full = [], [], []
    monkeypatch.setattr(api, "forward_key", lambda *args: asked.append(args) or ("test-key",))
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda c: full.append(c) or real(c))

    class Recorded:  # a kept replay: its output's (shape, dtype, device, channels-last) and its launches
        output = ((2, 8, 6, 6), torch.float32, torch.device("cpu"), True)
        accept = True

        def __call__(self, *tensors):
            launched.append(tensors)
            return self.accept

    hit = Recorded()
    replay.REPLAYS.clear()
    replay.REPLAYS.entries[("test-key",)] = hit
    try:
        x = torch.randn(2, 4, 6, 6).contiguous(memory_format=CL)
        m = tilegemm.nn.Conv2d(4, 8, 3, padding=1)
        w, b = m.weight.detach(), m.bias.detach()
        out = tilegemm.conv2d(x, w, b, 1, 1)
        assert out.shape == (2, 8, 6, 6) and out.is_contiguous(memory_format=CL) and not out.is_contiguous()
        assert launched == [(x, w, b, out)] and not full
        assert asked[-1] == (x, w, b, 1, 1, 1, 1, "none", None, "auto")
        with torch.no_grad():
            out = m(x)
        assert launched[-1][:3] == (x, m.weight, m.bias) and launched[-1][3] is out and not full
        assert asked[-1] == (x, m.weight, m.bias, (1, 1), (1, 1), (1, 1), 1, "none", None, "auto")
        hit.accept = False  # the replay declines: the call runs afresh
        out = tilegemm.conv2d(x, w, b, 1, 1, activation="relu")
        assert len(full) == 1 and asked[-1][7] == "relu"
        assert_rel_close(out, F.conv2d(x.double(), w.double(), b.double(), 1, 1).relu(), 1e-5)
    finally:
        replay.REPLAYS.clear()


def test_checks_run_once_per_layout_under_autograd(monkeypatch, device):
    """A call autograd records has no replay key; its checks still run once per layout (their resolved geometry
    kept), and a call of another layout or with bad arguments meets them."""
    from tilegemm.ops.conv2d import api

    api.forget_checks()
    calls = []
    real = api.check_conv
    monkeypatch.setattr(api, "check_conv", lambda *a: calls.append(1) or real(*a))
    conv = tilegemm.nn.Conv2d(4, 8, 3, padding=1).to(device)
    x = torch.randn(2, 4, 6, 6, device=device, requires_grad=True)
    outs = [conv(x) for _ in range(3)]
    assert len(calls) == 1
    ref = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    for out in outs:
        assert_rel_close(out, ref, 1e-3 if device == "cuda" else 1e-4)
    outs[0].sum().backward()
    assert x.grad is not None and conv.weight.grad is not None
    conv(torch.randn(2, 4, 7, 6, device=device, requires_grad=True))  # another shape: checked
    assert len(calls) == 2
    with pytest.raises(ValueError):  # a stride no layout passed with: checked, and refused
        tilegemm.conv2d(x, conv.weight, conv.bias, stride=0)
    with pytest.raises(ValueError):  # again: a refused layout is never kept
        tilegemm.conv2d(x, conv.weight, conv.bias, stride=0)
