"""``tools/w4a16_frag_sweep.py`` on the CPU: a config's identity (its key, mode and canonical form) keeps every
knob the launch reads, PAIRS included, so two configs that launch differently are never timed as one."""

from __future__ import annotations

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools", "w4a16_frag_sweep.py")


BASE = dict(BM=32, RH=1, num_warps=4, STAGES=6, SPLIT_K=2, OVERLAP=False, PIPE=False)


def test_pairs_is_its_own_mode(tool):
    plain = tool.canonical(BASE, 4096)
    paired = tool.canonical(dict(BASE, PAIRS=True), 4096)
    assert paired["PAIRS"] is True and plain["PAIRS"] is False
    assert tool.mode_of(paired) == "pairs" and tool.mode_of(plain) == "none"
    assert tool.config_key(paired) != tool.config_key(plain)
    assert tool.config_key(paired).endswith(".pairs")


def test_with_mode_round_trips_every_mode(tool):
    for mode in tool.MODES:
        cfg = tool.canonical(tool.with_mode(dict(BASE, PAIRS=True, OVERLAP=True), mode), 4096)
        assert tool.mode_of(cfg) == mode
    assert tool.with_mode(dict(BASE, PAIRS=True), "pipe")["PAIRS"] is False


def test_the_rule_at_32_rows_is_found_among_the_families(tool):
    # today's rule at BM = 32 runs PAIRS: the family set must hold that exact config under its own key
    from tilegemm.ops.w4a16 import configs

    rule = dict(BM=32, RH=1, num_warps=4, STAGES=configs.FRAG_WGMMA_PAIRS_STAGES, SPLIT_K=2, OVERLAP=False,
                PIPE=False, PAIRS=True)
    found = tool.family_candidates(32, 4096, 4096, 132, rule)
    key = tool.config_key(tool.canonical(rule, 4096))
    assert key in found and "rule" in found[key][1]
    assert found[key][0]["PAIRS"] is True
    # the neighbours of a PAIRS config include the plain loop at the same ring
    keys = {tool.config_key(c) for c in tool.neighbours(tool.canonical(rule, 4096), 4096)}
    assert tool.config_key(tool.canonical(dict(rule, PAIRS=False), 4096)) in keys


def test_rule_config_carries_the_rules_mode(tool):
    rule = dict(tiles=[(32, 1, 4)], alpha=1.0, split=(4, 8, 0), STAGES=6, mode="pairs")
    case = dict(M=32, N=4096, K=4096, sms=132)
    cfg = tool.rule_config(rule, case)
    assert cfg["PAIRS"] is True and tool.mode_of(cfg) == "pairs"
    assert tool.mode_of(tool.rule_config(dict(rule, mode="pipe"), case)) == "pipe"
