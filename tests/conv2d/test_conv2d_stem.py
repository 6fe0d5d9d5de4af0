"""The stem kernel (``implicit_gemm.conv2d_stem_kernel``: one group of at most 8 input channels, every (r, s, c)
a constexpr) against F.conv2d in float64: strides, paddings, dilations, layouts, several tiles of pixels and of
output channels, bias and activations; and which convolutions take it."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.conv2d import implicit_gemm
from tilegemm.ops.conv2d.problem import geometry_of
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close

CL = torch.channels_last


def _ran_stem(monkeypatch) -> list:
    """The geometries the stem kernel ran, from here on."""
    seen, real = [], implicit_gemm._run_stem

    def spy(p, out):
        seen.append(p.geo)
        return real(p, out)

    monkeypatch.setattr(implicit_gemm, "_run_stem", spy)
    return seen


# (N, C, H, W, K, R, S, stride, padding, dilation)
CASES = [
    pytest.param(2, 3, 17, 15, 24, 3, 3, 2, 1, 1, id="3x3-stride2-C3"),  # MobileNet's, EfficientNet's stems
    pytest.param(1, 3, 19, 18, 32, 3, 3, 2, 0, 1, id="3x3-stride2-unpadded"),  # Inception's
    pytest.param(1, 3, 11, 9, 20, 7, 7, 2, 3, 1, id="7x7-stride2-C3"),  # ResNet's, K not a power of two
    pytest.param(1, 3, 15, 14, 17, 11, 11, 4, 2, 1, id="11x11-stride4"),  # AlexNet's, K odd
    pytest.param(2, 3, 9, 40, 16, 3, 3, 1, 1, 1, id="3x3-stride1-rows-past-a-tile"),  # VGG's; Q over BLOCK_Q
    pytest.param(1, 1, 10, 9, 33, 3, 3, 1, 1, 1, id="C1-K33-several-channel-tiles"),
    pytest.param(2, 4, 12, 13, 12, 3, 5, (1, 3), (0, 2), (2, 1), id="C4-mixed-stride-dilation"),
    pytest.param(1, 8, 7, 9, 9, 2, 4, 1, "same", (2, 1), id="C8-even-filter-same-dilated"),  # uneven padding
    pytest.param(1, 5, 6, 6, 8, 3, 3, 1, 4, 1, id="padding-wider-than-filter"),
]


@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,padding,dilation", CASES)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_matches_f_conv2d_fp32(N, C, H, W, K, R, S, stride, padding, dilation, layout, device, monkeypatch):
    seen = _ran_stem(monkeypatch)
    x = torch.randn(N, C, H, W, device=device)
    w = torch.randn(K, C, R, S, device=device) / (C * R * S) ** 0.5
    b = torch.randn(K, device=device)
    if layout != "nchw":
        x = x.contiguous(memory_format=CL)
    if layout == "nhwc-weight-cl":
        w = w.contiguous(memory_format=CL)
    conv = dict(stride=stride, padding=padding, dilation=dilation)
    out = tilegemm.conv2d(x, w, b, **conv, activation="relu", precision="ieee", kernel="implicit_gemm")
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), 1e-5)
    assert len(seen) == 1


@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,padding,dilation", [CASES[0], CASES[6]])
def test_a_channels_last_weight(N, C, H, W, K, R, S, stride, padding, dilation, device, monkeypatch):
    test_matches_f_conv2d_fp32(N, C, H, W, K, R, S, stride, padding, dilation, "nhwc-weight-cl", device, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_without_bias(dtype, device, monkeypatch):
    seen = _ran_stem(monkeypatch)
    x = torch.randn(2, 3, 15, 14, device=device).to(dtype).contiguous(memory_format=CL)
    w = (torch.randn(24, 3, 3, 3, device=device) / 27**0.5).to(dtype)
    out = tilegemm.conv2d(x, w, None, stride=2, padding=1, kernel="implicit_gemm")
    assert out.dtype == dtype and out.is_contiguous(memory_format=CL)
    assert_rel_close(out, conv2d_reference(x, w, None, stride=2, padding=1), tolerance(dtype))
    assert len(seen) == 1


def test_sliced_and_strided_inputs_read_in_place(device, monkeypatch):
    seen = _ran_stem(monkeypatch)
    big = torch.randn(2, 10, 11, 12, device=device).contiguous(memory_format=CL)
    w = torch.randn(8, 3, 3, 3, device=device)
    x = big[:, 4:7]  # three channels of a wider channels-last tensor
    assert_rel_close(tilegemm.conv2d(x, w, None, padding=1, precision="ieee", kernel="implicit_gemm"),
                     conv2d_reference(x, w, padding=1), 1e-5)
    y = torch.randn(2, 3, 18, 13, device=device)[:, :, ::2, 1:]  # rows two apart, a column cut
    assert_rel_close(tilegemm.conv2d(y, w, None, stride=2, precision="ieee", kernel="implicit_gemm"),
                     conv2d_reference(y, w, stride=2), 1e-5)
    assert len(seen) == 2


@pytest.mark.parametrize("C,K,R,S,groups,takes", [
    (3, 64, 7, 7, 1, True),
    (8, 16, 8, 8, 1, True),  # 512 columns: the most the unrolled K loop takes
    (3, 64, 16, 16, 1, False),  # ViT's patch embedding: 768 columns
    (9, 16, 3, 3, 1, False),  # more than 8 channels
    (8, 8, 3, 3, 2, False),  # groups
])
def test_which_convolutions_take_it(C, K, R, S, groups, takes):
    g = geometry_of((2, C, 32, 32), (K, C // groups, R, S), [1, 1], [0, 0, 0, 0], [1, 1], groups)
    assert implicit_gemm.takes_stem(g) is takes


def test_others_keep_the_flat_kernel(device, monkeypatch):
    seen = _ran_stem(monkeypatch)
    x = torch.randn(1, 3, 17, 17, device=device)
    w = torch.randn(4, 3, 16, 16, device=device) / 768**0.5  # 768 (r, s, c) columns: the FLAT_K loop
    out = tilegemm.conv2d(x, w, None, stride=1, kernel="implicit_gemm", precision="ieee")
    assert_rel_close(out, conv2d_reference(x, w), 1e-5)
    assert seen == []


def _stem(C, K, R, S, stride=2, groups=1):
    return geometry_of((32, C, 224, 224), (K, C // groups, R, S), [stride, stride], [R // 2] * 4, [1, 1], groups)


@pytest.mark.parametrize("g,channels_last,kernel", [
    (_stem(3, 24, 3, 3), True, "implicit_gemm"),  # 8 past a multiple of 16: the window route's weak stems
    (_stem(3, 40, 3, 3), True, "implicit_gemm"),
    (_stem(3, 16, 3, 3), True, "implicit_gemm"),  # under 32 output channels
    (_stem(3, 32, 3, 3), True, "tma_implicit_gemm"),
    (_stem(3, 64, 7, 7), True, "tma_implicit_gemm"),  # ResNet's
    (_stem(3, 32, 3, 3), False, "implicit_gemm"),  # NCHW: the window route copies it first
    (_stem(3, 64, 3, 3, stride=1), False, "tma_implicit_gemm"),
    (_stem(3, 768, 16, 16, stride=16), True, "tma_implicit_gemm"),  # too many columns for the stem kernel
    (_stem(4, 24, 1, 1, stride=1), True, None),  # one tap: not a stem's rule
    (_stem(8, 24, 3, 3, groups=2), True, None),  # not one group
])
def test_auto_takes_the_stem_kernel_where_it_pays(g, channels_last, kernel):
    from tilegemm.ops.conv2d.dispatch import choose_kernel, stem_kernel_pays

    assert stem_kernel_pays(g, channels_last) is (kernel == "implicit_gemm")
    if kernel is None:
        assert choose_kernel(g, channels_last, tma=True) != "implicit_gemm"
    else:
        assert choose_kernel(g, channels_last, tma=True) == kernel
    assert choose_kernel(g, channels_last, tma=False) != "tma_implicit_gemm"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,channels_last,stem_kernel", [(24, True, True), (40, False, True), (32, True, False)])
def test_gpu_auto_routes_stems_by_output_channels(K, channels_last, stem_kernel, dtype, monkeypatch):
    # on Hopper auto sends a stem to the stem kernel or the TMA window route by stem_kernel_pays; both right
    from tilegemm.core import registry

    if registry.get("conv2d", "tma_implicit_gemm").unavailable_reason():
        pytest.skip("the window route needs a Hopper GPU")
    seen = _ran_stem(monkeypatch)
    x = torch.randn(3, 3, 67, 45, device="cuda").to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    w = (torch.randn(K, 3, 3, 3, device="cuda") / 27**0.5).to(dtype)
    b = torch.randn(K, device="cuda").to(dtype)
    out = tilegemm.conv2d(x, w, b, stride=2, padding=1, activation="silu")
    ref = conv2d_reference(x, w, b, stride=2, padding=1, activation="silu")
    assert_rel_close(out, ref, tolerance(dtype))
    assert out.is_contiguous(memory_format=CL) == channels_last
    assert len(seen) == int(stem_kernel)


def test_64_bit_addresses(device, monkeypatch):
    # the int64 offsets of a problem past 2^31 elements, on a small one (the flag forced): the same values
    from tilegemm.ops.conv2d.problem import ConvProblem

    seen = _ran_stem(monkeypatch)
    monkeypatch.setattr(ConvProblem, "index_64", property(lambda self: True))
    x = torch.randn(2, 3, 13, 11, device=device)
    w = torch.randn(20, 3, 3, 3, device=device)
    out = tilegemm.conv2d(x, w, None, stride=2, padding=1, precision="ieee", kernel="implicit_gemm")
    assert_rel_close(out, conv2d_reference(x, w, None, stride=2, padding=1), 1e-5)
    assert len(seen) == 1
