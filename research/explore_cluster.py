"""Exploration: does sharing A's tile between two CTAs (TMA multicast in clusters of two, the way cuBLAS's
``..._1x2_...`` kernels run) make the cooperative 16-bit Gluon kernel faster? (``research/cluster_f16.py``.)

First checks (output poisoned with NaN) on odd shapes, NN and NT, fp16 and bf16; then times the cluster
kernel at a few cluster counts against cuBLAS, the same config without clusters (``gluon_f16``), and
``auto``, in rounds (ratios = cuBLAS time / kernel time, medians of do_bench).

    PYTHONPATH=src python research/explore_cluster.py --json out.json [--sizes 1024,2048,4096]
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
from tilegemm.core.hardware import sm_count
from tilegemm.core.launch import launch
from tilegemm.ops.matmul import gluon_f16, persistent_tma
from tilegemm.ops.matmul.problem import make_problems

import cluster_f16
from explore_f16_coop import timed  # rounds of do_bench medians, as there

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CONFIGS = {
    "128x256_s4": dict(BLOCK_M=128, BLOCK_N=256, STAGES=4, SHARED_OUT=True),
    "128x256_s3": dict(BLOCK_M=128, BLOCK_N=256, STAGES=3, SHARED_OUT=False),
    "256x128_s4": dict(BLOCK_M=256, BLOCK_N=128, STAGES=4, SHARED_OUT=True),
    "256x128_s3": dict(BLOCK_M=256, BLOCK_N=128, STAGES=3, SHARED_OUT=False),
    # One tile per SM at 1024^3 (128 tiles, 64 pairs): cuBLAS's tile there, 128x64 with 8 stages in 1x2 clusters.
    "128x64_s8": dict(BLOCK_M=128, BLOCK_N=64, STAGES=8, SHARED_OUT=False),
    "128x128_s6": dict(BLOCK_M=128, BLOCK_N=128, STAGES=6, SHARED_OUT=False),
}


# mc: A shared by multicast, each consumer releases the slot in both CTAs (arrive at CTA scope; mc_cl: at
# cluster scope); nomc: each CTA loads all of A itself, releases in both (the synchronisation alone);
# own: each loads A itself and releases its own slot (the coop kernel launched in clusters); own_gl: the
# same with A through Gluon's TMA (a device-made descriptor, one copy) instead of the inline copies.
MODES = {"mc": dict(mcast=True, remote=True, scope="cta"), "mc_cl": dict(mcast=True, remote=True, scope="cluster"),
         "nomc": dict(mcast=False, remote=True, scope="cta"), "own": dict(mcast=False, remote=False, scope="cta"),
         "own_gl": dict(mcast=False, remote=False, scope="cta", a_gluon=True)}


def b_operand(K, N, transposed, dt):
    return torch.randn(N, K, device="cuda", dtype=dt).T if transposed else torch.randn(K, N, device="cuda", dtype=dt)


def coop(a, b, out, cfg):
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    args = gluon_f16.launch_args(p, dict(cfg, GLUON_F16=True, num_warps=4), sm_count(out.device))
    return lambda: launch(*args)


def check(results, configs):
    bad = 0
    shapes = [(256, 512, 64), (1000, 520, 384), (264, 1032, 408), (17, 1040, 2048), (2048, 1920, 4096), (1024, 1024, 1024)]
    for M, N, K in shapes:
        for dname, dt in DTYPES.items():
            for bt in (False, True):
                a = torch.randn(M, K, device="cuda", dtype=dt)
                b = b_operand(K, N, bt, dt)
                ref = a.double() @ b.double()
                for name, cfg in configs.items():
                    for clusters, mode in ((66, "mc"), (3, "mc"), (66, "nomc"), (5, "own"), (66, "mc_cl"), (66, "own_gl")):
                        out = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
                        t0 = time.time()
                        fn, _ = cluster_f16.prepare(a, b, out, cfg, clusters, **MODES[mode])
                        fn()
                        torch.cuda.synchronize()
                        err = ((out.double() - ref).norm() / ref.norm()).item()
                        ok = err < 1e-2 and not out.isnan().any().item()
                        bad += not ok
                        results.append(dict(check=True, shape=[M, N, K], dtype=dname, layout="NT" if bt else "NN",
                                            variant=name, clusters=clusters, mode=mode, rel_err=err, ok=ok))
                        if not ok:
                            print("  WRONG", results[-1], flush=True)
        print(f"  checked {M}x{N}x{K} ({time.time() - t0:.1f}s last)", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--layouts", default="NN")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--clusters", default="66,64")
    ap.add_argument("--modes", default="mc")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    persistent_tma.ensure_allocator()
    results = []
    if not args.no_check:
        bad = check(results, configs)
        print(f"checks: {len(results)} run, {bad} wrong", flush=True)
        if bad:
            sys.exit(1)
    for dname in args.dtypes.split(","):
        dt = DTYPES[dname]
        for layout in args.layouts.split(","):
            for s in (int(x) for x in args.sizes.split(",")):
                M = N = K = s
                a = torch.randn(M, K, device="cuda", dtype=dt)
                b = b_operand(K, N, layout[1] == "T", dt)
                out = torch.empty(M, N, device="cuda", dtype=dt)
                fns = {"cublas": lambda: torch.matmul(a, b), "auto": lambda: tilegemm.matmul(a, b)}
                for name, cfg in configs.items():
                    fns["coop" + name] = tuning.replaying(lambda c, f=coop(a, b, out, cfg): f(), cfg)
                    for c in (int(x) for x in args.clusters.split(",")):
                        for mode in args.modes.split(","):
                            fns[f"cl{c}_{mode}_{name}"] = cluster_f16.prepare(a, b, out, cfg, c, **MODES[mode])[0]
                ref = torch.matmul(a.float(), b.float())
                errs = {}
                for k, f in fns.items():
                    if k != "cublas" and k != "auto":
                        f(), f()
                        out.fill_(float("nan"))
                    got = f()
                    got = out if got is None else got
                    torch.cuda.synchronize()
                    errs[k] = ((got.float() - ref).norm() / ref.norm()).item()
                ms = timed(fns, rounds=args.rounds)
                base = ms["cublas"]
                for k in fns:
                    results.append(dict(dtype=dname, layout=layout, shape=[M, N, K], variant=k, rel_err=errs[k],
                                        ms=ms[k], ratio=base / ms[k]))
                print(f"{dname} {layout} {s:6d} " + " ".join(f"{k}={base / ms[k]:.3f}" for k in fns)
                      + f"  (cuBLAS {2 * s**3 / base / 1e9:.0f} TFLOPS)", flush=True)
                bad = [k for k in fns if errs[k] > 1e-2 or errs[k] != errs[k]]
                if bad:
                    print("  WRONG", bad, {k: errs[k] for k in bad}, flush=True)
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
