"""Fit the untimed cost model's constants (``tilegemm.ops.matmul.cost``) to survey data, offline (no GPU).

``tools/survey_configs.py`` timed every candidate of ``autotuned``, ``split_k`` and ``persistent_tma`` on a few
hundred random shapes. The cost model ranks the pointer kernels' candidates (``autotuned`` and ``split_k``)
where neither a tuned entry nor the survey speaks. This scores the model's pick on every surveyed shape,
as (best pointer candidate's time / pick's time), geomean per size class, and fits its constants by
coordinate descent on some surveys, scoring the others (cross-validation by seed and GPU).

    python3 research/fit_cost_model.py --train A.json B.json --test C.json D.json [--fit]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("TILEGEMM_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tilegemm.ops.matmul import cost  # noqa: E402

PEAK = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0)}
CLASSES = ((1.0, "<1us"), (3.5, "1-3.5us"), (30.0, "3.5-30us"), (float("inf"), ">30us"))


def size_class(M, N, K):
    us = 2 * M * N * K / 989e12 * 1e6
    return next(name for lim, name in CLASSES if us < lim)


def load(path):
    doc = json.load(open(path))
    gpu = "H100" if "H100" in doc["machine"]["gpu"] else "H200"
    sms = doc["machine"]["sm_count"]
    rows = []
    for r in doc["rows"]:
        cands = [(c["rung"], c["config"], c["us"]) for c in r["configs"] if c.get("us")]
        ptr = [c for c in cands if c[0] in ("autotuned", "split_k")]
        if not ptr:
            continue
        rows.append(dict(M=r["M"], N=r["N"], K=r["K"], cublas=r["cublas_us"], auto=r["auto_us"], sms=sms, gpu=gpu,
                         ptr=ptr, best=min(c[2] for c in cands), best_ptr=min(c[2] for c in ptr)))
    return rows


def pick(row):
    peak, hbm = PEAK[row["gpu"]]

    def est(c):
        cfg = dict(c[1])
        cfg.setdefault("SPLIT_K", 1)
        return cost.estimate_us(row["M"], row["N"], row["K"], 1, 2, 2, cfg, sms=row["sms"], peak_tflops=peak,
                                hbm_gbps=hbm)

    return min(row["ptr"], key=est)


def score(rows, by_class=False):
    """Mean log(best pointer time / pick time) (0 is perfect), and per class geomeans against cuBLAS."""
    total, classes = 0.0, {}
    for row in rows:
        chosen = pick(row)[2]
        total += math.log(row["best_ptr"] / chosen)
        if by_class:
            c = classes.setdefault(size_class(row["M"], row["N"], row["K"]), [[], [], [], [], []])
            c[0].append(row["cublas"] / chosen)
            c[1].append(row["cublas"] / row["best_ptr"])
            c[2].append(row["cublas"] / row["auto"])
            c[3].append(row["cublas"] / row["best"])
            c[4].append(1)
    return total / len(rows), classes


def report(name, rows):
    s, classes = score(rows, True)
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    print(f"{name}: mean log regret {s:.4f} ({math.exp(s):.3f}x of the best pointer candidate)")
    for _, cname in CLASSES:
        if cname in classes:
            c = classes[cname]
            print(f"   {cname:>9} {len(c[4]):4d} shapes: model pick {gm(c[0]):.3f}  best pointer {gm(c[1]):.3f}  "
                  f"auto (rules, measured) {gm(c[2]):.3f}  best of all {gm(c[3]):.3f}  (x cuBLAS)")


SCALARS = ["L2_PER_HBM", "SM_GBPS", "LAST_ARRIVAL_GBPS", "PROGRAM_US", "LAUNCH_US", "STEP_US"]


def params():
    p = {k: getattr(cost, k) for k in SCALARS if hasattr(cost, k)}
    for i, (area, f) in enumerate(cost._MMA_FRACTION):
        p[f"MMA{i}"] = f
    return p


def apply(p):
    for k in SCALARS:
        if k in p:
            setattr(cost, k, p[k])
    cost._MMA_FRACTION = tuple((area, p[f"MMA{i}"]) for i, (area, _) in enumerate(cost._MMA_FRACTION))


def fit(rows, rounds=6):
    best = params()
    apply(best)
    cur = score(rows)[0]
    for r in range(rounds):
        improved = False
        for k in list(best):
            for f in (0.5, 0.7, 0.85, 1.18, 1.4, 2.0):
                trial = dict(best)
                trial[k] = best[k] * f if best[k] else (0.1 if f > 1 else 0.0)
                apply(trial)
                s = score(rows)[0]
                if s > cur + 1e-5:
                    best, cur, improved = trial, s, True
        apply(best)
        print(f"round {r}: {cur:.4f} {json.dumps({k: round(v, 4) for k, v in best.items()})}", flush=True)
        if not improved:
            break
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs="+", required=True)
    ap.add_argument("--test", nargs="*", default=[])
    ap.add_argument("--fit", action="store_true")
    a = ap.parse_args()
    train = [r for f in a.train for r in load(f)]
    tests = {f: load(f) for f in a.test}
    report("train, current constants", train)
    for f, rows in tests.items():
        report(f"test {f}, current constants", rows)
    if a.fit:
        p = fit(train)
        print(json.dumps(p, indent=1))
        report("train, fitted", train)
        for f, rows in tests.items():
            report(f"test {f}, fitted", rows)


if __name__ == "__main__":
    main()
