"""Kernel ``gluon`` without a GPU: its plan (the row tiles a launch walks, made from ``offs`` on the device) under
the interpreter against a plain-Python walk of the groups; the warp-specialized kernel compiled for sm_90 (Triton's
compiler and ptxas: TMA loads into wgmma, no spills, every variant a config, b layout and epilogue give); the
problems it refuses, by name. Its results on the GPU: test_grouped_gluon_gpu.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tilegemm.core import registry
from tilegemm.ops.grouped import configs, dispatch
from tilegemm.ops.grouped.configs import row_tiles
from tilegemm.ops.grouped.problem import make_problem

from conftest import SM90, compile_offline

gluon = pytest.importorskip("tilegemm.ops.grouped.gluon")


def walk(offs: list[int], M: int, bm: int) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of every row tile, in order: each group's rows (offs clamped to [0, M]) cut
    into bm-row tiles from its first row, then the rows past offs[-1] as group G's."""
    tiles, prev = [], 0
    for g, end in enumerate(offs):
        start, end = min(max(prev, 0), M), min(max(end, 0), M)
        tiles += [(g, m0, end) for m0 in range(start, end, bm)]
        prev = offs[g]
    last = min(max(offs[-1], 0), M)
    return tiles + [(len(offs), m0, M) for m0 in range(last, M, bm)]


def plan_of(offs: list[int], M: int, bm: int) -> list[tuple[int, int, int]]:
    G = len(offs)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the plan kernel runs where the launch would)
    p = make_problem("2d3d", G, torch.zeros(M, 8, device=dev), torch.zeros(G, 8, 8, device=dev),
                     torch.tensor(offs, dtype=torch.int32, device=dev), None, torch.full((M, 8), float("nan"),
                                                                                          device=dev))
    table = gluon.plan(p, bm)
    n = int(table[0])
    assert n <= row_tiles(M, G, bm)  # the launch's bound on the units holds
    return [tuple(int(v) for v in table[1 + 3 * i: 4 + 3 * i].cpu()) for i in range(n)]


@pytest.mark.parametrize("offs, M, bm", [
    ([0, 700, 700, 701, 1001, 1130, 1130, 2130, 2167, 2167], 2244, 128),  # empty first/middle/last, one row, tail
    ([5], 5, 128),  # one group smaller than a tile
    ([0, 0, 0], 10, 16),  # every group empty: the tail alone
    ([3, 3, 10], 10, 16),
    ([100] * 4, 300, 64),
    ([64, 128, 192], 192, 64),  # groups of whole tiles, no tail
])
def test_plan_walks_the_groups(offs, M, bm):
    assert plan_of(offs, M, bm) == walk(offs, M, bm)


def test_plan_never_counts_past_its_bound():
    # offs that decrease (unchecked on the device: wrong numbers, never an access out of bounds) count more row
    # tiles than the launch's bound; the plan's count stops at the bound, and a stale row of an earlier, larger
    # call's table is never walked
    plan_of([4000, 8000], 8000, 128)  # an earlier call leaves rows in the stream's table
    offs, M, bm = [1024, 0, 1024], 1024, 128
    tiles = plan_of(offs, M, bm)
    assert len(tiles) == row_tiles(M, len(offs), bm)
    assert all(end <= M and m0 < M for _, m0, end in tiles)


def test_plan_random_routings():
    rng = random.Random(7)
    for _ in range(12):
        G = rng.choice([1, 2, 7, 64, 130])  # 130: more groups than the plan kernel's block of row tiles
        sizes = [rng.choice([0, 0, 1, rng.randrange(1, 300)]) for _ in range(G)]
        ends = [sum(sizes[:i + 1]) for i in range(G)]
        M = ends[-1] + rng.choice([0, 0, 5, 200])
        bm = rng.choice([64, 128])
        assert plan_of(ends, M, bm) == walk(ends, M, bm), (sizes, M, bm)


def problem(dtype=torch.bfloat16, b_nk=True, bias=None, activation="none", gated=False, out_dtype=None, K=256, N=512,
            M=300):
    G = 4
    a = torch.empty(M, K, dtype=dtype)
    width = 2 * N if gated else N
    b = torch.empty(G, width, K, dtype=dtype).transpose(1, 2) if b_nk else torch.empty(G, K, width, dtype=dtype)
    out = torch.empty(M, N, dtype=out_dtype or dtype)
    return make_problem("2d3d", G, a, b, torch.tensor([50, 50, 200, 300], dtype=torch.int32), bias, out, "ieee",
                        activation, gated)


@pytest.fixture
def on_hopper(monkeypatch):
    """why_not past its first check (an sm_90 GPU with Gluon), so the problem's own reasons show."""
    monkeypatch.setattr(gluon, "why_not_gluon", lambda: None)


def test_takes_the_moe_forward(on_hopper):
    assert gluon.why_not(problem()) is None
    assert gluon.why_not(problem(torch.float16, b_nk=False, bias=torch.empty(4, 512, dtype=torch.float16),
                                 activation="silu")) is None


@pytest.mark.parametrize("make, words", [
    (lambda: problem(gated=True), "gated"),
    (lambda: problem(torch.float32), "fp16 and bf16"),
    (lambda: problem(out_dtype=torch.float32), "stores the operands' dtype"),
    (lambda: problem(K=0), "K is 0"),
    (lambda: problem(K=100), "16-byte aligned"),
    (lambda: make_problem("3d3d", 2, torch.empty(2, 8, 16, dtype=torch.bfloat16),
                          torch.empty(2, 16, 8, dtype=torch.bfloat16), None, None,
                          torch.empty(2, 8, 8, dtype=torch.bfloat16)), "2-D x 3-D"),
])
def test_refuses_by_name(on_hopper, make, words):
    assert words in gluon.why_not(make())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without an sm_90 GPU (the GPU tests "
                    "run the kernel there)")
def test_refuses_without_a_hopper_gpu():
    # the interpreter (or any non-sm_90 machine): named, and a launch by name raises NotApplicable
    assert gluon.why_not(problem()) is not None
    with pytest.raises(registry.NotApplicable, match="gluon"):
        gluon.run(problem())


def test_auto_rule(monkeypatch):
    # on Hopper (both kernels taking the problem): gluon from 256 rows an expert on average for the plain product;
    # tma below it and for the gated product
    monkeypatch.setattr(dispatch, "takes_gluon", lambda p: not p.gated)
    monkeypatch.setattr(dispatch, "takes_tma", lambda p: True)

    def choose(M, G=4, gated=False):
        b = torch.zeros(G, 64, 64 if gated else 32)
        return dispatch.choose(make_problem("2d3d", G, torch.zeros(M, 64), b, torch.zeros(G, dtype=torch.int32),
                                            None, torch.zeros(M, 32), "ieee", "silu" if gated else "none", gated))

    assert choose(4 * 256) == "gluon"
    assert choose(4 * 256 - 1) == "tma"
    assert choose(4 * 1024, gated=True) == "tma"
    assert choose(4 * 16) == "tiled"


def test_candidate_knobs(monkeypatch):
    # knobs of tools/grouped_rule_candidates.py, read when a call runs: GLUON_FORWARD (off: tma takes the products
    # gluon would) and configs.GLUON_BLOCK (the tile config() takes, the ring still by K)
    monkeypatch.setattr(dispatch, "takes_gluon", lambda p: not p.gated)
    monkeypatch.setattr(dispatch, "takes_tma", lambda p: True)
    p = problem(K=4096, M=4 * 1024)  # 1024 rows an expert on average
    assert dispatch.GLUON_FORWARD is True and dispatch.choose(p) == "gluon"
    monkeypatch.setattr(dispatch, "GLUON_FORWARD", False)
    assert dispatch.choose(p) == "tma"
    assert configs.GLUON_BLOCK == (128, 256)
    assert (gluon.config(p)["BLOCK_M"], gluon.config(p)["BLOCK_N"], gluon.config(p)["SHARED_OUT"]) == (128, 256, True)
    monkeypatch.setattr(configs, "GLUON_BLOCK", (256, 128))
    for K, shared in ((4096, True), (256, False)):
        cfg = gluon.config(problem(K=K))
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SHARED_OUT"]) == (256, 128, shared), cfg
        assert cfg in gluon.configs()
    monkeypatch.setattr(configs, "GLUON_BLOCK", (64, 64))  # no such tile: the table's first of the ring kind
    assert gluon.config(problem(K=4096)) == gluon.configs()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto without an sm_90 GPU (the GPU tests pin it there)")
def test_registered_beside_tma_and_not_auto_without_a_gpu():
    assert "gluon" in registry.kernels("grouped")
    bf = torch.bfloat16
    p = make_problem("2d3d", 4, torch.zeros(1024, 64, dtype=bf), torch.zeros(4, 64, 32, dtype=bf),
                     torch.tensor([256, 512, 768, 1024], dtype=torch.int32), None, torch.zeros(1024, 32, dtype=bf))
    assert dispatch.gluon_rows(p)  # rows enough: only the machine keeps auto off it
    assert dispatch.choose(p) == "tiled"


def test_refuses_no_groups(on_hopper):
    bf = torch.bfloat16
    p = make_problem("2d3d", 0, torch.zeros(512, 64, dtype=bf), torch.zeros(0, 64, 32, dtype=bf),
                     torch.zeros(0, dtype=torch.int32), None, torch.zeros(512, 32, dtype=bf))
    assert "no groups" in gluon.why_not(p)


SCRIPT = SM90 + (Path(__file__).parent / "_sm90_one_ptxas.py").read_text() + r'''
import json, re, sys
import torch
from tilegemm.ops.grouped import gluon as gg
from tilegemm.ops.grouped.problem import make_problem

report = {}
for name, v in json.loads(sys.argv[1]).items():
    dt = getattr(torch, v["dtype"])
    G, M, K, N = 8, 8192, v["K"], 4096
    a = torch.empty(M, K, dtype=dt)
    b = torch.empty(G, N, K, dtype=dt).transpose(1, 2) if v["b_nk"] else torch.empty(G, K, N, dtype=dt)
    bias = torch.empty(G, N, dtype=dt) if v["bias"] else None
    p = make_problem("2d3d", G, a, b, torch.empty(G, dtype=torch.int32), bias, torch.empty(M, N, dtype=dt), "ieee",
                     v["act"])
    cfg = gg.configs()[v["cfg"]] if "cfg" in v else gg.config(p)  # a candidate by its index, or auto's
    kernel, grid, args, kwargs = gg.launch_args(p, cfg, torch.empty(64, dtype=torch.int32), 132)
    sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
    compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
    report[name] = dict(
        cfg=cfg, grid=grid,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.[23]d\.shared::cluster\.global", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx)),
        cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
        setmaxnreg=len(re.findall(r"setmaxnreg", ptx)),
        shared=compiled.metadata.shared,
        spills=[int(n) for n in re.findall(r"(\d+) bytes spill stores", info)],
    )
print(json.dumps(report))
'''

VARIANTS = {
    "bf16_b_nk_long_k": dict(dtype="bfloat16", b_nk=True, K=14336, bias=False, act="none"),
    "fp16_b_kn_short_k_bias_silu": dict(dtype="float16", b_nk=False, K=1024, bias=True, act="silu"),
    # the 256 x 128 candidates (consumers of 128 rows x 128 columns), both rings
    "bf16_b_nk_256x128_shared": dict(dtype="bfloat16", b_nk=True, K=4096, bias=True, act="none", cfg=2),
    "fp16_b_kn_256x128_own": dict(dtype="float16", b_nk=False, K=4096, bias=False, act="relu", cfg=3),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_offline(tmp_path_factory.mktemp("grouped-gluon"), SCRIPT, VARIANTS, timeout=600)


@pytest.mark.parametrize("name", VARIANTS)
def test_compiles_warp_specialized_for_sm90(compiled, name):
    c = compiled[name]
    assert c["wgmma"] > 0 and c["tma_loads"] >= 2 and c["tma_stores"] >= 1, c
    assert c["cp_async"] == 0, c  # every operand by TMA
    assert c["setmaxnreg"] >= 2, c  # the partitions' register budgets
    assert c["spills"] and max(c["spills"]) == 0, c
    assert c["shared"] <= 232448, c  # within an sm_90 block's shared memory
    assert c["grid"] == [132] or c["grid"] == (132,), c


def test_ring_follows_k(compiled):
    # the long K product takes the shared output buffer and 4 slots; the short one a buffer a consumer
    assert compiled["bf16_b_nk_long_k"]["cfg"]["SHARED_OUT"] is True
    assert compiled["bf16_b_nk_long_k"]["cfg"]["STAGES"] == 4
    assert compiled["fp16_b_kn_short_k_bias_silu"]["cfg"]["SHARED_OUT"] is False
