"""Every layer's backward in its two parts, each against cuDNN's, GPU time alone (CUDA graphs of one call):
the data gradient and the weight gradient as `auto` runs them (``op._dgrad`` / ``op._wgrad``), plus, for the
strided layers, the pointer data-gradient kernel with every tap masked per pixel (``phased=False``) and per
stride phase. fp16, channels-last, cuDNN in benchmark mode.

    PYTHONPATH=src python3 research/conv2d_grad_parts.py [--sweep resnet50] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--out", default=None)
    parser.add_argument("--layers", default=None, help="comma-separated case labels (default: all)")
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d import implicit_gemm, op
    from tilegemm.ops.conv2d.problem import geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    rows, logs = [], {}
    for case in bench_op("conv2d").cases(args.sweep):
        if args.layers and case.label not in args.layers.split(","):
            continue
        d = case.dims
        st, pad, groups = d["stride"], d["pad"], d["groups"]
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"] // groups, d["R"], d["S"]), [st, st],
                        [pad] * 4, [1, 1], groups)
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"] // groups, d["R"], d["S"], device="cuda") * 0.05).half()
        w = w.contiguous(memory_format=cl)
        dy = torch.randn(d["N"], d["K"], g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        conv_args = ([st, st], [pad, pad], [1, 1], False, [0, 0], groups)
        refs = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                   [True, True, False])
        shape = list(x.shape)
        cand = {
            "cudnn_dgrad": (lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args,
                                                                        [True, False, False])[0], 0),
            "cudnn_wgrad": (lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args,
                                                                        [False, True, False])[1], 1),
            "dgrad": (lambda: op._dgrad(dy, w, shape, True, [st, st], [pad] * 4, [1, 1], groups, "ieee"), 0),
            "wgrad": (lambda: op._wgrad(dy, x, list(w.shape), [st, st], [pad] * 4, [1, 1], groups, "ieee"), 1),
        }
        if implicit_gemm.phases_apply(g) and groups == 1:
            cand["dgrad_masked"] = (lambda: implicit_gemm.dgrad(dy, w, shape, cl, g, "ieee", False, phased=False), 0)
            cand["dgrad_phased"] = (lambda: implicit_gemm.dgrad(dy, w, shape, cl, g, "ieee", False, phased=True), 0)
        row = dict(layer=case.label, dims=d)
        for name, (f, part) in cand.items():
            ref = refs[part]
            got = f()
            err = float((got.float() - ref).norm() / ref.norm())
            us = tt.do_bench_cudagraph(f, rep=40) * 1e3
            row[name] = dict(us=us, rel_err=err)
        rows.append(row)
        line = "  ".join(f"{k} {v['us']:7.1f}" + ("" if v["rel_err"] < 1e-2 else f" ERR {v['rel_err']:.1e}")
                         for k, v in row.items() if isinstance(v, dict) and "us" in v)
        print(f"{case.label:28s} {line}", flush=True)

    def geo(key, base):
        vals = [r[base]["us"] / r[key]["us"] for r in rows if key in r]
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan"), len(vals)

    print("\ncuDNN / tilegemm, geomean over the layers:")
    for key, base in (("dgrad", "cudnn_dgrad"), ("wgrad", "cudnn_wgrad"), ("dgrad_masked", "cudnn_dgrad"),
                      ("dgrad_phased", "cudnn_dgrad")):
        gm, n = geo(key, base)
        logs[key] = gm
        print(f"  {key:14s} {gm:.2f}x over {n} layers")
    both = [(r["cudnn_dgrad"]["us"] + r["cudnn_wgrad"]["us"]) / (r["dgrad"]["us"] + r["wgrad"]["us"]) for r in rows]
    print(f"  backward (sum of both parts) {math.exp(sum(map(math.log, both)) / len(both)):.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"conv2d-grad-parts-{args.sweep}.json"), "w") as f:
            json.dump(dict(commit=os.environ.get("TILEGEMM_GIT_COMMIT"), gpu=torch.cuda.get_device_name(),
                           rows=rows, geomeans=logs), f, indent=1)


if __name__ == "__main__":
    main()
