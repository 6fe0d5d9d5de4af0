"""Open question (GPU): which tile should ``tma_implicit_gemm`` take on layers of few output channels over many
pixels?

``configs.tma_forward_config`` chooses 64 or 128 output pixels a tile by a cost model of MMA work and waves; on
layers of at most 64 output channels each K step is then a small MMA (64 x 32 x 32 on 24 -> 24 at 240x240) and a
program's fixed costs weigh most: such zoo layers read 0.37x-0.69x cuDNN (``2026-12-08-h100/e398b859/``), while the
stems' window convolutions, as short a reduction over as few channels, ran 1.2x-2.1x once given 256-pixel patches,
8 warps and 4 ring slots (``configs.tma_stem_config``; docs/conv2d.md, "Stems").

Times, on the zoo's dense layers that ``auto`` runs on the TMA kernel with at most ``--most-k`` output channels and
at least two waves of 256-pixel tiles (batch 32, channels-last, fp16 unless ``--dtype``; the largest first, within
``--budget`` seconds), cuDNN's forward and ``tilegemm.conv2d`` with the TMA kernel's config set to ``auto``'s and to
each candidate (pixels a tile x warps x ring slots, ``auto``'s channel tile and step), each checked against cuDNN's
fp32 output first, as CUDA graphs; then per candidate the geomean over the layers (halves: even and odd layers).
Padded layers (24 channels) run their padded route with the same config.

    PYTHONPATH=src:tools python3 research/tma_tiles.py [--budget 200] [--most-k 64] [--dtype fp16] [--out F.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn.functional as F

from conv2d_depthwise_candidates import geomean, graph_us
from tilegemm.core.checks import relative_error
from tilegemm.ops.conv2d import configs, dispatch, tma_fwd, zoo
from tilegemm.ops.conv2d.problem import ConvCall, geometry_of

CANDIDATES = [(256, 8, 4), (256, 4, 4), (256, 8, 3), (128, 4, 4), (128, 8, 4), (512, 8, 3)]  # (pixels, warps, slots)


def _geo(L: dict, batch: int):
    pad = L["padding"]
    return geometry_of((batch, L["C"], L["H"], L["W"]), (L["K"], L["C"] // L["groups"], L["R"], L["S"]),
                       L["stride"], [pad[0], pad[0], pad[1], pad[1]], L["dilation"], L["groups"])


def layers(batch: int, most_k: int) -> list[dict]:
    out = []
    for L in zoo.bench_layers():
        g = _geo(L, batch)
        if g.groups != 1 or g.C <= dispatch.STEM_MAX_C or g.K > most_k or g.R * g.S == 1:
            continue
        if dispatch.choose_kernel(g, True, True, 132) != "tma_implicit_gemm":
            continue
        if configs._patch(g, 256)[3] < 2 * 132:
            continue
        out.append(L)
    return sorted(out, key=lambda L: -_geo(L, batch).N * _geo(L, batch).P * _geo(L, batch).Q * L["K"] * L["C"])


def _config(g, base: dict, pixels: int, warps: int, slots: int) -> dict | None:
    """``base`` with a ``pixels``-pixel patch, ``warps`` warps and ``slots`` ring slots, or None where its ring
    does not fit the SM's shared memory or its accumulator would not fit the warps' registers."""
    bi, bh, bw, _ = configs._patch(g, pixels)
    bn, bk = base["BLOCK_N"], base["BLOCK_K"]
    if slots * (pixels + bn) * bk * 2 + 1024 > 220 * 1024 or pixels * bn // (warps * 32) > 128:
        return None
    return dict(base, BI=bi, BH=bh, BW=bw, STAGES=slots, num_warps=warps)


def run_layer(L: dict, batch: int, dtype: torch.dtype) -> dict:
    g = _geo(L, batch)
    pad = list(L["padding"])
    cl = torch.channels_last
    xs = [torch.randn(batch, g.C, g.H, g.W, device="cuda", dtype=dtype).contiguous(memory_format=cl)
          for _ in range(2)]
    w = (torch.randn(g.K, g.Cg, g.R, g.S, device="cuda", dtype=dtype) / (g.Cg * g.R * g.S) ** 0.5)
    w = w.contiguous(memory_format=cl)
    real = tma_fwd.config

    def with_config(cfg):
        def run(i):
            tma_fwd.config = (lambda *a, **k: dict(cfg)) if cfg is not None else real
            try:
                return dispatch.forward(ConvCall(xs[i], w, None, list(g.stride), list(g.padding),
                                                 list(g.dilation), g.groups, "none", "ieee", "auto"))
            finally:
                tma_fwd.config = real
        return run

    ref = F.conv2d(xs[0].float(), w.float(), None, L["stride"], pad, L["dilation"], g.groups)
    cudnn_us = graph_us(lambda i: F.conv2d(xs[i], w, None, L["stride"], pad, L["dilation"], g.groups), 2)
    gp = g if g.Cg % 16 == 0 else dataclasses.replace(g, C=configs.padded_group(g.Cg))
    base = real(gp, dtype, 132)
    row = dict(layer=f"{g.C}->{g.K} {g.R}x{g.S} s{g.stride[0]} {g.H}x{g.W}", models=L.get("models"),
               cudnn_us=cudnn_us, auto_config=base)
    cands = {"auto": None}
    for pixels, warps, slots in CANDIDATES:
        cfg = _config(gp, base, pixels, warps, slots)
        if cfg is not None:
            cands[f"{pixels}-{warps}w-{slots}s"] = cfg
    for name, cfg in cands.items():
        fn = with_config(cfg)
        try:
            err = relative_error(fn(0).float(), ref)
            row[name] = cudnn_us / graph_us(fn, 2) if err < 1e-2 else None
            if err >= 1e-2:
                row[f"{name}_err"] = err
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row[name], row[f"{name}_err"] = None, f"{type(e).__name__}: {e}"[:200]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=200.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--most-k", type=int, default=64)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    start, rows, todo = time.time(), [], layers(args.batch, args.most_k)
    names = ["auto"] + [f"{p}-{w}w-{s}s" for p, w, s in CANDIDATES]
    for L in todo:
        if time.time() - start > args.budget:
            break
        rows.append(run_layer(L, args.batch, dtype))
        r = rows[-1]
        print(f"{r['layer']:<26s} {r['cudnn_us']:7.1f}us " + " ".join(
            f"{n} {r[n]:.2f}" if r.get(n) else f"{n} -" for n in names), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(dtype=args.dtype, batch=args.batch, candidates=CANDIDATES, rows=rows), f, indent=1)
    print(f"{len(rows)} of {len(todo)} layers; cuDNN time / ours, geomean (all, even, odd layers):")
    for n in names:
        print(f"  {n:<12s} " + "  ".join(f"{geomean(r.get(n) for r in half) or 0:.3f}x"
                                          for half in (rows, rows[0::2], rows[1::2])))


if __name__ == "__main__":
    main()
