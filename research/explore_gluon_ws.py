"""Exploration: the warp-specialized ping-pong Gluon GEMM (``tilegemm.ops.matmul.gluon_ws``) against cuBLAS.

For each shape and layout: every config of the Gluon kernel is checked against an fp32 product (output
poisoned with NaN first) and timed, in rounds, beside cuBLAS (``torch.matmul``) and ``tilegemm.matmul`` as
shipped (``auto`` and ``persistent_tma``). Ratios are cuBLAS time / kernel time (medians of do_bench).

    PYTHONPATH=src python research/explore_gluon_ws.py --json out.json [--sizes 1024,4096] [--layouts NN,NT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess

import torch
import triton

import tilegemm
from tilegemm.core.launch import launch
import gluon_ws  # research/gluon_ws.py: run with PYTHONPATH=src:research
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems


def operands(m, n, k, layout, dtype):
    a = torch.randn(m, k, device="cuda", dtype=dtype) if layout[0] == "N" else \
        torch.randn(k, m, device="cuda", dtype=dtype).T
    b = torch.randn(k, n, device="cuda", dtype=dtype) if layout[1] == "N" else \
        torch.randn(n, k, device="cuda", dtype=dtype).T
    return a, b


def ws_call(a, b, out, cfg):
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    assert gluon_ws.usable(p) is None and persistent_tma.describable(p) is None
    persistent_tma.ensure_allocator()
    args = gluon_ws.launch_args(p, cfg, torch.cuda.get_device_properties(0).multi_processor_count)
    return lambda: launch(*args)


def timed(fns: dict, rounds=3, rep=100):
    runs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            runs[k].append(triton.testing.do_bench(f, warmup=25, rep=rep))
    return {k: statistics.median(v) for k, v in runs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--layouts", default="NN")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--shapes", default="", help="extra M,N,K shapes separated by ';'")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    shapes = [(int(s),) * 3 for s in args.sizes.split(",") if s]
    shapes += [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
    results = []
    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        for layout in args.layouts.split(","):
            for (m, n, k) in shapes:
                torch.manual_seed(0)
                a, b = operands(m, n, k, layout, dtype)
                ref = (a.float() @ b.float())
                scale = ref.abs().max().item()
                out = torch.empty(m, n, device="cuda", dtype=dtype)
                fns = {"cublas": lambda: torch.matmul(a, b, out=out),
                       "auto": lambda: tilegemm.matmul(a, b),
                       "persistent_tma": lambda: tilegemm.matmul(a, b, kernel="persistent_tma")}
                errs = {}
                for name in ("auto", "persistent_tma"):
                    got = fns[name]()
                    errs[name] = ((got.float() - ref).abs().max() / scale).item()
                for cfg in gluon_ws.configs():
                    name = f"ws_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_s{cfg['STAGES']}"
                    print(f"  running {name} {dname} {layout} {m}x{n}x{k}", flush=True)
                    o = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                    f = ws_call(a, b, o, cfg)
                    f()
                    torch.cuda.synchronize()
                    err = ((o.float() - ref).abs().max() / scale).item()
                    errs[name] = err
                    if not math.isfinite(err) or err > 1e-2:
                        print(f"WRONG {name} {dname} {layout} {m}x{n}x{k}: rel err {err}", flush=True)
                        continue
                    fns[name] = f
                ms = timed(fns, rounds=args.rounds)
                flops = 2 * m * n * k
                row = dict(dtype=dname, layout=layout, shape=f"{m}x{n}x{k}", ms=ms, errs=errs,
                           ratio={kk: ms["cublas"] / v for kk, v in ms.items()},
                           tflops={kk: flops / v / 1e9 for kk, v in ms.items()})
                results.append(row)
                best = max((kk for kk in row["ratio"] if kk.startswith("ws_")), key=lambda kk: row["ratio"][kk],
                           default=None)
                print(f"{dname} {layout} {m}x{n}x{k}: cublas {row['tflops']['cublas']:.0f} TFLOPS; "
                      f"auto {row['ratio']['auto']:.3f} pers {row['ratio']['persistent_tma']:.3f} "
                      f"best ws {best} {row['ratio'].get(best, float('nan')):.3f}  "
                      + " ".join(f"{kk[3:]}={v:.3f}" for kk, v in row["ratio"].items() if kk.startswith("ws_")),
                      flush=True)
    if args.json:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, commit=os.environ.get("TILEGEMM_GIT_COMMIT") or subprocess.run(
                        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
