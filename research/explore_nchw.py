"""NCHW forward, one process: cuDNN on NCHW tensors against tilegemm's NCHW route (x transposed channels-last into
a workspace, the channels-last kernel, NCHW stores or a transposed output) and the path before it (the route
off: pointer kernels over a torch copy, NCHW stores; 1x1 layers as one batched GEMM per image), plus the
channels-last times of both for reference and the transposition alone. do_bench medians (L2 cleared).

    PYTHONPATH=src python3 research/explore_nchw.py --out $OUT/nchw.json [--sweeps resnet50,mobilenet]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweeps", default="resnet50,mobilenet")
    ap.add_argument("--dtype", default="fp16")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import triton.testing as tt

    import tilegemm
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d import layout, op, replay

    torch.backends.cudnn.benchmark = True
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    cl = torch.channels_last
    route = op._nchw_route
    rows = []
    print(f"{'layer':34s} {'cudnn':>7s} {'route':>7s} {'before':>7s} {'cudnnCL':>7s} {'oursCL':>7s} {'xT':>6s}"
          f"  route/cudnn before/cudnn")
    for sweep in args.sweeps.split(","):
        for case in bench_op("conv2d").cases(sweep):
            d = case.dims
            s, p, gr = d["stride"], d["pad"], d["groups"]
            x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=dtype)
            w = (torch.randn(d["K"], d["C"] // gr, d["R"], d["S"], device="cuda") * 0.05).to(dtype)
            xc, wc = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
            ref = F.conv2d(x.float(), w.float(), None, s, p, 1, gr)
            t = {}

            def ours():
                return tilegemm.conv2d(x, w, None, s, p, 1, gr)

            out = ours()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert out.is_contiguous() and err < 1e-2, (case.label, err)
            t["cudnn"] = tt.do_bench(lambda: F.conv2d(x, w, None, s, p, 1, gr))
            t["route"] = tt.do_bench(ours)
            op._nchw_route = lambda x: False
            replay.clear()
            try:
                t["before"] = tt.do_bench(ours)
            finally:
                op._nchw_route = route
                replay.clear()
            t["cudnn_cl"] = tt.do_bench(lambda: F.conv2d(xc, wc, None, s, p, 1, gr))
            t["ours_cl"] = tt.do_bench(lambda: tilegemm.conv2d(xc, wc, None, s, p, 1, gr))
            t["transpose_x"] = tt.do_bench(lambda: layout.to_channels_last(x, "probe"))
            us = {k: v * 1e3 for k, v in t.items()}
            rows.append(dict(sweep=sweep, layer=case.label, err=err, **us))
            print(f"{case.label:34s} {us['cudnn']:7.1f} {us['route']:7.1f} {us['before']:7.1f} {us['cudnn_cl']:7.1f} "
                  f"{us['ours_cl']:7.1f} {us['transpose_x']:6.1f}  {us['cudnn'] / us['route']:6.2f}x "
                  f"{us['cudnn'] / us['before']:6.2f}x", flush=True)
    import math

    for sweep in args.sweeps.split(","):
        sel = [r for r in rows if r["sweep"] == sweep]
        gm = lambda k: math.exp(sum(math.log(r["cudnn"] / r[k]) for r in sel) / len(sel))  # noqa: E731
        print(f"{sweep}: geomean route {gm('route'):.2f}x, before {gm('before'):.2f}x (of cuDNN on NCHW)")
    with open(args.out, "w") as f:
        json.dump(dict(dtype=args.dtype, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
