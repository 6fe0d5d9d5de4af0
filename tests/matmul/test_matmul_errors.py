"""Bad input raises TypeError/ValueError naming the problem, before any kernel runs."""

from __future__ import annotations

import re

import numpy
import pytest
import torch

import tilegemm
from tilegemm.core import runtime


def _ab(device, dtype=torch.float16):
    return torch.randn(8, 4, dtype=dtype, device=device), torch.randn(4, 6, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda d: (torch.randn(8, 4, device=d), torch.randn(5, 6, device=d)), ValueError, "inner dimensions differ"),
        (lambda d: (torch.randn(8, 4, device=d), torch.randn(4, 6, device=d, dtype=torch.float16)), TypeError, "dtypes differ"),
        (lambda d: (torch.ones(8, 4, dtype=torch.int32, device=d),) * 2, TypeError, "integer dtype int32"),
        (lambda d: (torch.ones(8, 4, dtype=torch.int8, device=d),) * 2, TypeError, "integer dtype int8"),
        (lambda d: (torch.ones(8, 4, dtype=torch.bool, device=d),) * 2, TypeError, "boolean dtype bool"),
        (lambda d: (torch.randn(4, 4, dtype=torch.float64, device=d),) * 2, TypeError, "unsupported dtype float64"),
        (lambda d: (torch.randn((), device=d), torch.randn(4, 6, device=d)), ValueError, "at least 1 dim"),
        (lambda d: (torch.randn(8, 4, device=d), torch.randn((), device=d)), ValueError, "at least 1 dim"),
        (lambda d: (torch.randn(5, device=d), torch.randn(4, 6, device=d)), ValueError, "inner dimensions"),
        (lambda d: (torch.randn(2, 8, 4, device=d), torch.randn(3, 4, 6, device=d)), ValueError, "do not broadcast"),
        (lambda d: ([[1.0]], torch.randn(1, 1, device=d)), TypeError, "a must be a torch.Tensor"),
        # the 1-D route: a vector beside a non-tensor (an ndarray has ndim; it failed on unsqueeze or ndim)
        (lambda d: (torch.randn(4, device=d), [1.0] * 4), TypeError, "b must be a torch.Tensor, got list"),
        (lambda d: (torch.randn(4, device=d), None), TypeError, "b must be a torch.Tensor, got NoneType"),
        (lambda d: (numpy.ones(4, numpy.float32), torch.randn(4, 6, device=d)), TypeError,
         "a must be a torch.Tensor, got ndarray"),
        (lambda d: (torch.randn(4, device=d), numpy.ones(4, numpy.float32)), TypeError,
         "b must be a torch.Tensor, got ndarray"),
        (lambda d: (numpy.float32(1.0), torch.randn(4, 6, device=d)), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_bad_operands(make, error, match, device):
    a, b = make(device)
    with pytest.raises(error, match=match):
        tilegemm.matmul(a, b)


def test_bad_bias(device):
    a, b = _ab(device)
    with pytest.raises(ValueError, match=r"bias must have shape \[N\] = \[6\], got \[5\]"):
        tilegemm.matmul(a, b, bias=torch.randn(5, device=device))
    with pytest.raises(ValueError, match="bias must have shape"):
        tilegemm.matmul(a, b, bias=torch.randn(1, 6, device=device))
    with pytest.raises(TypeError, match="bias has integer dtype"):
        tilegemm.matmul(a, b, bias=torch.ones(6, dtype=torch.int64, device=device))


@pytest.mark.parametrize(
    "dtype,out_dtype,bias_dtype,message",
    [
        (torch.float16, None, torch.float32, "bias has dtype fp32; expected the operands' fp16"),
        (torch.float16, None, torch.bfloat16, "bias has dtype bf16; expected the operands' fp16"),
        (torch.bfloat16, None, torch.float16, "bias has dtype fp16; expected the operands' bf16"),
        (torch.float32, None, torch.float16, "bias has dtype fp16; expected the operands' fp32"),
        (torch.float16, torch.float32, torch.bfloat16,
         "bias has dtype bf16; expected the operands' fp16 or the output's, fp32"),
        (torch.bfloat16, torch.float16, torch.float32,
         "bias has dtype fp32; expected the operands' bf16 or the output's, fp16"),
        (torch.float32, torch.float32, torch.bfloat16, "bias has dtype bf16; expected the operands' fp32"),
    ],
    ids=["fp16-fp32", "fp16-bf16", "bf16-fp16", "fp32-fp16", "fp16-out32-bf16", "bf16-out16-fp32", "fp32-out32-bf16"],
)
def test_bias_of_another_dtype(dtype, out_dtype, bias_dtype, message, device):
    # neither the operands' dtype nor the output's: refused by name, as torch.addmm refuses it
    a, b = _ab(device, dtype)
    with pytest.raises(TypeError, match=re.escape(message) + "$"):
        tilegemm.matmul(a, b, bias=torch.randn(6, device=device).to(bias_dtype), out_dtype=out_dtype)
    with pytest.raises(TypeError, match=re.escape(message) + "$"):  # a 1-D operand's route checks it too
        tilegemm.matmul(a[0], b, bias=torch.randn(6, device=device).to(bias_dtype), out_dtype=out_dtype)


def test_bias_dtype_is_in_the_replay_key(monkeypatch):
    # the fast path replays only calls that passed the checks: a bias or out_dtype of another dtype must be
    # another key (checked afresh), never a replay of a call that passed with other dtypes
    from tilegemm.ops.matmul import checks

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # keyed as GPU tensors are
    monkeypatch.setattr(checks, "interpreting", lambda: False)
    a, b = _ab("cpu")
    bias = torch.randn(6, dtype=torch.float16)
    with torch.no_grad():
        key = checks.replay_key(a, b, 1.0, None, "auto", bias=bias)
        others = [checks.replay_key(a, b, 1.0, None, "auto", bias=bias.to(d)) for d in (torch.bfloat16, torch.float32)]
        others += [checks.replay_key(a, b, 1.0, None, "auto", out_dtype=d, bias=bias.to(d))
                   for d in (torch.bfloat16, torch.float32)]
    assert key is not None and None not in others
    assert len({key, *others}) == 1 + len(others)


def test_bad_c(device):
    a, b = _ab(device)
    with pytest.raises(ValueError, match=r"c of shape \[7, 6\] does not broadcast to the output shape \[8, 6\]"):
        tilegemm.matmul(a, b, c=torch.randn(7, 6, device=device))
    with pytest.raises(ValueError, match="does not broadcast"):
        tilegemm.matmul(a, b, c=torch.randn(2, 8, 6, device=device))  # would grow the output


@pytest.mark.parametrize(
    "dtype,out_dtype,c_dtype,message",
    [
        (torch.float16, None, torch.float32, "c has dtype fp32; expected the operands' fp16"),
        (torch.float16, None, torch.bfloat16, "c has dtype bf16; expected the operands' fp16"),
        (torch.bfloat16, None, torch.float16, "c has dtype fp16; expected the operands' bf16"),
        (torch.float32, None, torch.float64, "c has dtype float64; expected the operands' fp32"),
        (torch.float32, None, torch.int32, "c has dtype int32; expected the operands' fp32"),
        (torch.float16, torch.float32, torch.bfloat16,
         "c has dtype bf16; expected the operands' fp16 or the output's, fp32"),
        (torch.bfloat16, torch.float16, torch.float32,
         "c has dtype fp32; expected the operands' bf16 or the output's, fp16"),
    ],
    ids=["fp16-fp32", "fp16-bf16", "bf16-fp16", "fp32-f64", "fp32-int32", "fp16-out32-bf16", "bf16-out16-fp32"],
)
def test_c_of_another_dtype(dtype, out_dtype, c_dtype, message, device):
    # c is the output's addend (beta * c), read in the epilogue as the bias is: of the operands' dtype or the
    # output's, as torch.addmm takes its input; anything else is refused by name, with beta 0 too (as its shape)
    a, b = _ab(device, dtype)
    c = torch.randn(8, 6, device=device).to(c_dtype)
    for beta in (1.0, 0.0):
        with pytest.raises(TypeError, match=re.escape(message) + "$"):
            tilegemm.matmul(a, b, c=c, beta=beta, out_dtype=out_dtype)
    with pytest.raises(TypeError, match=re.escape(message) + "$"):  # a 1-D operand's route checks it too
        tilegemm.matmul(a[0], b, c=c[0], out_dtype=out_dtype)
    with pytest.raises(TypeError, match=re.escape(message) + "$"):  # and the registered op called directly
        torch.ops.tilegemm.matmul(a, b, None, c, 1.0, 1.0, "none", out_dtype, "ieee", "auto")
    with pytest.raises(TypeError, match="c must be a torch.Tensor, got list"):
        tilegemm.matmul(a, b, c=[[1.0] * 6] * 8)


def test_c_of_the_fp8_operands_dtype_or_the_outputs(device):
    a = torch.randn(8, 32, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(6, 32, device=device).to(torch.float8_e4m3fn).mT
    with pytest.raises(TypeError, match=re.escape("c has dtype fp16; expected bf16 (for fp8 operands)") + "$"):
        tilegemm.matmul(a, b, c=torch.randn(8, 6, device=device).half())
    with pytest.raises(TypeError, match=re.escape("c has dtype fp32; expected bf16 (for fp8 operands) or the "
                                                  "output's, fp16") + "$"):
        tilegemm.matmul(a, b, c=torch.randn(8, 6, device=device), out_dtype=torch.float16)


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16], ids=["own", "out32", "out-bf16"])
def test_c_of_the_operands_or_the_outputs_dtype_is_taken(out_dtype, device):
    # both accepted dtypes, forward and (through an activation: its recompute runs with an fp32 output, so a bf16
    # c of a bf16 output goes in as fp32) backward
    a = torch.randn(8, 16, device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(16, 6, device=device, dtype=torch.float16)
    c = torch.randn(8, 6, device=device).to(out_dtype or torch.float16).requires_grad_()
    out = tilegemm.matmul(a, b, c=c, beta=0.5, activation="gelu", out_dtype=out_dtype)
    ref = torch.nn.functional.gelu(a.double() @ b.double() + 0.5 * c.double())
    assert out.dtype == (out_dtype or torch.float16)
    assert (out.double() - ref).abs().max() <= 2e-2 * (1 + ref.abs().max())
    grad = torch.randn(8, 6, device=device, dtype=torch.float64)
    (out.double() * grad).sum().backward()
    a64, c64 = a.detach().double().requires_grad_(), c.detach().double().requires_grad_()
    (torch.nn.functional.gelu(a64 @ b.double() + 0.5 * c64) * grad).sum().backward()
    assert c.grad.dtype == c.dtype and (c.grad.double() - c64.grad).abs().max() <= 2e-2 * (1 + c64.grad.abs().max())
    assert (a.grad.double() - a64.grad).abs().max() <= 5e-2 * (1 + a64.grad.abs().max())


def test_the_op_called_directly_with_c_equals_float64(device):
    # a valid direct call of the registered op (c of the output's dtype) still runs, against a float64 reference
    a, b = _ab(device)
    c = torch.randn(8, 6, device=device)
    out = torch.ops.tilegemm.matmul(a, b, None, c, 1.0, 0.5, "none", torch.float32, "ieee", "auto")
    ref = a.double() @ b.double() + 0.5 * c.double()
    assert out.dtype == torch.float32 and (out.double() - ref).abs().max() <= 1e-2 * (1 + ref.abs().max())


def test_bad_options(device):
    a, b = _ab(device)
    with pytest.raises(ValueError, match="unknown activation 'tanh'; choose one of: none, relu"):
        tilegemm.matmul(a, b, activation="tanh")
    with pytest.raises(ValueError, match="unknown matmul kernel 'fastest'; choose one of: naive"):
        tilegemm.matmul(a, b, kernel="fastest")
    with pytest.raises(TypeError, match="matmul kernel must be a str, one of: naive"):
        tilegemm.matmul(a, b, kernel=None)
    with pytest.raises(ValueError, match="unknown precision 'double'"):
        tilegemm.matmul(a, b, precision="double")
    with pytest.raises(TypeError, match="precision must be a str, one of: .*; got int"):
        tilegemm.matmul(a, b, precision=3)
    with pytest.raises(TypeError, match="out_dtype int32 is not supported"):
        tilegemm.matmul(a, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype .* got str 'fp16'"):  # (a name, no dtype)
        tilegemm.matmul(a, b, out_dtype="fp16")
    with pytest.raises(ValueError, match="unknown precision ''"):  # (it ran as the default)
        tilegemm.matmul(a, b, precision="")
    with pytest.raises(TypeError, match="alpha must be a real number, got str"):
        tilegemm.matmul(a, b, alpha="2")
    with pytest.raises(TypeError, match="beta must be a real number, got bool"):
        tilegemm.matmul(a, b, beta=True)
    with pytest.raises(ValueError, match="alpha is too large to be a float"):  # (not float()'s bare OverflowError)
        tilegemm.matmul(a, b, alpha=10**400)
    with pytest.raises(TypeError, match="fast_accum must be a bool, got numpy.bool"):  # (not "got bool")
        tilegemm.matmul(a, b, fast_accum=numpy.bool_(True))


def test_different_devices(device):
    a, b = _ab(device)
    meta_b = torch.empty(4, 6, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="different devices: a on .*, b on meta"):
        tilegemm.matmul(a, meta_b)


def test_sparse_and_nested_tensors(device):
    """Tensors without strides are refused by name (they reached Triton, which cannot read their storage)."""
    a, b = _ab(device)
    with pytest.raises(TypeError, match=r"a is a tensor of layout torch.sparse_coo; .*dense .* a.to_dense\(\)"):
        tilegemm.matmul(a.to_sparse(), b)
    with pytest.raises(TypeError, match="b is a tensor of layout torch.sparse_csr"):
        tilegemm.matmul(a, b.to_sparse_csr())
    with pytest.raises(TypeError, match="bias is a tensor of layout torch.sparse_coo"):
        tilegemm.matmul(a, b, bias=torch.ones(6, dtype=a.dtype, device=device).to_sparse())
    with pytest.raises(TypeError, match="c is a tensor of layout torch.sparse_coo"):
        tilegemm.matmul(a, b, c=torch.ones(8, 6, dtype=a.dtype, device=device).to_sparse())
    nested = torch.nested.nested_tensor([a, a[:3]])
    with pytest.raises(TypeError, match="a is a nested tensor"):
        tilegemm.matmul(nested, b)


def test_cpu_tensors_when_a_gpu_is_in_use(monkeypatch):
    monkeypatch.setattr(runtime, "_interpret", False)
    monkeypatch.setattr(runtime, "missing_gpu", lambda: None)  # (a GPU is in use: no forced backend without one)
    a, b = _ab("cpu")
    with pytest.raises(ValueError, match="a is on cpu, but a CUDA GPU is in use"):
        tilegemm.matmul(a, b)


def test_fake_cpu_tensors_when_a_gpu_is_in_use(monkeypatch):
    """Fakes launch nothing: DTensor's sharding propagation (torch <= 2.11) makes them on the CPU whatever the mesh's
    device, and the op's fake must still give the output's shape; a real CPU tensor is still refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(runtime, "_interpret", False)
    monkeypatch.setattr(runtime, "missing_gpu", lambda: None)  # (a GPU is in use: no forced backend without one)
    with FakeTensorMode():
        a, b = torch.empty(16, 32, dtype=torch.float16), torch.empty(32, 8, dtype=torch.float16)
        out = torch.ops.tilegemm.matmul(a, b, None, None, 1.0, 0.0, "none", None, "default", "auto")
    assert out.shape == (16, 8) and out.dtype == torch.float16
    a, b = _ab("cpu")
    with pytest.raises(ValueError, match="a is on cpu, but a CUDA GPU is in use"):
        torch.ops.tilegemm.matmul(a, b, None, None, 1.0, 0.0, "none", None, "default", "auto")


def test_bad_env_flag(monkeypatch):
    monkeypatch.setenv("TILEGEMM_INTERPRET", "maybe")
    with pytest.raises(ValueError, match=r"TILEGEMM_INTERPRET='maybe': expected 1 or 0 \(or true/false, yes/no, on/off\)"):
        runtime._env_flag("TILEGEMM_INTERPRET")
    for empty in ("", " "):  # set empty: as if unset (it had forced the GPU compiler, naming "=0")
        monkeypatch.setenv("TILEGEMM_INTERPRET", empty)
        assert runtime._env_flag("TILEGEMM_INTERPRET") is None


def test_unknown_op_family():
    with pytest.raises(ValueError, match="unknown op 'fft'"):
        tilegemm.kernels("fft")
    with pytest.raises(TypeError, match="an op name is a str, one of: .*matmul.*; got list"):
        tilegemm.kernels(["matmul"])


def test_vectors_with_a_bias_take_c_of_their_output_shape(device):
    # a 1-D a and b with a bias give [1] (torch.matmul(a, b) + bias): a c of that shape broadcasts to it, where its
    # check ran against the scalar shape before the bias and refused it
    torch.manual_seed(0)
    v, w = torch.randn(16, device=device), torch.randn(16, device=device)
    bias, c = torch.randn(1, device=device), torch.randn(1, device=device)
    out = tilegemm.matmul(v, w, bias=bias, c=c, beta=0.5)
    want = v.double() @ w.double() + bias.double() + 0.5 * c.double()
    assert out.shape == (1,) and torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"c of shape \[2\] does not broadcast to the output shape \[1\]"):
        tilegemm.matmul(v, w, bias=bias, c=torch.randn(2, device=device))
