"""Exploration on the GPU: does a leading dimension that is a multiple of 8 elements but not of 64 slow tilegemm
down where cuBLAS keeps its speed (not a test)?

For each M x N x K (fp16 or bf16, NN), three variants of the same product, each against cuBLAS on the same
operands (do_bench medians, alternating over ``--rounds`` rounds):

- ``exact``: contiguous operands, as the random sweep makes them;
- ``ld64``: the same logical shape as views into buffers whose rows are a multiple of 64 elements (128 bytes);
  ``ldA64`` / ``ldB64``: only A's / only B's;
- ``round``: M, N, K rounded up to multiples of 128, 128, 64, contiguous (what a tuned shape looks like).

Writes ``$OUT/stride-alignment-<dtype>.json``; prints a table.

    PYTHONPATH=src python3 research/explore_stride_alignment.py 6744x11288x21480 3032x8872x1928 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import tilegemm

sys.path.insert(0, os.path.dirname(__file__))
from diagnose_random import timed_against_cublas, write_rows  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def up(n: int, to: int) -> int:
    return -(-n // to) * to


def operands(M, N, K, dtype, ld_to: int, which: str = "ab"):
    a = torch.randn(M, up(K, ld_to if "a" in which else 1), device="cuda", dtype=dtype)[:, :K]
    b = torch.randn(K, up(N, ld_to if "b" in which else 1), device="cuda", dtype=dtype)[:, :N]
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", default="auto,persistent_tma,autotuned")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    kernels = args.kernels.split(",")
    rows = []
    for shape in args.shapes:
        M, N, K = (int(x) for x in shape.split("x"))
        variants = {"exact": (M, N, K, 1, "ab"), "ld64": (M, N, K, 64, "ab"), "ldA64": (M, N, K, 64, "a"),
                    "ldB64": (M, N, K, 64, "b"), "round": (up(M, 128), up(N, 128), up(K, 64), 1, "ab")}
        row = dict(shape=shape, variants={})
        for vname, (m, n, k, ld, which) in variants.items():
            torch.manual_seed(0)
            a, b = operands(m, n, k, dtype, ld, which)
            ref = (a.float() @ b.float())
            fns = {"cuBLAS": lambda: torch.matmul(a, b)}
            for kern in kernels:
                fns[kern] = lambda kern=kern: tilegemm.matmul(a, b, kernel=kern)
            ok = {}
            for name, fn in fns.items():
                try:
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # noqa: BLE001 - exploration: record and go on
                    row["variants"][f"{vname}/{name}"] = dict(error=str(e)[:160])
                    continue
                if err < 2e-2:
                    ok[name] = fn
                else:
                    row["variants"][f"{vname}/{name}"] = dict(error=f"rel err {err}")
            for name, timed in timed_against_cublas(ok, args.rounds, rep=50).items():
                row["variants"][f"{vname}/{name}"] = timed
        rows.append(row)
        v = row["variants"]
        cells = "  ".join(f"{k}={x['ratio']:.2f}" for k, x in v.items() if "ratio" in x and not k.endswith("cuBLAS"))
        base = v.get("exact/cuBLAS", {}).get("us", float("nan"))
        print(f"{shape:>18} cuBLAS {base:9.1f} us  {cells}", flush=True)
    write_rows(f"stride-alignment-{args.dtype}.json", args.dtype, rows)


if __name__ == "__main__":
    main()
