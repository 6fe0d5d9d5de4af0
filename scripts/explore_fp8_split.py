"""Exploration on the GPU: fp8 with promotion, as whole tiles or as two half-width tiles (not a test).

Promoting fp8 products into fp32 every K step needs a second accumulator the size of the tile. A
128x256 tile over 8 warps then needs 256 registers a thread for the two alone: compiled offline for
sm_90, tilegemm's 128x256 promoted config spills (116 bytes) and ptxas inserts waits, and 256x128
serializes every MMA of the kernel (ptxas advisory C7514). ``SPLIT_N`` (``persistent_tma``) computes the
tile as two [BM, BN/2] halves with their own accumulators, so the partial sum is half a tile:
1 promotes with ``acc + tl.dot(a, b)``, 2 with ``max_num_imprecise_acc``. Compiled offline: no spills,
no serialization.

Here each config is checked against ``torch._scaled_mm`` (promoting, like tilegemm's default) and timed
against it, e4m3, NT, per-tensor scales, bf16 out, in two alternating rounds. Writes
``$OUT/explore-fp8-split.json``; prints a table.

    PYTHONPATH=src python3 scripts/explore_fp8_split.py
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import triton.testing

from tilegemm.hardware import machine_info
from tilegemm.ops.matmul import persistent_tma as pt
from tilegemm.ops.matmul.problem import make_problems

SIZES = [int(s) for s in os.environ.get("EXPLORE_SIZES", "2048,4096,8192,16384").split(",")]
CONFIGS = [
    pt._cfg(256, 128, 128, 8, 3), pt._cfg(128, 256, 128, 8, 3),  # whole tiles, as shipped
    pt._cfg(128, 256, 128, 8, 3, split_n=1), pt._cfg(128, 256, 128, 8, 4, split_n=1),
    pt._cfg(128, 256, 128, 8, 3, flatten=False, split_n=1), pt._cfg(256, 128, 128, 8, 3, split_n=1),
    pt._cfg(128, 128, 128, 8, 4, split_n=1), pt._cfg(128, 256, 128, 8, 3, flatten=False, ws=1, split_n=1),
    pt._cfg(128, 256, 128, 8, 3, split_n=2), pt._cfg(128, 256, 128, 8, 4, split_n=2),
    pt._cfg(256, 128, 128, 8, 3, split_n=2),
]


def name(cfg: dict) -> str:
    s = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)
    s += "" if cfg["FLATTEN"] else " nf"
    s += f" ws{cfg['WARP_SPECIALIZE']}" if cfg["WARP_SPECIALIZE"] else ""
    return s + (f" split{cfg['SPLIT_N']}" if cfg["SPLIT_N"] else "")


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=150, return_mode="median")


def main() -> None:
    rows = []
    pt._ensure_allocator()
    e4m3 = torch.float8_e4m3fn
    for n in SIZES:
        a = (torch.randn(n, n, device="cuda") * 2).to(e4m3)
        b = (torch.randn(n, n, device="cuda") * 2).to(e4m3).T  # column-major B: the NT layout _scaled_mm takes
        sa = torch.tensor(0.5, device="cuda")
        sb = torch.tensor(0.25, device="cuda")
        ref = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        base = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        runs = {"_scaled_mm": []}
        ok = []
        for cfg in CONFIGS:
            out = torch.full((n, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False,
                              scales=(sa.reshape(1), 0, sb.reshape(1), 0))[0]
            try:
                pt._launch(p, cfg)
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            except Exception as e:  # noqa: BLE001 - exploration: record and go on
                rows.append(dict(size=n, kernel=name(cfg), error=str(e)[:200]))
                continue
            if not err < 1e-2:
                rows.append(dict(size=n, kernel=name(cfg), error=f"wrong: rel err {err}"))
                continue
            ok.append((cfg, p, err))
            runs[name(cfg)] = []
        for _ in range(2):  # rounds alternating the baseline and every config
            runs["_scaled_mm"].append(bench(base))
            for cfg, p, _ in ok:
                runs[name(cfg)].append(bench(lambda: pt._launch(p, cfg)))
        base_ms = statistics.mean(runs["_scaled_mm"])
        rows.append(dict(size=n, kernel="_scaled_mm", ms=base_ms, runs=runs["_scaled_mm"]))
        for cfg, p, err in ok:
            ms = statistics.mean(runs[name(cfg)])
            rows.append(dict(size=n, kernel=name(cfg), config=cfg, ms=ms, runs=runs[name(cfg)], ratio=base_ms / ms,
                             rel_err_vs_scaled_mm=err))
    with open(os.path.join(os.environ.get("OUT", "."), "explore-fp8-split.json"), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)
    for r in rows:
        if "error" in r:
            print(f"{r['size']:6d} {r['kernel']:34s} FAILED {r['error'][:80]}")
        else:
            print(f"{r['size']:6d} {r['kernel']:34s} {r['ms'] * 1e3:9.1f} us {r.get('ratio', 1.0):6.3f}x")


if __name__ == "__main__":
    main()
