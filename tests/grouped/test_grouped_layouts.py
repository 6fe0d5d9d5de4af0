"""tilegemm.grouped_mm against the float64 oracle: every layout, empty and single-row groups, odd sizes,
transposed and sliced operands, bias, out_dtype; outputs NaN-poisoned (conftest), so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close

# Group sizes along the jagged dimension: empty groups (first, middle, last), single rows, odd sizes.
SIZES = {
    "mixed": [3, 0, 17, 1, 0, 20],
    "one_group": [17],
    "single_rows": [1, 1, 0, 1],
    "all_empty": [0, 0, 0],
    "first_takes_all": [33, 0, 0],
}


def offs_of(sizes, device):
    return torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def operands(layout, sizes, K, N, dtype, device, tail=0, b_transposed=False, M=9):
    """(a, b, offs) of a layout with groups of ``sizes`` along the jagged dimension and ``tail`` spare rows past
    offs[-1]."""
    G = len(sizes)
    total = sum(sizes) + tail
    offs = offs_of(sizes, device)
    r = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
    if layout == "2d3d":
        a, b = r(total, K), (r(G, N, K).transpose(-2, -1) if b_transposed else r(G, K, N))
    elif layout == "3d3d":
        a, b, offs = r(G, M, K), (r(G, N, K).transpose(-2, -1) if b_transposed else r(G, K, N)), None
    elif layout == "2d2d":
        a, b = r(M, total), (r(N, total).T if b_transposed else r(total, N))
    else:
        a, b = r(G, M, K), (r(total, K).T if b_transposed else r(K, total))
    return a, b, offs


def check_backward(a, b, offs, dtype):
    """``tilegemm.grouped_mm``'s gradients of ``a`` and ``b`` for a random output gradient, against the fp64
    reference's."""
    a.requires_grad_()
    b.requires_grad_()
    out = tilegemm.grouped_mm(a, b, offs=offs)
    grad = torch.randn_like(out)
    ga, gb = torch.autograd.grad(out, (a, b), grad)
    wa, wb = torch.autograd.grad(grouped_mm_reference(a, b, offs), (a, b), grad.double())
    assert_rel_close(ga, wa, tolerance(dtype))
    assert_rel_close(gb, wb, tolerance(dtype))


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d", "3d2d"])
@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
def test_layouts_fp32(layout, sizes, device):
    a, b, offs = operands(layout, SIZES[sizes], 17, 19, torch.float32, device)
    out = tilegemm.grouped_mm(a, b, offs=offs)
    assert_rel_close(out, grouped_mm_reference(a, b, offs), 1e-5)


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_transposed_b_and_fp16(layout, device):
    a, b, offs = operands(layout, SIZES["mixed"], 24, 40, torch.float16, device, b_transposed=True)
    assert b.stride(-2) == 1  # column-major b, read in place
    out = tilegemm.grouped_mm(a, b, offs=offs)
    assert out.dtype == torch.float16
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))


@pytest.mark.parametrize("layout", ["2d3d", "3d2d"])
def test_rows_past_the_last_offset_are_zero(layout, device):
    a, b, offs = operands(layout, [2, 0, 5], 8, 16, torch.float32, device, tail=7)
    out = tilegemm.grouped_mm(a, b, offs=offs)
    assert_rel_close(out, grouped_mm_reference(a, b, offs), 1e-5)
    tail = out[7:] if layout == "2d3d" else out[:, 7:]
    assert torch.equal(tail, torch.zeros_like(tail))


def test_matches_torch_grouped_mm_where_torch_runs(device):
    # torch's own op (on the CPU build: fp32 with 16-byte aligned strides) is the semantics we follow
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    a, b, offs = operands("2d3d", [3, 0, 9, 4], 16, 8, torch.float32, device, tail=4)
    # (rows past offs[-1] are left unspecified by torch; tilegemm zeroes them, checked above)
    torch.testing.assert_close(tilegemm.grouped_mm(a, b, offs=offs)[:16],
                               torch.nn.functional.grouped_mm(a, b, offs=offs)[:16], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout, per_group", [("2d3d", False), ("2d3d", True), ("3d3d", False), ("3d3d", True),
                                               ("2d2d", False), ("2d2d", True), ("3d2d", False)])
def test_bias(layout, per_group, device):
    # (3-D x 2-D takes a bias [N] only: its groups split N; a [G, N] one is refused, test_grouped_errors)
    sizes = SIZES["mixed"]
    a, b, offs = operands(layout, sizes, 16, 12, torch.float32, device, tail=3)
    N = b.shape[-1]
    bias = torch.randn(len(sizes), N, device=device) if per_group else torch.randn(N, device=device)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), 1e-5)


def test_sliced_operands(device):
    big = torch.randn(50, 40, device=device)
    a = big[5:38, 3:20]  # a view with a row stride of 40
    w = torch.randn(3, 30, 25, device=device)[:, 4:21, ::2]  # strided in every dimension
    offs = offs_of([10, 0, 23], device)
    out = tilegemm.grouped_mm(a, w, offs=offs)
    assert_rel_close(out, grouped_mm_reference(a, w, offs), 1e-5)


def test_negative_views_are_read_as_their_values(device):
    # z.conj().imag holds its values negated in memory (a bit torch's ops resolve): the kernels flipped their sign
    from tilegemm.ops.grouped.api import moe_gate_up

    def neg(*shape):
        t = torch.complex(torch.randn(*shape, device=device), torch.randn(*shape, device=device)).conj().imag
        assert t.is_neg()
        return t

    a, w, bias, offs = neg(12, 8), neg(3, 8, 6), neg(3, 6), offs_of([4, 0, 7], device)
    assert_rel_close(tilegemm.grouped_mm(a, w, offs=offs, bias=bias), grouped_mm_reference(a, w, offs, bias), 1e-5)
    out = torch.ops.tilegemm.grouped_mm(a, w, offs, bias, None, "default", "auto")  # (as a compiled graph calls it)
    assert_rel_close(out, grouped_mm_reference(a, w, offs, bias), 1e-5)
    gate, up = grouped_mm_reference(a, w, offs, bias).split(3, dim=1)
    assert_rel_close(moe_gate_up(a, w, offs, bias, "relu"), gate.relu() * up, 1e-5)


def test_out_dtype_fp32_from_fp16(device):
    a, b, offs = operands("2d3d", [5, 11], 32, 16, torch.float16, device)
    out = tilegemm.grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_rel_close(out, grouped_mm_reference(a, b, offs), 1e-3)
    for bias_dtype in (torch.float16, torch.float32):  # a bias of the operands' dtype or of the output's
        bias = torch.randn(2, 16, device=device).to(bias_dtype)
        out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), 1e-3)


def test_many_groups_and_one_row_each(device):
    # a decode step of a many-expert model: most groups empty, a few with one row
    sizes = [0] * 40
    for g in (0, 7, 8, 39):
        sizes[g] = 1
    a, b, offs = operands("2d3d", sizes, 16, 8, torch.float32, device)
    assert_rel_close(tilegemm.grouped_mm(a, b, offs=offs), grouped_mm_reference(a, b, offs), 1e-5)


def test_tf32_setting_is_read(device):
    a, b, offs = operands("2d3d", [9, 8], 64, 16, torch.float32, device)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        out = tilegemm.grouped_mm(a, b, offs=offs)
    finally:
        torch.set_float32_matmul_precision(old)
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float32, "tf32"))


def test_batched_matmul_entry(device):
    a = torch.randn(3, 17, 9, device=device)
    b = torch.randn(3, 13, 9, device=device).transpose(1, 2)
    assert_rel_close(tilegemm.ops.grouped.batched_matmul(a, b), torch.matmul(a.double(), b.double()), 1e-5)


def test_registered():
    assert "tiled" in tilegemm.kernels("grouped")
    assert "dequant_dot" in tilegemm.kernels("grouped_w4a16")


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_empty_k_gives_the_bias(layout, device):
    a, b, offs = operands(layout, [2, 0, 3], 0, 6, torch.float32, device, tail=1)
    bias = torch.randn(6, device=device)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), 1e-6)


def test_no_groups(device):
    a = torch.randn(5, 8, device=device)
    out = tilegemm.grouped_mm(a, torch.randn(0, 8, 4, device=device), offs=torch.zeros(0, dtype=torch.int32,
                                                                                          device=device))
    assert torch.equal(out, torch.zeros(5, 4, device=device))


def test_strided_offs(device):
    a, b, _ = operands("2d3d", [3, 0, 9], 8, 8, torch.float32, device)
    offs = torch.tensor([3, -1, 3, -1, 12, -1], dtype=torch.int32, device=device)[::2]  # a strided view
    assert offs.stride(0) == 2
    assert_rel_close(tilegemm.grouped_mm(a, b, offs=offs), grouped_mm_reference(a, b, offs), 1e-5)
