"""Stride-1 depthwise forwards of large filters (5x5, 7x7): ``depthwise_window_kernel`` (a thread's QT adjacent
output columns over a window of input columns held in registers, rows rolled through R accumulators), the row
kernel up to 7x7 by config, and either reading the weight tap-major (``TAP_MAJOR``). Against ``F.conv2d`` in
float64 with outputs poisoned (NaN, conftest) so an unwritten element fails: images 1, 3 and 7 wide and tall,
channel counts that are not multiples of 8, channel multipliers, bias and activation, both output layouts; the
configs and convolutions they refuse; that ``auto`` keeps today's routes until its switches are set; registers
and spills compiled offline for sm_90. GPU tests at the zoo's sizes in fp16 and bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.ops.conv2d import configs, depthwise
from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

from conftest import SM90, assert_rel_close, compile_offline, crossed, spy_launches


def _problem(x, w, b, padding, out_format=torch.channels_last, activation="none", stride=(1, 1), dilation=(1, 1)):
    g = geometry_of(x.shape, w.shape, list(stride), [padding[0], padding[0], padding[1], padding[1]],
                    list(dilation), x.shape[1])
    return ConvProblem(x, w, b, g, x.dtype, out_format, activation, "ieee", False)


def _window(qt=2, bg=2, bc=8, rows=3, vec=8, tap_major=False, ahead=False):
    return dict(QT=qt, BLOCK_G=bg, BLOCK_C=bc, WINDOW_ROWS=rows, VEC=vec, STAGES=1, num_warps=1,
                TAP_MAJOR=tap_major, AHEAD=ahead)


def _check(x, w, b, padding, cfg, out_format=torch.channels_last, activation="none", tol=1e-5):
    C = x.shape[1]
    out = depthwise.run(_problem(x, w, b, padding, out_format, activation), cfg)
    ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), 1, padding, 1, C)
    if activation == "relu":
        ref = F.relu(ref)
    assert out.is_contiguous(memory_format=out_format)
    assert out.dtype == x.dtype
    assert_rel_close(out, ref, tol)


def _input(N, C, H, W, device, dtype=torch.float32):
    return torch.randn(N, C, H, W, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("R", [5, 7])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_window_kernel_over_odd_images(R, size, device):
    # 5 channels (no 2-, 4- or 8-element runs), 3 columns a thread (7 = 2 groups of 3 and 1 over), rows a
    # program not dividing the image, an image narrower and shorter than the filter
    x = _input(1, 5, size, size, device)
    w = torch.randn(5, 1, R, R, device=device)
    b = torch.randn(5, device=device)
    _check(x, w, b, (R // 2, R // 2), _window(qt=3, rows=4), activation="relu")


@crossed("tap_major, ahead, C, W", [False, True], [False, True], [
    pytest.param(12, 7, id="two-channel-blocks"), pytest.param(4, 11, id="a-masked-column-group")])
def test_window_kernel_forms(tap_major, ahead, C, W, device):
    # 4 columns a thread over 2 groups, the image's 4 rows one program's; 12 channels over channel blocks of 8 (the
    # second half masked) and 7 columns (the second group's last column masked), or 4 channels (one block, half
    # masked) and 11 columns (the third group's last column and the fourth group masked): under the interpreter
    # each form meets one of the two (each a program fewer than both at once)
    x = _input(1, C, 4, W, device)
    w = torch.randn(C, 1, 7, 7, device=device)
    _check(x, w, None, (3, 3), _window(qt=4, bg=2, bc=8, rows=4, tap_major=tap_major, ahead=ahead))


@pytest.mark.parametrize("out_format", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("mult", [1, 2])
def test_window_kernel_multipliers_layouts_and_uneven_padding(mult, out_format, device):
    # padding 1 x 3 around a 5x5 filter (output 2 rows shorter than the input, 2 columns wider), two channels a
    # thread's vector
    x = _input(1, 6, 6, 5, device)
    w = torch.randn(6 * mult, 1, 5, 5, device=device)
    b = torch.randn(6 * mult, device=device)
    _check(x, w, b, (1, 3), _window(qt=2, bg=2, bc=8, rows=2, vec=2, tap_major=True), out_format, "relu")


def test_window_kernel_fp16_accumulates_in_fp32(device):
    x = _input(1, 16, 9, 5, device, torch.float16)
    w = torch.randn(16, 1, 7, 7, device=device, dtype=torch.float16)
    b = torch.randn(16, device=device, dtype=torch.float16)
    _check(x, w, b, (3, 3), _window(qt=4, bg=1, bc=16, rows=9, tap_major=True), tol=2e-3)


@pytest.mark.parametrize("tap_major", [False, True])
@pytest.mark.parametrize("pipeline", [False, True])
def test_rows_kernel_takes_7x7_by_config(tap_major, pipeline, device):
    # 7x7 at DEPTHWISE_ROWS_CONFIG_MAX_TAPS, a block straddling pixels, 3 channels, image 3 wide and 8 tall (rows
    # a program not dividing it)
    x = _input(1, 3, 8, 3, device)
    w = torch.randn(6, 1, 7, 7, device=device)
    b = torch.randn(6, device=device)
    cfg = dict(BLOCK=16, ROWS_PER=5, PIPELINE=pipeline, STAGES=1, num_warps=4, TAP_MAJOR=tap_major)
    _check(x, w, b, (3, 3), cfg, torch.contiguous_format, "relu")


def test_configs_refused(device):
    x = _input(1, 8, 9, 9, device)
    w = torch.randn(8, 1, 5, 5, device=device)
    strided = _problem(x, w, None, (2, 2), stride=(2, 2))
    with pytest.raises(ValueError, match="depthwise_window_kernel does not take"):
        depthwise.run(strided, _window())
    dilated = _problem(x, torch.randn(8, 1, 3, 3, device=device), None, (2, 2), dilation=(2, 2))
    with pytest.raises(ValueError, match="depthwise_window_kernel does not take"):
        depthwise.run(dilated, _window())
    with pytest.raises(ValueError, match="QT must be at least 1"):
        depthwise.run(_problem(x, w, None, (2, 2)), _window(qt=0))
    with pytest.raises(ValueError, match="WINDOW_ROWS must be at least 1"):
        depthwise.run(_problem(x, w, None, (2, 2)), _window(rows=0))
    with pytest.raises(ValueError, match=r"needs \['BLOCK_C'\]"):
        depthwise.run(_problem(x, w, None, (2, 2)), dict(QT=2, BLOCK_G=2, WINDOW_ROWS=2))
    big = _problem(_input(1, 8, 12, 12, device), torch.randn(8, 1, 9, 9, device=device), None, (4, 4))
    with pytest.raises(ValueError, match="depthwise_window_kernel does not take"):
        depthwise.run(big, _window())  # 81 taps: past DEPTHWISE_WINDOW_MAX_TAPS
    with pytest.raises(ValueError, match="depthwise_rows_kernel does not take"):
        depthwise.run(big, dict(BLOCK=32, ROWS_PER=4, PIPELINE=False, STAGES=1, num_warps=4))


def _launched(monkeypatch):
    return spy_launches(monkeypatch, depthwise)


@pytest.mark.parametrize("R, C, switch, expect", [
    (7, 8, None, ["depthwise_weight_kernel", "depthwise_window_kernel"]),  # 7x7: the window kernel (tap-major)
    (5, 8, None, ["depthwise_weight_kernel", "depthwise_rows_kernel"]),  # 5x5 on few channels: rows, tap-major
    (5, 24, None, ["depthwise_weight_kernel", "depthwise_window_kernel"]),  # 5x5 from the threshold: the window
    (7, 8, "off", ["depthwise_weight_kernel", "depthwise_fwd_kernel"]),  # switched off: 7x7 on the pixel kernel
    (5, 8, "row-major", ["depthwise_rows_kernel"]),  # DEPTHWISE_ROWS_TAP_MAJOR off: one launch
    (7, 8, "rows", ["depthwise_weight_kernel", "depthwise_rows_kernel"]),  # DEPTHWISE_ROWS_MAX_TAPS = 49, window off
])
def test_auto_routes_stride1_filters_past_3x3(R, C, switch, expect, device, monkeypatch):
    # the 5x5 channel threshold lowered from 192 (the interpreter pays for each channel block): where it sits is
    # test_window_auto_leaves_3x3_strided_and_narrow_5x5_layers's
    monkeypatch.setattr(configs, "DEPTHWISE_WINDOW_AUTO_MIN_CHANNELS", 24)
    if switch in ("off", "rows"):
        monkeypatch.setattr(configs, "DEPTHWISE_WINDOW_AUTO", False)
    if switch == "rows":
        monkeypatch.setattr(configs, "DEPTHWISE_ROWS_MAX_TAPS", 49)
    elif switch == "row-major":
        monkeypatch.setattr(configs, "DEPTHWISE_ROWS_TAP_MAJOR", False)
    from tilegemm.ops.conv2d import op

    op.REPLAYS.clear()  # on a GPU a call like an earlier one replays its launches: decide afresh
    x = _input(1, C, 4, 3, device)  # the rule reads channels and taps (4 rows: one program's, not two)
    w = torch.randn(C, 1, R, R, device=device)
    launched = _launched(monkeypatch)
    out = tilegemm.conv2d(x, w, None, 1, R // 2, 1, C)
    assert launched == expect
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 1, R // 2, 1, C), 1e-5)


def test_window_auto_leaves_3x3_strided_and_narrow_5x5_layers(device, monkeypatch):
    def geo(C, R, stride):
        return geometry_of((1, C, 9, 9), (C, 1, R, R), [stride] * 2, [R // 2] * 4, [1, 1], C)

    assert configs.depthwise_window_config(geo(8, 3, 1), torch.float16) is None
    assert configs.depthwise_window_config(geo(8, 5, 2), torch.float16) is None
    assert configs.depthwise_window_config(geo(191, 5, 1), torch.float16) is None  # few channels: the row kernel
    assert configs.depthwise_window_config(geo(192, 5, 1), torch.float16)["QT"] >= 1
    assert configs.depthwise_window_config(geo(8, 7, 1), torch.float16)["QT"] >= 1  # 7x7: any channel count
    monkeypatch.setattr(configs, "DEPTHWISE_WINDOW_AUTO", False)
    assert configs.depthwise_window_config(geo(8, 7, 1), torch.float16) is None


def test_stride1_3x3_rules_by_image_and_channels():
    def geo(C, H, R=3, dilation=1):
        return geometry_of((1, C, H, H), (C, 1, R, R), [1, 1], [R // 2 * dilation] * 4, [dilation] * 2, C)

    strided, window = configs.depthwise_strided_rows_config, configs.depthwise_window_config
    # 8 to 31 rows and at most 512 channels: the strided row kernel; many channels under 48 rows: the window kernel
    for C, H in [(58, 28), (122, 28), (512, 8), (24, 31)]:
        assert "STRIDED_ROWS" in strided(geo(C, H), torch.float16) and window(geo(C, H), torch.float16) is None
    for C, H in [(640, 30), (640, 8), (960, 47), (2048, 8)]:
        assert strided(geo(C, H), torch.float16) is None
        assert window(geo(C, H), torch.float16)["VEC"] == 2
    # the row kernel: small images, large ones, 513-639 channels, dilated filters
    for g in [geo(58, 7), geo(960, 7), geo(58, 32), geo(960, 48), geo(576, 14), geo(58, 28, dilation=2)]:
        assert strided(g, torch.float16) is None and window(g, torch.float16) is None, g


@pytest.mark.parametrize("C, H, expect", [
    (16, 9, ["depthwise_strided_rows_kernel"]),
    (32, 8, ["depthwise_weight_kernel", "depthwise_window_kernel"]),
])
def test_auto_routes_stride1_3x3_on_small_images(C, H, expect, device, monkeypatch):
    from tilegemm.ops.conv2d import op

    # the channel thresholds lowered from 512 and 640 (the interpreter pays for each channel block): where they
    # sit is test_stride1_3x3_rules_by_image_and_channels's
    monkeypatch.setattr(configs, "DEPTHWISE_S1_STRIDED_MAX_CHANNELS", 16)
    monkeypatch.setattr(configs, "DEPTHWISE_WINDOW_3X3_MIN_CHANNELS", 32)
    op.REPLAYS.clear()
    x = _input(1, C, H, 3, device)  # the rule reads channels and rows
    w = torch.randn(C, 1, 3, 3, device=device)
    launched = _launched(monkeypatch)
    out = tilegemm.conv2d(x, w, None, 1, 1, 1, C)
    assert launched == expect
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 1, 1, 1, C), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("C, H", [(58, 28), (122, 28), (960, 24), (640, 30), (2048, 7), (576, 14)])
def test_auto_on_the_zoo_stride1_3x3_layers(C, H, dtype, device):
    x = _input(32, C, H, H, device, dtype)
    w = (torch.randn(C, 1, 3, 3, device=device) / 3).to(dtype)
    b = torch.randn(C, device=device, dtype=dtype)
    out = tilegemm.conv2d(x, w, b, 1, 1, 1, C)
    ref = F.conv2d(x.float(), w.float(), b.float(), 1, 1, 1, C)
    assert_rel_close(out, ref, 4e-3 if dtype == torch.float16 else 1.6e-2)


@pytest.mark.parametrize("Q, K, qt, expect", [
    (7, 1536, 8, (1, 128)),  # one group of 8 columns covers the image: not four
    (56, 192, 8, (4, 32)),  # 7 groups: 8 padded by 4 a program, 7 + 1 by 2: 4 wins the tie
    (19, 2304, 4, (1, 128)),  # 5 groups: 5 by 1, 6 by 2, 8 by 4
    (56, 16, 4, (4, 32)),  # few channels: one warp's block stays
])
def test_window_blocks_follow_the_image(Q, K, qt, expect):
    assert configs.depthwise_window_blocks(Q, K, qt, 1) == expect


# Registers and spills of the candidates at ConvNeXt's 7x7 and EfficientNet's 5x5 sizes (fp16), sm_90.
_REGS_SCRIPT = SM90 + (Path(__file__).parent / "_depthwise_large_regs.py").read_text()
_CANDIDATES = {
    "rows2t-7x7": [192, 28, 7, dict(BLOCK=256, ROWS_PER=32, PIPELINE=False, STAGES=1, num_warps=4, TAP_MAJOR=True)],
    "win8t-7x7": [192, 56, 7, dict(QT=8, BLOCK_G=4, BLOCK_C=32, WINDOW_ROWS=32, VEC=1, STAGES=1, num_warps=4,
                                   TAP_MAJOR=True, AHEAD=False)],
    "win4t-5x5": [2304, 19, 5, dict(QT=4, BLOCK_G=1, BLOCK_C=128, WINDOW_ROWS=32, VEC=1, STAGES=1, num_warps=4,
                                    TAP_MAJOR=True, AHEAD=False)],
    # the next row loaded ahead at QT 8: 233 registers uncapped, 168 by maxnreg (Triton's option) without spilling
    "win8ta-7x7": [192, 56, 7, dict(QT=8, BLOCK_G=4, BLOCK_C=32, WINDOW_ROWS=32, VEC=1, STAGES=1, num_warps=4,
                                    TAP_MAJOR=True, AHEAD=True, maxnreg=168)],
}


def test_large_filter_candidates_fit_sm90_registers(tmp_path):
    got = compile_offline(tmp_path, _REGS_SCRIPT, _CANDIDATES)
    for name, info in got.items():
        assert info["spill"] == 0, f"{name} spills: {info}"
        assert info["regs"] <= 168, f"{name}: {info}"  # three programs of 4 warps an SM at least
    # the tap-major weight: a tap's channels in one run (4-byte loads of two channels at two elements a thread)
    assert "ld.global.b16" not in got["rows2t-7x7"]["loads"], got["rows2t-7x7"]


_ZOO = [  # (C, H, R): ConvNeXt's 7x7 at 56x56 and 7x7, EfficientNet's 5x5 at 19x19
    (192, 56, 7), (1536, 7, 7), (2304, 19, 5),
]
_GPU_CONFIGS = {
    "rows2t": dict(BLOCK=256, ROWS_PER=32, num_warps=4, TAP_MAJOR=True),
    "rows1t": dict(BLOCK=128, ROWS_PER=32, num_warps=4, TAP_MAJOR=True),
    "win4t": dict(qt=4), "win4ta": dict(qt=4, ahead=True), "win8t": dict(qt=8), "win2v2t": dict(qt=2, vec=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(_GPU_CONFIGS))
@pytest.mark.parametrize("C, H, R", _ZOO)
def test_large_filter_candidates_at_zoo_sizes(C, H, R, name, dtype, device):
    x = _input(32, C, H, H, device, dtype)
    w = (torch.randn(C, 1, R, R, device=device) / R).to(dtype)
    b = torch.randn(C, device=device, dtype=dtype)
    p = _problem(x, w, b, (R // 2, R // 2), activation="relu")
    cfg = dict(_GPU_CONFIGS[name])
    if "qt" in cfg:
        cfg = configs.depthwise_window_tile(p.geo, dtype, **cfg)
    else:
        cfg.update(PIPELINE=H >= 48, STAGES=3 if H >= 48 else 1)
    out = depthwise.run(p, cfg)
    ref = F.relu(F.conv2d(x.float(), w.float(), b.float(), 1, R // 2, 1, C))
    assert_rel_close(out, ref, 4e-3 if dtype == torch.float16 else 1.6e-2)


def test_candidates_tool_smoke_run_over_the_large_stride_1_layers(tmp_path, capsys):
    # tools/conv2d_depthwise_candidates.py --filter large-s1 on the interpreter: 7x7 first, every candidate checked
    import importlib.util

    from tilegemm.core.runtime import interpreting

    if not interpreting():
        pytest.skip("the tool's smoke run is the interpreter's")
    path = Path(__file__).resolve().parents[2] / "tools" / "conv2d_depthwise_candidates.py"
    spec = importlib.util.spec_from_file_location("conv2d_depthwise_candidates", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.clock_us = lambda fn: 1.0  # a timed call would repeat the checked one on the same inputs: times made up
    out = tmp_path / "dw.json"
    rc = tool.main(["--smoke", "--filter", "large-s1", "--limit", "1", "--candidates", "rows2t,win8t",
                    "--out", str(out)])
    doc = json.loads(out.read_text())
    (row,) = doc["layers"]
    assert rc == 0 and row["kind"] == "7x7" and not row["failed"]
    assert set(row["us"]) == {"cudnn", "auto", "rows2t", "win8t"}
    assert row["configs"]["win8t"]["QT"] >= 1 and row["configs"]["rows2t"]["TAP_MAJOR"]
    assert "candidate" in capsys.readouterr().out.splitlines()[-4]  # the table comes last
    names = {n for L in tool.ordered_layers(("7x7", "5x5")) for n, (_, takes) in tool.CANDIDATES.items() if takes(L)}
    assert {"rows2", "rows2t", "rows1t", "win4t", "win4ta", "win8t", "win2v2t"} <= names
