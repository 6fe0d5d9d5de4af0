"""A channels-last layer's backward pass copies an output gradient of another layout (torch's autograd gives
NCHW ones, e.g. a mean's backward) channels-last once, for both gradients, instead of once in each gradient's
route; layers whose kernels read any strides (grouped_direct) take it as it comes."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.runtime import interpreting
from conftest import tensor_copies

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tensors, copies counted on the interpreter's "
                                "path; on the GPU a training step's profile measures them (docs/conv2d.md)")

CL = torch.channels_last


def _layer(C, K, k, stride, groups=1, padding=0, image=None):
    layer = tilegemm.nn.Conv2d(C, K, k, stride=stride, padding=padding, groups=groups).half().to(memory_format=CL)
    # depthwise: the window kernel's programs unroll every tap (49 at 7x7); one image smaller than the filter
    n, size = image or ((1, 4) if groups == C > 1 else (2, 8))
    x = torch.randn(n, C, size, size, dtype=torch.float16).contiguous(memory_format=CL).requires_grad_(True)
    return layer, x


def _out_shape(layer, x) -> torch.Size:
    """The layer's output shape, from torch's convolution (tilegemm's forward runs in each backward below)."""
    return torch.nn.functional.conv2d(x.detach().float(), layer.weight.detach().float(), None, layer.stride,
                                      layer.padding, layer.dilation, layer.groups).shape


def _dy_copies(copies, dy) -> list:
    """The copies of ``dy``, NCHW or as its pixels' view ``[N, P, Q, K]`` (patchify's routes reshape that)."""
    n, k, p, q = dy.shape
    return [c for c in copies if c[1] in ((n, k, p, q), (n, p, q, k))]


def _backward(layer, x, dy):
    layer.zero_grad()
    x.grad = None
    copies = tensor_copies(lambda: layer(x).backward(dy))
    return copies, x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()


# ConvNeXt's downsampling (2x2 stride 2), its stem (4x4 stride 4: patchify) and depthwise 7x7; a 3x3
@pytest.mark.parametrize("C,K,k,stride,groups,padding", [(8, 16, 2, 2, 1, 0), (3, 8, 4, 4, 1, 0),
                                                          (8, 8, 7, 1, 8, 3), (8, 16, 3, 1, 1, 1)])
def test_an_nchw_output_gradient_is_copied_once(C, K, k, stride, groups, padding):
    layer, x = _layer(C, K, k, stride, groups, padding)
    dy = torch.randn(_out_shape(layer, x), dtype=torch.float16)  # NCHW
    copies, dx, dw, db = _backward(layer, x, dy)
    assert _dy_copies(copies, dy) == [("clone", tuple(dy.shape), dy.stride(), torch.float16)]
    # the same gradients as from the channels-last dy
    copies_cl, dx_cl, dw_cl, db_cl = _backward(layer, x, dy.contiguous(memory_format=CL))
    assert not _dy_copies(copies_cl, dy)
    assert torch.equal(dx, dx_cl) and torch.equal(dw, dw_cl) and torch.equal(db, db_cl)


def test_grouped_direct_reads_an_nchw_gradient_in_place():
    from tilegemm.ops.conv2d.configs import takes_grouped_direct
    from tilegemm.ops.conv2d.problem import geometry_of

    layer, x = _layer(16, 16, 3, 1, groups=8, padding=1, image=(1, 4))  # one pixel block of grouped_direct's
    assert takes_grouped_direct(geometry_of(x.shape, layer.weight.shape, (1, 1), (1, 1, 1, 1), (1, 1), 8))
    dy = torch.randn(_out_shape(layer, x), dtype=torch.float16)
    copies, *_ = _backward(layer, x, dy)
    assert not _dy_copies(copies, dy)
