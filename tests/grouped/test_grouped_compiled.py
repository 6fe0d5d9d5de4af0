"""The grouped kernels compile for sm_90 without a GPU (Triton's compiler and ptxas, no launch), and their
products run on Hopper's tensor cores (wgmma) with cp.async pipelining: a check of the compiled path, which the
interpreter's tests do not exercise."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compile_offline

SCRIPT = (Path(__file__).parent / "_compile_sm90.py").read_text()


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return compile_offline(tmp_path_factory.mktemp("grouped-ptx"), SCRIPT, [], timeout=900)


@pytest.mark.parametrize("kernel", ["2d3d_bf16", "2d3d_fp16_decode", "2d3d_bf16_gated", "2d2d_bf16", "3d3d_tf32",
                                    "int4_fp16_gated"])
def test_compiles_to_tensor_core_products(counts, kernel):
    ops = counts[kernel]
    assert any(op.startswith("wgmma") or op.startswith("mma") for op in ops), f"{kernel}: no MMA: {ops}"
    assert any(op.startswith("cp.async") for op in ops), f"{kernel}: no cp.async pipelining: {ops}"


@pytest.mark.parametrize("kernel", ["2d3d_bf16", "2d2d_bf16", "3d3d_tf32"])
def test_large_tiles_use_wgmma(counts, kernel):
    # 64+ rows a tile: Hopper's warpgroup MMA (16-32 row tiles of a decode step take mma.sync)
    assert any(op.startswith("wgmma") for op in counts[kernel]), counts[kernel]
