"""The backward pass of tilegemm.matmul copies no activation-sized tensor: without an activation the gradient
is used in its own dtype (no fp32 round trip), and a column-major operand (``nn.Linear``'s ``weight.t()``) gets
its gradient column-major, so autograd does not copy it into the parameter's layout."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.runtime import interpreting
from conftest import tensor_copies

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tensors, copies counted and values compared bit "
                                "for bit on the interpreter's path; on the GPU a training step's profile measures "
                                "them (docs/conv2d.md)")


def _linear(dtype, activation=None):
    layer = tilegemm.nn.Linear(8, 24, activation=activation).to(dtype)
    x = torch.randn(2, 3, 5, 8, dtype=dtype, requires_grad=True)
    gy = torch.randn(2, 3, 5, 24, dtype=dtype)
    return layer, x, gy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_backward_copies_only_the_bias_gradient(dtype):
    layer, x, gy = _linear(dtype)
    copies = tensor_copies(lambda: layer(x).backward(gy))
    # the bias gradient, summed in fp32, cast to the bias's dtype (a no-op for fp32)
    assert copies == ([] if dtype == torch.float32 else [("_to_copy", (24,), (1,), torch.float32)])
    assert layer.weight.grad.is_contiguous() and x.grad.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_gradients_are_those_of_the_fp32_round_trip(dtype):
    """The same values as the backward pass computed them through an fp32 copy of the gradient and the
    row-major product for the weight."""
    layer, x, gy = _linear(dtype)
    layer(x).backward(gy)
    x2, g2 = x.detach().flatten(0, -2), gy.float().flatten(0, -2)
    g = g2.to(dtype)
    assert torch.equal(layer.bias.grad, g2.sum(0).to(dtype))
    assert torch.equal(layer.weight.grad, tilegemm.matmul(x2.t(), g).t())
    assert torch.equal(x.grad, tilegemm.matmul(g, layer.weight.detach()).view_as(x))


def test_an_activation_keeps_its_fp32_gradient():
    """With an activation the derivative is taken in fp32 (the pre-activation recomputed), as before."""
    layer, x, gy = _linear(torch.float16, "gelu")
    layer(x).backward(gy)
    ref = torch.nn.Linear(8, 24).double()
    ref.load_state_dict(layer.state_dict())
    xr = x.detach().double().requires_grad_(True)
    torch.nn.functional.gelu(ref(xr)).backward(gy.double())
    for ours, theirs in ((x.grad, xr.grad), (layer.weight.grad, ref.weight.grad), (layer.bias.grad, ref.bias.grad)):
        assert torch.allclose(ours.double(), theirs, rtol=2e-2, atol=2e-2)


def test_a_column_major_operand_gets_a_column_major_gradient():
    a = torch.randn(16, 12, dtype=torch.float16).requires_grad_(True)  # used as a.t(): [12, 16], column-major
    b = torch.randn(8, 16, dtype=torch.float16).t().detach().requires_grad_(True)  # a column-major leaf [16, 8]
    gy = torch.randn(12, 8, dtype=torch.float16)
    copies = tensor_copies(lambda: tilegemm.matmul(a.t(), b).backward(gy))
    assert copies == []
    assert a.grad.stride() == a.stride() and b.grad.stride() == b.stride()
    # the transposed products, whose transposes they are
    assert torch.equal(a.grad, tilegemm.matmul(b.detach(), gy.t()))
    assert torch.equal(b.grad, tilegemm.matmul(gy.t(), a.detach().t()).t())
    assert torch.allclose(a.grad.float(), (gy.float() @ b.detach().float().t()).t(), rtol=1e-2, atol=1e-2)
