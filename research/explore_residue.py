"""Exploration on the GPU (not a test): ``split_k``'s residue-class path (``tilegemm.ops.matmul.residue``) for
small-M products whose B rows are not 16-byte aligned, against cuBLAS and the path before it (split_k's
misaligned rule), over tiles and programs per SM. Through ``tilegemm.matmul(kernel="split_k")`` as a user calls
it (replayed); do_bench medians alternating over ``--rounds`` rounds; each variant checked against an fp64
product. NN: B [K, N] row-major with N odd; NT: B = W.T, W [N, K] with K odd (an nn.Linear).

    PYTHONPATH=src:research python3 research/explore_residue.py [--budget 200]

Writes ``$OUT/explore-residue.json``; prints a table.
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
from tilegemm.ops.matmul import replay, residue

SHAPES = [("NN", 6, 5661, 26729), ("NN", 12, 14059, 10727), ("NN", 2, 3791, 19287), ("NN", 6, 8793, 245),
          ("NN", 4, 5973, 3529), ("NN", 1, 4095, 4095), ("NN", 16, 11007, 4096), ("NN", 8, 1001, 3001),
          ("NT", 1, 4096, 4097), ("NT", 16, 11008, 4095), ("NT", 1, 874, 5873), ("NT", 4, 14335, 5119),
          ("NT", 8, 28671, 8191), ("NT", 2, 625, 9997), ("NT", 3, 1111, 2087), ("NT", 16, 4097, 14335),
          # not among those the rule was read from
          ("NN", 3, 7001, 9999), ("NN", 9, 2049, 30001), ("NN", 16, 25001, 1537), ("NN", 1, 12345, 4096),
          ("NN", 5, 3333, 2500), ("NT", 1, 14336, 4095), ("NT", 16, 28672, 8191), ("NT", 2, 5000, 3001),
          ("NT", 8, 777, 12001), ("NT", 4, 1999, 5001)]
TILES = {"NN": [(32, 256, 4, 3)], "NT": [(64, 128, 4, 3)]}
PPS = (2, 4, 8)

STATE = {"variant": "cuBLAS", "residue": True}
_applies = residue.applies
residue.applies = lambda p: STATE["residue"] and _applies(p)
_replay_key = replay.replay_key


def replay_key(*args, **kwargs):
    key = _replay_key(*args, **kwargs)
    return None if key is None else (key, STATE["variant"])


replay.replay_key = replay_key


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=200)
    args = ap.parse_args()
    start, rows = time.time(), []
    default_tiles, default_pps = dict(residue.TILES), dict(residue.PROGRAMS_PER_SM)
    for layout, M, N, K in SHAPES:
        if time.time() - start > args.budget:
            print("budget spent", flush=True)
            break
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = (torch.randn(K, N, device="cuda", dtype=torch.float16) if layout == "NN"
             else torch.randn(N, K, device="cuda", dtype=torch.float16).T)
        ref = (a.double() @ b.double()).float()
        variants = {"cuBLAS": None, "before": None, "default": None, "auto": None}
        for tile in TILES[layout]:
            for pps in PPS:
                variants[f"{tile[0]}x{tile[1]}w{tile[2]}s{tile[3]}p{pps}"] = (tile, pps)
        fns, errs = {}, {}
        for name, spec in variants.items():
            def fn(name=name, spec=spec):
                STATE["variant"] = name
                STATE["residue"] = name != "before"
                if spec is not None:
                    residue.TILES[layout], residue.PROGRAMS_PER_SM[layout] = spec
                else:
                    residue.TILES.update(default_tiles)
                    residue.PROGRAMS_PER_SM.update(default_pps)
                if name == "cuBLAS":
                    return torch.matmul(a, b)
                return tilegemm.matmul(a, b, kernel="auto" if name == "auto" else "split_k")
            out = fn()
            torch.cuda.synchronize()
            errs[name] = float((out.float() - ref).norm() / ref.norm())
            fns[name] = fn
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = min((k for k in med if k not in ("cuBLAS", "before", "auto")), key=med.get)
        gb = K * N * 2 / 1e3
        row = dict(shape=f"{M}x{N}x{K}", layout=layout, us=med, rel_err=errs, best=best,
                   ratio={k: med["cuBLAS"] / v for k, v in med.items()})
        rows.append(row)
        print(f"{layout} {row['shape']:>16} cuBLAS {med['cuBLAS']:7.1f} ({gb / med['cuBLAS']:.0f} GB/s)"
              f"  before {med['before']:7.1f} ({row['ratio']['before']:.2f}x)"
              f"  default {med['default']:7.1f} ({row['ratio']['default']:.2f}x, {gb / med['default']:.0f} GB/s)"
              f"  auto {med['auto']:7.1f} ({row['ratio']['auto']:.2f}x)"
              f"  best {best} {med[best]:7.1f} ({row['ratio'][best]:.2f}x)  max err {max(errs.values()):.1e}",
              flush=True)
    for name in rows[0]["us"] if rows else []:
        r = [row["ratio"][name] for row in rows if name in row["ratio"]]
        print(f"geomean {name}: {statistics.geometric_mean(r):.3f}x over {len(r)}")
    with open(os.path.join(os.environ.get("OUT", "."), "explore-residue.json"), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
