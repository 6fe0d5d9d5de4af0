"""Exploration on the GPU machine: grey-kernel launch shapes at small images, and tf32 operand layouts.

Prints a short table; writes everything to $OUT/explore.json. Not part of the library or the tests.
"""
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

OUT = os.environ.get("OUT", "out")
results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("TILEGEMM_GIT_COMMIT")}
which = sys.argv[1:] or ["grey", "tf32"]


# ---------------------------------------------------------------- grey
@triton.jit
def grey_var(img_ptr, out_ptr, HW, PLANE, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HW
    policy: tl.constexpr = "evict_first" if STREAM else ""
    r = tl.load(img_ptr + offs, mask=mask, eviction_policy=policy).to(tl.float32)
    g = tl.load(img_ptr + PLANE + offs, mask=mask, eviction_policy=policy).to(tl.float32)
    b = tl.load(img_ptr + 2 * PLANE + offs, mask=mask, eviction_policy=policy).to(tl.float32)
    grey = 0.2989 * r + 0.5870 * g + 0.1140 * b
    grey = tl.minimum(tl.maximum(grey + 0.5, 0.0), 255.0)
    tl.store(out_ptr + offs, grey.to(tl.uint8), mask=mask)


if "grey" in which:
    variants = []
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 4 or block // (32 * warps) > 32:
                continue
            for stream in (True, False):
                variants.append((block, warps, stream))
    rows = []
    for side in (2048, 4096, 8192):
        img = torch.randint(0, 256, (3, side, side), device="cuda", dtype=torch.uint8)
        out = torch.empty(side, side, device="cuda", dtype=torch.uint8)
        same = torch.empty(2, side, side, device="cuda", dtype=torch.uint8)
        ref = (0.2989 * img[0].double() + 0.5870 * img[1].double() + 0.1140 * img[2].double()).round()
        ratios = {v: [] for v in variants}
        base_ts = []
        for rep in range(5):
            for v in variants:
                block, warps, stream = v
                fn = lambda: grey_var[(triton.cdiv(side * side, block),)](img, out, side * side, side * side,
                                                                         BLOCK=block, STREAM=stream, num_warps=warps)
                fn()
                if rep == 0:
                    assert (out.double() - ref).abs().max() <= 1, v
                t = do_bench(fn, warmup=10, rep=60)
                tb = do_bench(lambda: same.clone(), warmup=10, rep=60)
                base_ts.append(tb)
                ratios[v].append(tb / t)
        for v in variants:
            rows.append(dict(side=side, block=v[0], warps=v[1], stream=v[2], ratios=ratios[v],
                             median=statistics.median(ratios[v]), worst=min(ratios[v])))
        print(f"grey {side}: copy median {statistics.median(base_ts) * 1e3:.1f} us")
        best = sorted((r for r in rows if r["side"] == side), key=lambda r: -r["median"])[:6]
        for r in best:
            print(f"   block {r['block']:5d} w{r['warps']:2d} stream {int(r['stream'])}: median {r['median']:.3f} worst {r['worst']:.3f}")
        cur = [r for r in rows if r["side"] == side and r["block"] == 4096 and r["warps"] == 16 and r["stream"]]
        if cur:
            print(f"   current (4096, w16, stream): median {cur[0]['median']:.3f} worst {cur[0]['worst']:.3f}")
    results["grey"] = rows


# ---------------------------------------------------------------- tf32
@triton.jit
def tf32_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: plain (C tile = A tile @ B tile); 1: B tile forced through registers (b + 0.0);
    # 2: swapped, C^T tile = B^T tile (registers) @ A^T tile; 3: swapped without the register trick.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    GROUP: tl.constexpr = 8
    per_band = GROUP * tiles_n
    band = pid // per_band
    first = band * GROUP
    height = tl.minimum(tiles_m - first, GROUP)
    pid_m = first + (pid % per_band) % height
    pid_n = (pid % per_band) // height
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    offs_k = tl.arange(0, BK)
    if MODE < 2:
        a_ptrs = a_ptr + offs_m[:, None] * sam + offs_k[None, :] * sak
        b_ptrs = b_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if MODE == 1:
                b = b + 0.0
            acc = tl.dot(a, b, acc, input_precision="tf32")
            a_ptrs += BK * sak
            b_ptrs += BK * sbk
        tl.store(c_ptr + offs_m[:, None] * scm + offs_n[None, :] * scn, acc)
    else:
        bt_ptrs = b_ptr + offs_n[:, None] * sbn + offs_k[None, :] * sbk  # [BN, BK]
        at_ptrs = a_ptr + offs_k[:, None] * sak + offs_m[None, :] * sam  # [BK, BM]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            bt = tl.load(bt_ptrs)
            at = tl.load(at_ptrs)
            if MODE == 2:
                bt = bt + 0.0
            acc = tl.dot(bt, at, acc, input_precision="tf32")
            bt_ptrs += BK * sbk
            at_ptrs += BK * sak
        tl.store(c_ptr + offs_n[:, None] * scn + offs_m[None, :] * scm, acc)


def mma_version(compiled) -> str:
    ttgir = compiled.asm.get("ttgir", "")
    if "versionMajor = 3" in ttgir:
        return "v3"
    if "versionMajor = 2" in ttgir:
        return "v2"
    return "?"


if "tf32" in which:
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for S in (4096, 8192):
        a = torch.randn(S, S, device="cuda")
        b = torch.randn(S, S, device="cuda")
        bt = torch.randn(S, S, device="cuda")
        ref = (a.double() @ b.double()).float()
        flops = 2 * S**3
        layouts = {"NN": (a, b), "NT": (a, bt.T), "TN": (a.T.contiguous().T, b)}
        for lname, (x, y) in layouts.items():
            tcub = do_bench(lambda: torch.matmul(x, y), warmup=10, rep=100)
            rows.append(dict(S=S, layout=lname, kernel="cublas", ms=tcub, tflops=flops / tcub * 1e-9, ratio=1.0))
            print(f"tf32 {S} {lname}: cublas {flops / tcub * 1e-9:6.1f} TFLOPS")
            refl = (x.double() @ y.double()).float()
            for mode in (0, 1, 2, 3):
                for (bm, bn, bk, w, s) in ((128, 128, 32, 8, 3), (128, 256, 32, 8, 3), (128, 128, 32, 4, 4)):
                    c = torch.full((S, S), float("nan"), device="cuda")
                    grid = (triton.cdiv(S, bm) * triton.cdiv(S, bn),)
                    fn = lambda: tf32_kernel[grid](x, y, c, S, S, S, x.stride(0), x.stride(1), y.stride(0),
                                                   y.stride(1), c.stride(0), c.stride(1), BM=bm, BN=bn, BK=bk,
                                                   MODE=mode, num_warps=w, num_stages=s)
                    try:
                        h = fn()
                        torch.cuda.synchronize()
                    except Exception as e:
                        rows.append(dict(S=S, layout=lname, mode=mode, cfg=[bm, bn, bk, w, s], error=str(e)[:200]))
                        continue
                    err = ((c - refl).abs().max() / refl.abs().max()).item()
                    t = do_bench(fn, warmup=10, rep=100)
                    rows.append(dict(S=S, layout=lname, mode=mode, cfg=[bm, bn, bk, w, s], mma=mma_version(h),
                                     err=err, ms=t, tflops=flops / t * 1e-9, ratio=tcub / t))
                best = max((r for r in rows if r.get("mode") == mode and r["S"] == S and r["layout"] == lname
                            and "ms" in r), key=lambda r: r["ratio"], default=None)
                if best:
                    print(f"   mode {mode}: best {best['cfg']} {best['mma']} {best['tflops']:6.1f} TFLOPS "
                          f"{best['ratio']:.2f}x err {best['err']:.1e}")
            # the library's rungs
            sys.path.insert(0, "src")
            import tilegemm
            for kern in ("autotuned", "persistent_tma"):
                try:
                    tilegemm.matmul(x, y, kernel=kern, precision="tf32")
                    t = do_bench(lambda: tilegemm.matmul(x, y, kernel=kern, precision="tf32"), warmup=10, rep=100)
                    rows.append(dict(S=S, layout=lname, kernel=kern, ms=t, tflops=flops / t * 1e-9, ratio=tcub / t))
                    print(f"   {kern}: {flops / t * 1e-9:6.1f} TFLOPS {tcub / t:.2f}x")
                except Exception as e:
                    print(f"   {kern}: error {str(e)[:200]}")
    results["tf32"] = rows

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "explore.json"), "w") as f:
    json.dump(results, f, indent=1)
