"""The public forward's replay path on a GPU (checks.forward_key): a replayed call launches what a fresh call
launches, into an output of the same layout, across layer kinds; and it declines where a plain call must not be
replayed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format  # (torch.Tensor has no such method in Python)
from conftest import assert_rel_close

import tilegemm
from tilegemm.core.launch import recording
from tilegemm.core.replay import cache
from tilegemm.ops.conv2d import checks, dispatch
from tilegemm.ops.conv2d.problem import ConvCall

CL = torch.channels_last

# (name, N, C, H, W, K, R, stride, padding, groups, channels-last input)
LAYERS = [
    ("1x1", 4, 64, 14, 14, 96, 1, 1, 0, 1, True),
    ("1x1-se", 32, 348, 1, 1, 3712, 1, 1, 0, 1, True),  # [N, C, 1, 1]: contiguous and channels-last at once
    ("3x3-stride2", 2, 64, 17, 19, 128, 3, 2, 1, 1, True),
    ("depthwise", 2, 96, 15, 15, 96, 3, 1, 1, 96, True),
    ("grouped", 2, 128, 14, 14, 128, 3, 1, 1, 32, True),  # 4 channels a group
    ("3x3-nchw", 2, 64, 13, 11, 64, 3, 1, 1, 1, False),
]
# Layers whose call is documented to be kept (every launch Triton's, over the call's tensors or kept workspaces;
# the SE layer's one launch: docs/conv2d.md, "1x1 layers").
KEPT = {"1x1", "1x1-se", "3x3-stride2", "depthwise", "grouped", "3x3-nchw"}


def _layout(t: torch.Tensor) -> tuple:
    """The strides of the dims that have more than one element (the others never move an address)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: l[0])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gpu_replayed_calls_equal_fresh_ones(layer, bias, monkeypatch):
    name, N, C, H, W, K, R, stride, pad, groups, cl = layer
    fmt = CL if cl else torch.contiguous_format
    replays = cache("conv2d")
    replays.clear()
    full = []  # the calls that took the full path (dispatch.forward)
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda c: full.append(c) or real(c))
    torch.manual_seed(0)
    w = (torch.randn(K, C // groups, R, R, device="cuda") / (C // groups * R * R) ** 0.5).half().contiguous(
        memory_format=CL)
    b = torch.randn(K, device="cuda", dtype=torch.float16) if bias else None
    with torch.no_grad():
        for trial in range(3):  # the first call records, the later ones replay with new tensors
            x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
            out = tilegemm.conv2d(x, w, b, stride, pad, 1, groups, "relu")
            fresh = real(ConvCall(x, w, b, [stride] * 2, [pad] * 4, [1, 1], groups, "relu", "default", "auto"))
            assert out.shape == fresh.shape and out.dtype == fresh.dtype and _layout(out) == _layout(fresh)
            # torch's format: channels-last where x or the weight is (the weight here always is)
            assert out.is_contiguous(memory_format=suggest_memory_format(F.conv2d(x, w, b, stride, pad, 1, groups)))
            assert_rel_close(out, fresh.double(), 2e-3)
            ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, pad, 1, groups)
            assert_rel_close(out, ref.relu(), 4e-3)
    kept = replays.count()
    assert kept <= 1
    assert len(full) == (1 if kept else 3)  # kept: the later calls replayed without the full path
    if name in KEPT:
        assert kept == 1, f"{name}: the call was not kept for replay"


@pytest.mark.gpu
def test_gpu_module_calls_replay_and_keep_their_layout(monkeypatch):
    full = []
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda c: full.append(c) or real(c))
    cache("conv2d").clear()
    m = tilegemm.nn.Conv2d(32, 64, 3, stride=2, padding=1, activation="silu").cuda().half()
    m = m.to(memory_format=CL)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 32, 15, 16, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
            ref = F.silu(F.conv2d(x.double(), m.weight.double(), m.bias.double(), 2, 1))
            out = m(x)
            assert out.is_contiguous(memory_format=CL) and not out.is_contiguous()
            assert_rel_close(out, ref, 4e-3)
    assert cache("conv2d").count() == 1 and len(full) == 1


@pytest.mark.gpu
def test_gpu_a_kept_call_does_not_excuse_arguments_the_checks_refuse():
    """A bool or float equals an int in a tuple; a call with one must meet the checks, never the int call's
    replay."""
    cache("conv2d").clear()
    x = torch.randn(2, 16, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(32, 16, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    for _ in range(2):
        tilegemm.conv2d(x, w, None, (1, 1), (1, 1))
    assert cache("conv2d").count() == 1
    with pytest.raises(TypeError, match="stride"):
        tilegemm.conv2d(x, w, None, (1.0, 1), (1, 1))
    with pytest.raises(TypeError, match="padding"):
        tilegemm.conv2d(x, w, None, (1, 1), (True, 1))
    with pytest.raises(TypeError, match="groups"):
        tilegemm.conv2d(x, w, None, (1, 1), (1, 1), 1, 1.0)
    with pytest.raises(ValueError, match="activation"):
        tilegemm.conv2d(x, w, None, (1, 1), (1, 1), activation="rellu")


@pytest.mark.gpu
def test_gpu_forward_keys_decline_where_a_call_must_not_replay(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(2, 16, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(32, 16, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    b = torch.randn(32, device="cuda", dtype=torch.float16)

    def key(x=x, w=w, b=b):
        return checks.forward_key(x, w, b, 1, 1, 1, 1, "none", None, "auto")

    with torch.no_grad():
        assert key() is not None
    assert key() is not None  # grad mode on, nothing requiring grad
    assert key(x=x.clone().requires_grad_()) is None  # autograd must see the call
    assert key(w=torch.nn.Parameter(w.clone())) is None
    assert key(b=torch.nn.Parameter(b.clone())) is None
    with torch.no_grad():
        assert key(w=torch.nn.Parameter(w.clone())) is not None  # a module's weight at inference

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    with Mode():
        assert key() is None
    with recording():  # inside another op's recording the call must launch
        assert key() is None
    assert key(x=x.as_subclass(Sub)) is None and key(b=b.as_subclass(Sub)) is None
    monkeypatch.setattr(checks, "in_graph_tree", lambda: True)
    assert key() is None
