"""Why a backward layer reads slower through the bench than its two gradient calls timed alone: the bench's own
call (``Conv2dOp.run`` in bwd mode) against its parts, do_bench (L2 cleared) and CUDA graphs, one process.

    PYTHONPATH=src python3 research/diagnose_conv2d_bwd_bench.py [--shape 32,256,14,14,256,3,3,1,1]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", default=[])
    parser.add_argument("--profile", action="store_true", help="cProfile 200 calls of both gradients")
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d.op import backward_data, backward_weight
    from tilegemm.ops.conv2d.problem import check_conv

    torch.backends.cudnn.benchmark = True
    op = bench_op("conv2d")
    for text in args.shape or ["32,256,14,14,256,3,3,1,1"]:
        case = op.parse_shape(text)
        inputs = op.prepare(case, "fp16", "cuda", 1, {"mode": "bwd"}).sets[0]
        x, w, dy, conv = inputs["x"], inputs["w"], inputs["dy"], inputs["conv"]
        g = check_conv(x, w, None, conv["stride"], conv["padding"], 1, conv["groups"])
        a = (list(g.stride), list(g.padding), list(g.dilation), g.groups, op._precision("fp16"))
        parts = {
            "bench run": lambda: op.run("auto", inputs, "fp16"),
            "dgrad+wgrad": lambda: (backward_data(dy, w, list(x.shape), True, *a),
                                    backward_weight(dy, x, list(w.shape), *a)),
            "dgrad": lambda: backward_data(dy, w, list(x.shape), True, *a),
            "wgrad": lambda: backward_weight(dy, x, list(w.shape), *a),
            "cudnn": lambda: op.baseline(inputs, "fp16"),
        }
        for name, fn in parts.items():
            fn()
            ev = tt.do_bench(fn, rep=80) * 1e3
            gr = tt.do_bench_cudagraph(fn, rep=80) * 1e3
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{case.label:28s} {name:12s} events {ev:7.1f} us  graph {gr:7.1f} us  host {host:7.1f} us",
                  flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                parts["dgrad+wgrad"]()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("cumtime").print_stats(18)


if __name__ == "__main__":
    main()
