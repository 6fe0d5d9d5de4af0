"""Gradients of the non-1x1 layers, per layer, from CUDA graphs (GPU time alone), against cuDNN's:

- ``--part dgrad``: the pointer kernel (implicit_gemm.dgrad) against the TMA forward kernel run
  as transposed convolutions (tma_fwd.dgrad_tma: one per stride phase, the phase weights included);
- ``--part wgrad``: the pointer kernel (implicit_gemm.wgrad) against the TMA kernel (tma_wgrad.run) with its
  shipped config and variants (ring depth, pixel slices, 64- or 128-wide channel tiles).

    PYTHONPATH=src:research python3 research/compare_conv2d_grads.py [--part wgrad] [--sweep resnet50]
"""

from __future__ import annotations

import argparse
import math


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--part", default="dgrad", choices=("dgrad", "wgrad"))
    parser.add_argument("--splits", action="store_true",
                        help="wgrad: time every pixel split from 1 to 64 (64x64 and 64x128 tiles) instead of the variants")
    parser.add_argument("--json", help="write every layer's times here")
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d import implicit_gemm, tma_fwd, tma_wgrad
    from tilegemm.ops.conv2d.problem import geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    ratios = {}
    layers = []
    for case in bench_op("conv2d").cases(args.sweep):
        d = case.dims
        st = d["stride"]
        if (d["R"] == 1 and st == 1) or d["groups"] != 1 or d["C"] < 16:
            continue
        pad = d["pad"]
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"], d["R"], d["S"]), [st, st], [pad] * 4,
                        [1, 1], 1)
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"], d["R"], d["S"], device="cuda") * 0.05).half().contiguous(memory_format=cl)
        dy = torch.randn(d["N"], d["K"], g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        conv_args = ([st, st], [pad, pad], [1, 1], False, [0, 0], 1)
        which = [True, False, False] if args.part == "dgrad" else [False, True, False]
        part = 0 if args.part == "dgrad" else 1
        ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args, which)[part]
        cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args, which)  # noqa: E731
        if args.part == "dgrad":
            ptr = lambda: implicit_gemm.dgrad(dy, w, x.shape, cl, g, "ieee", False)  # noqa: E731
            variants = {"tma": lambda: tma_fwd.dgrad_tma(dy, w, g)}
        else:
            ptr = lambda: implicit_gemm.wgrad(dy, x, g, "ieee", False, torch.float16)  # noqa: E731
            shipped = tma_wgrad.config(g, sm_count(x.device))
            variants = {"tma": lambda: tma_wgrad.run(dy, x, g, torch.float16)}
            for name, change in (("4 slots", dict(STAGES=4)), ("2 slots", dict(STAGES=2)),
                                 ("split/2", dict(SPLIT=max(1, shipped["SPLIT"] // 2))),
                                 ("split*2", dict(SPLIT=min(128, shipped["SPLIT"] * 2)))):
                variants[name] = (lambda cfg: lambda: tma_wgrad.run(dy, x, g, torch.float16, cfg))({**shipped, **change})
            if args.splits:
                variants = {}
                for bm, bn in ((64, 64), (64, 128)):
                    tile = tma_wgrad.config(g, sm_count(x.device), bm, bn)
                    for split in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 29, 32, 40, 48, 64):
                        variants[f"{bm}x{bn} s{split}"] = (lambda cfg: lambda: tma_wgrad.run(
                            dy, x, g, torch.float16, cfg))({**tile, "SPLIT": split})
            for bm, bn in () if args.splits else ((64, 64), (64, 128), (128, 64), (128, 128)):
                tile = tma_wgrad.config(g, sm_count(x.device), bm, bn)
                for name, change in ((f"{bm}x{bn}", {}), (f"{bm}x{bn}/2", dict(SPLIT=max(1, tile["SPLIT"] // 2)))):
                    variants[name] = (lambda cfg: lambda: tma_wgrad.run(dy, x, g, torch.float16, cfg))({**tile, **change})
        line = []
        us0 = tt.do_bench_cudagraph(cudnn, rep=30) * 1e3
        layer = dict(layer=case.label, cudnn_us=us0, shipped=tma_wgrad.config(g, sm_count(x.device))
                     if args.part == "wgrad" else None, us={})
        for name, f in (("pointer", ptr), *variants.items()):
            err = float((f().float() - ref).norm() / ref.norm())
            us = tt.do_bench_cudagraph(f, rep=30) * 1e3
            ratios.setdefault(name, []).append(us0 / us)
            layer["us"][name] = us
            line.append(f"{name} {us:6.1f} ({err:.0e})")
            assert err < 1e-2, (case.label, name, err)
        layers.append(layer)
        print(f"{case.label:28s} cuDNN {us0:6.1f}  " + "  ".join(line), flush=True)
    for k, v in ratios.items():
        print(f"{k}: cuDNN / it geomean {math.exp(sum(map(math.log, v)) / len(v)):.2f} over {len(v)} layers")
    if args.json:
        import json

        json.dump(layers, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
