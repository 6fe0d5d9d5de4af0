"""``tools/grouped_candidates.py`` (the GPU's field of grouped kernels and configs) on the CPU: its smoke run writes
checked rows, a wrong output is never timed, and its grids around the H200's configs stay in bounds."""

from __future__ import annotations

import json

import pytest
import torch

from tilegemm.core.runtime import interpreting
from conftest import load_script

pytestmark = pytest.mark.skipif(not interpreting(), reason="the tool's smoke run is the interpreter's")


@pytest.fixture(scope="module")
def tool():
    return load_script("tools", "grouped_candidates.py")


def test_smoke_run_writes_checked_rows(tool, tmp_path, capsys):
    out = tmp_path / "gc.json"
    tool.main(["--smoke", "--out", str(out), "--budget", "1"])
    doc = json.loads(out.read_text())
    first = doc["cases"][0]
    names = {r["name"]: r for r in first["rows"]}
    assert {"loop", "auto"} <= set(names) and any(n.startswith("tma ") for n in names)
    ok = [r for c in doc["cases"] for r in c["rows"] if r["status"] == "ok"]
    assert ok and all(r["rel_err"] <= 2.5e-2 and r["us"] > 0 for r in ok)
    assert first["summary"]["baseline_us"] is not None
    assert "geomean auto vs baseline" in capsys.readouterr().out  # the table comes last


def test_a_wrong_output_is_not_timed(tool):
    case = next(c for c in tool.pick_cases("weak", smoke=True) if c.label == "tiny/gate_up/t17")
    inp = tool.Inputs(case, torch.bfloat16, "cpu")
    row = dict(name="zeros", kernel="tiled", fn=lambda: torch.zeros_like(inp.ref))
    tool.run_row(row, inp, smoke=True)
    assert row["status"] == "wrong" and "us" not in row


def test_grids_around_the_h200_configs(tool):
    tiled = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)
    field = tool.tiled_field(tiled, 4096, smoke=False)
    assert field[0] == ("core", tiled)
    assert ("core", dict(tiled, BLOCK_M=64, num_warps=4, num_stages=3)) in field
    assert all(c["BLOCK_M"] <= 128 and c["BLOCK_N"] <= 256 and 2 <= c["num_stages"] <= 6 for _, c in field)
    assert any(c["SPLIT_K"] == 2 for _, c in field)
    tma = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    field = tool.tma_field(tma, smoke=False)
    assert ("core", dict(tma, BLOCK_N=128, num_stages=4)) in field
    assert any(c.get("PROGRAMS_PER_SM") == 2 and c["BLOCK_M"] == 64 and c["num_warps"] == 4 for _, c in field)
