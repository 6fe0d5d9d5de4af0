"""The bench's ``w4-random`` sweep: held-out (N, K) from a fixed seed, log-uniform in 1024..32768, multiples of
128, every M of the list; and its second baseline column (fbgemm's kernel where it imports, else torch int4)."""

from __future__ import annotations

import math

import pytest

from tilegemm.bench.base import bench_op
from tilegemm.ops.w4a16 import bench as w4bench

M_LIST = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]


def test_w4_random_draws_what_it_says():
    cases = bench_op("w4a16").cases("w4-random")
    shapes = list(dict.fromkeys((c.dims["N"], c.dims["K"]) for c in cases))
    assert len(shapes) == w4bench.W4_RANDOM_SHAPES >= 8
    assert len(cases) == len(shapes) * len(M_LIST)
    for n, k in shapes:
        assert 1024 <= n <= 32768 and 1024 <= k <= 32768 and n % 128 == 0 and k % 128 == 0, (n, k)
    for i, (n, k) in enumerate(shapes):  # every shape at every M, in order
        assert [c.dims["M"] for c in cases[i * len(M_LIST):(i + 1) * len(M_LIST)]] == M_LIST
        assert all((c.dims["N"], c.dims["K"]) == (n, k) for c in cases[i * len(M_LIST):(i + 1) * len(M_LIST)])
    assert len({c.x for c in cases}) == len(cases)  # distinct plot positions
    # Fixed seed: the same draw every time, another seed draws others.
    assert w4bench.w4_random_shapes() == shapes == [(c.dims["N"], c.dims["K"]) for c in cases][::len(M_LIST)]
    assert w4bench.w4_random_shapes(seed=w4bench.W4_RANDOM_SEED + 1) != shapes
    # Log-uniform: over many draws about half fall below the range's geometric middle (5793), not its arithmetic one.
    many = [v for pair in w4bench.w4_random_shapes(count=2000) for v in pair]
    below = sum(v < math.sqrt(1024 * 32768) for v in many) / len(many)
    assert 0.45 < below < 0.55, below
    assert min(many) == 1024 or min(many) < 1300
    assert max(many) > 28000


def test_w4_random_parses_as_shapes():
    op = bench_op("w4a16")
    for c in op.cases("w4-random")[:: len(M_LIST)]:
        assert op.parse_shape(f"{c.dims['M']},{c.dims['N']},{c.dims['K']}").dims == c.dims


def test_second_baseline_names_what_runs(monkeypatch):
    op = bench_op("w4a16")
    assert op.second_baseline_reason("cpu") is not None  # both int4 baselines are CUDA-only
    assert op.second_baseline_reason("cuda") is None
    monkeypatch.setitem(w4bench._FBGEMM, "fbgemm", "fbgemm-gpu-genai does not import (ModuleNotFoundError)")
    assert op.second_baseline_name == "torch int4"
    assert "ModuleNotFoundError" in op.run_meta([])["second_baseline_note"]
    monkeypatch.setitem(w4bench._FBGEMM, "fbgemm", None)
    assert op.second_baseline_name == "fbgemm int4 (preshuffled)" and op.run_meta([]) == {}


@pytest.mark.gpu
def test_fbgemm_column_agrees_where_it_imports():
    """Where fbgemm-gpu-genai imports, its kernel on the bench's inputs matches the reference (bf16 bound)."""
    import torch

    if w4bench.fbgemm_reason() is not None:
        pytest.skip(w4bench.fbgemm_reason())
    op = bench_op("w4a16")
    prepared = op.prepare(op.parse_shape("16,4096,4096"), "fp16", "cuda", 1, {})
    out = op.second_baseline(prepared.sets[0], "fp16")
    err = float((out.double() - prepared.reference).norm() / prepared.reference.norm())
    assert err <= op.second_baseline_tolerance("fp16"), err
    assert torch.isfinite(out).all()
