"""A/B on the GPU (not a test): tilegemm.matmul on long-K products whose split reduces apart, GPU time (CUDA
graph) and do_bench time, and whether calls replay; run once per source tree (``PYTHONPATH``) and compare.

    PYTHONPATH=src python3 research/ab_split_reduce.py --tag new
"""
import argparse
import json
import os

import torch
import triton.testing as tt

import tilegemm

parser = argparse.ArgumentParser()
parser.add_argument("--tag", default="new")
args = parser.parse_args()
SHAPES = ((24, 128, 20968), (184, 168, 14400), (64, 64, 100352), (96, 200, 30000), (128, 256, 100352), (256, 256, 65536))
rows = []
for M, N, K in SHAPES:
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    ref = a.float() @ b.float()
    got = tilegemm.matmul(a, b)
    err = float((got.float() - ref).norm() / ref.norm())
    row = dict(shape=f"{M}x{N}x{K}", rel_err=err)
    for name, fn in (("tilegemm", lambda: tilegemm.matmul(a, b)), ("cublas", lambda: torch.matmul(a, b))):
        row[name] = dict(graph_us=tt.do_bench_cudagraph(fn, rep=30) * 1e3, do_bench_us=tt.do_bench(fn, rep=50) * 1e3)
    rows.append(row)
    print(args.tag, row["shape"], f"err {err:.1e}", " ".join(f"{k} graph {v['graph_us']:.1f} do_bench {v['do_bench_us']:.1f}"
                                               for k, v in row.items() if isinstance(v, dict)), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), f"ab-split-reduce-{args.tag}.json"), "w") as f:
    json.dump(rows, f, indent=1)
