"""Diagnosis on the GPU: where a wide K split's time goes (not a test).

For each shape: cuBLAS; ``tilegemm.matmul`` as the bench calls it (do_bench), its host time per call
(wall time of 200 calls, synchronized once) and its GPU time per call (CUDA graph of 20 calls); then
``split_k`` configs of one tile with splits 1, 2, 4, 8, 16 and the wave split, each with the planes added
by the last-arriving program and apart (a second launch), timed as replays like the tuners time them.
Writes ``$OUT/diagnose-split.json``; prints a table.

    PYTHONPATH=src:research python3 research/diagnose_split.py 184x168x14400 120x112x6136 [--tile 128,128,64,4,4]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton.testing

import tilegemm
from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info
from tilegemm.ops.matmul import split_k
from tilegemm.ops.matmul.problem import make_problems


def graph_us(fn, calls=20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def host_us(fn, calls=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--tile", default="128,128,64,4,4")
    args = ap.parse_args()
    bm, bn, bk, warps, stages = (int(x) for x in args.tile.split(","))
    rows = []
    for shape in args.shapes:
        M, N, K = (int(x) for x in shape.split("x"))
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        ref = torch.matmul(a.double(), b.double()).float()
        row = dict(shape=shape)
        row["cublas_us"] = triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median") * 1e3
        row["auto_us"] = triton.testing.do_bench(lambda: tilegemm.matmul(a, b), return_mode="median") * 1e3
        row["auto_host_us"] = host_us(lambda: tilegemm.matmul(a, b))
        row["auto_graph_us"] = graph_us(lambda: tilegemm.matmul(a, b))
        row["cublas_graph_us"] = graph_us(lambda: torch.matmul(a, b))
        out = torch.empty(M, N, device="cuda", dtype=torch.float16)
        p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
        steps = -(-K // bk)
        tiles = -(-M // bm) * -(-N // bn)
        splits = sorted({1, 2, 4, 8, 16, split_k.wave_split(tiles, steps, 132)})
        row["configs"] = []
        for s in splits:
            for apart in ((False,) if s == 1 else (False, True)):
                cfg = dict(split_k.make_config(bm, bn, bk, warps, stages, s), APART=apart)
                out.fill_(float("nan"))
                fn = tuning.replaying(lambda c: split_k.launch_config(p, c), cfg)
                fn()
                fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = triton.testing.do_bench(fn, return_mode="median") * 1e3
                g = graph_us(fn)
                row["configs"].append(dict(split=s, apart=apart, us=us, graph_us=g, rel_err=err))
        rows.append(row)
        print(f"{shape}: cuBLAS {row['cublas_us']:.1f} us (graph {row['cublas_graph_us']:.1f}); auto {row['auto_us']:.1f} "
              f"(graph {row['auto_graph_us']:.1f}, host {row['auto_host_us']:.1f})", flush=True)
        for c in row["configs"]:
            print(f"   split {c['split']:3d} {'apart' if c['apart'] else 'last '} {c['us']:8.1f} us  graph {c['graph_us']:8.1f}"
                  f"  err {c['rel_err']:.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "diagnose-split.json"), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"),
                       tile=args.tile, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
