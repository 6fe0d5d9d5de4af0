"""fp8 inputs with dequantization scales, and the operand orders that keep tf32/fp8 on Hopper's fast path.

Under the interpreter the tf32 dot is exact, so these tests check that every operand order (as loaded, A
through registers, swapped) computes the right product; on the GPU (`pytest -m gpu`) the same tests run
in real tf32 and fp8.
"""

from __future__ import annotations

import re

import pytest
import torch

import tilegemm
from tilegemm.core.dtypes import dtype_name
from tilegemm.ops.matmul.problem import mma_operands
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close, crossed, kernels, mm
from test_matmul import make_operand

RUNGS = kernels("matmul")  # every registered kernel, then "auto"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_operand(rows, cols, transposed, dtype, device, batch=()):
    x = make_operand(rows, cols, transposed, torch.float32, device, batch)
    return (x * 2).to(dtype)


def dequantized_reference(a, b, scale_a=None, scale_b=None, **epilogue):
    a64, b64 = a.double(), b.double()
    if scale_a is not None:
        a64 = a64 * scale_a.double().reshape(-1, 1)  # one scale, or one per row: both broadcast
    if scale_b is not None:
        b64 = b64 * scale_b.double().reshape(1, -1)
    return matmul_reference(a64, b64, **epilogue)


# --- which operand order --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, expected", [("NN", "swap"), ("NT", "ab"), ("TN", "swap"), ("TT", "reg_a")])
@pytest.mark.parametrize("dtype, precision", [(torch.float32, "tf32"), (E4M3, "ieee")])
def test_tf32_and_fp8_operands_go_k_major(layout, expected, dtype, precision):
    a_strides = (0, 1, 64) if layout[0] == "T" else (0, 64, 1)
    b_strides = (0, 1, 64) if layout[1] == "T" else (0, 64, 1)
    assert mma_operands(dtype, precision, a_strides, b_strides) == expected


@pytest.mark.parametrize("dtype, precision", [(torch.float16, "ieee"), (torch.bfloat16, "ieee"),
                                              (torch.float32, "ieee")])
def test_16_bit_and_ieee_operands_stay_as_loaded(dtype, precision):
    assert mma_operands(dtype, precision, (0, 64, 1), (0, 64, 1)) == "ab"


# --- tf32 through every operand order ----------------------------------------------------------------------


@crossed("shape, layout, kernel", [(1, 17, 33), (33, 65, 17), (100, 70, 129)], ["NN", "NT", "TN", "TT"], RUNGS,
         ids=(lambda s: "x".join(map(str, s)),))
def test_tf32_every_layout(kernel, layout, shape, device):
    M, N, K = shape
    a = make_operand(M, K, layout[0] == "T", torch.float32, device)
    b = make_operand(K, N, layout[1] == "T", torch.float32, device)
    out = mm(a, b, kernel=kernel, precision="tf32")
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float32, "tf32"))


@pytest.mark.parametrize("kernel", ["autotuned", "split_k", "persistent_tma"])
def test_tf32_swapped_tiles_keep_the_epilogue(kernel, device):
    a = torch.randn(45, 50, device=device)
    b = torch.randn(50, 37, device=device)  # row-major B: the swapped order
    bias, c = torch.randn(37, device=device), torch.randn(45, 1, device=device)
    kw = dict(bias=bias, c=c, alpha=0.5, beta=2.0, activation="silu")
    out = mm(a, b, kernel=kernel, precision="tf32", **kw)
    assert_rel_close(out, matmul_reference(a, b, **kw), tolerance(torch.float32, "tf32"))


# --- fp8 ---------------------------------------------------------------------------------------------------


@crossed("dtypes, layout, kernel", [(E4M3, E4M3), (E5M2, E5M2), (E5M2, E4M3)], ["NT", "NN", "TN", "TT"], RUNGS,
         ids=(lambda d: "x".join(str(t)[6:].replace("float8_", "").replace("fn", "") for t in dict.fromkeys(d)),))
def test_fp8_every_rung_and_layout(kernel, layout, dtypes, device):
    M, N, K = 37, 45, 70
    a = fp8_operand(M, K, layout[0] == "T", dtypes[0], device)
    b = fp8_operand(K, N, layout[1] == "T", dtypes[1], device)
    scale_a = torch.rand(M, 1, device=device) + 0.5
    scale_b = torch.tensor(0.25, device=device)
    out = mm(a, b, kernel=kernel, scale_a=scale_a, scale_b=scale_b)
    assert out.dtype == torch.bfloat16, "fp8 inputs give bf16 by default"
    assert_rel_close(out, dequantized_reference(a, b, scale_a, scale_b), tolerance(E4M3, out_dtype=torch.bfloat16))


def _scale(kind: str, length: int, device):
    if kind == "none":
        return None
    if kind == "tensor0d":
        return torch.tensor(1.5, device=device)
    if kind == "tensor1":
        return torch.full((1,), 0.75, device=device)
    if kind == "vector":
        return torch.rand(length, device=device) + 0.5
    if kind == "strided":  # a non-contiguous vector: every other element
        return (torch.rand(2 * length, device=device) + 0.5)[::2]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind_a", ["none", "tensor0d", "tensor1", "vector", "strided", "column"])
@pytest.mark.parametrize("kind_b", ["none", "tensor1", "vector", "strided", "row"])
def test_fp8_scale_shapes(kind_a, kind_b, device):
    M, N, K = 19, 23, 40
    a = fp8_operand(M, K, False, E4M3, device)
    b = fp8_operand(K, N, True, E4M3, device)
    scale_a = (torch.rand(M, 1, device=device) + 0.5) if kind_a == "column" else _scale(kind_a, M, device)
    scale_b = (torch.rand(1, N, device=device) + 0.5) if kind_b == "row" else _scale(kind_b, N, device)
    out = tilegemm.matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, kernel="grouped")
    assert_rel_close(out, dequantized_reference(a, b, scale_a, scale_b), tolerance(E4M3, out_dtype=torch.float32))


@pytest.mark.parametrize("kernel", RUNGS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp8_epilogue_and_out_dtypes(kernel, out_dtype, device):
    M, N, K = 33, 40, 64
    a = fp8_operand(M, K, False, E4M3, device)
    b = fp8_operand(K, N, True, E4M3, device)
    scale_a, scale_b = torch.rand(M, device=device) + 0.5, torch.rand(N, device=device) + 0.5
    # c of the output's dtype (bf16, the fp8 operands' own, or the output's: the bias's rule)
    kw = dict(bias=torch.randn(N, device=device, dtype=torch.bfloat16),
              c=torch.randn(M, N, device=device).to(out_dtype), alpha=0.5, beta=-1.0, activation="gelu")
    out = mm(a, b, kernel=kernel, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)
    assert out.dtype == out_dtype
    ref = dequantized_reference(a, b, scale_a, scale_b, **kw)
    assert_rel_close(out, ref, tolerance(E4M3, out_dtype=out_dtype))


@pytest.mark.parametrize("kernel", ["grouped", "auto"])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(None, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.float16, torch.bfloat16), (torch.float32, torch.float32)])
def test_fp8_bias_of_bf16_or_the_output_dtype(kernel, out_dtype, bias_dtype, device):
    # what an fp8 product takes as its bias: bf16 (its default output's dtype) or the output's dtype
    M, N, K = 21, 30, 48
    a = fp8_operand(M, K, False, E4M3, device)
    b = fp8_operand(K, N, True, E4M3, device)
    scale_a, scale_b = torch.tensor(0.5, device=device), torch.rand(N, device=device) + 0.5
    bias = torch.randn(N, device=device).to(bias_dtype)
    out = mm(a, b, kernel=kernel, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
             activation="relu")
    assert out.dtype == (out_dtype or torch.bfloat16)
    ref = dequantized_reference(a, b, scale_a, scale_b, bias=bias, activation="relu")
    assert_rel_close(out, ref, tolerance(E4M3, out_dtype=out.dtype))


@pytest.mark.parametrize("kernel", ["grouped", "split_k", "persistent_tma"])
def test_fp8_batched_shares_the_scales(kernel, device):
    B, M, N, K = 3, 17, 24, 48
    a = fp8_operand(M, K, False, E4M3, device, batch=(B,))
    b = fp8_operand(K, N, True, E4M3, device)
    scale_a, scale_b = torch.rand(M, 1, device=device) + 0.5, torch.rand(1, N, device=device) + 0.5
    out = mm(a, b, kernel=kernel, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    ref = torch.stack([dequantized_reference(a[i], b, scale_a, scale_b) for i in range(B)])
    assert_rel_close(out, ref, tolerance(E4M3, out_dtype=torch.float32))


def test_fp8_plain_call_twice_gives_bf16_both_times(device):
    # The second identical call may be replayed: it must still allocate a bf16 output.
    a = fp8_operand(32, 64, False, E4M3, device)
    b = fp8_operand(64, 16, True, E4M3, device)
    first, second = tilegemm.matmul(a, b), tilegemm.matmul(a, b)
    assert first.dtype == second.dtype == torch.bfloat16
    assert torch.equal(first, second)


def test_fp8_through_the_registered_op(device):
    a = fp8_operand(16, 32, False, E4M3, device)
    b = fp8_operand(32, 24, True, E5M2, device)
    scale_a, scale_b = torch.tensor(0.5, device=device), torch.rand(24, device=device) + 0.5
    args = (a, b, None, None, 1.0, 1.0, "none", torch.float32, "ieee", "grouped", scale_a, scale_b, True)
    # opcheck's schema test does arithmetic on the inputs, which torch has no fp8 kernel for on the CPU.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.tilegemm.matmul.default, args, test_utils=utils)

    def f(x, w, sa, sb):
        return tilegemm.matmul(x, w, scale_a=sa, scale_b=sb, out_dtype=torch.float32) * 2.0

    out = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(
        a, b, scale_a, scale_b)
    assert_rel_close(out, 2.0 * dequantized_reference(a, b, scale_a, scale_b), 1e-3)


# --- fp8 fast accumulation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", RUNGS)
@pytest.mark.parametrize("layout", ["NT", "NN"])
def test_fp8_fast_accum_every_rung(kernel, layout, device):
    M, N, K = 33, 70, 300
    a = fp8_operand(M, K, layout[0] == "T", E4M3, device)
    b = fp8_operand(K, N, layout[1] == "T", E4M3, device)
    scale_a, scale_b = torch.tensor(0.5, device=device), torch.rand(N, device=device) + 0.5
    fast = mm(a, b, kernel=kernel, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32,
                           fast_accum=True)
    ref = dequantized_reference(a, b, scale_a, scale_b)
    assert_rel_close(fast, ref, tolerance(E4M3, out_dtype=torch.float32, fast_accum=True))


def test_fp8_fast_accum_has_its_own_tuning_key(device):
    from tilegemm.ops.matmul.problem import make_problems

    a = fp8_operand(16, 32, False, E4M3, device)
    b = fp8_operand(32, 16, True, E4M3, device)
    out = torch.empty(16, 16, device=device, dtype=torch.bfloat16)
    precise, fast = (make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False, fast_accum=f)[0]
                     for f in (False, True))
    assert precise.tuning_dtype == "fp8_e4m3" and fast.tuning_dtype == "fp8_e4m3+fast"
    assert precise.kernel_flags()["FAST_ACCUM"] is False and fast.kernel_flags()["FAST_ACCUM"] is True


@pytest.mark.gpu
def test_fp8_fast_accum_long_k_stays_within_its_bound():
    # On the GPU fast accumulation really drops bits; over K = 8192 it must still be within its bound,
    # and the promoted (default) sum within the tighter fp8 bound.
    a = fp8_operand(256, 8192, False, E4M3, "cuda")
    b = fp8_operand(8192, 256, True, E4M3, "cuda")
    ref = dequantized_reference(a, b)
    for kernel in ("autotuned", "persistent_tma"):
        precise = mm(a, b, kernel=kernel, out_dtype=torch.float32)
        fast = mm(a, b, kernel=kernel, out_dtype=torch.float32, fast_accum=True)
        assert_rel_close(precise, ref, tolerance(E4M3, out_dtype=torch.float32))
        assert_rel_close(fast, ref, tolerance(E4M3, out_dtype=torch.float32, fast_accum=True))


# --- fp8 errors ----------------------------------------------------------------------------------------------


def test_fp8_bad_inputs_name_the_problem(device):
    a = fp8_operand(8, 16, False, E4M3, device)
    b = fp8_operand(16, 8, True, E4M3, device)
    half = torch.randn(16, 8, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="dtypes differ.*only fp8"):
        tilegemm.matmul(a, half)
    with pytest.raises(ValueError, match="scale_a applies to fp8 inputs only"):
        tilegemm.matmul(half.T.contiguous(), half, scale_a=torch.tensor(1.0, device=device))
    with pytest.raises(TypeError, match="scale_b must be float32"):
        tilegemm.matmul(a, b, scale_b=torch.ones(8, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"scale_a must hold one scale .* one per row of a .*got \[8, 2\]"):
        tilegemm.matmul(a, b, scale_a=torch.ones(8, 2, device=device))
    with pytest.raises(ValueError, match=r"scale_b .* one per column of b .*got \[8, 1\]"):
        tilegemm.matmul(a, b, scale_b=torch.ones(8, 1, device=device))
    with pytest.raises(TypeError, match="scale_a must be a torch.Tensor"):
        tilegemm.matmul(a, b, scale_a=2.0)
    with pytest.raises(TypeError, match="out_dtype"):
        tilegemm.matmul(a, b, out_dtype=E4M3)
    with pytest.raises(TypeError, match="bias has unsupported dtype fp8_e4m3"):
        tilegemm.matmul(a, b, bias=torch.zeros(8, device=device).to(E4M3))
    for bias_dtype in (torch.float16, torch.float32):  # neither bf16 nor the output's dtype (bf16 by default)
        with pytest.raises(TypeError, match=re.escape(f"bias has dtype {dtype_name(bias_dtype)}; expected bf16 "
                                                      "(for fp8 operands)") + "$"):
            tilegemm.matmul(a, b, bias=torch.zeros(8, device=device, dtype=bias_dtype))
    with pytest.raises(TypeError, match=re.escape("bias has dtype fp16; expected bf16 (for fp8 operands) or the "
                                                  "output's, fp32")):
        tilegemm.matmul(a, b, bias=torch.zeros(8, device=device, dtype=torch.float16), out_dtype=torch.float32)
    with pytest.raises(TypeError, match=re.escape("bias has dtype fp32; expected bf16 (for fp8 operands) or the "
                                                  "output's, fp16")):
        tilegemm.matmul(a, b, bias=torch.zeros(8, device=device), out_dtype=torch.float16)
    with pytest.raises(TypeError, match="no backward"):
        tilegemm.matmul(a.float().requires_grad_().to(E4M3), b)
    with pytest.raises(ValueError, match="fast_accum applies to fp8 inputs only; a is fp16"):
        tilegemm.matmul(half.T.contiguous(), half, fast_accum=True)
    with pytest.raises(TypeError, match="fast_accum must be a bool, got str"):
        tilegemm.matmul(a, b, fast_accum="yes")
    with pytest.raises(TypeError, match="no gradient for scale_b"):
        tilegemm.matmul(a, b, scale_b=torch.ones(8, device=device, requires_grad=True))


@pytest.mark.parametrize("wants,match", [("a", "fp8 matmul has no backward"), ("b", "fp8 matmul has no backward"),
                                         ("scale_a", "no gradient for scale_a"), ("scale_b", "no gradient for scale_b")])
def test_the_registered_op_refuses_fp8_gradients(wants, match, device):
    # torch.ops.tilegemm.matmul runs its checks below autograd (grad mode off): an fp8 operand that wanted a gradient
    # got one from a backward that ignored the scales, and a scale that wanted one got None, both silently
    a = fp8_operand(5, 16, False, E4M3, device).requires_grad_(wants == "a")
    b = fp8_operand(16, 8, True, E5M2, device).requires_grad_(wants == "b")
    sa = torch.tensor(0.5, device=device, requires_grad=wants == "scale_a")
    sb = torch.rand(8, device=device).requires_grad_(wants == "scale_b")
    with pytest.raises(TypeError, match=match):
        torch.ops.tilegemm.matmul(a, b, None, None, 1.0, 1.0, "none", None, "default", "auto", sa, sb)
    with torch.no_grad():  # (and without a gradient to give, the call runs)
        out = torch.ops.tilegemm.matmul(a, b, None, None, 1.0, 1.0, "none", None, "default", "auto", sa, sb)
    assert_rel_close(out.float(), dequantized_reference(a, b, sa, sb), tolerance(E4M3, out_dtype=torch.bfloat16))


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_bias_and_c_gradients_through_an_activation(device, fast_accum):
    # the backward recomputes the pre-activation: with the call's scales (and accumulation), or the bias and c
    # gradients come out of another function
    a = fp8_operand(5, 32, False, E4M3, device)
    b = fp8_operand(32, 7, True, E4M3, device)
    sa, sb = torch.tensor(0.05, device=device), torch.rand(7, device=device) * 0.1 + 0.02
    bias = torch.randn(7, device=device, requires_grad=True)
    c = torch.randn(5, 7, device=device, requires_grad=True)
    out = tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, bias=bias, c=c, beta=0.5, activation="gelu",
                          out_dtype=torch.float32, fast_accum=fast_accum)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    bias64, c64 = bias.detach().double().requires_grad_(), c.detach().double().requires_grad_()
    pre = (a.double() * sa.double()) @ (b.double() * sb.double()) + 0.5 * c64 + bias64
    (torch.nn.functional.gelu(pre) * weights.double()).sum().backward()
    assert_rel_close(bias.grad, bias64.grad, 1e-3)
    assert_rel_close(c.grad, c64.grad, 1e-3)
