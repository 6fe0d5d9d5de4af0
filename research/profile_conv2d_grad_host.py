"""Host time of the gradient calls, replayed: where a plain ``backward_data`` / ``backward_weight`` call's
microseconds go (cProfile over many calls of one layer), against cuDNN's host time for the same part.

    PYTHONPATH=src python3 research/profile_conv2d_grad_host.py [--layer n32c512h7w7k2048r1s1/1] [--calls 300]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", default="n32c512h7w7k2048r1s1/1")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d.op import backward_data, backward_weight

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    case = next(c for c in bench_op("conv2d").cases("resnet50") if c.label == args.layer)
    d = case.dims
    s, pad = [d["stride"]] * 2, d["pad"]
    x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(d["K"], d["C"], d["R"], d["S"], device="cuda") * 0.05).half().contiguous(memory_format=cl)
    y = torch.nn.functional.conv2d(x, w, None, s, pad)
    dy = torch.randn_like(y).contiguous(memory_format=cl)
    common = (s, [pad] * 4, [1, 1], 1, "default")
    parts = {
        "dgrad": lambda: backward_data(dy, w, list(x.shape), True, *common),
        "wgrad": lambda: backward_weight(dy, x, list(w.shape), *common),
        "cudnn_dgrad": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s, [pad, pad], [1, 1], False,
                                                                   [0, 0], 1, [True, False, False]),
        "cudnn_wgrad": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s, [pad, pad], [1, 1], False,
                                                                   [0, 0], 1, [False, True, False]),
    }
    for name, fn in parts.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        print(f"{name:12s} host {host:6.1f} us a call", flush=True)
        if not name.startswith("cudnn"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
