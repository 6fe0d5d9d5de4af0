"""tilegemm.conv2d against F.conv2d in float64: strides, paddings, dilations, groups, odd sizes, both memory
formats, every kernel and every activation."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close

CL = torch.channels_last


def _inputs(device, dtype, N, C, H, W, K, R, S, groups=1, channels_last=True, bias=True):
    x = torch.randn(N, C, H, W, device=device, dtype=torch.float32).to(dtype)
    w = (torch.randn(K, C // groups, R, S, device=device) / (C // groups * R * S) ** 0.5).to(dtype)
    b = torch.randn(K, device=device).to(dtype) if bias else None
    if channels_last:
        x = x.contiguous(memory_format=CL)
    return x, w, b


def _check(out, x, w, b, tol, **conv):
    ref = conv2d_reference(x, w, b, **conv)
    assert_rel_close(out, ref, tol)
    # the output keeps the input's memory format
    if x.is_contiguous(memory_format=CL) and not x.is_contiguous():
        assert out.is_contiguous(memory_format=CL)
    else:
        assert out.is_contiguous()


# (N, C, H, W, K, R, S, stride, padding, dilation, groups)
CASES = [
    pytest.param(2, 8, 9, 9, 16, 3, 3, 1, 1, 1, 1, id="3x3-same-size"),
    pytest.param(2, 8, 9, 7, 12, 3, 3, 2, 1, 1, 1, id="3x3-stride2-nonsquare"),
    pytest.param(2, 3, 9, 9, 16, 7, 7, 2, 3, 1, 1, id="stem-7x7-C3"),
    pytest.param(1, 5, 8, 9, 6, 5, 5, 1, 2, 1, 1, id="5x5-odd-channels"),
    pytest.param(2, 16, 1, 1, 8, 1, 1, 1, 0, 1, 1, id="1x1-image"),
    pytest.param(2, 16, 1, 1, 8, 3, 3, 1, 1, 1, 1, id="1x1-image-3x3-padded"),
    pytest.param(2, 6, 7, 8, 9, 3, 2, (2, 1), (1, 0), (2, 1), 1, id="nonsquare-filter-mixed"),
    pytest.param(1, 8, 6, 5, 12, 3, 3, 1, "same", 2, 2, id="same-dilated-groups2"),
    pytest.param(1, 8, 8, 7, 8, 4, 2, 1, "same", 1, 1, id="same-even-filter"),
    pytest.param(2, 8, 6, 6, 8, 3, 3, 1, "valid", 1, 4, id="valid-groups4"),
    pytest.param(2, 16, 5, 5, 32, 1, 1, 2, 0, 1, 1, id="1x1-stride2"),
    pytest.param(2, 16, 6, 6, 16, 1, 1, 1, 0, 1, 1, id="pointwise"),
    pytest.param(2, 12, 5, 5, 12, 3, 3, 1, 1, 1, 12, id="depthwise"),
    pytest.param(1, 8, 9, 8, 16, 5, 5, 2, 2, 1, 8, id="depthwise-mult2-5x5-stride2"),
    pytest.param(1, 8, 6, 5, 8, 9, 9, 1, 4, 1, 8, id="depthwise-9x9-taps-in-a-loop"),  # 81 taps: not unrolled
    pytest.param(1, 4, 3, 3, 4, 3, 3, 1, 4, 1, 1, id="padding-wider-than-filter"),
]


@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,padding,dilation,groups", CASES)
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_matches_f_conv2d_fp32(N, C, H, W, K, R, S, stride, padding, dilation, groups, channels_last, device):
    x, w, b = _inputs(device, torch.float32, N, C, H, W, K, R, S, groups, channels_last)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, precision="ieee")
    _check(out, x, w, b, 1e-5, **conv)


# Each registered kernel on problems it takes (kernels take different classes of convolution, so the cases
# are listed per kernel; test_every_registered_kernel_has_cases fails for a kernel registered without any).
EACH_KERNEL = [
    ("implicit_gemm", (2, 8, 7, 7, 16, 3, 3), 1),
    ("implicit_gemm", (2, 16, 5, 6, 24, 1, 1), 1),
    ("implicit_gemm", (2, 8, 7, 7, 8, 3, 3), 8),
    ("gemm_1x1", (2, 16, 5, 6, 24, 1, 1), 1),
    ("depthwise", (2, 8, 5, 4, 8, 3, 3), 8),
    ("grouped_direct", (2, 8, 5, 4, 8, 3, 3), 2),
    ("grouped_packed", (2, 16, 7, 7, 16, 3, 3), 4),
    ("grouped_packed", (2, 8, 7, 7, 16, 3, 3), 1),
    ("grouped_packed_tma", (2, 32, 8, 8, 32, 3, 3), 4),  # a Hopper GPU's, channels-last only
    ("tma_implicit_gemm", (2, 16, 7, 7, 24, 3, 3), 1),  # a Hopper GPU's, channels-last only
]


def test_every_registered_kernel_has_cases():
    from tilegemm.core import registry

    assert {k for k, _, _ in EACH_KERNEL} == {s.name for s in registry.specs("conv2d")}


@pytest.mark.parametrize("kernel,shape,groups", EACH_KERNEL)
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_each_kernel_fp16(kernel, shape, groups, channels_last, device):
    from tilegemm.core import registry

    reason = registry.get("conv2d", kernel).unavailable_reason()
    if reason:
        pytest.skip(reason)  # a GPU-only kernel: its GPU tests run it (tests/conv2d/test_tma_fwd.py)
    if kernel in ("tma_implicit_gemm", "grouped_packed_tma") and not channels_last:
        pytest.skip(f"{kernel} takes channels-last inputs only (auto sends NCHW ones elsewhere)")
    N, C, H, W, K, R, S = shape
    pad = R // 2
    x, w, b = _inputs(device, torch.float16, N, C, H, W, K, R, S, groups, channels_last)
    out = tilegemm.conv2d(x, w, b, padding=pad, groups=groups, activation="relu", kernel=kernel)
    assert out.dtype == torch.float16
    _check(out, x, w, b, tolerance(torch.float16), padding=pad, groups=groups, activation="relu")


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "leaky_relu"])
def test_fused_activations(activation, device):
    x, w, b = _inputs(device, torch.float32, 2, 8, 6, 6, 16, 3, 3)
    out = tilegemm.conv2d(x, w, b, padding=1, activation=activation, precision="ieee")
    _check(out, x, w, b, 1e-5, padding=1, activation=activation)


def test_no_bias_and_strided_input_views(device):
    # a channel slice of a bigger channels-last tensor and a spatially strided NCHW view: read in place or
    # copied, never wrong
    big = torch.randn(2, 20, 9, 9, device=device).contiguous(memory_format=CL)
    w = torch.randn(8, 6, 3, 3, device=device)
    x = big[:, 4:10]
    out = tilegemm.conv2d(x, w, None, padding=1, precision="ieee")
    assert_rel_close(out, conv2d_reference(x, w, padding=1), 1e-5)
    y = torch.randn(2, 6, 18, 9, device=device)[:, :, ::2]
    out = tilegemm.conv2d(y, w, None, stride=2, precision="ieee")
    assert_rel_close(out, conv2d_reference(y, w, stride=2), 1e-5)


def test_negative_views_are_read_as_their_values(device):
    # z.conj().imag holds its values negated in memory (a bit torch's ops resolve): a 1x1's x and the bias, read
    # in place, came out with their sign flipped
    def neg(*shape):
        t = torch.complex(torch.randn(*shape, device=device), torch.randn(*shape, device=device)).conj().imag
        assert t.is_neg()
        return t

    x, w, b = neg(2, 6, 5, 4), neg(8, 6, 1, 1), neg(8)
    out = tilegemm.conv2d(x, w, b, precision="ieee")
    assert_rel_close(out, conv2d_reference(x, w, b), 1e-5)
    # the registered op too (a graph compiled by torch.compile calls it with its inputs as they are)
    out = torch.ops.tilegemm.conv2d(x, w, b, [1, 1], [0, 0, 0, 0], [1, 1], 1, "none", "ieee", "auto")
    assert_rel_close(out, conv2d_reference(x, w, b), 1e-5)


def test_auto_picks_by_geometry():
    from tilegemm.ops.conv2d.dispatch import choose_kernel
    from tilegemm.ops.conv2d.problem import geometry_of

    def pick(x_shape, w_shape, **conv):  # shapes only: no tensor, so no device check
        s, pad = conv.get("stride", 1), conv.get("padding", 0)
        return choose_kernel(geometry_of(x_shape, w_shape, [s, s], [pad] * 4, [1, 1], conv.get("groups", 1)))

    assert pick((1, 16, 4, 4), (8, 16, 1, 1)) == "gemm_1x1"
    assert pick((1, 16, 4, 4), (8, 16, 1, 1), stride=2) == "gemm_1x1"  # channels-last input assumed
    g = geometry_of((1, 16, 4, 4), (8, 16, 1, 1), [2, 2], [0] * 4, [1, 1], 1)
    assert choose_kernel(g, x_channels_last=False) == "implicit_gemm"
    assert pick((1, 16, 4, 4), (8, 16, 1, 1), padding=1) == "implicit_gemm"
    assert pick((1, 16, 4, 4), (16, 1, 3, 3), groups=16) == "depthwise"
    assert pick((1, 16, 4, 4), (16, 2, 3, 3), groups=8) == "grouped_packed"  # few channels a group, 16-bit
    g = geometry_of((1, 16, 4, 4), (16, 2, 3, 3), [1, 1], [0] * 4, [1, 1], 8)
    assert choose_kernel(g, sixteen_bit=False) == "grouped_direct"  # fp32: CUDA cores
    assert pick((1, 32, 4, 4), (32, 16, 3, 3), groups=2) == "grouped_packed"  # 16 a group: several a tile
    assert pick((1, 128, 4, 4), (128, 64, 3, 3), groups=2) == "implicit_gemm"  # 64 a group: past its threshold


@pytest.mark.parametrize("stride", [2, (2, 3), 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_1x1_channels_last_as_a_gemm(stride, dtype, device):
    # ResNet's downsampling projection: the kept pixels gathered into a matrix, then tilegemm.matmul; odd sizes
    # (H, W not multiples of the stride), bias and activation fused, output channels-last
    x, w, b = _inputs(device, dtype, 2, 24, 7, 9, 40, 1, 1)
    for kernel in ("auto", "gemm_1x1"):
        out = tilegemm.conv2d(x, w, b, stride=stride, activation="relu", kernel=kernel, precision="ieee")
        _check(out, x, w, b, 1e-5 if dtype == torch.float32 else tolerance(dtype), stride=stride,
               activation="relu")
    # a second call with other values reads its own input (no stale workspace)
    x2 = torch.randn_like(x).contiguous(memory_format=CL)
    out = tilegemm.conv2d(x2, w, b, stride=stride, precision="ieee")
    _check(out, x2, w, b, 1e-5 if dtype == torch.float32 else tolerance(dtype), stride=stride)


def test_strided_1x1_nchw_takes_the_implicit_gemm(device):
    from tilegemm.core.registry import NotApplicable

    x, w, b = _inputs(device, torch.float32, 2, 8, 6, 6, 8, 1, 1, channels_last=False)
    out = tilegemm.conv2d(x, w, b, stride=2, precision="ieee")
    _check(out, x, w, b, 1e-5, stride=2)
    with pytest.raises(NotApplicable, match="channels-last input only"):
        tilegemm.conv2d(x, w, b, stride=2, kernel="gemm_1x1")


def test_a_kernel_that_does_not_take_the_problem_says_so(device):
    from tilegemm.core.registry import NotApplicable

    x, w, _ = _inputs(device, torch.float32, 1, 8, 5, 5, 8, 3, 3)
    with pytest.raises(NotApplicable, match="gemm_1x1 takes 1x1"):
        tilegemm.conv2d(x, w, kernel="gemm_1x1")
    with pytest.raises(NotApplicable, match="depthwise kernel takes groups = C"):
        tilegemm.conv2d(x, w, kernel="depthwise")


def test_tf32_follows_torch_setting(device):
    # Under the interpreter tf32 dots are exact; on the GPU they round the operands (bound 1e-2).
    x, w, b = _inputs(device, torch.float32, 2, 16, 6, 6, 16, 3, 3)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        out = tilegemm.conv2d(x, w, b, padding=1)
    finally:
        torch.set_float32_matmul_precision(old)
    _check(out, x, w, b, tolerance(torch.float32, "tf32"), padding=1)


def test_empty_batch(device):
    x = torch.randn(0, 4, 5, 5, device=device)
    w = torch.randn(6, 4, 3, 3, device=device)
    out = tilegemm.conv2d(x, w, padding=1)
    assert out.shape == (0, 6, 5, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,padding,groups", [
    (8, 64, 56, 56, 64, 3, 3, 1, 1, 1),
    (8, 3, 224, 224, 64, 7, 7, 2, 3, 1),
    (8, 256, 56, 56, 128, 1, 1, 1, 0, 1),
    (8, 512, 28, 28, 256, 1, 1, 2, 0, 1),
    (8, 144, 56, 56, 144, 3, 3, 2, 1, 144),
    (4, 100, 17, 23, 36, 3, 5, 1, 2, 4),
])
def test_gpu_shapes(N, C, H, W, K, R, S, stride, padding, groups, dtype, channels_last, device):
    x, w, b = _inputs(device, dtype, N, C, H, W, K, R, S, groups, channels_last)
    out = tilegemm.conv2d(x, w, b, stride, padding, 1, groups, activation="relu")
    _check(out, x, w, b, tolerance(dtype), stride=stride, padding=padding, groups=groups, activation="relu")


def test_index_64_when_a_tensor_reaches_2_31_elements():
    # meta tensors: shapes without memory
    from tilegemm.ops.conv2d.problem import ConvProblem, Geometry

    def problem(x_shape, w_shape, padding=0):
        x, w = torch.empty(x_shape, device="meta"), torch.empty(w_shape, device="meta")
        g = Geometry(*x_shape, w_shape[0], *w_shape[2:], 1, (1, 1), (padding,) * 4, (1, 1))
        return ConvProblem(x, w, None, g, torch.float16, torch.channels_last, "none", "ieee", False)

    assert not problem((32, 64, 56, 56), (64, 64, 3, 3), 1).index_64
    assert problem((256, 256, 192, 192), (64, 256, 3, 3), 1).index_64  # x: 2.4e9 elements
    assert problem((256, 64, 192, 192), (256, 64, 1, 1)).index_64  # only the output passes 2^31


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_1x1_on_one_pixel_is_one_gemm_in_either_format(channels_last, device, monkeypatch):
    # squeeze-and-excitation blocks: [N, C, 1, 1] is the same bytes in both formats; the N images are one
    # [N, C] x [C, K] product (the NCHW branch would run N products of one column each)
    from tilegemm.ops.conv2d import gemm_1x1

    shapes = []
    real = gemm_1x1.matmul
    monkeypatch.setattr(gemm_1x1, "matmul", lambda a, b, **kw: shapes.append((tuple(a.shape), tuple(b.shape)))
                        or real(a, b, **kw))
    x, w, b = _inputs(device, torch.float32, 5, 24, 1, 1, 40, 1, 1, channels_last=channels_last)
    out = tilegemm.conv2d(x, w, b, activation="silu", kernel="gemm_1x1", precision="ieee")
    _check(out, x, w, b, 1e-5, activation="silu")
    assert shapes == [((5, 24), (24, 40))]
    assert out.shape == (5, 40, 1, 1) and not out.isnan().any()
