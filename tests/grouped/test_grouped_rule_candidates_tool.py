"""``tools/grouped_rule_candidates.py`` (auto's rule variants on the moe and batched targets, GPU) on the CPU: its
smoke run writes checked rows and the table, a wrong or failing row fails the run, a tile left wrong is seen where
the whole output's error would pass, the knobs come back as they were, and on a Hopper-like setup each candidate's
knobs reach the route it is meant to take."""

from __future__ import annotations

import json

import pytest
import torch

from tilegemm.core.runtime import interpreting
from conftest import load_script

pytestmark = pytest.mark.skipif(not interpreting(), reason="the tool's smoke run is the interpreter's")


@pytest.fixture(scope="module")
def tool():
    return load_script("tools", "grouped_rule_candidates.py")


def test_smoke_run_writes_checked_rows(tool, tmp_path, capsys):
    out = tmp_path / "rc.json"
    assert tool.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {c["name"] for c in doc["candidates"]["moe"]} == {n for n, _, _ in tool.MOE}
    assert {r["part"] for r in doc["rows"]} == {"moe", "batched"}
    mine = [r for r in doc["rows"] if r["kind"] != "baseline"]
    assert mine and all(r["status"] == "ok" and r["rel_err"] <= r["tol"] and r["tile_err"] <= r["tol"] for r in mine)
    assert all(r["us"] > 0 and r["ratio"] > 0 for r in doc["rows"])
    tail = next(r for r in mine if r["name"] == "tail")
    assert tail["knobs"] == ["grouped.configs.TMA_TAIL_SPLIT=4"] and tail["same_as"] == "auto"  # (no tma here)
    assert doc["summary"]["moe/bf16"]["auto"]["cases"] == 1
    printed = capsys.readouterr().out
    assert "geomean fp16" in printed and printed.rstrip().splitlines()[-1].startswith("0 failed")


def test_a_failing_candidate_fails_the_run(tool, tmp_path, monkeypatch, capsys):
    bogus = ("bogus", "a kernel that does not exist", (("grouped.dispatch", "AUTO", "no_such_kernel"),))
    monkeypatch.setitem(tool.CANDIDATES, "moe", (bogus,))
    out = tmp_path / "rc.json"
    assert tool.main(["--smoke", "--parts", "moe", "--moe-dtypes", "bf16", "--out", str(out)]) == 1
    row = next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "bogus")
    assert row["status"] == "error" and "us" not in row
    assert "FAILED moe tiny/down/t9 bf16 bogus" in capsys.readouterr().out


def test_a_wrong_tile_is_seen(tool):
    # one 8 x 8 corner left at zero: the whole output's relative error passes bf16's bound, its tile's does not
    ref = torch.randn(1024, 1024, dtype=torch.float64)
    bad = ref.clone()
    bad[:8, :8] = 0
    prepared = type("P", (), dict(sets=[{}], reference=ref))()
    row = dict(name="corner", kind="candidate", call=lambda inputs: bad.to(torch.bfloat16), context=lambda: _Null(),
               status="ok")
    tool.check(row, prepared, 2.5e-2)
    assert row["rel_err"] < 2.5e-2 < row["tile_err"] and row["status"] == "wrong", row
    ok = dict(row, status="ok", call=lambda inputs: ref.to(torch.bfloat16))
    tool.check(ok, prepared, 2.5e-2)
    assert ok["status"] == "ok"
    batched = torch.randn(3, 200, 72, dtype=torch.float64)
    wrong = batched.clone()
    wrong[2, 128:] = 0  # (the last batch's second row tile, whole)
    assert tool.worst_tile_error(batched, batched) == 0 and tool.worst_tile_error(wrong, batched) == 1.0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_knobs_set_and_restore(tool):
    from tilegemm.ops.grouped import configs, dispatch

    with tool.Knobs(tool.knobs_of("moe", "tma_s3_tail")):
        assert (dispatch.GLUON_FORWARD, configs.TMA_STAGES, configs.TMA_TAIL_SPLIT) == (False, 3, 4)
    assert (dispatch.GLUON_FORWARD, configs.TMA_STAGES, configs.TMA_TAIL_SPLIT) == (True, 4, 1)
    from tilegemm.ops.matmul import dispatch as matmul_dispatch

    with tool.Knobs(tool.knobs_of("batched", "small_m_split_k")):
        assert matmul_dispatch.GLUON_F16_BATCHED_MIN_M == matmul_dispatch.SMALL_M + 1
    with pytest.raises(AttributeError, match="NO_SUCH"):
        with tool.Knobs((("grouped.configs", "NO_SUCH", 1),)):
            pass
    assert configs.TMA_STAGES == 4


MOE_ROUTES = {  # Mixtral's down projection, on an H200-like setup: (4096, 512, 16384 tokens)
    "auto": ("gluon m128 n256", "tma m64 n256", "gluon m128 n256"),
    "tma": ("tma m128 n256 k64 g8 w8 s4", "tma m64 n256 k64 g8 w4 s5", "tma m128 n256 k64 g8 w8 s4"),
    "tma_s3": ("tma m128 n256 k64 g8 w8 s3", "tma m64", "tma m128 n256 k64 g8 w8 s3"),
    "tail": ("gluon m128 n256", "tma m64 n256 k64 g8 w4 s5 tail4", "gluon m128 n256"),
    "tma_tail": ("tma m128 n256 k64 g8 w8 s4 tail4", "tma m64 n256 k64 g8 w4 s5 tail4", "tma m128"),
    "tma_s3_tail": ("tma m128 n256 k64 g8 w8 s3 tail4", "tma m64 n256 k64 g8 w4 s5 tail4", "tma m128"),
    "gluon_256x128": ("gluon m256 n128 s4 sharedTrue", "tma m64", "gluon m256 n128 s4 sharedTrue"),
    "tma_half": ("tma m64 n256 k64 g8 w4 s5", "tma m64", "gluon m128 n256"),
}


def test_moe_candidates_take_their_routes(tool, monkeypatch):
    from tilegemm.ops.grouped import configs, dispatch

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "takes_tma", lambda p: True)
    monkeypatch.setattr(dispatch, "takes_gluon", lambda p: not p.gated)
    pytest.importorskip("tilegemm.ops.grouped.gluon")
    op = tool.bench_op("moe")
    cases = tool.cases_of("moe", False)
    assert [c.label for c in cases] == list(tool.MOE_CASES)
    assert set(MOE_ROUTES) == {"auto"} | {n for n, _, _ in tool.MOE}
    for i, case in enumerate(cases):
        inputs = tool.compile_inputs("moe", op, case, "bf16", "meta")  # (shapes only: meta tensors)
        for name, want in MOE_ROUTES.items():
            with tool.Knobs(tool.knobs_of("moe", name)):
                got = tool.route("moe", inputs)
            assert got.startswith(want[i]), (case.label, name, got)
            assert ("tail4" in got) == ("tail" in name and got.startswith("tma")), got  # tma's config carries it


def test_batched_candidates_take_their_routes(tool, monkeypatch):
    import tilegemm.core.hardware
    from tilegemm.ops.matmul import dispatch, persistent_tma

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(tilegemm.core.hardware, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent_tma, "why_not_gluon", lambda: None)
    op = tool.bench_op("batched")
    cases = {c.label: c for c in tool.cases_of("batched", False)}
    assert len(cases) == 13 and list(cases)[:len(tool.BATCHED_WEAK)] == list(tool.BATCHED_WEAK)

    def route(label, name):
        inputs = tool.compile_inputs("batched", op, cases[label], "fp16", "meta")
        with tool.Knobs(tool.knobs_of("batched", name)):
            return tool.route("batched", inputs)

    assert route("4096x128x4096/b8", "auto") == "autotuned"
    assert route("4096x128x4096/b8", "narrow").startswith("gluon_f16 m256 n128")
    assert route("4096x128x4096/b8", "narrow_128").startswith("gluon_f16 m128 n128")
    assert route("512x64x512/b64", "narrow_128").startswith("gluon_f16 m128 n128")
    assert route("128x128x128/b256", "auto").startswith("gluon_f16 m128 n128")
    assert route("128x128x128/b256", "small_m_split_k") == "split_k"
    for name in ("narrow", "narrow_128", "small_m_split_k"):  # the wide cases keep auto's route
        assert route("1000x1000x1000/b4", name) == route("1000x1000x1000/b4", "auto")
