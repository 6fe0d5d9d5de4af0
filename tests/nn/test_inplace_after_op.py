"""An in-place op right after a tilegemm op in training (``conv -> ReLU(inplace=True)``, as VGG, SqueezeNet and
EfficientNet's squeeze-excitation have): the ops' outputs are built as views of buffers (channels-last
``permute``, batched ``view``), and autograd refuses an in-place op on a view made inside a custom function.
Each case runs forward, ``relu_``/``silu_`` and backward, against torch's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.core.torch_ops import own_storage

from conftest import assert_rel_close

# fp32 on the GPU runs in tf32 where torch's settings allow it (convolutions by default): a looser bound there
TOL = 1e-4 if interpreting() else 1e-2


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _grads_match(ours_fn, ref_fn, inputs, tol):
    """Forward, an in-place SiLU, backward through a random cotangent; values and gradients against torch's."""
    ours_in = [_leaf(t) for t in inputs]
    ref_in = [_leaf(t.double()) for t in inputs]
    y = ours_fn(*ours_in)
    y = F.silu(y, inplace=True)
    r = F.silu(ref_fn(*ref_in), inplace=True)
    cot = torch.randn(r.shape, dtype=torch.float64, device=r.device)
    (y.float() * cot.to(y.device, torch.float32)).sum().backward()
    (r * cot).sum().backward()
    assert_rel_close(y.detach().double(), r.detach(), tol)
    for a, b in zip(ours_in, ref_in):
        assert_rel_close(a.grad.double(), b.grad, tol)


@pytest.mark.parametrize("shape", [(2, 16, 1, 1, 8, 1), (2, 16, 5, 5, 16, 1), (2, 16, 6, 6, 16, 3),
                                   (2, 8, 7, 7, 8, 3)], ids=["one-pixel", "1x1", "3x3", "depthwise"])
def test_conv2d_then_inplace_trains(shape, device):
    torch.manual_seed(0)
    N, C, H, W, K, R = shape
    groups = C if shape == (2, 8, 7, 7, 8, 3) else 1
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(K, C // groups, R, R, device=device).contiguous(memory_format=torch.channels_last)
    _grads_match(lambda x, w: tilegemm.conv2d(x, w, padding=R // 2, groups=groups),
                 lambda x, w: F.conv2d(x, w, padding=R // 2, groups=groups), [x, w], TOL)


def test_conv2d_module_then_inplace_relu_in_a_model_trains(device):
    """The user's case: a converted model whose convolution feeds ``ReLU(inplace=True)`` (no norm between)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(inplace=True),
                                torch.nn.Conv2d(8, 4, 1), torch.nn.SiLU(inplace=True)).to(device)
    ours = tilegemm.nn.convert_(__import__("copy").deepcopy(model))
    x = torch.randn(2, 4, 6, 6, device=device).contiguous(memory_format=torch.channels_last)
    ours(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), model.parameters()):
        assert_rel_close(p.grad, q.grad, TOL), name


def test_matmul_batched_then_inplace_trains(device):
    torch.manual_seed(0)
    a, b = torch.randn(3, 17, 16, device=device), torch.randn(3, 16, 9, device=device)
    _grads_match(tilegemm.matmul, torch.matmul, [a, b], TOL)


def test_linear_module_with_leading_dims_then_inplace_trains(device):
    torch.manual_seed(0)
    lin = tilegemm.nn.Linear(16, 8).to(device)
    x = torch.randn(2, 3, 16, device=device)
    _grads_match(lambda x: lin(x), lambda x: F.linear(x, lin.weight.double(), lin.bias.double()), [x], TOL)


def test_grouped_mm_then_inplace_trains(device):
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, 16, device=device), torch.randn(3, 16, 8, device=device)
    _grads_match(lambda a, b: tilegemm.grouped_mm(a, b), torch.bmm, [a, b], TOL)


def test_own_storage_shares_memory_without_a_copy():
    base = torch.randn(2, 3, 4)
    v = base.permute(0, 2, 1)
    o = own_storage(v)
    assert o._base is None and o.data_ptr() == v.data_ptr() and o.stride() == v.stride()
    assert torch.equal(o, v)
    o.mul_(2)
    assert torch.equal(base.permute(0, 2, 1), o)  # the same memory
    assert own_storage(base) is base


def test_compiled_convolution_then_inplace_relu_trains(device):
    """torch.compile (AOTAutograd's eager backend) around the convolution, the in-place ReLU outside it."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).to(device)
    ours = tilegemm.nn.convert_(torch.nn.Sequential(__import__("copy").deepcopy(conv)))
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4, 6, 6, device=device).contiguous(memory_format=torch.channels_last)
    F.relu(compiled(x), inplace=True).square().sum().backward()
    F.relu(conv(x), inplace=True).square().sum().backward()
    for p, q in zip(ours.parameters(), conv.parameters()):
        assert_rel_close(p.grad, q.grad, TOL)
