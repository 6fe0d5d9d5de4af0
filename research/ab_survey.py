"""A/B on the GPU, in one process: ``auto`` with the survey against ``auto`` by its rules alone, on unseen shapes of
one layout (not a test).

The shapes are drawn like ``tools/survey_configs.py`` draws them, from a seed no table was built from. For each
shape: cuBLAS, auto (the survey speaking), auto with the survey turned off; do_bench medians, alternating.
Writes ``$OUT/ab-survey-<dtype>-<layout>-s<seed>.json``.

    PYTHONPATH=src python3 research/ab_survey.py --layout NT --seed 29 --count 80 [--dtype fp16] [--budget 300]
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
from tilegemm.ops.matmul import dispatch, replay

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from survey_configs import survey_shapes  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def operands(M, N, K, layout, dtype):
    a = torch.randn(K, M, device="cuda", dtype=dtype).mT if layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).mT if layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="NT")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--count", type=int, default=80)
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--budget", type=float, default=300.0)
    a_ = ap.parse_args()
    dtype = DTYPES[a_.dtype]
    bench = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3  # noqa: E731
    real = dispatch.surveyed
    rows, t0 = [], time.time()
    for M, N, K in survey_shapes(a_.count, a_.seed):
        a, b = operands(M, N, K, a_.layout, dtype)
        ref = torch.matmul(a.float(), b.float())
        row = dict(shape=f"{M}x{N}x{K}")
        picks = []
        dispatch.surveyed = lambda p: picks.append(real(p)) or picks[-1]
        replay.clear()
        out = tilegemm.matmul(a, b)
        row["pick"] = picks[0] if picks else None
        row["err"] = float(((out.float() - ref).norm() / ref.norm()).item())
        dispatch.surveyed = real
        cub, sur, rul = [], [], []
        for _ in range(2):
            cub.append(bench(lambda: torch.matmul(a, b)))
            replay.clear()
            sur.append(bench(lambda: tilegemm.matmul(a, b)))
            dispatch.surveyed = lambda p: None
            replay.clear()
            try:
                rul.append(bench(lambda: tilegemm.matmul(a, b)))
            finally:
                dispatch.surveyed = real
                replay.clear()
        row.update(cublas_us=min(cub), survey_us=min(sur), rules_us=min(rul))
        rows.append(row)
        print(f"{row['shape']:>18} cuBLAS {row['cublas_us']:7.1f}  survey {row['survey_us']:7.1f}  rules "
              f"{row['rules_us']:7.1f}  err {row['err']:.1e}  {row['pick'][0] if row['pick'] else '-'}", flush=True)
        if time.time() - t0 > a_.budget:
            break
    gm = lambda k: math.exp(sum(math.log(r["cublas_us"] / r[k]) for r in rows) / len(rows))  # noqa: E731
    summary = dict(shapes=len(rows), survey=gm("survey_us"), rules=gm("rules_us"),
                   picked=sum(1 for r in rows if r["pick"]), max_err=max(r["err"] for r in rows))
    print(json.dumps(summary))
    path = os.path.join(os.environ.get("OUT", "."), f"ab-survey-{a_.dtype}-{a_.layout}-s{a_.seed}.json")
    with open(path, "w") as f:
        json.dump(dict(git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"), layout=a_.layout, seed=a_.seed,
                       summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
