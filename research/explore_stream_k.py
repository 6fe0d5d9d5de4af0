"""Exploration on the GPU: does persistent_tma's stream-K form (``STREAM_K``) beat its whole tiles and its K
splits where the output tiles fill the SMs poorly? (not a test)

Stream-K cuts the product's ``tiles x K steps`` into one even run a program (one program an SM), so no SM idles
in a last partial wave whatever the number of tiles; a tile whose steps two programs share is summed by the
last to arrive. The shapes are products whose 128x128 tiles make a partial wave or a few waves with a ragged
last one: ResNet-50's 1x1 layers at 14x14 and 7x7 as GEMMs, LLM projections at moderate M, and a draw of
shapes from a seed of their own (none of them the bench's ``random`` sweep's).

For each shape: cuBLAS, ``auto`` (the public call), every unsplit candidate of persistent_tma (Triton and Gluon
configs), its K splits of one wave, and ``STREAM_K`` on five tiles; each checked against cuBLAS's product
(relative error), then timed as replays of its recorded launch (as the tuners time), do_bench medians in
``--rounds`` rounds alternating with cuBLAS. Writes ``$OUT/stream-k-<dtype>.json``; prints per shape cuBLAS's
time and the ratio of ``auto``, the best unsplit config, the best split and the best stream-K config.

    PYTHONPATH=src:research python3 research/explore_stream_k.py [--dtype fp16] [--shapes 6272x256x1024,...] [--budget S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

import tilegemm
from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems

from diagnose_random import timed_against_cublas  # noqa: E402  (do_bench medians alternating with cuBLAS)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
STREAM_TILES = ((128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 128, 4, 4),
                (256, 128, 64, 8, 3))
FIXED = ["6272x256x1024", "6272x512x1024", "1568x512x2048", "1568x2048x512", "512x4096x4096", "768x5120x5120",
         "1024x4096x4096", "384x11008x4096", "2048x3072x3072", "640x13824x5120"]


def drawn(count: int, seed: int = 20261128) -> list[str]:
    """Shapes with a ragged last wave of 128x128 tiles: M 256..4096, N and K 512..16384, multiples of 64."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        M, N, K = (64 * round(2 ** rng.uniform(lo, hi) / 64) for lo, hi in ((8, 12), (9, 14), (9, 14)))
        tiles = -(-M // 128) * -(-N // 128)
        if 0.4 < tiles / 132 < 4 and (tiles % 132) / 132 < 0.7:
            out.append(f"{M}x{N}x{K}")
    return out


def field(a, b, dtype):
    """(name, kind, cfg) of every config timed: persistent_tma's candidates (unsplit, split) and STREAM_K."""
    M, N = a.shape[0], b.shape[1]
    p = make_problems(a, b, torch.empty(M, N, device="cuda", dtype=dtype), None, None, 1.0, 0.0, "none", "ieee",
                      False)[0]
    out = []
    for cfg in persistent_tma.candidates(p):
        out.append(("split" if cfg.get("SPLIT_K", 1) > 1 else "whole", cfg))
    for tile in STREAM_TILES[:2] + STREAM_TILES[4:]:
        for share in (2, 4):
            out.append(("stream", dict(persistent_tma.make_config(*tile, flatten=False), STREAM_K=True,
                                       SK_SHARE=share)))
    return out


def name_of(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items() if (k, v) != ("GROUP_M", 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--shapes", default=None, help="comma-separated MxNxK (default: the fixed list and 12 drawn)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=330.0, help="seconds: no new shape is started past it")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    shapes = args.shapes.split(",") if args.shapes else FIXED + drawn(12)
    persistent_tma.ensure_allocator()
    t0 = time.time()
    results = []
    for shape in shapes:
        if time.time() - t0 > args.budget:
            print(f"budget spent: {shape} and later not run")
            break
        M, N, K = (int(x) for x in shape.split("x"))
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        ref = torch.matmul(a, b).float()
        fns = {"cuBLAS": lambda: torch.matmul(a, b), "auto": lambda: tilegemm.matmul(a, b)}
        kinds = {"auto": "auto"}
        rows = []
        for kind, cfg in field(a, b, dtype):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
            fn = tuning.replaying(lambda c, p=p: persistent_tma.launch_config(p, c), cfg)
            name = f"{kind} {name_of(cfg)}"
            try:
                fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - exploration: record and go on
                rows.append(dict(kernel=name, kind=kind, error=str(e)[:200]))
                continue
            if not err < 1e-2:
                rows.append(dict(kernel=name, kind=kind, error=f"wrong: rel err {err}"))
                continue
            fns[name] = fn
            kinds[name] = kind
        check = tilegemm.matmul(a, b).float()
        auto_err = ((check - ref).norm() / ref.norm()).item()
        timed = timed_against_cublas(fns, args.rounds, rep=60)
        base = timed["cuBLAS"]["us"] / 1e3
        for name, t in timed.items():
            rows.append(dict(kernel=name, kind=kinds.get(name, "baseline"), **t))
        best = {}
        for r in rows:
            if "ratio" in r and r["kind"] != "baseline" and r["ratio"] > best.get(r["kind"], {}).get("ratio", 0):
                best[r["kind"]] = r
        tiles = -(-M // 128) * -(-N // 128)
        results.append(dict(shape=[M, N, K], tiles_128=tiles, cublas_us=base * 1e3, auto_err=auto_err,
                            best={k: dict(kernel=v["kernel"], ratio=v["ratio"], us=v["us"]) for k, v in best.items()},
                            rows=rows))
        print(f"{shape:>18} tiles {tiles:5d} cuBLAS {base * 1e3:8.1f} us | " + " ".join(
            f"{k} {best[k]['ratio']:.3f}" for k in ("auto", "whole", "split", "stream") if k in best)
            + f" | stream: {best['stream']['kernel'][7:60] if 'stream' in best else '-'}", flush=True)
    path = os.path.join(os.environ.get("OUT", "."), f"stream-k-{args.dtype}.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), commit=os.environ.get("TILEGEMM_GIT_COMMIT"),
                       dtype=args.dtype, results=results), f, indent=1)
    errors = [(r["shape"], row["kernel"], row["error"]) for r in results for row in r["rows"] if "error" in row]
    for e in errors[:20]:
        print("FAILED", e)
    for kind in ("auto", "whole", "split", "stream"):
        vals = [r["best"][kind]["ratio"] for r in results if kind in r["best"]]
        if vals:
            geo = statistics.geometric_mean(vals)
            print(f"best {kind:6s} geomean {geo:.3f} over {len(vals)} shapes (worst {min(vals):.3f})")


if __name__ == "__main__":
    main()
