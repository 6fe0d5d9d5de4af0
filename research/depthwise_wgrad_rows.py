"""Open question (GPU): how should the depthwise weight gradient split its work (a tap or a row a program, slices)?

``depthwise_wgrad_kernel`` with ``S_PAD = 1`` gives each program one tap and re-reads dy and x from L2 once per
tap (49 times at 7x7); with ``S_PAD`` a row's taps share each dy tile and read x's shifted columns from L1. This
times, on the zoo's depthwise layers (batch 32, fp16, channels-last; the first ``--per-kind`` of each kind of
``tools/conv2d_depthwise_candidates.py``), cuDNN's weight gradient and the kernel per tap, per row (the rule's
pixel block), each with its pixel slices aimed at 2 to 32 programs an SM, checked against cuDNN's fp32 gradient,
as CUDA graphs; a table of cuDNN time / ours with geomeans per kind last. The first run (both shapes at 2
programs an SM, 0.21x-0.22x cuDNN) found the kernel latency-bound: few programs, each a long serial loop; 32
programs an SM (shipped) ran 0.375x. What is left open: the rest of the gap to cuDNN (docs/conv2d.md,
"Depthwise weight gradient").

    PYTHONPATH=src:tools python3 research/depthwise_wgrad_rows.py [--per-kind 8] [--budget 120] [--out F.json]
    PYTHONPATH=src:tools python3 research/depthwise_wgrad_rows.py --kernel grouped_direct   # the same question

``--kernel grouped_direct``: the same loop (programs a tap over pixel slices) in ``grouped_direct``'s weight
gradient, on the zoo's grouped layers it takes (``configs.takes_grouped_direct``; ResNeXt's groups of 4 and 8
channels among them), at 2 to 32 programs an SM.
"""

from __future__ import annotations

import argparse
import json
import lzma
import time

import torch

from conv2d_depthwise_candidates import KINDS, geomean, graph_us, kind, label, ordered_layers
from tilegemm.core.checks import relative_error
from tilegemm.ops.conv2d import depthwise, grouped_direct
from tilegemm.ops.conv2d.configs import (depthwise_wgrad_config, depthwise_wgrad_taps_config,
                                        depthwise_wgrad_walk_config, takes_grouped_direct, walk_column_runs,
                                        walk_takes)
from tilegemm.ops.conv2d.problem import geometry_of

# (program shape, programs an SM the pixel slices aim at, least pixel blocks a slice): 2 and 8 were the rule
CANDIDATES = ("tap-2-8", "row-2-8", "tap-8-4", "row-8-4", "tap-16-4", "row-16-4", "tap-32-2", "row-32-2")
GROUPED_CANDIDATES = ("tap-2-8", "tap-8-4", "tap-16-4", "tap-32-2")


def config(name: str, g) -> dict:
    if name in ("rule", "rule-c1"):  # the walking kernel as auto configures it (COLS by the rule), or one run
        return dict(depthwise_wgrad_walk_config(g, torch.float16), **({"COLS": 1} if name == "rule-c1" else {}))
    shape, per_sm, steps, *bq = name.split("-")
    # depthwise_wgrad_walk_kernel: walk-PER_SM-MIN_CHUNKS[-STAGES|-aAHEAD|-rROWS|-vVEC|-cCOLS] (no -cCOLS: the rule's)
    if shape == "walk":
        rows = next((min(g.R, int(e[1:])) for e in bq if e.startswith("r")), None)
        cfg = dict(depthwise_wgrad_walk_config(g, torch.float16, rows), PER_SM=int(per_sm), MIN_CHUNKS=int(steps))
        for extra in bq:
            if extra.startswith("r"):
                continue
            if extra.startswith("v"):  # channels a thread, the tile recomputed as the config does (4 warps)
                vec = int(extra[1:])
                bn = max(vec, min(64, g.K & -g.K))
                cfg.update(BLOCK_N=bn, BLOCK_P=max(1, 128 * vec // bn))
            elif extra.startswith("c"):  # runs of output columns, each its own program
                cfg["COLS"] = int(extra[1:])
            elif extra.startswith("a"):
                cfg["AHEAD"] = int(extra[1:])
            else:
                cfg["num_stages"] = int(extra)
        return cfg
    if shape == "all":  # depthwise_wgrad_taps_kernel: every tap a program, slices of output rows; -BQ: its columns
        cfg = dict(depthwise_wgrad_taps_config(g, torch.float16), PER_SM=int(per_sm), MIN_ROWS=int(steps))
        if bq:
            cfg["BLOCK_Q"] = int(bq[0])
        return cfg
    # rows asked for by name: the rule's default (DEPTHWISE_WGRAD_ROW_TAPS) is a program a tap
    cfg = depthwise_wgrad_config(g, torch.float16, rows=shape == "row", taps=False)
    return dict(cfg, PER_SM=int(per_sm), MIN_STEPS=int(steps))


def run_layer(L: dict, batch: int, kernel: str = "depthwise", names=CANDIDATES, dgrad: bool = False) -> dict:
    C, K, groups = L["C"], L["K"], L["groups"]
    pad = L["padding"]
    x = [torch.randn(batch, C, L["H"], L["W"], device="cuda", dtype=torch.float16)
         .contiguous(memory_format=torch.channels_last) for _ in range(2)]
    w = torch.randn(K, C // groups, L["R"], L["S"], device="cuda", dtype=torch.float16)
    g = geometry_of(x[0].shape, w.shape, L["stride"], [pad[0], pad[0], pad[1], pad[1]], L["dilation"], groups)
    dy = [torch.randn(batch, K, g.P, g.Q, device="cuda", dtype=torch.float16)
          .contiguous(memory_format=torch.channels_last) for _ in range(2)]

    def cudnn(i, dt=None):
        xx, yy, ww = (x[i], dy[i], w) if dt is None else (x[i].to(dt), dy[i].to(dt), w.to(dt))
        return torch.ops.aten.convolution_backward(yy, xx, ww, None, L["stride"], pad, L["dilation"], False,
                                                   [0, 0], groups, [False, True, False])[1]

    ref = cudnn(0, torch.float32)
    row = dict(layer=label(L, batch) + (f"g{groups}" if kernel != "depthwise" else ""), models=L.get("models"),
               kind=kind(L) if kernel == "depthwise" else f"{C // groups}-a-group")
    row["cudnn_us"] = graph_us(cudnn, 2)
    if dgrad:  # the other half of the layer's backward: auto's data gradient against cuDNN's, checked the same way
        pads = [pad[0], pad[0], pad[1], pad[1]]

        def cudnn_dx(i, dt=None):
            xx, yy, ww = (x[i], dy[i], w) if dt is None else (x[i].to(dt), dy[i].to(dt), w.to(dt))
            return torch.ops.aten.convolution_backward(yy, xx, ww, None, L["stride"], pad, L["dilation"], False,
                                                       [0, 0], groups, [True, False, False])[0]

        def ours_dx(i):
            return torch.ops.tilegemm.conv2d_dgrad(dy[i], w, list(x[i].shape), True, list(L["stride"]), pads,
                                                   list(L["dilation"]), groups, "default")

        err = relative_error(ours_dx(0).float(), cudnn_dx(0, torch.float32))
        row["dgrad_cudnn_us"] = graph_us(cudnn_dx, 2)
        row["dgrad"] = row["dgrad_cudnn_us"] / graph_us(ours_dx, 2) if err < 1e-2 else None
    for name in names:
        if kernel == "depthwise":
            cfg = config(name, g)
            fn = lambda i, cfg=cfg: depthwise.wgrad(dy[i], x[i], g, torch.float16, dict(cfg))  # noqa: E731
        else:
            _, per_sm, steps = name.split("-")
            bm = 32
            bg = max(1, min(g.groups, 128 // (_pow2(g.Kg) * _pow2(g.Cg))))
            cfg = dict(BLOCK_M=bm, BLOCK_G=_pow2(bg), num_warps=4, PER_SM=int(per_sm), MIN_STEPS=int(steps))
            fn = lambda i, cfg=cfg: grouped_direct.wgrad(dy[i], x[i], g, torch.float16,  # noqa: E731
                                                         torch.channels_last, dict(cfg))
        err = relative_error(fn(0).float(), ref)
        if not err < 1e-2:
            row[name] = None
            row[f"{name}_err"] = err
            continue
        row[name] = row["cudnn_us"] / graph_us(fn, 2)
    return row


def rule_cols(L: dict, batch: int) -> int:
    """The runs of output columns the walk takes on the layer by the rule (1: not split; not walked)."""
    pad = L["padding"]
    g = geometry_of((batch, L["C"], L["H"], L["W"]), (L["K"], 1, L["R"], L["S"]), L["stride"],
                    [pad[0], pad[0], pad[1], pad[1]], L["dilation"], L["C"])
    if not walk_takes(g):
        return 1
    cfg = depthwise_wgrad_walk_config(g, torch.float16)
    tiles = -(-g.K // cfg["BLOCK_N"]) * -(-g.R // cfg["ROWS"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return walk_column_runs(g, tiles * -(-batch * g.P // cfg["BLOCK_P"]), cfg["PER_SM"] * sms)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def grouped_layers() -> list[dict]:
    from tilegemm.ops.conv2d import zoo

    out = []
    for L in zoo.bench_layers():
        if L["groups"] > 1 and L["groups"] != L["C"]:
            pad = L["padding"]
            g = geometry_of((32, L["C"], L["H"], L["W"]), (L["K"], L["C"] // L["groups"], L["R"], L["S"]),
                            L["stride"], [pad[0], pad[0], pad[1], pad[1]], L["dilation"], L["groups"])
            if takes_grouped_direct(g):
                out.append(L)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=8)
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kernel", choices=("depthwise", "grouped_direct"), default="depthwise")
    ap.add_argument("--candidates", help="comma-separated names (e.g. tap-32-2,row-32-2); default: all")
    ap.add_argument("--kinds", help="comma-separated kinds of layer to take (e.g. 5x5,7x7); default: all")
    ap.add_argument("--dgrad", action="store_true", help="also time auto's data gradient against cuDNN's")
    ap.add_argument("--rule-cols", action="store_true",
                    help="only the layers whose walk the rule splits into runs of columns (every kind)")
    ap.add_argument("--exclude", help="a results JSON of this script: leave out the layers it timed")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    layers, seen = [], {}
    excluded = set()
    if args.exclude:  # (a results JSON, or one compressed by xz as benchmarks/results keeps them)
        with (lzma.open if args.exclude.endswith(".xz") else open)(args.exclude, "rt") as f:
            excluded = {r["layer"] for r in json.load(f)}
    for L in ordered_layers(KINDS) if args.kernel == "depthwise" else grouped_layers():
        k = kind(L)
        if args.kinds and k not in args.kinds.split(","):
            continue
        if label(L, args.batch) in excluded or (args.rule_cols and rule_cols(L, args.batch) == 1):
            continue
        if args.kernel != "depthwise" or seen.get(k, 0) < args.per_kind:
            seen[k] = seen.get(k, 0) + 1
            layers.append(L)
    names = CANDIDATES if args.kernel == "depthwise" else GROUPED_CANDIDATES
    if args.candidates:
        names = tuple(args.candidates.split(","))
    start, rows = time.time(), []
    for L in layers:
        if time.time() - start > args.budget:
            break
        rows.append(run_layer(L, args.batch, args.kernel, names, args.dgrad))
        r = rows[-1]
        print(f"{r['layer']:<30s} {r['kind']:<7s} {r['cudnn_us']:7.1f}us "
              + " ".join(f"{r[c]:.2f}" if r[c] else "WRONG" for c in names)
              + (f"  dgrad {r['dgrad_cudnn_us']:.1f}us {r['dgrad']:.2f}" if r.get("dgrad") else
                 "  dgrad WRONG" if args.dgrad else ""), flush=True)
    names = names + (("dgrad",) if args.dgrad else ())  # (the summaries: the data gradient a column too)
    print(f"{len(rows)} layers; cuDNN time / ours, geomean per kind ({' '.join(names)}); even / odd layers:")
    for k in [*dict.fromkeys(r["kind"] for r in rows), "all"]:
        mine = [r for r in rows if k == "all" or r["kind"] == k]
        if mine:
            print(f"  {k:<8s} {len(mine):3d}  " + "  ".join(f"{c} {geomean(r[c] for r in mine) or 0:.3f}x"
                                                        for c in names))
    for half in (0, 1):
        mine = rows[half::2]
        print(f"  half {half} {len(mine):3d}  " + " ".join(f"{geomean(r[c] for r in mine) or 0:.3f}"
                                                      for c in names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
