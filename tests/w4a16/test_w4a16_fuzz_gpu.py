"""Fuzz `tilegemm.w4a16.matmul` (``auto``) on the GPU (`pytest -m gpu`): random M (1 .. 2048, so every kernel auto
routes to), N, K and group sizes, fp16 and bf16, symmetric or not, act-order, bias and activation, x with leading
dims or rows sliced out of a wider buffer; each weight called twice with fresh activations (the second call replays
the first's launch) and once from rows at another offset, against ``x @ dequantize(w).T`` in float64
(`w4a16_kit.run_fuzz_call`); `test_w4a16_fuzz.py` runs small calls under the interpreter."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from w4a16_kit import fuzz_calls, run_fuzz_call
from conftest import fuzz_draw

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("TILEGEMM_FUZZ_EXAMPLES", "40"))


@fuzz_draw
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=fuzz_calls())
def test_auto_matches_the_dequantized_reference(c):
    run_fuzz_call(c, "cuda")
