"""split_k's rule for small-M products whose rows are not 16-byte aligned (``split_k.misaligned_config``)."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.ops.matmul import split_k
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close


def problem(M, N, K, dtype=torch.float16, layout="NN", device="cpu", out=None):
    a = torch.randn(K, M, dtype=dtype, device=device).T if layout[0] == "T" else torch.randn(M, K, dtype=dtype,
                                                                                             device=device)
    b = torch.randn(N, K, dtype=dtype, device=device).T if layout[1] == "T" else torch.randn(K, N, dtype=dtype,
                                                                                            device=device)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device) if out is None else out
    return make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]


@pytest.fixture
def gpu_like(monkeypatch):
    """The rule as on a 132-SM GPU (it is off under the interpreter)."""
    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)


def test_narrow_tiles_in_many_slices_for_small_misaligned_products(gpu_like):
    cfg = split_k.misaligned_config(problem(5, 423, 2047))
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (16, 32, 64)
    assert cfg["SPLIT_K"] == 32  # 14 tiles: 32 slices of one K step each stay within 16 programs an SM
    assert split_k.misaligned_config(problem(6, 5661, 26729))["SPLIT_K"] == 8  # 177 tiles x 8 <= 16 x 132
    assert split_k.misaligned_config(problem(1, 630, 61))["SPLIT_K"] == 1  # one K step: no split
    assert split_k.misaligned_config(problem(1, 630, 97))["SPLIT_K"] == 2  # two: a step a slice
    assert split_k.misaligned_config(problem(1, 630, 150))["SPLIT_K"] == 2  # three: powers of two only
    assert split_k.misaligned_config(problem(8, 70, 1_000_001))["SPLIT_K"] == split_k.MISALIGNED_MAX_SPLIT


def test_the_rule_keeps_to_its_class(gpu_like):
    assert split_k.misaligned_config(problem(5, 424, 2048)) is None, "rows aligned"
    assert split_k.misaligned_config(problem(17, 423, 2047)) is None, "M above 16"
    assert split_k.misaligned_config(problem(5, 423, 2047, layout="NT")) is not None, "nn.Linear's layout too"
    assert split_k.misaligned_config(problem(5, 423, 2047, layout="TN")) is None, "not measured for TN"
    assert split_k.misaligned_config(problem(5, 423, 2047, dtype=torch.float32)) is None, "16-bit only"


def test_timing_weighs_the_rules_config_too(gpu_like):
    p = problem(5, 423, 2047)
    assert split_k.misaligned_config(p) in split_k.configs(p)


@pytest.mark.skipif(not interpreting(), reason="checks the interpreter's side of the rule")
def test_off_under_the_interpreter():
    assert split_k.misaligned_config(problem(5, 423, 2047)) is None


@pytest.mark.parametrize("shape", [(5, 43, 203), (1, 33, 129), (16, 70, 65)], ids=lambda s: "x".join(map(str, s)))
def test_its_configs_compute_the_product(shape, gpu_like, monkeypatch, device):
    """The rule's config (one K step a slice, partial planes added in order) launched as it is (under the
    interpreter too)."""
    M, N, K = shape
    p = problem(M, N, K, device=device)
    cfg = split_k.misaligned_config(p)
    monkeypatch.undo()  # launch the way the interpreter launches
    split_k.launch_config(p, dict(cfg, BLOCK_K=32))  # the interpreter's dot wants K steps of 16 or more
    assert_rel_close(p.out, matmul_reference(p.a, p.b), tolerance(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 423, 2047), (2, 4385, 1718), (1, 630, 605), (8, 134, 11609), (16, 77, 9)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_small_misaligned_products_through_auto(shape, dtype, layout):
    M, N, K = shape
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).T if layout == "NT" else torch.randn(K, N, device="cuda",
                                                                                           dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    p = make_problems(a, b, torch.empty(M, N, device="cuda", dtype=dtype), None, None, 1.0, 0.0, "none", "ieee",
                      False)[0]
    assert split_k.misaligned_config(p) is not None
    out = tilegemm.matmul(a, b, bias=bias, activation="gelu")
    ref = torch.nn.functional.gelu(matmul_reference(a, b) + bias.double())
    assert_rel_close(out, ref, tolerance(dtype))
