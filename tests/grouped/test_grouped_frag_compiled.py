"""Kernel ``frag`` of ``grouped_w4a16`` compiles for sm_90 without a GPU (Triton's compiler and ptxas, no launch):
the configs ``frag_config`` gives the ``moe`` sweep's decode cases on an H200 (132 SMs), and the other epilogues,
group lengths and row tiles, each with wgmma fed by cp.async, no serialized wgmma and no spills."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from conftest import SM90, compile_offline

SCRIPT = SM90 + "".join((Path(__file__).parent / name).read_text() for name in ("_sm90_one_ptxas.py",
                                                                                "_compile_sm90_frag.py"))
SMEM = 227 * 1024  # an H100 / H200 SM's shared memory a block may take


def _decode_variants() -> dict:
    """The sweep's decode cases (1, 8, 64 tokens) of Mixtral and Qwen3-30B-A3B, gate/up (gated, silu) and down,
    with the config frag_config gives them on 132 SMs."""
    import torch

    from tilegemm.ops.grouped import frag
    from tilegemm.ops.grouped.bench import MOE_MODELS
    from tilegemm.ops.grouped.problem import GroupedInt4Problem

    variants = {}
    for name, E, topk, H, I in MOE_MODELS[:2]:
        for T in (1, 8, 64):
            M = T * topk
            for product, (N, K, gated) in (("gate_up", (I, H, True)), ("down", (H, I, False))):
                x = mock.Mock(shape=(M, K), device=torch.device("cuda"))
                p = GroupedInt4Problem(x, None, None, None, None, None, None, E, M, N, K, 128, "silu", gated)
                with mock.patch.object(frag, "sm_count", lambda device: 132):
                    cfg = frag.frag_config(p, 2 * N if gated else N)
                variants[f"{name}-{product}-t{T}"] = dict(dtype="bfloat16", emnk=[E, M, N, K], gated=gated,
                                                          act="silu" if gated else "none", cfg=cfg)
    return variants


EXTRA = {
    # bias per expert, gelu, fp16, group 32 (two groups a K step), a K split
    "g32-fp16-bias-gelu-split": dict(dtype="float16", emnk=[8, 16, 4096, 4096], act="gelu", group=32, bias="en",
                                     cfg=dict(BM=16, RH=1, num_warps=4, STAGES=4, SPLIT_K=4)),
    # one group over a K that is no multiple of 64, bias [N], gated unsplit
    "whole-k-gated-bias": dict(dtype="float16", emnk=[4, 8, 200, 1000], act="relu", group=-1, bias="n", gated=True,
                               cfg=dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1)),
    # 64 rows a program (the most), a split, gated, group 64
    "m64-gated-split": dict(dtype="bfloat16", emnk=[8, 256, 1408, 2048], act="silu", group=64, gated=True,
                            cfg=dict(BM=64, RH=1, num_warps=4, STAGES=4, SPLIT_K=2)),
    "m64-fp16": dict(dtype="float16", emnk=[8, 256, 4096, 4096], act="none", cfg=dict(BM=64, RH=1, num_warps=4,
                                                                                     STAGES=4, SPLIT_K=1)),
    # one row, one expert (M, E, SLOTS: the constexpr 1 Triton makes of them); one row over 8 experts (compact)
    "one-row-one-expert": dict(dtype="float16", emnk=[1, 1, 64, 64], act="none", group=-1,
                               cfg=dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1)),
    "one-row-gated-split": dict(dtype="bfloat16", emnk=[8, 1, 4096, 14336], act="silu", gated=True, bias="n",
                                cfg=dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=8)),
    # 32 rows a program, group 256
    "m32-g256": dict(dtype="bfloat16", emnk=[8, 128, 4096, 14336], act="none", group=256,
                     cfg=dict(BM=32, RH=1, num_warps=4, STAGES=4, SPLIT_K=2)),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    variants = dict(_decode_variants(), **EXTRA)
    return variants, compile_offline(tmp_path_factory.mktemp("grouped-frag-ptx"), SCRIPT, variants, timeout=900)


def test_decode_configs(report):
    variants, _ = report
    # one token to 2 of Mixtral's experts: the down projection (2 x 64 row tiles over K = 14336) is split
    assert variants["mixtral-down-t1"]["cfg"]["SPLIT_K"] > 1
    for name, v in variants.items():
        if name in EXTRA:
            continue
        assert v["cfg"]["BM"] <= 32, (name, v["cfg"])


def test_compiles_to_wgmma_fed_by_cp_async_without_spills(report):
    variants, r = report
    for name, v in variants.items():
        got = r[name]
        assert got["wgmma"] >= 4, (name, got)
        assert got["cp_async"] >= 2, (name, got)  # 16-byte copies of x and of the packed words
        assert got["lop3"] >= 16, (name, got)  # the dequantization's nibble pairs
        assert not got["serialized"], (name, got)
        assert got["spills"] in ([], [0]), (name, got)
        assert got["shared"] <= SMEM, (name, got)
        assert (got["atomics"] > 0) == (got["split"] > 1), (name, got)  # slices meet through one atomic a tile
        assert got["group32"] == (v.get("group") == 32), (name, got)
        E, M = v["emnk"][:2]
        assert got["grid"][1] == min(E, M) + 1, (name, got)  # the (non-empty) experts and the tail past offs[-1]
        assert got["compact"] == (M < E), (name, got)


def test_decode_configs_keep_registers_for_several_programs_an_sm(report):
    # at most 128 registers a thread at 16 rows or fewer a program: 4+ programs of 128 threads an SM (the K split's
    # programs hide the weight's latency as frag_wgmma's do)
    variants, r = report
    for name, v in variants.items():
        if name not in EXTRA and v["cfg"]["BM"] <= 16:
            assert max(r[name]["registers"]) <= 128, (name, r[name]["registers"])
