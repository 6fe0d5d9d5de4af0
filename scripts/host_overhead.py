"""Host time per call on a tiny shape: tilegemm.matmul against torch.matmul (run on the GPU machine).

The GPU work of a 64x64x64 product is a few microseconds, so the wall time of many back-to-back calls is
set by the host: argument checks, dispatch and the kernel launch.
"""

import json
import os
import sys
import time

import torch

import tilegemm


def per_call_us(fn, n=2000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def main():
    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    rows = {"torch.matmul": per_call_us(lambda: torch.matmul(a, b))}
    for kernel in ("naive", "grouped", "autotuned", "auto"):
        rows[f"tilegemm {kernel}"] = per_call_us(lambda: tilegemm.matmul(a, b, kernel=kernel))
    rows["tilegemm via torch.ops"] = per_call_us(
        lambda: torch.ops.tilegemm.matmul(a, b, None, None, 1.0, 1.0, "none", None, "default", "grouped"))
    base = rows["torch.matmul"]
    for name, us in rows.items():
        print(f"{name:28s} {us:7.1f} us/call  {us / base:5.2f}x torch")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           commit=os.environ.get("TILEGEMM_GIT_COMMIT"), us_per_call=rows), f, indent=1)


if __name__ == "__main__":
    main()
