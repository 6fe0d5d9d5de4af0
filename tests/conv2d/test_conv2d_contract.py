"""``tilegemm.conv2d`` behaves like ``F.conv2d`` where torch defines the behaviour, else raises a clear
TypeError/ValueError: unbatched input, meta tensors, then a property test over sizes, options and devices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from conftest import CLEAR, HERE, rel_err_of_sums
from tilegemm.core.activations import torch_activation
from tilegemm.ops.matmul.reference import relative_error



pytestmark = pytest.mark.usefixtures("tensors_here")  # inputs made where the kernels run


def test_unbatched_input_like_f_conv2d():
    x, w, b = torch.randn(4, 6, 5), torch.randn(8, 4, 3, 3), torch.randn(8)
    out = tilegemm.conv2d(x, w, b, padding=1, activation="relu")
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1))
    assert out.shape == ref.shape == (8, 6, 5)
    assert relative_error(out, ref) <= 1e-4


@pytest.mark.parametrize("x_shape", [(2, 3, 7, 7), (3, 7, 7)])
def test_meta_tensors_give_an_empty_meta_result(x_shape):
    x = torch.empty(x_shape, device="meta", dtype=torch.float16)
    w = torch.empty(6, 3, 3, 3, device="meta", dtype=torch.float16)
    out = tilegemm.conv2d(x, w, stride=2, padding=1)
    assert out.device.type == "meta" and out.shape == F.conv2d(x, w, stride=2, padding=1).shape


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(n=st.sampled_from([0, 1, 2]), c=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 2, 4]),
       h=st.sampled_from([1, 2, 5]), w=st.sampled_from([1, 3, 6]), r=st.sampled_from([1, 2, 3]),
       stride=st.sampled_from([1, 1, 2, 0]), padding=st.sampled_from([0, 1, 1, "same", "valid", -1]),
       dilation=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), bias=st.booleans(),
       rank=st.sampled_from([4, 4, 3, 2]), dtype=st.sampled_from([torch.float32] * 4 + [torch.float64]),
       activation=st.sampled_from([None, None, "relu", "silu", "tanh"]), channels_last=st.booleans(),
       device=st.sampled_from([HERE, HERE, "meta"]))
def test_conv2d_equals_torch_or_raises_clearly(n, c, k, h, w, r, stride, padding, dilation, groups, bias, rank, dtype,
                                               activation, channels_last, device):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    x = torch.randn(n, c, h, w, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x = x[0] if rank == 3 and n else x[0, 0] if rank == 2 and n else x
    weight = torch.randn(k, c // groups if c % groups == 0 else c, r, r, dtype=dtype)
    b = torch.randn(k, dtype=dtype) if bias else None
    try:
        ref = F.conv2d(x.double(), weight.double(), None if b is None else b.double(), stride, padding, dilation,
                       groups)
        ref = torch_activation(ref, activation) if activation != "tanh" else ref
        torch_refuses = False
    except RuntimeError:
        torch_refuses = True
    invalid = torch_refuses or dtype == torch.float64 or activation == "tanh"
    args = [t.to(device) if t is not None else None for t in (x, weight, b)]
    try:
        with torch.no_grad():
            out = tilegemm.conv2d(*args, stride=stride, padding=padding, dilation=dilation, groups=groups,
                                  activation=activation)
    except CLEAR:
        assert invalid, "a call torch takes was refused"
        return
    assert not invalid, "a call torch refuses (or an unsupported option) was taken"
    assert out.shape == ref.shape and out.dtype == dtype and out.device.type == device
    if device != "meta":
        terms = F.conv2d(x.double().abs(), weight.double().abs(), None if b is None else b.double().abs(), stride,
                         padding, dilation, groups)
        assert rel_err_of_sums(out, ref, terms, weight[0].numel()) <= 1e-4


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(n=st.sampled_from([1, 2]), c=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 2, 4]), h=st.sampled_from([3, 5]),
       r=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]), padding=st.sampled_from([0, 1]),
       groups=st.sampled_from([1, 2]), bias=st.booleans(), activation=st.sampled_from([None, "relu", "silu"]),
       kernel=st.sampled_from(["auto", "implicit_gemm", "depthwise", "gemm_1x1", "winograd"]),
       precision=st.sampled_from([None, "ieee", "bogus"]))
def test_conv2d_gradients_equal_torch_or_raise_clearly(n, c, k, h, r, stride, padding, groups, bias, activation, kernel,
                                                       precision):
    torch.manual_seed(0)
    if c % groups or k % groups:
        groups = 1
    x = torch.randn(n, c, h, h, requires_grad=True)
    w = torch.randn(k, c // groups, r, r, requires_grad=True)
    b = torch.randn(k, requires_grad=True) if bias else None
    try:
        out = tilegemm.conv2d(x, w, b, stride, padding, 1, groups, activation, precision=precision, kernel=kernel)
    except CLEAR:
        assert kernel in ("winograd", "depthwise", "gemm_1x1") or precision == "bogus", "a valid call was refused"
        return
    assert kernel != "winograd" and precision != "bogus"
    ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, padding, 1, groups)
    ref = torch_activation(ref, activation or "none")
    assert out.shape == ref.shape
    grad = torch.randn(out.shape)
    tensors = [t for t in (x, w, b) if t is not None]
    ours = torch.autograd.grad(out, tensors, grad)
    theirs = torch.autograd.grad(ref, tensors, grad.double())
    for g, t in zip(ours, theirs):
        assert g.shape == t.shape and relative_error(g, t) <= 1e-4


@pytest.mark.parametrize("kwargs", [
    dict(stride=[2], padding=[1], dilation=(1,)),
    dict(stride=(2,), padding=(0,), dilation=[2]),
    dict(stride=1, padding=[2], dilation=(2,)),
])
def test_one_element_lists_expand_like_f_conv2d(kwargs):
    # nn.Conv2d(stride=[2]) keeps (2,): torch expands a one-element list to both dimensions
    x, w, b = torch.randn(1, 4, 9, 8), torch.randn(6, 4, 3, 3), torch.randn(6)
    out = tilegemm.conv2d(x, w, b, **kwargs)
    ref = F.conv2d(x.double(), w.double(), b.double(), **kwargs)
    assert out.shape == ref.shape
    assert relative_error(out, ref) <= 1e-4


@pytest.mark.parametrize("x_shape,padding", [((1, 4, 0, 8), 2), ((1, 4, 8, 0), 1), ((1, 4, 0, 8), 0)])
def test_empty_spatial_input_is_refused_as_torch_refuses_it(x_shape, padding):
    x, w, b = torch.randn(x_shape), torch.randn(6, 4, 3, 3), torch.full((6,), 5.0)
    with pytest.raises(RuntimeError):
        F.conv2d(x, w, b, padding=padding)
    with pytest.raises(ValueError, match="empty spatial dimension"):
        tilegemm.conv2d(x, w, b, padding=padding)


def test_an_empty_batch_may_have_empty_spatial_dimensions_as_in_torch():
    x, w, b = torch.randn(0, 4, 0, 8), torch.randn(6, 4, 3, 3), torch.randn(6)
    ref = F.conv2d(x, w, b, padding=2)
    out = tilegemm.conv2d(x, w, b, padding=2)
    assert out.shape == ref.shape == (0, 6, 2, 10)


@pytest.mark.parametrize("padding", ["SAME", "Valid", "VALID"])
def test_padding_strings_are_lowercase_as_in_torch(padding):
    x, w = torch.randn(1, 4, 6, 6), torch.randn(6, 4, 3, 3)
    with pytest.raises(RuntimeError, match="Invalid padding string"):
        F.conv2d(x, w, padding=padding)
    with pytest.raises(ValueError, match=f"got '{padding}'"):
        tilegemm.conv2d(x, w, padding=padding)
