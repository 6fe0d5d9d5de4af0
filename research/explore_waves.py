"""Diagnosis: what the last, partial wave of tiles costs (GPU machine, not a test).

A persistent kernel with T tiles on P SMs runs ceil(T / P) waves; when T / P is just under a whole number
(4096^3 in 128x256 tiles: 512 tiles, 3.88 waves on 132 SMs) the last wave leaves SMs idle. This times
``persistent_tma``'s config for M x N x K next to problems grown in M to whole waves (and cuBLAS on each):
if the grown problem takes no longer, the idle SMs cost the whole difference, and a finer split of the
last wave's work (stream-K) could win it back.

    PYTHONPATH=src:tools python3 research/explore_waves.py --shape 4096x4096x4096 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info, sm_count
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems

from profile_counters import base_config, do_bench_rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x4096x4096")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    M, N, K = (int(x) for x in args.shape.split("x"))
    dtype = torch.float16
    persistent_tma.ensure_allocator()
    probe = make_problems(torch.empty(M, K, device="cuda", dtype=dtype), torch.empty(K, N, device="cuda", dtype=dtype),
                          torch.empty(M, N, device="cuda", dtype=dtype), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    cfg = base_config(probe)
    bm, bn, sms = cfg["BLOCK_M"], cfg["BLOCK_N"], sm_count(torch.device("cuda"))
    tiles_n = triton.cdiv(N, bn)
    tiles = triton.cdiv(M, bm) * tiles_n
    waves = tiles / sms
    # M grown to whole waves of tiles (the tile rows needed for ceil(waves) * sms tiles, if that is whole).
    sizes = [M]
    for w in (int(waves), -(-tiles // sms)):
        rows = w * sms / tiles_n
        if w and rows == int(rows) and int(rows) * bm != M:
            sizes.append(int(rows) * bm)
    print(f"config {cfg}; {tiles} tiles = {waves:.2f} waves on {sms} SMs; M sizes {sizes}")
    fns = {}
    for m in sizes:
        a = torch.randn(m, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        out = torch.full((m, N), float("nan"), device="cuda", dtype=dtype)
        p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
        fn = tuning.replaying(lambda c, p=p: persistent_tma.run(p, c), cfg)
        fn()
        ref = a.float() @ b.float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (m, err)
        fns[(m, "tilegemm")] = fn
        fns[(m, "cublas")] = lambda a=a, b=b: torch.matmul(a, b)
    times = do_bench_rounds(fns, args.rounds)
    rows = []
    for (m, name), ts in times.items():
        us = statistics.median(ts) * 1e3
        t = triton.cdiv(m, bm) * tiles_n
        rows.append(dict(M=m, N=N, K=K, kernel=name, us=us, tiles=t, waves=t / sms,
                         tflops=2 * m * N * K / us * 1e-6, runs=ts))
    for r in rows:
        print(f"{r['M']:6d}x{N}x{K} {r['kernel']:9s} {r['us']:9.2f} us  {r['tflops']:6.1f} TFLOPS  "
              f"{r['tiles']} tiles ({r['waves']:.2f} waves)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_info().to_dict(), config=cfg, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
