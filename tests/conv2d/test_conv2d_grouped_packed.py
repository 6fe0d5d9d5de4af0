"""grouped_packed (several groups a tensor-core tile, the weight tile block-diagonal) against F.conv2d in float64,
outputs NaN-poisoned (conftest): channels a group 2-32, strides 1 and 2, 1x1, 3x3 and 5x5 filters, odd images,
dilation, bias and activations, both memory formats, fp32 and fp16, tiles of uneven and several K steps; the
block-diagonal weight of its TMA form; auto's rule (16-bit, up to 56 channels a group)."""

from __future__ import annotations

import textwrap

import pytest
import torch

import tilegemm
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from test_conv2d_grouped_direct import _format_ok, _inputs as _square_inputs
from conftest import SM90, assert_rel_close, compile_offline

CL = torch.channels_last

# (N, C, K, H, W, R, stride, padding, dilation, groups): Cg = C / groups from 2 to 32, odd images
CASES = [
    pytest.param(2, 8, 8, 5, 7, 3, 1, 1, 1, 4, id="cg2-3x3"),
    pytest.param(1, 16, 16, 7, 9, 3, 2, 1, 1, 4, id="cg4-3x3-stride2"),
    pytest.param(1, 104, 104, 9, 7, 3, 2, 1, 1, 13, id="cg8-regnet-13-groups-stride2"),
    pytest.param(1, 64, 64, 7, 5, 3, 1, 1, 1, 4, id="cg16-3x3"),
    pytest.param(1, 48, 48, 9, 9, 3, 2, 1, 1, 2, id="cg24-3x3-stride2"),
    pytest.param(1, 96, 96, 5, 5, 3, 1, 1, 1, 3, id="cg32-3x3"),
    pytest.param(2, 32, 32, 5, 7, 1, 1, 0, 1, 4, id="cg8-1x1"),
    pytest.param(1, 32, 32, 7, 7, 1, 2, 0, 1, 2, id="cg16-1x1-stride2"),
    pytest.param(1, 32, 32, 7, 9, 5, 1, 2, 1, 8, id="cg4-5x5"),
    pytest.param(1, 48, 48, 9, 7, 5, 2, 2, 1, 3, id="cg16-5x5-stride2"),
    pytest.param(1, 32, 32, 9, 9, 3, 1, 2, 2, 4, id="cg8-dilated"),
    pytest.param(1, 12, 24, 5, 7, 3, 1, 1, 1, 3, id="cg4-kg8-wider-outputs"),
]


def _inputs(device, dtype, N, C, K, H, W, R, groups, channels_last):
    return _square_inputs(device, dtype, N, C, K, H, W, R, R, groups, channels_last)  # square filters here


@pytest.mark.parametrize("N,C,K,H,W,R,stride,padding,dilation,groups", CASES)
def test_forward_matches_f_conv2d_fp32(N, C, K, H, W, R, stride, padding, dilation, groups, device):
    x, w, b = _inputs(device, torch.float32, N, C, K, H, W, R, groups, True)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, activation="silu", precision="ieee", kernel="grouped_packed")
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="silu"), 1e-5)
    assert _format_ok(out, x)


@pytest.mark.parametrize("N,C,K,H,W,R,stride,padding,dilation,groups", CASES[:6])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_forward_fp16(N, C, K, H, W, R, stride, padding, dilation, groups, channels_last, device):
    x, w, b = _inputs(device, torch.float16, N, C, K, H, W, R, groups, channels_last)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = tilegemm.conv2d(x, w, b, **conv, activation="relu", kernel="grouped_packed")
    assert out.dtype == torch.float16
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), tolerance(torch.float16))
    assert _format_ok(out, x)


@pytest.mark.parametrize("cg,groups,gt,block_m,flat", [
    (8, 13, 5, 16, False),  # 13 groups in tiles of 5, 5, 3: the last tile part empty
    (32, 3, 3, 32, False),  # 96 channels a tile: two 64-deep K steps (fp32: three of 32) a tap
    (16, 4, 1, 16, False),  # one group a tile
    (2, 16, 16, 32, False),  # 32 channels a tile over tiny groups
    (8, 13, 2, 16, True),  # taps in the K steps: 2 groups of 8 (16 channels, 2 taps a 32-deep fp32 step)
    (4, 6, 3, 16, True),  # 12 channels a tile, padded to 16 a tap
    (8, 3, 1, 32, True),  # one group a tile, 4 taps a step
])
def test_tile_configs(cg, groups, gt, block_m, flat, device):
    # the launcher with its config given: tiles that split the groups unevenly, K steps that split a tile's
    # channels, one group a tile; several taps a K step (TAPS_FLAT)
    from tilegemm.ops.conv2d import grouped_packed
    from tilegemm.ops.conv2d.checks import check_conv
    from tilegemm.ops.conv2d.problem import ConvProblem

    C = cg * groups
    x, w, b = _inputs(device, torch.float32, 1, C, C, 5, 7, 3, groups, True)
    g = check_conv(x, w, b, 2, 1, 1, groups)
    p = ConvProblem(x, w, b, g, torch.float32, CL, "gelu", "ieee", False)
    out = grouped_packed.run(p, dict(GT=gt, BLOCK_M=block_m, TAPS_FLAT=flat, num_warps=4, num_stages=1))
    ref = conv2d_reference(x, w, b, stride=2, padding=1, groups=groups, activation="gelu")
    assert_rel_close(out, ref, 1e-5)


def test_weight_views_and_a_channel_sliced_input(device):
    # x a channel slice of a bigger channels-last tensor (its pixel stride not its C), the weight NCHW-strided
    # as nn.Conv2d holds it and a transposed view: read through their strides
    big = torch.randn(2, 40, 7, 9, device=device).contiguous(memory_format=CL)
    x = big[:, 8:32]
    w = torch.randn(24, 3, 3, 3, device=device)
    for weight in (w, w.contiguous(memory_format=CL)):
        out = tilegemm.conv2d(x, weight, None, padding=1, groups=8, precision="ieee", kernel="grouped_packed")
        assert_rel_close(out, conv2d_reference(x, w, padding=1, groups=8), 1e-5)


def test_a_non_finite_input_stays_in_its_group_on_the_kernels_that_keep_groups_apart(device):
    # docs/conv2d.md, "Several groups a tensor-core tile": grouped_packed's block-diagonal tile meets a NaN of one
    # group with the other groups' zero weights (their outputs at that pixel NaN too, where F.conv2d's are not);
    # the kernels the page names instead keep F.conv2d's NaNs exactly, and no kernel spreads one past its pixels
    x = torch.randn(1, 8, 6, 6, device=device)
    x[0, 1, 2, 3] = float("nan")  # group 0 of 4
    w = torch.randn(8, 2, 3, 3, device=device)
    want = torch.isnan(conv2d_reference(x, w, padding=1, groups=4))
    reach = want.any(dim=1, keepdim=True).expand_as(want)  # the pixels whose window holds the NaN
    for kernel in ("grouped_direct", "implicit_gemm", "grouped_packed"):
        got = torch.isnan(tilegemm.conv2d(x, w, padding=1, groups=4, precision="ieee", kernel=kernel))
        if kernel == "grouped_packed":
            assert not (got & ~reach).any(), kernel
            assert got[:, 2:].any(), "the block-diagonal tile no longer spreads a NaN: update docs/conv2d.md"
        else:
            assert torch.equal(got, want), kernel


def test_refuses_wide_groups_clearly(device):
    from tilegemm.core.registry import NotApplicable

    x = torch.randn(1, 4, 5, 5, device=device)
    w = torch.randn(260, 2, 1, 1, device=device)  # 130 output channels a group
    with pytest.raises(NotApplicable, match="grouped_packed takes at most 128 output channels a group"):
        tilegemm.conv2d(x, w, groups=2, kernel="grouped_packed")


@pytest.mark.parametrize("cg,kg,groups,gt,channels", [(8, 8, 13, 13, 112), (16, 16, 4, 2, 32), (4, 8, 6, 3, 16)])
def test_block_diagonal_weight_is_the_coarser_layer(cg, kg, groups, gt, channels, device):
    # the TMA form's weight: the layer with GT times fewer groups whose weight is block-diagonal (zeros past
    # GT*Cg channels) is the same convolution
    from tilegemm.ops.conv2d.checks import check_conv
    from tilegemm.ops.conv2d.grouped_packed import coarse_geometry, expand_weight

    x = torch.randn(1, cg * groups, 6, 7, device=device)
    w = torch.randn(kg * groups, cg, 3, 3, device=device)
    g = check_conv(x, w, None, 1, 1, 1, groups)
    wx = expand_weight(w, g, gt, channels)
    assert wx.shape == (kg * groups, channels, 3, 3) and wx.is_contiguous(memory_format=CL)
    assert not torch.isnan(wx).any()
    assert (wx[:, gt * cg:] == 0).all()
    gc = coarse_geometry(g, gt)
    xp = torch.nn.functional.pad(x.view(1, gc.groups, gt * cg, 6, 7),
                                 (0, 0, 0, 0, 0, channels - gt * cg)).view(1, gc.groups * channels, 6, 7)
    out = torch.nn.functional.conv2d(xp.double(), wx.double(), padding=1, groups=gc.groups)
    assert_rel_close(out, conv2d_reference(x, w, padding=1, groups=groups), 1e-12)
    with pytest.raises(ValueError, match="must divide the groups"):
        coarse_geometry(g, 5)


def test_auto_rule_takes_groups_up_to_its_threshold(monkeypatch, device):
    from tilegemm.ops.conv2d import configs
    from tilegemm.ops.conv2d.dispatch import choose_kernel
    from tilegemm.ops.conv2d.problem import geometry_of

    def geo(C, groups):
        return geometry_of((32, C, 56, 56), (C, C // groups, 3, 3), [2, 2], [1] * 4, [1, 1], groups)

    assert configs.GROUPED_PACKED_AUTO_CHANNELS == 56
    assert choose_kernel(geo(104, 13), tma=True) == "grouped_packed"  # 8 a group
    assert choose_kernel(geo(64, 4), tma=True) == "grouped_packed"  # 16
    assert choose_kernel(geo(448, 8), tma=True) == "grouped_packed"  # 56
    assert choose_kernel(geo(2048, 32), tma=True) == "tma_implicit_gemm"  # 64 a group: over the threshold
    assert choose_kernel(geo(104, 13), tma=True, sixteen_bit=False) == "grouped_direct"  # fp32: not measured there
    assert choose_kernel(geo(64, 64)) == "depthwise"
    monkeypatch.setattr(configs, "GROUPED_PACKED_AUTO_CHANNELS", 0)  # off: the kernels before it
    assert choose_kernel(geo(104, 13), tma=True) == "grouped_direct"
    assert choose_kernel(geo(64, 4), tma=True) == "tma_implicit_gemm"
    monkeypatch.setattr(configs, "GROUPED_PACKED_AUTO_CHANNELS", 16)
    assert choose_kernel(geo(96, 3), tma=True) == "tma_implicit_gemm"  # 32 a group: over that threshold
    # and through a call (NCHW input too): auto runs it and agrees with F.conv2d
    for channels_last in (True, False):
        x, w, b = _inputs(device, torch.float32, 1, 32, 32, 3, 5, 3, 4, channels_last)
        out = tilegemm.conv2d(x, w, b, padding=1, groups=4, activation="relu", precision="ieee")
        assert_rel_close(out, conv2d_reference(x, w, b, padding=1, groups=4, activation="relu"), 1e-5)


def test_default_config():
    from tilegemm.ops.conv2d.configs import grouped_packed_config, grouped_packed_tiles, grouped_packed_tma_groups
    from tilegemm.ops.conv2d.problem import geometry_of

    def geo(C, groups):
        return geometry_of((32, C, 56, 56), (C, C // groups, 3, 3), [2, 2], [1] * 4, [1, 1], groups)

    assert grouped_packed_config(geo(104, 13), torch.float16)["GT"] == 7  # 13 groups: tiles of 7 and 6
    assert grouped_packed_config(geo(64, 4), torch.float16)["GT"] == 4  # 16 a group: 64 channels a tile
    assert grouped_packed_config(geo(48, 2), torch.float16)["GT"] == 2  # 24 a group: one tile of 48
    assert grouped_packed_tiles(geo(104, 13), 7, torch.float16) == (64, 64)
    assert grouped_packed_tiles(geo(96, 3), 3, torch.float32) == (128, 32)
    assert grouped_packed_tma_groups(geo(104, 13)) == 1  # 13 is prime: only 1 or 13 divide it
    assert grouped_packed_tma_groups(geo(512, 32)) == 4
    assert grouped_packed_tma_groups(geo(256, 64)) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["grouped_packed", "grouped_packed_tma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(8, 104, 56, 56, 2, 13), (4, 64, 112, 112, 2, 4), (4, 256, 28, 28, 1, 32),
                                   (3, 128, 29, 31, 1, 32), (4, 96, 28, 28, 2, 2)],
                         ids=["regnet-8", "regnet-16", "resnext-8", "resnext-4-odd", "regnet-48"])
def test_gpu_16bit_forward(kernel, dtype, shape):
    from tilegemm.core.registry import NotApplicable

    N, C, H, W, stride, groups = shape
    x, w, b = _inputs("cuda", dtype, N, C, C, H, W, 3, groups, True)
    conv = dict(stride=stride, padding=1, groups=groups)
    try:
        out = tilegemm.conv2d(x, w, b, **conv, activation="relu", kernel=kernel)
    except NotApplicable as err:
        assert kernel == "grouped_packed_tma", err
        pytest.skip(str(err))
    assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), tolerance(dtype))


# Compiles the forward for sm_90 (no GPU needed: Triton ships ptxas) on three zoo layers (two also with taps in
# the K steps), fp16 channels-last
# with channels-last weights, its arguments specialized as a launch specializes them, and reads the PTX and
# ptxas's report: every operand tile moved by 16-byte cp.async (8-byte for 4-channel groups' weight runs, the
# weight's block-diagonal rows were 2-byte loads outside the pipeline before their pointers said they are
# contiguous), wgmma, 16-byte stores, no spills.
_COMPILE = SM90 + textwrap.dedent(
    """
    import collections, json, re
    import torch
    from tilegemm.ops.conv2d import configs, grouped_packed as gp
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of, memory_format_of

    captured = []
    gp.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, args, kwargs))
    configs.interpreting = lambda: False

    out = {}
    cases = dict(cg8=(104, 56, 2, 13, None), cg16=(64, 112, 2, 4, None), cg4=(128, 56, 1, 32, None),
                 cg8_flat=(104, 56, 2, 13, dict(GT=2, TAPS_FLAT=True, BLOCK_M=128, num_warps=4, num_stages=3)),
                 cg4_flat=(128, 56, 1, 32, dict(GT=4, TAPS_FLAT=True, BLOCK_M=128, num_warps=4, num_stages=3)))
    for label, (C, H, stride, G, cfg) in cases.items():
        x = torch.empty(32, C, H, H, dtype=torch.float16).to(memory_format=torch.channels_last)
        w = torch.empty(C, C // G, 3, 3, dtype=torch.float16).to(memory_format=torch.channels_last)
        g = geometry_of(x.shape, w.shape, (stride, stride), (1, 1, 1, 1), (1, 1), G)
        gp.run(ConvProblem(x, w, None, g, torch.float16, memory_format_of(x), "relu", "ieee", False), cfg)
        kernel, args, kwargs = captured[-1]
        flags = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        sig, constexprs, attrs = specialized_signature(kernel, args, flags)
        _, ptx, log = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"], kwargs["num_stages"],
                                   gluon=False)
        ops = collections.Counter(re.findall(r"\\b(cp\\.async\\.c[ag]\\S+|ld\\.global\\S*|st\\.global\\S+|wgmma\\.mma\\S+)",
                                             ptx))
        ops["spills"] = int(re.search(r"(\\d+) bytes spill stores", log).group(1))
        out[label] = dict(ops)
    print(json.dumps(out))
    """
)


def test_forward_compiles_to_wide_pipelined_loads_for_sm90(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, {})
    for label, ops in report.items():
        assert ops["spills"] == 0, (label, ops)
        assert not any(op.startswith("ld.global") for op in ops), (label, ops)  # all through cp.async
        assert ops.get("cp.async.cg.shared.global", 0) > 0, (label, ops)
        assert any(op.startswith("wgmma.mma_async") for op in ops), (label, ops)
        assert set(op for op in ops if op.startswith("st.global")) == {"st.global.v4.b32"}, (label, ops)


# The TMA form's launches on three zoo layers, made on the CPU with the GPU checks patched to the geometry's, and
# the TMA kernel compiled for sm_90: the coarse grid (groups / GT along axis 1), x read in place (its own C
# channels in the descriptor, 13 groups of 8 as one block of 104 padded to 128), 5-D boxes, wgmma, no spills.
_COMPILE_TMA = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.core import hardware, workspace
    from tilegemm.ops.conv2d import grouped_packed as gp, padded, tma_fwd
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of, memory_format_of

    def input_ok(x, weight, g, channel_step=16):
        return None if g.Cg % channel_step == 0 and g.H % g.stride[0] == 0 and g.W % g.stride[1] == 0 else "no"

    seen = []
    gp.launch = lambda kernel, grid, args, kwargs, **_: seen.append((kernel, grid, args, kwargs))
    gp.why_not_tma = lambda p, gt: None
    tma_fwd.why_not_input = input_ok
    padded.why_not = lambda x, w, g: None if g.Cg % 16 else "multiple of 16"
    workspace.buffer = lambda device, dtype, n, tag: torch.empty(n, dtype=dtype)
    hardware.sm_count = lambda device: 132
    report = {}
    for name, (C, H, stride, G, gt) in json.loads(sys.argv[1]).items():
        x = torch.empty(8, C, H, H, dtype=torch.float16).to(memory_format=torch.channels_last)
        w = torch.empty(C, C // G, 3, 3, dtype=torch.float16).to(memory_format=torch.channels_last)
        g = geometry_of(x.shape, w.shape, (stride, stride), (1, 1, 1, 1), (1, 1), G)
        seen.clear()
        gp.run_tma(ConvProblem(x, w, None, g, torch.float16, memory_format_of(x), "relu", "ieee", False), dict(GT=gt))
        (_, _, wargs, _), (kernel, grid, args, kwargs) = seen
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
        report[name] = dict(
            coarse_groups=grid[1], expanded=wargs[8], x_channels=args[0].shape[-1], w_box=list(args[1].block_shape),
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)), tma_loads=len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
        )
    print(json.dumps(report))
    """
)


def test_tma_form_launches_a_coarser_grouping_and_compiles_for_sm90(tmp_path):
    cases = {"cg8-13-groups": [104, 56, 2, 13, 13], "cg16-gt4": [64, 112, 2, 4, 4], "cg8-gt8": [256, 56, 1, 32, 8]}
    report = compile_offline(tmp_path, _COMPILE_TMA, cases, timeout=600)
    assert report["cg8-13-groups"]["coarse_groups"] == 1 and report["cg8-13-groups"]["expanded"] == 128
    assert report["cg8-13-groups"]["x_channels"] == 2 * 104  # x's own channels (stride-2 view: 2 pixels a row)
    assert report["cg16-gt4"]["coarse_groups"] == 1 and report["cg16-gt4"]["expanded"] == 64
    assert report["cg8-gt8"]["coarse_groups"] == 4 and report["cg8-gt8"]["expanded"] == 64
    for name, r in report.items():
        assert r["tma_loads"] >= 2 and r["mmas"] >= 1, (name, r)
        assert r["spills"] in ([], [0]), (name, r)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_gpu_auto_with_the_rule_on(tma, channels_last, monkeypatch):
    # the rule's thresholds as GPU measurements may set them: auto's forward (and the NCHW route's) through
    # either form, the backward through the routes it had
    from tilegemm.ops.conv2d import configs

    monkeypatch.setattr(configs, "GROUPED_PACKED_AUTO_CHANNELS", 64)
    monkeypatch.setattr(configs, "GROUPED_PACKED_TMA_AUTO", tma)
    for C, H, stride, groups in ((104, 28, 2, 13), (64, 30, 1, 4), (96, 15, 2, 2)):
        x, w, b = _inputs("cuda", torch.float16, 4, C, C, H, H, 3, groups, channels_last)
        conv = dict(stride=stride, padding=1, groups=groups)
        out = tilegemm.conv2d(x, w, b, **conv, activation="relu")
        assert_rel_close(out, conv2d_reference(x, w, b, **conv, activation="relu"), tolerance(torch.float16))
        assert _format_ok(out, x)
        x.requires_grad_(True)
        gx, = torch.autograd.grad(tilegemm.conv2d(x, w, None, **conv).float().sum(), x)
        x64 = x.detach().double().requires_grad_(True)
        rx, = torch.autograd.grad(torch.nn.functional.conv2d(x64, w.double(), None, **conv).sum(), x64)
        assert_rel_close(gx, rx, tolerance(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,gt", [((8, 104, 56, 56, 2, 13), 2), ((4, 128, 28, 29, 1, 32), 4),
                                      ((4, 64, 30, 30, 2, 4), 1)], ids=["cg8-gt2", "cg4-gt4-odd", "cg16-gt1"])
def test_gpu_taps_in_the_k_steps(dtype, shape, gt):
    from tilegemm.ops.conv2d import grouped_packed
    from tilegemm.ops.conv2d.checks import check_conv
    from tilegemm.ops.conv2d.problem import ConvProblem

    N, C, H, W, stride, groups = shape
    x, w, b = _inputs("cuda", dtype, N, C, C, H, W, 3, groups, True)
    w = w.contiguous(memory_format=CL)
    g = check_conv(x, w, b, stride, 1, 1, groups)
    p = ConvProblem(x, w, b, g, dtype, CL, "relu", "ieee", False)
    out = grouped_packed.run(p, dict(GT=gt, TAPS_FLAT=True, BLOCK_M=128, num_warps=4, num_stages=3))
    ref = conv2d_reference(x, w, b, stride=stride, padding=1, groups=groups, activation="relu")
    assert_rel_close(out, ref, tolerance(dtype))
