"""Exploration: promoted fp8 with a producer warp group (warp specialization) against the one-partition kernel.

``tilegemm.ops.matmul.gluon_fp8`` has two kernels for promoted fp8 e4m3/e5m2 (A row-major, B column-major):
the one-partition kernel, whose eight warps issue the TMA loads between their MMAs (each load is fenced by
CTA-wide ``bar.sync``s, which keep the two warp groups in step), and ``matmul_fp8_ws_kernel``, where a
producer warp group loads and the two consumer warp groups (64 rows of the tile each) only wait on
mbarriers, so one can add its partial tile while the other's MMAs run.

First every config of both kernels is checked (output poisoned with NaN) on odd shapes and with the full
epilogue; then both are timed against ``torch._scaled_mm`` (promoted, and with fast accumulation) in rounds.
Ratios are ``_scaled_mm`` time / kernel time (medians of do_bench). Rows ending in ``_r`` time the same
launches replayed (``tilegemm.core.tuning.replaying``: a few microseconds of host time a launch, as the tuner
and a repeated ``tilegemm.matmul`` call launch them); the others go through ``persistent_tma.run`` and
Triton's launch path each time, which is host-bound below about 4096^3.

    PYTHONPATH=src python research/explore_fp8_ws.py --json out.json [--sizes 2048,4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

import tilegemm
from tilegemm.core import tuning
from tilegemm.ops.matmul import gluon_fp8, persistent_tma
from tilegemm.ops.matmul.problem import make_problems

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from profile_counters import parse_knobs  # noqa: E402


KNOBS = {}  # --knobs: extra warp-specialized variants, e.g. {"p1": {"PRODUCER_WARPS": 1}, "g16": {"GROUP_M": 16}}
STAGES = set()  # --stages: only these ring depths (empty: all)


def variants(out_element_size: int) -> dict[str, dict]:
    found = {f"{'ws' if c.get('WS') else 'pers'}_s{c['STAGES']}": c for c in gluon_fp8.configs(out_element_size)
             if not STAGES or c["STAGES"] in STAGES}
    if KNOBS:  # only the warp-specialized kernel, plain and with each knob
        found = {k: c for k, c in found.items() if c.get("WS")}
        for k, c in list(found.items()):
            for tag, knob in KNOBS.items():
                found[f"{k}_{tag}"] = dict(c, **knob)
    return found


def call(a, w, out, sa, sb, cfg, c=None, bias=None, alpha=1.0, beta=0.0, act="none"):
    """``out = act(alpha * sa * sb * (a @ w.T) + beta * c + bias)`` through persistent_tma with config ``cfg``."""
    ka = 1 if sa.dim() else 0
    kb = 1 if sb.dim() else 0
    p = make_problems(a, w.T, out, c, bias, alpha, beta, act, "ieee", False, scales=(sa, ka, sb, kb))[0]
    assert persistent_tma.describable(p) is None and gluon_fp8.usable(p) is None
    return lambda: persistent_tma.run(p, cfg)


def check(results):
    """Every config on edge-tile shapes, row/column scales, and the full epilogue in three output dtypes."""
    bad = 0
    shapes = [(128, 128, 128), (257, 264, 400), (300, 136, 256), (1000, 520, 384), (17, 1040, 2048),
              (2048, 1920, 4096)]
    for M, N, K in shapes:
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            a = (torch.randn(M, K, device="cuda") * 2).to(dt)
            w = (torch.randn(N, K, device="cuda") * 2).to(dt)
            sa = torch.rand(M, device="cuda") + 0.5
            sb = torch.tensor(0.75, device="cuda")
            ref = (a.double() @ w.double().T) * sa.double()[:, None] * 0.75
            for name, cfg in variants(2).items():
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                call(a, w, out, sa, sb, cfg)()
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ok = err < 1e-2 and not out.isnan().any().item()
                bad += not ok
                results.append(dict(check="plain", shape=[M, N, K], dtype=str(dt), variant=name, rel_err=err, ok=ok))
    M, N, K = 200, 152, 640
    a = torch.randn(M, K, device="cuda").to(torch.float8_e5m2)
    w = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.rand(M, device="cuda") + 0.5, torch.rand(N, device="cuda") + 0.5
    c = torch.randn(M, N, device="cuda")
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    lin = 0.5 * (a.double() @ w.double().T) * sa.double()[:, None] * sb.double()[None, :] - c.double() + bias.double()
    ref = torch.nn.functional.gelu(lin)
    for od in (torch.float16, torch.bfloat16, torch.float32):
        for name, cfg in variants(torch.empty((), dtype=od).element_size()).items():
            out = torch.full((M, N), float("nan"), device="cuda", dtype=od)
            call(a, w, out, sa, sb, cfg, c=c, bias=bias, alpha=0.5, beta=-1.0, act="gelu")()
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ok = err < 1e-2 and not out.isnan().any().item()
            bad += not ok
            results.append(dict(check="epilogue", out=str(od), variant=name, rel_err=err, ok=ok))
    return bad


def timed(fns: dict, rounds=3, rep=100):
    runs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            runs[k].append(triton.testing.do_bench(f, warmup=25, rep=rep))
    return {k: statistics.median(v) for k, v in runs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--knobs", default="", help='e.g. p1:PRODUCER_WARPS=1,g16:GROUP_M=16,p1g16:PRODUCER_WARPS=1+GROUP_M=16')
    ap.add_argument("--stages", default="", help="only these ring depths, e.g. 5")
    ap.add_argument("--no-plain", action="store_true", help="time the Gluon configs only as replays")
    args = ap.parse_args()
    KNOBS.update(parse_knobs(args.knobs))
    STAGES.update(int(x) for x in filter(None, args.stages.split(",")))
    persistent_tma.ensure_allocator()
    results = []
    if not args.no_check:
        bad = check(results)
        print(f"checks: {sum(1 for r in results if 'check' in r)} run, {bad} wrong", flush=True)
        for r in results:
            if not r["ok"]:
                print("  WRONG", r, flush=True)
    table = []
    for s in (int(x) for x in args.sizes.split(",")):
        M = N = K = s
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.tensor(0.75, device="cuda")
        sb = torch.tensor(1.25, device="cuda")
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {
            "scaled_mm": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16),
            "scaled_mm_fast": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16,
                                                       use_fast_accum=True),
            "auto": lambda: tilegemm.matmul(a, w.T, scale_a=sa, scale_b=sb),
        }
        if args.no_plain:
            fns.pop("scaled_mm_fast")
        for name, cfg in variants(2).items():
            fns[name] = call(a, w, out, sa, sb, cfg)
            # The same launches replayed, as the tuner times them and as a repeated call makes them.
            fns[name + "_r"] = tuning.replaying(lambda c, f=fns[name]: f(), cfg)
        ref = (a.float() @ w.float().T) * (0.75 * 1.25)
        errs = {}
        for k, f in fns.items():
            if k.endswith("_r"):  # launch, record, then (output poisoned) replay
                f(), f()
                out.fill_(float("nan"))
            got = f()
            got = out if got is None else got
            torch.cuda.synchronize()
            errs[k] = ((got.float() - ref).norm() / ref.norm()).item()
        if args.no_plain:
            fns = {k: f for k, f in fns.items() if not (k.startswith(("pers_s", "ws_s")) and not k.endswith("_r"))}
        ms = timed(fns, rounds=args.rounds)
        base = ms["scaled_mm"]
        for k in fns:
            row = dict(shape=[M, N, K], variant=k, rel_err=errs[k], ms=ms[k], ratio=base / ms[k],
                       tflops=2 * M * N * K / ms[k] / 1e9)
            results.append(row)
            table.append(row)
            print(f"{s:6d} {k:15s} {row['ratio']:6.3f} {row['tflops']:8.1f} err={errs[k]:.2e}", flush=True)
    print("\nsize   " + " ".join(f"{k:>9s}" for k in dict.fromkeys(r["variant"] for r in table)))
    for s in dict.fromkeys(r["shape"][0] for r in table):
        print(f"{s:6d} " + " ".join(f"{r['ratio']:9.3f}" for r in table if r["shape"][0] == s))
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
