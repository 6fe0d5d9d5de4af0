"""The grouped kernels compile for sm_90 without a GPU (Triton's compiler and ptxas, no launch), and their
products run on Hopper's tensor cores (wgmma) with cp.async pipelining: a check of the compiled path, which the
interpreter's tests do not exercise."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SM90, compile_offline

SCRIPT = SM90 + (Path(__file__).parent / "_compile_sm90.py").read_text()


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return compile_offline(tmp_path_factory.mktemp("grouped-ptx"), SCRIPT, [], timeout=900)


KERNELS = ["2d3d_bf16", "2d3d_fp16_decode", "2d3d_bf16_gated", "2d2d_bf16", "3d3d_tf32", "2d3d_bf16_decode_split",
           "int4_fp16_gated", "int4_fp16_decode", "int4_bf16_decode", "int4_bf16_prefill", "int4_fp16_group_rows"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_to_tensor_core_products(counts, kernel):
    ops = counts[kernel]
    assert any(op.startswith("wgmma") or op.startswith("mma") for op in ops), f"{kernel}: no MMA: {ops}"
    assert any(op.startswith("cp.async") for op in ops), f"{kernel}: no cp.async pipelining: {ops}"


@pytest.mark.parametrize("kernel", ["2d3d_bf16", "2d2d_bf16", "3d3d_tf32", "int4_bf16_prefill", "int4_fp16_decode"])
def test_large_tiles_use_wgmma(counts, kernel):
    # 64+ rows a tile: Hopper's warpgroup MMA (16-32 row tiles of a decode step take mma.sync, but the 4-bit
    # kernel's, whose weight tile is the A operand there: SWAP)
    assert any(op.startswith("wgmma") for op in counts[kernel]), counts[kernel]


@pytest.mark.parametrize("kernel, split", [("2d3d_bf16_decode_split", True), ("int4_fp16_decode", True),
                                           ("int4_bf16_decode", True), ("2d3d_bf16", False),
                                           ("int4_bf16_prefill", False)])
def test_decode_steps_split_k(counts, kernel, split):
    # one token to 2 of Mixtral-8x7B's experts: few tiles, so K is split (slices meet through one atomic a tile)
    assert (counts["configs"][kernel]["SPLIT_K"] > 1) == split, counts["configs"][kernel]
    assert any(op.startswith("atom.") for op in counts[kernel]) == split, counts[kernel]


@pytest.mark.parametrize("kernel, swap, one_group", [("int4_fp16_decode", True, True),
                                                     ("int4_bf16_prefill", False, True),
                                                     ("int4_fp16_group_rows", False, False)])
def test_int4_variants(counts, kernel, swap, one_group):
    # SWAP at decode sizes; one row of scales a K step unless groups (32) are shorter than the step (64)
    cfg = counts["configs"][kernel]
    assert (cfg["SWAP"], cfg["ONE_GROUP"]) == (swap, one_group), cfg


TMA = ["tma_bf16_b_nk", "tma_fp16_b_kn", "tma_bf16_gated", "tma_fp16_gated_b_kn", "tma_bf16_bias",
       "tma_bf16_half_tile", "tma_bf16_tail_split", "tma_fp16_half_tile_tail_split"]


@pytest.mark.parametrize("kernel", TMA)
def test_tma_kernel_loads_by_tma_into_wgmma(counts, kernel):
    # both operands' tiles by TMA (2-D boxes of a, 3-D of b), wgmma on them; no cp.async or per-element loads of
    # operands (the only global loads: offs, and the bias)
    ops = counts[kernel]
    assert any(op.startswith("cp.async.bulk.tensor.2d") for op in ops), ops
    assert any(op.startswith("cp.async.bulk.tensor.3d") for op in ops), ops
    assert any(op.startswith("wgmma") for op in ops), ops
    assert not any(op.startswith("cp.async.c") or op.startswith("mma.sync") for op in ops), ops
    # the 64 x 256 accumulator a warp group (two of 64 x 128 gated), bias and gate included, fits in registers
    assert ops["spilled_bytes"] == 0, ops


@pytest.mark.parametrize("kernel, b_nk", [("tma_bf16_b_nk", True), ("tma_fp16_b_kn", False),
                                          ("tma_bf16_gated", True), ("tma_fp16_gated_b_kn", False)])
def test_tma_kernel_configs(counts, kernel, b_nk):
    # b read in its own layout (no copy), a pipeline of the table's stages
    from tilegemm.ops.grouped import configs

    cfg = counts["configs"][kernel]
    stages = configs.TMA_STAGES_GATED if "gated" in kernel else configs.TMA_STAGES
    assert cfg["B_NK"] == b_nk and cfg["STAGES"] == stages, cfg
    assert cfg["BLOCK_M"] == configs.TMA_BLOCK[0], cfg


def test_tma_half_tile_config(counts):
    # under TMA_HALF_TILE_MAX_ROWS rows an expert: 64-row tiles on one warp group, the table's deeper ring
    from tilegemm.ops.grouped import configs

    cfg = counts["configs"]["tma_bf16_half_tile"]
    assert cfg["BLOCK_M"] == configs.TMA_HALF_TILE["BLOCK_M"] and cfg["STAGES"] == configs.TMA_HALF_TILE["num_stages"]


@pytest.mark.parametrize("kernel, split", [("tma_bf16_b_nk", False), ("tma_bf16_half_tile", False),
                                           ("tma_bf16_tail_split", True), ("tma_fp16_half_tile_tail_split", True)])
def test_tma_tail_split(counts, kernel, split):
    # off in the shipped configs (no atomic, no workspace traffic); the candidate's slices meet through one acq_rel
    # arrival a unit and fp32 partial tiles, the accumulator kept in registers (no spills: test above)
    cfg, ops = counts["configs"][kernel], counts[kernel]
    assert (cfg["TAIL_SPLIT"] > 1) == split, cfg
    assert any(op.startswith("atom.global.gpu.acq_rel") for op in ops) == split, ops
    assert any(op.startswith("ld.global.cg") for op in ops) == split, ops


@pytest.mark.parametrize("kernel", ["dequant_pass_fp16", "dequant_pass_bf16_slice"])
def test_dequant_pass_writes_16_byte_vectors(counts, kernel):
    # kernel dequant_grouped's pass: a packed word's eight weights are 16 contiguous bytes of a scratch row, stored
    # as one vector (no 2-byte stores), its words and scales read as vectors along N
    ops = counts[kernel]
    stores = {op: n for op, n in ops.items() if op.startswith("st.global")}
    assert stores and all(".v4" in op for op in stores), ops
