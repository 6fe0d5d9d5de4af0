"""Diagnosis on the GPU: where the random sweep's small products lose to cuBLAS (not a test).

For each shape with under ``--max-work`` us of work at the vendor peak (default: the random sweep's own, or
shapes given): cuBLAS; ``tilegemm.matmul`` with the survey turned off (auto by the rules) through do_bench
(what the bench measures) and as a CUDA graph of one call (GPU time alone); auto as it is (the survey's pick,
aligned shapes only; at 10080c3 the survey spoke from 3.5 us of work up, and the script lowered that bar to
0) the same two ways; the host time of one call in a loop. Then a cProfile of the replay path on one shape.
Writes ``$OUT/diagnose-tiny-<dtype>.json``.

    PYTHONPATH=src python3 research/diagnose_tiny.py [--shapes 104x88x320 ...] [--max-work 3.5] [--limit 60]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import sys
import time

import tilegemm
import torch
import triton.testing
from tilegemm.ops.matmul import bench as mbench, dispatch, replay

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diagnose_survey import host_us  # noqa: E402  (one call's host time in a loop)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def graph_us(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=5, rep=30, return_mode="median") * 1e3


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--max-work", type=float, default=3.5)
    ap.add_argument("--limit", type=int, default=200)
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    else:
        shapes = []
        for case in mbench._random_cases():
            M, N, K = case.dims["M"], case.dims["N"], case.dims["K"]
            if 2 * M * N * K / 989e12 * 1e6 < args.max_work:
                shapes.append((M, N, K))
        shapes = shapes[:args.limit]
    rows = []
    real = dispatch.surveyed
    t_start = time.time()
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        row = dict(shape=f"{M}x{N}x{K}")
        row["cublas_us"] = bench(lambda: torch.matmul(a, b))
        row["cublas_graph_us"] = graph_us(lambda: torch.matmul(a, b))
        row["cublas_host_us"] = host_us(lambda: torch.matmul(a, b))
        replay.clear()
        dispatch.surveyed = lambda p: None  # the rules alone
        try:
            row["rules_us"] = bench(lambda: tilegemm.matmul(a, b))
            row["rules_graph_us"] = graph_us(lambda: tilegemm.matmul(a, b))
            row["rules_host_us"] = host_us(lambda: tilegemm.matmul(a, b))
        finally:
            dispatch.surveyed = real
        replay.clear()
        try:
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            from tilegemm.ops.matmul.problem import make_problems
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
            picked = dispatch.surveyed(p)
            row["survey_pick"] = picked
            if picked is not None:
                row["survey_us"] = bench(lambda: tilegemm.matmul(a, b))
                row["survey_graph_us"] = graph_us(lambda: tilegemm.matmul(a, b))
        finally:
            replay.clear()
        rows.append(row)
        print(f"{row['shape']:>16} cuBLAS {row['cublas_us']:6.1f} g {row['cublas_graph_us']:6.1f} h "
              f"{row['cublas_host_us']:5.1f} | rules {row['rules_us']:6.1f} g {row['rules_graph_us']:6.1f} h "
              f"{row['rules_host_us']:5.1f} | survey {row.get('survey_us', float('nan')):6.1f} g "
              f"{row.get('survey_graph_us', float('nan')):6.1f}", flush=True)
        if time.time() - t_start > 400:
            print("time budget reached", flush=True)
            break

    def gm(key, base="cublas_us"):
        v = [r[base] / r[key] for r in rows if key in r]
        return (math.exp(sum(map(math.log, v)) / len(v)), len(v)) if v else (None, 0)

    summary = {k: gm(k, "cublas_graph_us" if "graph" in k else "cublas_us")
               for k in ("rules_us", "rules_graph_us", "survey_us", "survey_graph_us")}
    aligned = [r for r in rows if "survey_us" in r]
    summary["rules_us_on_surveyed"] = (math.exp(sum(math.log(r["cublas_us"] / r["rules_us"]) for r in aligned) /
                                       max(1, len(aligned))), len(aligned))
    summary["rules_graph_on_surveyed"] = (math.exp(sum(math.log(r["cublas_graph_us"] / r["rules_graph_us"])
                                                       for r in aligned) / max(1, len(aligned))), len(aligned))
    # where the replay path's host time goes
    M, N, K = 64, 64, 64
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    for _ in range(10):
        tilegemm.matmul(a, b)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        tilegemm.matmul(a, b)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    profile = s.getvalue()
    summary["host_64_us"] = host_us(lambda: tilegemm.matmul(a, b), 2000)
    summary["torch_host_64_us"] = host_us(lambda: torch.matmul(a, b), 2000)
    print(profile)
    print(json.dumps(summary, indent=1))
    with open(os.path.join(os.environ.get("OUT", "."), f"diagnose-tiny-{args.dtype}.json"), "w") as f:
        json.dump(dict(git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"), summary=summary, rows=rows,
                       profile=profile), f, indent=1)


if __name__ == "__main__":
    main()
