"""Fuzz `tilegemm.matmul(kernel="auto")` on the GPU (`pytest -m gpu`): random products of every dtype, with
transposed, padded and offset operands, batches, and epilogues, each called twice with fresh tensors of the
same layout (the second call replays the first's launch) and once more from tensors whose storage starts at
another offset (another alignment: another key). The shapes are drawn across the rules' regimes (M or N of 1..8,
long K, sizes just off multiples of 8/16/64) rather than from any sweep (`fuzz_kit.py`); `test_matmul_fuzz.py` runs
small ones under the interpreter.

Every output is NaN-poisoned before the kernel writes it; the check is per tile (32 x 32) as well as overall,
so one spoiled tile of a large output fails."""

from __future__ import annotations

import os

import pytest
from fuzz_kit import products, run_product
from hypothesis import HealthCheck, given, settings
from conftest import fuzz_draw

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("TILEGEMM_FUZZ_EXAMPLES", "60"))  # more on request


@fuzz_draw
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(p=products())
def test_auto_matches_the_reference(p):
    run_product(p, "cuda")
