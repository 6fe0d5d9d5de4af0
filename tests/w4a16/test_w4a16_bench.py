"""The bench reads w4a16 from the registry and checks every kernel; importing tilegemm imports no triton."""

from __future__ import annotations

import subprocess
import sys

from tilegemm.bench.base import bench_op


def test_bench_cli_runs():
    from tilegemm.cli import main

    assert main(["bench", "--op", "w4a16", "--quiet", "--no-save"]) == 0


def test_adapter():
    op = bench_op("w4a16")
    assert op.gpu_sweep == "llm" and op.cpu_sweep == "tiny"
    llm = op.cases("llm")
    assert len(llm) == 55 and llm[0].dims == dict(M=1, N=4096, K=4096)
    case = op.parse_shape("1,8192,8192")
    # 8192 x 8192 g128: 32 MiB of nibbles + 2 MiB of scales and zeros; 8 us is about 4.5 TB/s
    assert op.weight_bytes(8192, 8192) == 8192 * 8192 // 2 + 2 * 64 * 8192 * 2
    assert abs(op.weight_gbps(case, 0.008) - 4456.4) < 1


def test_import_needs_no_triton():
    code = "import sys, tilegemm; from tilegemm import w4a16, nn; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
