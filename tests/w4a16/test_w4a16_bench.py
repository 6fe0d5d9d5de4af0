"""The bench reads w4a16 from the registry and checks every kernel; importing tilegemm imports no triton."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tilegemm.bench.base import BenchError, bench_op


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


def test_formats_sweep_and_shapes_name_the_weight_format():
    op = bench_op("w4a16")
    cases = op.cases("formats")
    formats = {(c.dims.get("G", 128), c.dims.get("S", 0), c.dims.get("A", 0)) for c in cases}
    assert {g for g, _, _ in formats} == {32, 64, 128, 256, -1}
    assert (32, 1, 0) in formats and (-1, 0, 0) in formats and (128, 0, 1) in formats and (32, 0, 1) in formats
    assert {c.dims["M"] for c in cases} == {1, 3, 16, 48, 128}
    assert {(c.dims["N"], c.dims["K"]) for c in cases} == {(5120, 5120), (4096, 11008)}
    assert len({c.label for c in cases}) == len(cases)  # every case its own label
    case = op.parse_shape("3,5120,5120,32,sym")
    assert case.dims == dict(M=3, N=5120, K=5120, G=32, S=1, A=0) and case.label == "3x5120x5120-g32-sym"
    assert op.parse_shape("1,64,200,-1,act").label == "1x64x200-gK-act"
    assert op.parse_shape("16,8192,8192").dims == dict(M=16, N=8192, K=8192)  # group 128 asymmetric as before
    assert op.parse_shape("16,64,128,sym").dims == dict(M=16, N=64, K=128, G=128, S=1, A=0)  # flags without G
    assert op.parse_shape("16,64,128,act,sym").label == "16x64x128-g128-sym-act"
    for bad, match in (("3,64,96,64", "multiple of 64"), ("3,64,128,48", "group size"), ("3,64,128,32,foo", "malformed"),
                       ("3,64,128,32,sym,sym", "malformed")):
        with pytest.raises(BenchError, match=match):
            op.parse_shape(bad)
    # g32 groups: scales and zeros of 160 groups instead of 40
    assert op.weight_bytes(5120, 5120, group=32) == 5120 * 5120 // 2 + 2 * 160 * 5120 * 2


def test_bench_cli_times_a_chosen_format():
    from tilegemm.cli import main

    assert main(["bench", "--op", "w4a16", "--quiet", "--no-save", "--kernels", "auto",
                 "--shape", "3,64,96,32,sym,act", "--shape", "2,40,200,-1"]) == 0


def test_import_needs_no_triton():
    code = "import sys, tilegemm; from tilegemm import w4a16, nn; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
