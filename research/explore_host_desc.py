"""Exploration: 16-bit GEMMs with TMA descriptors made on the host, against cuBLAS and the shipped rungs.

``persistent_tma``'s Triton kernel makes its three TMA descriptors in every program, and the cooperative
Gluon kernel (``gluon_f16``) used to make them in every partition; for the fp8 kernel that cost about
2 us a launch (``research/diagnose_fp8_overhead.py``). Here every Triton config runs both ways
(``HOST_DESC``) and the Gluon configs (now host descriptors only, plus the small 128x128 and 128x64
tiles) beside them, all launched as replays (``tuning.replaying``, as the tuner and a repeated call
launch them). Each variant is checked first on the timed shape (a replay into a NaN-poisoned output,
against cuBLAS in fp32), then timed in rounds alternating with ``torch.matmul``; ratios are cuBLAS time /
variant time (medians of do_bench, which clears L2 before each call).

    PYTHONPATH=src python research/explore_host_desc.py --json out.json [--sizes 1024,2048] [--dtypes fp16]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import tilegemm
from tilegemm.core import tuning
from tilegemm.ops.matmul import gluon_f16, persistent_tma
from tilegemm.ops.matmul.problem import make_problems

from explore_f16_coop import timed  # rounds of do_bench medians

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Beyond the rung's own configs: deeper rings for the one-tile-per-SM shapes (1024^3: 128 tiles of 128x64).
EXTRA = [(128, 64, 64, 4, 6), (64, 128, 64, 4, 6), (128, 64, 64, 4, 8), (128, 128, 64, 8, 5)]


def variants(size: int) -> dict[str, dict]:
    out = {}
    triton_cfgs = persistent_tma.hopper_configs(2, "ab") + [persistent_tma.make_config(*e) for e in EXTRA]
    for cfg in triton_cfgs:
        tiles = triton.cdiv(size, cfg["BLOCK_M"]) * triton.cdiv(size, cfg["BLOCK_N"])
        if tiles < 64 or (size >= 4096 and cfg["BLOCK_M"] * cfg["BLOCK_N"] < 128 * 128):
            continue  # too few tiles to fill the GPU, or small tiles on large shapes
        name = (f"tma{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}_w{cfg['num_warps']}_s{cfg['num_stages']}"
                + ("" if cfg["FLATTEN"] else "_nf"))
        out[name + "_dev"] = cfg
        out[name + "_host"] = dict(cfg, HOST_DESC=True)
    for cfg in gluon_f16.configs():
        tiles = triton.cdiv(size, cfg["BLOCK_M"]) * triton.cdiv(size, cfg["BLOCK_N"])
        if tiles < 64 or (size >= 4096 and cfg["BLOCK_M"] * cfg["BLOCK_N"] < 128 * 256):
            continue
        out[f"coop{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_s{cfg['STAGES']}" + ("_so" if cfg["SHARED_OUT"] else "")] = cfg
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=50)
    args = ap.parse_args()
    persistent_tma.ensure_allocator()
    results, wrong = [], 0
    for dname in args.dtypes.split(","):
        dt = DTYPES[dname]
        for s in (int(x) for x in args.sizes.split(",")):
            a = torch.randn(s, s, device="cuda", dtype=dt)
            b = torch.randn(s, s, device="cuda", dtype=dt)
            out = torch.empty(s, s, device="cuda", dtype=dt)
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
            ref = torch.matmul(a.float(), b.float())
            fns = {"cublas": lambda: torch.matmul(a, b),
                   "auto": lambda: tilegemm.matmul(a, b),
                   "autotuned": lambda: tilegemm.matmul(a, b, kernel="autotuned")}
            for name, cfg in variants(s).items():
                fns[name] = tuning.replaying(lambda c: persistent_tma.launch_config(p, c), cfg)
            errs = {}
            for k, f in fns.items():
                if k not in ("cublas", "auto", "autotuned"):
                    f(), f()  # launch, then record
                    out.fill_(float("nan"))
                    f()  # a replay
                    got = out
                else:
                    got = f()
                torch.cuda.synchronize()
                errs[k] = ((got.float() - ref).norm() / ref.norm()).item()
                if not errs[k] < 1e-2:  # NaN fails too
                    wrong += 1
                    print(f"  WRONG {dname} {s} {k}: rel err {errs[k]}", flush=True)
            ms = timed(fns, rounds=args.rounds, rep=args.rep)
            base = ms["cublas"]
            rows = []
            for k in fns:
                row = dict(dtype=dname, shape=[s, s, s], variant=k, rel_err=errs[k], ms=ms[k], ratio=base / ms[k],
                           tflops=2 * s**3 / ms[k] / 1e9)
                results.append(row)
                rows.append(row)
            rows.sort(key=lambda r: -r["ratio"])
            print(f"{dname} {s}: cuBLAS {base * 1e3:.1f} us; " + " ".join(f"{r['variant']}={r['ratio']:.3f}"
                                                                     for r in rows[:12]), flush=True)
            pairs = [(k[:-5], base / ms[k[:-5] + "_dev"], base / ms[k]) for k in fns if k.endswith("_host")]
            print("   host vs device: " + " ".join(f"{n}:{d:.3f}->{h:.3f}" for n, d, h in pairs), flush=True)
    print(f"wrong: {wrong}")
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, wrong=wrong, results=results), f, indent=1)


if __name__ == "__main__":
    main()
