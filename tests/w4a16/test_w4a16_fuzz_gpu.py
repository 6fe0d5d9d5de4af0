"""Fuzz `tilegemm.w4a16.matmul` (``auto``) on the GPU (`pytest -m gpu`): random M (1 .. 2048, so every kernel
auto routes to), N, K and group sizes, fp16 and bf16, symmetric or not, bias and activation, x with leading dims
or rows sliced out of a wider buffer; each weight called twice with fresh activations (the second call replays
the first's launch) and once from rows at another offset, against ``x @ dequantize(w).T`` in float64.

The error is relative to the output's norm, or where a sum cancels (a handful of outputs, N = 1), to half
the norm its terms' magnitudes give (``|x| @ |W|.T / sqrt(K)``): the kernels that do not round each weight to
16 bits as ``dequantize`` does (``gemv``) differ by that rounding, which cancellation magnifies in one output."""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from w4a16_kit import reference

from tilegemm import w4a16

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("TILEGEMM_FUZZ_EXAMPLES", "40"))


@st.composite
def calls(draw):
    group = draw(st.sampled_from([32, 64, 128, 128, 256, -1]))
    unit = 8 if group == -1 else group
    K = unit * draw(st.integers(1, max(1, 8192 // unit)))
    N = draw(st.sampled_from([draw(st.integers(1, 12000)), 8 * draw(st.integers(1, 1500))]))
    M = max(1, int(math.exp(draw(st.floats(0.0, math.log(2048))))))
    return dict(M=M, N=N, K=K, group=group, dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
                symmetric=draw(st.booleans()), bias=draw(st.booleans()),
                activation=draw(st.sampled_from(["none", "none", "silu", "relu"])),
                lead=draw(st.sampled_from([(), (), (2,)])), pad=draw(st.sampled_from([0, 0, 8, 3])),
                offset=draw(st.sampled_from([1, 3])))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=calls())
def test_auto_matches_the_dequantized_reference(c):
    torch.manual_seed(zlib.crc32(repr(sorted(c.items())).encode()))  # the same values each time it is drawn
    dtype, M, N, K = c["dtype"], c["M"], c["N"], c["K"]
    w = w4a16.quantize(torch.randn(N, K, device="cuda", dtype=dtype), c["group"], symmetric=c["symmetric"])
    bias = torch.randn(N, device="cuda", dtype=dtype) if c["bias"] else None
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    rows = math.prod(c["lead"]) * M
    for call, offset in enumerate((0, 0, c["offset"])):
        buf = torch.randn(offset + rows * (K + c["pad"]), device="cuda", dtype=dtype)
        x = buf[offset:].view(rows, K + c["pad"])[:, :K].reshape(*c["lead"], M, K)
        out = w4a16.matmul(x, w, bias=bias, activation=c["activation"])
        ref = reference(x.reshape(rows, K), w, bias, c["activation"]).reshape(*c["lead"], M, N)
        assert out.dtype == dtype, f"call {call} of {c}: output dtype {out.dtype}"
        assert not torch.isnan(out).any(), f"call {call} of {c}: NaN (an element never written)"
        x2 = x.reshape(rows, K).double()
        terms = (x2.abs() @ w4a16.dequantize(w).double().abs().T).norm().item() / math.sqrt(K)
        err = (out.double() - ref).norm().item() / max(ref.norm().item(), 0.5 * terms, 1e-30)
        assert err <= tol, f"call {call} of {c}: relative error {err:.2e} > {tol:.1e}"
    torch.cuda.synchronize()
