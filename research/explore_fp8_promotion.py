"""Exploration on the GPU: ways to promote fp8 products into an fp32 sum, and what each costs (not a test).

Hopper's fp8 MMA keeps fewer accumulator bits than fp32. ``torch._scaled_mm`` (no ``use_fast_accum``)
promotes partial sums into fp32 now and then; tilegemm does it with ``tl.dot(..., max_num_imprecise_acc=BK)``
and ran 0.82x of it (58db05f), while the unpromoted sum ran 0.98x-1.06x. Variants, in one pointer kernel
(A row-major, B column-major, K a multiple of the K step):

- ``fast``: ``acc = tl.dot(a, b, acc)``: no promotion.
- ``limit``: ``tl.dot(a, b, acc, max_num_imprecise_acc=BK)``: what tilegemm does.
- ``add``: ``acc += tl.dot(a, b)``: a fresh MMA sum per K step, added in fp32 by hand.
- ``add2``: the same every two K steps (two MMAs chained, then added).

The error of each against an fp64 product of the same fp8 values tells whether the compiler kept the
promotion (``add`` could be folded back into ``fast``). Writes ``$OUT/explore-fp8-promotion.json``.

    PYTHONPATH=src python3 research/explore_fp8_promotion.py
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from tilegemm.core.hardware import machine_info


@triton.jit
def fp8_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
               MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    height = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % height
    pid_n = (pid % (GROUP_M * tiles_n)) // height
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]  # [BM, BK], K contiguous
    b_ptrs = b_ptr + offs_k[:, None] + offs_n[None, :] * stride_bn  # [BK, BN], K contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == "add2":
        for k in range(0, K, 2 * BLOCK_K):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            part = tl.dot(a, b)
            a = tl.load(a_ptrs + BLOCK_K)
            b = tl.load(b_ptrs + BLOCK_K)
            part = tl.dot(a, b, part)
            acc += part
            a_ptrs += 2 * BLOCK_K
            b_ptrs += 2 * BLOCK_K
    else:
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if MODE == "fast":
                acc = tl.dot(a, b, acc)
            elif MODE == "limit":
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:  # "add"
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


CONFIGS = [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (256, 128, 128, 8, 3),
           (128, 256, 64, 8, 4)]
MODES = ["fast", "limit", "add", "add2"]


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    torch.manual_seed(0)
    rows = []
    for size in (4096, 8192):
        M = N = K = size
        a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)  # B^T row-major: B column-major
        ref = (a.double() @ b.double().T)
        one = torch.ones((), device="cuda")

        def rel(x):
            return ((x.double() - ref).norm() / ref.norm()).item()

        for fast in (False, True):
            fn = lambda: torch._scaled_mm(a, b.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                          use_fast_accum=fast)
            res = fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
            rows.append(dict(size=size, kernel=f"_scaled_mm{'_fast' if fast else ''}", ms=ms, rel_err=rel(res)))
        base = rows[-2]["ms"]
        for bm, bn, bk, w, s in CONFIGS:
            for mode in MODES:
                c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)

                def fn():
                    fp8_kernel[grid](a, b, c, M, N, K, a.stride(0), b.stride(0), c.stride(0), MODE=mode,
                                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - exploration: record and go on
                    rows.append(dict(size=size, kernel=mode, config=[bm, bn, bk, w, s], error=str(e)[:200]))
                    continue
                err = rel(c)
                ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                rows.append(dict(size=size, kernel=mode, config=[bm, bn, bk, w, s], ms=ms, rel_err=err,
                                 ratio=base / ms))
                print(f"{size} {mode:6s} {bm}x{bn}x{bk} w{w} s{s}: {ms * 1e3:8.1f} us  {base / ms:5.2f}x  "
                      f"err {err:.2e}", file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, "explore-fp8-promotion.json"), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)
    print(f"{'size':>5} {'kernel':14s} {'config':22s} {'us':>9} {'ratio':>6} {'rel_err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:5d} {r['kernel']:14s} {str(r['config']):22s} FAILED {r['error'][:60]}")
            continue
        print(f"{r['size']:5d} {r['kernel']:14s} {str(r.get('config', '')):22s} {r['ms'] * 1e3:9.1f} "
              f"{r.get('ratio', 1.0):6.2f} {r['rel_err']:9.2e}")


if __name__ == "__main__":
    main()
