"""``auto``'s survey-based choice for unseen shapes (tilegemm.ops.matmul.survey): the ranking, the shipped tables of
each dtype family and layout, when dispatch consults them, and (on the GPU) that what they choose runs and is
right."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.ops.matmul import dispatch, persistent_tma, survey
from tilegemm.ops.matmul.problem import make_problems, mma_operands, rows_aligned
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close

TABLES = sorted((Path(survey.__file__).resolve().parent.parent.parent / "tuned" / "survey").glob("*.json"))
ROOT = Path(__file__).resolve().parent.parent.parent


def problem(M, N, K, dtype=torch.float16, device="cpu"):
    a = torch.empty(M, K, dtype=dtype, device=device)
    b = torch.empty(K, N, dtype=dtype, device=device)
    return make_problems(a, b, torch.empty(M, N, dtype=dtype, device=device), None, None, 1.0, 0.0, "none",
                         "ieee", False)[0]


def test_identity_names_wave_splits_and_keeps_fixed_ones():
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=11)
    assert json.loads(survey.identity("split_k", cfg)[1])["SPLIT_K"] == "wave"
    assert json.loads(survey.identity("split_k", dict(cfg, SPLIT_K=8))[1])["SPLIT_K"] == 8
    assert json.loads(survey.identity("autotuned", dict(cfg, SPLIT_K=11))[1])["SPLIT_K"] == 11
    assert survey.identity("autotuned", {"b": 1, "a": 2}) == survey.identity("autotuned", {"a": 2, "b": 1})
    assert json.loads(survey.identity("persistent_tma", dict(cfg, SPLIT_K=2))[1])["SPLIT_K"] == "wave"
    assert "SPLIT_K" not in json.loads(survey.identity("persistent_tma", dict(BLOCK_M=64))[1])


def test_persistent_tma_wave_splits_are_worked_out_for_the_shape():
    """persistent_tma's "wave" split: the split of one wave of work units at the target (its fill of the GPU
    counted), where split_k's counts as filling the GPU; resolved to the same number when launched."""
    tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K="wave")
    # 800 x 536: 35 tiles, 3 slices of 41 K steps a tile on 132 SMs: 105 units, 800 x 536 of 896 x 640 computed
    u = survey.utilization(tile, (800, 536, 7816), 132, "persistent_tma")
    assert u == pytest.approx(800 * 536 * 7816 / (132 * 128 * 128 * 41 * 64))
    assert survey.utilization(tile, (800, 536, 7816), 132) == pytest.approx(800 * 536 / (896 * 640))  # split_k's
    p = problem(800, 536, 7816, dtype=torch.float16, device="meta")
    assert persistent_tma.wave_split(p, tile) == 1  # four "SMs" off the GPU: 35 tiles fill them


def test_split_candidates_are_offered_where_they_split(monkeypatch):
    """As on a 132-SM GPU: a split tile is valid for the survey where its wave split is above one, not for a
    product whose tiles fill the GPU, and no other tile is."""
    monkeypatch.setattr(persistent_tma, "interpreting", lambda: False)
    monkeypatch.setattr(persistent_tma, "sm_count", lambda device: 132)
    wave = dict(persistent_tma.make_config(128, 128, 64, 4, 4), SPLIT_K="wave")
    assert persistent_tma.offers_split(problem(800, 536, 7816, device="meta"), wave)
    assert persistent_tma.split_configs(problem(800, 536, 7816, device="meta"))[0] == dict(wave, SPLIT_K=3)
    assert not persistent_tma.offers_split(problem(8192, 8192, 8192, device="meta"), wave)  # 4096 tiles: no split
    assert not persistent_tma.offers_split(problem(800, 536, 7816, device="meta"), dict(wave, BLOCK_K=32))
    assert not persistent_tma.offers_split(problem(800, 536, 7816, dtype=torch.float32, device="meta"), wave)  # no tf32
    # fp8: the same tiles with K steps of the same bytes, where both operands are K-major (B given as [N, K].T)
    fp8 = torch.float8_e4m3fn
    a, b = torch.empty(800, 7816, dtype=fp8, device="meta"), torch.empty(536, 7816, dtype=fp8, device="meta").T
    out = torch.empty(800, 536, dtype=torch.bfloat16, device="meta")
    (nt,) = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)
    assert persistent_tma.offers_split(nt, dict(wave, BLOCK_K=128)) and not persistent_tma.offers_split(nt, wave)
    assert persistent_tma.split_configs(nt)[0] == dict(wave, BLOCK_K=128, SPLIT_K=3)
    (nn,) = make_problems(a, b.T.contiguous().T.contiguous(), out, None, None, 1.0, 0.0, "none", "ieee", False)
    assert not persistent_tma.split_configs(nn)  # B row-major: through registers, not offered


def test_rank_follows_the_nearest_shapes_and_counts_missing_candidates_at_the_floor():
    shapes = [[1024, 1024, 1024, [[0, 1.0], [1, 0.6]]],
              [2048, 1024, 1024, [[0, 0.7], [1, 1.0]]],
              [1024, 2048, 1024, [[0, 1.0], [2, 0.95]]],
              [16, 64, 64, [[1, 1.0], [2, 1.0]]]]  # far away: not among the three nearest
    assert survey.rank(shapes, (1024, 1024, 1024), [0, 1, 2]) == [0, 1, 2]
    assert survey.rank(shapes, (2048, 1024, 1024), [0, 1, 2])[0] == 1
    assert survey.rank(shapes, (16, 64, 64), [0, 1, 2])[0] in (1, 2)
    assert survey.rank(shapes, (1024, 1024, 1024), [2, 1]) == [1, 2]  # only the candidates asked for
    assert survey.distance((1, 1, 1), (2, 4, 1)) == 3.0


def test_utilization_counts_waves_and_padding():
    tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
    assert survey.utilization(tile, (1024, 1024, 4096), 64) == 1.0  # 64 tiles on 64 SMs, nothing padded
    assert survey.utilization(tile, (1024, 1024, 4096), 132) == pytest.approx(64 / 132)  # one part-filled wave
    assert survey.utilization(tile, (1000, 1024, 4096), 64) == pytest.approx(1000 / 1024)  # edge rows padded
    split = dict(tile, SPLIT_K=2)  # 128 programs of 32 K steps each
    assert survey.utilization(split, (1024, 1024, 4096), 132) == pytest.approx(128 / 132)
    assert survey.utilization(dict(tile, SPLIT_K="wave"), (1000, 1024, 4096), 132) == pytest.approx(1000 / 1024)
    gluon = dict(BLOCK_M=128, BLOCK_N=128)  # no BLOCK_K: the Gluon kernel's 64
    assert survey.utilization(gluon, (128, 128, 96), 1) == pytest.approx(96 / 128)


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 20000), N=st.integers(1, 30000), K=st.integers(1, 30000),
       bm=st.sampled_from([16, 32, 64, 128, 256]), bn=st.sampled_from([32, 64, 128, 256]),
       bk=st.sampled_from([None, 32, 64, 128]), split=st.sampled_from([None, 1, 2, 3, 4, 8, 16, "wave"]),
       sms=st.sampled_from([1, 78, 114, 132]))
def test_utilization_is_a_share(M, N, K, bm, bn, bk, split, sms):
    config = dict(BLOCK_M=bm, BLOCK_N=bn)
    if bk is not None:
        config["BLOCK_K"] = bk
    if split is not None:
        config["SPLIT_K"] = split
    u = survey.utilization(config, (M, N, K), sms)
    assert 0.0 < u <= 1.0 + 1e-12
    if M % bm == 0 and N % bn == 0 and split in (None, 1, "wave") and K % (bk or survey.GLUON_BLOCK_K) == 0:
        tiles = (M // bm) * (N // bn)
        expected = 1.0 if split == "wave" else tiles / (-(-tiles // sms) * sms)
        assert u == pytest.approx(expected)


def test_rank_with_configs_moves_a_candidate_by_its_fill_of_the_gpu():
    # one neighbour (8 tiles) where the unsplit candidate ran best: at the neighbour's own shape the order stays
    configs = [["autotuned", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)],
               ["split_k", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K="wave")]]
    shapes = [[512, 256, 4096, [[0, 1.0], [1, 0.9]]]]
    assert survey.rank(shapes, (512, 256, 4096), [0, 1], configs, 132) == [0, 1]
    # a target with 16x the tiles: the unsplit kernel fills the GPU there, as the wave split did already
    assert survey.rank(shapes, (2048, 1024, 4096), [0, 1], configs, 132) == [0, 1]
    # the neighbour had 132 tiles (a full wave); the target has 8: the unsplit candidate leaves 124 SMs idle
    shapes = [[128 * 12, 128 * 11, 512, [[0, 1.0], [1, 0.9]]]]
    assert survey.rank(shapes, (512, 256, 512), [0, 1], configs, 132) == [1, 0]
    assert survey.rank(shapes, (512, 256, 512), [0, 1]) == [0, 1]  # without configs: as before


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_shipped_tables_hold_only_candidates_of_their_rungs(path, monkeypatch):
    from tilegemm.ops.matmul import configs, gluon_f16, gluon_fp8, gluon_tf32, persistent_tma, split_k

    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's candidate lists
    doc = json.loads(path.read_text())
    assert doc["schema"] == survey.SCHEMA and doc["shapes"] and doc["configs"]
    family = doc.get("family", "")
    assert path == survey.table_path(doc["gpu"], doc["layouts"][0], family), "named by its GPU, layout and family"
    size = {"": 2, "tf32": 4, "fp8": 1}[family]
    gluon = {"": gluon_f16.configs(2), "tf32": gluon_tf32.configs(4), "fp8": gluon_fp8.configs(2)}[family]
    pointer = configs.prune_for(configs.autotune_configs(), size)
    # how the table's layout meets the tensor cores (tf32 NN: an operand through registers, "swap")
    dtype = {"": torch.float16, "tf32": torch.float32, "fp8": torch.float8_e4m3fn}[family]
    a_strides = (0, 1, 64) if doc["layouts"][0][0] == "T" else (0, 64, 1)
    b_strides = (0, 1, 64) if doc["layouts"][0][1] == "T" else (0, 64, 1)
    mma = mma_operands(dtype, "tf32" if family == "tf32" else "ieee", a_strides, b_strides)
    tma = persistent_tma.hopper_configs(size, mma) + gluon
    tiles = {(bm, bn, max(32, min(256, bk * 2 // size)), warps, stages)  # K steps of the same bytes, as configs()
             for bucket in split_k._TILES.values() for bm, bn, bk, warps, stages in bucket}
    for rung, cfg in doc["configs"]:
        if rung == "autotuned":
            assert cfg in pointer, cfg
        elif rung == "persistent_tma" and "SPLIT_K" in cfg:  # a K split of one wave, 16-bit and fp8 only
            plain = {k: v for k, v in cfg.items() if k != "SPLIT_K"}
            assert family in ("", "fp8") and cfg["SPLIT_K"] == "wave", cfg
            assert plain in [persistent_tma.make_config(*t) for t in persistent_tma.split_tiles(size)], cfg
        elif rung == "persistent_tma":
            assert cfg in tma, cfg
        else:
            assert rung == "split_k", rung
            tile = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"])
            assert tile in tiles and (cfg["SPLIT_K"] == "wave" or cfg["SPLIT_K"] in survey.FIXED_SPLITS), cfg
    for M, N, K, kept in doc["shapes"]:
        assert min(M, N, K) >= 1 and kept
        effs = [e for i, e in kept]
        assert max(effs) == 1.0 and min(effs) >= survey.FLOOR
        assert all(0 <= i < len(doc["configs"]) for i, _ in kept)


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_on_a_surveyed_shape_the_choice_runs_near_that_shapes_best(path):
    """The ranking uses the stored efficiencies: on each surveyed shape itself (its own data included, as a
    later call of that shape would have), the candidate ranked first ran at 0.8 or more of its best."""
    doc = json.loads(path.read_text())
    everything = list(range(len(doc["configs"])))
    for M, N, K, kept in doc["shapes"]:
        first = survey.rank(doc["shapes"], (M, N, K), everything)[0]
        assert dict((i, e) for i, e in kept).get(first, 0.0) >= 0.8, (M, N, K)


def test_choose_picks_valid_candidates_and_resolves_wave_splits(monkeypatch):
    """On the CPU, with the H200's table: no Gluon config (the Gluon kernels need the GPU), a persistent_tma
    config only where TMA can describe the problem, a wave split made a number."""
    if not (Path(survey.table_path("NVIDIA H200"))).exists():
        pytest.skip("no H200 table shipped")
    if torch.cuda.is_available():
        pytest.skip("a CPU check: on a GPU the Gluon kernels are valid candidates (the -m gpu tests launch them)")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr("tilegemm.core.hardware.sm_count", lambda device: 132)
    monkeypatch.setattr(survey, "_choices", {})
    for M, N, K in [(1, 4096, 11008), (37, 640, 24000), (300, 1000, 4000), (4000, 264, 520), (9000, 9000, 72)]:
        p = problem(M, N, K)
        rung, cfg = survey.choose(p)
        assert rung in ("autotuned", "persistent_tma", "split_k")
        assert not cfg.get("GLUON_F16")
        assert isinstance(cfg.get("SPLIT_K", 1), int) and cfg.get("SPLIT_K", 1) >= 1
        assert survey.choose(p) == (rung, cfg)  # answered once, the same


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_tf32_and_fp8_tables_choose_their_own_familys_candidates(gpu, monkeypatch):
    """On the CPU with a GPU's tf32 and fp8 tables (Gluon taken as available): valid candidates of the family;
    no Gluon fp8 config where fast accumulation asks for none; IEEE fp32 has no table."""
    from tilegemm.ops.matmul import configs, persistent_tma, split_k

    if not survey.table_path(gpu, "NN", "tf32").exists() or not survey.table_path(gpu, "NT", "fp8").exists():
        pytest.skip(f"no tf32 and fp8 tables shipped for {gpu}")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr("tilegemm.core.hardware.sm_count", lambda device: 132)
    for module in (configs, split_k):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent_tma, "why_not_gluon", lambda: None)
    monkeypatch.setattr(survey, "_choices", {})
    monkeypatch.setattr(survey, "_tables", {})
    # the K-split candidates as on a GPU of 132 SMs, whatever runs the test (the problems' tensors are on the CPU)
    monkeypatch.setattr(persistent_tma, "interpreting", lambda: False)
    monkeypatch.setattr(persistent_tma, "sm_count", lambda device: 132)

    def fp8(M, N, K, fast=False):
        a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
        b = torch.empty(N, K, dtype=torch.float8_e4m3fn).T
        one = torch.tensor(1.0)
        return make_problems(a, b, torch.empty(M, N, dtype=torch.bfloat16), None, None, 1.0, 0.0, "none", "ieee",
                             False, (one, 0, one, 0), fast)[0]

    def fp32(M, N, K, precision):
        a, b = torch.empty(M, K), torch.empty(K, N)
        return make_problems(a, b, torch.empty(M, N), None, None, 1.0, 0.0, "none", precision, False)[0]

    def named(family, layout):  # the candidates of that family's table, as identities
        return {survey.identity(r, c) for r, c in survey.table_for(gpu, layout, family)["configs"]}

    tf32_table, fp8_table = named("tf32", "NN"), named("fp8", "NT")
    assert tf32_table != fp8_table and tf32_table != named("", "NN")
    for M, N, K in [(5, 3000, 4000), (700, 1500, 2000), (3000, 200, 6000), (6000, 6000, 512)]:
        p = fp32(M, N, K, "tf32")
        assert p.layout == "NN" and survey.covers(p)
        assert survey.identity(*survey.choose(p)) in tf32_table, "a tf32 problem is chosen for from the tf32 table"
        assert not survey.covers(fp32(M, N, K, "ieee")), "IEEE fp32 has no table"
        q = fp8(M, N, K)
        assert q.layout == "NT" and survey.covers(q)
        assert survey.identity(*survey.choose(q)) in fp8_table
        rung, cfg = survey.choose(fp8(M, N, K, fast=True))
        assert survey.identity(rung, cfg) in fp8_table
        assert not cfg.get("GLUON_FP8"), "fast accumulation: no Gluon fp8 kernel takes it"
    gluon_picks = {survey.choose(fp8(M, 8192, 4096))[1].get("GLUON_FP8", False) for M in (2048, 4096, 8192)}
    # Large promoted fp8 products: the H200's survey ranked the Gluon kernel best there, the H100's Triton's 256 x 128
    # tile (both tables hold the Gluon configs)
    assert gluon_picks == {gpu == "NVIDIA H200"}, gluon_picks
    assert any(c.get("GLUON_FP8") for _, c in survey.table_for(gpu, "NT", "fp8")["configs"])


def test_dispatch_consults_the_survey_only_for_untuned_classes_with_timing_off(monkeypatch, tmp_path):
    from tilegemm.core import tuning

    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(survey, "why_not", lambda p: None)
    monkeypatch.setattr(survey, "covers", lambda p: True)
    monkeypatch.setattr(survey, "choose", lambda p: ("autotuned", {"picked": True}))
    p = problem(333, 4440, 1000)
    assert dispatch.surveyed(p) == ("autotuned", {"picked": True})
    with tuning.timing():
        assert dispatch.surveyed(p) is None, "tuning asked for: the candidates are timed instead"
    try:
        tuning.record(tuning.key("persistent_tma", 333, 4440, 1000, p.tuning_dtype, p.out.dtype, p.layout),
                      {"BLOCK_M": 128})
        assert dispatch.surveyed(p) is None, "a tuned class (even after a cached answer) keeps its measured choice"
    finally:
        tuning.forget()
    q = problem(335, 4440, 1000)
    shipped = {tuning.key("persistent_tma", 335, 4440, 1000, q.tuning_dtype, q.out.dtype, q.layout): {"BLOCK_M": 64}}
    read = tuning._read
    monkeypatch.setattr(tuning, "_read", lambda path: (shipped, True) if path == tuning.shipped_file() else ({}, True))
    tuning.forget()
    try:
        assert tuning.lookup(next(iter(shipped))) == {"BLOCK_M": 64} and not tuning.measured(next(iter(shipped)))
        assert dispatch.surveyed(q) == ("autotuned", {"picked": True}), "a shipped single-rung config: the survey"
        shipped[tuning.key("auto", 335, 4440, 1000, q.tuning_dtype, q.out.dtype, q.layout)] = {"rung": "split_k"}
        tuning.forget()
        dispatch._decisions.clear()
        assert dispatch.surveyed(q) is None, "a shipped choice of rung keeps the survey out"
    finally:
        monkeypatch.setattr(tuning, "_read", read)
        tuning.forget()
        dispatch._decisions.clear()
    assert dispatch.surveyed(problem(3, 40, 48)) == ("autotuned", {"picked": True}), "small products too"
    a = torch.empty(336, 1001, dtype=torch.float16)[:, :1000]  # rows 2002 bytes apart
    misaligned = make_problems(a, torch.empty(1000, 4440, dtype=torch.float16),
                               torch.empty(336, 4440, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee",
                               False)[0]
    assert dispatch.surveyed(misaligned) is None, "rows not 16-byte aligned: padded first, or the rules"
    monkeypatch.setattr(survey, "covers", lambda p: False)
    assert dispatch.surveyed(problem(337, 4440, 1000)) is None, "no table (or not of this layout): the rules"
    monkeypatch.setattr(survey, "covers", lambda p: True)
    monkeypatch.setattr(survey, "why_not", lambda p: "not surveyed")
    assert dispatch.surveyed(problem(334, 4440, 1000)) is None


def test_tables_cover_the_layouts_they_surveyed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(survey, "_tables", {})
    if not survey.table_path("NVIDIA H200").exists():
        pytest.skip("no H200 table shipped")
    nn = problem(300, 400, 500)
    nt = make_problems(torch.empty(300, 500, dtype=torch.float16), torch.empty(400, 500, dtype=torch.float16).T,
                       torch.empty(300, 400, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    tn = make_problems(torch.empty(500, 300, dtype=torch.float16).T, torch.empty(500, 400, dtype=torch.float16),
                       torch.empty(300, 400, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    assert (nn.layout, nt.layout, tn.layout) == ("NN", "NT", "TN")
    assert survey.covers(nn)
    assert survey.covers(nt) == survey.table_path("NVIDIA H200", "NT").exists()  # nn.Linear's x @ W.T
    assert survey.covers(tn) == survey.table_path("NVIDIA H200", "TN").exists()  # its weight gradient dy.T @ x
    tt = make_problems(torch.empty(500, 300, dtype=torch.float16).T, torch.empty(400, 500, dtype=torch.float16).T,
                       torch.empty(300, 400, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    assert tt.layout == "TT" and not survey.table_path("NVIDIA H200", "TT").exists() and not survey.covers(tt)
    assert not survey.covers(problem(300, 400, 100352)), "K far past the surveyed box: the rules"
    assert not survey.covers(problem(300, 65536, 500)), "N far past the surveyed box: the rules"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Other GPU")
    assert not survey.covers(nn)


def test_within_takes_the_surveyed_box_and_a_margin():
    table = dict(bounds=[(0.0, 14.0), (6.0, 14.8), (6.0, 14.8)])  # M 1..16384, N and K 64..28672
    assert survey.within(table, (1, 64, 64)) and survey.within(table, (16384, 28672, 28672))
    assert survey.within(table, (1, 48, 36000))  # inside the margin (a factor of about 1.4)
    assert not survey.within(table, (1, 40, 4096)) and not survey.within(table, (1, 4096, 100352))
    assert not survey.within(table, (32768, 4096, 4096))


def test_launch_auto_launches_the_surveyed_rung_with_its_config_else_the_rules_rung(monkeypatch):
    launched = []
    monkeypatch.setattr(dispatch, "launcher", lambda rung: lambda p, *config: launched.append((rung, *config)))
    monkeypatch.setattr(dispatch, "surveyed", lambda p: ("split_k", {"SPLIT_K": 3}))
    dispatch.launch_auto(problem(300, 300, 3000))
    monkeypatch.setattr(dispatch, "surveyed", lambda p: None)
    monkeypatch.setattr(dispatch, "choose_kernel", lambda p: "autotuned")
    dispatch.launch_auto(problem(300, 300, 3000))
    assert launched == [("split_k", {"SPLIT_K": 3}), ("autotuned",)]


@pytest.mark.parametrize("text", ["{not json", '{"schema": "tilegemm-survey/0"}', '{"schema": "tilegemm-survey/1"}',
                                  '{"schema": "tilegemm-survey/1", "configs": [], "shapes": [[1, 2, 3, [[0, 1.0]]]]}',
                                  "[1, 2]"])
def test_a_damaged_table_is_ignored_with_a_warning(text, tmp_path, monkeypatch):
    path = tmp_path / "gpu.json"
    path.write_text(text)
    monkeypatch.setattr(survey, "table_path", lambda name, layout="NN", family="": path)
    monkeypatch.setattr(survey, "_tables", {})
    with pytest.warns(UserWarning, match="damaged survey table"):
        assert survey.table_for("Some GPU") is None
    assert survey.table_for("Some GPU") is None  # read once: no second warning, no error


def test_applies_to_single_products_of_a_surveyed_family_on_a_gpu_only():
    assert [survey.family(d) for d in ("fp16", "bf16", "tf32", "fp8_e4m3", "fp8_e5m2xfp8_e4m3", "fp8_e4m3+fast")] \
        == ["", "", "tf32", "fp8", "fp8", "fp8"]
    assert survey.family("fp32") is None and survey.family("fp16xbf16") is None  # IEEE fp32, mixed 16-bit
    assert survey.why_not(problem(64, 64, 64)) is not None  # CPU tensors: no GPU table speaks for them
    assert survey.why_not(problem(64, 64, 64, torch.float32)) is not None
    if torch.cuda.is_available() and not tilegemm.core.runtime.interpreting():
        assert survey.why_not(problem(64, 64, 64, device="cuda")) is None
        assert survey.why_not(problem(64, 64, 64, torch.float32, device="cuda")) is not None  # IEEE
        a = torch.empty(64, 64, device="cuda")
        tf32 = make_problems(a, a, torch.empty_like(a), None, None, 1.0, 0.0, "none", "tf32", False)[0]
        assert survey.why_not(tf32) is None
        batched = make_problems(a.expand(2, 64, 64), a, torch.empty(2, 64, 64, device="cuda"), None, None, 1.0,
                                0.0, "none", "tf32", False)[0]
        assert batched.batch == 2 and survey.why_not(batched) is not None


def test_tables_are_named_by_gpu_family_and_layout(tmp_path, monkeypatch):
    assert survey.table_path("NVIDIA H200").name == "nvidia-h200.json"
    assert survey.table_path("NVIDIA H200", "NT").name == "nvidia-h200-NT.json"
    assert survey.table_path("NVIDIA H200", "NT", "fp8").name == "nvidia-h200-fp8-NT.json"
    assert survey.table_path("NVIDIA H200", "NN", "tf32").name == "nvidia-h200-tf32.json"
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(dict(schema=survey.SCHEMA, family="tf32", layouts=["NN"], configs=[],
                                    shapes=[])))
    monkeypatch.setattr(survey, "table_path", lambda name, layout="NN", family="": path)
    monkeypatch.setattr(survey, "_tables", {})
    with pytest.warns(UserWarning, match="tf32 family, not fp8"):
        assert survey.table_for("Some GPU", "NN", "fp8") is None  # a table misplaced is refused, not misread
    with pytest.warns(UserWarning, match="NN only"):
        assert survey.table_for("Some GPU", "TT", "tf32") is None  # tile() knows gluon_tf32's NN tile only


def test_gluon_tiles_are_the_kernels_own():
    from tilegemm.ops.matmul import gluon_fp8, gluon_tf32

    assert survey.GLUON_FP8_TILE == (gluon_fp8.BLOCK_M, gluon_fp8.BLOCK_N, gluon_fp8.BLOCK_K)
    assert survey.GLUON_TF32_NN_TILE == (gluon_tf32.BLOCK_S, gluon_tf32.BLOCK_R, gluon_tf32.BLOCK_K)  # C^T's tile
    assert survey.tile(gluon_fp8.configs(2)[0]) == survey.GLUON_FP8_TILE
    assert survey.tile(gluon_tf32.configs(4)[0]) == survey.GLUON_TF32_NN_TILE
    assert survey.tile({"GLUON_F16": True, "BLOCK_M": 128, "BLOCK_N": 256}) == (128, 256, survey.GLUON_BLOCK_K)
    with pytest.raises(KeyError):
        survey.tile({"num_warps": 4})


def test_fit_tool_round_trips_a_survey(tmp_path):
    rows = [dict(M=m, N=256, K=512, cublas_us=10.0, auto_us=12.0,
                 configs=[dict(rung="autotuned", config=dict(BLOCK_M=64), us=10.0 + m),
                          dict(rung="split_k", config=dict(BLOCK_M=16, SPLIT_K=16), us=20.0),
                          dict(rung="persistent_tma", config=dict(BLOCK_M=128), error="no")])
            for m in (3, 30, 300)]
    src = tmp_path / "survey.json"
    src.write_text(json.dumps(dict(machine=dict(gpu="Test GPU"), rows=rows)))
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fit_survey
    finally:
        sys.path.remove(str(ROOT / "tools"))
    gpu, layout, dtype, loaded = fit_survey.load([str(src)])
    doc = fit_survey.table(gpu, [str(src)], loaded, layout, dtype)
    assert layout == "NN" and doc["layouts"] == ["NN"] and dtype == "fp16" and doc["family"] == ""
    assert gpu == "Test GPU" and [s[:3] for s in doc["shapes"]] == [[3, 256, 512], [30, 256, 512], [300, 256, 512]]
    names = [(r, c.get("SPLIT_K")) for r, c in doc["configs"]]
    assert names == [("autotuned", None), ("split_k", "wave")]  # the failed candidate is not kept
    assert doc["shapes"][0][3] == [[0, 1.0], [1, 0.65]]  # 13 us best against 20 us
    assert doc["shapes"][2][3] == [[1, 1.0]]  # 310 us is below the floor against 20 us
    tf32 = tmp_path / "survey-tf32.json"
    tf32.write_text(json.dumps(dict(machine=dict(gpu="Test GPU"), dtype="tf32", rows=rows)))
    gpu, layout, dtype, loaded = fit_survey.load([str(tf32)])
    assert fit_survey.table(gpu, [str(tf32)], loaded, layout, dtype)["family"] == "tf32"
    with pytest.raises(SystemExit, match="tf32"):
        fit_survey.load([str(src), str(tf32)])  # one table per family: fp16 and tf32 do not mix
    # A --splits-only supplement of the same shapes: its candidates join, put on the full survey's scale by the
    # two runs' cuBLAS times (5 us there against 10 here: its 7 us counts as 14 against 10 + m).
    sup = tmp_path / "survey-splits.json"
    sup.write_text(json.dumps(dict(machine=dict(gpu="Test GPU"), rows=[
        dict(M=3, N=256, K=512, cublas_us=5.0, configs=[dict(rung="persistent_tma", config=dict(BLOCK_M=128, SPLIT_K=4),
                                                              us=7.0)])])))
    gpu, layout, dtype, loaded = fit_survey.load([str(src)])
    merged = fit_survey.supplement(loaded, [str(sup)], gpu, layout, dtype)
    doc = fit_survey.table(gpu, [str(src), str(sup)], merged, layout, dtype)
    assert [(r, c.get("SPLIT_K")) for r, c in doc["configs"]] == [("autotuned", None), ("persistent_tma", "wave"),
                                                                  ("split_k", "wave")]
    assert doc["shapes"][0][3] == [[0, 1.0], [1, 0.929], [2, 0.65]]  # 13 us best; 7 us x 2 = 14 us; 20 us
    assert doc["shapes"][1][3] == [[0, 0.5], [2, 1.0]]  # another shape: as it was (40 and 20 us)
    other = tmp_path / "survey-other.json"
    other.write_text(json.dumps(dict(machine=dict(gpu="Other GPU"), rows=[])))
    with pytest.raises(SystemExit, match="Other GPU"):
        fit_survey.supplement(loaded, [str(other)], gpu, layout, dtype)
    ieee = tmp_path / "survey-fp32.json"
    ieee.write_text(json.dumps(dict(machine=dict(gpu="Test GPU"), dtype="fp32", rows=rows)))
    with pytest.raises(SystemExit, match="no table speaks for"):
        fit_survey.load([str(ieee)])


# --- GPU -----------------------------------------------------------------------------------------------------


def _spy(monkeypatch):
    picks = []
    real = dispatch.surveyed
    monkeypatch.setattr(dispatch, "surveyed", lambda p: picks.append(real(p)) or picks[-1])
    return picks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("shape", [(3, 7000, 2600), (96, 1000, 9000), (700, 3000, 1800), (5000, 200, 4400)],
                         ids=lambda s: "x".join(map(str, s)))
def test_unseen_shapes_run_the_surveyed_choice_correctly(dtype, layout, shape, monkeypatch):
    if not survey.table_path(torch.cuda.get_device_name()).exists():
        pytest.skip("no survey table for this GPU: auto uses its rules")
    M, N, K = shape
    a = torch.randn(K, M, device="cuda", dtype=dtype).mT if layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).mT if layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    picks = _spy(monkeypatch)
    out = tilegemm.matmul(a, b, bias=bias, activation="relu")
    p = make_problems(a, b, torch.empty(M, N, device="cuda", dtype=dtype), None, None, 1.0, 0.0, "none", "ieee",
                      False)[0]
    if survey.table_path(torch.cuda.get_device_name(), layout).exists() and rows_aligned(p):
        # a surveyed layout (NN, NT, TN) and rows 16-byte aligned (TN with M = 3: A's rows are 6 bytes apart)
        assert picks and picks[0] is not None, f"an unseen aligned 16-bit {layout} shape takes the survey's choice"
    ref = torch.relu(matmul_reference(a, b) + bias.double())
    assert_rel_close(out, ref, tolerance(dtype))


def _family_operands(family: str, M: int, N: int, K: int, layout: str = "NN"):
    """(a, b, matmul kwargs, output dtype, tolerance) for a product of ``family`` ("" 16-bit, "tf32", "fp8")."""
    dtype = {"": torch.float16, "tf32": torch.float32, "fp8": torch.float8_e4m3fn}[family]

    def operand(rows, cols, transposed):
        x = torch.randn(*((cols, rows) if transposed else (rows, cols)), device="cuda").to(dtype)
        return x.T if transposed else x

    a, b = operand(M, K, layout[0] == "T"), operand(K, N, layout[1] == "T")
    if family == "fp8":
        kwargs = dict(scale_a=torch.tensor(0.5, device="cuda"), scale_b=torch.tensor(2.0, device="cuda"),
                      out_dtype=torch.bfloat16)
        return a, b, kwargs, torch.bfloat16, tolerance(torch.float8_e4m3fn, "ieee", torch.bfloat16)
    precision = "tf32" if family == "tf32" else "ieee"
    return a, b, dict(precision=precision), dtype, tolerance(dtype, precision)


def _problem(a, b, out, kwargs):
    scales = (kwargs.get("scale_a"), 0, kwargs.get("scale_b"), 0)
    return make_problems(a, b, out, None, None, 1.0, 0.0, "none", kwargs.get("precision", "ieee"), False, scales)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("family,layout", [("", "NN"), ("", "NT"), ("", "TN"), ("tf32", "NN"), ("fp8", "NT")])
def test_every_candidate_of_the_gpus_table_launches_correctly(family, layout):
    """Each config the table of a family and layout can name, launched as auto launches it, on one shape it is
    valid for."""
    path = survey.table_path(torch.cuda.get_device_name(), layout, family)
    if not path.exists():
        pytest.skip(f"no {family or '16-bit'} {layout} survey table for this GPU")
    doc = json.loads(path.read_text())
    M, N, K = 200, 528, 2064
    a, b, kwargs, out_dtype, tol = _family_operands(family, M, N, K, layout)
    ref = matmul_reference(a, b)  # the fp8 scales multiply to 1
    for rung, cfg in doc["configs"]:
        out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
        p = _problem(a, b, out, kwargs)
        dispatch.launcher(rung)(p, survey._resolved(p, rung, cfg))
        assert_rel_close(out, ref, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("family,layout", [("tf32", "NN"), ("fp8", "NT")])
@pytest.mark.parametrize("shape", [(5, 3000, 4000), (700, 1500, 2000), (3000, 200, 6000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_unseen_tf32_and_fp8_shapes_take_their_familys_table(family, layout, shape, monkeypatch):
    if not survey.table_path(torch.cuda.get_device_name(), layout, family).exists():
        pytest.skip(f"no {family} {layout} survey table for this GPU: auto uses its rules")
    M, N, K = shape
    a, b, kwargs, _, tol = _family_operands(family, M, N, K, layout)
    picks = _spy(monkeypatch)
    out = tilegemm.matmul(a, b, **kwargs)
    assert picks and picks[0] is not None, f"an unseen aligned {family} {layout} shape takes its table's choice"
    assert_rel_close(out, matmul_reference(a, b), tol)


@pytest.mark.gpu
def test_no_tma_config_where_tma_cannot_describe_the_problem():
    """A's base 8 bytes off a 16-byte boundary (rows still aligned): persistent_tma cannot take it, so the
    survey must pick among the pointer kernels, and the product stays right."""
    if not survey.table_path(torch.cuda.get_device_name()).exists():
        pytest.skip("no survey table for this GPU")
    M, N, K = 2000, 3000, 2048
    base = torch.randn(M, K + 8, device="cuda", dtype=torch.float16)
    a = base[:, 4:K + 4]
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    picked = dispatch.surveyed(p)
    assert picked is not None and picked[0] != "persistent_tma", picked
    assert_rel_close(tilegemm.matmul(a, b), matmul_reference(a, b), tolerance(torch.float16))
