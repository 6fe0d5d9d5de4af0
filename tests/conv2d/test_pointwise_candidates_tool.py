"""tools/conv2d_pointwise_candidates.py (the 1x1 layers ``auto`` runs as GEMMs, against cuDNN, cuBLAS and the matmul
rungs' candidates): its smoke run under the interpreter writes rows whose candidates were checked, and its layer
selection follows conv2d's ``auto`` (every selected zoo layer goes to ``gemm_1x1``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tilegemm.core.runtime import interpreting


def _tool():
    path = Path(__file__).resolve().parents[2] / "tools" / "conv2d_pointwise_candidates.py"
    spec = importlib.util.spec_from_file_location("conv2d_pointwise_candidates", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_smoke_run_checks_every_candidate(tmp_path, capsys):
    if not interpreting():
        pytest.skip("the tool's smoke run is the interpreter's")
    tool = _tool()
    out = tmp_path / "pw.json"
    rc = tool.main(["--smoke", "--kinds", "strided,small", "--limit", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["layers"]
    assert rc == 0 and [r["kind"] for r in rows] == ["strided", "small"]
    for row in rows:
        assert not row["failed"], row["failed"]
        assert set(tool.BASELINES) <= set(row["us"])
        assert row["checked"] >= 3 and set(row["rung"].values()) == {"persistent_tma", "split_k", "grouped"}
        assert all(row["error"][n] <= doc["tolerance"] for n in row["configs"])
        assert row["best"] in row["configs"] and row["route"]["conv2d"] == "gemm_1x1"
    assert "gathered" in rows[0]["route"]["gemm_1x1"]
    # the pool's compile tasks name every call but the baselines' own, chunked, and a repeated layer none again
    seen: set = set()
    L = tool.shrink(tool.ordered_layers(("small",))[0])
    tasks = tool.warm_tasks(L, 1, "cpu", torch.float32, tool.RUNGS, None, seen)
    assert [n for t in tasks for n in t] == ["auto", "matmul-auto"] + list(rows[1]["configs"])
    assert all(len(t) <= tool.WARM_CHUNK for t in tasks)
    assert tool.warm_tasks(L, 1, "cpu", torch.float32, tool.RUNGS, None, seen) == []
    assert capsys.readouterr().out.splitlines()[-1].startswith("geomean")  # the table comes last


def test_explicit_layers_and_the_selection():
    tool = _tool()
    first, strided = tool.parse_layers("1920x192@14, 256x512@28/2")
    assert (first["C"], first["K"], first["H"], first["stride"]) == (1920, 192, 14, [1, 1])
    assert strided["stride"] == [2, 2] and tool.kind(first) == "small" and tool.kind(strided) == "strided"
    with pytest.raises(ValueError, match="CxK@H"):
        tool.parse_layers("1920x192")
    layers = tool.ordered_layers(("small",))
    assert len(layers) > 100 and all(tool.on_gemm_route(L) and tool.kind(L) == "small" for L in layers)
    flops = [tool.geometry(L, 32).flops() for L in layers]
    assert {flops[0], flops[1]} == {min(flops), max(flops)}  # a prefix spans the sizes


def test_a_candidate_that_writes_nothing_fails_its_check(tmp_path, monkeypatch):
    if not interpreting():
        pytest.skip("the tool's smoke run is the interpreter's")
    tool = _tool()
    import time_candidates  # the tool put tools/ on the path

    real = time_candidates.launcher

    def launcher(rung, p, cfg):  # split_k's configs launch nothing: their outputs keep the poison
        return (lambda: None) if rung == "split_k" else real(rung, p, cfg)

    monkeypatch.setattr(time_candidates, "launcher", launcher)
    out = tmp_path / "pw.json"
    assert tool.main(["--smoke", "--kinds", "small", "--limit", "1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["layers"][0]
    split = [n for n, r in row["rung"].items() if r == "split_k"]
    assert split and all(n in row["failed"] for n in split), row["failed"]
    assert not [n for n in row["failed"] if n not in split]
