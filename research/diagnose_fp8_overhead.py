"""Diagnosis: how much of a promoted-fp8 GEMM's time is fixed (start-up, last epilogue) rather than per K
step, for the warp-specialized Gluon kernel and for ``torch._scaled_mm`` (run on the GPU machine).

At 2048^3 the shipped kernel ran 18.5 us where cuBLAS ran 14.9 (profiler times,
``2026-11-22-h200/67ba97c/cublas-kernels.json``), while from 4096^3 up a K step costs about the same in
both. Here M = N are fixed and K varies; the profiler's kernel durations (no launch gaps) are fitted as
``time = fixed + per_step * K / 128`` by least squares, per kernel. Writes ``$OUT``-style JSON.

At 765dd39 the kernel made its descriptors on the device: 3 us more fixed time than cuBLAS at 2048^2 and
4096^2, the same per-step time within 2-4%. At 3f16841 a copy with host-made descriptors
(``ws_hd``, then ``research/fp8_host_desc.py``) took 2 us of that off; the shipped kernel takes them since.

    PYTHONPATH=src:tools python3 research/diagnose_fp8_overhead.py --json out.json [--mn 2048] [--stages 6]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems

from cublas_kernels import kernel_times


def fit(ks, ts):
    """Least-squares (fixed, per_step) of ts against K / 128."""
    xs = [k / 128 for k in ks]
    mx, my = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def host_us(fn, calls=200):
    """Host time per call (us): ``calls`` calls enqueued back to back, no sync inside (the GPU queue
    holds them all, so this is what the CPU spends, not what the GPU does)."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_times(mn, rows):
    """tilegemm.matmul (auto; a repeated call replays its launch, host descriptors included) against
    torch._scaled_mm at M = N = K = mn."""
    import tilegemm

    a = torch.randn(mn, mn, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(mn, mn, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.tensor(0.75, device="cuda")
    sb = torch.tensor(1.25, device="cuda")
    got = {"scaled_mm": host_us(lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16)),
           "tilegemm": host_us(lambda: tilegemm.matmul(a, w.T, scale_a=sa, scale_b=sb))}
    # Where tilegemm's host time goes: the replay alone, and the encoding of its host descriptors.
    from tilegemm.ops.matmul import replay
    from triton.backends.nvidia.driver import make_tensordesc_arg

    out = torch.empty(mn, mn, device="cuda", dtype=torch.bfloat16)
    replays = [r for r in replay._cache.entries.values() if r.shape == out.shape]
    got["replays_cached"] = len(replays)
    if replays:
        replay = replays[-1]
        got["replay_only"] = host_us(lambda: replay(a, w.T, out, sa, sb))
        descs = [d for _, _, d in replay.slots if d is not None]
        got["host_descriptors"] = len(descs)
        # What Triton's launcher does per descriptor (the metadata's values only steer the encoding).
        meta = [dict(swizzle=3, elem_size=d.base.element_size(), elem_type=0, block_size=d.block_shape,
                     fp4_padded=False) for d in descs]
        if descs:
            got["encode_descriptors"] = host_us(lambda: [make_tensordesc_arg(d, m) for d, m in zip(descs, meta)])
    kernels = kernel_times(lambda: tilegemm.matmul(a, w.T, scale_a=sa, scale_b=sb), 5)
    rows.append(dict(M=mn, N=mn, K=mn, host_us=got, tilegemm_kernels=sorted(kernels)))
    print(f"{mn}^3 host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items())
          + f" (tilegemm runs {sorted(kernels)})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--mn", default="2048,4096")
    ap.add_argument("--ks", default="256,512,1024,2048,4096")
    ap.add_argument("--stages", type=int, default=6)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--host", default="", help="sizes at which to time the host side of repeated calls")
    args = ap.parse_args()
    persistent_tma.ensure_allocator()
    cfg = dict(GLUON_FP8=True, WS=True, STAGES=args.stages, num_warps=4)
    rows = []
    for mn in (int(x) for x in args.host.split(",") if x):
        host_times(mn, rows)
    for mn in (int(x) for x in args.mn.split(",")):
        per = {"scaled_mm": [], "ws": []}
        ks = [int(x) for x in args.ks.split(",")]
        for K in ks:
            a = torch.randn(mn, K, device="cuda").to(torch.float8_e4m3fn)
            w = torch.randn(mn, K, device="cuda").to(torch.float8_e4m3fn)
            sa = torch.tensor(0.75, device="cuda")
            sb = torch.tensor(1.25, device="cuda")
            out = torch.empty(mn, mn, device="cuda", dtype=torch.bfloat16)
            p = make_problems(a, w.T, out, None, None, 1.0, 0.0, "none", "ieee", False, scales=(sa, 0, sb, 0))[0]
            fns = {"scaled_mm": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16),
                   "ws": lambda: persistent_tma.run(p, cfg)}
            ref = (a.float() @ w.float().T) * (0.75 * 1.25)
            for name in ("ws",):
                out.fill_(float("nan"))
                fns[name]()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, err)
            for name, fn in fns.items():
                times = kernel_times(fn, args.reps)
                main_kernel = max(times.items(), key=lambda kv: statistics.median(kv[1]))
                t = statistics.median(main_kernel[1])
                per[name].append(t)
                rows.append(dict(M=mn, N=mn, K=K, variant=name, kernel=main_kernel[0], median_us=t, rel_err=err))
            print(f"{mn} K={K:5d} " + "  ".join(f"{k} {v[-1]:8.2f} us" for k, v in per.items()), flush=True)
        for name, ts in per.items():
            fixed, step = fit(ks, ts)
            rows.append(dict(M=mn, N=mn, variant=name, fit_fixed_us=fixed, fit_per_step_us=step))
            print(f"{mn} {name:10s} fixed {fixed:6.2f} us + {step:6.3f} us per 128-wide K step", flush=True)
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit(), stages=args.stages)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
