"""A CUDA build of torch on a machine without a GPU driver (what ``pip install torch`` gives by default): the
kernels run under the interpreter on CPU tensors, and nothing on that path may ask CUDA for its current stream,
which would initialise CUDA and fail ("Found no NVIDIA driver"). The routes that keep a workspace (a strided 1x1
layer's subsampled pixels: RegNet's and ResNet's downsampling projections) asked it at every launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.core import launch
from tilegemm.core.runtime import interpreting
from conftest import assert_rel_close

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tensors under the interpreter")

CL = torch.channels_last


@pytest.fixture
def no_driver(monkeypatch):
    """torch's CUDA stream queries as a driverless CUDA build answers them: CUDA uninitialised, asking fails."""
    def fail(*args):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(launch, "_raw_stream", fail)
    monkeypatch.setattr(launch, "_current_device", fail)
    monkeypatch.setattr(launch, "_cuda_up", False, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


# a strided 1x1 projection (channels-last and NCHW), a 3x3 of 24 channels a group (RegNet's), a depthwise 3x3
@pytest.mark.parametrize("C,K,k,stride,groups,fmt", [(16, 24, 1, 2, 1, CL), (16, 24, 1, 2, 1, None),
                                                     (48, 48, 3, 2, 2, CL), (16, 16, 3, 1, 16, CL)])
def test_layers_forward_and_backward_without_a_driver(no_driver, C, K, k, stride, groups, fmt):
    layer = tilegemm.nn.Conv2d(C, K, k, stride=stride, padding=k // 2, groups=groups)
    x = torch.randn(2, C, 6, 6)
    if fmt is not None:
        layer, x = layer.to(memory_format=fmt), x.contiguous(memory_format=fmt)
    x.requires_grad_(True)
    y = layer(x)
    xr = x.detach().double().requires_grad_(True)
    wr = layer.weight.detach().double().requires_grad_(True)
    ref = F.conv2d(xr, wr, layer.bias.detach().double(), stride, k // 2, 1, groups)
    assert_rel_close(y, ref, 1e-5)
    dy = torch.randn(y.shape)
    y.backward(dy)
    ref.backward(dy.double())
    assert_rel_close(x.grad, xr.grad, 1e-5)
    assert_rel_close(layer.weight.grad, wr.grad, 1e-5)
