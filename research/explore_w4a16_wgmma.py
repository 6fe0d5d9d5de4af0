"""The ``frag_wgmma`` W4A16 kernel (the pre-shuffled fragments through wgmma, x from shared memory): correctness
against ``x @ dequantize(w).T`` and cold-L2 GPU times against cuBLAS fp16 and the shipped kernels, over its
configs, for M from 17 up.

    PYTHONPATH=src:research python research/explore_w4a16_wgmma.py --json $OUT/wgmma.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tilegemm import w4a16
from tilegemm.ops.w4a16 import frag_wgmma
from tilegemm.ops.w4a16.configs import frag_wgmma_config

from explore_w4a16_small_m import Cold  # GPU time in CUDA graphs, the L2 cleared before each call


def launch(x, fw, fzs, w, cfg, bias=None, activation="none", out=None):
    """(launcher closure, output) with prebuilt arguments (no host work but the launch)."""
    if out is None:
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    kernel, grid, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, bias, out, w.shape[0], w.shape[1], w.group_k,
                                                        activation, cfg)
    return (lambda: kernel[grid](*args, **kwargs)), out


def record_check(rows, out, ref, dt, cfg, **where):
    """Append (and print) one correctness check of ``out`` against the float64 ``ref``: finite, and within
    2e-3 (fp16) / 1e-2 (bf16) relative error."""
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ok = bool(torch.isfinite(out).all()) and err < (2e-3 if dt == torch.float16 else 1e-2)
    rows.append(dict(kind="check", **where, dtype=str(dt), cfg=cfg, err=err, ok=ok))
    print(f"check {where['N']}x{where['K']} g{where['g']} M={where['M']} {dt} {cfg}: err {err:.2e} "
          f"{'ok' if ok else 'FAIL'}", flush=True)


def check_problem(N, K, g, M, dt):
    """(Int4Weight of a random [N, K] weight in groups of ``g``, its fragments and fragment scales, x [M, K], a
    bias, the float64 reference of silu(x @ W.T + bias)) for a correctness check."""
    w = w4a16.quantize(torch.randn(N, K, device="cuda", dtype=dt), group_size=g)
    x = torch.randn(M, K, device="cuda", dtype=dt)
    bias = torch.randn(N, device="cuda", dtype=dt)
    ref = F.silu(x.double() @ w4a16.dequantize(w).double().T + bias.double())
    return (w, *w.fragments(), x, bias, ref)


def fp16_weights(shapes: str):
    """(N, K, dense fp16 weight, its g128 Int4Weight, fragments, fragment scales) per ``NxK`` in ``shapes``."""
    for shape in shapes.split(","):
        N, K = map(int, shape.split("x"))
        wd = torch.randn(N, K, device="cuda", dtype=torch.float16)
        w = w4a16.quantize(wd, group_size=128)
        yield (N, K, wd, w, *w.fragments())


def configs(M, N, K, sms):
    """BM the smallest of 32..256 that holds M (and the next smaller from 256 rows on), three warp shapes,
    two ring depths, the K split of the shipped rule and its neighbours."""
    bms = sorted({next((b for b in (8, 16, 32, 64, 128) if M <= b), 256)} | ({128} if M >= 256 else set())
                 | ({64} if M >= 128 else set()))
    for bm, (warps, rh), stages in itertools.product(bms, ((4, 2), (8, 1), (4, 1)), (3, 4, 6)):
        if bm * 64 * 2 * stages + 16 * rh * warps * 32 * stages > 200 * 1024 or rh * bm > 256 or (rh == 2 and bm >= 128):
            continue  # shared memory; an accumulator over 128 registers a thread spills
        base = frag_wgmma_config(M, N, K, "cuda")["SPLIT_K"] if (bm, warps, rh) == (
            frag_wgmma_config(M, N, K, "cuda")["BM"], *((8, 1) if bm == 256 else (4, 2))) else None
        tiles = -(-N // (16 * rh * warps)) * -(-M // bm)
        splits = {1}
        s = 1
        while tiles * s < (8 if bm <= 16 else 4) * sms and K // 64 // s >= 8:
            s *= 2
            splits.add(s)
        if base:
            splits.add(base)
        for split in sorted(splits):
            yield dict(BM=bm, RH=rh, num_warps=warps, STAGES=stages, SPLIT_K=split)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="4096x4096,8192x8192,28672x8192,14336x4096")
    ap.add_argument("--ms", default="32,64,128,256,1024")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="time the shipped config only")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (N, K, g, M, dt) in [] if a.no_check else [
            (256, 512, 128, 17, torch.float16), (272, 320, 64, 33, torch.float16),
            (1000, 4160, 64, 70, torch.float16), (4096, 4096, -1, 129, torch.float16),
            (4096, 4096, 128, 256, torch.bfloat16), (320, 1024, 128, 300, torch.float16),
            (4096, 4096, 256, 40, torch.bfloat16), (8192, 1024, 128, 1000, torch.float16)]:
        w, fw, fzs, x, bias, ref = check_problem(N, K, g, M, dt)
        for bm, warps, rh, stages, split, overlap in (
                (32, 4, 2, 4, 1, True), (64, 4, 2, 3, 3, True), (128, 8, 1, 4, 2, True), (256, 8, 1, 3, 1, True),
                (64, 4, 1, 4, 5, True), (256, 8, 1, 2, 2, False), (64, 8, 2, 3, 1, True), (32, 4, 1, 3, 7, False),
                (8, 4, 1, 4, 3, True), (16, 8, 1, 4, 2, True), (16, 4, 2, 6, 1, True)):
            cfg = dict(BM=bm, RH=rh, num_warps=warps, STAGES=stages, SPLIT_K=split, OVERLAP=overlap)
            fn, out = launch(x, fw, fzs, w, cfg, bias, "silu")
            fn()
            record_check(rows, out, ref, dt, cfg, N=N, K=K, g=g, M=M)
    cold = Cold()
    for N, K, wd, w, fw, fzs in fp16_weights(a.shapes):
        for M in map(int, a.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            t_cublas = cold(lambda: F.linear(x, wd))
            t_mma = cold(lambda: w4a16.matmul(x, w, kernel="mma"))
            t_deq = cold(lambda: w4a16.matmul(x, w, kernel="frag" if M <= 16 else "dequant_cublas"))
            shipped = frag_wgmma_config(M, N, K, "cuda")
            t_ship = cold(launch(x, fw, fzs, w, shipped)[0])
            best = (t_ship, shipped)
            for cfg in [] if a.no_sweep else configs(M, N, K, sms):
                t = cold(launch(x, fw, fzs, w, cfg)[0])
                rows.append(dict(kind="time", N=N, K=K, M=M, cfg=cfg, us=t, cublas_us=t_cublas))
                if t < best[0]:
                    best = (t, cfg)
            serial = dict(best[1], OVERLAP=False)
            t_serial = cold(launch(x, fw, fzs, w, serial)[0])
            rows.append(dict(kind="time", N=N, K=K, M=M, cfg=serial, us=t_serial, cublas_us=t_cublas))
            rows.append(dict(kind="summary", N=N, K=K, M=M, cublas_us=t_cublas, mma_us=t_mma, dequant_us=t_deq,
                             shipped=shipped, shipped_us=t_ship, best=best[1], best_us=best[0]))
            other = "frag" if M <= 16 else "dequant"
            print(f"{N}x{K} M={M}: cuBLAS {t_cublas:.1f} us, mma {t_mma:.1f} ({t_cublas/t_mma:.2f}x), {other} "
                  f"{t_deq:.1f} ({t_cublas/t_deq:.2f}x), wgmma shipped {t_ship:.1f} ({t_cublas/t_ship:.2f}x) "
                  f"best {best[0]:.1f} ({t_cublas/best[0]:.2f}x) {best[1]}; it without OVERLAP {t_serial:.1f}",
                  flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
