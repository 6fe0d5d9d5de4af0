"""``tools/grouped_frag_candidates.py`` (GPU timing of kernel ``frag``) on the CPU: its cases, config neighbours,
summary and table (the GPU run itself is the lead's: the tool's docstring says how)."""

from __future__ import annotations

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools", "grouped_frag_candidates.py")


def test_cases_are_the_sweeps_decode_cases(tool):
    cases = tool.pick_cases([1, 8, 64])
    assert len(cases) == 18 and {c.dims["T"] for c in cases} == {1, 8, 64}
    assert {c.label.split("/")[0] for c in cases} == {"mixtral", "qwen3_30b_a3b", "deepseek_v2_lite"}


def test_neighbours_stay_in_bounds(tool):
    cfg = dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1)
    assert tool.neighbours(cfg, 128) == [dict(cfg, BM=16), dict(cfg, SPLIT_K=2)]
    big = dict(cfg, BM=64, SPLIT_K=8)
    assert tool.neighbours(big, 14336) == [dict(big, BM=32), dict(big, SPLIT_K=4), dict(big, SPLIT_K=16)]


def test_summary_and_table(tool):
    cases = [dict(case="mixtral/down/t1", rows=[dict(name="baseline", us=40.0, status="ok"),
                                                dict(name="frag", us=10.0, vs_baseline=4.0, status="ok"),
                                                dict(name="auto", status="wrong", rel_err=1.0),
                                                dict(name="frag BM16", us=9.0, vs_baseline=4.4, status="ok")]),
             dict(case="qwen3_30b_a3b/down/t1", rows=[dict(name="baseline", us=20.0, status="ok"),
                                                      dict(name="frag", us=20.0, vs_baseline=1.0, status="ok")])]
    summ = tool.summary(cases)
    assert summ["frag"]["geomean"] == pytest.approx(2.0) and summ["frag"]["worst"] == 1.0 and "auto" not in summ
    text = tool.table(cases, summ)
    assert text.splitlines()[-1].startswith("frag: geomean 2.00x, worst 1.00x")
    assert "wrong" in text and "frag BM16 9.0" in text


def test_routing_seed_draws_other_group_sizes(tool, monkeypatch):
    from tilegemm.ops.grouped import bench

    monkeypatch.setattr(bench, "group_sizes", bench.group_sizes)  # restored after the test
    before = bench.group_sizes(64, 128, 8)
    tool.use_routing_seed(bench.SEED + 1)
    after = bench.group_sizes(64, 128, 8)
    assert sum(before) == sum(after) == 64 * 8 and before != after
    tool.use_routing_seed(bench.SEED)
    assert bench.group_sizes(64, 128, 8) == before
