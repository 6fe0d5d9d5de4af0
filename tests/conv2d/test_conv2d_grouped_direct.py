"""grouped_direct (few channels a group, CUDA-core arithmetic): the forward and both gradients against F.conv2d
in float64, outputs NaN-poisoned (conftest), over channels a group, odd sizes, strides, paddings, dilations,
bias, activations and both memory formats; ``auto``'s rule; its refusal of wide groups."""

from __future__ import annotations

import textwrap

import pytest
import torch

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import SM90, assert_rel_close, compile_offline

CL = torch.channels_last

# (N, C, K, H, W, R, S, stride, padding, dilation, groups): C/groups 2, 3, 4, 8; odd images (5x3 to 5x7)
CASES = [
    pytest.param(2, 8, 8, 5, 3, 3, 3, 1, 1, 1, 4, id="cg2-3x3"),
    pytest.param(1, 9, 12, 5, 7, 3, 3, 2, 1, 1, 3, id="cg3-kg4-stride2"),
    pytest.param(1, 16, 16, 5, 5, 3, 3, 1, 2, 2, 4, id="cg4-dilated"),
    pytest.param(1, 16, 16, 6, 5, 1, 3, (2, 1), (0, 1), 1, 2, id="cg8-1x3-mixed-stride"),
    pytest.param(1, 8, 24, 5, 7, 2, 2, 1, 0, 1, 2, id="cg4-kg12-even-filter"),
]


def _inputs(device, dtype, N, C, K, H, W, R, S, groups, channels_last):
    x = torch.randn(N, C, H, W, device=device).to(dtype)
    w = (torch.randn(K, C // groups, R, S, device=device) / (C // groups * R * S) ** 0.5).to(dtype)
    b = torch.randn(K, device=device).to(dtype)
    return (x.contiguous(memory_format=CL) if channels_last else x), w, b


def _format_ok(out, x):
    if x.is_contiguous(memory_format=CL) and not x.is_contiguous():
        return out.is_contiguous(memory_format=CL)
    return out.is_contiguous()


@pytest.mark.parametrize("N,C,K,H,W,R,S,stride,padding,dilation,groups", CASES)
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_forward_matches_f_conv2d_fp32(N, C, K, H, W, R, S, stride, padding, dilation, groups, channels_last,
                                       device):
    x, w, b = _inputs(device, torch.float32, N, C, K, H, W, R, S, groups, channels_last)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, activation="silu", kernel="grouped_direct")
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="silu"), 1e-5)
    assert _format_ok(out, x)


@pytest.mark.parametrize("N,C,K,H,W,R,S,stride,padding,dilation,groups", CASES[:3])
def test_forward_without_bias_through_auto(N, C, K, H, W, R, S, stride, padding, dilation, groups, device):
    x, w, _ = _inputs(device, torch.float32, N, C, K, H, W, R, S, groups, True)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, None, **conv, activation="relu")  # auto, fp32: the rule picks grouped_direct
    assert_rel_close(out, conv2d_reference(x, w, None, **conv, activation="relu"), 1e-5)


@pytest.mark.parametrize("N,C,K,H,W,R,S,stride,padding,dilation,groups,channels_last",
                         [pytest.param(*case.values, i % 2 == 0, id=case.id + ("-nhwc" if i % 2 == 0 else "-nchw"))
                          for i, case in enumerate(CASES)])
def test_gradients_match_torch(N, C, K, H, W, R, S, stride, padding, dilation, groups, channels_last, device):
    x, w, b = _inputs(device, torch.float32, N, C, K, H, W, R, S, groups, channels_last)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = tilegemm.conv2d(x, w, b, **conv, precision="ieee")
    dy = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = torch.nn.functional.conv2d(x64, w64, None, **conv)
    rx, rw = torch.autograd.grad(ref, (x64, w64), dy.double())
    assert_rel_close(gx, rx, 1e-5)
    assert_rel_close(gw, rw, 1e-5)
    assert _format_ok(gx, x)


@pytest.mark.skipif(not interpreting(), reason="launcher checks on CPU tensors (the interpreter's); the GPU's fp16 "
                    "and bf16 checks are the gpu-marked tests")
def test_data_gradient_direct_fp64_view():
    # the launcher on its own, an output gradient given as a channel-sliced view (read through its strides)
    from tilegemm.ops.conv2d import grouped_direct
    from tilegemm.ops.conv2d.checks import check_conv

    x = torch.randn(1, 12, 5, 7)
    w = torch.randn(12, 4, 3, 3)
    g = check_conv(x, w, None, 1, 1, 1, 3)
    dy = torch.randn(1, 20, 5, 7).contiguous(memory_format=CL)[:, 4:16]
    dx = grouped_direct.dgrad(dy, w, x.shape, torch.contiguous_format, g)
    ref = torch.ops.aten.convolution_backward(dy.double(), x.double(), w.double(), None, [1, 1], [1, 1], [1, 1],
                                              False, [0, 0], 3, [True, False, False])[0]
    assert_rel_close(dx, ref, 1e-5)


@pytest.mark.skipif(not interpreting(), reason="launcher checks on CPU tensors (the interpreter's); the GPU's fp16 "
                    "and bf16 checks are the gpu-marked tests")
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_weight_gradient_split_and_formats(split, channels_last):
    # the pixel reduction in one program or split over three (the last to arrive adds them), the gradient in
    # the format the op's fake promises (channels-last for a channels-last x)
    from tilegemm.ops.conv2d import grouped_direct
    from tilegemm.ops.conv2d.problem import wgrad_format
    from tilegemm.ops.conv2d.checks import check_conv

    x = torch.randn(2, 9, 5, 7)
    x = x.contiguous(memory_format=CL) if channels_last else x
    w = torch.randn(6, 3, 3, 3)
    g = check_conv(x, w, None, 2, 1, 1, 3)
    dy = torch.randn(g.out_shape)
    fmt = wgrad_format(x, w.shape)
    dw = grouped_direct.wgrad(dy, x, g, x.dtype, fmt, config=dict(BLOCK_M=8, BLOCK_G=2, SPLIT=split, num_warps=4))
    assert dw.is_contiguous(memory_format=fmt)
    ref = torch.ops.aten.convolution_backward(dy.double(), x.double(), w.double(), None, [2, 2], [1, 1], [1, 1],
                                              False, [0, 0], 3, [False, True, False])[1]
    assert_rel_close(dw, ref, 1e-5)


def test_auto_rule(monkeypatch):
    from tilegemm.ops.conv2d import configs
    from tilegemm.ops.conv2d.configs import takes_grouped_direct
    from tilegemm.ops.conv2d.dispatch import choose_kernel
    from tilegemm.ops.conv2d.problem import geometry_of

    def geo(C, K, groups, R=3):
        return geometry_of((32, C, 56, 56), (K, C // groups, R, R), [1, 1], [R // 2] * 4, [1, 1], groups)

    resnext = geo(128, 128, 32)  # ResNeXt-50 32x4d's first 3x3: 4 channels a group
    assert takes_grouped_direct(resnext)
    assert choose_kernel(resnext, tma=True) == "grouped_packed"  # auto's first choice for few channels a group
    monkeypatch.setattr(configs, "GROUPED_PACKED_AUTO_CHANNELS", 0)  # grouped_packed off: the rule below it
    for tma in (False, True):
        assert choose_kernel(resnext, tma=tma) == "grouped_direct"
    assert choose_kernel(geo(256, 256, 32), tma=True) == "grouped_direct"  # 8 a group
    assert choose_kernel(geo(9, 12, 3)) == "grouped_direct"  # 3 in, 4 out a group
    assert choose_kernel(geo(512, 512, 32), tma=True) == "tma_implicit_gemm"  # 16 a group: tensor cores
    assert choose_kernel(geo(512, 512, 32)) == "implicit_gemm"
    assert choose_kernel(geo(64, 64, 64)) == "depthwise"
    assert choose_kernel(geo(64, 64, 1)) == "implicit_gemm"
    assert not takes_grouped_direct(geo(64, 64, 1, R=1))


def test_refuses_wide_groups_clearly(device):
    from tilegemm.core.registry import NotApplicable

    x = torch.randn(1, 64, 5, 5, device=device)
    w = torch.randn(64, 32, 3, 3, device=device)
    with pytest.raises(NotApplicable, match="grouped_direct takes at most 16 input"):
        tilegemm.conv2d(x, w, groups=2, kernel="grouped_direct")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(32, 128, 128, 56, 56, 1, 32), (8, 256, 256, 28, 28, 2, 32),
                                   (4, 48, 48, 112, 112, 2, 6), (3, 104, 104, 29, 31, 1, 13)],
                         ids=["resnext50-4", "resnext-8-stride2", "regnet-8-stride2", "regnet-odd"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_gpu_16bit_forward_and_gradients(dtype, shape, channels_last):
    N, C, K, H, W, stride, groups = shape
    x, w, b = _inputs("cuda", dtype, N, C, K, H, W, 3, 3, groups, channels_last)
    conv = dict(stride=stride, padding=1, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, activation="relu")
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), tolerance(dtype))
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = tilegemm.conv2d(x, w, None, **conv)
    dy = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), dy)
    rx, rw, _ = torch.ops.aten.convolution_backward(dy.double(), x.detach().double(), w.detach().double(), None,
                                                    [stride] * 2, [1, 1], [1, 1], False, [0, 0], groups,
                                                    [True, True, False])
    assert_rel_close(gx, rx, tolerance(dtype))
    assert_rel_close(gw, rw, tolerance(dtype))


# Compiles the three kernels for sm_90 (no GPU needed: Triton ships ptxas) and reads ptxas's report: the kernels
# must not spill (with every tap unrolled they did: each tap's loads were kept live at once).
_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    from tilegemm.ops.conv2d import grouped_direct as gd

    def report(kernel, flags, types):
        sig, constexprs, attrs = signature(kernel, flags, types)
        _, _, log = compile_sm90(kernel, sig, constexprs, attrs, num_warps=4, gluon=False)
        return dict(regs=int(re.search(r"Used (\\d+) registers", log).group(1)),
                    spills=int(re.search(r"(\\d+) bytes spill stores", log).group(1)))

    half = lambda *names: {n: "*fp16" for n in names}
    out = dict(
        fwd=report(gd.grouped_direct_fwd_kernel, dict(R=3, S=3, CG=4, KG=4, KGP=4, HAS_BIAS=True, ACTIVATION="relu",
                   INDEX_64=False, BLOCK_M=64, BLOCK_G=8), half("x_ptr", "w_ptr", "out_ptr", "bias_ptr")),
        fwd8=report(gd.grouped_direct_fwd_kernel, dict(R=3, S=3, CG=8, KG=8, KGP=8, HAS_BIAS=False,
                    ACTIVATION="none", INDEX_64=False, BLOCK_M=64, BLOCK_G=4), half("x_ptr", "w_ptr", "out_ptr",
                                                                                       "bias_ptr")),
        dgrad=report(gd.grouped_direct_dgrad_kernel, dict(R=3, S=3, CG=4, CGP=4, KG=4, INDEX_64=False, BLOCK_M=64,
                     BLOCK_G=8), half("dy_ptr", "w_ptr", "dx_ptr")),
        wgrad=report(gd.grouped_direct_wgrad_kernel, dict(R=3, S=3, CG=4, CGP=4, KG=4, KGP=4, INDEX_64=False,
                     BLOCK_M=32, BLOCK_G=8, SPLIT=4), dict(half("dy_ptr", "x_ptr", "dw_ptr"), ws_ptr="*fp32",
                                                           count_ptr="*i32")),
    )
    print(json.dumps(out))
    """
)


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, {})
    for name, r in report.items():
        assert r["spills"] == 0 and r["regs"] <= 128, (name, r)
