"""Where does a conv2d call's time go: the kernels, or the host?

For each layer of a sweep (fp16, channels-last): the forward, data-gradient and weight-gradient ops timed
three ways against cuDNN, all in one process: ``do_bench`` (events around back-to-back calls, what the bench
reports), ``do_bench_cudagraph`` (the same calls captured in a CUDA graph: kernel time without host cost),
and the host's wall time per call (200 calls, no synchronization in between). Also which kernel and
config ``auto`` picked.

    PYTHONPATH=src:research python3 research/diagnose_conv2d_time.py --out conv-time.json [--sweep resnet50]
"""

from __future__ import annotations

import argparse
import json
import math
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--budget", type=float, default=150.0)
    parser.add_argument("--layers", default=None, help="comma-separated case labels (default: all)")
    args = parser.parse_args()

    import tilegemm  # noqa: F401  (settles the backend first)
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d.op import backward_data, backward_weight, choose_kernel
    from tilegemm.ops.conv2d.problem import geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    op = bench_op("conv2d")
    rows, t0 = [], time.time()

    def host_us(fn, n=200):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        end = time.perf_counter()
        torch.cuda.synchronize()
        return (end - start) / n * 1e6

    def timings(fn):
        return dict(events_us=tt.do_bench(fn, warmup=25, rep=60) * 1e3,
                    graph_us=tt.do_bench_cudagraph(fn, rep=60) * 1e3,
                    host_us=host_us(fn))

    for case in op.cases(args.sweep):
        if time.time() - t0 > args.budget:
            break
        if args.layers and case.label not in args.layers.split(","):
            continue
        d = case.dims
        s, p = [d["stride"]] * 2, [d["pad"]] * 2
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"] // d["groups"], d["R"], d["S"], device="cuda") * 0.05).half().contiguous(memory_format=cl)
        g = geometry_of(x.shape, w.shape, s, [d["pad"]] * 4, [1, 1], d["groups"])
        y = F.conv2d(x, w, None, s, p, 1, d["groups"])
        dy = torch.randn_like(y).contiguous(memory_format=cl)
        common = (s, [d["pad"]] * 4, [1, 1], d["groups"], "default")
        ours = {
            "fwd": lambda: tilegemm.conv2d(x, w, None, s, p, 1, d["groups"]),
            "dgrad": lambda: backward_data(dy, w, list(x.shape), True, *common),
            "wgrad": lambda: backward_weight(dy, x, list(w.shape), *common),
        }
        cudnn = {
            "fwd": lambda: F.conv2d(x, w, None, s, p, 1, d["groups"]),
            "dgrad": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s, p, [1, 1], False, [0, 0],
                                                                d["groups"], [True, False, False]),
            "wgrad": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s, p, [1, 1], False, [0, 0],
                                                                d["groups"], [False, True, False]),
        }
        row = dict(shape=case.label, kernel=choose_kernel(g))
        for part in ("fwd", "dgrad", "wgrad"):
            row[part] = dict(ours=timings(ours[part]), cudnn=timings(cudnn[part]))
        rows.append(row)
        f, dg, wg = (row[k] for k in ("fwd", "dgrad", "wgrad"))
        print(f"{case.label:32s} {row['kernel']:14s} " + "  ".join(
            f"{k} ev {r['ours']['events_us']:7.1f}/{r['cudnn']['events_us']:6.1f} gr {r['ours']['graph_us']:7.1f}/"
            f"{r['cudnn']['graph_us']:6.1f} host {r['ours']['host_us']:5.1f}"
            for k, r in (("F", f), ("D", dg), ("W", wg))), flush=True)
    with open(args.out, "w") as fh:
        json.dump(dict(sweep=args.sweep, rows=rows), fh, indent=1)

    def geo(part, how):
        vals = [r[part]["cudnn"][how] / r[part]["ours"][how] for r in rows]
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")

    print("\npart   events-ratio  graph-ratio  (cuDNN / ours, geomean over", len(rows), "layers)")
    for part in ("fwd", "dgrad", "wgrad"):
        print(f"{part:6s} {geo(part, 'events_us'):12.2f} {geo(part, 'graph_us'):12.2f}")


if __name__ == "__main__":
    main()
