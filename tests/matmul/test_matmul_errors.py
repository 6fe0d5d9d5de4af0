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
        (lambda d: (torch.randn(4, 4, dtype=torch.float64, device=d),) * 2, TypeError, "unsupported dtype float64"),
        (lambda d: (torch.randn((), device=d), torch.randn(4, 6, device=d)), ValueError, "at least 1 dim"),
        (lambda d: (torch.randn(8, 4, device=d), torch.randn((), device=d)), ValueError, "at least 1 dim"),
        (lambda d: (torch.randn(5, device=d), torch.randn(4, 6, device=d)), ValueError, "inner dimensions"),
        (lambda d: (torch.randn(2, 8, 4, device=d), torch.randn(3, 4, 6, device=d)), ValueError, "do not broadcast"),
        (lambda d: ([[1.0]], torch.randn(1, 1, device=d)), TypeError, "a must be a torch.Tensor"),
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


def test_bad_options(device):
    a, b = _ab(device)
    with pytest.raises(ValueError, match="unknown activation 'tanh'; choose one of: none, relu"):
        tilegemm.matmul(a, b, activation="tanh")
    with pytest.raises(ValueError, match="unknown matmul kernel 'fastest'; choose one of: naive"):
        tilegemm.matmul(a, b, kernel="fastest")
    with pytest.raises(ValueError, match="unknown precision 'double'"):
        tilegemm.matmul(a, b, precision="double")
    with pytest.raises(TypeError, match="out_dtype int32 is not supported"):
        tilegemm.matmul(a, b, out_dtype=torch.int32)
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


def test_cpu_tensors_when_a_gpu_is_in_use(monkeypatch):
    monkeypatch.setattr(runtime, "_interpret", False)
    monkeypatch.setattr(runtime, "missing_gpu", lambda: None)  # (a GPU is in use: no forced backend without one)
    a, b = _ab("cpu")
    with pytest.raises(ValueError, match="a is on cpu, but a CUDA GPU is in use"):
        tilegemm.matmul(a, b)


def test_bad_env_flag(monkeypatch):
    monkeypatch.setenv("TILEGEMM_INTERPRET", "maybe")
    with pytest.raises(ValueError, match="TILEGEMM_INTERPRET='maybe': expected 1 or 0"):
        runtime._env_flag("TILEGEMM_INTERPRET")


def test_unknown_op_family():
    with pytest.raises(ValueError, match="unknown op 'fft'"):
        tilegemm.kernels("fft")
