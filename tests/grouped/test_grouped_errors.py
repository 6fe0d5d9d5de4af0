"""Bad input to tilegemm.grouped_mm gets a TypeError/ValueError naming the problem."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped.api import batched_matmul, moe_gate_up, moe_gate_up_int4

O = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


class _Tagged(torch.Tensor):
    pass


def call(a, b, **kw):
    return tilegemm.grouped_mm(a, b, **kw)


# CPU tensors: each of these is refused before the device check, so a GPU machine (which refuses CPU tensors)
# names the same problem; offs' values are checked only on CPU tensors
CASES = [
    ("offs wrong length", lambda: call(torch.randn(8, 4), torch.randn(3, 4, 5), offs=O(2, 8)), ValueError,
     "offs has 2 entries but there are 3 groups"),
    ("offs int64", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=torch.tensor([2, 8])), TypeError,
     "offs must be int32"),
    ("offs 2-D", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 8)[None]), ValueError,
     "offs must be 1-D"),
    ("offs not a tensor", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=[2, 8]), TypeError,
     "offs must be a torch.Tensor"),
    ("offs decreasing", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(5, 2)), ValueError,
     "non-decreasing"),
    # a subclass that overrides nothing holds values to read, as torch's own tensor
    ("offs of a plain subclass decreasing", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5),
                                                         offs=O(5, 2).as_subclass(_Tagged)), ValueError,
     "non-decreasing"),
    ("offs past the end", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 9)), ValueError,
     "past the end"),
    # the dimension offs runs past is named with its own size (it read "(a.shape[0]; ... = 5)" for b's columns)
    ("offs past a's rows", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 9)), ValueError,
     r"offs\[-1\] = 9 is past the end of the grouped dimension, a's rows: a\.shape\[0\] = 8"),
    ("offs past K", lambda: call(torch.randn(8, 4), torch.randn(4, 5), offs=O(2, 6)), ValueError,
     r"past the end of the grouped dimension, K: a\.shape\[1\] = 4"),
    ("offs past b's columns", lambda: call(torch.randn(2, 8, 4), torch.randn(4, 5), offs=O(2, 6)), ValueError,
     r"past the end of the grouped dimension, b's columns: b\.shape\[1\] = 5"),
    ("offs negative", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(-1, 3)), ValueError,
     "negative"),
    ("missing offs 2d3d", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5)), ValueError, "offs is required"),
    ("missing offs 2d2d", lambda: call(torch.randn(8, 4), torch.randn(4, 5)), ValueError, "offs is required"),
    ("offs for 3d3d", lambda: call(torch.randn(2, 8, 4), torch.randn(2, 4, 5), offs=O(1, 2)), ValueError,
     "offs must be None"),
    ("K mismatch 2d3d", lambda: call(torch.randn(8, 4), torch.randn(2, 5, 5), offs=O(2, 8)), ValueError,
     "K mismatch"),
    ("K mismatch 3d3d", lambda: call(torch.randn(2, 8, 4), torch.randn(2, 5, 5)), ValueError, "K mismatch"),
    ("K mismatch 2d2d", lambda: call(torch.randn(8, 4), torch.randn(5, 5), offs=O(2, 4)), ValueError, "K mismatch"),
    ("K mismatch 3d2d", lambda: call(torch.randn(2, 8, 4), torch.randn(5, 5), offs=O(2, 5)), ValueError,
     "K mismatch"),
    ("batch mismatch", lambda: call(torch.randn(3, 8, 4), torch.randn(2, 4, 5)), ValueError,
     "different numbers of groups"),
    ("mixed dtypes", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5).half(), offs=O(2, 8)), TypeError,
     "must share a dtype"),
    ("int operands", lambda: call(torch.ones(8, 4, dtype=torch.int32), torch.ones(2, 4, 5, dtype=torch.int32),
                                  offs=O(2, 8)), TypeError, "fp16, bf16 or fp32"),
    ("1-D a", lambda: call(torch.randn(4), torch.randn(2, 4, 5), offs=O(2, 8)), ValueError, "2-D or 3-D"),
    ("a not a tensor", lambda: call([[1.0]], torch.randn(2, 4, 5), offs=O(2, 8)), TypeError,
     "a must be a torch.Tensor"),
    ("bias shape", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 8), bias=torch.randn(4)),
     ValueError, "bias must have shape"),
    ("bias per group for 3d2d", lambda: call(torch.randn(2, 8, 4), torch.randn(4, 6), offs=O(2, 6),
                                             bias=torch.randn(2, 6)), ValueError, "bias must have shape"),
    ("bias dtype", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 8),
                                bias=torch.randn(5).half()), TypeError, "bias has dtype"),
    ("bias dtype fp16 of fp32", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 8),
                                             bias=torch.randn(2, 5).half()), TypeError,
     r"bias has dtype fp16; expected the operands' fp32$"),
    ("bias dtype bf16 of fp16", lambda: call(torch.randn(8, 4).half(), torch.randn(2, 4, 5).half(), offs=O(2, 8),
                                             bias=torch.randn(5).bfloat16()), TypeError,
     r"bias has dtype bf16; expected the operands' fp16$"),
    ("bias dtype, gated", lambda: moe_gate_up(
        torch.randn(8, 4).half(), torch.randn(2, 4, 6).half(), O(2, 8), bias=torch.randn(6)), TypeError,
     r"bias has dtype fp32; expected the operands' fp16$"),
    ("bias dtype with fp32 out", lambda: call(torch.randn(8, 4).half(), torch.randn(2, 4, 5).half(), offs=O(2, 8),
                                              bias=torch.randn(5).bfloat16(), out_dtype=torch.float32), TypeError,
     "bias has dtype bf16; expected the operands' fp16 or the output's, fp32"),
    # tensors without strides are refused by name (they reached Triton, which cannot read their storage)
    ("sparse a", lambda: call(torch.randn(8, 4).to_sparse(), torch.randn(2, 4, 5), offs=O(2, 8)), TypeError,
     r"a is a tensor of layout torch.sparse_coo; tilegemm takes dense \(strided\) tensors only"),
    ("sparse bias", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 8),
                                 bias=torch.randn(5).to_sparse()), TypeError, "bias is a tensor of layout"),
    ("nested a", lambda: call(torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)]),
                              torch.randn(2, 4, 5), offs=O(3, 8)), TypeError, "a is a nested tensor"),
    ("out_dtype fp16 from fp32", lambda: call(torch.randn(8, 4), torch.randn(2, 4, 5), offs=O(2, 8),
                                              out_dtype=torch.float16), TypeError, "out_dtype"),
]


CASES += [
    # the gated call's and batched_matmul's refusals say whose they are (the shared checks speak of a and b)
    ("gated K mismatch", lambda: moe_gate_up(torch.randn(9, 8), torch.randn(3, 10, 8), O(2, 9)), ValueError,
     r"^moe_gate_up \(x \[M, K\] and w \[E, K, 2I\] as a and b\): K mismatch"),
    ("gated no offs", lambda: moe_gate_up(torch.randn(9, 8), torch.randn(3, 8, 10), None), ValueError,
     r"^moe_gate_up .*offs is required"),
    ("batched float64", lambda: batched_matmul(torch.randn(2, 3, 4).double(), torch.randn(2, 4, 5).double()),
     TypeError, r"^batched_matmul \(a \[B, M, K\] and b \[B, K, N\], on grouped_mm's checks\): a has dtype"),
]


@pytest.mark.parametrize("fn, err, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(fn, err, text):
    with pytest.raises(err, match=text):
        fn()


def test_unknown_kernel_is_named(device):
    # checked after the devices: the operands where kernels run, so on a GPU the kernel's name is what is refused
    a, b, offs = torch.randn(8, 4, device=device), torch.randn(2, 4, 5, device=device), O(2, 8).to(device)
    with pytest.raises(ValueError, match="unknown grouped kernel"):
        call(a, b, offs=offs, kernel="nope")
    for kernel in (None, 1, ["tiled"]):  # a name of the wrong type: a TypeError naming the choices
        with pytest.raises(TypeError, match="grouped kernel must be a str, one of: tiled"):
            call(a, b, offs=offs, kernel=kernel)


def test_devices_must_match():
    meta = torch.randn(8, 4, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        call(meta, torch.randn(2, 4, 5), offs=O(2, 8))


def test_gated_calls_take_no_activation_as_none_on_every_path():
    # activation=None had run as "none" on a plain call and failed in the op's schema where x required grad
    import tilegemm.w4a16 as w4a16

    x, w, offs = torch.randn(9, 8), torch.randn(3, 8, 10), O(2, 2, 7)
    want = moe_gate_up(x, w, offs, None, "none")
    for xx in (x, x.clone().requires_grad_(True)):
        assert torch.equal(moe_gate_up(xx, w, offs, None, None).detach(), want)
    w4 = w4a16.quantize(torch.randn(3, 10, 32).half(), 32)
    xh = torch.randn(9, 32).half()
    want4 = moe_gate_up_int4(xh, w4, offs, None, "none")
    for xx in (xh, xh.clone().requires_grad_(True)):
        assert torch.equal(moe_gate_up_int4(xx, w4, offs, None, None).detach(), want4)
