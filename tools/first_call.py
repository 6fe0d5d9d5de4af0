"""First-call wall time of ``tilegemm.matmul`` on shapes no tuned table holds, in fresh processes.

For every shape and dtype, fresh Python processes each time their first call on it (import excluded, the
result synchronized): one with an empty Triton cache (everything compiles), one with a warm one (the kernels
compiled by an earlier process are on disk), and one with a warm cache that made a call on another shape
first (a 64^3 product): the per-shape cost without the once-per-process ones (importing Triton and the
kernel modules, Triton hashing its own sources for its cache keys: about 0.3 + 0.2 + 0.4 s on the H100,
docs/performance.md). ``torch.matmul``'s first call is timed beside them, and once, the first call
of a trivial Triton kernel (empty and warm cache): what Triton alone costs a fresh process, the floor of any
Triton library's first call.

    PYTHONPATH=src python3 tools/first_call.py [--shapes 333x333x8192,1x12345x4096] [--dtypes fp16,bf16] \
        [--out first-call.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

DEFAULT_SHAPES = "333x333x8192,777x5000x3000,1x12345x4096,257x11008x4096,4000x4000x4000,37x2999x1001,8190x128x4104"

CHILD = r"""
import json, sys, time
import torch
m, n, k, dtype, which = sys.argv[1:]
m, n, k = int(m), int(n), int(k)
dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
a = torch.randn(m, k, device="cuda", dtype=dt)
b = torch.randn(k, n, device="cuda", dtype=dt)
torch.cuda.synchronize()
if which == "torch":
    f = torch.matmul
elif which == "triton":  # the floor of any Triton library: a trivial kernel's first call (Triton's own costs)
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    out = torch.empty_like(a)
    f = lambda a, b: _twice[(triton.cdiv(a.numel(), 1024),)](a, out, a.numel(), BLOCK=1024)
else:
    import tilegemm
    f = tilegemm.matmul
    if which == "tilegemm-after":  # the process has made a call already, on another shape
        f(torch.randn(64, 64, device="cuda", dtype=dt), torch.randn(64, 64, device="cuda", dtype=dt))
        torch.cuda.synchronize()
times = []
for _ in range(2):
    start = time.perf_counter()
    f(a, b)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def run(shape, dtype, which, cache_dir) -> list[float]:
    # No user tuning cache either: an "unseen" shape must be unseen by tilegemm's tables too, shipped ones aside.
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, TILEGEMM_TUNING_CACHE="0")
    env.pop("TILEGEMM_TUNE", None)
    with tempfile.TemporaryDirectory() as d:  # a file, not -c: Triton reads a kernel's source from its file
        script = os.path.join(d, "first_call_child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        done = subprocess.run([sys.executable, script, *shape, dtype, which], env=env, capture_output=True,
                              text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cold:  # Triton's own floor, once: a trivial kernel on 64x64 fp16
        floor = dict(empty_cache_s=run(["64", "64", "64"], "fp16", "triton", cold)[0],
                     warm_cache_s=run(["64", "64", "64"], "fp16", "triton", cold)[0])
    print(f"a trivial Triton kernel's first call: empty cache {floor['empty_cache_s']:.3f} s, warm cache "
          f"{floor['warm_cache_s'] * 1e3:.1f} ms", flush=True)
    for text in args.shapes.split(","):
        shape = text.split("x")
        for dtype in args.dtypes.split(","):
            with tempfile.TemporaryDirectory() as cold:
                empty = run(shape, dtype, "tilegemm", cold)  # compiles into `cold`
                warm = run(shape, dtype, "tilegemm", cold)  # a new process; the compiled kernels are on disk
                after = run(shape, dtype, "tilegemm-after", cold)  # and one that made a call on another shape
            with tempfile.TemporaryDirectory() as d:
                torch_first = run(shape, dtype, "torch", d)
            rows.append(dict(shape=text, dtype=dtype, empty_cache_s=empty[0], warm_cache_s=warm[0],
                             warm_cache_after_a_call_s=after[0], second_call_s=warm[1], torch_first_s=torch_first[0]))
            print(f"{text:>18} {dtype}: empty cache {empty[0]:7.3f} s, warm cache {warm[0] * 1e3:8.1f} ms "
                  f"({after[0] * 1e3:6.1f} ms after a call on another shape), second call {warm[1] * 1e3:6.2f} ms, "
                  f"torch.matmul first {torch_first[0] * 1e3:7.1f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(triton_floor=floor, rows=rows), f, indent=1)
    worst_empty = max(r["empty_cache_s"] for r in rows)
    worst_warm = max(r["warm_cache_s"] for r in rows)
    worst_after = max(r["warm_cache_after_a_call_s"] for r in rows)
    print(f"worst first call: empty cache {worst_empty:.2f} s (target <= 1.5 s), warm {worst_warm * 1e3:.0f} ms, "
          f"warm after a call on another shape {worst_after * 1e3:.0f} ms (target < 50 ms)")


if __name__ == "__main__":
    main()
