"""Open question: which split_k tile should a stride-1 1x1 layer's weight gradient (``dw[K, C] = dy^T @ x`` over
the N*H*W pixels) take? ``gemm_1x1.pointwise_wgrad`` ran ``WGRAD_TILE`` (64x64x128) in one wave of K slices
wherever its tiles fit one per SM; a 64x64 tile reads twice the operand bytes a 128x128 one does for the same
FLOPs, and on wide layers (232 -> 696 at 56x56) the gradient ran 0.44x cuDNN's
(`benchmarks/results/2026-12-04-h200/09fa908/conv2d-worst-wgrad.json`).

For zoo 1x1 stride-1 layers (batch 32, fp16, channels-last), drawn from a seed, each of:
``cudnn`` (aten.convolution_backward, weight only, cudnn.benchmark), ``shipped`` (pointwise_wgrad) and every
tile of TILES in one wave of K slices (``wave_split``), checked against an fp32 reference, then timed as CUDA-graph
replays (triton.testing.do_bench_cudagraph); ratio = cuDNN time / time. GPU only.

    PYTHONPATH=src python3 research/pointwise_wgrad_tiles.py --out $OUT/pointwise-wgrad-tiles.json [--seed 1] [--n 16]
        [--extra 232x696@56,256x128@56]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

TILES = [(64, 64, 128, 4, 6), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
         (128, 256, 64, 8, 3)]


def layers(seed: int, n: int, extra: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "src", "tilegemm", "ops", "conv2d", "zoo.json")) as f:
        zoo = json.load(f)["layers"]
    found = sorted({(d["C"], d["K"], d["H"]) for d in zoo if d["R"] == d["S"] == 1 and d["stride"] == [1, 1]
                    and d["groups"] == 1 and d["H"] == d["W"] and d["H"] >= 7 and d["C"] % 8 == 0 and d["K"] % 8 == 0})
    return extra + [c for c in random.Random(seed).sample(found, n) if c not in extra]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--extra", default="232x696@56", help="layers timed first, CxK@H,... (stride 1, batch 32)")
    args = ap.parse_args()

    import tilegemm  # noqa: F401 - settles the backend first
    import torch
    import triton.testing
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.runtime import new_output
    from tilegemm.ops.conv2d.gemm_1x1 import pointwise_wgrad, wave_split
    from tilegemm.ops.matmul.dispatch import launch as launch_gemm
    from tilegemm.ops.matmul.problem import make_problems

    torch.backends.cudnn.benchmark = True
    sms = sm_count(torch.device("cuda"))
    rows = []
    extra = [tuple(int(v) for v in e.replace("@", "x").split("x")) for e in args.extra.split(",") if e]
    for C, K, H in layers(args.seed, args.n, extra):
        N = 32
        x = torch.randn(N, C, H, H, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        dy = torch.randn(N, K, H, H, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        w = torch.empty(K, C, 1, 1, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        a, b = dy.permute(0, 2, 3, 1).reshape(-1, K).t(), x.permute(0, 2, 3, 1).reshape(-1, C)
        ref = a.float() @ b.float()
        calls = {"cudnn": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [0, 0], [1, 1], False,
                                                                      [0, 0], 1, [False, True, False])[1],
                 "shipped": lambda: pointwise_wgrad(a, b, "ieee")}
        for bm, bn, bk, warps, stages in TILES:
            tiles = -(-K // bm) * -(-C // bn)
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=wave_split(tiles, -(-a.shape[1] // bk), sms),
                       SLICES=True, num_warps=warps, num_stages=stages)

            def run(cfg=cfg):
                out = new_output((K, C), a.dtype, a.device)
                for p in make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False):
                    launch_gemm(p, kernel="split_k", config=cfg)
                return out

            calls[f"{bm}x{bn}x{bk}w{warps}s{stages}/{cfg['SPLIT_K']}"] = run
        label = f"{C}x{K}@{H}"
        times = {}
        for name, fn in calls.items():
            try:
                out = fn().reshape(K, C).float()
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < 4e-3:
                    rows.append(dict(layer=label, call=name, error=f"relative error {err:.2e}"))
                    continue
                times[name] = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - recorded
                rows.append(dict(layer=label, call=name, error=f"{type(e).__name__}: {str(e)[:160]}"))
        if "cudnn" not in times or "shipped" not in times:  # (recorded above) no ratio to take
            print(f"{label:>16} not compared: {[r['error'] for r in rows if r['layer'] == label][:2]}", flush=True)
            continue
        for name, us in times.items():
            rows.append(dict(layer=label, call=name, us=us, ratio=times["cudnn"] / us))
        best = max((n for n in times if n not in ("cudnn", "shipped")), key=lambda n: -times[n])
        print(f"{label:>16} cudnn {times['cudnn']:7.1f} us  shipped {times['cudnn'] / times['shipped']:.2f}x  "
              f"best {best} {times['cudnn'] / times[best]:.2f}x", flush=True)
        with open(args.out, "w") as f:  # after every layer: a later failure keeps what ran
            json.dump(dict(tiles=TILES, seed=args.seed, rows=rows), f, indent=1)
    names = sorted({r["call"].split("/")[0] for r in rows if "ratio" in r})
    for n in names:
        v = [r["ratio"] for r in rows if "ratio" in r and r["call"].split("/")[0] == n]
        print(f"{n:>22}: geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f}x, worst {min(v):.3f}x ({len(v)} layers)")
    print("errors:", [r for r in rows if "error" in r][:4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
