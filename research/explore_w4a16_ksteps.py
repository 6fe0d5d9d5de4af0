"""``frag_wgmma`` at small M with longer K steps (``KH``: 64 * KH deep) and the group scales applied to the
accumulator (``GSCALE``: the MMAs take q - z, each group's sum is scaled once in fp32): correctness against
``x @ dequantize(w).T``, then cold-L2 GPU times (CUDA graphs, the L2 cleared before each call) against cuBLAS
fp16 over row tiles, step depths, GSCALE and K splits.

    PYTHONPATH=src:research python research/explore_w4a16_ksteps.py --json $OUT/ksteps.json

Offline, ``research/sass_w4a16.py --set KH=2 --set GSCALE=1`` counts the loop's instructions per weight.

The two options lived in ``frag_wgmma`` at commit feff4a7 only (check it out to run this): halving the
instructions per weight (M=1: 4.4 -> 2.2) left the times within a few percent (H200,
benchmarks/results/2026-11-24-h200/feff4a7/), so they were taken out again.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tilegemm.ops.w4a16.configs import frag_wgmma_config, split_within

from explore_w4a16_small_m import Cold
from explore_w4a16_wgmma import check_problem, fp16_weights, launch, record_check

CHECKS = [  # N, K, group, M, dtype, cfg changes
    (256, 512, 128, 1, torch.float16, dict(KH=2)),
    (272, 1024, 128, 5, torch.float16, dict(KH=2, GSCALE=True, SPLIT_K=3)),
    (1000, 4160, 64, 9, torch.float16, dict(GSCALE=True, SPLIT_K=5)),
    (4096, 4096, 128, 16, torch.bfloat16, dict(KH=2, GSCALE=True, SPLIT_K=5)),
    (4096, 4096, 256, 3, torch.bfloat16, dict(KH=2, GSCALE=True, SPLIT_K=7)),
    (4096, 4096, 256, 3, torch.float16, dict(KH=1, GSCALE=True, SPLIT_K=6)),
    (8192, 1024, -1, 8, torch.float16, dict(KH=2, GSCALE=True, SPLIT_K=3)),
    (300, 4160, -1, 2, torch.float16, dict(GSCALE=True)),
    (1000, 4160, 64, 33, torch.float16, dict(RH=2, KH=1, GSCALE=True, SPLIT_K=2)),
    (4000, 8192, 128, 16, torch.float16, dict(RH=4, KH=2, GSCALE=True, SPLIT_K=4)),
]


def configs(M, N, K, sms):
    base = frag_wgmma_config(M, N, K, "cuda")
    for rh, kh, gs in itertools.product((1, 2, 4), (1, 2), (False, True)):
        tiles = -(-N // (64 * rh)) * -(-M // base["BM"])
        rule = split_within(tiles, -(-K // (64 * kh)), 8 * sms, max(2, 8 // kh))
        for split in sorted({max(1, rule // 2), rule, rule * 2}):
            yield dict(base, RH=rh, KH=kh, GSCALE=gs, SPLIT_K=split, OVERLAP=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="4096x4096,8192x8192,28672x8192,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,4,16")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K, g, M, dt, change in CHECKS:
        w, fw, fzs, x, bias, ref = check_problem(N, K, g, M, dt)
        cfg = dict(frag_wgmma_config(M, N, K, "cuda"), OVERLAP=False, **change)
        fn, out = launch(x, fw, fzs, w, cfg, bias, "silu")
        fn()
        fn()  # twice: the split-K counters are reset by the last arrival
        record_check(rows, out, ref, dt, cfg, N=N, K=K, g=g, M=M)
    cold = Cold()
    table = []
    for N, K, wd, w, fw, fzs in fp16_weights(a.shapes):
        for M in map(int, a.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            t_cublas = cold(lambda: F.linear(x, wd))
            shipped = frag_wgmma_config(M, N, K, "cuda")
            t_ship = cold(launch(x, fw, fzs, w, shipped)[0])
            best = {}
            for cfg in configs(M, N, K, sms):
                t = cold(launch(x, fw, fzs, w, cfg)[0])
                rows.append(dict(kind="time", N=N, K=K, M=M, cfg=cfg, us=t, cublas_us=t_cublas))
                key = (cfg["KH"], cfg["GSCALE"])
                if key not in best or t < best[key][0]:
                    best[key] = (t, cfg)
            rows.append(dict(kind="summary", N=N, K=K, M=M, cublas_us=t_cublas, shipped=shipped, shipped_us=t_ship,
                             best={f"KH{k[0]}-GS{int(k[1])}": v for k, v in best.items()}))
            line = f"{N:5d}x{K:5d} M={M:2d}: cuBLAS {t_cublas:6.1f} shipped {t_ship:6.1f} ({t_cublas / t_ship:.2f}x)"
            for (kh, gs), (t, cfg) in sorted(best.items()):
                line += f" | KH{kh} GS{int(gs)} {t:6.1f} ({t_cublas / t:.2f}x RH{cfg['RH']} S{cfg['SPLIT_K']})"
            print(line, flush=True)
            table.append(line)
    print("\n".join(table))
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
