"""Where act-order weights should stop gathering x in frag_wgmma: times each M both ways on the GPU.

    PYTHONPATH=src python3 tools/w4a16_actorder_line.py [--shapes 5120x5120,11008x4096] [--group 128] \\
        [--dtype fp16] [--out actorder.json]

For each (N, K) and M, the same weight three ways through ``w4a16.matmul`` (``auto``): in natural order (group
``--group``, no perm), act-order with x read through perm by frag_wgmma (``gather``: ``dispatch.GATHER_MAX_M``
and ``GATHER_MAX_X`` set above every call), and act-order with x reordered by ``index_select`` first
(``reorder``: both set to 0).
Each is checked against ``x @ dequantize(w).T`` before it is timed. Times (us, ``triton.testing.do_bench``
medians, L2 cleared before each call): ``api`` the call as a caller makes it (its replay fast path included) and
``graph`` the call's kernels replayed from a CUDA graph (GPU time, the launch gap between index_select and the
kernel included). Printed: x's size, each act-order way's speed over natural order's (1.0 = as fast; the target is
0.85 or more), which way wins, and where the shipped rule (``dispatch.gathers``) picks the other.
"""

from __future__ import annotations

import argparse
import json

import torch

from tilegemm import w4a16
from tilegemm.ops.w4a16 import dispatch
from tilegemm.ops.w4a16.reference import reference, tolerance

MS = [1, 2, 3, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256]


def _graph(fn):
    fn()  # compiled, fragments made, workspaces allocated: outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _times(fn) -> dict:
    import triton.testing

    return dict(api=triton.testing.do_bench(fn, rep=40) * 1e3,
                graph=triton.testing.do_bench(_graph(fn), rep=40) * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="5120x5120,11008x4096,4096x11008", help="N x K, comma-separated")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=None, help="JSON of every time")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    shipped = dispatch.GATHER_MAX_M, dispatch.GATHER_MAX_X
    rows = []
    print(f"{'N x K':>12} {'M':>5} {'x KB':>6} {'natural':>9} {'gather':>9} {'reorder':>9}   speed over natural "
          f"(api / graph)  [shipped: gather up to {shipped[0]} rows and {shipped[1]} elements of x]")
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.lower().split("x"))
        torch.manual_seed(0)
        natural = w4a16.quantize(torch.randn(N, K, dtype=dtype, device="cuda"), args.group)
        act = w4a16.Int4Weight(natural.qweight, natural.scales, natural.zeros, args.group, natural.shape,
                               torch.randperm(K, device="cuda"))
        natural.fragments(), act.fragments()
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, dtype=dtype, device="cuda")
            row = dict(N=N, K=K, M=M, group=args.group, dtype=args.dtype,
                       shipped_gathers=dispatch.gathers("auto", x, act))
            ways = (("natural", natural, shipped), ("gather", act, (1 << 30,) * 2), ("reorder", act, (0, 0)))
            for name, w, line in ways:
                dispatch.GATHER_MAX_M, dispatch.GATHER_MAX_X = line
                try:
                    out = w4a16.matmul(x, w)
                    err = ((out.double() - reference(x, w)).norm() / reference(x, w).norm()).item()
                    if not err <= tolerance(dtype):
                        raise AssertionError(f"{name} M={M} {N}x{K}: relative error {err:.2e}")
                    row[name] = _times(lambda: w4a16.matmul(x, w))
                finally:
                    dispatch.GATHER_MAX_M, dispatch.GATHER_MAX_X = shipped
            rows.append(row)
            nat = row["natural"]
            speed = {k: (nat["api"] / row[k]["api"], nat["graph"] / row[k]["graph"]) for k in ("gather", "reorder")}
            best = "gather" if row["gather"]["graph"] <= row["reorder"]["graph"] else "reorder"
            print(f"{N:>5} x {K:<5} {M:>5} {M * K * x.element_size() / 1024:>6.0f} {nat['graph']:>8.1f}u "
                  f"{row['gather']['graph']:>8.1f}u "
                  f"{row['reorder']['graph']:>8.1f}u   gather {speed['gather'][0]:.2f} / {speed['gather'][1]:.2f}"
                  f"  reorder {speed['reorder'][0]:.2f} / {speed['reorder'][1]:.2f}  -> {best}"
                  f"{'' if row['shipped_gathers'] == (best == 'gather') else '  (the shipped rule picks the other)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gather_max_m=shipped[0], gather_max_x=shipped[1], rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
