"""Open question: does ``frag_wgmma``'s plain loop at M <= 32 lose to its per-step synchronisation? ``PAIRS``
waits and synchronises once every two K steps (the ring issues two steps at a time, STAGES - 2 ahead); this
times it against today's rule on the llm shapes and a fitting draw of ``w4-random`` (never the held-out seed),
every candidate checked first, as CUDA-graph replays with inputs rotated past L2 (GPU time).

    PYTHONPATH=src:tools python3 research/w4a16_pairs.py --out $OUT/w4-pairs.json [--budget 150]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import w4a16_frag_sweep as sweep
from tilegemm.ops.w4a16 import configs
from tilegemm.ops.w4a16.bench import _LLM_NK, w4_random_shapes

FIT_SEED = 60418  # a fitting draw (the bench's held-out draw is 60417)


def variants(rule: dict) -> dict[str, dict]:
    out = {"rule": rule, "rule-s6": dict(rule, STAGES=6)}
    if not rule.get("OVERLAP") and not rule.get("PIPE"):
        for stages in (4, 6, 8):
            out[f"pairs-s{stages}"] = dict(rule, STAGES=stages, PAIRS=True)
        out["pairs-s6-split2x"] = dict(rule, STAGES=6, PAIRS=True, SPLIT_K=rule["SPLIT_K"] * 2)
        out["pairs-s6-split/2"] = dict(rule, STAGES=6, PAIRS=True, SPLIT_K=max(1, rule["SPLIT_K"] // 2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1,4,16,32")
    p.add_argument("--fit-shapes", type=int, default=5, help="the first N (N, K) of the draw")
    p.add_argument("--seed", type=int, default=FIT_SEED, help="the w4-random draw (60417: the held-out check only)")
    p.add_argument("--no-llm", action="store_true", help="the draw's shapes alone")
    p.add_argument("--budget", type=float, default=150.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    start = time.time()
    ms = [int(m) for m in a.ms.split(",")]
    shapes = ([] if a.no_llm else [("llm", n, k) for n, k in _LLM_NK]) + \
        [(f"seed{a.seed}", n, k) for n, k in w4_random_shapes(seed=a.seed)[:a.fit_shapes]]
    from tilegemm.core.hardware import machine_info

    machine = machine_info()
    rows = []
    for index, (source, N, K) in enumerate(shapes):
        if time.time() - start > a.budget:
            break
        sets = sweep.rotation_sets(sweep.weight_bytes(N, K), max(ms), N, K, True, machine)
        shape = sweep.Shape(a.seed, index, N, K, sets, "cuda")
        for M in ms:
            case = sweep.Case(shape, M, sets)
            base = sweep.measure(lambda i: F.linear(case.x[i], shape.dense[i]), case.ref, sets, True)
            rule = configs.frag_wgmma_config(M, N, K, case.x[0].device)
            row = dict(source=source, N=N, K=K, M=M, sets=sets, cublas=base.get("us"), rule=rule)
            for name, cfg in variants(rule).items():
                r = sweep.run_candidate(case, cfg, True, "")
                row[name] = r.get("us", r.get("error"))
            rows.append(row)
            cands = {k: v for k, v in row.items() if k.startswith(("rule", "pairs")) and isinstance(v, float)}
            print(f"{source:10s} {N:6d}x{K:<6d} M={M:<3d} cuBLAS {row['cublas']:8.2f} " +
                  " ".join(f"{k} {v:.2f}" for k, v in cands.items()), flush=True)
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    names = sorted({k for r in rows for k in r if k.startswith(("rule", "pairs")) and k != "rule"} | {"rule"})
    print("geomean cuBLAS / time by M (cases where every named variant ran):")
    for M in ms:
        line = []
        for name in ["rule"] + [n for n in names if n != "rule"]:
            vals = [r["cublas"] / r[name] for r in rows if r["M"] == M and isinstance(r.get(name), float)
                    and r["cublas"]]
            if vals:
                line.append(f"{name} {math.exp(sum(map(math.log, vals)) / len(vals)):.3f} ({len(vals)})")
        print(f"M={M:<3d} " + "  ".join(line))


if __name__ == "__main__":
    main()
