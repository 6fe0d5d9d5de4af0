"""Exploration on the GPU: what do persistent_tma's device-side TMA descriptors cost at small shapes?

Every program of the persistent kernel makes its three descriptors itself (``tl.make_tensor_descriptor``:
written to global scratch, then fenced before the TMA unit may use them). The HOST_DESC knob passes
descriptors made on the host instead (kernel parameters). For each square shape and dtype this times
cuBLAS, ``auto``, and persistent_tma's configs both ways, in two alternating rounds (do_bench median, L2
cleared), after checking every tile against cuBLAS's result. It also measures the host time per call of
``auto`` against ``torch._scaled_mm`` for fp8 with fast accumulation, and which rung ``auto`` took.
Writes ``$OUT/explore-host-descriptors.json``; prints a table.

    PYTHONPATH=src python3 scripts/explore_host_descriptors.py [--sizes 1024,2048,4096,8192] [--dtypes fp16,bf16]
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
from tilegemm.checks import worst_tile_error
from tilegemm.hardware import machine_info
from tilegemm.ops.matmul import op, persistent_tma
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TILES = [(128, 256, 64, 8, 3, True), (128, 256, 64, 8, 3, False), (128, 128, 64, 8, 4, True),
         (128, 128, 64, 4, 4, True), (64, 128, 64, 4, 4, True)]


def host_us(fn, n=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def fp8_auto_check(rows: list) -> None:
    for s in (2048, 4096):
        a = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn).mT
        one = torch.ones(1, device="cuda")
        calls = {
            "scaled_mm fast": lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
            "auto fast": lambda: tilegemm.matmul(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                 fast_accum=True),
            "autotuned fast": lambda: tilegemm.matmul(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                      fast_accum=True, kernel="autotuned"),
            "persistent_tma fast": lambda: tilegemm.matmul(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                           fast_accum=True, kernel="persistent_tma"),
        }
        out = torch.empty(s, s, device="cuda", dtype=torch.bfloat16)
        p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False, (one, 0, one, 0), True)[0]
        rung = op.choose_kernel(p)
        print(f"--- fp8 fast {s}^3: auto takes {rung}", flush=True)
        for name, fn in calls.items():
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            us = host_us(fn)
            rows.append(dict(dtype="fp8+fast", shape=[s, s, s], kernel=name, us=ms * 1e3, host_us=us, auto_rung=rung))
            print(f"  {name:22s} do_bench {ms * 1e3:8.1f} us   host {us:7.1f} us/call", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="fp16,bf16")
    args = ap.parse_args()
    persistent_tma._ensure_allocator()
    rows: list[dict] = []
    fp8_auto_check(rows)
    for dtype in args.dtypes.split(","):
        for s in map(int, args.sizes.split(",")):
            M = N = K = s
            a = torch.randn(M, K, device="cuda", dtype=DTYPES[dtype])
            b = torch.randn(K, N, device="cuda", dtype=DTYPES[dtype])
            ref = torch.matmul(a, b).float()
            field = {"cuBLAS": lambda: torch.matmul(a, b), "auto": lambda: tilegemm.matmul(a, b),
                     "autotuned": lambda: tilegemm.matmul(a, b, kernel="autotuned")}
            for bm, bn, bk, w, st, flat in TILES:
                for host in (False, True):
                    cfg = persistent_tma._cfg(bm, bn, bk, w, st, flatten=flat)
                    cfg["HOST_DESC"] = host
                    name = f"{'host' if host else 'dev '} {bm}x{bn}x{bk} w{w} s{st}{'' if flat else ' unflat'}"
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=DTYPES[dtype])
                    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
                    try:
                        persistent_tma._launch(p, cfg)
                        torch.cuda.synchronize()
                        err = worst_tile_error(out, ref, bm, bn)
                    except Exception as e:  # noqa: BLE001 - exploration: record and go on
                        rows.append(dict(dtype=dtype, shape=[M, N, K], kernel=name, config=cfg, error=str(e)[:300]))
                        continue
                    if not err < 1e-2:
                        rows.append(dict(dtype=dtype, shape=[M, N, K], kernel=name, config=cfg, error=f"wrong {err}"))
                        continue
                    field[name] = (lambda p=p, cfg=cfg: persistent_tma._launch(p, cfg))
            times = {name: [] for name in field}
            for _ in range(2):
                for name, fn in field.items():
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            base = statistics.mean(times["cuBLAS"])
            print(f"--- {dtype} {s}^3", flush=True)
            for name in field:
                ms = statistics.mean(times[name])
                rows.append(dict(dtype=dtype, shape=[M, N, K], kernel=name, us=ms * 1e3, runs=times[name],
                                 ratio=base / ms))
                print(f"  {name:32s} {ms * 1e3:9.1f} us {base / ms:6.3f}x", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "explore-host-descriptors.json"), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['dtype']} {r['shape']} {r['kernel']}: {r['error'][:200]}")


if __name__ == "__main__":
    main()
