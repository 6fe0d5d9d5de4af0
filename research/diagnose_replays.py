"""Diagnosis (not a test): are repeated ``tilegemm.matmul`` calls replayed, what do they cost the host,
and how do they time against the baseline (do_bench medians, L2 cleared before each call)?

    PYTHONPATH=src python3 research/diagnose_replays.py [--fp8]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import triton.testing

import tilegemm
from tilegemm.core import tuning
from tilegemm.ops.matmul import persistent_tma, replay
from tilegemm.ops.matmul.problem import make_problems


def host_us(fn, calls=200):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def bench(fns):
    ms = {k: statistics.median([triton.testing.do_bench(f, warmup=10, rep=50) for _ in range(3)]) for k, f in fns.items()}
    return {k: round(ms["baseline"] / v, 3) for k, v in ms.items()}


def main():
    fp8 = "--fp8" in sys.argv
    dtypes = [torch.float8_e4m3fn] if fp8 else [torch.float16, torch.bfloat16]
    for dt in dtypes:
        for s in (1024, 2048, 4096):
            a = torch.randn(s, s, device="cuda").to(dt)
            if fp8:
                b = torch.randn(s, s, device="cuda").to(dt).T  # K-major, as _scaled_mm takes it
                one = torch.ones((), device="cuda")
                kw = dict(scale_a=one, scale_b=one)
                base = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
            else:
                b = torch.randn(s, s, device="cuda").to(dt)
                kw = {}
                base = lambda: torch.matmul(a, b)  # noqa: E731
            fns = {"baseline": base}
            for k in ("auto", "persistent_tma", "autotuned"):
                fns[k] = lambda k=k: tilegemm.matmul(a, b, kernel=k, **kw)
                n0 = replay.count()
                for _ in range(3):
                    fns[k]()
                print(dt, s, k, "replay entries +", replay.count() - n0,
                      f"host {host_us(fns[k]):.1f} us/call", flush=True)
            if fp8:  # the tuned persistent_tma config, launched as the tuner times it
                out = torch.empty(s, s, device="cuda", dtype=torch.bfloat16)
                p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False,
                                  (one, 0, one, 0))[0]
                cfg = persistent_tma.tuned_config(p)
                print("   tuned persistent_tma config:", cfg)
                if cfg:
                    fns["tuner_replay"] = tuning.replaying(lambda c: persistent_tma.launch_config(p, c), cfg)
            print("   ratios:", bench(fns), flush=True)


if __name__ == "__main__":
    main()
