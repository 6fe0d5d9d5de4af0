"""How fast can a depthwise convolution run, and with which tile and weight layout?

Depthwise layers move few bytes per load instruction: each output element is R*S multiply-adds over one input
channel. For each layer (MobileNetV2's at batch 64, plus 5x5 and dilated ones no sweep holds) this times from
CUDA graphs (GPU time alone: the variants launched from Python here cost more host time than their GPU
time): cuDNN channels-last, ``tilegemm.conv2d`` (``auto``), and ``depthwise_fwd_kernel`` with the taps in a
loop over the ``[K, 1, R, S]`` weight (the kernel before tap-major weights), then unrolled over that weight
("KRS") and over the tap-major ``[R, S, K]`` weight ("RSK") for 64/128/256 pixels x 32/64 channels x 4/8
warps; and ``research/depthwise_cols.py`` (each loaded input column reused across the horizontal taps:
2 or 4 output columns a group, 16-64 groups x 32/64 channels). Every variant is checked against cuDNN in fp32 first; a wrong or failing one is recorded, never
ranked. Prints each layer's best per weight layout with its DRAM rate (input + output bytes over the time);
writes ``--out`` after every layer.

A row kernel (a program owning output rows x columns x channels, walking its rows so that each input row
is read from L1 by the R output rows over it) was timed too (``2026-11-25-h200/f575c60/depthwise-*.json``):
it never beat the pixel kernel by more than a few percent and lost on small images; it is not shipped.

    PYTHONPATH=src:research python3 research/explore_depthwise.py --out depthwise.json
"""

from __future__ import annotations

import argparse
import json
import time

LAYERS = {  # name: (N, C, H, W, R, stride, dilation)
    "mbv2-32x112": (64, 32, 112, 112, 3, 1, 1),
    "mbv2-96x112/2": (64, 96, 112, 112, 3, 2, 1),
    "mbv2-144x56": (64, 144, 56, 56, 3, 1, 1),
    "mbv2-144x56/2": (64, 144, 56, 56, 3, 2, 1),
    "mbv2-192x28": (64, 192, 28, 28, 3, 1, 1),
    "mbv2-192x28/2": (64, 192, 28, 28, 3, 2, 1),
    "mbv2-384x14": (64, 384, 14, 14, 3, 1, 1),
    "mbv2-576x14": (64, 576, 14, 14, 3, 1, 1),
    "mbv2-576x14/2": (64, 576, 14, 14, 3, 2, 1),
    "mbv2-960x7": (64, 960, 7, 7, 3, 1, 1),
    "5x5-240x28": (32, 240, 28, 28, 5, 1, 1),
    "5x5-672x14/2": (32, 672, 14, 14, 5, 2, 1),
    "dil2-128x33": (16, 128, 33, 33, 3, 1, 2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; layers after it are skipped")
    args = ap.parse_args()

    import depthwise_cols
    from graph_timing import checked_graph_us, depthwise_case, print_variants
    import tilegemm
    import torch
    import torch.nn.functional as F
    from tilegemm.core.hardware import machine_info
    from tilegemm.core.launch import launch
    from tilegemm.core.runtime import cdiv
    from tilegemm.ops.conv2d import depthwise
    from tilegemm.ops.conv2d.configs import depthwise_fwd_config
    from tilegemm.ops.conv2d.implicit_gemm import _conv_args, _divisor, _nhwc_strides, allocate_out

    torch.backends.cudnn.benchmark = True
    start = time.time()
    results = []
    for name in args.layers.split(","):
        if time.time() - start > args.budget:
            print(f"budget spent: {name} and after skipped")
            break
        N, C, H, W, R, s, d = LAYERS[name]
        x, w, ref, moved, pad, p = depthwise_case(LAYERS[name])
        g = p.geo
        row = dict(layer=name, dims=LAYERS[name], bytes=moved, variants={}, pixel=[])

        def timed(fn):
            return checked_graph_us(fn, ref)

        row["variants"]["cuDNN"] = timed(lambda: F.conv2d(x, w, None, s, pad, d, C))
        row["variants"]["auto"] = timed(lambda: tilegemm.conv2d(x, w, None, s, pad, d, C))
        row["shipped"] = depthwise_fwd_config(g, torch.float16)

        # the weight as [R, S, C] (channels contiguous: one 16-byte load a tap), seen as [C, 1, R, S]
        wt = w.permute(2, 3, 0, 1).contiguous().permute(2, 3, 0, 1)

        def pixel(cfg, wv):
            out = allocate_out(p)
            M = g.N * g.P * g.Q
            a = (x, wv, out, out, g.H, g.W, g.P, g.Q, g.K, M, 1, *_nhwc_strides(x), wv.stride(0), wv.stride(2),
                 wv.stride(3), out.stride(0), out.stride(2), out.stride(3), out.stride(1), 0, *_conv_args(g))
            kw = dict(R=g.R, S=g.S, HAS_BIAS=False, ACTIVATION="none", INDEX_64=False, DIV=_divisor(g.K), **cfg)
            launch(depthwise.depthwise_fwd_kernel, (cdiv(M, cfg["BLOCK_M"]), cdiv(g.K, cfg["BLOCK_N"])), a, kw)
            return out

        rolled = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, UNROLL=False)  # the kernel before
        row["pixel"].append(dict(config=dict(rolled, weight="KRS"), **timed(lambda: pixel(rolled, w))))
        for wname, wv in (("KRS", w), ("RSK", wt)):
            for bm in (64, 128, 256):
                for bn in (32, 64):
                    for warps in (4, 8):
                        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=2, UNROLL=True)
                        row["pixel"].append(dict(config=dict(cfg, weight=wname),
                                                 **timed(lambda cfg=cfg, wv=wv: pixel(cfg, wv))))
        row["cols"] = []
        rsk = wt.permute(2, 3, 0, 1)  # [R, S, C, 1], contiguous
        for cols in (2, 4):
            for bm in (16, 32, 64):
                for bn in (32, 64):
                    if bm * cols > 128:
                        continue
                    cfg = dict(BLOCK_M=bm, COLS=cols, BLOCK_N=bn, num_warps=4)
                    row["cols"].append(dict(config=dict(cfg, weight="RSK"),
                                            **timed(lambda cfg=cfg: depthwise_cols.run(x, w, g, cfg, tap_major=rsk))))
        results.append(row)
        base = row["variants"]["cuDNN"].get("us")
        print(f"== {name} ({moved / 1e6:.1f} MB), shipped {row['shipped']}")
        print_variants(row["variants"], moved)
        for kind in ("pixel", "cols"):
            ok = sorted((c for c in row[kind] if "us" in c), key=lambda c: c["us"])
            picks = [row[kind][0]] if kind == "pixel" else []
            for wname in ("KRS", "RSK"):
                picks += [c for c in ok if c["config"]["weight"] == wname][:2]
            for c in picks:
                if "us" in c:
                    print(f"  {kind:5s} {c['us']:8.1f} us {base / c['us']:5.2f}x {moved / c['us'] / 1e6:5.2f} TB/s "
                          f"{c['config']}")
            bad = [c for c in row[kind] if "error" in c]
            if bad:
                print(f"  {kind}: {len(bad)} failed, first {bad[0]['config']}: {bad[0]['error'][:120]}")
        with open(args.out, "w") as f:  # after every layer: a run cut short keeps what it measured
            json.dump(dict(machine=machine_info().to_dict(), rows=results), f, indent=1)
    with open(args.out, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
