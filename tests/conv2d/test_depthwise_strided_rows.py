"""The depthwise forward over channels-last rows for any stride and dilation, chosen by config: flat
(``depthwise_strided_rows_kernel``) and in tiles of columns x channels (``depthwise_strided_tile_kernel``):
strides 1-4 (different along h and w), dilation 2, filters 1x1 to 7x7 and 1x7, odd channel counts (3, 17, 58:
2-element runs and none), channel multiplier 2, bias and activation, padding wider than the filter's reach, rows
a program that do and do not divide the image, both output layouts, fp16 / bf16 / fp32, input views, and the
switch that lets ``auto`` run it (both call routes: channels-last, and NCHW through its copies). Against
``F.conv2d`` in float64, outputs NaN-poisoned (conftest) so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.ops.conv2d import configs, depthwise
from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

from conftest import assert_rel_close, spy_launches


def _problem(x, w, b, stride, padding, dilation, out_format, activation="none"):
    g = geometry_of(x.shape, w.shape, list(stride), [padding[0], padding[0], padding[1], padding[1]],
                    list(dilation), x.shape[1])
    return ConvProblem(x, w, b, g, x.dtype, out_format, activation, "ieee", False)


def _cfg(block=32, rows=3, stages=1, tile=None):
    """A flat config of ``block`` elements, or (``tile``: (BLOCK_Q, BLOCK_C, VEC)) a tile config."""
    if tile is not None:
        return dict(BLOCK_Q=tile[0], BLOCK_C=tile[1], VEC=tile[2], STRIDED_ROWS=rows, STAGES=stages, num_warps=4)
    return dict(BLOCK=block, STRIDED_ROWS=rows, STAGES=stages, num_warps=4)


FORMS = [pytest.param(None, id="flat"), pytest.param((8, 16, 8), id="tile")]


CASES = [  # (C, mult, H, W, R, S, stride, dilation, padding)
    pytest.param(3, 1, 9, 8, 3, 3, (2, 2), (1, 1), (1, 1), id="3x3-stride2-c3"),
    pytest.param(17, 1, 7, 5, 3, 3, (1, 1), (1, 1), (1, 1), id="3x3-stride1-c17"),
    pytest.param(58, 1, 7, 4, 3, 3, (2, 2), (1, 1), (1, 1), id="3x3-stride2-c58"),
    pytest.param(8, 1, 13, 12, 3, 3, (3, 3), (1, 1), (1, 1), id="3x3-stride3"),
    pytest.param(5, 1, 15, 14, 3, 3, (4, 4), (2, 2), (2, 2), id="3x3-stride4-dilation2"),
    pytest.param(6, 2, 6, 6, 3, 3, (1, 1), (2, 2), (2, 2), id="3x3-dilation2-mult2"),
    pytest.param(4, 1, 11, 10, 3, 3, (2, 2), (2, 2), (2, 2), id="3x3-stride2-dilation2"),
    pytest.param(17, 2, 10, 5, 5, 5, (3, 1), (1, 2), (2, 3), id="5x5-stride3x1-dilation1x2-mult2"),
    pytest.param(16, 1, 7, 7, 5, 5, (2, 2), (1, 1), (2, 2), id="5x5-stride2"),
    pytest.param(3, 1, 6, 7, 7, 7, (1, 1), (1, 1), (3, 3), id="7x7-stride1-c3"),
    pytest.param(8, 1, 7, 10, 7, 7, (2, 2), (1, 1), (3, 3), id="7x7-stride2"),
    pytest.param(8, 1, 7, 9, 1, 7, (1, 1), (1, 1), (0, 3), id="1x7"),
    pytest.param(8, 1, 9, 7, 7, 1, (2, 1), (1, 1), (3, 0), id="7x1-stride2x1"),
    pytest.param(12, 1, 6, 7, 1, 1, (2, 2), (1, 1), (0, 0), id="1x1-stride2"),
    pytest.param(5, 1, 5, 5, 3, 3, (1, 2), (1, 1), (4, 1), id="padding-past-the-filter"),  # rows of pure padding
]


@pytest.mark.parametrize("tile", FORMS)
@pytest.mark.parametrize("C, mult, H, W, R, S, stride, dilation, padding", CASES)
def test_strided_rows_kernel_matches_f_conv2d(C, mult, H, W, R, S, stride, dilation, padding, tile, device):
    x = torch.randn(1, C, H, W, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C * mult, 1, R, S, device=device)
    b = torch.randn(C * mult, device=device)
    p = _problem(x, w, b, stride, padding, dilation, torch.channels_last, "relu")
    assert depthwise.strided_rows_apply(p.geo, x)
    out = depthwise.run(p, _cfg(tile=tile))
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), stride, padding, dilation, C))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_rel_close(out, ref, 1e-5)


@pytest.mark.parametrize("rows, block, stages, tile", [(1, 16, 1, None), (4, 64, 2, None), (7, 32, 3, None),
                                                       (2, 0, 1, (2, 16, 2)), (9, 0, 2, (8, 32, 4))])
@pytest.mark.parametrize("channels_last_out", [True, False])
def test_rows_a_program_blocks_stages_and_output_layouts(rows, block, stages, tile, channels_last_out, device):
    # 9 output rows (at most 1, 2, 4, 7 or 9 a program: balanced, one program for all), flat blocks that
    # straddle pixels and rows, tiles of columns and channel blocks (10 channels: a block partly past them),
    # narrower vectors, the pipelined loop; no bias, an NCHW output stored element by element (one image: the
    # other tests here take several)
    x = torch.randn(1, 10, 17, 6, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(10, 1, 3, 3, device=device)
    fmt = torch.channels_last if channels_last_out else torch.contiguous_format
    p = _problem(x, w, None, (2, 2), (1, 1), (1, 1), fmt)
    out = depthwise.run(p, _cfg(block, rows, stages, tile))
    assert out.is_contiguous(memory_format=fmt)
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 2, 1, 1, 10), 1e-5)


@pytest.mark.parametrize("tile", FORMS)
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 4e-3), (torch.bfloat16, 2.5e-2)])
def test_16_bit_inputs_accumulate_in_fp32(dtype, tol, tile, device):
    x = torch.randn(2, 24, 6, 6, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 1, 3, 3, device=device, dtype=dtype)
    b = torch.randn(24, device=device, dtype=dtype)
    p = _problem(x, w, b, (2, 2), (1, 1), (1, 1), torch.channels_last)
    out = depthwise.run(p, _cfg(64, 2, tile=tile))
    assert out.dtype == dtype
    assert_rel_close(out, F.conv2d(x.double(), w.double(), b.double(), 2, 1, 1, 24), tol)


def _gapped_rows(device):  # channels-last rows 3 pixels apart: each row is still one run
    return torch.randn(2, 8, 7, 9, device=device).contiguous(memory_format=torch.channels_last)[..., :6]


def _misaligned(device):  # 3 channels, the first image row dropped: a data pointer 15 elements in
    return torch.randn(1, 3, 8, 5, device=device).contiguous(memory_format=torch.channels_last)[:, :, 1:]


@pytest.mark.parametrize("tile", FORMS)
@pytest.mark.parametrize("make", [_gapped_rows, _misaligned], ids=["gapped-rows", "misaligned"])
def test_strided_rows_kernel_takes_input_views(make, tile, device):
    x = make(device)
    C = x.shape[1]
    w = torch.randn(C, 1, 3, 3, device=device)
    p = _problem(x, w, None, (2, 2), (1, 1), (1, 1), torch.channels_last)
    out = depthwise.run(p, _cfg(tile=tile))
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 2, 1, 1, C), 1e-5)


def _launched_kernels(monkeypatch):
    return spy_launches(monkeypatch, depthwise)


def test_auto_runs_strided_forwards_on_the_strided_row_kernel(device, monkeypatch):
    assert configs.STRIDED_ROWS_AUTO
    x = torch.randn(1, 8, 9, 9, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, device=device)
    w7 = torch.randn(8, 1, 7, 7, device=device)
    launched = _launched_kernels(monkeypatch)
    out = tilegemm.conv2d(x, w, None, 2, 1, 1, 8)
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 2, 1, 1, 8), 1e-5)
    short = torch.randn(1, 8, 6, 9, device=device).contiguous(memory_format=torch.channels_last)
    tilegemm.conv2d(short, w, None, 1, 1, 1, 8)  # stride 1 on 6 rows: the row kernel (8-31 rows: strided rows)
    tilegemm.conv2d(x, w7, None, 2, 3, 1, 8)  # 7x7 strided: the pixel kernel (not timed on the strided rows)
    assert launched == ["depthwise_strided_rows_kernel", "depthwise_rows_kernel", "depthwise_weight_kernel",
                        "depthwise_fwd_kernel"]
    monkeypatch.setattr(configs, "STRIDED_ROWS_AUTO", False)
    from tilegemm.ops.conv2d import op

    op.REPLAYS.clear()  # on a GPU the call like the first one would replay its launches: decide afresh
    launched.clear()
    tilegemm.conv2d(x, w, None, 2, 1, 1, 8)
    assert launched == ["depthwise_weight_kernel", "depthwise_fwd_kernel"]


@pytest.mark.parametrize("nchw", [False, True], ids=["channels-last", "nchw-route"])
def test_the_switch_runs_every_depthwise_forward_it_takes(nchw, device, monkeypatch):
    from tilegemm.ops.conv2d import dispatch, layout

    monkeypatch.setattr(configs, "STRIDED_ROWS_AUTO", True)
    if nchw:  # the GPU's NCHW route forced on: the input copied channels-last, the output copied back
        monkeypatch.setattr(dispatch, "_nchw_route", lambda t: layout.planar(t) and t.shape[1] > 8)
    x = torch.randn(2, 12, 5, 8, device=device)
    if not nchw:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 1, 3, 3, device=device)
    b = torch.randn(24, device=device)
    launched = _launched_kernels(monkeypatch)
    out = tilegemm.conv2d(x, w, b, 2, 1, 1, 12, activation="relu")
    assert launched == ["depthwise_strided_rows_kernel"]
    assert out.is_contiguous(memory_format=torch.contiguous_format if nchw else torch.channels_last)
    assert_rel_close(out, F.relu(F.conv2d(x.double(), w.double(), b.double(), 2, 1, 1, 12)), 1e-5)


def test_larger_filters_and_gapped_pixels_are_refused(device):
    x = torch.randn(1, 8, 12, 12, device=device).contiguous(memory_format=torch.channels_last)
    big = _problem(x, torch.randn(8, 1, 9, 9, device=device), None, (1, 1), (4, 4), (1, 1), torch.channels_last)
    assert not depthwise.strided_rows_apply(big.geo, x)  # 81 taps of weights a thread: past the cap
    with pytest.raises(ValueError, match="depthwise_strided_rows_kernel does not take"):
        depthwise.run(big, _cfg())
    p = _problem(x, torch.randn(8, 1, 3, 3, device=device), None, (2, 2), (1, 1), (1, 1), torch.channels_last)
    with pytest.raises(ValueError, match="STRIDED_ROWS must be at least 1"):
        depthwise.run(p, _cfg(rows=0))
    gapped = x[:, :, :, ::2]  # pixels 2*C apart: a row is not one run
    p = _problem(gapped, torch.randn(8, 1, 3, 3, device=device), None, (2, 2), (1, 1), (1, 1), torch.channels_last)
    assert not depthwise.strided_rows_apply(p.geo, gapped)


@pytest.mark.parametrize("R, stride, per_thread", [(3, 2, 8), (5, 1, 2), (5, 2, 2), (7, 1, 2), (7, 2, 2)])
def test_the_gpu_tile_holds_fewer_elements_a_thread_for_larger_filters(R, stride, per_thread, monkeypatch):
    from tilegemm.ops.conv2d.problem import Geometry

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    g = Geometry(32, 96, 28, 28, 96, R, R, 96, (stride, stride), (R // 2,) * 4, (1, 1))
    cfg = configs.depthwise_strided_rows_tile(g, torch.float16)
    assert cfg["BLOCK"] // (32 * cfg["num_warps"]) == per_thread  # R*S weights an element in registers
    # auto's rule: strided forwards of up to 5x5 filters (stride 1 keeps the row kernel, 7x7 the pixel kernel)
    assert (configs.depthwise_strided_rows_config(g, torch.float16) is not None) == (stride > 1 and R <= 5)
