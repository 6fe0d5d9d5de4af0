"""The ``frag`` W4A16 kernel (weights pre-shuffled into MMA fragments): correctness against
``x @ dequantize(w).T`` and timing against cuBLAS fp16 and the shipped kernels, over its configs.

    PYTHONPATH=src:research python research/explore_w4a16_frag.py --json $OUT/frag.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tilegemm import w4a16
from tilegemm.ops.w4a16 import frag

from explore_w4a16_small_m import Cold, checked, silu_case, timing_cases  # Cold: GPU time in CUDA graphs, the L2 cleared before each call


def run_frag(x, fw, fzs, w, cfg, bias=None, activation="none"):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    kernel, grid, args, kwargs = frag.launch_args(x, fw, fzs, bias, out, w.shape[0], w.shape[1], w.group_k,
                                                  activation, cfg)
    kernel[grid](*args, **kwargs)
    return out


def launcher(x, fw, fzs, w, cfg):
    """A closure that launches the kernel with prebuilt arguments (no host work but the launch)."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    kernel, grid, args, kwargs = frag.launch_args(x, fw, fzs, None, out, w.shape[0], w.shape[1], w.group_k,
                                                  "none", cfg)
    return lambda: kernel[grid](*args, **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="4096x4096,8192x8192,28672x8192,14336x4096,8192x28672")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    cold = Cold()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # correctness first, odd shapes and both dtypes
    for (N, K, g, M, dt) in [] if a.no_check else [(256, 512, 128, 1, torch.float16), (272, 320, 64, 3, torch.float16),
                             (1000, 4096, 128, 17, torch.float16), (4096, 4096, -1, 5, torch.float16),
                             (4096, 4096, 128, 16, torch.bfloat16), (320, 1024, 128, 2, torch.float16),
                             (4096, 4096, 256, 33, torch.bfloat16)]:
        if K % 8 or (g != -1 and K % g):
            continue
        w, fw, fzs, x, bias, ref, bound = silu_case(M, N, K, g, dt)
        for cfg in (dict(RH=4, BM=8, SPLIT_K=1), dict(RH=2, BM=16, SPLIT_K=3, DEPTH=2),
                    dict(RH=1, BM=16, SPLIT_K=2, KH=2, DEPTH=2), dict(RH=4, BM=8, SPLIT_K=5, KH=2)):
            if cfg.get("KH", 1) == 2 and (g if g != -1 else K) % 128:
                continue
            out = run_frag(x, fw, fzs, w, cfg, bias, "silu")
            err, ok = checked(out, ref, bound)
            rows.append(dict(kind="check", N=N, K=K, g=g, M=M, dtype=str(dt), cfg=cfg, err=err, ok=ok))
            print(f"check {N}x{K} g{g} M={M} {dt} {cfg}: err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    for N, K, M, wd, w, fw, fzs, x in timing_cases(a.shapes, a.ms):
        t_cublas = cold(lambda: F.linear(x, wd)) * 1e-3
        t_auto = cold(lambda: w4a16.matmul(x, w)) * 1e-3
        best = None
        bm = 8 if M <= 8 else 16
        for rh, kh, split in itertools.product((1, 2, 4), (1, 2), (2, 4, 8, 16)):
            tiles = -(-fw.shape[0] * 16 // (64 * rh))
            if tiles * split > 8 * sms or fw.shape[1] // kh // split < 2:
                continue
            cfg = dict(RH=rh, BM=bm, SPLIT_K=split, KH=kh)
            t = cold(launcher(x, fw, fzs, w, cfg)) * 1e-3
            rows.append(dict(kind="time", N=N, K=K, M=M, cfg=cfg, us=t * 1e3, cublas_us=t_cublas * 1e3,
                             auto_us=t_auto * 1e3))
            if best is None or t < best[0]:
                best = (t, cfg)
        print(f"{N}x{K} M={M}: cuBLAS {t_cublas*1e3:.1f} us, auto {t_auto*1e3:.1f} us "
              f"({t_cublas/t_auto:.2f}x), frag best {best[0]*1e3:.1f} us {best[1]} "
              f"({t_cublas/best[0]:.2f}x)", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
