"""The stride-1 depthwise forward over flattened channels-last rows (``depthwise_rows_kernel``): both loop forms
(Triton's pipeliner, loads held rows ahead in registers) over filters up to 5x5, channel multipliers, padding
taller than the filter's reach, rows per program that do and do not divide the image, blocks that straddle
pixels and rows, both output layouts; which forwards take it; configs it refuses. Against ``F.conv2d`` in
float64 with outputs poisoned (NaN) so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d import depthwise
from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

from conftest import assert_rel_close, crossed, spy_launches


def _problem(x, w, b, padding, out_format, activation="none", stride=(1, 1), dilation=(1, 1)):
    g = geometry_of(x.shape, w.shape, list(stride), [padding[0], padding[0], padding[1], padding[1]],
                    list(dilation), x.shape[1])
    return ConvProblem(x, w, b, g, x.dtype, out_format, activation, "ieee", False)


@st.composite
def rows_cases(draw):
    C = draw(st.integers(2, 24))  # one channel is a plain convolution (groups = 1)
    R, S = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    H = draw(st.integers(max(1, R - 2 * padding[0]), 9))
    W = draw(st.integers(max(1, S - 2 * padding[1]), 9))
    config = dict(BLOCK=draw(st.sampled_from([16, 32, 64])), ROWS_PER=draw(st.integers(1, 9)),
                  PIPELINE=draw(st.booleans()), STAGES=draw(st.integers(1, 3)), num_warps=4)
    return dict(N=draw(st.integers(1, 2)), C=C, mult=draw(st.integers(1, 3)), H=H, W=W, R=R, S=S,
                padding=padding, bias=draw(st.booleans()), channels_last_out=draw(st.booleans()),
                activation=draw(st.sampled_from(["none", "relu"])), config=config)


# fewer draws under the interpreter (CI's minutes, each draw seconds there); a GPU run takes the full count
@settings(max_examples=4 if interpreting() else 7, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=rows_cases())
def test_rows_kernel_matches_f_conv2d(c, device):
    x = torch.randn(c["N"], c["C"], c["H"], c["W"], device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(c["C"] * c["mult"], 1, c["R"], c["S"], device=device)
    b = torch.randn(c["C"] * c["mult"], device=device) if c["bias"] else None
    fmt = torch.channels_last if c["channels_last_out"] else torch.contiguous_format
    p = _problem(x, w, b, c["padding"], fmt, c["activation"])
    assert depthwise.rows_apply(p.geo, x)
    out = depthwise.run(p, c["config"])
    ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), 1, c["padding"], 1, c["C"])
    if c["activation"] == "relu":
        ref = F.relu(ref)
    assert out.is_contiguous(memory_format=fmt)
    assert_rel_close(out, ref, 1e-5)


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_kernel_both_forms_over_a_taller_image(pipeline, dtype, device):
    # more rows than a program's, padding 3 around a 3x3 filter (rows above and below that add nothing), a
    # block that straddles pixels; fp16 accumulates in fp32 like the reference's rounding allows
    x = torch.randn(1, 24, 11, 4, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 1, 3, 3, device=device, dtype=dtype)
    b = torch.randn(24, device=device, dtype=dtype)
    p = _problem(x, w, b, (3, 1), torch.channels_last)
    out = depthwise.run(p, dict(BLOCK=32, ROWS_PER=5, PIPELINE=pipeline, STAGES=2, num_warps=4))
    ref = F.conv2d(x.double(), w.double(), b.double(), 1, (3, 1), 1, 24)
    assert_rel_close(out, ref, 2e-3 if dtype == torch.float16 else 1e-5)


def _launched_kernels(monkeypatch, grids=None):
    return spy_launches(monkeypatch, depthwise, grids)


@crossed("mult, pipeline, channels_last_out, stages", [1, 3], [True, False], [True, False], [1, 3])
def test_rows_kernel_forms_multipliers_and_layouts(mult, pipeline, channels_last_out, stages, device):
    # padding 4 above and below a 3-tall filter (rows of pure padding, the last program's row all padding), 3
    # rows a program (not dividing the 10 output rows), 5 channels (no 2-, 4- or 8-element runs)
    x = torch.randn(1, 5, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(5 * mult, 1, 3, 2, device=device)
    b = torch.randn(5 * mult, device=device)
    fmt = torch.channels_last if channels_last_out else torch.contiguous_format
    p = _problem(x, w, b, (4, 1), fmt, "relu")
    out = depthwise.run(p, dict(BLOCK=16, ROWS_PER=3, PIPELINE=pipeline, STAGES=stages, num_warps=4))
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), 1, (4, 1), 1, 5))
    assert out.is_contiguous(memory_format=fmt)
    assert_rel_close(out, ref, 1e-5)


def _gapped_rows(device):  # channels-last rows 3 pixels apart: admitted (each row is still one run)
    return torch.randn(2, 8, 7, 9, device=device).contiguous(memory_format=torch.channels_last)[..., :6]


def _misaligned(device):  # 3 channels, the first image row dropped: a data pointer 15 elements in
    return torch.randn(1, 3, 8, 5, device=device).contiguous(memory_format=torch.channels_last)[:, :, 1:]


def _one_column(device):  # W = 1 with a pixel stride that is not C
    base = torch.randn(2 * 6 * 7 * 4, device=device)
    return base.as_strided((2, 4, 6, 1), (6 * 7 * 4, 1, 7 * 4, 5))


@pytest.mark.parametrize("make", [_gapped_rows, _misaligned, _one_column], ids=["gapped-rows", "misaligned",
                                                                                "one-column"])
def test_rows_kernel_takes_input_views(make, device, monkeypatch):
    x = make(device)
    C = x.shape[1]
    w = torch.randn(C, 1, 3, 3, device=device)
    launched = _launched_kernels(monkeypatch)
    out = tilegemm.conv2d(x, w, None, 1, 1, 1, C, kernel="depthwise")
    assert launched == ["depthwise_rows_kernel"]
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 1, 1, 1, C), 1e-5)


@pytest.mark.parametrize("bias", ["strided", "expanded"])
def test_rows_kernel_reads_the_bias_through_its_stride(bias, device):
    x = torch.randn(1, 8, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, device=device)
    b = torch.randn(16, device=device)[::2] if bias == "strided" else torch.tensor([0.5], device=device).expand(8)
    out = tilegemm.conv2d(x, w, b, 1, 1, 1, 8, kernel="depthwise")
    assert_rel_close(out, F.conv2d(x.double(), w.double(), b.double(), 1, 1, 1, 8), 1e-5)


@pytest.mark.parametrize("R, S", [(1, 25), (3, 7), (5, 5)])
def test_rows_kernel_filters_up_to_25_taps(R, S, device, monkeypatch):
    x = torch.randn(1, 8, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, R, S, device=device)
    launched = _launched_kernels(monkeypatch)
    out = tilegemm.conv2d(x, w, None, 1, (R // 2, S // 2), 1, 8, kernel="depthwise")
    # past 9 taps the weight is first rewritten tap-major (configs.DEPTHWISE_ROWS_TAP_MAJOR)
    assert launched == (["depthwise_weight_kernel"] if R * S > 9 else []) + ["depthwise_rows_kernel"]
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 1, (R // 2, S // 2), 1, 8), 1e-5)


def test_rows_kernel_bf16(device):
    x = torch.randn(2, 16, 9, 3, device=device, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 1, 3, 3, device=device, dtype=torch.bfloat16)
    b = torch.randn(16, device=device, dtype=torch.bfloat16)
    out = tilegemm.conv2d(x, w, b, 1, 1, 1, 16, kernel="depthwise")
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, F.conv2d(x.double(), w.double(), b.double(), 1, 1, 1, 16), 1e-2)


def test_rows_kernel_launches_one_grid_axis(device, monkeypatch):
    # a second grid axis is capped at 65535 programs: images x row groups must not go there
    x = torch.randn(3, 8, 9, 3, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, device=device)
    grids = []
    _launched_kernels(monkeypatch, grids)
    tilegemm.conv2d(x, w, None, 1, 1, 1, 8, kernel="depthwise")
    assert len(grids) == 1 and len(grids[0]) == 1


@pytest.mark.gpu
def test_rows_kernel_over_more_than_65535_images_and_row_groups(device):
    x = torch.randn(70000, 8, 4, 4, device=device, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, device=device, dtype=torch.float16)
    out = tilegemm.conv2d(x, w, None, 1, 1, 1, 8, kernel="depthwise")
    assert_rel_close(out, F.conv2d(x.float(), w.float(), None, 1, 1, 1, 8), 2e-3)


def test_an_input_whose_rows_span_past_32_bit_offsets_takes_the_pixel_kernel():
    # rows 2^29 pixels apart: a view of a few elements whose in-image offsets pass 2^31 (no memory behind it)
    from tilegemm.ops.conv2d.problem import geometry_of as geo

    x = torch.empty_strided((1, 3, 4, 2), (3 * 2**30, 1, 3 * 2**29, 3), device="meta")
    g = geo(x.shape, (3, 1, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 3)
    assert not depthwise.rows_apply(g, x)
    small = torch.empty(1, 3, 4, 2).contiguous(memory_format=torch.channels_last)
    assert depthwise.rows_apply(g, small)


@pytest.mark.parametrize("stride, dilation, layout, rows, expect", [
    ((1, 1), (1, 1), "channels_last", 6, ["depthwise_rows_kernel"]),
    ((1, 1), (1, 1), "nchw", 6, ["depthwise_rows_kernel"]),  # the input made channels-last first, as before
    # stride-1 3x3 on an image of 8 to 31 rows: the strided row kernel (configs.DEPTHWISE_S1_STRIDED_ROWS)
    ((1, 1), (1, 1), "channels_last", 9, ["depthwise_strided_rows_kernel"]),
    ((1, 1), (1, 1), "channels_last", 33, ["depthwise_rows_kernel"]),
    ((2, 2), (1, 1), "channels_last", 9, ["depthwise_strided_rows_kernel"]),  # strided: the strided row kernel
    ((1, 1), (2, 2), "channels_last", 9, ["depthwise_weight_kernel", "depthwise_fwd_kernel"]),
    ((1, 1), (1, 1), "gapped", 9, ["depthwise_weight_kernel", "depthwise_fwd_kernel"]),  # pixels not adjacent
])
def test_which_forwards_take_the_rows_kernel(stride, dilation, layout, rows, expect, device, monkeypatch):
    # the rules read rows (and channels, taps, stride, dilation, layout), not the width: a narrow image
    x = torch.randn(1, 16, rows, 4, device=device).contiguous(memory_format=torch.channels_last)
    if layout == "nchw":
        x = x.contiguous()
    elif layout == "gapped":
        x = x[:, :, :, ::2]  # channels at stride 1, pixels 2*C apart
    w = torch.randn(16, 1, 3, 3, device=device)
    launched = _launched_kernels(monkeypatch)
    out = tilegemm.conv2d(x, w, None, stride, 1, dilation, 16, kernel="depthwise")
    assert launched == expect
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, stride, 1, dilation, 16), 1e-5)


def test_a_larger_filter_takes_the_pixel_kernel_where_the_window_kernel_is_off(device, monkeypatch):
    # 7x7: 49 taps of weights in registers a thread is past DEPTHWISE_ROWS_MAX_TAPS
    from tilegemm.ops.conv2d import configs

    monkeypatch.setattr(configs, "DEPTHWISE_WINDOW_AUTO", False)
    x = torch.randn(1, 8, 6, 5, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 7, 7, device=device)
    launched = _launched_kernels(monkeypatch)
    out = tilegemm.conv2d(x, w, None, 1, 3, 1, 8, kernel="depthwise")
    assert launched == ["depthwise_weight_kernel", "depthwise_fwd_kernel"]
    assert_rel_close(out, F.conv2d(x.double(), w.double(), None, 1, 3, 1, 8), 1e-5)


def test_a_rows_config_for_a_strided_layer_is_refused(device):
    x = torch.randn(1, 8, 9, 9, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, device=device)
    p = _problem(x, w, None, (1, 1), torch.channels_last, stride=(2, 2))
    with pytest.raises(ValueError, match="depthwise_rows_kernel does not take"):
        depthwise.run(p, dict(BLOCK=32, ROWS_PER=4, PIPELINE=False, STAGES=1, num_warps=4))
