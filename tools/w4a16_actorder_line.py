"""Act-order against the natural order through the shipped route, at each M on the GPU.

    PYTHONPATH=src python3 tools/w4a16_actorder_line.py [--shapes 5120x5120,4096x11008] [--ms 1,3,16,64,128,512] \\
        [--group 128] [--dtype fp16] [--out $OUT/actorder.json]

For each weight (N x K, group ``--group``) and M, the same stored weight two ways through ``w4a16.matmul``
(``auto``): in natural order (no perm) and act-order (a random perm: x's inputs reordered by the Triton gather,
``ops/w4a16/reorder.py``, then the natural order's kernel; docs/w4a16.md, "Act-order"). Each is checked before it is
timed: act-order bit for bit against the natural order on ``x[:, perm]``, both against ``x @ dequantize(w).T``.
Times (us): ``api`` the call as a caller makes it (the replay fast path, both of act-order's launches replayed;
``triton.testing.do_bench`` median, L2 cleared before each call), ``loop`` the same call 200 times back to back
(wall time a call: the host's cost shows where it exceeds the GPU's), ``graph`` the call's kernels replayed from a
CUDA graph captured right after one eager call (GPU time, do_bench); ``reorder`` the gather alone as a graph.
Printed last: a table of act-order's speed over the natural order's (1.0 = as fast; the target is 0.85 or more)
and the kernels each act-order call launched. One H200: under 3 minutes.
"""

from __future__ import annotations

import argparse
import json

import torch

from tilegemm import w4a16
from tilegemm.core.launch import recording
from tilegemm.ops.w4a16 import op
from tilegemm.ops.w4a16.reference import reference, tolerance
from tilegemm.ops.w4a16.reorder import reorder_columns

MS = [1, 3, 16, 64, 128, 512]


def _graph(fn):
    """fn's kernels as a CUDA graph captured right after one eager call (as a caller would), replayed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=30) * 1e3


def _loop(fn, n: int = 200) -> float:
    """Wall time a call of ``n`` calls back to back (after a warm-up), in us."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _route(fn) -> list:
    """The kernels a call launches when nothing is replayed (the replay caches emptied first and after)."""
    for cache in (op.REORDERS, op.REPLAYS, op.DEQUANTS):
        cache.clear()
    with recording() as rec:
        fn()
    for cache in (op.REORDERS, op.REPLAYS, op.DEQUANTS):
        cache.clear()
    return [one.compiled.name for one in rec.launches or ()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="5120x5120,4096x11008", help="N x K, comma-separated")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=None, help="JSON of every time")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.lower().split("x"))
        torch.manual_seed(0)
        natural = w4a16.quantize(torch.randn(N, K, dtype=dtype, device="cuda"), args.group)
        act = w4a16.Int4Weight(natural.qweight, natural.scales, natural.zeros, args.group, natural.shape,
                               torch.randperm(K, device="cuda"))
        natural.fragments(), act.fragments()
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, dtype=dtype, device="cuda")
            xp = x[:, act.perm].contiguous()
            ref = reference(x, act)
            for name, out in (("natural", w4a16.matmul(xp, natural)), ("act-order", w4a16.matmul(x, act))):
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err <= tolerance(dtype):
                    raise AssertionError(f"{name} M={M} {N}x{K}: relative error {err:.2e}")
            if not torch.equal(w4a16.matmul(x, act), w4a16.matmul(xp, natural)):
                raise AssertionError(f"act-order M={M} {N}x{K}: not the natural order's bits on x[:, perm]")
            row = dict(N=N, K=K, M=M, group=args.group, dtype=args.dtype, route=_route(lambda: w4a16.matmul(x, act)),
                       natural_route=_route(lambda: w4a16.matmul(xp, natural)))
            for name, fn in (("natural", lambda: w4a16.matmul(xp, natural)), ("act", lambda: w4a16.matmul(x, act))):
                fn()  # recorded: the api times are replays
                row[name] = dict(api=_bench(fn), loop=_loop(fn), graph=_bench(_graph(fn)))
            row["reorder_graph"] = _bench(_graph(lambda: reorder_columns(x, act.perm)))
            row["speed"] = {mode: row["natural"][mode] / row["act"][mode] for mode in ("api", "loop", "graph")}
            rows.append(row)
            print(f"{N} x {K} M={M}: natural {row['natural']['api']:.1f} / {row['natural']['loop']:.1f} / "
                  f"{row['natural']['graph']:.1f} us, act-order {row['act']['api']:.1f} / {row['act']['loop']:.1f} / "
                  f"{row['act']['graph']:.1f} us (api / loop / graph), "
                  f"reorder alone {row['reorder_graph']:.2f} us; route {' -> '.join(row['route'])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)
    print(f"\n{'N x K':>12} {'M':>4} | {'api nat':>7} {'act':>7} {'speed':>5} | {'loop nat':>8} {'act':>7} "
          f"{'speed':>5} | {'graph nat':>9} {'act':>7} {'speed':>5} | {'reord':>5}  route of act-order "
          f"(us; target: speed >= 0.85)")
    for r in rows:
        nat, ao, sp = r["natural"], r["act"], r["speed"]
        flag = "" if min(sp.values()) >= 0.85 else "  <-- below 0.85"
        print(f"{r['N']:>5} x {r['K']:<5} {r['M']:>4} | {nat['api']:>7.1f} {ao['api']:>7.1f} {sp['api']:>5.2f} | "
              f"{nat['loop']:>8.1f} {ao['loop']:>7.1f} {sp['loop']:>5.2f} | {nat['graph']:>9.1f} {ao['graph']:>7.1f} "
              f"{sp['graph']:>5.2f} | {r['reorder_graph']:>5.2f}  {'+'.join(r['route'])}{flag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
