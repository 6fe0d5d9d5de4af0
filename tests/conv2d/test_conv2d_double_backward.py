"""Double backward (``create_graph=True``: gradient penalties, Hessian-vector products) through tilegemm.conv2d,
against F.conv2d's in float64: the data and weight gradients' ops have autograd of their own."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.conv2d.reference import conv2d_reference

from conftest import assert_rel_close, crossed

CL = torch.channels_last


def _second_order(conv_fn, x, w, b, dy, vs):
    """Gradients of <d out/d (x, w, b) . dy, vs> in x, w, b and dy: every second-order term of the op."""
    out = conv_fn(x, w, b)
    firsts = torch.autograd.grad(out, (x, w, b), dy, create_graph=True)
    penalty = sum((f * v).sum() for f, v in zip(firsts, vs))
    return out, firsts, torch.autograd.grad(penalty, (x, w, b, dy), allow_unused=True)


_SHAPES = [  # images of at most one pixel block a launch (the interpreter's cost)
    pytest.param((2, 4, 5, 6, 6, 3, 3), dict(padding=1), id="3x3"),
    pytest.param((1, 4, 8, 7, 6, 3, 3), dict(stride=2, padding=1, dilation=(2, 1)), id="strided-dilated"),
    pytest.param((2, 8, 5, 5, 8, 1, 1), dict(), id="pointwise"),
    pytest.param((1, 6, 5, 5, 6, 3, 3), dict(padding=1, groups=6), id="depthwise"),
    pytest.param((1, 8, 4, 4, 4, 3, 3), dict(padding="same", groups=2), id="same-groups2"),
]


# every layer in both layouts and with each activation (relu's backward takes silu's path through tilegemm: only
# the forward's epilogue and torch's derivative differ): under the interpreter half the cross, every pair meeting
@crossed("shape,conv,channels_last,activation", _SHAPES,
         [pytest.param(False, id="nchw"), pytest.param(True, id="nhwc")], ["none", "silu", "relu"])
def test_double_backward_matches_torch(shape, conv, channels_last, activation, device):
    N, C, H, W, K, R, S = shape
    groups = conv.get("groups", 1)
    x = torch.randn(N, C, H, W, device=device)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    w = torch.randn(K, C // groups, R, S, device=device) / (C // groups * R * S) ** 0.5
    b = torch.randn(K, device=device)
    dy = torch.randn(conv2d_reference(x, w, b, **conv).shape, device=device)
    vs = [torch.randn_like(t) for t in (x, w, b)]

    got = _second_order(lambda x, w, b: tilegemm.conv2d(x, w, b, **conv, activation=activation, precision="ieee"),
                        *(t.detach().clone().requires_grad_() for t in (x, w, b, dy)), vs)
    want = _second_order(lambda x, w, b: conv2d_reference(x, w, b, **conv, activation=activation),
                         *(t.detach().double().requires_grad_() for t in (x, w, b, dy)),
                         [v.double() for v in vs])
    assert_rel_close(got[0], want[0].detach(), 1e-5)
    for g, r in zip(got[1], want[1]):
        assert_rel_close(g, r.detach(), 1e-5)
    for name, g, r in zip(("x", "weight", "bias", "dy"), got[2], want[2]):
        if r is None or not r.abs().max():
            assert g is None or not g.abs().max(), name
        else:
            assert g is not None, name
            assert_rel_close(g, r, 1e-5)


def test_gradient_penalty_through_converted_module(device):
    """The audit's case: a gradient penalty on the input gradient of a converted nn.Conv2d trains the weight as
    torch's does."""
    from tilegemm.nn import Conv2d

    conv = torch.nn.Conv2d(4, 6, 3).to(device)
    x = torch.randn(2, 4, 8, 8, device=device, requires_grad=True)

    def penalty(model):
        (g,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), model.weight)[0]

    assert_rel_close(penalty(Conv2d.from_conv(conv)), penalty(conv), 1e-5)


def test_third_order_runs(device):
    """The gradients' own backward goes through the ops again, so higher orders are recorded too."""
    x = torch.randn(1, 3, 5, 5, device=device, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, device=device, requires_grad=True)
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))

    def third(conv, x, w):
        (g,) = torch.autograd.grad(conv(x, w).pow(3).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.pow(2).sum(), w, create_graph=True)
        return torch.autograd.grad(h.pow(2).sum(), x)[0]

    got = third(lambda x, w: tilegemm.conv2d(x, w, padding=1, precision="ieee"), x, w)
    want = third(lambda x, w: torch.nn.functional.conv2d(x, w, padding=1), xr, wr)
    assert_rel_close(got, want, 1e-4)
