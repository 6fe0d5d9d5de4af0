"""The backward launchers compute addresses in 64 bits for views whose strides reach past 2^31 - 1 elements, not only
for tensors of that many elements (a slice of a larger tensor is small but its offsets are not). Meta tensors give
such views without the memory; the launch is captured, not run."""

import pytest
import torch

from tilegemm.ops.conv2d import depthwise, implicit_gemm
from tilegemm.ops.conv2d.configs import (depthwise_wgrad_config, depthwise_wgrad_taps_config,
                                        depthwise_wgrad_walk_config)
from tilegemm.ops.conv2d.problem import geometry_of, needs_index_64

N, C, H, W = 2, 16, 8, 8


def _far_view(shape):
    # [N, C, H, W] channels-last pixels, images 2^31 elements apart: a slice of a tensor past 2^31 elements
    n, c, h, w = shape
    return torch.empty_strided(shape, (2**31, 1, w * c, c), device="meta", dtype=torch.float16)


def _near(shape):
    return torch.empty(shape, device="meta", dtype=torch.float16).contiguous(memory_format=torch.channels_last)


def test_a_view_past_2_31_needs_64_bit_offsets():
    assert needs_index_64(_far_view((N, C, H, W)))
    assert not needs_index_64(_near((N, C, H, W)))
    assert needs_index_64(torch.empty(2**31, device="meta", dtype=torch.int8))


@pytest.fixture
def launches(monkeypatch):
    got = []
    for mod in (depthwise, implicit_gemm):
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, args, flags, **kw: got.append(flags))
    return got


@pytest.mark.parametrize("far", ["x", "dy"])
@pytest.mark.parametrize("route", ["walk", "all taps", "a tap a program"])
def test_depthwise_weight_gradients(launches, route, far):
    g = geometry_of((N, C, H, W), (C, 1, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], C)
    x = _far_view((N, C, H, W)) if far == "x" else _near((N, C, H, W))
    dy = _far_view((N, C, g.P, g.Q)) if far == "dy" else _near((N, C, g.P, g.Q))
    cfg = {"walk": lambda: depthwise_wgrad_walk_config(g, torch.float16),
           "all taps": lambda: depthwise_wgrad_taps_config(g, torch.float16),
           "a tap a program": lambda: depthwise_wgrad_config(g, torch.float16, taps=False)}[route]()
    depthwise.wgrad(dy, x, g, torch.float16, dict(cfg, SPLIT=1) if route != "a tap a program" else cfg)
    assert launches and launches[-1]["INDEX_64"]


def test_depthwise_data_gradient(launches):
    g = geometry_of((N, C, H, W), (C, 1, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], C)
    w = torch.empty(C, 1, 3, 3, device="meta", dtype=torch.float16)
    depthwise.dgrad(_far_view((N, C, g.P, g.Q)), w, (N, C, H, W), torch.channels_last, g)
    assert launches[-1]["INDEX_64"]


def test_implicit_gemm_gradients(launches):
    K = 32
    g = geometry_of((N, C, H, W), (K, C, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 1)
    w = torch.empty(K, C, 3, 3, device="meta", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    implicit_gemm.wgrad(_near((N, K, g.P, g.Q)), _far_view((N, C, H, W)), g, "ieee", False, torch.float16)
    assert launches[-1]["INDEX_64"]
    implicit_gemm.dgrad(_far_view((N, K, g.P, g.Q)), w, (N, C, H, W), torch.channels_last, g, "ieee", False)
    assert launches[-1]["INDEX_64"]
