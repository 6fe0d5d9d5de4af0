"""Which patches, channel tiles and ring depths make the TMA implicit-GEMM forward fast, layer by layer?

For each layer of a sweep (fp16, channels-last) this times cuDNN, ``auto`` (what ships), and a grid of configs
of ``tma_implicit_gemm`` (:mod:`tilegemm.ops.conv2d.tma_fwd`): patches of 64 and 128 output pixels (the least
wasteful shapes, ``tma_fwd._patch``), 64 and 128 output channels, 3 to 8 ring slots, all from CUDA graphs
(GPU time alone). Each candidate is checked against cuDNN in fp32 first; a wrong or failing one is recorded,
never ranked.

    PYTHONPATH=src:research python3 research/explore_conv2d_tma.py --out tma.json [--budget 300] [--layers 1,2]
"""

from __future__ import annotations

import argparse
import json
import math
import time


def candidates(g, sms, short=False):
    """The grid of configs; ``short``: ring depths from 2 (a short reduction, e.g. a 1x1 layer over 64
    channels, uses one or two slots, and a shallower ring lets more programs share an SM) and 8 warps on
    128 x 128 tiles."""
    from tilegemm.ops.conv2d.configs import _patch

    bk = 64 if g.Cg % 64 == 0 else 32 if g.Cg % 32 == 0 else 16
    out = []
    for rows in (64, 128):
        bi, bh, bw, _ = _patch(g, rows)
        for bn in (64, 128):
            if bn > 64 and g.Kg <= 64:
                continue
            for stages in ((2, 3, 4) if short else (3, 4, 6, 8)):  # the kernel's ring needs 2 slots at least
                if stages * (rows + bn) * bk * 2 > 200 * 1024:
                    continue
                warps = (4, 8) if short and rows * bn == 128 * 128 else (4,)
                for w in warps:
                    out.append(dict(BI=bi, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=w))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; layers past it are skipped")
    parser.add_argument("--layers", default=None, help="indices of the sweep's layers, e.g. 2,6,10")
    parser.add_argument("--short", action="store_true",
                        help="shallow rings and 8 warps (short reductions); gemm_1x1 timed on 1x1 layers")
    args = parser.parse_args()

    import tilegemm  # noqa: F401  (settles the backend first)
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d import tma_fwd
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    sms = sm_count(torch.device("cuda"))
    t0 = time.time()
    rows = []
    cases = list(bench_op("conv2d").cases(args.sweep))
    if args.layers:
        cases = [cases[int(i)] for i in args.layers.split(",")]
    for case in cases:
        if time.time() - t0 > args.budget:
            print("budget spent", flush=True)
            break
        d = case.dims
        s, pad = [d["stride"]] * 2, d["pad"]
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"] // d["groups"], d["R"], d["S"]), s,
                        [pad] * 4, [1, 1], d["groups"])
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"] // d["groups"], d["R"], d["S"], device="cuda") * 0.05).half()
        w = w.contiguous(memory_format=cl)
        if tma_fwd.unusable(x, w, g):
            continue
        ref = F.conv2d(x.float(), w.float(), None, s, pad, 1, d["groups"])
        p = ConvProblem(x, w, None, g, torch.float16, cl, "none", "ieee", False)
        row = dict(shape=case.label, cudnn_us=tt.do_bench_cudagraph(lambda: F.conv2d(x, w, None, s, pad, 1, d["groups"]), rep=30) * 1e3,
                   auto_us=tt.do_bench_cudagraph(lambda: tilegemm.conv2d(x, w, None, s, pad), rep=30) * 1e3,
                   shipped=tma_fwd.config(g, torch.float16, sms), candidates=[])
        if args.short and g.is_pointwise:
            row["gemm_1x1_us"] = tt.do_bench_cudagraph(
                lambda: tilegemm.conv2d(x, w, None, s, pad, kernel="gemm_1x1"), rep=30) * 1e3
        for cfg in [dict(row["shipped"]), *candidates(g, sms, args.short)]:
            entry = dict(cfg=cfg)
            try:
                out = tma_fwd.run(p, cfg)
                err = float((out.float() - ref).norm() / ref.norm())
                entry["err"] = err
                if err <= 4e-3:
                    entry["us"] = tt.do_bench_cudagraph(lambda: tma_fwd.run(p, cfg), rep=25) * 1e3
            except Exception as exc:  # noqa: BLE001 - a config that fails is a result too
                entry["error"] = str(exc)[:200]
            row["candidates"].append(entry)
        timed = [c for c in row["candidates"] if "us" in c]
        row["shipped_us"] = row["candidates"][0].get("us")
        if timed:
            best = min(timed, key=lambda c: c["us"])
            row["best"] = best
            print(f"{case.label:28s} cuDNN {row['cudnn_us']:6.1f} auto {row['auto_us']:6.1f} "
                  f"gemm_1x1 {row.get('gemm_1x1_us', float('nan')):6.1f} shipped "
                  f"{row['shipped_us'] or float('nan'):6.1f} best {best['us']:6.1f} {best['cfg']}", flush=True)
        rows.append(row)
        with open(args.out, "w") as fh:
            json.dump(dict(sweep=args.sweep, rows=rows), fh, indent=1)

    def geo(vals):
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")

    print(f"\ncuDNN / auto {geo([r['cudnn_us'] / r['auto_us'] for r in rows]):.2f}, cuDNN / shipped tma "
          f"{geo([r['cudnn_us'] / r['shipped_us'] for r in rows if r.get('shipped_us')]):.2f}, cuDNN / best tma "
          f"{geo([r['cudnn_us'] / r['best']['us'] for r in rows if r.get('best')]):.2f} over {len(rows)} layers")


if __name__ == "__main__":
    main()
