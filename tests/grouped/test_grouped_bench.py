"""The grouped bench: its sweeps, routing, and the tiny sweep checked end to end in every mode."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tilegemm.bench.base import BenchError, bench_op
from tilegemm.ops.grouped.bench import MOE_MODELS, TOKENS, group_sizes


# the backward on one MoE product and the batched one (the forward's sweep has the other two)
@pytest.mark.parametrize("args", [["--op", "grouped"],
                                  ["--op", "grouped", "--mode", "bwd", "--dtype", "fp32", "--shape", "4,2,64,32,9,down",
                                   "--shape", "3,17,24,32"],
                                  ["--op", "grouped_w4a16", "--shape", "4,2,64,32,9,down"]])
def test_bench_cli_tiny_sweep(args):
    from tilegemm.cli import main

    # (every row checked against the float64 reference; main returns 1 if one is wrong)
    assert main(["bench", "--quiet", "--no-save", "--warmup", "1", "--rep", "1", *args]) == 0


def test_moe_sweep_covers_the_models():
    op = bench_op("grouped")
    moe = op.cases("moe")
    assert len(moe) == len(MOE_MODELS) * len(TOKENS) * 2
    labels = {c.label for c in moe}
    assert "mixtral/gate_up/t16384" in labels and "qwen3_30b_a3b/down/t1" in labels
    assert op.parse_shape("8,2,4096,14336,512,down").dims["T"] == 512
    assert op.parse_shape("8,512,4096,1024").dims == dict(kind=1, B=8, M=512, N=4096, K=1024)
    with pytest.raises(BenchError, match="malformed"):
        op.parse_shape("8,2,4096")


def test_routing_is_skewed_fixed_and_leaves_experts_empty():
    sizes = group_sizes(4096, 128, 8)
    assert sizes == group_sizes(4096, 128, 8)  # a fixed seed
    assert sum(sizes) == 4096 * 8
    assert sizes.count(0) >= 128 // 8  # some experts get no token
    assert max(sizes) > 4 * (4096 * 8 / 128)  # and some many more than their share


def test_import_needs_no_triton():
    code = "import sys, tilegemm; tilegemm.grouped_mm; tilegemm.w4a16.grouped_matmul; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
