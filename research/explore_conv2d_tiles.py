"""Which tiles, warps and pipeline depths make the implicit-GEMM conv2d kernels fast, layer by layer?

The conv2d configs (``ops/conv2d/configs.py``) are a rule by shape class that was never timed on a GPU. For
each layer of a sweep (fp16, channels-last activations and weights) this times the shipped config and a grid
of candidates of the forward (``--part fwd``), data-gradient (``dgrad``) or weight-gradient (``wgrad``)
kernel, each launched directly and timed from a CUDA graph (GPU time alone, so Triton's host launch path does
not hide the kernel), against cuDNN timed the same way. Every candidate is checked against cuDNN's result in
fp32 before it is timed; one that fails to compile or is wrong is recorded, never ranked.

    PYTHONPATH=src:research python3 research/explore_conv2d_tiles.py --out tiles.json [--part fwd]
        [--sweep resnet50] [--budget 400]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time


def candidates(part: str, C: int, K: int):
    """Configs to try: block sizes no larger than the channel counts warrant, 3-5 stages, 4 warps up to
    64x128 tiles and 8 above."""
    def p2(n, lo, hi):
        v = lo
        while v < n and v < hi:
            v *= 2
        return v

    bms = (64, 128)
    bns = sorted({min(64, p2(K if part != "dgrad" else C, 16, 256)), p2(K if part != "dgrad" else C, 16, 256)})
    if part == "dgrad":
        bns = sorted({*bns, min(128, p2(C, 16, 256))})
    bks = (32, 64) if part != "wgrad" else (32, 64, 128)
    for bm, bn, bk, stages in itertools.product(bms, bns, bks, (3, 4, 5)):
        warps = 4 if bm * bn <= 64 * 128 else 8  # (a kernel is compiled once per config, for every layer size)
        if (bm + bn) * bk * 2 * stages > 220 * 1024:
            continue
        if part == "wgrad":
            bm_, bn_ = min(bm, p2(K, 16, 128)), min(bn, p2(C, 16, 128))
            yield dict(BLOCK_M=bm_, BLOCK_N=bn_, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
        else:
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", default="fwd", choices=("fwd", "dgrad", "wgrad"))
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; layers past it are skipped")
    parser.add_argument("--layers", default=None, help="indices of the sweep's layers, e.g. 2,6,10")
    args = parser.parse_args()

    import tilegemm  # noqa: F401  (settles the backend first)
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d import configs, implicit_gemm
    from tilegemm.ops.conv2d.op import choose_kernel
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    t0 = time.time()
    rows = []
    cases = list(bench_op("conv2d").cases(args.sweep))
    if args.layers:
        cases = [cases[int(i)] for i in args.layers.split(",")]
    for case in cases:
        if time.time() - t0 > args.budget:
            break
        d = case.dims
        s, pad = [d["stride"]] * 2, d["pad"]
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"] // d["groups"], d["R"], d["S"]), s,
                        [pad] * 4, [1, 1], d["groups"])
        if part_skipped(args.part, choose_kernel(g), g):
            continue
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"] // d["groups"], d["R"], d["S"], device="cuda") * 0.05).half()
        w = w.contiguous(memory_format=cl)
        y = F.conv2d(x, w, None, s, pad, 1, d["groups"])
        dy = torch.randn_like(y).contiguous(memory_format=cl)
        conv_args = (s, [pad, pad], [1, 1], False, [0, 0], d["groups"])
        if args.part == "fwd":
            ref = F.conv2d(x.float(), w.float(), None, s, pad, 1, d["groups"])
            cudnn = lambda: F.conv2d(x, w, None, s, pad, 1, d["groups"])  # noqa: E731
            p = ConvProblem(x, w, None, g, torch.float16, cl, "none", "ieee", False)
            shipped = configs.forward_config(g, torch.float16)
            run = lambda cfg: implicit_gemm.run(p, dict(cfg, FLAT_K=shipped["FLAT_K"]))  # noqa: E731
        elif args.part == "dgrad":
            ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                      [True, False, False])[0]
            cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args,  # noqa: E731
                                                               [True, False, False])
            shipped = configs.dgrad_config(g, torch.float16)
            run = lambda cfg: implicit_gemm.dgrad(dy, w, x.shape, cl, g, "ieee", False, cfg)  # noqa: E731
        else:
            ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                      [False, True, False])[1]
            cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args,  # noqa: E731
                                                               [False, True, False])
            shipped = configs.wgrad_config(g, torch.float16, sm_count(x.device))
            run = lambda cfg: implicit_gemm.wgrad(dy, x, g, "ieee", False, torch.float16,  # noqa: E731
                                                  dict(cfg, SPLIT=cfg.get("SPLIT", shipped["SPLIT"]),
                                                       FLAT=shipped["FLAT"]))
        row = dict(shape=case.label, part=args.part, cudnn_us=tt.do_bench_cudagraph(cudnn, rep=40) * 1e3,
                   shipped=shipped, candidates=[])
        cols = g.R * g.S * g.Cg if args.part == "wgrad" and shipped.get("FLAT") else g.Cg
        extra = []
        if args.part == "wgrad":  # the pixel split too
            for cfg in candidates(args.part, cols, g.Kg):
                extra += [dict(cfg, SPLIT=sp) for sp in (shipped["SPLIT"] // 2, shipped["SPLIT"] * 2) if sp >= 1]
        for cfg in [dict(shipped), *candidates(args.part, cols, g.Kg), *extra]:
            entry = dict(cfg=cfg)
            try:
                out = run(cfg)
                err = float((out.float() - ref).norm() / ref.norm())
                entry["err"] = err
                if err <= 4e-3:
                    entry["us"] = tt.do_bench_cudagraph(lambda: run(cfg), rep=30) * 1e3
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a result too
                entry["error"] = str(exc)[:200]
            row["candidates"].append(entry)
        timed = [c for c in row["candidates"] if "us" in c]
        row["shipped_us"] = row["candidates"][0].get("us")
        if timed:
            best = min(timed, key=lambda c: c["us"])
            row["best"] = best
            print(f"{case.label:32s} cuDNN {row['cudnn_us']:7.1f}  shipped {row['shipped_us'] or float('nan'):7.1f}"
                  f"  best {best['us']:7.1f} {best['cfg']}", flush=True)
        rows.append(row)
        with open(args.out, "w") as fh:
            json.dump(dict(part=args.part, sweep=args.sweep, rows=rows), fh, indent=1)

    def geo(key):
        vals = [r["cudnn_us"] / r[key] for r in rows if r.get(key)] if key == "shipped_us" else \
            [r["cudnn_us"] / r["best"]["us"] for r in rows if r.get("best")]
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")

    print(f"\n{args.part}: cuDNN / shipped geomean {geo('shipped_us'):.2f}, cuDNN / best {geo('best'):.2f} "
          f"over {len(rows)} layers (GPU time, CUDA graphs)")


def part_skipped(part: str, kernel: str, g) -> bool:
    """Only layers that reach the implicit-GEMM kernels for this part on Hopper: forward, those auto sends
    there; data gradient, the strided ones too (per stride phase); weight gradient, the few-channel ones (FLAT)
    too. (1x1 stride-1 layers go to matmul; depthwise ones to the direct kernels.)"""
    from tilegemm.ops.conv2d.implicit_gemm import phases_apply

    if g.is_depthwise or g.is_pointwise:
        return True
    if part == "dgrad" and phases_apply(g):
        return False
    if part == "wgrad" and g.Cg < 16:
        return False
    return kernel != "implicit_gemm"


if __name__ == "__main__":
    main()
