"""Offline (no GPU): does a wave-aware correction of the survey's neighbour ranking choose better?

``auto``'s untimed choice (tilegemm.ops.matmul.survey) ranks candidates by their efficiency on the nearest
surveyed shapes. A candidate's efficiency there partly reflects how its grid filled the GPU at that shape (its
tile count, the partial last wave, the padding of edge tiles), which differs at the target. The variants here
move each neighbour's log-efficiency by how the candidate's utilization changes from the neighbour to the target:

    score(c, T) = sum_n w_n [log eff(c, n) + ALPHA (log u(c, T) - log u(c, n))]

with u one of
- ``wave``: programs / (ceil(programs / slots) * slots), programs = tiles * SPLIT_K (``autotuned``, ``split_k``;
  slots = sms * programs an SM holds: 1, 2 or from shared memory), tiles for ``persistent_tma`` (slots = sms);
  a ``"wave"`` split counts 1 (it fills the GPU by construction);
- ``util``: the useful share of what the launched waves could compute: M N K / (waves * slots * BLOCK_M * BLOCK_N
  * K per program), i.e. the wave factor times the padding of edge tiles and of K slices (a ``"wave"`` split with
  the split ``split_k.wave_split`` computes for the shape); ``util filled``: the same, a ``"wave"`` split counted as
  filling the GPU (its tiles' padding only: no split_k import, what ``survey.utilization`` computes);
- ``pad``: the padding alone (no waves).

Also: the correction applied to the candidates a neighbour kept only (its floor left as it is), ALPHA from 0.25 to
1.25, and the H200's seed-23 survey with N and K multiples of 8 (never in a table) as a held-out set. The few-tile
long-K subset: fewer 128x128 output tiles than half the SMs and K >= 1024.

Verdict (offline, at 7642831): waves alone (any slots per SM) or padding alone choose worse; both together
(utilization, one program an SM) better on every set, leave-one-out and cross-seed and held out, ALPHA 0.25-1;
shipped as ``util filled`` with ALPHA 0.5 (``survey.WAVE_WEIGHT``): +1.3% to +2.9% geomean (``shipped`` row).

Scores are those of ``tools/fit_survey.py --check``: cuBLAS time / the chosen candidate's time, geomean and
worst, each surveyed shape chosen from the other shapes' data (leave-one-out), and cross-seed (the table built
from one seed's rows, the other seed's shapes chosen from it). Candidates: those the survey timed on the shape
(the survey timed exactly the candidates valid for it), with ``split_k``'s split checked as ``survey`` does.

    python3 research/explore_survey_waves.py
"""

from __future__ import annotations

import json
import math
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tools")]

from fit_survey import load, table  # noqa: E402
from tilegemm.ops.matmul import survey  # noqa: E402
from tilegemm.ops.matmul.split_k import sensible_split, wave_split  # noqa: E402

RES = ROOT / "benchmarks" / "results"
SETS = {
    "H200 NN": [RES / "2026-11-24-h200/b3a0245/survey-fp16-s7-0.json.xz",
                RES / "2026-11-24-h200/b3a0245/survey-fp16-s11-0.json.xz"],
    "H200 NT": [RES / "2026-11-24-h200/db70881/survey-fp16-s7-NT-0.json.xz"],
    "H200 TN": [RES / "2026-11-24-h200/cd4832f/survey-fp16-s7-TN-0.json.xz"],
    "H100 NN": [RES / "2026-11-24-h100/b3a0245/survey-fp16-s7-0.json.xz",
                RES / "2026-11-24-h100/b3a0245/survey-fp16-s11-0.json.xz"],
    "H100 NT": [RES / "2026-11-24-h100/db70881/survey-fp16-s7-NT-0.json.xz"],
    "H100 TN": [RES / "2026-11-24-h100/bd835e0/survey-fp16-s7-TN-0.json.xz"],
}
SMS = 132  # H200 and H100 SXM
SMEM = 228 * 1024  # shared memory per SM (sm_90)
GLUON_BLOCK_K = 64


def cdiv(a, b):
    return -(-a // b)


def few_tiles_long_k(M, N, K) -> bool:
    """The subset the wave-blind ranking got wrong: fewer 128x128 output tiles than half the SMs, K >= 1024."""
    return cdiv(M, 128) * cdiv(N, 128) < SMS // 2 and K >= 1024


class Candidate:
    def __init__(self, rung: str, cfg: dict):
        self.rung, self.cfg = rung, cfg
        self.bm, self.bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        self.bk = cfg.get("BLOCK_K", GLUON_BLOCK_K)
        self.split = cfg.get("SPLIT_K", 1)
        self.persistent = rung == "persistent_tma"
        stages = cfg.get("num_stages", cfg.get("STAGES", 3))
        smem = (self.bm + self.bn) * self.bk * 2 * stages + 1024
        self.fit = max(1, min(SMEM // smem, 64 // cfg.get("num_warps", 4)))  # programs an SM holds

    def valid(self, M, N, K) -> bool:
        if self.rung != "split_k" or self.split == "wave":
            return True
        return sensible_split(self.split, cdiv(M, self.bm) * cdiv(N, self.bn), cdiv(K, self.bk), SMS)

    def programs(self, M, N, K, actual_wave: bool) -> tuple[int, int]:
        """(programs, K steps per program)."""
        tiles = cdiv(M, self.bm) * cdiv(N, self.bn)
        steps = cdiv(K, self.bk)
        split = self.split
        if split == "wave":
            split = wave_split(tiles, steps, SMS) if actual_wave else None
        if split is None:
            return None, None
        return tiles * split, cdiv(steps, split)

    def log_u(self, M, N, K, kind: str, per_sm) -> float:
        slots = SMS * (1 if self.persistent else (self.fit if per_sm == "smem" else per_sm))
        progs, steps = self.programs(M, N, K, actual_wave=kind == "util")
        if progs is None:  # a wave split, counted as filling the GPU (``util filled``: but for its tiles' padding)
            if kind != "util filled":
                return 0.0
            return math.log(M * N / (cdiv(M, self.bm) * cdiv(N, self.bn) * self.bm * self.bn))
        waves = cdiv(progs, slots)
        if kind == "wave":
            return math.log(progs / (waves * slots))
        if kind == "pad":  # the padding alone, no waves
            return math.log(M * N * K / (progs * self.bm * self.bn * steps * self.bk))
        return math.log(M * N * K / (waves * slots * self.bm * self.bn * steps * self.bk))


def make_rank(cands: list[Candidate], kind=None, per_sm=1, alpha=1.0, correct_floor=True):
    """A ranking function (indexed shapes, target, candidate indices) -> indices best first. ``kind="shipped"``:
    ``survey._rank`` as ``auto`` ranks (the same as ``util filled``, 1/SM, alpha = ``survey.WAVE_WEIGHT``)."""
    if kind == "shipped":
        configs = [(c.rung, c.cfg) for c in cands]
        return lambda indexed, target, candidates: survey._rank(indexed, target, candidates, configs, SMS)

    @lru_cache(maxsize=None)
    def lu(i, M, N, K):
        return cands[i].log_u(M, N, K, kind, per_sm)

    def rank(indexed, target, candidates):
        logs = [math.log2(max(d, 1)) for d in target]

        def away(shape):
            return abs(shape[0] - logs[0]) + abs(shape[1] - logs[1]) + abs(shape[2] - logs[2])

        score = dict.fromkeys(candidates, 0.0)
        for shape in sorted(indexed, key=away)[:survey.NEIGHBOURS]:
            weight = 1.0 / (survey.DISTANCE_SOFTENING + away(shape))
            kept, dims = shape[3], shape[4]
            for i in candidates:
                s = math.log(kept.get(i, survey.FLOOR))
                if kind and (correct_floor or i in kept):
                    s += alpha * (lu(i, *target) - lu(i, *dims))
                score[i] += weight * s
        return sorted(candidates, key=lambda i: (-score[i], i))

    return rank


class Set:
    """A GPU's survey of one layout: its files' rows, the table built from all of them, and the candidates."""

    def __init__(self, paths, held_out=None):
        self.gpu, self.layout, _, self.rows = load([str(p) for p in paths])
        self.seeds = [load([str(p)])[3] for p in paths]  # rows per file (one seed each)
        self.held_out = load([str(held_out)])[3] if held_out else None
        everything = self.rows + (self.held_out or [])
        self.names = sorted({c for *_, timed in everything for c in timed})
        self.index = {n: i for i, n in enumerate(self.names)}
        self.cands = [Candidate(r, json.loads(c)) for r, c in self.names]
        self.indexed = self.shapes(self.rows)

    def shapes(self, rows):
        """The table ``tools/fit_survey.py`` builds from ``rows``, indexed as ranking reads it (our indices)."""
        doc = table(self.gpu, [], rows, self.layout)
        remap = [self.index[(r, json.dumps(c, sort_keys=True))] for r, c in doc["configs"]]
        return [(*sh[:3], {remap[i]: e for i, e in sh[3].items()}, tuple(shape[:3]))
                for sh, shape in zip(survey._indexed(doc["shapes"]), doc["shapes"])]

    def pick(self, rank, shapes, row):
        M, N, K, cublas, _, timed = row
        valid = [self.index[c] for c in timed if self.cands[self.index[c]].valid(M, N, K)]
        return (M, N, K), cublas / timed[self.names[rank(shapes, (M, N, K), valid)[0]]]

    def loo(self, rank):
        return [self.pick(rank, self.indexed[:j] + self.indexed[j + 1:], row) for j, row in enumerate(self.rows)]

    def cross(self, rank):
        """Each seed's shapes chosen from a table built from the other seed's rows."""
        if len(self.seeds) != 2:
            return []
        return [self.pick(rank, self.shapes(self.seeds[src]), row)
                for src, dst in ((0, 1), (1, 0)) for row in self.seeds[dst]]

    def held(self, rank):
        """The held-out survey's shapes chosen from the table of all the other rows."""
        return [self.pick(rank, self.indexed, row) for row in self.held_out] if self.held_out else []


def gm(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summary(results):
    xs = [x for _, x in results]
    sub = [x for s, x in results if few_tiles_long_k(*s)]
    return gm(xs), min(xs), gm(sub), len(sub)


VARIANTS = {
    "current": dict(kind=None),
    "shipped": dict(kind="shipped"),
    "wave 1/SM": dict(kind="wave", per_sm=1),
    "wave 2/SM": dict(kind="wave", per_sm=2),
    "wave smem": dict(kind="wave", per_sm="smem"),
    "util 1/SM": dict(kind="util", per_sm=1),
    "util 2/SM": dict(kind="util", per_sm=2),
    "util smem": dict(kind="util", per_sm="smem"),
    "pad only": dict(kind="pad"),
    "util filled 1/SM": dict(kind="util filled", per_sm=1),
    "util filled a=.5": dict(kind="util filled", per_sm=1, alpha=0.5),
    "util kept only": dict(kind="util", per_sm=1, correct_floor=False),  # a neighbour's floor left as it is
}
SENSITIVITY = {f"{kind} 1/SM a={a}": dict(kind=kind, per_sm=1, alpha=a)
               for kind in ("util", "util filled", "wave", "pad") for a in (0.25, 0.5, 0.75, 1.0, 1.25)}
# The H200's survey of seed 23 with N and K multiples of 8 (not 16): never in the shipped tables, held out.
HELD_OUT = RES / "2026-11-24-h200/e2b0011/survey-fp16-s23-m8-0.json.xz"


def main() -> None:
    sets = {name: Set(paths, HELD_OUT if name == "H200 NN" else None) for name, paths in SETS.items()}
    for name, s in sets.items():
        best = [cublas / min(timed.values()) for *_, cublas, _, timed in s.rows]
        print(f"{name}: {len(s.rows)} shapes, {len(s.names)} candidates, best candidate {gm(best):.4f}; "
              f"few tiles long K: {sum(few_tiles_long_k(*r[:3]) for r in s.rows)} shapes")
    columns = [(f"LOO {name}", s, Set.loo) for name, s in sets.items()]
    columns += [(f"cross-seed {name}", s, Set.cross) for name, s in sets.items() if len(s.seeds) == 2]
    columns += [("H200 s23-m8 held out", sets["H200 NN"], Set.held)]

    for variants in (VARIANTS, SENSITIVITY):
        print(f"\ngeomean (worst) [few-tile long-K geomean] against cuBLAS\n{'':18}"
              + "".join(f"{label:>25}" for label, *_ in columns))
        for label, kw in variants.items():
            cells = []
            for _, s, how in columns:
                g, w, sub, _ = summary(how(s, make_rank(s.cands, **kw)))
                cells.append(f"{g:.4f} ({w:.2f}) [{sub:.3f}]".rjust(25))
            print(f"{label:18}" + "".join(cells))


if __name__ == "__main__":
    main()
