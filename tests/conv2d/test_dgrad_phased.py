"""The pointer data-gradient kernel per stride phase (``PHASED``): each program takes the input pixels of one
stride phase and runs only the taps that land on whole output pixels. Checked against F.conv2d's gradient in
float64 and against the masked kernel (every tap, masked per pixel), over strides, paddings, odd sizes, phases
with no tap at all, groups and both memory formats; outputs are NaN-poisoned, so a pixel no program writes
fails."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d import implicit_gemm
from tilegemm.ops.conv2d.problem import geometry_of
from tilegemm.ops.conv2d.reference import tolerance

from conftest import assert_rel_close

CL = torch.channels_last


def _reference_dgrad(dy, w, x_shape, stride, padding, groups):
    xr = torch.zeros(x_shape, dtype=torch.float64, device=dy.device, requires_grad=True)
    top, bottom, left, right = padding
    xp = torch.nn.functional.pad(xr, (left, right, top, bottom))
    torch.nn.functional.conv2d(xp, w.double(), None, stride, 0, 1, groups).backward(dy.double())
    return xr.grad


def _run(N, C, H, W, K, R, S, stride, padding, groups, channels_last, device, dtype=torch.float32, phased=None):
    padding = tuple(padding) if len(padding) == 4 else (padding[0], padding[0], padding[1], padding[1])
    g = geometry_of((N, C, H, W), (K, C // groups, R, S), list(stride), list(padding), [1, 1], groups)
    dy = torch.randn(N, K, g.P, g.Q, device=device).to(dtype)
    if channels_last:
        dy = dy.contiguous(memory_format=CL)
    w = (torch.randn(K, C // groups, R, S, device=device) / (K * R * S / (stride[0] * stride[1])) ** 0.5).to(dtype)
    fmt = CL if channels_last else torch.contiguous_format
    upcast = dtype == torch.bfloat16 and device == "cpu"
    dx = implicit_gemm.dgrad(dy, w, (N, C, H, W), fmt, g, "ieee", upcast, phased=phased)
    return g, dx, _reference_dgrad(dy, w, (N, C, H, W), stride, padding, groups)


def test_phases_apply_to_strided_undilated_convolutions_only():
    def geo(stride, dilation):
        return geometry_of((1, 8, 9, 9), (8, 8, 3, 3), list(stride), [1, 1, 1, 1], list(dilation), 1)

    assert implicit_gemm.phases_apply(geo((2, 2), (1, 1)))
    assert implicit_gemm.phases_apply(geo((1, 2), (1, 1)))
    assert not implicit_gemm.phases_apply(geo((1, 1), (1, 1)))  # one phase: nothing to skip
    assert not implicit_gemm.phases_apply(geo((2, 2), (2, 1)))  # dilated: taps per phase are not a progression


@pytest.mark.parametrize("shape,stride,padding", [
    pytest.param((2, 6, 9, 8, 8, 3, 3), (2, 2), (1, 1), id="3x3-s2-odd-height"),
    pytest.param((1, 5, 11, 10, 7, 5, 5), (2, 2), (2, 2), id="5x5-s2"),
    pytest.param((2, 16, 7, 9, 8, 1, 1), (2, 2), (0, 0), id="1x1-s2-three-empty-phases"),
    pytest.param((1, 4, 10, 11, 6, 1, 1), (3, 3), (0, 0), id="1x1-s3-eight-empty-phases"),
    pytest.param((1, 3, 13, 12, 8, 7, 7), (2, 2), (3, 3), id="stem-7x7-C3"),
    pytest.param((1, 6, 9, 14, 5, 3, 4), (2, 3), (1, 2), id="non-square-filter-and-stride"),
    pytest.param((1, 4, 8, 8, 4, 2, 2), (3, 3), (0, 0), id="stride-above-filter-rows-never-read"),
    pytest.param((2, 8, 9, 9, 6, 3, 3), (2, 2), (0, 2, 1, 0), id="asymmetric-padding"),
    pytest.param((1, 2, 1, 1, 4, 3, 3), (2, 2), (1, 1), id="one-pixel-image"),
])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_phased_data_gradient_matches_f_conv2d(shape, stride, padding, channels_last, device):
    g, dx, want = _run(*shape, stride, padding, 1, channels_last, device)
    assert implicit_gemm.phases_apply(g)
    assert dx.shape == want.shape
    assert dx.is_contiguous(memory_format=CL if channels_last else torch.contiguous_format)
    assert_rel_close(dx, want, 1e-5)


@pytest.mark.parametrize("groups", [2, 3])
def test_phased_data_gradient_over_groups(groups, device):
    # grid axis 1 is group * phases + phase: a wrong split would put one group's pixels in another's channels
    _, dx, want = _run(2, 4 * groups, 9, 7, 5 * groups, 3, 3, (2, 2), (1, 1), groups, True, device)
    assert_rel_close(dx, want, 1e-5)


@pytest.mark.parametrize("stride,padding", [((7, 64), (1, 2)), ((2**31 - 1, 2**31 - 1), (0, 0))],
                         ids=["past-the-image", "huge"])
def test_a_stride_past_the_image_launches_only_the_phases_holding_pixels(stride, padding, device, monkeypatch):
    # phases from H (W) on hold no pixel: a stride of 2**31 - 1 launched 2**62 programs (and overflowed 32-bit
    # arithmetic), one of 64 ran 4096 for 20
    grids = []
    launch = implicit_gemm.launch
    monkeypatch.setattr(implicit_gemm, "launch", lambda kernel, grid, *a, **k: (grids.append(grid),
                                                                                launch(kernel, grid, *a, **k))[1])
    _, dx, want = _run(2, 3, 5, 4, 4, 3, 3, stride, padding, 1, True, device)
    assert_rel_close(dx, want, 1e-5)
    assert grids[-1][1] <= 5 * 4  # at most a phase a pixel of the 5x4 image


def test_phases_past_the_grids_second_axis_run_one_program_a_group(device, monkeypatch):
    grids = []
    launch = implicit_gemm.launch
    monkeypatch.setattr(implicit_gemm, "launch", lambda kernel, grid, *a, **k: (grids.append(grid),
                                                                                launch(kernel, grid, *a, **k))[1])
    monkeypatch.setattr(implicit_gemm, "_MAX_GRID_Y", 2 * 3 * 3 - 1)  # two groups of 3x3 phases: one too many
    _, dx, want = _run(1, 4, 7, 7, 4, 3, 3, (3, 3), (1, 1), 2, False, device)
    assert_rel_close(dx, want, 1e-5)
    assert grids[-1][1] == 2


def test_phased_and_masked_kernels_agree(device):
    _, phased, want = _run(2, 8, 10, 9, 12, 3, 3, (2, 2), (1, 1), 1, True, device, phased=True)
    torch.manual_seed(0)
    g, masked, want2 = _run(2, 8, 10, 9, 12, 3, 3, (2, 2), (1, 1), 1, True, device, phased=False)
    assert_rel_close(phased, want, 1e-5)
    assert_rel_close(masked, want2, 1e-5)


# fewer draws under the interpreter (CI's minutes); a GPU run takes the full count
@settings(max_examples=8 if interpreting() else 12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(R=st.integers(1, 5), S=st.integers(1, 5), sh=st.integers(1, 3), sw=st.integers(1, 3),
       pads=st.tuples(*[st.integers(0, 3)] * 4), H=st.integers(1, 12), W=st.integers(1, 12),
       N=st.integers(1, 2), C=st.integers(1, 6), K=st.integers(1, 6), channels_last=st.booleans())
def test_phased_data_gradient_properties(R, S, sh, sw, pads, H, W, N, C, K, channels_last, device):
    top, bottom, left, right = pads
    if H + top + bottom < R or W + left + right < S or (sh, sw) == (1, 1):
        return
    _, dx, want = _run(N, C, H, W, K, R, S, (sh, sw), pads, 1, channels_last, device)
    assert_rel_close(dx, want, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,padding", [
    ((4, 128, 28, 28, 256, 3, 3), (1, 1)),
    ((4, 256, 28, 28, 512, 1, 1), (0, 0)),
    ((4, 3, 64, 64, 64, 7, 7), (3, 3)),
    ((3, 72, 15, 17, 40, 3, 3), (1, 1)),
])
def test_gpu_phased_data_gradient(shape, padding, dtype, device):
    _, dx, want = _run(*shape, (2, 2), padding, 1, True, device, dtype)
    assert_rel_close(dx, want, tolerance(dtype))
