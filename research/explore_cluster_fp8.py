"""Exploration: does sharing B's tile between two CTAs (TMA multicast in clusters of two, as cuBLAS's
promoted-fp8 kernel ``..._128x128_128x6_2x1_..._coopA`` runs) make the warp-specialized promoted-fp8 Gluon
kernel faster? (``research/cluster_fp8.py``.)

First checks (output poisoned with NaN) on odd shapes (odd tile counts in M and N included), e4m3 and e5m2 A,
per-tensor scales, every mode, one pair per cluster and several; then times the cluster kernel against
``torch._scaled_mm`` (promoted), the shipped warp-specialized kernel (its launches replayed, as a repeated
``tilegemm.matmul`` call launches them) and ``auto``, in rounds (ratios = ``_scaled_mm`` time / kernel
time, medians of do_bench).

    PYTHONPATH=src python research/explore_cluster_fp8.py --json out.json [--sizes 2048,4096]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

import tilegemm
from tilegemm.core import tuning
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems

import cluster_fp8
from explore_f16_coop import timed  # rounds of do_bench medians

# mc: B shared by multicast, each consumer releases its slot in both CTAs; nomc: each CTA loads all of B
# and still releases in both (the synchronisation alone); own: each loads all of B and releases its own
# slot (the kernel launched in clusters, nothing shared); _sp: the two arrives from two threads; fwd: the
# consumers release locally and the producers relay it to each other (a "gate" barrier per slot).
MODES = {"mc": dict(mcast=True, remote=True), "nomc": dict(mcast=False, remote=True),
         "mc_sp": dict(mcast=True, remote=True, split=True), "nomc_sp": dict(mcast=False, remote=True, split=True),
         "fwd": dict(mcast=True, remote=False, forward=True), "fwd_nomc": dict(mcast=False, remote=False, forward=True),
         "own": dict(mcast=False, remote=False)}


def ws(a, w, out, sa, sb, stages):
    """The shipped warp-specialized kernel through persistent_tma, its launches replayed."""
    p = make_problems(a, w.T, out, None, None, 1.0, 0.0, "none", "ieee", False, scales=(sa, 0, sb, 0))[0]
    cfg = dict(GLUON_FP8=True, WS=True, STAGES=stages, num_warps=4)
    return tuning.replaying(lambda c: persistent_tma.run(p, cfg), cfg)


def check(results, stages_list):
    bad = 0
    shapes = [(128, 128, 128), (257, 264, 400), (300, 136, 256), (1000, 520, 384), (17, 1040, 2048),
              (2048, 1920, 4096)]
    for M, N, K in shapes:
        t0 = time.time()
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            a = (torch.randn(M, K, device="cuda") * 2).to(dt)
            w = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
            sa = torch.tensor(0.75, device="cuda")
            sb = torch.tensor(1.25, device="cuda")
            ref = (a.double() @ w.double().T) * (0.75 * 1.25)
            for stages in stages_list:
                for clusters, mode in ((66, "mc"), (3, "mc"), (66, "nomc"), (5, "own"), (1, "mc"), (66, "mc_sp"), (3, "nomc_sp"),
                                      (66, "fwd"), (3, "fwd"), (66, "fwd_nomc")):
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    fn, _ = cluster_fp8.prepare(a, w.T, out, stages, clusters, scale_a=sa, scale_b=sb, **MODES[mode])
                    fn()
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    ok = err < 1e-2 and not out.isnan().any().item()
                    bad += not ok
                    results.append(dict(check=True, shape=[M, N, K], a_dtype=str(dt), stages=stages,
                                        clusters=clusters, mode=mode, rel_err=err, ok=ok))
                    if not ok:
                        print("  WRONG", results[-1], flush=True)
        print(f"  checked {M}x{N}x{K} ({time.time() - t0:.1f}s)", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="2048,4096,8192,16384")
    ap.add_argument("--stages", default="6,5")
    ap.add_argument("--clusters", default="66")
    ap.add_argument("--modes", default="mc,own")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    stages_list = [int(x) for x in args.stages.split(",")]
    persistent_tma.ensure_allocator()
    results = []
    if not args.no_check:
        bad = check(results, stages_list)
        print(f"checks: {len(results)} run, {bad} wrong", flush=True)
        if bad:
            sys.exit(1)
    table = []
    for s in (int(x) for x in args.sizes.split(",")):
        M = N = K = s
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.tensor(0.75, device="cuda")
        sb = torch.tensor(1.25, device="cuda")
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {"scaled_mm": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16),
               "auto": lambda: tilegemm.matmul(a, w.T, scale_a=sa, scale_b=sb)}
        keep = []
        for st in stages_list:
            fns[f"ws_s{st}"] = ws(a, w, out, sa, sb, st)
            for c in (int(x) for x in args.clusters.split(",")):
                for mode in args.modes.split(","):
                    fn, desc = cluster_fp8.prepare(a, w.T, out, st, c, scale_a=sa, scale_b=sb, **MODES[mode])
                    keep.append(desc)
                    fns[f"cl{c}_{mode}_s{st}"] = fn
        ref = (a.float() @ w.float().T) * (0.75 * 1.25)
        errs = {}
        for k, f in fns.items():
            if k not in ("scaled_mm", "auto"):
                f(), f()
                out.fill_(float("nan"))
            got = f()
            got = out if got is None else got
            torch.cuda.synchronize()
            errs[k] = ((got.float() - ref).norm() / ref.norm()).item()
        ms = timed(fns, rounds=args.rounds)
        base = ms["scaled_mm"]
        for k in fns:
            row = dict(shape=[M, N, K], variant=k, rel_err=errs[k], ms=ms[k], ratio=base / ms[k],
                       tflops=2 * M * N * K / ms[k] / 1e9)
            results.append(row)
            table.append(row)
        print(f"{s:6d} " + " ".join(f"{k}={base / ms[k]:.3f}" for k in fns)
              + f"  (_scaled_mm {2 * s**3 / base / 1e9:.0f} TFLOPS)", flush=True)
        wrong = [k for k in fns if not errs[k] < 1e-2]
        if wrong:
            print("  WRONG", {k: errs[k] for k in wrong}, flush=True)
    names = list(dict.fromkeys(r["variant"] for r in table))
    print("\nsize   " + " ".join(f"{k:>12s}" for k in names))
    for s in dict.fromkeys(r["shape"][0] for r in table):
        print(f"{s:6d} " + " ".join(f"{r['ratio']:12.3f}" for r in table if r["shape"][0] == s))
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
