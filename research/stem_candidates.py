"""Which kernel runs the zoo's stems (convolutions of at most 8 input channels, one group, not patch embeddings)
fastest: the TMA window route ``auto`` takes (``tma_implicit_gemm``), or the pointer kernel ``implicit_gemm``,
whose K loop walks (r, s, c) as one index for them (``FLAT_K``), at which tile?

For each stem of ``src/tilegemm/ops/conv2d/zoo.json`` (batch 32, fp16, channels-last input, weight as stored,
the layer's bias), it times the row kernel of ``research/stem_kernel.py`` at BQ 64/128/256, BK 32/64, 4 or 8
warps, and ``F.conv2d`` (cuDNN, benchmark mode), ``tilegemm.conv2d`` (``auto``), the window route
by name, ``implicit_gemm`` by name (``stem``: its stem kernel at ``configs.stem_rows_config``'s tile), and its
``FLAT_K`` kernel at a grid of tiles (BLOCK_M 64/128/256, BLOCK_K 32/64, 4 or 8 warps, 1 or 2 stages). Every call's output is checked against an fp32 reference (the bench's
bound) before it is timed; CUDA-graph replays (``tools/conv2d_depthwise_candidates.graph_us``), ratio = cuDNN's
time / the call's. Writes ``--out`` after every layer and prints a table last.

    PYTHONPATH=src:tools python3 research/stem_candidates.py --out $OUT/stem-candidates.json [--budget 150]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conv2d_depthwise_candidates import geomean, graph_us  # noqa: E402


def stems() -> list[dict]:
    from tilegemm.ops.conv2d import patchify
    from tilegemm.ops.conv2d.problem import geometry_of

    path = os.path.join(os.path.dirname(__file__), "..", "src", "tilegemm", "ops", "conv2d", "zoo.json")
    layers = json.load(open(path))["layers"]
    out = []
    for L in layers:
        if L["C"] > 8 or L["groups"] != 1 or L["H"] == 1 or L["R"] * L["S"] == 1:
            continue
        (ph, pw) = L["padding"]
        g = geometry_of((32, L["C"], L["H"], L["W"]), (L["K"], L["C"], L["R"], L["S"]), list(L["stride"]),
                        [ph, ph, pw, pw], list(L["dilation"]), 1)
        if patchify.takes(g):
            continue
        out.append(L)
    return out


def configs(L: dict) -> list[dict]:
    kk = L["R"] * L["S"] * L["C"]
    bn = max(16, 1 << (L["K"] - 1).bit_length())
    grid = []
    for bm, bk, warps, stages in itertools.product((64, 128, 256), (32, 64), (4, 8), (1, 2)):
        if bk > 32 and kk <= 32 or stages > 1 and kk <= bk or bm * bn > 256 * 64:
            continue
        grid.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                         FLAT_K=True))
    return grid


def label(L: dict) -> str:
    return f"{L['C']}->{L['K']} {L['R']}x{L['S']}/{L['stride'][0]} p{L['padding'][0]} @{L['H']}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, fp32, tiny images, 2 layers")
    args = ap.parse_args()
    dev, dt = ("cpu", torch.float32) if args.smoke else ("cuda", torch.float16)
    import tilegemm
    from tilegemm.ops.conv2d import implicit_gemm, reference
    from tilegemm.ops.conv2d.configs import forward_config
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

    torch.backends.cudnn.benchmark = True
    start = time.time()
    rows = []
    for L in stems()[:2] if args.smoke else stems():
        if args.smoke:
            L = dict(L, H=12, W=12, K=min(L["K"], 20))
            args.batch = 1
        if time.time() - start > args.budget:
            break
        C, K, H, W, R, S = (L[k] for k in ("C", "K", "H", "W", "R", "S"))
        stride, (ph, pw), dil = tuple(L["stride"]), L["padding"], tuple(L["dilation"])
        sets = 2
        xs = [torch.randn(args.batch, C, H, W, device=dev, dtype=dt)
              .contiguous(memory_format=torch.channels_last) for _ in range(sets)]
        w = (torch.randn(K, C, R, S, device=dev) / math.sqrt(C * R * S)).to(dt)
        b = torch.randn(K, device=dev).to(dt) if L["bias"] else None
        ref = F.conv2d(xs[0].float(), w.float(), None if b is None else b.float(), stride, (ph, pw), dil)
        g = geometry_of(xs[0].shape, w.shape, list(stride), [ph, ph, pw, pw], list(dil), 1)
        probs = [ConvProblem(x, w, b, g, dt, torch.channels_last, "none", "ieee", False) for x in xs]
        calls = {
            "cudnn": lambda i: F.conv2d(xs[i], w, b, stride, (ph, pw), dil),
            "auto": lambda i: tilegemm.conv2d(xs[i], w, b, stride, (ph, pw), dil),
            "window": lambda i: tilegemm.conv2d(xs[i], w, b, stride, (ph, pw), dil, kernel="tma_implicit_gemm"),
            "stem": lambda i: implicit_gemm.run(probs[i]),  # the pointer kernel's stem path (its rule)
        }
        import stem_kernel

        for bq, bk, warps in itertools.product((64, 128, 256), (32, 64), (4, 8)):
            bn = min(128, max(16, 1 << (K - 1).bit_length()))
            if bk > 32 and R * S * C <= 32 or bq * bn > 256 * 64:
                continue
            calls[f"r{bq}x{bn}x{bk}w{warps}"] = (lambda a, c, d, e: lambda i: stem_kernel.run(
                xs[i], w, b, stride, (ph, pw), BQ=a, BN=c, BK=d, num_warps=e))(bq, bn, bk, warps)
        xn = [x.contiguous() for x in xs]  # NCHW copies: a model's images usually come so
        bn = min(128, max(16, 1 << (K - 1).bit_length()))
        calls[f"nchw-r128x{bn}x32w4"] = lambda i: stem_kernel.run(xn[i], w, b, stride, (ph, pw), BQ=128, BN=bn)
        calls["nchw-auto"] = lambda i: tilegemm.conv2d(xn[i], w, b, stride, (ph, pw), dil)
        for cfg in configs(L):
            name = "p{BLOCK_M}x{BLOCK_N}x{BLOCK_K}w{num_warps}s{num_stages}".format(**cfg)
            calls[name] = (lambda c: lambda i: implicit_gemm.run(probs[i], dict(c)))(cfg)
        bound = reference.tolerance(torch.float16) if hasattr(reference, "tolerance") else 4e-3
        row = {"layer": label(L), "models": L["models"], "default": forward_config(g, dt), "us": {},
               "errors": {}}
        for name, fn in calls.items():
            try:
                out = fn(0)
                if args.smoke:
                    row["us"][name] = 1.0
                    continue
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err <= bound:
                    row["errors"][name] = f"rel err {err:.2e}"
                    continue
                row["us"][name] = graph_us(fn, sets)
            except Exception as e:  # noqa: BLE001  (recorded, the next candidate runs)
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
        base = row["us"].get("cudnn")
        row["ratio"] = {k: base / v for k, v in row["us"].items()} if base else {}
        cands = {k: v for k, v in row["ratio"].items() if k.startswith("p") and k != "stem"}
        row["best"] = max(cands, key=cands.get) if cands else None
        rows_ = {k: v for k, v in row["ratio"].items() if k.startswith("r") and k != "ratio"}
        row["best_rows"] = max(rows_, key=rows_.get) if rows_ else None
        rows.append(row)
        json.dump({"rows": rows, "elapsed_s": time.time() - start}, open(args.out, "w"), indent=1)
        r = row["ratio"]
        print(f"{row['layer']:28s} cudnn {base or 0:7.1f}us auto {r.get('auto', 0):.2f} window {r.get('window', 0):.2f}"
              f" stem {r.get('stem', 0):.2f} best {row['best']} {r.get(row['best'], 0):.2f}"
              f" rows {row['best_rows']} {r.get(row['best_rows'], 0):.2f} "
              + " ".join(f"{k} {v:.2f}" for k, v in r.items() if k.startswith("nchw")) + f" errors {len(row['errors'])}", flush=True)
    for col in ("auto", "window", "stem", "nchw-auto"):
        print(col, "geomean", f"{geomean(r['ratio'].get(col) for r in rows) or 0:.3f}")
    print("best", "geomean", f"{geomean(r['ratio'].get(r['best']) for r in rows if r['best']) or 0:.3f}")
    print("rows", "geomean", f"{geomean(r['ratio'].get(r['best_rows']) for r in rows if r['best_rows']) or 0:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
