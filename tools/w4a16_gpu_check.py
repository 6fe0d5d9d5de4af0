"""One GPU session for W4A16: check every kernel, time every candidate config, compare with cuBLAS and tinygemm.

    PYTHONPATH=src python3 tools/w4a16_gpu_check.py --out w4a16_gpu.json [--quick] [--budget 210]

Sections, in order: ``check`` (every kernel, fp16/bf16, odd shapes, bias + silu, through the public op), then for
each shape (4096x4096, 8192x8192, 14336x4096, 28672x8192, as N x K, g128 fp16) and M (1, 2, 4, 8, 16, 32, 64,
256, 4096): cuBLAS fp16 ``F.linear``, torch's int4 kernel (tinygemm, bf16), the public ``w4a16.matmul`` (its
replay fast path included: ``api``), the shipped ``auto`` choice launched directly, and every candidate config
of ``gemv`` (M <= 16) and ``mma`` (M >= 2) launched directly; each candidate is checked against an fp32
reference before it is timed. Times are ``triton.testing.do_bench`` medians (L2 cleared before each call), in
microseconds; ratio = cuBLAS time / time. The JSON is written after every shape; the table comes last.
``--quick`` takes fewer candidates and M values (under 2 minutes on an H100). ``auto`` and the candidates
are timed from CUDA graphs (GPU time alone, against cuBLAS timed the same way); cuBLAS, tinygemm and the public
op are also timed by events around back-to-back calls, as a caller sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F

import tilegemm
from tilegemm import w4a16

T0 = time.time()
SHAPES = [(4096, 4096), (8192, 8192), (14336, 4096), (28672, 8192)]  # N x K
MS = [1, 2, 4, 8, 16, 32, 64, 256, 4096]
QUICK_MS = [1, 4, 16, 64, 4096]
TARGET = {(4096, 4096): 2.5}  # cuBLAS / time wanted for M = 1..16; 3.5 on the other shapes


def bench(fn, rep=20) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")) * 1e3  # us


def gbench(fn, rep=20) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph: the GPU's time alone. A candidate launched
    through Triton's Python launch path costs 20-40 us of host time, more than most of these kernels run, so
    timing it by events measured the host (the first runs of this tool did)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")) * 1e3  # us


def rel(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def problem(x, w, bias=None, activation="none"):
    from tilegemm.ops.w4a16.problem import W4A16Problem

    out = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)
    return W4A16Problem(x=x, qweight=w.qweight, scales=w.scales, zeros=w.zeros, bias=bias, out=out, group_k=w.group_k,
                        activation=activation)


# --- candidates -----------------------------------------------------------------------------------------


def gemv_candidates(M: int, quick: bool):
    """(name, cfg without SPLIT_K, programs per SM to try) for the gemv kernel at M rows."""
    if M > 16:
        return []
    # (BLOCK_N, BLOCK_K, num_warps, DEQ, PREFETCH); the first is the shipped config (29.6 us at 8192^2 M=1)
    tiles = [(64, 128, 4, "magic", False), (64, 128, 4, "exp16asm", True), (128, 128, 4, "exp16asm", True),
             (64, 256, 4, "exp16asm", True), (32, 256, 4, "exp16asm", True), (128, 256, 8, "exp16asm", True)]
    if not quick:
        tiles += [(64, 128, 4, "exp16asm", False), (64, 128, 4, "magic", True), (64, 128, 4, "exp16", True),
                  (64, 128, 2, "exp16asm", True), (256, 128, 8, "exp16asm", True), (128, 64, 4, "exp16asm", True)]
    rows_list = [min(M, 4)] + ([2] if M >= 4 and not quick else [])
    per_sm = (4, 8, 16)
    for (bn, bk, warps, deq, pf) in tiles:
        for rows in rows_list:
            # XVEC: x's eight values of a packed row in one load (ROWS=1 only; offline sm_90: one 2-byte load a
            # step instead of sixteen)
            for xvec in ((False, True) if rows == 1 else (False,)):
                name = f"gemv {deq} pf{int(pf)} r{rows} {bn}x{bk} w{warps}" + (" xvec" if xvec else "")
                yield name, dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEQ=deq, PREFETCH=pf,
                                 ROWS=rows, XVEC=xvec), per_sm


def mma_candidates(M: int, quick: bool):
    """(name, cfg without SPLIT_K, programs per SM to try) for the mma kernel: the shipped table's entry first."""
    if M < 2:
        return []
    if M <= 16:
        tiles = [(16, 64, 128, 4, 3, True), (16, 128, 128, 4, 3, True), (16, 64, 64, 4, 4, True)]
    elif M <= 32:
        tiles = [(32, 64, 128, 4, 3, True), (32, 128, 128, 4, 3, True), (32, 64, 128, 4, 3, False)]
    elif M <= 64:
        tiles = [(64, 128, 128, 4, 3, False), (64, 64, 128, 4, 4, False), (64, 64, 128, 4, 3, True)]
    elif M <= 256:
        tiles = [(128, 128, 128, 8, 3, False), (64, 128, 64, 4, 4, False), (128, 128, 64, 8, 4, False)]
    else:
        tiles = [(128, 128, 64, 8, 4, False), (128, 256, 64, 8, 3, False)]
    if quick:
        tiles = tiles[:1]
    per_sm = (4,) if quick else (1, 2, 4, 8)
    for (bm, bn, bk, warps, stages, swap) in tiles:
        name = f"mma {bm}x{bn}x{bk} w{warps} s{stages}{' swap' if swap else ''}"
        yield name, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                         SWAP=swap), per_sm


def splits(p, cfg, per_sm_list) -> list[int]:
    from tilegemm.ops.w4a16.configs import split_for

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = cfg.get("BLOCK_M", cfg.get("ROWS", 1))
    tiles = -(-p.N // cfg["BLOCK_N"]) * -(-p.M // rows)
    steps = -(-p.K // cfg["BLOCK_K"])
    return sorted({split_for(tiles, steps, sms, ps, 1) for ps in per_sm_list})


# --- sections -------------------------------------------------------------------------------------------


def section_check(results) -> None:
    rows = []
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        for (N, K, g) in ((4096, 4096, 128), (264, 768, 32)):
            w = w4a16.quantize(torch.randn(N, K, device="cuda", dtype=dtype), g)
            dq = w4a16.dequantize(w).double()
            bias = torch.randn(N, device="cuda", dtype=dtype)
            for M in (1, 3, 17, 300):
                x = torch.randn(2, M, K, device="cuda", dtype=dtype)[1]
                for kernel in ("auto", "gemv", "mma", "dequant_cublas"):
                    for act in (("none", "silu") if kernel == "auto" else ("none",)):
                        for trial in range(2):  # the second auto call replays the first's launch
                            y = w4a16.matmul(x, w, bias=bias if act == "silu" else None, activation=act,
                                             kernel=kernel)
                            ref = x.double() @ dq.T
                            if act == "silu":
                                ref = F.silu(ref + bias.double())
                            err = rel(y, ref.float())
                            rows.append(dict(dtype=str(dtype), N=N, K=K, g=g, M=M, kernel=kernel, act=act,
                                             trial=trial, err=err, ok=err <= tol))
    # every gemv option on an odd shape (bf16 too)
    from tilegemm.ops.w4a16 import gemv

    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        w = w4a16.quantize(torch.randn(200, 1024, device="cuda", dtype=dtype), 64)
        dq = w4a16.dequantize(w).float()
        for M in (1, 2, 3, 5):
            x = torch.randn(M, 1024, device="cuda", dtype=dtype)
            for deq in ("magic", "exp16", "exp16asm"):
                for pf in (False, True):
                    for n_rows in (1, 2, 4):
                        p = problem(x, w)
                        gemv.run(p, dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=1, DEQ=deq,
                                         PREFETCH=pf, ROWS=n_rows))
                        err = rel(p.out, x.float() @ dq.T)
                        rows.append(dict(dtype=str(dtype), N=200, K=1024, M=M, kernel=f"gemv {deq} pf{pf} r{n_rows}",
                                         err=err, ok=err <= tol))
    bad = [r for r in rows if not r["ok"]]
    print(f"check: {len(rows) - len(bad)}/{len(rows)} within tolerance", flush=True)
    for r in bad[:20]:
        print("  WRONG", r, flush=True)
    results["check"] = dict(total=len(rows), bad=bad)


def time_shape(N, K, Ms, quick, budget, results) -> None:
    from tilegemm.ops.w4a16 import dispatch, gemv, mma
    from tilegemm.ops.w4a16.baselines import tinygemm_mm, tinygemm_weight

    torch.cuda.empty_cache()
    W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    w = w4a16.quantize(W, 128)
    dq = w4a16.dequantize(w).float()
    try:
        wb = w.to(torch.bfloat16)
        tg = tinygemm_weight(wb)
    except Exception as exc:  # noqa: BLE001
        print("tinygemm unavailable:", str(exc)[:200], flush=True)
        tg = None
    for M in Ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        ref = x.float() @ dq.T
        row = dict(N=N, K=K, M=M, g=128, candidates=[])
        row["cublas_us"] = bench(lambda: F.linear(x, W))
        row["cublas_graph_us"] = gbench(lambda: F.linear(x, W))
        if tg is not None:
            xb = x.to(torch.bfloat16)
            row["tinygemm_us"] = bench(lambda: tinygemm_mm(xb, *tg))
        w4a16.matmul(x, w)  # records the replay
        row["api_us"] = bench(lambda: w4a16.matmul(x, w))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            w4a16.matmul(x, w)
        torch.cuda.synchronize()
        row["api_loop_us"] = (time.perf_counter() - t) / 100 * 1e6  # back to back: max(host, GPU) per call
        kernel = dispatch.choose(M)
        row["auto_kernel"] = kernel
        p = problem(x, w)
        run = dispatch.launcher(kernel)
        run(p)
        row["auto_err"] = rel(p.out, ref)
        row["auto_us"] = gbench(lambda: run(p))
        for fam, mod, cands in (("gemv", gemv, gemv_candidates(M, quick)), ("mma", mma, mma_candidates(M, quick))):
            for name, cfg, per_sm in cands:
                if time.time() - T0 > budget:
                    row["budget_reached"] = True
                    break
                for split in splits(p, cfg, per_sm):
                    c = dict(cfg, SPLIT_K=split)
                    try:
                        mod.run(p, c)
                        err = rel(p.out, ref)
                        us = gbench(lambda: mod.run(p, c)) if err <= 2e-3 else None
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                        row["candidates"].append(dict(name=name, split=split, cfg=c, error=str(exc)[:300]))
                        continue
                    row["candidates"].append(dict(name=name, split=split, cfg=c, us=us, err=err))
        timed = [c for c in row["candidates"] if c.get("us")]
        if timed:
            best = min(timed, key=lambda c: c["us"])
            row["best"] = dict(name=f"{best['name']} split{best['split']}", us=best["us"], cfg=best["cfg"])
            row["best_ratio"] = row["cublas_graph_us"] / best["us"]  # both timed from CUDA graphs
        failed = [c for c in row["candidates"] if not c.get("us")]
        print(f"{N}x{K} M={M}: cuBLAS {row['cublas_us']:.1f} tinygemm {row.get('tinygemm_us', float('nan')):.1f} "
              f"api {row['api_us']:.1f} (loop {row['api_loop_us']:.1f}) auto[{kernel}] {row['auto_us']:.1f}"
              + (f" best {row['best']['us']:.1f} ({row['best']['name']}) {row['best_ratio']:.2f}x" if timed else "")
              + (f"; {len(failed)} candidates failed or wrong" if failed else ""), flush=True)
        results["rows"].append(row)
    del W, w, dq


def print_table(results) -> None:
    print("\n| N x K | M | cuBLAS | tinygemm | api | auto (kernel) | best candidate | best/cuBLAS | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        best = r.get("best")
        target = TARGET.get((r["N"], r["K"]), 3.5) if r["M"] <= 16 else None
        ratio = r.get("best_ratio")
        mark = "" if target is None or ratio is None else (" ok" if ratio >= target else " MISS")
        print(f"| {r['N']}x{r['K']} | {r['M']} | {r['cublas_us']:.1f} | {r.get('tinygemm_us', float('nan')):.1f} | "
              f"{r['api_us']:.1f} | {r['auto_us']:.1f} ({r['auto_kernel']}) | "
              f"{best['us']:.1f} {best['name']} | {ratio:.2f}x | {target or '-'}{mark} |" if best else
              f"| {r['N']}x{r['K']} | {r['M']} | {r['cublas_us']:.1f} | - | {r['api_us']:.1f} | "
              f"{r['auto_us']:.1f} | - | - | - |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "w4a16_gpu.json"))
    parser.add_argument("--quick", action="store_true", help="fewer candidates and M values (< 2 min)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which candidates are skipped (baselines still run); 200 or 90 quick")
    parser.add_argument("--shapes", default=None, help="e.g. 8192x8192,4096x4096 (N x K)")
    parser.add_argument("--ms", default=None, help="M values, e.g. 1,16 (default: all, or fewer with --quick)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness section")
    args = parser.parse_args()
    budget = args.budget or (90.0 if args.quick else 200.0)
    props = torch.cuda.get_device_properties(0)
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    commit = commit or os.environ.get("TILEGEMM_GIT_COMMIT", "")  # the GPU machine's copy has no .git
    results = dict(meta=dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                             triton=triton.__version__, cuda=torch.version.cuda, tilegemm=tilegemm.__version__,
                             commit=commit, quick=args.quick), rows=[])
    print(results["meta"], flush=True)

    def save():
        results["meta"]["seconds"] = round(time.time() - T0, 1)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    try:
        if not args.no_check:
            section_check(results)
    except Exception as exc:  # noqa: BLE001 - a broken check must not cost the timings
        import traceback

        traceback.print_exc()
        results["check_error"] = repr(exc)[:500]
    print(f"[check: {time.time() - T0:.0f} s]", flush=True)
    save()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for N, K in shapes:
        try:
            ms = [int(m) for m in args.ms.split(",")] if args.ms else (QUICK_MS if args.quick else MS)
            time_shape(N, K, ms, args.quick, budget, results)
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            results.setdefault("errors", []).append(f"{N}x{K}: {exc!r}"[:500])
        print(f"[{N}x{K}: total {time.time() - T0:.0f} s]", flush=True)
        save()
    print_table(results)
    save()


if __name__ == "__main__":
    main()
