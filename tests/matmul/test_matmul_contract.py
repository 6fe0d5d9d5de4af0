"""``tilegemm.matmul`` behaves like torch where torch defines the behaviour, else raises a clear TypeError/ValueError:
the cases a new user met (beta = 0 with a non-finite c, meta tensors, 1-D operands), then a property test that
draws inputs, valid and invalid, and allows nothing but "equal to the reference" or a clear error."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from conftest import CLEAR, HERE, rel_err_of_sums
from tilegemm.ops.matmul.reference import matmul_reference, relative_error, tolerance



pytestmark = pytest.mark.usefixtures("tensors_here")  # inputs made where the kernels run


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_beta_zero_ignores_c_like_addmm(fill):
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    c = torch.full((5, 3), fill)
    out = tilegemm.matmul(a, b, c=c, beta=0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.addmm(c, a, b, beta=0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_alpha_zero_reads_neither_operand(fill, dtype):
    # as BLAS (and torch.addmm in fp32): alpha = 0 leaves activation(beta * c + bias), whatever a and b hold;
    # the operands' gradients are zero, and the shapes are still checked
    a, b = torch.randn(5, 7, dtype=dtype), torch.randn(7, 3, dtype=dtype)
    a[0, 0], b[1, 2] = fill, fill
    c, bias = torch.randn(5, 3, dtype=dtype), torch.randn(3, dtype=dtype)
    a.requires_grad_(True)
    out = tilegemm.matmul(a, b, c=c, bias=bias, alpha=0, beta=0.5, activation="silu")
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(0.5 * c.float() + bias.float()),
                               rtol=1e-3, atol=1e-3)
    out.sum().backward()
    assert a.grad.shape == a.shape and not a.grad.any()
    with pytest.raises(ValueError):
        tilegemm.matmul(a, torch.randn(6, 3, dtype=dtype), alpha=0)
    # the registered op called directly, and a kernel named (one that may refuse a product of no inputs)
    with torch.no_grad():
        out = torch.ops.tilegemm.matmul(a, b, bias, c, 0.0, 0.5, "silu", None, "default", "split_k")
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(0.5 * c.float() + bias.float()),
                               rtol=1e-3, atol=1e-3)


def test_beta_zero_still_checks_c():
    with pytest.raises(ValueError, match="broadcast"):
        tilegemm.matmul(torch.randn(5, 7), torch.randn(7, 3), c=torch.randn(4, 3), beta=0)


@pytest.mark.parametrize("a_shape,b_shape", [((8,), (8, 3)), ((4, 8), (8,)), ((8,), (8,)), ((2, 4, 8), (8,)),
                                             ((8,), (2, 8, 3))])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_dimensional_operands_like_torch_matmul(a_shape, b_shape, with_bias):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    bias = torch.randn(b_shape[-1] if len(b_shape) > 1 else 1) if with_bias else None
    out = tilegemm.matmul(a, b, bias=bias)
    ref = torch.matmul(a.double(), b.double())
    if with_bias:  # torch's broadcast: a scalar product plus a [1] bias is [1]
        ref = ref + bias.double()
    assert out.shape == ref.shape
    assert relative_error(out, ref) <= tolerance(torch.float32)


def test_zero_dimensional_operands_are_refused():
    with pytest.raises(ValueError, match="at least 1 dim"):
        tilegemm.matmul(torch.tensor(2.0), torch.randn(3))


@pytest.mark.parametrize("a_shape,b_shape", [((4, 8), (8, 3)), ((2, 4, 8), (8, 3)), ((8,), (8, 3)), ((0, 8), (8, 3))])
def test_meta_tensors_give_an_empty_meta_result(a_shape, b_shape):
    a = torch.empty(a_shape, device="meta", dtype=torch.float16)
    b = torch.empty(b_shape, device="meta", dtype=torch.float16)
    out = tilegemm.matmul(a, b, bias=torch.empty(3, device="meta", dtype=torch.float16), activation="relu",
                          out_dtype=torch.float32)
    ref = torch.matmul(a, b)
    assert out.device.type == "meta" and out.shape == ref.shape and out.dtype == torch.float32


def test_meta_tensors_still_get_checked():
    with pytest.raises(ValueError, match="inner dimensions"):
        tilegemm.matmul(torch.empty(4, 8, device="meta"), torch.empty(7, 3, device="meta"))


@pytest.mark.parametrize("M,N,K", [(0, 0, 0), (2, 0, 3), (0, 4, 3), (2, 4, 0)])
def test_gradients_of_an_empty_product_like_torch(M, N, K):
    a, b, bias = torch.randn(M, K, requires_grad=True), torch.randn(K, N, requires_grad=True), torch.randn(N,
                                                                                                      requires_grad=True)
    tilegemm.matmul(a, b, bias=bias).sum().backward()
    ra, rb, rbias = (t.detach().clone().requires_grad_() for t in (a, b, bias))
    torch.addmm(rbias, ra, rb).sum().backward()
    for ours, theirs in ((a, ra), (b, rb), (bias, rbias)):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_interpreter_overflow_warnings_stay_inside():
    # silu of a large negative value overflows exp under the interpreter's numpy: not the user's business.
    a = torch.full((4, 16), -100.0)
    b = torch.ones(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = tilegemm.matmul(a, b, activation="silu")
    assert torch.isfinite(out).all()


# --- the property: equal to torch's result, or a clear error ------------------------------------------------

SIZES = st.sampled_from([0, 1, 2, 5, 17])
DTYPES = st.sampled_from([torch.float16, torch.float32, torch.float32, torch.float64, torch.int32])


@st.composite
def calls(draw):
    M, N, K = draw(SIZES), draw(SIZES), draw(SIZES)
    kind = draw(st.sampled_from(["2d", "2d", "batched", "a1d", "b1d"]))
    return dict(
        M=M, N=N, K=K, kind=kind, dtype=draw(DTYPES), b_dtype_same=draw(st.integers(0, 7)) > 0,
        a_t=draw(st.booleans()), b_t=draw(st.booleans()), device=draw(st.sampled_from([HERE, HERE, "meta"])),
        bias=draw(st.sampled_from([None, "ok", "wrong"])), c=draw(st.sampled_from([None, "ok", "wrong", "nan"])),
        alpha=draw(st.sampled_from([1.0, 0.5, 2, "x", True])), beta=draw(st.sampled_from([1.0, 0.0, 0, -1.5])),
        activation=draw(st.sampled_from([None, "relu", "gelu", "silu", "tanh", 3])),
        out_dtype=draw(st.sampled_from([None, None, torch.float32, torch.float16, torch.int8])),
        kernel=draw(st.sampled_from(["auto", "auto", "grouped", "nope"])),
    )


def _operand(rows, cols, transposed, dtype, device, lead=()):
    t = torch.randn(*lead, cols, rows).mT if transposed else torch.randn(*lead, rows, cols)
    return t.to(device=device, dtype=dtype)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(p=calls())
def test_matmul_equals_torch_or_raises_clearly(p):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    M, N, K, dtype, device = p["M"], p["N"], p["K"], p["dtype"], p["device"]
    b_dtype = dtype if p["b_dtype_same"] else torch.float16 if dtype != torch.float16 else torch.float32
    lead = (2,) if p["kind"] == "batched" else ()
    a = _operand(M, K, p["a_t"], dtype, device, lead)
    b = _operand(K, N, p["b_t"], b_dtype, device)
    if p["kind"] == "a1d":
        a = a[..., 0, :] if M else torch.randn(K).to(device=device, dtype=dtype)
    if p["kind"] == "b1d":
        b = b[..., 0] if N else torch.randn(K).to(device=device, dtype=b_dtype)
    ref_shape = torch.matmul(a.to("meta"), b.to("meta", a.dtype)).shape
    epi = torch.float16 if dtype == torch.float16 else torch.float32
    n_out = ref_shape[-1] if p["kind"] != "b1d" and len(ref_shape) else 1
    bias = None if p["bias"] is None else torch.randn(n_out + (p["bias"] == "wrong")).to(device=device, dtype=epi)
    c = None
    if p["c"] is not None:
        c = torch.randn(*ref_shape[:-1], ref_shape[-1] + 1) if p["c"] == "wrong" and len(ref_shape) else \
            torch.full(ref_shape, float("nan")) if p["c"] == "nan" else torch.randn(ref_shape)
        c = c.to(device=device, dtype=epi)
    kw = dict(bias=bias, c=c, alpha=p["alpha"], beta=p["beta"], activation=p["activation"], out_dtype=p["out_dtype"],
              kernel=p["kernel"])
    valid = (dtype in (torch.float16, torch.float32) and b_dtype == dtype and p["bias"] != "wrong"
             and p["c"] != "wrong" and not isinstance(p["alpha"], (str, bool)) and p["activation"] != "tanh"
             and p["activation"] != 3 and p["out_dtype"] != torch.int8 and p["kernel"] != "nope"
             and not (p["c"] == "nan" and p["beta"] != 0))
    try:
        with torch.no_grad():
            out = tilegemm.matmul(a, b, **kw)
    except CLEAR:
        assert not valid or p["kernel"] == "grouped", f"a valid call was refused: {p}"
        return
    assert not (p["kernel"] == "nope" or p["activation"] in ("tanh", 3) or p["out_dtype"] == torch.int8), \
        f"an invalid option was accepted: {p}"
    out_dtype = p["out_dtype"] or dtype
    assert out.shape == ref_shape and out.dtype == out_dtype and out.device.type == device
    if device == "meta" or p["c"] == "nan" and p["beta"] != 0:
        return
    ref = matmul_reference(a, b, bias=bias, c=c if p["beta"] != 0 else None, alpha=float(p["alpha"]),
                           beta=float(p["beta"]), activation=p["activation"])
    terms = matmul_reference(a.abs(), b.abs(), bias=None if bias is None else bias.abs(),
                             c=c.abs() if c is not None and p["beta"] != 0 else None, alpha=abs(float(p["alpha"])),
                             beta=abs(float(p["beta"])))
    assert rel_err_of_sums(out, ref, terms, K) <= tolerance(dtype, "ieee", out_dtype), p


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(M=SIZES, N=SIZES, K=SIZES, lead=st.sampled_from([(), (2,)]), a_t=st.booleans(), b_t=st.booleans(),
       bias=st.booleans(), c=st.sampled_from([None, "full", "row", "scalar"]), beta=st.sampled_from([1.0, 0.5, 0.0]),
       alpha=st.sampled_from([1.0, -2.0]), activation=st.sampled_from([None, "relu", "gelu_tanh", "silu", "leaky_relu"]),
       precision=st.sampled_from([None, "ieee", "tf32", "highest", "double"]))
def test_matmul_gradients_equal_torch_or_raise_clearly(M, N, K, lead, a_t, b_t, bias, c, beta, alpha, activation,
                                                       precision):
    torch.manual_seed(0)
    a = _operand(M, K, a_t, torch.float32, HERE, lead).requires_grad_()
    b = _operand(K, N, b_t, torch.float32, HERE).requires_grad_()
    bias_t = torch.randn(N, requires_grad=True) if bias else None
    c_t = {None: None, "full": torch.randn(*lead, M, N), "row": torch.randn(N), "scalar": torch.randn(())}[c]
    if c_t is not None:
        c_t.requires_grad_()
    try:
        out = tilegemm.matmul(a, b, bias=bias_t, c=c_t, alpha=alpha, beta=beta, activation=activation,
                              precision=precision)
    except CLEAR:
        assert precision == "double", "a valid call was refused"
        return
    assert precision != "double"
    ref = matmul_reference(a, b, bias=bias_t, c=c_t if beta != 0 else None, alpha=alpha, beta=beta,
                           activation=activation)
    grad = torch.randn(out.shape)
    tensors = [t for t in (a, b, bias_t, c_t) if t is not None]
    ours = torch.autograd.grad(out, tensors, grad, allow_unused=True)
    theirs = torch.autograd.grad(ref, tensors, grad.double(), allow_unused=True)
    bound = 1e-2 if precision == "tf32" else 1e-4
    for name, g, r in zip("a b bias c".split(), ours, theirs):
        if r is None or beta == 0 and name == "c":
            continue
        assert g is not None and g.shape == r.shape and g.dtype == torch.float32, name
        assert relative_error(g, r) <= bound or (g - r).abs().max() <= bound * (1 + r.abs().max()), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_casts_like_torch_matmul(dtype):
    # as torch.matmul / F.linear under autocast: the product in the autocast dtype, operands of two float dtypes
    # taken, gradients in each input's own dtype
    device = HERE
    a = torch.randn(2, 5, 8, device=device, requires_grad=True)
    b = torch.randn(8, 3, device=device, dtype=torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)
    bias, c = torch.randn(3, device=device, requires_grad=True), torch.randn(5, 1, device=device)
    with torch.autocast(device, dtype=dtype):
        out = tilegemm.matmul(a, b, bias=bias, c=c, activation="relu")
        ref = torch.relu(torch.matmul(a.double(), b.double()) + c.double() + bias.double())
        assert out.dtype == dtype == torch.matmul(a, b).dtype
        assert tilegemm.matmul(a, b, out_dtype=torch.float32).dtype == torch.float32
        assert tilegemm.matmul(a[0, 0], b).dtype == dtype  # 1-D: the same casts
    assert relative_error(out, ref) <= tolerance(dtype)
    out.float().sum().backward()
    assert a.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32 and a.grad.shape == a.shape
    with torch.autocast(device, dtype=dtype):
        with pytest.raises(TypeError, match="unsupported dtype float64"):  # autocast leaves float64: refused
            tilegemm.matmul(a.double(), b)
        a8 = torch.randn(5, 8, device=device).to(torch.float8_e4m3fn)
        assert tilegemm.matmul(a8, a8.mT, out_dtype=torch.float32).dtype == torch.float32  # fp8: not cast
    with torch.autocast(device, dtype=dtype, enabled=False):
        assert tilegemm.matmul(a.detach(), b.float()).dtype == torch.float32
