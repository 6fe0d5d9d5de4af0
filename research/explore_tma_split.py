"""Few output tiles with a long K: does a K split of persistent_tma's TMA kernel reach cuBLAS there?

The random sweep's worst aligned products (800x536x7816, 136x6232x2496, 1176x136x9312, ...) have too few
128x128 tiles to fill the GPU and a long K. ``split_k``'s pointer kernel splits K but moves its operands with
``cp.async`` in small tiles; ``persistent_tma`` moves them with TMA in large tiles but did not split. Here every
candidate of the split TMA kernel (``persistent_tma`` configs with ``SPLIT_K``) is timed as a replay beside
cuBLAS and beside ``auto`` (``tilegemm.matmul`` as a user calls it), for given shapes or for shapes drawn from
that class (``--random N --seed S``: aligned M, N, K; at most 1.5 SMs' worth of 128x128 tiles; K >= 1024).
Not a test. Writes ``$OUT/explore-tma-split-<dtype>-<tag>.json``; prints one line a shape.

    PYTHONPATH=src python3 research/explore_tma_split.py 800x536x7816 136x6232x2496 [--dtype fp16]
    PYTHONPATH=src python3 research/explore_tma_split.py --random 24 --seed 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics

import torch
import triton.testing

import tilegemm
from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info, sm_count
from tilegemm.core.runtime import cdiv
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): persistent_tma's 16-bit tiles
TILES = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
         (64, 128, 128, 4, 4), (128, 64, 64, 4, 4)]


def draw(n: int, seed: int, sms: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)

    def logu(lo, hi):
        return max(8, int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) // 8 * 8)

    out = []
    while len(out) < n:
        M, N, K = logu(16, 16384), logu(64, 28672), logu(1024, 28672)
        if cdiv(M, 128) * cdiv(N, 128) <= 1.5 * sms:
            out.append((M, N, K))
    return out


def splits(tiles: int, k_steps: int, sms: int) -> list[int]:
    """A few splits per tile: the largest that keeps one wave, one less, and two waves' worth."""
    wave = max(1, sms // tiles)
    out = {wave, max(1, wave - 1), max(1, 2 * sms // tiles), 1}
    return sorted(s for s in out if s == 1 or k_steps >= 4 * s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--random", type=int, default=0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="given")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    sms = sm_count(torch.device("cuda"))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] + draw(args.random, args.seed, sms)
    persistent_tma.ensure_allocator()
    results = []
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        ref = torch.matmul(a.double(), b.double()).float()
        field = {}
        for bm, bn, bk, warps, stages in TILES:
            tiles = cdiv(M, bm) * cdiv(N, bn)
            for split in splits(tiles, cdiv(K, bk), sms):
                cfg = dict(persistent_tma.make_config(bm, bn, bk, warps, stages), SPLIT_K=split)
                out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
                fn = tuning.replaying(lambda c, p=p: persistent_tma.launch_config(p, c), cfg)
                fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise SystemExit(f"{M}x{N}x{K} {cfg}: relative error {err}")
                field[json.dumps(cfg, sort_keys=True)] = fn
        got = tilegemm.matmul(a, b)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
        times = {"cuBLAS": [], "auto": []} | {k: [] for k in field}
        for _ in range(args.rounds):
            times["cuBLAS"].append(triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median"))
            times["auto"].append(triton.testing.do_bench(lambda: tilegemm.matmul(a, b), return_mode="median"))
            for k, fn in field.items():
                times[k].append(triton.testing.do_bench(fn, return_mode="median"))
        us = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        best = min(field, key=us.get)
        results.append(dict(shape=[M, N, K], us=us))
        print(f"{M}x{N}x{K}: cuBLAS {us['cuBLAS']:.1f} us, auto {us['cuBLAS'] / us['auto']:.3f}x, best split "
              f"{us['cuBLAS'] / us[best]:.3f}x {best}", flush=True)
    path = os.path.join(os.environ.get("OUT", "."), f"explore-tma-split-{args.dtype}-{args.tag}.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), dtype=args.dtype, results=results), f, indent=1)


if __name__ == "__main__":
    main()
