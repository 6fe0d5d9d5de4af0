"""Where the host time of a replayed 64^3 ``tilegemm.matmul`` goes, part by part (run on the GPU machine).

    PYTHONPATH=src python3 research/profile_host_call.py [--json PATH]

Times, per call (best of five runs of 2000 back-to-back calls): ``torch.matmul``, ``tilegemm.matmul`` (the bench's
host probe), and the pieces of its replay path alone: the key, the cache lookup, the output's allocation and the
replay's launch. Then a cProfile of the call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--n", type=int, default=64)
    args = parser.parse_args()

    import torch

    import tilegemm
    from tilegemm.bench.runner import host_us_per_call
    from tilegemm.core.launch import plain_call
    from tilegemm.core.runtime import new_output
    from tilegemm.ops.matmul import replay

    n = args.n
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    tilegemm.matmul(a, b)
    key = replay.replay_key(a, b, 1.0, None, "auto")
    hit = replay.lookup(key)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)

    def per_call(fn):
        return host_us_per_call(fn, calls=2000)

    rows = {
        "torch.matmul": per_call(lambda: torch.matmul(a, b)),
        "tilegemm.matmul": per_call(lambda: tilegemm.matmul(a, b)),
        "torch.empty": per_call(lambda: torch.empty((n, n), dtype=torch.float16, device=a.device)),
        "new_output": per_call(lambda: new_output(hit.shape, torch.float16, a.device)),
        "replay_key": per_call(lambda: replay.replay_key(a, b, 1.0, None, "auto")),
        "plain_call": per_call(lambda: plain_call(a, b)),
        "lookup (key made)": per_call(lambda: replay.lookup(key)),
        "hash(key)": per_call(lambda: hash(key)),
        "replay launch": per_call(lambda: hit(a, b, out)),
        "a.stride(), a.shape, a.device": per_call(lambda: (a.stride(), a.shape, a.device)),
        "a.data_ptr() x2": per_call(lambda: (a.data_ptr(), b.data_ptr())),
        "torch.compiler.is_compiling()": per_call(torch.compiler.is_compiling),
    }
    rows["ratio"] = rows["tilegemm.matmul"] / rows["torch.matmul"]
    print(f"{torch.cuda.get_device_name()}, {n}^3 fp16")
    for name, us in rows.items():
        print(f"{name:34s} {us:7.2f}" + (" us" if name != "ratio" else "x"))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5000):
        tilegemm.matmul(a, b)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    text = "\n".join(s.getvalue().splitlines()[:40])
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), n=n, us=rows, profile=text), f, indent=1)


if __name__ == "__main__":
    main()
