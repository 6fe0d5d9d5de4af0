"""Does programmatic dependent launch (PDL) speed up chains of W4A16 products as CUDA graphs (GPU, Hopper)?

``frag_wgmma`` with ``PDL`` (config key) is launched with the programmatic-serialization attribute: every program
first lets the next kernel in the stream launch (``griddepcontrol.launch_dependents``), copies its first steps'
weight words and loads its first scales, and only then waits for the kernel ahead of it (``griddepcontrol.wait``)
before reading x. So a product's weight stream starts under the tail of the kernel before it.

    PYTHONPATH=src:research python3 research/w4a16_pdl.py --out $OUT/w4a16-pdl.json

1. Checks: dependent chains (each product reads the one before, with torch ops between) captured into a CUDA graph
   with PDL on and replayed on fresh inputs, against the same chain run eagerly without PDL: bit for bit.
2. Times, as CUDA-graph replays (events around ``--replays`` replays, median of ``--rounds``):
   - ``layers``: Llama-3-8B's seven products of a decoder layer (q, k, v, o, gate, up, down) with torch's
     elementwise work between them as a layer has it, over ``--layers`` layers of distinct weights (past the L2),
     at each M: int4 without PDL, int4 with PDL, fp16 cuBLAS (``F.linear``);
   - ``repeat``: one product over 8 distinct weights back to back (the bench's graph timing), PDL off / on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from tilegemm import w4a16
from tilegemm.core import replay
import tilegemm.ops.w4a16.frag_wgmma as fw

_ORIG_CONFIG = fw.frag_wgmma_config


def set_pdl(on: int) -> None:
    fw.frag_wgmma_config = (lambda *a, **k: dict(_ORIG_CONFIG(*a, **k), PDL=int(on))) if on else _ORIG_CONFIG
    replay.clear()


def graph_ms(fn, replays: int, rounds: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return statistics.median(times)


LLAMA = dict(q=(4096, 4096), k=(1024, 4096), v=(1024, 4096), o=(4096, 4096), gate=(14336, 4096),
             up=(14336, 4096), down=(4096, 14336))


def make_layers(n: int, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(n):
        dense = {k: torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) * K ** -0.5
                 for k, (N, K) in LLAMA.items()}
        quant = {k: w4a16.quantize(v, group_size=128) for k, v in dense.items()}
        layers.append((dense, quant))
    return layers


def layer_fn(layers, x, int4: bool):
    def run():
        h = x
        for dense, quant in layers:
            lin = (lambda t, k: w4a16.matmul(t, quant[k])) if int4 else (lambda t, k: F.linear(t, dense[k]))
            hn = h * 0.5  # the norm
            q, k, v = lin(hn, "q"), lin(hn, "k"), lin(hn, "v")
            a = q + (k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True)) * 1e-3  # attention's stand-in
            h = h + lin(a, "o")
            hn = h * 0.5
            m = F.silu(lin(hn, "gate")) * lin(hn, "up")
            h = h + lin(m, "down")
        run.out = h
    return run


def check(dtype, report: dict, mode: int) -> bool:
    """Chains with PDL as a graph against eager without: bit for bit."""
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(1)
    for (N, M, depth) in ((4096, 1, 6), (4096, 16, 6), (2048, 64, 4), (8192, 3, 4), (1024, 200, 3)):
        ws = [w4a16.quantize(torch.randn(N, N, device="cuda", dtype=dtype, generator=gen) * N ** -0.5, group_size=128)
              for _ in range(depth)]
        x = torch.randn(M, N, device="cuda", dtype=dtype, generator=gen)

        def chain():
            y = x
            for w in ws:
                y = torch.tanh(w4a16.matmul(y, w)) + 0.25 * y
            chain.out = y
        set_pdl(False)
        chain()
        want = chain.out.clone()
        set_pdl(mode)
        g = torch.cuda.CUDAGraph()
        chain()  # warm up (compiles, records)
        with torch.cuda.graph(g):
            chain()
        results = []
        for trial in range(3):
            x.copy_(torch.randn(M, N, device="cuda", dtype=dtype, generator=gen))
            set_pdl(False)
            chain()
            want = chain.out.clone()
            g.replay()
            torch.cuda.synchronize()
            same = torch.equal(chain.out, want)
            results.append(same)
        eager_pdl_ok = True
        set_pdl(mode)
        chain()
        eager_pdl_ok = torch.equal(chain.out, want)
        report.setdefault("checks", []).append(dict(N=N, M=M, depth=depth, dtype=str(dtype), pdl=mode, graph_equal=results,
                                                    eager_equal=eager_pdl_ok))
        ok &= all(results) and eager_pdl_ok
        print(f"check N={N} M={M} depth={depth} {dtype}: graph {results} eager {eager_pdl_ok}", flush=True)
    set_pdl(False)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,4,16,32,64,128")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    report = dict(commit=os.environ.get("TILEGEMM_GIT_COMMIT", ""), device=torch.cuda.get_device_name())
    ok = check(torch.float16, report, 1) and check(torch.float16, report, 2)
    dtype = torch.float16
    layers = make_layers(args.layers, dtype)
    rows = []
    for M in (int(m) for m in args.ms.split(",")):
        x = torch.randn(M, 4096, device="cuda", dtype=dtype)
        t = {}
        for name, int4, pdl in (("fp16", False, 0), ("int4", True, 0), ("int4_pdl", True, 1), ("int4_pdl2", True, 2)):
            set_pdl(pdl)
            t[name] = graph_ms(layer_fn(layers, x, int4), args.replays, args.rounds) / args.layers
        row = dict(kind="layers", M=M, ms_per_layer=t, ratio_int4=t["fp16"] / t["int4"],
                   ratio_int4_pdl=t["fp16"] / t["int4_pdl"], pdl_gain=t["int4"] / t["int4_pdl"])
        rows.append(row)
        print(f"layers M={M}: fp16 {t['fp16']*1e3:.1f} us  int4 {t['int4']*1e3:.1f}  pdl {t['int4_pdl']*1e3:.1f} "
              f"pdl2 {t['int4_pdl2']*1e3:.1f}  "
              f"ratio {row['ratio_int4']:.2f} -> {row['ratio_int4_pdl']:.2f}", flush=True)
    for (N, K) in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)):
        ws = [w4a16.quantize(torch.randn(N, K, device="cuda", dtype=dtype) * K ** -0.5, group_size=128)
              for _ in range(8)]
        dense = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(8)]
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            t = {}
            t["fp16"] = graph_ms(lambda: [F.linear(x, w) for w in dense], args.replays, args.rounds) / 8
            for name, pdl in (("int4", 0), ("int4_pdl", 1), ("int4_pdl2", 2)):
                set_pdl(pdl)
                t[name] = graph_ms(lambda: [w4a16.matmul(x, w) for w in ws], args.replays, args.rounds) / 8
            row = dict(kind="repeat", N=N, K=K, M=M, ms=t, ratio_int4=t["fp16"] / t["int4"],
                       ratio_int4_pdl=t["fp16"] / t["int4_pdl"])
            rows.append(row)
            print(f"repeat {N}x{K} M={M}: fp16 {t['fp16']*1e3:.1f} us int4 {t['int4']*1e3:.1f} pdl "
                  f"{t['int4_pdl']*1e3:.1f} pdl2 {t['int4_pdl2']*1e3:.1f}  ratio {row['ratio_int4']:.2f} -> {row['ratio_int4_pdl']:.2f}", flush=True)
    set_pdl(False)
    report["rows"] = rows
    report["checks_ok"] = ok
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("checks", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
