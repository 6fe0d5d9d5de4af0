"""Exploration on the GPU: gluon_f16 with its K split (``SPLIT``) against cuBLAS and ``auto`` (not a test).

Products with few 128x128 output tiles and a long K: the random sweep's worst aligned shapes, the weight
gradients of ResNet-50's 1x1 convolutions (``dy^T @ x``, TN) and its small-image 1x1 forward layers (NT).
For each: cuBLAS (``torch.matmul``), ``auto`` and gluon_f16's 128x128 6-slot config at every split from 1 that
keeps slices of two K steps or more and at most two units an SM, each checked against an fp64 product
(outputs poisoned first), then timed (do_bench medians with the L2 cleared, ``--rounds`` rounds alternating,
the Gluon configs as replays of their recorded launch, as the tuners time). Writes
``$OUT/gluon-split-<dtype>.json``; prints a table.

    PYTHONPATH=src:research python3 research/explore_gluon_split.py [--dtype fp16] [--only conv|random]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton.testing

import tilegemm
from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info, sm_count
from tilegemm.core.runtime import cdiv
from tilegemm.ops.matmul import dispatch, gluon_f16, persistent_tma
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

RANDOM = [  # the random sweep's aligned products under 0.85x with few tiles or a long K (H200 runs)
    (800, 536, 7816), (192, 512, 1960), (192, 1944, 3816), (136, 6232, 2496), (1176, 136, 9312),
    (2560, 296, 6424), (144, 13976, 3248), (184, 168, 14400), (264, 72, 4904), (136, 480, 16256),
    (280, 200, 2960), (3488, 464, 28184), (288, 104, 7440), (1040, 1904, 2048), (776, 12288, 4096),
    (1000, 4088, 1944), (104, 840, 9104), (7304, 112, 4296), (10744, 168, 11088), (4808, 1256, 1936),
    (368, 232, 1080), (24, 128, 20968), (48, 208, 17744), (24, 480, 17904),
]
CONV = [  # ResNet-50 at batch 32: 1x1 weight gradients (K_out x C over N*P*Q pixels, TN), 1x1 forwards (NT)
    (64, 64, 100352, "TN"), (256, 64, 100352, "TN"), (64, 256, 100352, "TN"), (128, 256, 100352, "TN"),
    (512, 128, 25088, "TN"), (128, 512, 25088, "TN"), (256, 512, 25088, "TN"), (1024, 256, 6272, "TN"),
    (256, 1024, 6272, "TN"), (512, 1024, 6272, "TN"), (2048, 512, 1568, "TN"), (512, 2048, 1568, "TN"),
    (6272, 256, 1024, "NT"), (6272, 512, 1024, "NT"), (1568, 2048, 512, "NT"), (1568, 512, 2048, "NT"),
    (6272, 1024, 256, "NT"),
]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def operands(M, N, K, layout, dtype):
    a = torch.randn(K, M, device="cuda", dtype=dtype).T if layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).T if layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    return a, b


def splits_for(M, N, K, sms):
    tiles = cdiv(M, 128) * cdiv(N, 128)
    steps = cdiv(K, 64)
    out = []
    for s in SPLITS:
        eff = cdiv(steps, cdiv(steps, s))
        if eff in out or (s > 1 and (steps // s < 2 or tiles * s > 2 * sms)):
            continue
        out.append(eff)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--only", choices=["conv", "random"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    sms = sm_count(torch.device("cuda"))
    persistent_tma.ensure_allocator()
    cases = ([] if args.only == "conv" else [(*s, "NN", "random") for s in RANDOM]) + \
            ([] if args.only == "random" else [(*s, "conv") for s in CONV])
    rows = []
    for M, N, K, layout, group in cases:
        a, b = operands(M, N, K, layout, dtype)
        ref = torch.matmul(a.double(), b.double())
        fns = {"cuBLAS": lambda: torch.matmul(a, b), "auto": lambda: tilegemm.matmul(a, b)}
        errors = {}
        for s in splits_for(M, N, K, sms):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
            cfg = dict(GLUON_F16=True, BLOCK_M=128, BLOCK_N=128, STAGES=6, SHARED_OUT=False, num_warps=4, SPLIT=s)
            fn = tuning.replaying(lambda c, p=p: persistent_tma.launch_config(p, c), cfg)
            fn()
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                errors[f"split{s}"] = err
                continue
            fn()  # a second run: the counters were reset by the first
            torch.cuda.synchronize()
            err2 = ((out.double() - ref).norm() / ref.norm()).item()
            if not err2 < 1e-2:
                errors[f"split{s} again"] = err2
                continue
            fns[f"split{s}"] = fn
        out = tilegemm.matmul(a, b)
        errors_auto = ((out.double() - ref).norm() / ref.norm()).item()
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                times[k].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
        us = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        base = us["cuBLAS"]
        best = min((k for k in us if k.startswith("split")), key=us.get, default=None)
        rung = dispatch.choose_kernel(make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0])
        surveyed = dispatch.surveyed(make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0])
        row = dict(shape=[M, N, K], layout=layout, group=group, tiles=cdiv(M, 128) * cdiv(N, 128),
                   steps=cdiv(K, 64), us=us, ratio={k: base / v for k, v in us.items()}, best=best,
                   auto_rung=surveyed[0] if surveyed else rung, auto_err=errors_auto, errors=errors)
        rows.append(row)
        r = row["ratio"]
        print(f"{M}x{N}x{K} {layout} tiles={row['tiles']:4d} cuBLAS {base:7.1f} us  auto {r['auto']:.2f} "
              f"({row['auto_rung']})  split1 {r.get('split1', float('nan')):.2f}  best {best} {r.get(best, float('nan')):.2f}"
              + (f"  ERR {errors}" if errors else ""), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), f"gluon-split-{args.dtype}.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), commit=os.environ.get("TILEGEMM_GIT_COMMIT"), rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
