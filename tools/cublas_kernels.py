"""Which kernels cuBLAS runs, and for how long on the GPU alone (run on the GPU machine; not a test).

For each case the baseline (``torch.matmul`` or ``torch._scaled_mm``) and ``tilegemm.matmul`` (the rung
given, ``auto`` by default) run under ``torch.profiler``; the profiler's CUPTI durations are the kernels'
own time, without the launch gaps and events that ``do_bench`` counts. cuBLAS's kernel names say its tile,
cluster and schedule (e.g. ``nvjet_..._128x256_64x4_2x1_..._coopA``), so one sees which shape of kernel a
rung has to beat. Writes ``$OUT/cublas-kernels.json``; prints one line per case.

    PYTHONPATH=src python3 tools/cublas_kernels.py [--cases fp16:1024,fp16:2048,fp8:2048] [--rung auto]

A case is ``DTYPE:N`` (square) or, for 16-bit types, ``DTYPE:MxNxK`` with an optional ``:nt`` (B the transpose of a
row-major ``[N, K]`` weight, as ``F.linear`` and conv2d's 1x1 GEMMs read it), e.g. ``fp16:6272x192x1920:nt``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import tilegemm
from tilegemm.core.hardware import machine_info

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8fast": torch.float8_e4m3fn}
DEFAULT = ("fp16:1024,fp16:2048,fp16:4096,fp16:8192,bf16:1024,bf16:2048,bf16:4096,"
           "fp8:2048,fp8:4096,fp8:8192,fp8:16384,fp8fast:2048,fp8fast:4096")


def kernel_times(fn, reps: int) -> dict[str, list[float]]:
    """Kernel name -> its durations in us over ``reps`` calls (after a warm-up outside the profile)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name].append(ev.device_time if hasattr(ev, "device_time") else ev.cuda_time)
    return dict(out)


def summary(times: dict[str, list[float]], reps: int) -> list[dict]:
    return sorted(({"name": n, "calls_per_op": len(t) / reps, "median_us": statistics.median(t)} for n, t in times.items()),
                  key=lambda r: -r["median_us"] * r["calls_per_op"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT)
    ap.add_argument("--rung", default="auto")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        kind, size, *layout = case.split(":")
        dims = [int(v) for v in size.split("x")]
        n = dims[0]
        dtype = DTYPES[kind]
        if len(dims) not in (1, 3) or (len(dims) == 3 and dtype.itemsize == 1):
            raise SystemExit(f"{case}: a case is DTYPE:N, or DTYPE:MxNxK for 16-bit types")
        torch.manual_seed(0)
        if dtype.itemsize == 1:
            a = torch.randn(n, n, device="cuda").to(dtype)
            b = torch.randn(n, n, device="cuda").to(dtype).T  # column-major, as _scaled_mm takes it
            one = torch.ones((), device="cuda")
            fast = kind == "fp8fast"
            base = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                            use_fast_accum=fast)
            ours = lambda: tilegemm.matmul(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                           fast_accum=fast, kernel=args.rung)
        else:
            M, N, K = dims if len(dims) == 3 else (n, n, n)
            a = torch.randn(M, K, device="cuda", dtype=dtype)
            b = (torch.randn(N, K, device="cuda", dtype=dtype).T if layout == ["nt"]
                 else torch.randn(K, N, device="cuda", dtype=dtype))
            base = lambda: torch.matmul(a, b)  # noqa: E731
            ours = lambda: tilegemm.matmul(a, b, kernel=args.rung)  # noqa: E731
        row = {"case": case}
        for who, fn in (("baseline", base), ("tilegemm", ours)):
            row[who] = summary(kernel_times(fn, args.reps), args.reps)
        rows.append(row)
        b0, t0 = row["baseline"][0], row["tilegemm"][0]
        bt = sum(r["median_us"] * r["calls_per_op"] for r in row["baseline"])
        tt = sum(r["median_us"] * r["calls_per_op"] for r in row["tilegemm"])
        print(f"{case:14s} cuBLAS {bt:8.1f} us  ours {tt:8.1f} us  ratio {bt / tt:5.3f}  | {b0['name'][:110]}")
        print(f"{'':14s} ours: {t0['name'][:100]}")
    path = os.path.join(os.environ.get("OUT", "."), "cublas-kernels.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rung=args.rung, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
