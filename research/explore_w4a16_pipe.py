"""Exploration on the GPU: ``frag_wgmma`` with two MMA groups in flight (``PIPE``) against its shipped form, from
M = 64 up (not a test).

With ``OVERLAP`` the kernel makes step s + 1's fragments while step s's MMA runs, then waits for that MMA before
issuing the next: the tensor cores idle between steps. ``PIPE`` issues step s + 1's MMA before retiring step
s's. For each case: a correctness check of every config against ``x @ dequantize(w).T`` (float64), then
cold-L2 GPU times (CUDA graphs) of cuBLAS fp16 ``F.linear``, the shipped config and a grid of tiles and K
splits, all with ``PIPE`` or all without (``--pipe``). ``--compare`` times the shipped rule against the one
before on other shapes. Writes ``--json``; prints a line per case.

    PYTHONPATH=src:research python3 research/explore_w4a16_pipe.py --json $OUT/pipe.json [--pipe 0|1] [--budget S]
    PYTHONPATH=src:research python3 research/explore_w4a16_pipe.py --compare --shapes 5120x5120 --ms 96,192 --json F
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tilegemm import w4a16
from tilegemm.core.hardware import machine_info
from tilegemm.ops.w4a16.configs import frag_wgmma_config

from explore_w4a16_small_m import Cold, timing_cases  # noqa: E402  (cold-L2 GPU time; weights and x per case)
from explore_w4a16_wgmma import launch  # noqa: E402  (a prebuilt frag_wgmma launch)


def variants(M: int, N: int, K: int, pipe: bool) -> dict[str, dict]:
    """The shipped config (with ``pipe``'s PIPE) and a grid: BM 64 / 128 / 256 (up to M's power of two, at
    least 64), 4 warps x 1 or 2 row tiles or 8 warps x 1, a ring of 4 slots, K splits 1 / 2 / 4 (slices of 8
    steps or more)."""
    shipped = dict(frag_wgmma_config(M, N, K, "cuda"), PIPE=pipe)
    out = {"shipped": shipped}
    top = max(64, 1 << (M - 1).bit_length())
    for bm in (64, 128, 256):
        if bm > top:
            continue
        for warps, rh in ((4, 1), (4, 2), (8, 1)):
            if rh * bm > 256 or (rh == 2 and bm >= 128):
                continue  # an accumulator over 128 registers a thread spills
            for split in (1, 2, 4):
                if K // 64 // split < 8:
                    continue
                out[f"{bm}-{warps}x{rh}-s{split}"] = dict(BM=bm, RH=rh, num_warps=warps, STAGES=4, SPLIT_K=split,
                                                          OVERLAP=True, PIPE=pipe)
    return out


def old_config(M: int, N: int, K: int, sms: int) -> dict:
    """frag_wgmma's tile rule before PIPE (fitted to 4096^2, 8192^2 and 28672 x 8192; 2026-11-24-h200/d813fbc/): up
    to 64 rows the shipped rule without PIPE; above, BM 256 / 128 where its tiles make 0.9 of a wave, else 64."""
    from tilegemm.ops.w4a16.configs import _cdiv, split_within

    if M <= 64:
        return dict(frag_wgmma_config(M, N, K, "cuda"), PIPE=False)
    bm = next((b for b in (256, 128) if b <= 1 << (M - 1).bit_length() and
               _cdiv(N, 128) * _cdiv(M, b) >= 0.9 * sms), 64)
    warps, rh = (8, 1) if bm >= 128 else (4, 2 if _cdiv(N, 128) * _cdiv(M, bm) >= sms else 1)
    tiles = _cdiv(N, 16 * rh * warps) * _cdiv(M, bm)
    split = split_within(tiles, _cdiv(K, 64), (4 if bm <= 64 else 1) * sms, 8)
    return dict(BM=bm, RH=rh, num_warps=warps, STAGES=4, SPLIT_K=split, OVERLAP=True)


def compare(shapes: str, ms: str, out: str) -> None:
    """Held-out check of the rule: cuBLAS, the rule before PIPE and the shipped rule, per (N, K) x M."""
    import math

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cold = Cold()
    rows = []
    for N, K, M, wd, w, fw, fzs, x in timing_cases(shapes, ms):
        t_cublas = cold(lambda: F.linear(x, wd))
        old, new = old_config(M, N, K, sms), frag_wgmma_config(M, N, K, "cuda")
        t_old = cold(launch(x, fw, fzs, w, old)[0])
        t_new = cold(launch(x, fw, fzs, w, new)[0])
        fn, o = launch(x, fw, fzs, w, new)
        fn()
        ref = x.double() @ w4a16.dequantize(w).double().T
        err = ((o.double() - ref).norm() / ref.norm()).item()
        rows.append(dict(N=N, K=K, M=M, cublas_us=t_cublas, old=old, old_us=t_old, new=new, new_us=t_new, err=err))
        print(f"{N}x{K} M={M}: cuBLAS {t_cublas:.1f} us, before {t_cublas / t_old:.2f}x, now {t_cublas / t_new:.2f}x"
              f" (err {err:.1e})", flush=True)
    g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print(f"geomean over {len(rows)}: before {g([r['cublas_us'] / r['old_us'] for r in rows]):.3f}x, "
          f"now {g([r['cublas_us'] / r['new_us'] for r in rows]):.3f}x", flush=True)
    json.dump(dict(machine=machine_info().to_dict(), rows=rows), open(out, "w"), indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="pipe.json")
    ap.add_argument("--shapes", default="8192x8192,28672x8192,4096x4096,14336x4096,4096x14336,11008x4096,"
                                        "4096x11008,6144x6144,13824x5120")
    ap.add_argument("--ms", default="64,128,256,512,1024")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds: no new case is started past it")
    ap.add_argument("--pipe", type=int, default=1, help="1: every config with PIPE (and the checks); 0: without")
    ap.add_argument("--compare", action="store_true", help="only the held-out check of the shipped rule against the "
                                                             "one before (--shapes, --ms)")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.compare:
        return compare(a.shapes, a.ms, a.json)
    start = time.time()
    rows = []
    # correctness of PIPE: odd shapes, both dtypes, splits, short slices
    for N, K, g, M, dt in [] if not a.pipe else [(256, 512, 128, 70, torch.float16), (1000, 4160, 64, 130, torch.float16),
                           (4096, 4096, 128, 256, torch.bfloat16), (320, 1024, 128, 300, torch.float16),
                           (8192, 1024, 128, 1000, torch.float16), (272, 320, 64, 64, torch.bfloat16)]:
        w = w4a16.quantize(torch.randn(N, K, device="cuda", dtype=dt), group_size=g)
        fw, fzs = w.fragments()
        x = torch.randn(M, K, device="cuda", dtype=dt)
        bias = torch.randn(N, device="cuda", dtype=dt)
        ref = F.silu(x.double() @ w4a16.dequantize(w).double().T + bias.double())
        for name, cfg in list(variants(M, N, K, True).items())[:6]:
            for split in (1, 3):
                cfg = dict(cfg, SPLIT_K=split)
                fn, out = launch(x, fw, fzs, w, cfg, bias, "silu")
                fn()
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all()) and err < (2e-3 if dt == torch.float16 else 1e-2)
                rows.append(dict(kind="check", N=N, K=K, g=g, M=M, dtype=str(dt), cfg=cfg, err=err, ok=ok))
                if not ok:
                    print(f"FAIL {N}x{K} g{g} M={M} {dt} {cfg}: err {err:.2e}", flush=True)
    print(f"checks: {sum(r['ok'] for r in rows)}/{len(rows)} ok", flush=True)
    cold = Cold()
    for N, K, M, wd, w, fw, fzs, x in timing_cases(a.shapes, a.ms):
        if time.time() - start > a.budget:
            break
        t_cublas = cold(lambda: F.linear(x, wd))
        t_auto = cold(lambda: w4a16.matmul(x, w))
        times = {}
        for name, cfg in variants(M, N, K, bool(a.pipe)).items():
            times[name] = cold(launch(x, fw, fzs, w, cfg)[0])
            rows.append(dict(kind="time", N=N, K=K, M=M, name=name, cfg=cfg, us=times[name], cublas_us=t_cublas))
        best = min(times, key=times.get)
        rows.append(dict(kind="summary", N=N, K=K, M=M, cublas_us=t_cublas, auto_us=t_auto, shipped_us=times["shipped"],
                         pipe=bool(a.pipe), best=best, best_cfg=variants(M, N, K, bool(a.pipe))[best],
                         best_us=times[best]))
        print(f"{N}x{K} M={M}: cuBLAS {t_cublas:.1f} us, auto {t_cublas / t_auto:.2f}x, shipped config "
              f"{t_cublas / times['shipped']:.2f}x, best {best} {t_cublas / times[best]:.2f}x", flush=True)
    json.dump(dict(machine=machine_info().to_dict(), rows=rows), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
