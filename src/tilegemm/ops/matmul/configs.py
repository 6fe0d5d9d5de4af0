"""Block sizes, warps and pipeline depths for the dense-GEMM rungs.

Config lists are functions so they can depend on the backend and be pruned per problem.
"""

from __future__ import annotations

import torch

from tilegemm.core.runtime import interpreting


def make_config(bm, bn, bk, warps, stages, group_m=8) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)


def fixed_config(dtype: torch.dtype) -> dict:
    """The one config of ``naive`` and ``grouped``: a sound textbook choice, not a tuned one."""
    if interpreting():
        # Small tiles: the interpreter runs each program in numpy, and tests then cross many tile edges.
        return make_config(32, 32, 16, 4, 1)
    if dtype == torch.float32:
        # Not 8 warps and 3 stages: with tf32 operands swapped that config once gave a wrong tile, cause unknown
        # (docs/rungs/autotuned.md).
        return make_config(128, 128, 32, 4, 4)
    return make_config(128, 128, 64, 4, 4)


def autotune_configs() -> list[dict]:
    """Candidates for ``autotuned``; :func:`prune_for` keeps those that suit the dtype."""
    if interpreting():
        return [make_config(32, 32, 16, 4, 1)]
    return [
        # 16-bit operands: large tiles with 64-wide K steps feed the tensor cores best.
        make_config(128, 256, 64, 8, 3),
        make_config(256, 128, 64, 8, 3),
        make_config(128, 128, 64, 8, 4),
        make_config(128, 128, 64, 4, 4),
        make_config(128, 64, 64, 4, 4),
        make_config(64, 128, 64, 4, 4),
        make_config(64, 128, 64, 4, 5),  # 1024^3 fp16's best (docs/rungs/autotuned.md)
        make_config(64, 64, 64, 4, 4),
        make_config(128, 32, 64, 4, 4),
        make_config(64, 32, 64, 4, 5),
        make_config(32, 64, 64, 4, 5),
        make_config(16, 64, 128, 4, 4),
        # fp8 operands: half the bytes of 16-bit ones, so twice the K per step.
        make_config(128, 256, 128, 8, 3),
        make_config(128, 128, 128, 8, 4),
        make_config(128, 128, 128, 4, 4),
        make_config(64, 128, 128, 4, 4),
        make_config(64, 64, 128, 4, 4),
        # fp32 operands take twice the shared memory per element: shorter K steps. (128x128x32 with 8 warps
        # and 3 stages is left out; see fixed_config.)
        make_config(128, 128, 32, 4, 4),  # tf32 with swapped operands: 316 TFLOPS at 4096^3 on H200, the best seen
        make_config(128, 256, 32, 8, 3),
        make_config(128, 64, 32, 4, 4),
        make_config(64, 128, 32, 4, 4),
        make_config(64, 64, 32, 4, 4),
        make_config(32, 64, 32, 4, 4),
    ]


def prune_for(configs, dtype_bytes: int) -> list:
    """Keep the configs whose pipelined tiles fit comfortably in shared memory for this element size."""
    budget = 200 * 1024
    kept = []
    for config in configs:
        kw = config.kwargs if hasattr(config, "kwargs") else config
        stages = config.num_stages if hasattr(config, "num_stages") else config["num_stages"]
        tile_bytes = (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * dtype_bytes * max(stages - 1, 1)
        if dtype_bytes >= 4 and kw["BLOCK_K"] > 32:
            continue
        if dtype_bytes < 4 and kw["BLOCK_K"] < 64 and len(configs) > 1:
            continue
        if dtype_bytes == 2 and kw["BLOCK_K"] >= 128 and kw["BLOCK_M"] * kw["BLOCK_N"] > 64 * 128:
            continue  # the large fp8 configs (64x128x128 stays: 1024^3 bf16's, docs/rungs/autotuned.md)
        if tile_bytes <= budget:
            kept.append(config)
    return kept or list(configs)[:1]
