"""The grouped family's MoE backward, product by product, on the `moe` sweep's slowest backward cases (GPU):

    PYTHONPATH=src python3 tools/grouped_bwd_probe.py --out $OUT/grouped-bwd-probe.json
    PYTHONPATH=src python3 tools/grouped_bwd_probe.py --boundary --out ...   # and 4 cases about auto's threshold
    PYTHONPATH=src TRITON_INTERPRET=1 python3 tools/grouped_bwd_probe.py --smoke   # CPU, interpreter, tiny sizes

The five cases the bf16 `--mode bwd --cuda-graph` sweep ran slowest (deepseek_v2_lite gate_up 16384 tokens,
mixtral gate_up 4096, mixtral down 16384, mixtral gate_up 16384, mixtral down 4096), built by the grouped bench's
own code (``GroupedBench.prepare``: its routing, group sizes and operands), bf16. For each, GPU microseconds per
call as CUDA-graph replays (``tilegemm.bench.runner.graph_us_per_call``) of:

- dA = grouped(dY, B^T) (2-D x 3-D): ``F.grouped_mm``, tilegemm ``tiled``, tilegemm ``tma`` (auto's kernel);
- dB = grouped(A^T, dY) (2-D x 2-D, groups along K): ``F.grouped_mm``, tilegemm ``tiled``, tilegemm ``tma_k``;
- the whole backward (``torch.autograd.grad`` of the forward's output, the forward outside the timing):
  ``tilegemm.grouped_mm`` (auto) against ``F.grouped_mm``.

Every candidate's result is checked against an fp32 reference (a loop of fp32 products, TF32 off) before it is
timed; a failing one is reported and not timed. The table printed last gives the times and F.grouped_mm's time
over tilegemm's (above 1: tilegemm faster). ``--smoke`` runs a tiny case under the interpreter on the CPU (times
there are host seconds, not GPU performance; F.grouped_mm is CUDA only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import tilegemm
from tilegemm.core.checks import relative_error
from tilegemm.ops.grouped import tma_k
from tilegemm.ops.grouped.bench import GroupedBench
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

CASES = ("deepseek_v2_lite/gate_up/t16384", "mixtral/gate_up/t4096", "mixtral/down/t16384",
         "mixtral/gate_up/t16384", "mixtral/down/t4096")
# --boundary adds cases about auto's threshold for tma_k (dispatch.TMA_K_MIN_TOKENS_PER_GROUP): Qwen3-30B-A3B at 4096
# tokens (256), DeepSeek-V2-Lite down at 4096 (384), Mixtral gate/up at 512 (128: tiled in auto)
BOUNDARY = ("qwen3_30b_a3b/gate_up/t4096", "qwen3_30b_a3b/down/t4096", "deepseek_v2_lite/down/t4096",
            "mixtral/gate_up/t512")
# kernel tma_k's shipped config (tma_k.config) runs as "tma_k"; these other configs of it are timed on dB as well
# (the table after the main one), to pick its tile on the GPU: BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, programs
# an SM (98 KB of shared memory a program at 128 x 128 x 64 x 3 stages: two fit an SM; 197 KB at 128 x 256 x 4)
VARIANTS = {"128x256x64 s4": (128, 256, 64, 4, 8, 1), "128x128x64 s3 2/SM": (128, 128, 64, 3, 8, 2),
            "128x128x64 s4 w4": (128, 128, 64, 4, 4, 1)}
SMOKE_SHAPE = "4,2,32,24,160,gate_up"  # 4 experts, top 2, hidden 32, intermediate 24, 160 tokens
DTYPE = "bf16"


def timer(cuda: bool, calls: int, reps: int):
    """GPU microseconds a call as CUDA-graph replays, or (the CPU smoke run) host microseconds of one call."""
    if cuda:
        from tilegemm.bench.runner import graph_us_per_call

        return lambda fn: graph_us_per_call(fn, calls=calls, reps=reps)

    def host(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    return host


def case_inputs(bench: GroupedBench, name: str, device: str):
    """(a, b, offs, dy, group sizes) of a case as the bench's sweep builds it (``mode=bwd``)."""
    if name.startswith("custom"):
        case = bench.parse_shape(SMOKE_SHAPE)
    else:
        case = next((c for c in bench.sweeps["moe"]() if c.label == name), None)
        if case is None:
            raise SystemExit(f"no moe case {name!r}: names are MODEL/PRODUCT/tTOKENS, e.g. mixtral/down/t4096")
    prepared = bench.prepare(case, DTYPE, device, 1, {"mode": "bwd"})
    inputs = prepared.sets[0]
    del prepared  # (its fp64 reference)
    sizes = bench._dims(case)[4]
    return inputs["a"], inputs["b"], inputs["offs"], inputs["dy"], sizes


def probe(name: str, device: str, time_us, calls_note: str, calls: int, reps: int) -> dict:
    bench = GroupedBench()
    a, b, offs, dy, sizes = case_inputs(bench, name, device)
    cuda = device == "cuda"
    tol = tolerance(torch.bfloat16)
    F = torch.nn.functional
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in full fp32
    try:
        ref = {"dA": grouped_mm_reference(dy, b.transpose(-2, -1), offs, dtype=torch.float32),
               "dB": grouped_mm_reference(a.transpose(-2, -1), dy, offs, dtype=torch.float32)}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    bt, at = b.transpose(-2, -1), a.transpose(-2, -1)
    products = {
        "dA": {"F.grouped_mm": (lambda: F.grouped_mm(dy, bt, offs=offs)) if cuda else None,
               "tiled": lambda: tilegemm.grouped_mm(dy, bt, offs=offs, kernel="tiled"),
               "tma": lambda: tilegemm.grouped_mm(dy, bt, offs=offs, kernel="tma")},
        "dB": {"F.grouped_mm": (lambda: F.grouped_mm(at, dy, offs=offs)) if cuda else None,
               "tiled": lambda: tilegemm.grouped_mm(at, dy, offs=offs, kernel="tiled"),
               "tma_k": lambda: tilegemm.grouped_mm(at, dy, offs=offs, kernel="tma_k")},
    }
    for label, (bm, bn, bk, stages, warps, per_sm) in VARIANTS.items():
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PROGRAMS_PER_SM=per_sm, num_warps=warps,
                   num_stages=stages)
        if not cuda:  # (the interpreter: small tiles, the grid of one program)
            cfg.update(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
        products["dB"][f"tma_k {label}"] = lambda cfg=cfg: tma_k_with(at, dy, offs, cfg)
    row = {"case": name, "groups": len(sizes), "tokens_per_group": sum(sizes) / len(sizes),
           "M_tokens": a.shape[0], "K": a.shape[1], "N": dy.shape[1], "timing": calls_note}
    for what, candidates in products.items():
        for kernel, fn in candidates.items():
            key = f"{what}/{kernel}"
            if fn is None:
                row[key] = {"skipped": "F.grouped_mm runs on CUDA only"}
                continue
            try:
                err = relative_error(fn(), ref[what])
            except Exception as e:  # noqa: BLE001  (a refusal or a failure: reported, not timed)
                row[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            row[key] = {"rel_err": err, "ok": err <= tol}
            if err <= tol:
                row[key]["us"] = time_us(fn)
            del fn
    # the whole backward through autograd (the forward outside the timing; retain_graph to call it again)
    for label, forward in (("tilegemm auto", lambda x, w: tilegemm.grouped_mm(x, w, offs=offs)),
                           ("F.grouped_mm", (lambda x, w: F.grouped_mm(x, w, offs=offs)) if cuda else None)):
        key = f"bwd/{label}"
        if forward is None:
            row[key] = {"skipped": "F.grouped_mm runs on CUDA only"}
            continue
        x = a.detach().requires_grad_()
        w = b.detach().requires_grad_()
        try:
            if cuda:
                us, err, how = autograd_graph_us(forward, x, w, dy, ref, calls, reps)
            else:
                start = time.perf_counter()
                ga, gb = torch.autograd.grad(forward(x, w), (x, w), dy)
                us, how = (time.perf_counter() - start) * 1e6, "host, forward and backward"
                err = max(relative_error(ga, ref["dA"]), relative_error(gb, ref["dB"]))
        except Exception as e:  # noqa: BLE001
            row[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        row[key] = {"rel_err": err, "ok": err <= tol, "timing": how}
        if err <= tol:
            row[key]["us"] = us
    if cuda:
        torch.cuda.empty_cache()
    return row


def tma_k_with(a, b, offs, cfg: dict) -> torch.Tensor:
    """dB on kernel tma_k with config ``cfg``: a fresh output, as a call of grouped_mm makes."""
    out = torch.empty(offs.shape[0], a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    tma_k.run(make_problem("2d2d", offs.shape[0], a, b, offs, None, out), dict(cfg))
    return out


def autograd_graph_us(forward, x, w, dy, ref, calls: int, reps: int):
    """(GPU microseconds, relative error, how timed) of ``torch.autograd.grad(forward(x, w), (x, w), dy)``, the
    forward outside the timing: forward and backward run on one side stream, which then captures ``calls``
    backward calls in a CUDA graph (autograd runs a backward op on its forward op's stream, so that stream must be
    the capturing one), replayed ``reps`` times. Where the capture fails, CUDA events around eager calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = forward(x, w)
        grads = lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)  # noqa: E731
        ga, gb = grads()
        err = max(relative_error(ga, ref["dA"]), relative_error(gb, ref["dB"]))
        del ga, gb
        torch.cuda.synchronize()
        how = f"CUDA graph of the backward, {calls} calls x {reps} replays"
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                for _ in range(calls):
                    grads()
            graph.replay()
            run, n = graph.replay, reps * calls
            per = calls
        except Exception as e:  # noqa: BLE001  (a capture autograd refuses: time it eagerly)
            how = f"eager (CUDA events; capture failed: {type(e).__name__}: {e})"[:300]
            run, n, per = grads, reps * calls, 1
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n // per):
            run()
        end.record()
        end.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    return start.elapsed_time(end) * 1e3 / n, err, how


def cell(row, key):
    v = row.get(key, {})
    if "us" in v and v["us"] is not None:
        return f"{v['us']:9.1f}"
    if "error" in v:
        return "    error"
    if v.get("ok") is False:
        return "    WRONG"
    return "        -"


def ratio(row, theirs, ours):
    t, o = row.get(theirs, {}).get("us"), row.get(ours, {}).get("us")
    return f"{t / o:5.2f}x" if t and o else "    -"


def table(rows, unit):
    print(f"\nmicroseconds a call ({unit}); ratio = F.grouped_mm / tilegemm (above 1: tilegemm faster)")
    print(f"{'case':34s} | {'dA F':>9s} {'tiled':>9s} {'tma':>9s} {'ratio':>6s} | {'dB F':>9s} {'tiled':>9s} "
          f"{'tma_k':>9s} {'ratio':>6s} | {'bwd F':>9s} {'auto':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['case']:34s} | {cell(r, 'dA/F.grouped_mm')} {cell(r, 'dA/tiled')} {cell(r, 'dA/tma')} "
              f"{ratio(r, 'dA/F.grouped_mm', 'dA/tma'):>6s} | {cell(r, 'dB/F.grouped_mm')} {cell(r, 'dB/tiled')} "
              f"{cell(r, 'dB/tma_k')} {ratio(r, 'dB/F.grouped_mm', 'dB/tma_k'):>6s} | "
              f"{cell(r, 'bwd/F.grouped_mm')} {cell(r, 'bwd/tilegemm auto')} "
              f"{ratio(r, 'bwd/F.grouped_mm', 'bwd/tilegemm auto'):>6s}")


def variants_table(rows):
    print("\ndB on tma_k by config (microseconds a call; the shipped one first)")
    names = ["tma_k"] + [f"tma_k {v}" for v in VARIANTS]
    print(f"{'case':34s} | " + " ".join(f"{n[6:] or 'shipped':>18s}" for n in names))
    for r in rows:
        print(f"{r['case']:34s} | " + " ".join(f"{cell(r, 'dB/' + n):>18s}" for n in names))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--smoke", action="store_true", help="a tiny case under the interpreter on the CPU")
    parser.add_argument("--calls", type=int, default=4, help="calls captured in one CUDA graph")
    parser.add_argument("--reps", type=int, default=5, help="replays of the graph timed")
    parser.add_argument("--boundary", action="store_true", help="also the cases about auto's threshold (BOUNDARY)")
    parser.add_argument("--cases", help="comma-separated moe case names (default: the five above), e.g. "
                                        "qwen3_30b_a3b/down/t4096")
    args = parser.parse_args()
    if args.smoke:
        device, cases = "cpu", ("custom/" + SMOKE_SHAPE,)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --smoke for the interpreter on the CPU)")
        device, cases = "cuda", tuple(args.cases.split(",")) if args.cases else CASES
        if args.boundary:
            cases += BOUNDARY
    note = f"CUDA graph, {args.calls} calls x {args.reps} replays" if device == "cuda" else "host, one call"
    time_us = timer(device == "cuda", args.calls, args.reps)
    rows = []
    for name in cases:
        start = time.perf_counter()
        rows.append(probe(name, device, time_us, note, args.calls, args.reps))
        rows[-1]["probe_s"] = time.perf_counter() - start
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                       "dtype": DTYPE, "rows": rows}, f, indent=1)
    variants_table(rows)
    table(rows, note)
    bad = [(r["case"], k) for r in rows for k, v in r.items() if isinstance(v, dict) and (v.get("ok") is False
                                                                                       or "error" in v)]
    if bad:
        print(f"\nFAILED checks (not timed): {bad}")


if __name__ == "__main__":
    main()
