"""``tilegemm.w4a16.quantize`` and ``matmul`` give the dequantized weight's product or a clear TypeError/ValueError:
empty K, meta tensors, then a property test over sizes, group sizes, dtypes, layouts, devices and options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilegemm import w4a16
from conftest import CLEAR, HERE, rel_err_of_sums
from tilegemm.core.activations import torch_activation



pytestmark = pytest.mark.usefixtures("tensors_here")  # inputs made where the kernels run


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_no_inputs_quantize_and_multiply_to_the_bias(group_size):
    w = w4a16.quantize(torch.randn(5, 0), group_size)
    assert w.shape == (5, 0) and w4a16.dequantize(w).shape == (5, 0)
    bias = torch.randn(5).half()
    out = w4a16.matmul(torch.randn(3, 0).half(), w, bias=bias, activation="relu")
    torch.testing.assert_close(out, torch.relu(bias).expand(3, 5))


def test_meta_tensors_give_an_empty_meta_result():
    w = w4a16.quantize(torch.empty(16, 128, device="meta"))
    assert w.device.type == "meta"
    out = w4a16.matmul(torch.empty(2, 3, 128, device="meta", dtype=torch.float16), w, activation="silu")
    assert out.device.type == "meta" and out.shape == (2, 3, 16) and out.dtype == torch.float16


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(n=st.sampled_from([1, 8, 17]), k=st.sampled_from([0, 8, 32, 64, 96, 128]),
       group_size=st.sampled_from([32, 64, 128, -1, -1, 48, 0]), lead=st.sampled_from([(), (1,), (3,), (2, 2), (0,)]),
       w_dtype=st.sampled_from([torch.float16, torch.float32, torch.float32, torch.float64]),
       x_dtype=st.sampled_from([torch.float16, torch.float16, torch.float32]), symmetric=st.booleans(),
       bias=st.sampled_from([None, "ok", "wrong"]), activation=st.sampled_from([None, "relu", "gelu", "tanh"]),
       transposed=st.booleans(), kernel=st.sampled_from(["auto", "auto", "gemv", "mma", "nope"]),
       device=st.sampled_from([HERE, HERE, "meta"]))
def test_w4a16_equals_the_dequantized_product_or_raises_clearly(n, k, group_size, lead, w_dtype, x_dtype, symmetric,
                                                                 bias, activation, transposed, kernel, device):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    weight = torch.randn(n, k, dtype=w_dtype, device=device)
    try:
        w = w4a16.quantize(weight, group_size, symmetric)
    except CLEAR:
        assert w_dtype == torch.float64 or group_size in (48, 0) or k % 8 or group_size != -1 and k % group_size, \
            "a weight quantize takes was refused"
        return
    assert w_dtype != torch.float64 and group_size not in (48, 0)
    x = torch.randn(*lead, k, dtype=x_dtype)
    if transposed and len(lead) == 1:
        x = torch.randn(k, *lead, dtype=x_dtype).mT
    x = x.to(device)
    scales = w.dtype
    b = None if bias is None else torch.randn(n + (bias == "wrong"), dtype=scales, device=device)
    try:
        out = w4a16.matmul(x, w, bias=b, activation=activation, kernel=kernel)
    except CLEAR:
        assert x_dtype != scales or bias == "wrong" or activation == "tanh" or kernel == "nope", \
            "a valid call was refused"
        return
    assert x_dtype == scales and bias != "wrong" and activation != "tanh" and kernel != "nope"
    assert out.shape == (*lead, n) and out.dtype == x_dtype and out.device.type == device
    if device != "meta":
        wt = w4a16.dequantize(w).double().T
        ref = x.double() @ wt + (0 if b is None else b.double())
        terms = x.double().abs() @ wt.abs() + (0 if b is None else b.double().abs())
        assert rel_err_of_sums(out, torch_activation(ref, activation or "none"), terms, k) <= 4e-3


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(n=st.sampled_from([1, 8]), k=st.sampled_from([0, 32, 64]), group_size=st.sampled_from([32, -1]),
       lead=st.sampled_from([(1,), (3,), (2, 2), (0,)]), bias=st.booleans(),
       activation=st.sampled_from([None, "relu", "silu"]))
def test_w4a16_gradients_equal_the_dequantized_products(n, k, group_size, lead, bias, activation):
    torch.manual_seed(0)
    w = w4a16.quantize(torch.randn(n, k), group_size)
    x = torch.randn(*lead, k, dtype=torch.float16, requires_grad=True)
    b = torch.randn(n, dtype=torch.float16, requires_grad=True) if bias else None
    out = w4a16.matmul(x, w, bias=b, activation=activation)
    wt = w4a16.dequantize(w).double().T
    xd = x.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    ref = torch_activation(xd @ wt + (0 if bd is None else bd), activation or "none")
    grad = torch.randn(out.shape, dtype=torch.float16)
    ours = torch.autograd.grad(out, [t for t in (x, b) if t is not None], grad)
    theirs = torch.autograd.grad(ref, [t for t in (xd, bd) if t is not None], grad.double())
    for g, r in zip(ours, theirs):
        assert g.shape == r.shape and g.dtype == torch.float16
        terms = grad.double().abs() @ wt.abs().T if g.shape == x.shape else grad.double().abs().sum(
            tuple(range(grad.ndim - 1)))
        assert rel_err_of_sums(g, r, terms, max(n, 1)) <= 1e-2


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "leaky_relu"])
def test_sums_past_the_16_bit_range_take_the_activation_of_the_sum(activation):
    # a row whose sum passes fp16's range (-30 * 60 * 64 = -115200): the activation of the fp32 sum (silu and gelu
    # about -0, leaky_relu -1152), on every kernel, whatever the batch; and the gradients are those of the sum
    # (0 through silu and gelu, not NaN): the backward recomputes the sum in fp16, where it reads -inf
    from tilegemm.ops.w4a16.format import dequantize

    K, N = 64, 16
    w = w4a16.quantize(torch.full((N, K), 60.0, dtype=torch.float16, device=HERE), group_size=32)
    x = torch.full((3, K), -30.0, dtype=torch.float16, device=HERE)
    x[1] = 0.01
    want = torch_activation(x.double() @ dequantize(w).double().T, activation)
    for kernel in ("auto", "mma", "dequant_cublas"):
        got = w4a16.matmul(x, w, activation=activation, kernel=kernel)
        assert not got.isnan().any(), kernel
        assert torch.allclose(got.double(), want.to(got.dtype).double(), rtol=1e-2, atol=1e-3), kernel
    xt = x.clone().requires_grad_()
    bias = torch.zeros(N, dtype=torch.float16, device=HERE, requires_grad=True)
    w4a16.matmul(xt, w, bias=bias, activation=activation).sum().backward()
    xr = x.double().requires_grad_()
    br = torch.zeros(N, dtype=torch.float64, device=HERE, requires_grad=True)
    torch_activation(xr @ dequantize(w).double().T + br, activation).sum().backward()
    assert not xt.grad.isnan().any() and not bias.grad.isnan().any()
    assert torch.allclose(xt.grad.double(), xr.grad, rtol=1e-2, atol=1e-2)
    assert torch.allclose(bias.grad.double(), br.grad, rtol=1e-2, atol=1e-2)
