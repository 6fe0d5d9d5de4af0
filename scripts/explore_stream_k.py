"""Exploration on the GPU: does stream-K (persistent_tma's STREAM_K configs) buy back the partial last wave?

For each square shape and dtype, times cuBLAS (``torch._scaled_mm`` with fast accumulation for fp8), what
``auto`` runs, and persistent_tma's plain and stream-K versions of its large tiles, in two alternating
rounds (do_bench median, L2 cleared), after checking every tile of each result against cuBLAS's. Also
times the plain 128x256 config on "control" shapes with whole waves of tiles (4224x4096x4096: 528 tiles, 4
waves of 132), to show what a partial wave costs. Writes ``$OUT/explore-stream-k.json``; prints a table.

    PYTHONPATH=src python3 scripts/explore_stream_k.py [--sizes 1024,2048,4096,8192,16384] [--dtypes fp16,bf16,fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.testing

import tilegemm
from tilegemm.checks import worst_tile_error
from tilegemm.hardware import machine_info, sm_count
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def configs(dtype: str) -> dict[str, dict]:
    if dtype == "fp8":
        plain = [persistent_tma._cfg(128, 256, 128, 8, 3)]
        sk = [persistent_tma._cfg(128, 256, 128, 8, 3, stream_k=True)]
    else:
        plain = [persistent_tma._cfg(128, 256, 64, 8, 3), persistent_tma._cfg(128, 256, 64, 8, 3, flatten=False),
                 persistent_tma._cfg(128, 128, 64, 8, 4)]
        sk = [dict(c, STREAM_K=True) for c in plain]
    out = {}
    for c in plain + sk:
        name = ("SK " if c.get("STREAM_K") else "   ") + f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} " \
            f"w{c['num_warps']} s{c['num_stages']}{' unflat' if not c['FLATTEN'] else ''}"
        out[name] = c
    return out


def operands(dtype: str, M: int, N: int, K: int):
    if dtype == "fp8":
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).mT
        one = torch.ones((), device="cuda")
        base = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
        return a, b, torch.bfloat16, (one.reshape(1), 0, one.reshape(1), 0), True, base
    a = torch.randn(M, K, device="cuda", dtype=DTYPES[dtype])
    b = torch.randn(K, N, device="cuda", dtype=DTYPES[dtype])
    return a, b, DTYPES[dtype], (None, 0, None, 0), False, lambda: torch.matmul(a, b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--dtypes", default="fp16,bf16,fp8")
    ap.add_argument("--controls", default="4224x4096x4096,4096x4096x4096")
    args = ap.parse_args()
    persistent_tma._ensure_allocator()
    sms = sm_count(torch.device("cuda"))
    rows = []
    shapes = [(s, s, s, "square") for s in map(int, args.sizes.split(","))]
    shapes += [(*map(int, c.split("x")), "control") for c in args.controls.split(",") if c]
    for dtype in args.dtypes.split(","):
        for M, N, K, kind in shapes:
            if dtype == "fp8" and kind == "square" and M < 2048:
                continue
            a, b, out_dtype, scales, fast, base = operands(dtype, M, N, K)
            ref = base().float()
            field = {"cuBLAS": base}
            names = configs(dtype)
            if kind == "control":
                names = {k: v for k, v in names.items() if not v.get("STREAM_K")}
            else:
                kw = dict(out_dtype=out_dtype, scale_a=scales[0], scale_b=scales[2], fast_accum=True) \
                    if dtype == "fp8" else {}
                field["auto"] = lambda kw=kw: tilegemm.matmul(a, b, kernel="auto", **kw)
            for name, cfg in names.items():
                out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
                p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False, scales, fast_accum=fast)[0]
                tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
                shared = persistent_tma.stream_k_tiles(tiles, triton.cdiv(K, cfg["BLOCK_K"]), sms)
                row = dict(dtype=dtype, shape=[M, N, K], kind=kind, kernel=name, config=cfg, tiles=tiles,
                           shared=shared if cfg.get("STREAM_K") else 0)
                try:
                    errs = []
                    for _ in range(2):
                        out.fill_(float("nan"))
                        persistent_tma._launch(p, cfg)
                        torch.cuda.synchronize()
                        errs.append(worst_tile_error(out, ref, cfg["BLOCK_M"], cfg["BLOCK_N"]))
                except Exception as e:  # noqa: BLE001 - exploration: record and go on
                    rows.append(dict(row, error=str(e)[:300]))
                    continue
                row["worst_tile_error"] = max(errs)
                if not max(errs) < 2e-2:
                    rows.append(dict(row, error=f"wrong: worst tile error {max(errs)}"))
                    continue
                rows.append(row)
                field[name] = (lambda p=p, cfg=cfg: persistent_tma._launch(p, cfg))
            times = {name: [] for name in field}
            for _ in range(2):
                for name, fn in field.items():
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            base_ms = statistics.mean(times["cuBLAS"])
            for name in field:
                ms = statistics.mean(times[name])
                found = [r for r in rows if r["kernel"] == name and r["shape"] == [M, N, K] and r["dtype"] == dtype
                         and r["kind"] == kind]
                row = found[0] if found else dict(dtype=dtype, shape=[M, N, K], kind=kind, kernel=name)
                if not found:
                    rows.append(row)
                row.update(us=ms * 1e3, runs=times[name], ratio=base_ms / ms,
                           tflops=2 * M * N * K / ms / 1e9)
            print(f"--- {dtype} {M}x{N}x{K} ({kind})", flush=True)
            for name in field:
                r = next(r for r in rows if r["kernel"] == name and r["shape"] == [M, N, K] and r["dtype"] == dtype
                         and r["kind"] == kind)
                print(f"  {name:34s} {r['us']:9.1f} us {r['tflops']:6.0f} TFLOPS {r['ratio']:6.3f}x"
                      f"{'  shared ' + str(r['shared']) + ' of ' + str(r['tiles']) if r.get('shared') else ''}",
                      flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "explore-stream-k.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['dtype']} {r['shape']} {r['kernel']}: {r['error'][:200]}")


if __name__ == "__main__":
    main()
