"""Exploration on the GPU: tiles and K splits for skinny GEMMs (M <= 128), where cuBLAS still leads.

For each shape of the llm sweep with M <= 128, times cuBLAS, the grouped kernel with forced tile configs,
and ``split_k`` with forced tiles, SPLIT_K and reduction (atomic adds into one fp32 plane, or one plane
per slice added in order by the last program: ``SLICES``). Every variant is checked against cuBLAS's
output before it is timed. Compilation runs first in parallel worker processes (Triton's disk cache then
serves the timing process). Not a test, not the bench: evidence for ``split_k``'s candidates and ``auto``.

    PYTHONPATH=src python3 research/explore_skinny.py [--shapes 1x4096x4096,...] [--quick]

Writes ``$OUT/explore-skinny.json``; prints the best variant of each kind per shape.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

SHAPES = ["1x4096x4096", "16x4096x4096", "128x4096x4096", "1x4096x14336", "16x4096x14336", "128x4096x14336",
          "1x14336x4096", "16x14336x4096", "128x14336x4096", "1x28672x8192", "16x28672x8192"]


def _fits(bm, bn, bk, stages, nbytes=2, budget=200 * 1024):
    return (bm + bn) * bk * nbytes * stages <= budget


def variants(m: int, quick: bool) -> list[tuple[str, dict]]:
    out = []
    if m <= 16:
        tiles = [(16, bn, bk, 4, st) for bn in (32, 64, 128) for bk in (128, 256) for st in (3, 4, 6)]
        tiles += [(16, 128, 128, 8, 4), (16, 256, 128, 8, 3)]
        split_tiles = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3)]
        splits = (2, 3, 4, 8)
    else:
        tiles = [(64, 32, 64, 4, 5), (64, 64, 64, 4, 4), (128, 32, 64, 4, 4), (128, 64, 64, 4, 4),
                 (64, 128, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 128, 4, 3),
                 (64, 64, 128, 4, 4), (128, 256, 64, 8, 3), (64, 32, 128, 4, 4)]
        split_tiles = [(128, 64, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
                       (64, 64, 64, 4, 4), (128, 256, 64, 8, 3)]
        splits = (2, 3, 4, 8)
    if quick:
        tiles, split_tiles, splits = tiles[:4], split_tiles[:2], splits[:2]
    for bm, bn, bk, w, st in tiles:
        if _fits(bm, bn, bk, st):
            out.append(("grouped", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=st)))
    for bm, bn, bk, w, st in split_tiles:
        if not _fits(bm, bn, bk, st):
            continue
        for s in splits:
            for slices in (False, True):
                out.append(("split_k", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w,
                                            num_stages=st, SPLIT_K=s, SLICES=slices)))
    return out


def _setup(shape: str, dtype_name: str):
    import torch

    from tilegemm.ops.matmul.problem import make_problems

    m, n, k = (int(x) for x in shape.split("x"))
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    return a, b, out, p


def _runner(kind: str, cfg: dict, p):
    from tilegemm.ops.matmul import grouped, split_k

    if kind == "grouped":
        return lambda: grouped.run(p, cfg)
    return lambda: split_k.run(p, cfg)


def _compile(job) -> list[str]:
    """Worker: run each (shape, kind, cfg) once, so that Triton compiles it into its disk cache."""
    shape, dtype_name, items = job
    import torch

    errors = []
    _, _, _, p = _setup(shape, dtype_name)
    for kind, cfg in items:
        try:
            _runner(kind, cfg, p)()
        except Exception as err:  # noqa: BLE001 - reported, the variant is then skipped
            errors.append(f"{shape} {kind} {cfg}: {type(err).__name__}: {str(err)[:200]}")
    torch.cuda.synchronize()
    return errors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    t0 = time.time()

    # 1. Compile in parallel: one job per (shape's specialization, chunk of variants).
    jobs, seen = [], set()
    for shape in shapes:
        m = int(shape.split("x")[0])
        spec = "m1" if m == 1 else f"m{m}"  # Triton specializes an int argument equal to 1
        todo = [(kind, cfg) for kind, cfg in variants(m, args.quick)
                if (spec, kind, json.dumps(cfg, sort_keys=True)) not in seen]
        for kind, cfg in todo:
            seen.add((spec, kind, json.dumps(cfg, sort_keys=True)))
        for i in range(0, len(todo), 4):
            jobs.append((shape, args.dtype, todo[i:i + 4]))
    compile_errors = []
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn")) as pool:
        for errs in pool.map(_compile, jobs):
            compile_errors += errs
    t_compile = time.time() - t0
    print(f"compiled {len(seen)} variants in {t_compile:.0f} s ({len(compile_errors)} errors)", flush=True)
    for e in compile_errors[:10]:
        print("  ", e)

    # 2. Check and time, in rounds alternating cuBLAS and the variants.
    import torch
    import triton.testing

    from tilegemm.core.hardware import machine_info

    rows = []
    for shape in shapes:
        m = int(shape.split("x")[0])
        a, b, out, p = _setup(shape, args.dtype)
        ref = torch.matmul(a, b)
        scale = ref.float().abs().max().item()
        cands = [("cublas", {}, lambda: torch.matmul(a, b))]
        for kind, cfg in variants(m, args.quick):
            fn = _runner(kind, cfg, p)
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item() / scale
            except Exception as e:  # noqa: BLE001
                rows.append(dict(shape=shape, kind=kind, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            if not err < 2e-2:
                rows.append(dict(shape=shape, kind=kind, cfg=cfg, error=f"wrong: rel err {err}"))
                continue
            cands.append((kind, cfg, fn))
        samples = {i: [] for i in range(len(cands))}
        for r in range(args.rounds):
            order = range(len(cands)) if r % 2 == 0 else reversed(range(len(cands)))
            for i in order:
                samples[i] += triton.testing.do_bench(cands[i][2], warmup=5, rep=25, return_mode="all")
        base = statistics.median(samples[0])
        for i, (kind, cfg, _) in enumerate(cands):
            ms = statistics.median(samples[i])
            rows.append(dict(shape=shape, kind=kind, cfg=cfg, us=ms * 1e3, ratio=base / ms))
        print(f"{shape}: {len(cands) - 1} variants timed, {time.time() - t0:.0f} s", flush=True)

    result = dict(machine=machine_info(), git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"), dtype=args.dtype,
                  compile_s=t_compile, compile_errors=compile_errors, rows=rows)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "explore-skinny.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)

    def short(kind, cfg):
        t = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
        if kind == "split_k":
            t += f" K/{cfg['SPLIT_K']}{' sl' if cfg['SLICES'] else ' at'}"
        return t

    print(f"\n{'shape':16s} {'cuBLAS us':>9s} | best grouped (ratio) | best split atomic | best split slices")
    for shape in shapes:
        mine = [r for r in rows if r["shape"] == shape and "us" in r]
        base = next(r for r in mine if r["kind"] == "cublas")
        cells = []
        for kind, slices in (("grouped", None), ("split_k", False), ("split_k", True)):
            pool = [r for r in mine if r["kind"] == kind and (slices is None or r["cfg"]["SLICES"] == slices)]
            if pool:
                best = max(pool, key=lambda r: r["ratio"])
                cells.append(f"{short(kind, best['cfg'])} {best['ratio']:.2f}")
            else:
                cells.append("-")
        print(f"{shape:16s} {base['us']:9.1f} | " + " | ".join(cells))
    bad = [r for r in rows if "error" in r]
    print(f"{len(bad)} variants failed the check or the launch")
    for r in bad[:8]:
        print("  ", r["shape"], r["kind"], r["cfg"], r["error"][:120])
    return 0


if __name__ == "__main__":
    sys.exit(main())
