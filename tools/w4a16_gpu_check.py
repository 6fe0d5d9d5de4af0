"""One GPU session for W4A16: check every kernel, explore configs, time against cuBLAS fp16 and torch's int4.

    PYTHONPATH=src python tools/w4a16_gpu_check.py [--sections check,gemv,mma,table] [--budget 280]

Writes ``$OUT/w4a16_gpu.json`` (or ./w4a16_gpu.json) after every section. Times are
``triton.testing.do_bench`` medians (L2 cleared before each call) on random data, all in one process; ratio =
cuBLAS fp16 time / the kernel's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

import tilegemm
from tilegemm import w4a16

T0 = time.time()
OUT = os.environ.get("OUT", ".")
RESULTS: dict = {"meta": {}}


def save() -> None:
    with open(os.path.join(OUT, "w4a16_gpu.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def bench(fn, rep=40) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")) * 1e3  # us


def rel(out, ref) -> float:
    from tilegemm.core.checks import relative_error

    return relative_error(out, ref)


_weights: dict = {}


def weight(N, K, dtype, g=128):
    key = (N, K, dtype, g)
    if key not in _weights:
        _weights.clear()
        torch.cuda.empty_cache()
        W = torch.randn(N, K, device="cuda", dtype=dtype) * 0.02
        _weights[key] = (W, w4a16.quantize(W, g))
    return _weights[key]


def problem(x, w, out=None):
    from tilegemm.ops.w4a16.common import W4A16Problem

    out = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype) if out is None else out
    return W4A16Problem(x, w.qweight, w.scales, w.zeros, None, out, w.group_k, "none", False)


def section_check() -> None:
    rows = []
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        for (N, K, g) in ((4096, 4096, 128), (264, 768, 32)):
            W = torch.randn(N, K, device="cuda", dtype=dtype)
            w = w4a16.quantize(W, g)
            dq = w4a16.dequantize(w).double()
            bias = torch.randn(N, device="cuda", dtype=dtype)
            for M in (1, 3, 17, 300):
                x = torch.randn(2, M, K, device="cuda", dtype=dtype)[1]
                for kernel in ("auto", "gemv", "mma", "dequant_cublas"):
                    for act in (("none", "silu") if kernel == "auto" else ("none",)):
                        y = w4a16.matmul(x, w, bias=bias if act == "silu" else None, activation=act, kernel=kernel)
                        ref = x.double() @ dq.T
                        if act == "silu":
                            ref = F.silu(ref + bias.double())
                        err = rel(y, ref)
                        rows.append(dict(dtype=str(dtype), N=N, K=K, g=g, M=M, kernel=kernel, act=act, err=err,
                                         ok=err <= tol))
    bad = [r for r in rows if not r["ok"]]
    print(f"check: {len(rows) - len(bad)}/{len(rows)} within tolerance", flush=True)
    for r in bad[:20]:
        print("  WRONG", r, flush=True)
    RESULTS["check"] = dict(total=len(rows), bad=bad)


def per_sm_splits(mod, p, cfg, sms, per_sm_list):
    from tilegemm.ops.w4a16.configs import split_for

    tiles = -(-p.N // cfg["BLOCK_N"]) * -(-p.M // cfg.get("BLOCK_M", 1))
    steps = -(-p.K // cfg["BLOCK_K"])
    return sorted({split_for(tiles, steps, sms, ps, 1) for ps in per_sm_list})


def explore(name, mod, shapes, Ms, cfgs, per_sm_list, budget, top=6):
    """Time every (config, split) on the shapes and Ms; return rows sorted per (shape, M)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (N, K), M in itertools.product(shapes, Ms):
        W, w = weight(N, K, torch.float16)
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        base = bench(lambda: F.linear(x, W))
        ref = x.double() @ w4a16.dequantize(w).double().T
        p = problem(x, w)
        results = []
        for cfg in cfgs(M):
            if time.time() - T0 > budget:
                print(f"{name}: budget reached", flush=True)
                break
            for split in per_sm_splits(mod, p, cfg, sms, per_sm_list):
                c = dict(cfg, SPLIT_K=split)
                try:
                    mod.run(p, c)
                    err = rel(p.out, ref)
                    us = bench(lambda: mod.run(p, c), rep=25) if err < 2e-3 else None
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} {c} failed: {str(exc)[:200]}", flush=True)
                    continue
                results.append(dict(N=N, K=K, M=M, cfg=c, us=us, err=err, cublas_us=base,
                                    ratio=base / us if us else None))
        results.sort(key=lambda r: r["us"] or 1e9)
        rows += results
        print(f"{name} M={M} {N}x{K}: cuBLAS {base:.1f} us; best:", flush=True)
        for r in results[:top]:
            print(f"   {r['us']:.1f} us {r['ratio']:.2f}x {r['cfg']}", flush=True)
    return rows


def section_gemv(budget) -> None:
    from tilegemm.ops.w4a16 import gemv

    def cfgs(M):
        for bn, bk, warps, magic in itertools.product((64, 128, 256), (64, 128), (4, 8), (False, True)):
            yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, MAGIC=magic)

    RESULTS["gemv"] = explore("gemv", gemv, [(8192, 8192), (4096, 4096)], [1], cfgs, (2, 4, 8, 16), budget)
    save()


def section_mma(budget) -> None:
    from tilegemm.ops.w4a16 import mma

    def cfgs(M):
        if M <= 16:
            tiles = [(16, 64, 128, 4, 3), (16, 128, 128, 4, 3)]
        elif M <= 64:
            tiles = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4), (64, 128, 128, 4, 3)]
        elif M <= 256:
            tiles = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 8, 4),
                     (128, 64, 128, 4, 4)]
        else:
            tiles = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]
        for (bm, bn, bk, warps, stages), unpack in itertools.product(tiles, ("reshape", "gather")):
            for swap in ((False, True) if M <= 64 else (False,)):
                yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                           UNPACK=unpack, SWAP=swap)

    RESULTS["mma"] = explore("mma", mma, [(8192, 8192)], [16, 64, 256, 4096], cfgs, (1, 2, 4, 8), budget)
    save()


SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]


def section_table(budget) -> None:
    from tilegemm.ops.w4a16.baselines import tinygemm_mm, tinygemm_weight

    rows = []
    for N, K in SHAPES:
        W, w = weight(N, K, torch.float16)
        wb = w.to(torch.bfloat16)
        Wb = W.to(torch.bfloat16)
        try:
            tg = tinygemm_weight(wb)
        except Exception as exc:  # noqa: BLE001
            print("tinygemm unavailable:", str(exc)[:200], flush=True)
            tg = None
        for M in MS:
            if time.time() - T0 > budget:
                print("table: budget reached", flush=True)
                break
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            xb = x.to(torch.bfloat16)
            row = dict(N=N, K=K, M=M, g=128)
            row["cublas_us"] = bench(lambda: F.linear(x, W))
            row["cublas_bf16_us"] = bench(lambda: F.linear(xb, Wb))
            kernels = ["auto", "mma"] + (["gemv"] if M <= 16 else []) + (["dequant_cublas"] if M >= 256 else [])
            for k in kernels:
                row[f"{k}_us"] = bench(lambda: w4a16.matmul(x, w, kernel=k))
            row["auto_bf16_us"] = bench(lambda: w4a16.matmul(xb, wb))
            if tg is not None:
                try:
                    ref = xb.double() @ w4a16.dequantize(wb).double().T
                    row["tinygemm_err"] = rel(tinygemm_mm(xb, *tg), ref)
                    row["tinygemm_us"] = bench(lambda: tinygemm_mm(xb, *tg))
                except Exception as exc:  # noqa: BLE001
                    row["tinygemm_error"] = str(exc)[:200]
            row["ratio"] = row["cublas_us"] / row["auto_us"]
            if "tinygemm_us" in row:
                row["vs_tinygemm_bf16"] = row["tinygemm_us"] / row["auto_bf16_us"]
            # weight traffic: packed weights + scales + zeros
            row["weight_GBps"] = w.nbytes / (row["auto_us"] * 1e-6) / 1e9
            rows.append(row)
            extra = " ".join(f"{k}={row[k + '_us']:.1f}" for k in kernels)
            tgs = f" tinygemm={row.get('tinygemm_us', float('nan')):.1f} bf16auto={row['auto_bf16_us']:.1f}"
            print(f"{N}x{K} M={M}: cuBLAS {row['cublas_us']:.1f} us, {extra}{tgs} -> {row['ratio']:.2f}x "
                  f"({row['weight_GBps']:.0f} GB/s)", flush=True)
        RESULTS["table"] = rows
        save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="check,gemv,mma,table")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds; exploration stops after it")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    RESULTS["meta"] = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                           tilegemm=tilegemm.__version__, sections=args.sections)
    import triton

    RESULTS["meta"]["triton"] = triton.__version__
    print(RESULTS["meta"], flush=True)
    sections = args.sections.split(",")
    budgets = {"gemv": 0.45, "mma": 0.7, "table": 1.0}
    for name in sections:
        t = time.time()
        try:
            if name == "check":
                section_check()
            else:
                globals()[f"section_{name}"](args.budget * budgets.get(name, 1.0))
        except Exception as exc:  # noqa: BLE001 - one broken section must not cost the others
            import traceback

            traceback.print_exc()
            RESULTS[f"{name}_error"] = repr(exc)[:500]
        print(f"[{name}: {time.time() - t:.0f} s, total {time.time() - T0:.0f} s]", flush=True)
        save()


if __name__ == "__main__":
    main()
