"""The registered grouped ops called directly (torch.ops.tilegemm.grouped_mm, grouped_mm_gated, grouped_w4a16)
check their arguments as the public functions check theirs, by the same code: each bad argument refused by name
(the public function refuses it alike), a valid direct call still runs (against float64)."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.activations import torch_activation
from tilegemm.ops.grouped.api import moe_gate_up, moe_gate_up_int4
from tilegemm.ops.grouped.reference import grouped_mm_reference

O = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
r = torch.randn


def _mm_op(a, b, offs=None, bias=None, out_dtype=None, kernel="auto"):
    return torch.ops.tilegemm.grouped_mm(a, b, offs, bias, out_dtype, "default", kernel)


def _mm(a, b, offs=None, bias=None, out_dtype=None, kernel="auto"):
    return tilegemm.grouped_mm(a, b, offs=offs, bias=bias, out_dtype=out_dtype, kernel=kernel)


# (what, the arguments a, b, offs, bias, out_dtype[, kernel], the error, its text)
MM = [
    ("a 1-D", (r(4), r(2, 4, 5), O(2, 8)), ValueError, r"a and b must be 2-D or 3-D, got a \[4\]"),
    ("b 4-D", (r(8, 4), r(1, 2, 4, 5), O(2, 8)), ValueError, "a and b must be 2-D or 3-D"),
    ("K mismatch 2d3d", (r(8, 4), r(2, 5, 5), O(2, 8)), ValueError,
     r"K mismatch: a is \[M, K\] = \[8, 4\], b is \[G, K, N\] = \[2, 5, 5\]"),
    ("K mismatch 3d3d", (r(2, 8, 4), r(2, 5, 5)), ValueError, "K mismatch"),
    ("K mismatch 2d2d", (r(8, 4), r(5, 5), O(2, 4)), ValueError, "K mismatch"),
    ("K mismatch 3d2d", (r(2, 8, 4), r(5, 5), O(2, 5)), ValueError, "K mismatch"),
    ("groups 3d3d", (r(3, 8, 4), r(2, 4, 5)), ValueError, "different numbers of groups"),
    ("offs length 2d3d", (r(8, 4), r(3, 4, 5), O(2, 8)), ValueError,
     r"offs has 2 entries but there are 3 groups \(b.shape\[0\]\)"),
    ("offs length 3d2d", (r(3, 8, 4), r(4, 6), O(2, 6)), ValueError,
     r"offs has 2 entries but there are 3 groups \(a.shape\[0\]\)"),
    ("offs int64", (r(8, 4), r(2, 4, 5), torch.tensor([2, 8])), TypeError, "offs must be int32"),
    ("offs 2-D", (r(8, 4), r(2, 4, 5), O(2, 8)[None]), ValueError, r"offs must be 1-D \[G\]"),
    ("offs missing", (r(8, 4), r(2, 4, 5)), ValueError, "offs is required"),
    ("offs for 3d3d", (r(2, 8, 4), r(2, 4, 5), O(1, 2)), ValueError, "offs must be None"),
    ("offs past the end", (r(8, 4), r(2, 4, 5), O(2, 9)), ValueError, r"offs\[-1\] = 9 is past the end"),
    ("bias shape", (r(8, 4), r(2, 4, 5), O(2, 8), r(4)), ValueError, r"bias must have shape \[5\] or \[2, 5\]"),
    ("bias per group 3d2d", (r(2, 8, 4), r(4, 6), O(2, 6), r(2, 6)), ValueError, r"bias must have shape \[6\], got"),
    ("bias dtype", (r(8, 4), r(2, 4, 5), O(2, 8), r(5).half()), TypeError,
     "bias has dtype fp16; expected the operands' fp32$"),
    ("mixed dtypes", (r(8, 4), r(2, 4, 5).half(), O(2, 8)), TypeError, "a and b must share a dtype"),
    ("int operands", (torch.ones(8, 4, dtype=torch.int32), torch.ones(2, 4, 5, dtype=torch.int32), O(2, 8)),
     TypeError, "a has dtype int32; grouped_mm takes fp16, bf16 or fp32"),
    ("out_dtype", (r(8, 4), r(2, 4, 5), O(2, 8), None, torch.float16), TypeError, "out_dtype must be"),
    ("kernel", (r(8, 4), r(2, 4, 5), O(2, 8), None, None, "nope"), ValueError, "unknown grouped kernel 'nope'"),
]


@pytest.mark.parametrize("args, err, text", [c[1:] for c in MM], ids=[c[0] for c in MM])
@pytest.mark.parametrize("entry", [_mm_op, _mm], ids=["op", "public"])
def test_grouped_mm_refuses_by_name(entry, args, err, text):
    with pytest.raises(err, match=text):
        entry(*args)


def _gated_op(x, w, offs, bias=None, activation="silu"):
    return torch.ops.tilegemm.grouped_mm_gated(x, w, offs, bias, activation, "default")


def _gated(x, w, offs, bias=None, activation="silu"):
    return moe_gate_up(x, w, offs, bias, activation)


GATED = [
    ("odd columns", (r(8, 4), r(2, 4, 5), O(2, 8)), ValueError, r"w \[E, K, 2I\] \(an even number of columns\)"),
    ("3-D x", (r(2, 8, 4), r(2, 4, 6), O(2, 8)), ValueError, r"moe_gate_up takes x \[M, K\]"),
    ("2-D w", (r(8, 4), r(4, 6), O(2, 8)), ValueError, r"moe_gate_up takes x \[M, K\] and w \[E, K, 2I\]"),
    ("K mismatch", (r(8, 4), r(2, 5, 6), O(2, 8)), ValueError, "K mismatch"),
    ("offs length", (r(8, 4), r(3, 4, 6), O(2, 8)), ValueError, "offs has 2 entries but there are 3 groups"),
    ("offs int64", (r(8, 4), r(2, 4, 6), torch.tensor([2, 8])), TypeError, "offs must be int32"),
    ("bias shape", (r(8, 4), r(2, 4, 6), O(2, 8), r(2, 3)), ValueError, r"bias must have shape \[6\] or \[2, 6\]"),
    ("bias dtype", (r(8, 4).half(), r(2, 4, 6).half(), O(2, 8), r(6)), TypeError,
     "bias has dtype fp32; expected the operands' fp16$"),
    ("activation", (r(8, 4), r(2, 4, 6), O(2, 8), None, "tanhh"), ValueError, "unknown activation 'tanhh'"),
]


@pytest.mark.parametrize("args, err, text", [c[1:] for c in GATED], ids=[c[0] for c in GATED])
@pytest.mark.parametrize("entry", [_gated_op, _gated], ids=["op", "public"])
def test_gated_product_refuses_by_name(entry, args, err, text):
    with pytest.raises(err, match=text):
        entry(*args)


E, N, K, GK = 3, 16, 64, 32


def _experts(gated=False, dtype=torch.float16):
    return tilegemm.w4a16.quantize(torch.randn(E, 2 * N if gated else N, K).to(dtype), GK)


def _int4_op(w_, x_, offs_, bias=None, activation="none", gated=False, kernel="auto", **change):
    """The op on the parts of w_, x_ and offs_, in its schema's order, with ``change`` made (any argument)."""
    args = dict(x=x_, qweight=w_.qweight, scales=w_.scales, zeros=w_.zeros, offs=offs_, bias=bias, group_k=w_.group_k,
                activation=activation, gated=gated, kernel=kernel, fweight=None, fzs=None)
    args.update(change)
    return torch.ops.tilegemm.grouped_w4a16(*args.values())


x16 = torch.randn(10, K).half()
o3 = O(2, 6, 10)
INT4 = [
    ("qweight 2-D", dict(qweight=lambda w: w.qweight[0]), ValueError,
     r"qweight must be int32 \[E, K/8, N\], got shape \[8, 16\]"),
    ("qweight dtype", dict(qweight=lambda w: w.qweight.float()), TypeError, "qweight must be int32"),
    ("scales shape", dict(scales=lambda w: w.scales[:, :1]), ValueError,
     r"scales must be \[3, 2, 16\] \(\[G, N\]\), got \[3, 1, 16\]"),
    ("zeros experts", dict(zeros=lambda w: w.zeros[:2]), ValueError, r"zeros must be \[3, 2, 16\]"),
    ("zeros dtype", dict(zeros=lambda w: w.zeros.bfloat16()), TypeError, "must share a dtype"),
    ("group_k", dict(group_k=lambda w: 48), ValueError, "group_k must be K = 64 .one group. or a group size"),
    ("group_k against scales", dict(group_k=lambda w: 64), ValueError, r"scales must be \[3, 1, 16\]"),
    ("x K", dict(x=lambda w: x16[:, :32]), ValueError, r"x must be \[M, K\] with K = 64"),
    ("x dtype", dict(x=lambda w: x16.float()), TypeError, "x has dtype fp32; grouped_matmul takes fp16 or bf16"),
    ("x of the other 16-bit dtype", dict(x=lambda w: x16.bfloat16()), TypeError, "scales are fp16"),
    ("offs length", dict(offs=lambda w: o3[:2]), ValueError, "offs has 2 entries but there are 3 groups"),
    ("offs int64", dict(offs=lambda w: o3.long()), TypeError, "offs must be int32"),
    ("offs past x's rows", dict(offs=lambda w: O(2, 6, 11)), ValueError, r"offs\[-1\] = 11 is past the end"),
    ("bias shape", dict(bias=lambda w: torch.randn(3).half()), ValueError, r"bias must have shape \[16\] or"),
    ("bias dtype", dict(bias=lambda w: torch.randn(16)), TypeError, "bias has dtype fp32; expected x's dtype"),
    ("activation", dict(activation=lambda w: "tanhh"), ValueError, "unknown activation"),
    ("kernel", dict(kernel=lambda w: "nope"), ValueError, "unknown grouped_w4a16 kernel 'nope'"),
    ("fweight alone", dict(fweight=lambda w: torch.zeros(1, dtype=torch.int32)), TypeError,
     "fweight and fzs go together"),
    ("fragments' shapes", dict(fweight=lambda w: torch.zeros(1, dtype=torch.int32),
                               fzs=lambda w: torch.zeros(1).half()), ValueError, "frag's fweight must be"),
]


@pytest.mark.parametrize("change, err, text", [c[1:] for c in INT4], ids=[c[0] for c in INT4])
def test_int4_op_refuses_by_name(change, err, text):
    w = _experts()
    with pytest.raises(err, match=text):
        _int4_op(w, x16, o3, **{k: f(w) for k, f in change.items()})


def test_int4_gated_op_refuses_an_odd_number_of_rows():
    w = tilegemm.w4a16.quantize(torch.randn(E, 15, K).half(), GK)
    with pytest.raises(ValueError, match="a gated product needs an even number of weight rows"):
        _int4_op(w, x16, o3, gated=True)
    with pytest.raises(ValueError, match="a gated product needs an even number of weight rows"):
        moe_gate_up_int4(x16, w, o3)


def test_the_op_bodies_refuse_two_devices():
    # (a call with a meta tensor goes to the op's fake: the check that the op's body makes, called here)
    from tilegemm.ops.grouped.checks import check_gated_call, check_int4_op_args, check_mm_call

    meta = torch.randn(2, 4, 6, device="meta")
    with pytest.raises(ValueError, match="different devices: a on cpu, b on meta"):
        check_mm_call(r(8, 4), meta, O(2, 8), None, None, "auto")
    with pytest.raises(ValueError, match="different devices: a on cpu, b on meta"):
        check_gated_call(r(8, 4), meta, O(2, 8), None, "silu")
    w = _experts()
    with pytest.raises(ValueError, match="different devices: x on cpu, w on meta"):
        check_int4_op_args(x16, w.qweight.to("meta"), w.scales.to("meta"), w.zeros.to("meta"), o3, None, w.group_k,
                           "none", False, "auto")


# --- valid direct calls, against float64 ----------------------------------------------------------------------


def _close(out, ref, bound=1e-3):
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max() <= bound * (1 + ref.abs().max()), (out.double() - ref).abs().max()


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_valid_grouped_mm_op_call_equals_float64(layout, device):
    shapes = {"2d3d": ((9, 8), (3, 8, 5)), "3d3d": ((3, 4, 8), (3, 8, 5)), "2d2d": ((6, 9), (9, 5)),
              "3d2d": ((3, 4, 8), (8, 7))}[layout]
    a, b = (torch.randn(*s, dtype=torch.float64).float().to(device) for s in shapes)
    offs = {"2d3d": O(2, 2, 9), "3d3d": None, "2d2d": O(4, 9, 9), "3d2d": O(3, 3, 7)}[layout]
    offs = None if offs is None else offs.to(device)
    bias = torch.randn(5 if layout != "3d2d" else 7, device=device)
    out = _mm_op(a, b, offs, bias)
    ref = grouped_mm_reference(a.double(), b.double(), offs, bias=bias.double())
    _close(out, ref)
    _close(_mm(a, b, offs, bias), ref)  # the public function alike


def test_valid_gated_op_call_equals_float64(device):
    x, w = torch.randn(9, 8, device=device), torch.randn(3, 8, 10, device=device)
    offs, bias = O(2, 5, 9).to(device), torch.randn(3, 10, device=device)
    out = _gated_op(x, w, offs, bias, "silu")
    pre = grouped_mm_reference(x.double(), w.double(), offs, bias=bias.double())
    _close(out, torch_activation(pre[:, :5], "silu") * pre[:, 5:])


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_valid_int4_op_call_equals_float64(gated, device):
    w = _experts(gated).to(device)
    x, offs = torch.randn(10, K, device=device).half(), o3.to(device)
    rows = w.shape[1]
    bias = torch.randn(E, rows, device=device).half()
    out = _int4_op(w, x, offs, bias, "gelu" if not gated else "silu", gated)
    pre = grouped_mm_reference(x.double(), tilegemm.w4a16.dequantize(w).double().transpose(1, 2), offs,
                               bias=bias.double())
    ref = torch_activation(pre, "gelu") if not gated else torch_activation(pre[:, :N], "silu") * pre[:, N:]
    _close(out, ref, 2e-2)
