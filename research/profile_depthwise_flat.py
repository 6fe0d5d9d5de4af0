"""Counters of the flattened-row depthwise forwards beside cuDNN's on one layer (GPU machine, under ncu).

(``2026-11-25-h200/ed547a3/ncu-depthwise-flat.txt`` was taken with the rolled forms still in
``research/depthwise_flat.py``, as ``ROLL`` configs; they are the shipped kernel's ``PIPELINE`` ones now.)

Each kernel runs once after warm-up between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that
``ncu --profile-from-start off`` reads those launches only; ``--time`` instead prints CUDA-graph times of the
same launches and of a device copy of as many bytes (the DRAM ceiling at this size).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 research/profile_depthwise_flat.py --layer 64,144,56,3,1
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", default="64,144,56,3,1", help="N,C,H(=W),R,stride")
    ap.add_argument("--configs", default='[{"BLOCK": 256, "num_warps": 2, "ROWS_PER": 32, "PIPELINE": true, "STAGES": 3}]',
                    help="configs of the shipped depthwise_rows_kernel (stride 1) or, without PIPELINE, of the "
                         "per-row form in research/depthwise_flat.py")
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()

    import depthwise_flat
    import torch
    from tilegemm.ops.conv2d import depthwise
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of
    import torch.nn.functional as F
    import triton.testing as tt

    torch.backends.cudnn.benchmark = True
    N, C, H, R, st = (int(v) for v in args.layer.split(","))
    pad = (R - 1) // 2
    x = torch.randn(N, C, H, H, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(C, 1, R, R, device="cuda") * 0.3).half()
    configs = json.loads(args.configs)
    fns = {"cuDNN": lambda: F.conv2d(x, w, None, st, pad, 1, C)}
    g = geometry_of(x.shape, w.shape, [st, st], [pad] * 4, [1, 1], C)
    problem = ConvProblem(x, w, None, g, torch.float16, torch.channels_last, "none", "ieee", False)
    for i, cfg in enumerate(configs):
        if "PIPELINE" in cfg:
            fns[f"rows{i}"] = lambda cfg=cfg: depthwise.run(problem, dict(cfg))
        else:
            fns[f"flat{i}"] = lambda cfg=cfg: depthwise_flat.run(x, w, None, (st, st), (pad, pad), (1, 1), cfg)
    out = fns["cuDNN"]()
    src = torch.empty(x.numel() + out.numel(), device="cuda", dtype=torch.float16).normal_()
    half = src[: (src.numel() // 2)]
    dst = torch.empty_like(half)
    fns["copy"] = lambda: dst.copy_(half)  # reads and writes the layer's bytes in all
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    if args.time:
        for name, fn in fns.items():
            print(f"{name:8s} {tt.do_bench_cudagraph(fn, rep=50) * 1e3:8.1f} us")
        return
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
