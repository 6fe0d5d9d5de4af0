"""A/B on the GPU, in one process: ``auto`` with a choice of its against ``auto`` without it, on unseen shapes
(not a test).

- default: the survey against the rules alone, on shapes of one layout drawn like ``tools/survey_configs.py``
  draws them, from a seed no table was built from;
- ``--misaligned``: ``split_k.misaligned_config`` against the rules before it, on the misaligned third of a
  random-sweep-like draw (another seed than the sweep's) with M <= 16;
- ``--utilization``: the survey's ranking with its utilization correction (``survey.WAVE_WEIGHT``) against
  without it (0), on shapes drawn as by default;
- ``--rung-entries``: the survey speaking for a shape class whose shipped entries are configs of single rungs
  (no ``auto`` entry: no measured choice between rungs; shipped since e5e991f) against those entries keeping it
  out (the former rule), on those classes of the GPU's shipped table (``--dtype``, ``--layout``);
- ``--restride``: operands whose rows straddle 128-byte lines copied first (``dispatch._restrides``) against
  read as they are, on the aligned shapes of a random-sweep-like draw (another seed than the sweep's) with N or
  K not a multiple of 64.

For each shape: cuBLAS, auto, auto with the choice turned off; do_bench medians, alternating, the better of
two rounds. Writes ``$OUT/ab-<survey|misaligned>-<dtype>-<layout>-s<seed>.json``.

    PYTHONPATH=src python3 research/ab_survey.py --layout NT --seed 29 --count 80 [--dtype fp16] [--budget 300]
    PYTHONPATH=src python3 research/ab_survey.py --misaligned --seed 31 --count 60
    PYTHONPATH=src python3 research/ab_survey.py --utilization --layout NN --seed 37 --count 80
    PYTHONPATH=src python3 research/ab_survey.py --restride --layout NN --seed 41 --count 60
    PYTHONPATH=src python3 research/ab_survey.py --rung-entries --layout NN --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import tilegemm
import torch
import triton.testing
from tilegemm.ops.matmul import dispatch, replay, split_k, survey
from tilegemm.ops.matmul.bench import _random_cases

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from survey_configs import survey_shapes  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def operands(M, N, K, layout, dtype):
    a = torch.randn(K, M, device="cuda", dtype=dtype).mT if layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).mT if layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    return a, b


def rung_entry_classes(dtype: str, layout: str):
    """(shapes, owner, name, off) for ``--rung-entries``: the shape classes of the shipped table with entries
    for single rungs and none for ``auto``; ``off`` replaces ``dispatch._survey_speaks`` by the former rule,
    under which an entry of any rung kept the survey out."""
    from tilegemm.core import tuning

    tuning._load()
    keys = [tuning.parse_key(k) for k in list(tuning._memory)]
    classes = {k[1:4] for k in keys if k and k[0] != "auto" and k[4] == dtype and k[5] == dtype and k[6] == layout}
    decided = {k[1:4] for k in keys if k and k[0] == "auto" and k[4] == dtype and k[6] == layout}

    def former(p):
        return survey.applies(p) and survey.covers(p) and not any(
            tuning.lookup(tuning.key(r, p.M, p.N, p.K, p.tuning_dtype, p.out.dtype, p.layout)) is not None
            for r in dispatch._RUNGS_TUNED)

    return sorted(classes - decided), dispatch, "_survey_speaks", former


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="NT")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--count", type=int, default=80)
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--misaligned", action="store_true")
    ap.add_argument("--utilization", action="store_true")
    ap.add_argument("--restride", action="store_true")
    ap.add_argument("--rung-entries", action="store_true")
    a_ = ap.parse_args()
    if a_.rung_entries:
        shapes, owner, name, off = rung_entry_classes(a_.dtype, a_.layout)
    elif a_.restride:
        if a_.seed == 2026:
            raise SystemExit("seed 2026 is the bench's random sweep")
        cases = _random_cases(30 * a_.count, a_.seed)
        shapes = [tuple(c.dims.values()) for i, c in enumerate(cases) if i % 3 != 2
                  and all(d % 8 == 0 for d in c.dims.values()) and (c.dims["N"] % 64 or c.dims["K"] % 64)][:a_.count]
        owner, name, off = dispatch, "_restrides", lambda p, a, b: ""
    elif a_.misaligned:
        if a_.seed == 2026:
            raise SystemExit("seed 2026 is the bench's random sweep")
        cases = _random_cases(30 * a_.count, a_.seed)
        shapes = [tuple(c.dims.values()) for i, c in enumerate(cases) if i % 3 == 2 and c.dims["M"] <= 16][:a_.count]
        owner, name, off = split_k, "misaligned_config", lambda p: None
    elif a_.utilization:
        shapes = survey_shapes(a_.count, a_.seed)
        owner, name, off = survey, "WAVE_WEIGHT", 0.0
    else:
        shapes = survey_shapes(a_.count, a_.seed)
        owner, name, off = dispatch, "surveyed", lambda p: None
    dtype = DTYPES[a_.dtype]
    bench = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3  # noqa: E731
    real = getattr(owner, name)
    rows, t0 = [], time.time()
    for M, N, K in shapes:
        a, b = operands(M, N, K, a_.layout, dtype)
        ref = torch.matmul(a.float(), b.float())
        row = dict(shape=f"{M}x{N}x{K}")
        picks = []
        if not a_.utilization:
            setattr(owner, name, lambda *args: picks.append(real(*args)) or picks[-1])
        replay.clear()
        survey._choices.clear()
        dispatch._decisions.clear()
        out = tilegemm.matmul(a, b)
        row["pick"] = picks[0] if picks else None
        row["err"] = float(((out.float() - ref).norm() / ref.norm()).item())
        setattr(owner, name, real)
        cub, on, off_ = [], [], []
        for _ in range(2):
            cub.append(bench(lambda: torch.matmul(a, b)))
            replay.clear()
            survey._choices.clear()
            on.append(bench(lambda: tilegemm.matmul(a, b)))
            setattr(owner, name, off)
            replay.clear()
            survey._choices.clear()
            try:
                off_.append(bench(lambda: tilegemm.matmul(a, b)))
            finally:
                setattr(owner, name, real)
                replay.clear()
                survey._choices.clear()
                dispatch._decisions.clear()
        row.update(cublas_us=min(cub), with_us=min(on), without_us=min(off_))
        rows.append(row)
        print(f"{row['shape']:>18} cuBLAS {row['cublas_us']:7.1f}  with {row['with_us']:7.1f}  without "
              f"{row['without_us']:7.1f}  err {row['err']:.1e}  {row['pick'] or '-'}", flush=True)
        if time.time() - t0 > a_.budget:
            break
    def gm(k, among):
        return math.exp(sum(math.log(r["cublas_us"] / r[k]) for r in among) / len(among)) if among else None

    chose = [r for r in rows if r["pick"]]
    summary = dict(shapes=len(rows), with_choice=gm("with_us", rows), without=gm("without_us", rows),
                   picked=len(chose), picked_with=gm("with_us", chose), picked_without=gm("without_us", chose),
                   max_err=max(r["err"] for r in rows))
    kind = ("rung-entries" if a_.rung_entries else "restride" if a_.restride else "misaligned" if a_.misaligned
            else "utilization" if a_.utilization else "survey")
    save(f"ab-{kind}-{a_.dtype}-{a_.layout}-s{a_.seed}.json", summary, rows, layout=a_.layout, seed=a_.seed)


def save(name: str, summary: dict, rows: list, **meta) -> None:
    """Print an A/B's summary and write it with its rows and the commit to ``$OUT/name``."""
    print(json.dumps(summary))
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(dict(git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"), **meta, summary=summary, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
