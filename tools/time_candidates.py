"""Diagnosis on the GPU: every candidate config of a rung for one shape, timed against cuBLAS (not a test).

The tuners keep only the winner; this prints the whole field, so one can see whether a rung loses by a
little or a lot, and which tiles, splits and stage counts are close. Each config is checked against
cuBLAS's result, then timed (do_bench median, ``--rounds``, two by default, alternating with cuBLAS; the median of the rounds) as replays of its
recorded launch, as the tuners time it. Extra configs beyond a
rung's own list can be given as JSON. Writes ``$OUT/candidates-<shape>-<dtype>.json``; prints a table,
fastest first.

    PYTHONPATH=src python3 tools/time_candidates.py 128x4096x4096 [--dtype fp16] [--layout NN]
        [--rungs split_k,persistent_tma] [--extra '{"split_k": [[128, 128, 64, 4, 6, 4]], "grouped": [[64, 64, 64, 4, 8]]}']

Extra tuples: split_k ``(bm, bn, bk, warps, stages, split)``; persistent_tma ``(bm, bn, bk, warps, stages
[, flatten, warp_specialize])`` or a whole config as a JSON object (a Gluon kernel's too, e.g.
``{"GLUON_F16": true, "BLOCK_M": 128, "BLOCK_N": 256, "STAGES": 4, "SHARED_OUT": true, "num_warps": 4,
"GROUP_M": 12, "SERPENTINE": 1}``); persistent_tma's field includes the Gluon kernel's configs where one
takes the problem; grouped ``(bm, bn, bk, warps, stages)`` (the pointer kernel that ``autotuned``
tunes). ``--dtype tf32`` runs fp32 operands in tf32 on both sides (cuBLAS with TF32 allowed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton.testing

from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info
from tilegemm.core.launch import ensure_allocator
from tilegemm.ops.matmul import grouped, persistent_tma, split_k
from tilegemm.ops.matmul.configs import autotune_configs, prune_for
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32}


def candidates(rung: str, p, extra: list) -> list[dict]:
    if rung == "split_k":
        return split_k.configs(p) + [split_k.make_config(*e) for e in extra]
    if rung == "persistent_tma":
        return persistent_tma.candidates(p) + [e if isinstance(e, dict) else persistent_tma.make_config(*e) for e in extra]
    if rung == "grouped":
        return prune_for(autotune_configs(), p.a.element_size()) + [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)
                      for bm, bn, bk, w, s in extra]
    raise SystemExit(f"unknown rung {rung}")


def launcher(rung: str, p, cfg: dict):
    if rung == "split_k":
        return lambda: split_k.launch_config(p, cfg)
    if rung == "persistent_tma":
        ensure_allocator()
        return lambda: persistent_tma.launch_config(p, cfg)
    return lambda: grouped.run(p, cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--layout", default="NN", choices=["NN", "NT", "TN", "TT"],
                    help="T: that operand is a transposed view of a contiguous tensor")
    ap.add_argument("--rungs", default="split_k,persistent_tma,grouped")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds, cuBLAS and each config in turn")
    args = ap.parse_args()
    M, N, K = (int(x) for x in args.shape.split("x"))
    dtype = DTYPES[args.dtype]
    extra = json.loads(args.extra)
    precision = "tf32" if args.dtype == "tf32" else "ieee"
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    a = torch.randn(K, M, device="cuda", dtype=dtype).T if args.layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).T if args.layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    ref = torch.matmul(a.double(), b.double()).float()
    field = []  # (name, rung, cfg, fn)
    rows = []
    for rung in args.rungs.split(","):
        for cfg in candidates(rung, make_problems(a, b, torch.empty(M, N, device="cuda", dtype=dtype), None, None,
                                                   1.0, 0.0, "none", precision, False)[0], extra.get(rung, [])):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", precision, False)[0]
            name = rung + " " + " ".join(f"{k}={v}" for k, v in cfg.items() if (k, v) != ("GROUP_M", 8))
            # Timed as the tuners time (tuning.replaying): replays of a recorded launch, so that the host's
            # launch path (15-60 us) does not hide a small kernel's time.
            fn = tuning.replaying(lambda c, rung=rung, p=p: launcher(rung, p, c)(), cfg)
            try:
                fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - diagnosis: record and go on
                rows.append(dict(kernel=name, error=str(e)[:200]))
                continue
            if not err < 1e-2:
                rows.append(dict(kernel=name, error=f"wrong: rel err {err}"))
                continue
            field.append((name, rung, cfg, fn))
    times = {"cuBLAS": []} | {name: [] for name, *_ in field}
    for _ in range(args.rounds):
        times["cuBLAS"].append(triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=20, rep=150,
                                                       return_mode="median"))
        for name, _, _, fn in field:
            times[name].append(triton.testing.do_bench(fn, warmup=20, rep=150, return_mode="median"))
    base = statistics.median(times["cuBLAS"])
    rows.append(dict(kernel="cuBLAS", us=base * 1e3, runs=times["cuBLAS"]))
    for name, rung, cfg, _ in field:
        ms = statistics.median(times[name])
        rows.append(dict(kernel=name, rung=rung, config=cfg, us=ms * 1e3, runs=times[name], ratio=base / ms))
    path = os.path.join(os.environ.get("OUT", "."), f"candidates-{args.shape}-{args.dtype}-{args.layout}.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), shape=[M, N, K], dtype=args.dtype, layout=args.layout,
                       rows=rows), f, indent=1)
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    for r in ok[:25]:
        print(f"{r['us']:8.1f} us {r.get('ratio', 1.0):6.3f}x  {r['kernel']}")
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['kernel']}: {r['error'][:90]}")


if __name__ == "__main__":
    main()
