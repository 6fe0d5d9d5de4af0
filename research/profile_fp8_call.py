"""Where does an fp8 call's time go? (GPU; prints a table)

The bench measured fp8 with scales at 1024^3 / 2048^3 several times slower through ``tilegemm.matmul`` than
research/explore_hopper.py measured the same kernel launched directly. This times both ways, measures the
host time per call, and lists the GPU kernels one call launches (torch.profiler).

    PYTHONPATH=src python3 research/profile_fp8_call.py
"""

from __future__ import annotations

import time

import torch
import triton.testing

import tilegemm
from tilegemm.ops.matmul import persistent_tma as pt
from tilegemm.ops.matmul.problem import make_problems


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    for s in (1024, 2048, 4096):
        a = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn).t()
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
        out = torch.empty(s, s, device="cuda", dtype=torch.bfloat16)
        calls = {
            "scaled_mm": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
            "matmul auto": lambda: tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
            "matmul pt": lambda: tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                 kernel="persistent_tma"),
            "matmul pt no scales": lambda: tilegemm.matmul(a, b, kernel="persistent_tma"),
        }
        p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False, (sa, 0, sb, 0))[0]
        tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, kernel="persistent_tma")
        cfg = pt.tuned_config(p)
        calls["pt._launch direct"] = lambda: pt._launch(p, cfg)
        print(f"--- {s}^3  tuned config {cfg}")
        for name, fn in calls.items():
            fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            print(f"{name:22s} do_bench {ms * 1e3:8.1f} us   host {host_us(fn):7.1f} us/call", flush=True)
        if s == 1024:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    calls["matmul pt"]()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
