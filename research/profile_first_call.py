"""Diagnosis on the GPU: where a first ``tilegemm.matmul`` call's wall time goes with a warm Triton cache.

Runs one fresh process to fill a Triton cache for the shape, then a second one that profiles its first call
(cProfile, import of tilegemm excluded as in tools/first_call.py), and prints the entries with the most
cumulative time. With ``--empty`` the profiled process starts from an empty Triton cache (what compiles, and
for how long). Writes ``$OUT/profile-first-call-<shape>[-empty].txt``.

    PYTHONPATH=src python3 research/profile_first_call.py 777x5000x3000 [--empty]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import cProfile, io, pstats, sys, time
import torch
import tilegemm
m, n, k = (int(x) for x in sys.argv[1].split("x"))
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
b = torch.randn(k, n, device="cuda", dtype=torch.float16)
torch.matmul(a, b)
torch.cuda.synchronize()
prof = cProfile.Profile()
start = time.perf_counter()
prof.enable()
tilegemm.matmul(a, b)
torch.cuda.synchronize()
prof.disable()
print(f"first call {1e3 * (time.perf_counter() - start):.1f} ms (under cProfile)")
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
print(s.getvalue())
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
print(s.getvalue()[-6000:])
"""


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--empty"]
    empty = "--empty" in sys.argv[1:]
    shape = args[0] if args else "777x5000x3000"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, TILEGEMM_TUNING_CACHE="0")
        if not empty:
            subprocess.run([sys.executable, "-c", CHILD, shape], env=env, capture_output=True, text=True,
                           timeout=600)
        done = subprocess.run([sys.executable, "-c", CHILD, shape], env=env, capture_output=True, text=True,
                              timeout=600)
    text = done.stdout + done.stderr[-3000:]
    name = f"profile-first-call-{shape}{'-empty' if empty else ''}.txt"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        f.write(text)
    print(text[:6000])


if __name__ == "__main__":
    main()
