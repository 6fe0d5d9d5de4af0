"""Diagnosis on the GPU: what a tuner times for each candidate, as it times it (not a test).

``tilegemm.core.tuning.lookup_or_tune`` keeps only its winner. This runs it for one rung and shape with a fresh,
memory-only table (``TILEGEMM_TUNING_CACHE=0``, shipped entries dropped) and logs every ``do_bench`` call
it makes: the config, the rep and the median, or the exception that ruled a config out. Promoted fp8 e4m3
NT with per-tensor scales (as the bench runs it), or fp16/bf16 NN.

    PYTHONPATH=src python3 research/diagnose_tuner.py 4096x4096x4096 [--dtype fp8] [--rung persistent_tma]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["TILEGEMM_TUNING_CACHE"] = "0"

import torch  # noqa: E402
import triton.testing  # noqa: E402

from tilegemm.core import tuning  # noqa: E402
from tilegemm.ops.matmul import dispatch  # noqa: E402
from tilegemm.ops.matmul.problem import make_problems  # noqa: E402


def problem(shape: str, dtype: str):
    M, N, K = (int(x) for x in shape.split("x"))
    if dtype == "fp8":
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).T
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
        return make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False, scales=(sa, 0, sb, 0))[0]
    t = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(M, K, device="cuda", dtype=t), torch.randn(K, N, device="cuda", dtype=t)
    return make_problems(a, b, torch.empty(M, N, device="cuda", dtype=t), None, None, 1.0, 0.0, "none",
                         "ieee", False)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", help="MxNxK[,MxNxK...]")
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "fp16", "bf16"])
    ap.add_argument("--rung", default="persistent_tma")
    ap.add_argument("--json")
    ap.add_argument("--bench", action="store_true",
                    help="tune inside `tilegemm bench --shape ... --kernels RUNG` (its inputs, checks and timing)")
    args = ap.parse_args()
    real = triton.testing.do_bench
    log = []
    current = {}

    def logged(fn, **kwargs):
        try:
            ms = real(fn, **kwargs)
        except Exception as e:  # noqa: BLE001
            log.append(dict(current, rep=kwargs.get("rep"), error=f"{type(e).__name__}: {str(e)[:300]}"))
            current.pop("cfg", None)
            raise
        log.append(dict(current, rep=kwargs.get("rep"), ms=ms))
        current.pop("cfg", None)  # a do_bench call outside the tuner (the bench's own timing) has none
        return ms

    tuning._load()
    tuning._memory.clear()  # shipped entries too: every shape is tuned here
    triton.testing.do_bench = logged
    real_replaying = tuning.replaying

    def tagged(launch, cfg):
        run = real_replaying(launch, cfg)

        def call():
            current["cfg"] = cfg
            run()
        return call

    tuning.replaying = tagged
    for shape in args.shapes.split(","):
        current.clear()
        current["shape"] = shape
        if args.bench:
            from tilegemm.cli import main as cli

            dtype = {"fp8": "fp8_e4m3"}.get(args.dtype, args.dtype)
            layout = "NT" if args.dtype == "fp8" else "NN"
            cli(["bench", "--quiet", "--no-save", "--shape", shape.replace("x", ","), "--dtype", dtype,
                 "--layout", layout, "--kernels", args.rung])
        else:
            dispatch.launcher(args.rung)(problem(shape, args.dtype))
        torch.cuda.synchronize()
        picked = tuning.entries()
        print(f"\n{shape} {args.dtype} {args.rung}: picked {[v for k, v in picked.items() if args.rung in k][-1:]}")
        for row in log:
            if row.get("shape") == shape and "cfg" in row:
                print(f"  rep {row['rep']:>4} {row.get('ms', float('nan')):9.4f} ms {row.get('error', '')} {row.get('cfg')}")
    if args.json:
        with open(args.json, "w") as f:
            from dataclasses import asdict

            from tilegemm.core.hardware import machine_info

            json.dump(dict(machine=asdict(machine_info()), log=log), f, indent=1, default=str)


if __name__ == "__main__":
    main()
