"""A/B on the GPU (not a test): persistent_tma's K split reduced by a second launch (as shipped) against the same
split reduced by each tile's last-arriving slice in the one launch (``REDUCE_LAST``), through ``tilegemm.matmul``
as a user calls it (replayed), on every shape of the ``random`` sweep (and a few long-K extras) where ``auto``
runs a persistent_tma split. cuBLAS and both variants alternate over ``--rounds`` rounds of do_bench medians;
each variant is checked against an fp64 product first; host time per call (back to back, no sync) too.

    PYTHONPATH=src:research python3 research/ab_reduce_last.py --dtypes fp16 fp8_e4m3 [--budget 200]

Writes ``$OUT/ab-reduce-last-<dtype>.json``; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton.testing

import tilegemm
from tilegemm.core.hardware import machine_info
from tilegemm.ops.matmul import persistent_tma, replay
from tilegemm.ops.matmul.bench import _model_cases, _random_cases

from diagnose_survey import host_us  # noqa: E402

EXTRA = ((184, 168, 14400), (24, 128, 20968), (136, 480, 16256), (288, 104, 7440), (800, 536, 7816),
         (48, 208, 17744), (24, 480, 17904), (64, 64, 100352), (96, 200, 30000), (128, 256, 65536))
MODE = {"now": "apart"}
SEEN: list = []

_launch_config = persistent_tma.launch_config


def launch_config(p, cfg):
    if cfg.get("SPLIT_K", 1) > 1 and persistent_tma.split_of(p, cfg) > 1:
        SEEN.append(dict(cfg, split=persistent_tma.split_of(p, cfg)))
        if MODE["now"] == "last":
            cfg = dict(cfg, REDUCE_LAST=True)
    return _launch_config(p, cfg)


_replay_key = replay.replay_key


def replay_key(*args, **kwargs):
    key = _replay_key(*args, **kwargs)
    return None if key is None else (key, MODE["now"])


persistent_tma.launch_config = launch_config
replay.replay_key = replay_key


def inputs(dtype: str, M: int, N: int, K: int):
    if dtype == "fp8_e4m3":
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).T
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
        return (lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
                lambda: tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                lambda: (a.double() @ b.double()).float())
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(M, K, device="cuda", dtype=dt)
    b = torch.randn(K, N, device="cuda", dtype=dt)
    return lambda: torch.matmul(a, b), lambda: tilegemm.matmul(a, b), lambda: (a.double() @ b.double()).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "fp8_e4m3"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=240, help="seconds for each dtype")
    args = ap.parse_args()
    shapes = [(c.dims["M"], c.dims["N"], c.dims["K"]) for c in _random_cases() + _model_cases()] + list(EXTRA)
    for dtype in args.dtypes:
        start, rows = time.time(), []
        for M, N, K in shapes:
            if time.time() - start > args.budget:
                print(f"{dtype}: budget spent", flush=True)
                break
            if dtype.startswith("fp8") and (M % 16 or N % 16 or K % 16):
                continue  # what torch._scaled_mm takes
            cublas, fn, ref = inputs(dtype, M, N, K)
            MODE["now"] = "apart"
            SEEN.clear()
            out = fn()
            if not SEEN:
                continue  # auto runs no persistent_tma split here
            cfg, ref = SEEN[0], ref()
            row = dict(shape=f"{M}x{N}x{K}", split=cfg["split"],
                       tile=f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}",
                       plane_kb=cfg["split"] * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 4 // 1024)
            errs = {}
            for mode in ("apart", "last"):
                MODE["now"] = mode
                out = fn()
                torch.cuda.synchronize()
                errs[mode] = float((out.float() - ref).norm() / ref.norm())
            row["rel_err"] = errs
            times = {"cuBLAS": [], "apart": [], "last": []}
            host = {}
            for _ in range(args.rounds):
                for name in times:
                    MODE["now"] = name
                    f = cublas if name == "cuBLAS" else fn
                    times[name].append(triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median") * 1e3)
            for name in times:
                MODE["now"] = name
                host[name] = host_us(cublas if name == "cuBLAS" else fn, n=200)
            med = {k: statistics.median(v) for k, v in times.items()}
            row.update(us=med, host_us=host, ratio={k: med["cuBLAS"] / med[k] for k in ("apart", "last")})
            rows.append(row)
            print(f"{dtype} {row['shape']:>18} split {row['split']:>3} {row['tile']:>11} {row['plane_kb']:>5} KB"
                  f"  cuBLAS {med['cuBLAS']:7.1f}  apart {med['apart']:7.1f} ({row['ratio']['apart']:.2f}x)"
                  f"  last {med['last']:7.1f} ({row['ratio']['last']:.2f}x)  host {host['apart']:.0f}/{host['last']:.0f}"
                  f"  err {errs['apart']:.1e}/{errs['last']:.1e}", flush=True)
        if rows:
            geo = {k: statistics.geometric_mean([r["ratio"][k] for r in rows]) for k in ("apart", "last")}
            print(f"{dtype}: {len(rows)} split shapes, geomean apart {geo['apart']:.3f}x last {geo['last']:.3f}x")
        with open(os.path.join(os.environ.get("OUT", "."), f"ab-reduce-last-{dtype}.json"), "w") as f:
            json.dump(dict(machine=machine_info().to_dict(), git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
