"""Exploration on the GPU: split_k's second-launch reduction (``split_reduce``) per block and planes in flight
(not a test). For a few long-K products whose split reduces apart: the split config ``split_k`` picks untimed,
then the two launches with the reduction's (block, PLANES) forced, checked against torch.matmul, timed as
CUDA-graph replays (GPU time) and with do_bench. Prints a table; writes ``$OUT/split-reduce.json``.

    PYTHONPATH=src:research python3 research/explore_split_reduce.py
"""
import json
import os

import torch
import triton.testing as tt

import tilegemm  # noqa: F401  (the backend choice before triton)
from tilegemm.ops.matmul import split_k, split_reduce
from tilegemm.ops.matmul.problem import make_problems

SHAPES = ((24, 128, 20968), (184, 168, 14400), (64, 64, 100352), (96, 200, 30000), (128, 256, 100352))
VARIANTS = (((16, 32), 4), ((16, 32), 16), ((8, 32), 16), ((8, 32), 32), ((4, 32), 4), ((4, 32), 32), ((16, 64), 8),
            ((32, 64), 4), ((64, 64), 2))
rows = []
orig_block, orig_planes = split_reduce.reduce_block, split_reduce.reduce_planes  # forced per variant below
for M, N, K in SHAPES:
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    ref = a.float() @ b.float()
    cublas = tt.do_bench_cudagraph(lambda: torch.matmul(a, b), rep=30) * 1e3
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    (p,) = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)
    row = dict(shape=f"{M}x{N}x{K}", cublas_us=cublas)
    split_k.run(p)  # the untimed choice, recorded below
    for (bm, bn), planes in VARIANTS:
        split_reduce.reduce_block = lambda *args, bm=bm, bn=bn: (bm, bn)
        split_reduce.reduce_planes = lambda *args, planes=planes: planes
        fn = lambda: split_k.run(p)
        fn()
        err = float((out.float() - ref).norm() / ref.norm())
        row[f"{bm}x{bn}p{planes}"] = dict(graph_us=tt.do_bench_cudagraph(fn, rep=30) * 1e3,
                                          do_bench_us=tt.do_bench(fn, rep=30) * 1e3, rel_err=err)
    split_reduce.reduce_block, split_reduce.reduce_planes = orig_block, orig_planes
    rows.append(row)
    print(row["shape"], f"cuBLAS {cublas:.1f}", " ".join(
        f"{k} {v['graph_us']:.1f}/{v['do_bench_us']:.1f}" + ("" if v["rel_err"] < 1e-2 else "ERR")
        for k, v in row.items() if isinstance(v, dict)), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "split-reduce.json"), "w") as f:
    json.dump(rows, f, indent=1)
