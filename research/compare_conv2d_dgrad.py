"""Stride-1 data gradients: the pointer kernel (implicit_gemm.dgrad) against the TMA forward kernel run as a
transposed convolution (tma_fwd.dgrad_stride1, flipped weight included) and cuDNN, per layer, from CUDA graphs.

    PYTHONPATH=src:research python3 research/compare_conv2d_dgrad.py [--sweep resnet50]
"""

from __future__ import annotations

import argparse
import math


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", default="resnet50")
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d import implicit_gemm, tma_fwd
    from tilegemm.ops.conv2d.problem import geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    ratios = {"ptr": [], "tma": []}
    for case in bench_op("conv2d").cases(args.sweep):
        d = case.dims
        if d["stride"] != 1 or d["R"] == 1 or d["groups"] != 1:
            continue
        pad = d["pad"]
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"], d["R"], d["S"]), [1, 1], [pad] * 4,
                        [1, 1], 1)
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"], d["R"], d["S"], device="cuda") * 0.05).half().contiguous(memory_format=cl)
        dy = torch.randn(d["N"], d["K"], g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        conv_args = ([1, 1], [pad, pad], [1, 1], False, [0, 0], 1)
        ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                  [True, False, False])[0]
        cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args, [True, False, False])  # noqa: E731
        ptr = lambda: implicit_gemm.dgrad(dy, w, x.shape, cl, g, "ieee", False)  # noqa: E731
        tma = lambda: tma_fwd.dgrad_stride1(dy, w, g)  # noqa: E731
        errs = [float((f().float() - ref).norm() / ref.norm()) for f in (ptr, tma)]
        us = [tt.do_bench_cudagraph(f, rep=30) * 1e3 for f in (cudnn, ptr, tma)]
        ratios["ptr"].append(us[0] / us[1])
        ratios["tma"].append(us[0] / us[2])
        print(f"{case.label:28s} cuDNN {us[0]:6.1f}  pointer {us[1]:6.1f} ({errs[0]:.1e})  tma {us[2]:6.1f} "
              f"({errs[1]:.1e})", flush=True)
    for k, v in ratios.items():
        print(f"{k}: cuDNN / it geomean {math.exp(sum(map(math.log, v)) / len(v)):.2f} over {len(v)} layers")


if __name__ == "__main__":
    main()
