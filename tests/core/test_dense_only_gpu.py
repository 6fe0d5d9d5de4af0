"""Sparse and nested CUDA tensors through every public op's host fast path: its replay key is computed before
any check, from strides and data pointers such tensors do not have, so the key must give way to the full path's
refusal by name (a sparse ``x`` once reached ``data_ptr()`` in conv2d's key: "Cannot access data pointer of Tensor
that doesn't have storage"). Each op is first called once with dense tensors, so a replay is recorded."""

import pytest
import torch

import tilegemm
from tilegemm import w4a16

pytestmark = pytest.mark.gpu

LAYOUT = r"is a tensor of layout torch.sparse_(coo|csr)"


def _twice(fn, *dense):
    fn(*dense)
    fn(*dense)  # (a replay recorded and taken)


def test_matmul():
    a = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    b = torch.randn(16, 24, device="cuda", dtype=torch.float16)
    bias = torch.randn(24, device="cuda", dtype=torch.float16)
    _twice(lambda: tilegemm.matmul(a, b, bias=bias))
    with pytest.raises(TypeError, match="a " + LAYOUT):
        tilegemm.matmul(a.to_sparse(), b)
    with pytest.raises(TypeError, match="b " + LAYOUT):
        tilegemm.matmul(a, b.to_sparse_csr())
    with pytest.raises(TypeError, match="bias " + LAYOUT):
        tilegemm.matmul(a, b, bias=bias.to_sparse())
    with pytest.raises(TypeError, match="a is a nested tensor"):
        tilegemm.matmul(torch.nested.nested_tensor([a, a[:3]]), b)


def test_linear():
    lin = tilegemm.nn.Linear(16, 24, device="cuda", dtype=torch.float16)
    x = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        _twice(lin, x)
        with pytest.raises(TypeError, match=LAYOUT):
            lin(x.to_sparse())


def test_conv2d():
    x = torch.randn(2, 8, 9, 9, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    w = torch.randn(16, 8, 3, 3, device="cuda", dtype=torch.float16)
    bias = torch.randn(16, device="cuda", dtype=torch.float16)
    _twice(lambda: tilegemm.conv2d(x, w, bias))
    with pytest.raises(TypeError, match="x " + LAYOUT):
        tilegemm.conv2d(x.to_sparse(), w, bias)
    with pytest.raises(TypeError, match="weight " + LAYOUT):
        tilegemm.conv2d(x, w.to_sparse(), bias)
    with pytest.raises(TypeError, match="bias " + LAYOUT):
        tilegemm.conv2d(x, w, bias.to_sparse())


def test_w4a16():
    w = w4a16.quantize(torch.randn(32, 128, device="cuda", dtype=torch.float16), 64)
    x = torch.randn(3, 128, device="cuda", dtype=torch.float16)
    bias = torch.randn(32, device="cuda", dtype=torch.float16)
    _twice(lambda: w4a16.matmul(x, w, bias=bias))
    with pytest.raises(TypeError, match="x " + LAYOUT):
        w4a16.matmul(x.to_sparse(), w, bias=bias)
    with pytest.raises(TypeError, match="bias " + LAYOUT):
        w4a16.matmul(x, w, bias=bias.to_sparse())


def test_grouped():
    a = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 16, 24, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], device="cuda", dtype=torch.int32)
    _twice(lambda: tilegemm.grouped_mm(a, b, offs=offs))
    with pytest.raises(TypeError, match="a " + LAYOUT):
        tilegemm.grouped_mm(a.to_sparse(), b, offs=offs)
    with pytest.raises(TypeError, match="a is a nested tensor"):
        tilegemm.grouped_mm(torch.nested.nested_tensor([a[:3], a[3:]]), b, offs=offs)


def test_grouped_int4():
    w = w4a16.quantize(torch.randn(2, 32, 64, device="cuda", dtype=torch.float16), 32)
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    offs = torch.tensor([3, 8], device="cuda", dtype=torch.int32)
    _twice(lambda: w4a16.grouped_matmul(x, w, offs))
    with pytest.raises(TypeError, match="x " + LAYOUT):
        w4a16.grouped_matmul(x.to_sparse(), w, offs)
