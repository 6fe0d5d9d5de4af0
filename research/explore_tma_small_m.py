"""Exploration on the GPU: can ``persistent_tma`` with small tiles beat ``split_k`` at M = 64..128? (not a test)

At 128x4096x4096 fp16 (the worst llm shape) ``split_k``'s best pointer config ran 21.6 us against cuBLAS's
18.5 us, and ``persistent_tma``'s own candidates (128-wide tiles: 32-64 tiles for 132 SMs) 30.9 us. Here:
``persistent_tma`` with 64-row tiles, so that there are about as many tiles as SMs, each config checked
against cuBLAS's result first. Writes ``$OUT/explore-tma-small-m.json``; prints a table.

    PYTHONPATH=src python3 research/explore_tma_small_m.py
"""

from __future__ import annotations

import json
import os

import torch
import triton.testing

import tilegemm
from tilegemm.core.hardware import machine_info
from tilegemm.ops.matmul import persistent_tma as pt
from tilegemm.ops.matmul.problem import make_problems

SHAPES = [(128, 4096, 4096), (128, 4096, 14336), (64, 4096, 4096), (128, 14336, 4096)]
CONFIGS = [pt.make_config(64, 64, 128, 4, 4), pt.make_config(64, 64, 128, 4, 6), pt.make_config(64, 64, 64, 4, 8),
           pt.make_config(64, 128, 128, 4, 4), pt.make_config(128, 64, 128, 4, 4), pt.make_config(128, 64, 64, 4, 6),
           pt.make_config(64, 64, 256, 4, 3), pt.make_config(64, 32, 256, 4, 4), pt.make_config(128, 32, 128, 4, 5)]
if os.environ.get("EXPLORE_ROUND") == "2":  # second round: around the best of the first (64x64x128, 6 stages)
    SHAPES = [(128, 4096, 4096), (128, 4096, 14336), (64, 4096, 14336)]
    CONFIGS = [pt.make_config(64, 64, 128, 4, 6), pt.make_config(64, 64, 128, 4, 7), pt.make_config(64, 64, 64, 4, 12),
               pt.make_config(64, 64, 128, 4, 6, flatten=False), pt.make_config(64, 64, 128, 4, 6, flatten=False, ws=1),
               pt.make_config(64, 64, 128, 4, 6, flatten=False, ws=2), pt.make_config(64, 128, 128, 4, 5),
               pt.make_config(64, 128, 64, 4, 8), pt.make_config(64, 64, 128, 8, 6), pt.make_config(128, 64, 128, 8, 5)]


def main() -> None:
    rows = []
    pt.ensure_allocator()
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        ref = a @ b
        base = triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=20, rep=200, return_mode="median")
        sk = triton.testing.do_bench(lambda: tilegemm.matmul(a, b, kernel="split_k"), warmup=20, rep=200,
                                     return_mode="median")
        rows.append(dict(shape=[M, N, K], kernel="cuBLAS", us=base * 1e3))
        rows.append(dict(shape=[M, N, K], kernel="split_k (tuned)", us=sk * 1e3, ratio=base / sk))
        for cfg in CONFIGS:
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
            p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False)[0]
            name = "pt {BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)
            try:
                pt._launch(p, cfg)
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    rows.append(dict(shape=[M, N, K], kernel=name, error=f"wrong: rel err {err}"))
                    continue
                ms = triton.testing.do_bench(lambda: pt._launch(p, cfg), warmup=20, rep=200, return_mode="median")
                rows.append(dict(shape=[M, N, K], kernel=name, us=ms * 1e3, ratio=base / ms, rel_err=err))
            except Exception as e:  # noqa: BLE001 - exploration: record and go on
                rows.append(dict(shape=[M, N, K], kernel=name, error=str(e)[:160]))
    with open(os.path.join(os.environ.get("OUT", "."), f"explore-tma-small-m{os.environ.get('EXPLORE_ROUND', '')}.json"), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:16s} {r['kernel']:24s} FAILED {r['error'][:70]}")
        else:
            print(f"{shape:16s} {r['kernel']:24s} {r['us']:8.1f} us {r.get('ratio', 1.0):6.2f}x")


if __name__ == "__main__":
    main()
