"""The W4A16 fuzz (`w4a16_kit.fuzz_calls`) on small calls where the suite runs: under Triton's interpreter in CI
(bf16 dequantized through fp32 there), on the GPU with `pytest` unmarked. `test_w4a16_fuzz_gpu.py` draws large
ones."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from w4a16_kit import fuzz_calls, run_fuzz_call


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(c=fuzz_calls(max_m=40, max_n=72, max_k=512))
def test_auto_matches_the_dequantized_reference_on_small_calls(c, device):
    run_fuzz_call(c, device)
