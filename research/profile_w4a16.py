"""Where the W4A16 kernels' time goes at small M: one launch of each, between cudaProfilerStart/Stop, for ncu.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 research/profile_w4a16.py [--shape 8192x8192] [--set small|wgmma]

Kernels, in launch order (ncu numbers them so). ``--set small``: gemv at M=1 (the shipped config), mma at M=16
(shipped, 16-bit dequantization by conversion), mma at M=16 with ``DEQ16="magic"``, mma ``UNPACK="perm"`` at
M=16, then cuBLAS fp16 at M=1 and M=16. ``--set wgmma``: frag_wgmma's shipped configs at M = 1, 64, 256, then
cuBLAS at M = 64 and 256. Each is run five times first (compile, warm caches), then once profiled.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tilegemm import w4a16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x8192")
    ap.add_argument("--set", default="small", choices=("small", "wgmma"))
    args = ap.parse_args()
    N, K = (int(v) for v in args.shape.split("x"))
    from tilegemm.ops.w4a16 import frag_wgmma, gemv, mma
    from tilegemm.ops.w4a16.common import W4A16Problem
    from tilegemm.ops.w4a16.configs import mma_config

    torch.manual_seed(0)
    W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    w = w4a16.quantize(W, 128)

    fw, fzs = w.fragments()

    def problem(M):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        out = torch.empty(M, N, device="cuda", dtype=x.dtype)
        return W4A16Problem(x, w.qweight, w.scales, w.zeros, None, out, w.group_k, "none", False, fw, fzs)

    if args.set == "wgmma":
        ps = {M: problem(M) for M in (1, 64, 256)}
        cases = [(f"frag_wgmma M={M}", lambda p=p: frag_wgmma.run(p)) for M, p in ps.items()]
        cases += [(f"cuBLAS M={M}", lambda p=ps[M]: F.linear(p.x, W)) for M in (64, 256)]
        profile(cases)
        return

    p1, p16 = problem(1), problem(16)
    ship16 = mma_config(16, N, K, torch.device("cuda"))
    cases = [
        ("gemv M=1", lambda: gemv.run(p1)),
        ("mma M=16 shipped", lambda: mma.run(p16, ship16)),
        ("mma M=16 magic", lambda: mma.run(p16, dict(ship16, DEQ16="magic"))),
        ("mma M=16 perm", lambda: mma.run(p16, dict(ship16, UNPACK="perm", DEQ16="magic", BLOCK_N=128))),
        ("cuBLAS M=1", lambda: F.linear(p1.x, W)),
        ("cuBLAS M=16", lambda: F.linear(p16.x, W)),
    ]
    profile(cases)


def profile(cases) -> None:
    for _, fn in cases:
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in cases:
        fn()
        torch.cuda.synchronize()
        print("profiled:", name, flush=True)
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
