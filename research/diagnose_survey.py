"""Diagnosis on the GPU: auto with the survey's choice against auto by the rules, per shape (not a test).

For each shape: cuBLAS; ``tilegemm.matmul`` (auto) with the survey consulted and with it turned off; the
survey's (rung, config) launched as the survey timed it (replays of its recorded launch); the host time of
one call of each auto (mean over many calls, the GPU left to drain). do_bench medians.

    PYTHONPATH=src python3 research/diagnose_survey.py 104x88x320 112x17248x304 [--dtype fp16]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import tilegemm
import torch
import triton.testing
from tilegemm.core import tuning
from tilegemm.ops.matmul import dispatch, replay, survey
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def host_us(fn, n=300):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    rows = []
    real = dispatch.surveyed
    for shape in args.shapes:
        M, N, K = (int(x) for x in shape.split("x"))
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        out = torch.empty(M, N, device="cuda", dtype=dtype)
        p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
        picked = real(p)
        rules = dispatch.choose_kernel(p)
        bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        row = dict(shape=shape, survey=picked, rules=rules)
        row["cublas_us"] = bench(lambda: torch.matmul(a, b))
        replay.clear()
        row["auto_survey_us"] = bench(lambda: tilegemm.matmul(a, b))
        row["auto_survey_host_us"] = host_us(lambda: tilegemm.matmul(a, b))
        dispatch.surveyed = lambda p: None
        replay.clear()
        try:
            row["auto_rules_us"] = bench(lambda: tilegemm.matmul(a, b))
            row["auto_rules_host_us"] = host_us(lambda: tilegemm.matmul(a, b))
        finally:
            dispatch.surveyed = real
        replay.clear()
        if picked:
            rung, cfg = picked
            fn = tuning.replaying(lambda c: dispatch.launcher(rung)(p, c), cfg)
            row["survey_replayed_us"] = bench(fn)
        rows.append(row)
        print(f"{shape:>18} cuBLAS {row['cublas_us']:7.1f}  auto+survey {row['auto_survey_us']:7.1f} "
              f"(host {row['auto_survey_host_us']:5.1f})  auto rules[{rules}] {row['auto_rules_us']:7.1f} "
              f"(host {row['auto_rules_host_us']:5.1f})  survey replayed {row.get('survey_replayed_us', 0):7.1f}  "
              f"{picked[0] if picked else None} {picked[1] if picked else ''}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"diagnose-survey-{args.dtype}.json"), "w") as f:
        json.dump(dict(git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
