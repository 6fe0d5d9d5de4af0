"""W4A16 at small M with a cold L2: which kernel and tile streams the 4-bit weight closest to HBM speed?

    PYTHONPATH=src python3 research/explore_w4a16_small_m.py --out DIR [--budget 300] [--ms 1,4,16,64]

At M = 1..16 the weight is the whole cost, and at 8192 x 8192 g128 its 34 MB fit in the H200's 60 MB L2: a
time taken from back-to-back replays (``do_bench_cudagraph``) reads it from L2, not HBM. Here every time is
GPU time with the L2 cleared before each call: a CUDA graph of ``reps`` x (zero a 256 MB buffer, call) minus a
graph of the zeroing alone, divided by ``reps``; median of five replays. Host time is not in it.

Candidates (each checked against an fp32 reference first):
- ``gemv`` (M = 1): the shipped tile and wider ones, at several K splits;
- ``mma`` with ``UNPACK="perm"`` (eight dots of K = BLOCK_K/8 a step, one per nibble, no reshape), the
  dequantization by the magic-exponent trick (``DEQ16="magic"``) or a conversion (``"cvt"``), weights as
  the first operand (``SWAP``) or not;
- the shipped ``mma`` config (``reshape`` unpacking) for M >= 2;
- cuBLAS fp16 ``F.linear`` with the dense weight, and a read of the packed weight alone (``qweight.sum``)
  for the bandwidth a plain reduction gets.
Prints one line per (shape, M) with the best of each family; ``DIR/small_m.json`` has every time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from tilegemm import w4a16

SHAPES = [(8192, 8192), (28672, 8192), (14336, 4096), (4096, 4096)]  # N x K


class Cold:
    """GPU microseconds of ``fn`` with the L2 cleared before each call (see the module docstring)."""

    def __init__(self, reps: int = 20, flush: str = "write"):
        """``flush``: "write" zeroes the buffer (as ``do_bench`` does: the L2 is left full of dirty lines, which
        the timed call writes back as it reads); "read" reads it (clean lines, nothing to write back)."""
        self.reps = reps
        self.buf = torch.zeros(256 * 2**20, dtype=torch.int8, device="cuda")
        self.sink = torch.empty(1, dtype=torch.int32, device="cuda")
        self.flush = {"write": self.buf.zero_, "read": self._read}[flush]
        self.base = self._graph_ms(None)

    def _read(self):
        torch.amax(self.buf.view(torch.int32), 0, keepdim=True, out=self.sink)

    def _graph_ms(self, fn) -> float:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            if fn is not None:
                fn()  # warm: compile and record outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                for _ in range(self.reps):
                    self.flush()
                    if fn is not None:
                        fn()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del g
        return sorted(times)[2]

    def __call__(self, fn) -> float:
        return (self._graph_ms(fn) - self.base) / self.reps * 1e3


def rel(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def silu_case(M, N, K, g, dtype):
    """A random correctness case of the fragment kernels: (w, its fragments, their zero/scale words, x, bias, the
    fp64 reference of silu(x @ dequantize(w).T + bias)), and the relative error bound of ``dtype``."""
    w = w4a16.quantize(torch.randn(N, K, device="cuda", dtype=dtype), group_size=g)
    fw, fzs = w.fragments()
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    ref = F.silu(x.double() @ w4a16.dequantize(w).double().T + bias.double())
    return w, fw, fzs, x, bias, ref, (2e-3 if dtype == torch.float16 else 1e-2)


def timing_cases(shapes: str, ms: str):
    """(N, K, M, the fp16 weight, its int4 quantization (group 128), the fragments and their zero/scale words,
    x) for each ``NxK`` of ``shapes`` and each M of ``ms`` (comma-separated), each weight made once."""
    for shape in shapes.split(","):
        N, K = map(int, shape.split("x"))
        wd = torch.randn(N, K, device="cuda", dtype=torch.float16)
        w = w4a16.quantize(wd, group_size=128)
        fw, fzs = w.fragments()
        for M in map(int, ms.split(",")):
            yield N, K, M, wd, w, fw, fzs, torch.randn(M, K, device="cuda", dtype=torch.float16)


def checked(out, ref, bound) -> tuple[float, bool]:
    """(relative error, finite and within ``bound``)."""
    err = ((out.double() - ref).norm() / ref.norm()).item()
    return err, bool(torch.isfinite(out).all()) and err < bound


def problem(x, w):
    from tilegemm.ops.w4a16.common import W4A16Problem

    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=x.dtype)
    return W4A16Problem(x, w.qweight, w.scales, w.zeros, None, out, w.group_k, "none", False)


def split_list(tiles, steps, sms, per_sm_list):
    from tilegemm.ops.w4a16.configs import split_for

    return sorted({split_for(tiles, steps, sms, ps, 1) for ps in per_sm_list})


def candidates(M, N, K, sms):
    """(family, name, module name, cfg) to time at M rows."""
    out = []
    if M == 1:
        for bn, bk, warps in ((64, 128, 4), (128, 128, 4), (128, 256, 8), (256, 128, 8), (64, 256, 4)):
            tiles, steps = -(-N // bn), -(-K // bk)
            for split in split_list(tiles, steps, sms, (2, 4, 6, 12)):
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEQ="exp16asm", PREFETCH=True,
                           ROWS=1, XVEC=True, SPLIT_K=split)
                out.append(("gemv", f"gemv {bn}x{bk} w{warps} s{split}", "gemv", cfg))
        for bn, bk, warps in ((256, 64, 4), (256, 128, 4), (128, 64, 4), (128, 128, 2), (256, 64, 8)):
            tiles, steps = -(-N // bn), -(-K // bk)
            for split in split_list(tiles, steps, sms, (2, 4, 8)):
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEQ="exp16asm", PREFETCH=True,
                           ROWS=1, XVEC=True, SPLIT_K=split)
                out.append(("gemv-wide", f"gemv {bn}x{bk} w{warps} s{split}", "gemv", cfg))
        for bn, bk, warps in ((64, 128, 4), (128, 128, 4), (64, 256, 4), (128, 256, 8)):
            tiles, steps = -(-N // bn), -(-K // bk)
            for stages in (3, 4):
                for split in split_list(tiles, steps, sms, (2, 4, 8, 12)):
                    cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEQ="exp16asm",
                               PREFETCH=False, ROWS=1, XVEC=True, SPLIT_K=split, STAGES=stages)
                    out.append(("gemv-stages", f"gemv {bn}x{bk} w{warps} stages{stages} s{split}", "gemv", cfg))
    if 2 <= M <= 4:
        for bn, bk, warps, stages in ((64, 128, 4, 3), (128, 128, 4, 3), (64, 128, 4, None)):
            tiles, steps = -(-N // bn) * -(-M // M), -(-K // bk)
            for split in split_list(tiles, steps, sms, (2, 4, 8)):
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEQ="exp16asm",
                           PREFETCH=stages is None, ROWS=M if M != 3 else 4, XVEC=False, SPLIT_K=split,
                           STAGES=stages)
                out.append(("gemv-rows", f"gemv rows{cfg['ROWS']} {bn}x{bk} stages{stages} s{split}", "gemv", cfg))
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    tiles_list = [(64, 128, 3, 4, "magic", True), (64, 128, 4, 4, "magic", True), (64, 256, 3, 4, "magic", True),
                  (128, 128, 3, 4, "magic", True), (128, 256, 3, 8, "magic", True), (64, 128, 3, 4, "cvt", True),
                  (64, 128, 2, 4, "magic", True)]
    if M >= 32:
        tiles_list += [(128, 128, 3, 4, "magic", False), (64, 128, 3, 4, "magic", False)]
    for bn, bk, stages, warps, deq, swap in tiles_list:
        tiles, steps = -(-M // bm) * -(-N // bn), -(-K // bk)
        for split in split_list(tiles, steps, sms, (1, 2, 4, 8)):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                       SWAP=swap, UNPACK="perm", DEQ16=deq, SPLIT_K=split)
            out.append(("perm", f"perm {bm}x{bn}x{bk} s{stages} w{warps} {deq}{' swap' if swap else ''} k{split}",
                        "mma", cfg))
    if M >= 2:
        from tilegemm.ops.w4a16.configs import mma_config

        cfg = mma_config(M, N, K, torch.device("cuda"))
        out.append(("mma", "mma shipped", "mma", cfg))
        out.append(("mma-magic", "mma shipped magic", "mma", dict(cfg, DEQ16="magic")))
        for bn, stages in ((128, 3), (64, 4)):
            out.append(("mma-magic", f"mma magic bn{bn} s{stages}", "mma",
                        dict(cfg, DEQ16="magic", BLOCK_N=bn, num_stages=stages)))
            out.append(("mma-magic", f"mma magic gather bn{bn} s{stages}", "mma",
                        dict(cfg, DEQ16="magic", BLOCK_N=bn, num_stages=stages, UNPACK="gather")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--families", default="", help="only these candidate families (comma-separated)")
    args = ap.parse_args()
    from tilegemm.ops.w4a16 import gemv, mma

    mods = dict(gemv=gemv, mma=mma)
    t0 = time.time()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cold = Cold()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s] or SHAPES
    results = dict(device=torch.cuda.get_device_name(), rows=[])
    table = []
    for N, K in shapes:
        W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        w = w4a16.quantize(W, 128)
        dq = w4a16.dequantize(w).float()
        wbytes = w.qweight.numel() * 4 + w.scales.numel() * 2 * 2
        read_us = cold(lambda: w.qweight.sum(dtype=torch.int64))
        for M in [int(m) for m in args.ms.split(",")]:
            if time.time() - t0 > args.budget:
                print("budget reached", flush=True)
                break
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            ref = x.float() @ dq.T
            row = dict(N=N, K=K, M=M, read_us=read_us, weight_bytes=wbytes, cands=[])
            row["cublas_us"] = cold(lambda: F.linear(x, W))
            for fam, name, mod, cfg in candidates(M, N, K, sms):
                if args.families and fam not in args.families.split(","):
                    continue
                p = problem(x, w)
                run = mods[mod].run
                try:
                    run(p, cfg)
                    err = rel(p.out, ref)
                    us = cold(lambda: run(p, cfg)) if err <= 2e-3 else None
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                    row["cands"].append(dict(family=fam, name=name, error=str(exc)[:300]))
                    continue
                row["cands"].append(dict(family=fam, name=name, us=us, err=err))
            best = {}
            for c in row["cands"]:
                if c.get("us") and (c["family"] not in best or c["us"] < best[c["family"]]["us"]):
                    best[c["family"]] = c
            row["best"] = best
            results["rows"].append(row)
            line = (f"{N}x{K} M={M}: read {read_us:.1f} ({wbytes / read_us / 1e3:.0f} GB/s) cuBLAS "
                    f"{row['cublas_us']:.1f} | " + " | ".join(
                        f"{f} {c['us']:.1f} {row['cublas_us'] / c['us']:.2f}x ({wbytes / c['us'] / 1e3:.0f} GB/s) "
                        f"[{c['name']}]" for f, c in best.items()))
            bad = [c for c in row["cands"] if not c.get("us")]
            print(line + (f"  ({len(bad)} failed)" if bad else ""), flush=True)
            table.append(line)
            with open(os.path.join(args.out, "small_m.json"), "w") as fh:
                json.dump(results, fh, indent=1)
    print("\n".join(table))


if __name__ == "__main__":
    main()
