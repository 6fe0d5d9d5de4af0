"""Answered (GPU), and the route now ships: the weight gradient of a grouped layer of few channels a group runs
faster as the dense-per-group gradient of a coarser grouping on tensor cores, keeping only its block diagonal.
``auto`` takes it (``dispatch._coarse_wgrad``, its GT by ``configs.coarse_wgrad_groups``; docs/conv2d.md, "Grouped
weight gradient by a coarser grouping"), so ``auto`` below is the shipped route and ``gtN`` that route at each
candidate GT. Kept for one rerun on the GPU.

``grouped_direct``'s weight gradient (groups of at most 8 channels: ResNeXt's and RegNet's 3x3 layers) runs on
CUDA cores at about a quarter of cuDNN's speed (docs/conv2d.md, "Depthwise weight gradient"), and the layers of
16-56 channels a group take ``tma_wgrad`` per group, whose 64-wide tiles hold one group's 16-56 channels. Seen with
GT times fewer groups (``grouped_packed.coarse_geometry``), the layer's weight gradient is ``[K, GT*C/groups, R, S]``
of which the block diagonal is the layer's: GT times the MMA work, in full 64-wide tiles, read once.

Times, on the zoo's grouped layers of at most 56 channels a group and (``--depthwise``) some depthwise ones
(batch 32, fp16, channels-last, CUDA graphs, each checked against cuDNN's fp32 gradient): cuDNN's weight gradient,
tilegemm's ``auto``, and the coarse route at up to three GT making 32-128 channels a coarse group (the coarse
gradient by ``tma_wgrad`` into a workspace, then ``grouped_packed.block_diagonal``'s launch that copies the block
diagonal out). A table of cuDNN time / ours and geomeans (even and odd layers apart) last.

    PYTHONPATH=src:tools python3 research/grouped_wgrad_coarse.py [--budget 150] [--depthwise 8] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import tilegemm  # noqa: F401  (first: it chooses Triton's interpreter or the GPU before triton is imported)

from conv2d_depthwise_candidates import geomean, graph_us
from tilegemm.core.checks import relative_error
from tilegemm.core.registry import NotApplicable
from tilegemm.ops.conv2d import dispatch, zoo
from tilegemm.ops.conv2d.grouped_packed import coarse_geometry
from tilegemm.ops.conv2d.problem import WgradCall, geometry_of, wgrad_format


def coarse_wgrad(dy, x, g, gt: int, fmt) -> torch.Tensor:
    """The shipped route at this GT (its coarse gradient by ``tma_wgrad``, its block diagonal by
    ``grouped_packed.block_diagonal``), where ``tma_wgrad`` takes the coarse layer."""
    if not dispatch._tma_wgrad_usable(dy, x, coarse_geometry(g, gt)):
        raise NotApplicable(f"tma_wgrad does not take the coarse layer of GT={gt}")
    return dispatch._coarse_wgrad(dy, x, g, gt, fmt, x.dtype)


def _geo(L: dict, batch: int):
    pad = L["padding"]
    return geometry_of((batch, L["C"], L["H"], L["W"]), (L["K"], L["C"] // L["groups"], L["R"], L["S"]),
                       L["stride"], [pad[0], pad[0], pad[1], pad[1]], L["dilation"], L["groups"])


def layers(depthwise: int) -> list[dict]:
    out, dw = [], []
    for L in zoo.bench_layers():
        if L["groups"] == 1:
            continue
        g = _geo(L, 32)
        if g.is_depthwise:
            if g.K == g.C and g.R == 3:
                dw.append(L)
        elif g.Cg <= 56 and g.Kg <= 56:
            out.append(L)
    return out + dw[::max(1, len(dw) // max(depthwise, 1))][:depthwise]


def candidates(g) -> list[int]:
    """GT making 32-128 channels a coarse group, a multiple of 8 (the TMA kernel's 16, or its padded route's), at
    most three: those nearest 64 first."""
    gts = [gt for gt in range(2, g.groups + 1)
           if g.groups % gt == 0 and gt * g.Cg % 8 == 0 and 32 <= gt * g.Cg <= 128]
    return sorted(gts, key=lambda gt: abs(gt * g.Cg - 64))[:3]


def run_layer(L: dict, batch: int) -> dict:
    g = _geo(L, batch)
    pad = list(L["padding"])
    dtype = torch.float16
    x = [torch.randn(batch, g.C, g.H, g.W, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
         for _ in range(2)]
    dy = [torch.randn(batch, g.K, g.P, g.Q, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
          for _ in range(2)]
    w = torch.empty(g.K, g.Cg, g.R, g.S, device="cuda", dtype=dtype)
    fmt = wgrad_format(x[0], list(w.shape))

    def cudnn(i, dt=None):
        xx, yy, ww = (x[i], dy[i], w) if dt is None else (x[i].to(dt), dy[i].to(dt), w.to(dt))
        return torch.ops.aten.convolution_backward(yy, xx, ww, None, L["stride"], pad, L["dilation"], False,
                                                   [0, 0], g.groups, [False, True, False])[1]

    def auto(i):
        return dispatch.wgrad(WgradCall(dy[i], x[i], list(w.shape), list(g.stride), list(g.padding),
                                        list(g.dilation), g.groups, "ieee"))

    ref = cudnn(0, torch.float32)
    row = dict(layer=f"{g.C}->{g.K} {g.R}x{g.S} s{g.stride[0]} {g.H}x{g.W} g{g.groups} ({g.Cg} a group)",
               kind="depthwise" if g.is_depthwise else f"{g.Cg}-a-group", models=L.get("models"),
               cudnn_us=graph_us(cudnn, 2))
    for name, fn in [("auto", auto)] + [(f"gt{gt}", lambda i, gt=gt: coarse_wgrad(dy[i], x[i], g, gt, fmt))
                                        for gt in candidates(g)]:
        try:
            err = relative_error(fn(0).float(), ref)
        except Exception as e:  # noqa: BLE001 - a candidate the dispatcher refuses: recorded, not fatal
            row[name], row[f"{name}_err"] = None, f"{type(e).__name__}: {e}"[:200]
            continue
        row[f"{name}_err"] = err
        row[name] = row["cudnn_us"] / graph_us(fn, 2) if err < 1e-2 else None
    coarse = [row[k] for k in row if k.startswith("gt") and not k.endswith("_err") and row[k]]
    row["best_coarse"] = max(coarse) if coarse else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--depthwise", type=int, default=8, help="depthwise 3x3 layers to add (spread over the zoo's)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    start, rows = time.time(), []
    todo = layers(args.depthwise)
    for L in todo:
        if time.time() - start > args.budget:
            break
        r = run_layer(L, args.batch)
        rows.append(r)
        cells = " ".join(f"{k} {r[k]:.2f}" if r[k] else f"{k} -" for k in r
                         if (k == "auto" or k.startswith("gt")) and not k.endswith("_err"))
        print(f"{r['layer']:<44s} {r['cudnn_us']:7.1f}us {cells}", flush=True)
    print(f"{len(rows)} of {len(todo)} layers; cuDNN time / ours, geomean (auto, the best coarse GT per layer):")
    for k in [*dict.fromkeys(r["kind"] for r in rows), "all"]:
        mine = [r for r in rows if k == "all" or r["kind"] == k]
        print(f"  {k:<12s} {len(mine):3d}  auto {geomean(r['auto'] for r in mine) or 0:.3f}x"
              f"  coarse {geomean(r['best_coarse'] for r in mine) or 0:.3f}x")
    for half in (0, 1):
        mine = rows[half::2]
        print(f"  half {half} {len(mine):3d}  auto {geomean(r['auto'] for r in mine) or 0:.3f}x"
              f"  coarse {geomean(r['best_coarse'] for r in mine) or 0:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(batch=args.batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
