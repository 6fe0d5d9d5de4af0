"""The matmul fuzz (`fuzz_kit.py`) on small products, where the suite runs: under Triton's interpreter in CI (no
bf16: its dot is wrong there), on the GPU with `pytest` unmarked. `test_matmul_fuzz_gpu.py` draws large ones."""

from __future__ import annotations

from fuzz_kit import DTYPES, products, run_product
from hypothesis import HealthCheck, given, settings

from tilegemm.core.runtime import interpreting

NAMES = tuple(n for n in DTYPES if n != "bf16" or not interpreting())


# (20 draws under the interpreter, CI's minutes; 30 on the GPU)
@settings(max_examples=20 if interpreting() else 30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(p=products(NAMES, mn=72, k=200))
def test_auto_matches_the_reference_on_small_products(p, device):
    run_product(p, device)
