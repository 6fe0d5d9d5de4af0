"""``dequant_cublas`` at large M: where its time goes (cold-L2 GPU times, CUDA graphs), against cuBLAS fp16.

Times, per (N, K) and M: ``F.linear`` with the dense weight (the baseline), the dequantization kernel alone over
block shapes, ``torch.matmul`` of x with the dequantized weight (as ``W.T`` [K, N] and as a view of W [N, K]) into
a preallocated output, the whole ``w4a16.matmul(kernel="dequant_cublas")`` call and ``frag_wgmma`` where it runs
(M <= 1024). Checks the dequantized weight against ``w4a16.dequantize`` for every block shape first.

    PYTHONPATH=src:research python3 research/explore_w4a16_dequant.py --json $OUT/dequant.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tilegemm import w4a16
from tilegemm.core.hardware import machine_info
from tilegemm.ops.w4a16.dequant_cublas import dequantize_w

from explore_w4a16_small_m import Cold  # GPU time in CUDA graphs, the L2 cleared before each call

BLOCKS = [(16, 128, 4), (8, 128, 4), (16, 64, 4), (32, 64, 4), (8, 256, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192,28672x8192,4096x14336")
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--json", default="dequant.json")
    args = ap.parse_args()
    cold = Cold()
    rows = []
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        wd = torch.randn(N, K, device="cuda", dtype=torch.float16)
        w = w4a16.quantize(wd, group_size=128)
        ref = w4a16.dequantize(w)
        for rows_n in (True, False):
            for br, bn, warps in BLOCKS:
                got = dequantize_w(w.qweight, w.scales, w.zeros, w.group_k, rows_n, br, bn, warps)
                assert torch.equal(got, ref if rows_n else ref.T), (shape, rows_n, br, bn, warps)
                us = cold(lambda: dequantize_w(w.qweight, w.scales, w.zeros, w.group_k, rows_n, br, bn, warps))
                gbs = (w.qweight.numel() * 4 + 2 * w.scales.numel() * 2 + N * K * 2) / us / 1e3
                rows.append(dict(N=N, K=K, what="dequant", rows_n=rows_n, block=[br, bn, warps], us=us, gbs=gbs))
                print(f"{N}x{K} dequant {'W' if rows_n else 'W.T'} {br}x{bn} w{warps}: {us:.1f} us {gbs:.0f} GB/s",
                      flush=True)
        wt = ref.T.contiguous()
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            out = torch.empty(M, N, device="cuda", dtype=torch.float16)
            base = cold(lambda: F.linear(x, wd))
            t = dict(mm_nn=cold(lambda: torch.matmul(x, wt, out=out)),
                     mm_tn=cold(lambda: torch.matmul(x, ref.t(), out=out)),
                     dequant_cublas=cold(lambda: w4a16.matmul(x, w, kernel="dequant_cublas")))
            if M <= 1024:
                t["frag_wgmma"] = cold(lambda: w4a16.matmul(x, w, kernel="frag_wgmma"))
            for what, us in t.items():
                rows.append(dict(N=N, K=K, M=M, what=what, us=us, cublas_us=base, ratio=base / us))
            print(f"{N}x{K} M={M}: cuBLAS {base:.1f} us | " +
                  " | ".join(f"{k} {v:.1f} ({base / v:.3f}x)" for k, v in t.items()), flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
