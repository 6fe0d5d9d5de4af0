"""Exploration on the GPU: the Gluon tf32 kernel for NN and TT (tilegemm/ops/matmul/gluon_tf32.py) against cuBLAS (TF32
on) and `autotuned`, after checking every tile of its results (not a test).

First each config runs three times on ragged and square shapes, with and without C and bias, into a
NaN-poisoned output, every 256x128 tile compared with an fp64 reference on its own. Then the square sizes
are timed with do_bench (median), in alternating rounds. Writes ``$OUT/explore-tf32-gluon.json``; prints
a table last.

    PYTHONPATH=src python3 research/explore_tf32_gluon.py [--sizes 2048,4096,8192,16384] [--rounds 3]
        [--layouts NN,TT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton.testing

import tilegemm
from tilegemm.core.checks import worst_tile_error
from tilegemm.core.hardware import machine_info, sm_count
from tilegemm.core.launch import launch
from tilegemm.ops.matmul import gluon_tf32, persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference


def operands(M, N, K, layout):
    a = torch.randn(K, M, device="cuda").T if layout[0] == "T" else torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").T if layout[1] == "T" else torch.randn(K, N, device="cuda")
    return a, b


def runner(a, b, out, c, bias, alpha, beta, cfg):
    p = make_problems(a, b, out, c, bias, alpha, beta, "none", "tf32", False)[0]
    assert gluon_tf32.usable(p) is None and persistent_tma.describable(p) is None
    args = gluon_tf32.launch_args(p, cfg, sm_count(out.device))
    return lambda: launch(*args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2048,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="NN")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    persistent_tma.ensure_allocator()
    checks = []
    layouts = args.layouts.split(",")
    for shape, layout in ((s, lay) for lay in layouts for s in ((1000, 776, 520), (1008, 784, 528),
                                                               (1024, 1024, 1024), (300, 4100, 1000),
                                                               (4096, 4096, 4096))):
        M, N, K = shape
        a, b = operands(M, N, K, layout)
        c, bias = torch.randn(M, N, device="cuda"), torch.randn(N, device="cuda")
        for epi in ("plain", "c+bias"):
            cc, bb, alpha, beta = (None, None, 1.0, 0.0) if epi == "plain" else (c, bias, 1.5, 0.5)
            ref = matmul_reference(a, b, c=cc, bias=bb, alpha=alpha, beta=beta)
            for cfg in gluon_tf32.configs():
                errs = []
                for _ in range(3):
                    out = torch.full((M, N), float("nan"), device="cuda")
                    runner(a, b, out, cc, bb, alpha, beta, cfg)()
                    torch.cuda.synchronize()
                    errs.append(worst_tile_error(out, ref, 256, 128))
                checks.append(dict(shape=shape, layout=layout, epilogue=epi, config=cfg, worst_tile_errors=errs))
                print(f"check {shape} {layout} {epi} stages={cfg['STAGES']}: worst tile {max(errs):.2e}", flush=True)
    rows = []
    for size, layout in ((int(s), lay) for lay in layouts for s in args.sizes.split(",")):
        a, b = operands(size, size, size, layout)
        out = torch.empty(size, size, device="cuda")
        fns = {"cuBLAS": lambda: torch.matmul(a, b),
               "autotuned": lambda: tilegemm.matmul(a, b, kernel="autotuned", precision="tf32")}
        for cfg in gluon_tf32.configs():
            fns[f"gluon_tf32 stages={cfg['STAGES']}"] = runner(a, b, out, None, None, 1.0, 0.0, cfg)
        ref = torch.matmul(a.double(), b.double()) if size <= 8192 else None
        errors = {}
        for name, fn in fns.items():
            r = fn()
            torch.cuda.synchronize()
            res = r if isinstance(r, torch.Tensor) else out
            if ref is not None:
                errors[name] = ((res.double() - ref).norm() / ref.norm()).item()
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        base = statistics.median(times["cuBLAS"])
        for name in fns:
            ms = statistics.median(times[name])
            rows.append(dict(size=size, layout=layout, kernel=name, ms=ms, runs=times[name], ratio=base / ms,
                             tflops=2 * size ** 3 / ms / 1e9, rel_err=errors.get(name)))
    path = os.path.join(os.environ.get("OUT", "."), "explore-tf32-gluon.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), checks=checks, rows=rows), f, indent=1)
    bad = [ch for ch in checks if not max(ch["worst_tile_errors"]) < 1e-2]
    print(f"tile checks: {len(checks)} run, {len(bad)} with a tile over 1e-2")
    for r in rows:
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        print(f"{r['size']:6d} {r['layout']} {r['kernel']:22s} {r['ms'] * 1e3:10.1f} us {r['tflops']:6.0f} TFLOPS {r['ratio']:6.3f}x  err {err}")


if __name__ == "__main__":
    main()
