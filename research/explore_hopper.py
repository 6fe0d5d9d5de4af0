"""Exploration on the GPU: which new knobs of the GEMM rungs pay, per dtype and shape (not a test, not the bench).

Knobs: ``EVEN_K`` (the K loop of the pointer rungs without masks; measured at no gain on 2026-11-21 and
removed from the kernels, so now skipped), ``WARP_SPECIALIZE`` of ``persistent_tma``
(1: Triton's warp specialization on the K loop, 2: on the tile loop) and, for fp8, ``FAST_ACCUM`` (no
fp32 promotion every K step, like ``torch._scaled_mm(use_fast_accum=True)``).

Every variant is checked against the baseline's output before it is timed. Timing: do_bench medians in
rounds that alternate the baseline and the variants. Writes ``$OUT/explore-hopper.json``; prints a table.

    PYTHONPATH=src python3 research/explore_hopper.py [--quick] [--only fp16,tf32,fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.testing

from tilegemm.core.hardware import machine_info
from tilegemm.core.launch import launch
from tilegemm.ops.matmul import persistent_tma as pt
from tilegemm.ops.matmul.grouped import grid, matmul_grouped_kernel
from tilegemm.ops.matmul.problem import make_problems

BUDGET_S = float(os.environ.get("EXPLORE_BUDGET_S", "420"))
T0 = time.time()


def median_ms(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def persistent_variants(dtype_bytes, fp8):
    base = pt.configs(dtype_bytes)
    out = [("pt", dict(c), False) for c in base]
    if dtype_bytes == 2:
        extra = [pt.make_config(128, 256, 64, 8, 3, flatten=False, ws=1), pt.make_config(128, 256, 64, 8, 3, flatten=False, ws=2),
                 pt.make_config(128, 128, 64, 8, 4, flatten=False, ws=1), pt.make_config(128, 128, 64, 4, 4, flatten=False, ws=1),
                 pt.make_config(128, 256, 64, 8, 4), pt.make_config(256, 128, 64, 8, 4), pt.make_config(128, 128, 64, 4, 5),
                 pt.make_config(64, 256, 64, 4, 4)]
    elif fp8:
        extra = [pt.make_config(128, 256, 128, 8, 3, flatten=False, ws=1), pt.make_config(128, 256, 128, 8, 3, flatten=False, ws=2),
                 pt.make_config(128, 256, 128, 8, 4), pt.make_config(256, 128, 128, 8, 4)]
    else:
        extra = [pt.make_config(128, 128, 32, 8, 3, flatten=False, ws=1), pt.make_config(128, 256, 32, 8, 3, flatten=False, ws=1),
                 pt.make_config(128, 128, 32, 4, 5), pt.make_config(128, 256, 32, 8, 4)]
    if os.environ.get("EXPLORE_NO_WS"):
        extra = [c for c in extra if not c["WARP_SPECIALIZE"]]
    out += [("pt", c, False) for c in extra]
    if fp8:
        out += [("pt", dict(c), True) for c in base + extra]
    return out


def pointer_variants(dtype_bytes):
    if dtype_bytes == 2:
        cfgs = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
                (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)]
    elif dtype_bytes == 1:
        cfgs = [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (64, 128, 128, 4, 4)]
    else:
        cfgs = [(128, 128, 32, 8, 3), (128, 128, 32, 4, 4), (128, 256, 32, 8, 3), (64, 128, 32, 4, 4)]
    # (The first runs also tried each with EVEN_K; that knob is gone from the kernels: no gain measured.)
    return [("ptr", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s), False)
            for bm, bn, bk, w, s in cfgs]


def small_variants():
    """Pointer-kernel configs for problems with fewer 128x128 tiles than SMs (1024^3: 64 tiles)."""
    out = []
    for bm, bn in ((64, 64), (64, 128), (128, 64), (128, 128), (32, 128), (64, 256)):
        for bk in (32, 64, 128):
            for w in (4, 8):
                for s in (3, 4, 5):
                    if (bm + bn) * bk * 2 * (s - 1) > 200 * 1024 or (bm * bn < 128 * 128 and w == 8):
                        continue
                    out.append(("ptr", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w,
                                            num_stages=s), False))
    return out


def make_case(kind, m, n, k, layout):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    if kind == "fp8":
        a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
        bt = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
        b = bt.t()
        sa = torch.tensor(0.75, device="cuda")
        sb = torch.tensor(1.25, device="cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        base = {
            "scaled_mm": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
            "scaled_mm_fast": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
        }
        p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False, (sa, 0, sb, 0))[0]
        ref = (a.float() @ b.float()) * 0.75 * 1.25
        return p, out, base, ref, 1
    dtype = torch.float16 if kind == "fp16" else torch.bfloat16 if kind == "bf16" else torch.float32
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=dtype, generator=g)
    if layout[0] == "T":
        a = a.t().contiguous().t()
    if layout[1] == "T":
        b = b.t().contiguous().t()
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    prec = "tf32" if kind == "tf32" else "ieee"
    p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", prec, False)[0]

    def cublas():
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        return torch.matmul(a, b)

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = a.float() @ b.float() if kind != "tf32" else a.double() @ b.double()
    return p, out, {"cublas": cublas}, ref, a.element_size()


def runner(family, p, cfg, flag):
    if family == "pt":
        pt.ensure_allocator()
        q = dataclasses.replace(p, fast_accum=flag)
        return lambda: pt._launch(q, cfg)
    flags = {**p.kernel_flags(), **cfg}
    return lambda: launch(matmul_grouped_kernel, grid(p), p.kernel_args(), flags)


def label(family, cfg, flag):
    s = f"{family}:{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}"
    if family == "pt":
        s += ("f" if cfg.get("FLATTEN") else "") + (f"ws{cfg['WARP_SPECIALIZE']}" if cfg.get("WARP_SPECIALIZE") else "")
        s += "+fast" if flag else ""
    else:
        s += "+evenk" if flag else ""
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="fp16,tf32,fp8")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--probe", action="store_true", help="only compile and run one warp-specialized config")
    args = ap.parse_args()
    if args.probe:
        p, out, _, ref, _ = make_case("fp16", 1024, 1024, 1024, "NN")
        runner("pt", p, pt.make_config(128, 128, 64, 8, 4, flatten=False, ws=1), False)()
        torch.cuda.synchronize()
        print("warp-specialized probe ran; max error", (out.float() - ref).abs().max().item())
        return
    kinds = args.only.split(",")
    cases = []
    if "fp16" in kinds:
        sizes = [1024, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384]
        cases += [("fp16", s, s, s, "NN") for s in sizes]
        cases += [("fp16", 128, 4096, 4096, "NN"), ("fp16", 2048, 4096, 14336, "NN"), ("fp16", 2048, 14336, 4096, "NN")]
    if "bf16" in kinds:
        cases += [("bf16", s, s, s, "NN") for s in (1024, 4096, 8192)]
    if "tf32" in kinds:
        cases += [("tf32", s, s, s, "NN") for s in (2048, 4096, 8192)]
    if "fp8" in kinds:
        cases += [("fp8", s, s, s, "NT") for s in (1024, 2048, 4096, 8192)]
    if "small" in kinds:
        cases += [("fp16", 1024, 1024, 1024, "NN", "small"), ("bf16", 1024, 1024, 1024, "NN", "small")]
    cases = [c if len(c) == 6 else (*c, "full") for c in cases]
    results = []
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    summary = []
    for kind, m, n, k, layout, vset in cases:
        if time.time() - T0 > BUDGET_S:
            print(f"budget spent; skipping {kind} {m}x{n}x{k}", flush=True)
            continue
        p, out, bases, ref, eb = make_case(kind, m, n, k, layout)
        rep = 30 if m * n * k <= 4096**3 else 100
        if vset == "small":
            variants = small_variants()
        else:
            variants = persistent_variants(eb, kind == "fp8") + pointer_variants(eb)
        # Check and warm every variant (compiles); drop the ones that fail or are wrong.
        live, errors = {}, {}
        for fam, cfg, flag in variants:
            name = label(fam, cfg, flag)
            try:
                fn = runner(fam, p, cfg, flag)
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                tol = 2e-2 if kind in ("tf32", "fp8", "bf16") else 5e-3
                errors[name] = err
                if not err <= tol:
                    results.append(dict(kind=kind, shape=[m, n, k], variant=name, status=f"wrong {err:.3g}"))
                    continue
                live[name] = fn
            except Exception as exc:  # noqa: BLE001
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                results.append(dict(kind=kind, shape=[m, n, k], variant=name, status="error " + msg))
        timings = {name: [] for name in list(bases) + list(live)}
        fns = {**bases, **live}
        names = list(fns)
        for r in range(2):
            for name in (names if r == 0 else names[::-1]):
                timings[name].append(median_ms(fns[name], rep))
        ms = {name: statistics.median(v) for name, v in timings.items()}
        base_name = next(iter(bases))
        flops = 2.0 * m * n * k
        for name, t in ms.items():
            results.append(dict(kind=kind, shape=[m, n, k], layout=layout, variant=name, ms=t, runs=timings[name],
                                tflops=flops / t * 1e-9, ratio=ms[base_name] / t, max_err=errors.get(name)))
        best = {}
        for name, t in ms.items():
            fam = name.split(":")[0] if ":" in name else name
            tag = fam + ("+ws" if "ws" in name.split(":")[-1] else "") + ("+fast" if "+fast" in name else "") + \
                ("+evenk" if "+evenk" in name else "")
            if tag not in best or t < ms[best[tag]]:
                best[tag] = name
        line = f"{kind:5s} {m}x{n}x{k} {layout} base {flops / ms[base_name] * 1e-9:6.0f} TF |"
        for tag, name in sorted(best.items()):
            line += f" {tag}={ms[base_name] / ms[name]:.3f}"
        overall = min(live, key=ms.get) if live else None
        if vset == "small":
            top = sorted(live, key=ms.get)[:5]
            line += " | top " + ", ".join(f"{t} {ms[base_name] / ms[t]:.3f}" for t in top)
        if overall:
            line += f" | best {overall} {ms[base_name] / ms[overall]:.3f}"
        summary.append(line)
        print(line, f"[{time.time() - T0:.0f}s]", flush=True)
        with open(os.path.join(out_dir, "explore-hopper.json"), "w") as f:
            json.dump(dict(machine=machine_info().to_dict(), results=results), f, indent=1)
        del p, out, ref
        torch.cuda.empty_cache()
    print("\n".join(summary))
    errors = [r for r in results if "status" in r]
    print(f"{len(errors)} variants failed or were wrong:", file=sys.stderr)
    for r in errors[:30]:
        print(" ", r["kind"], r["shape"], r["variant"], r["status"], file=sys.stderr)


if __name__ == "__main__":
    main()
