"""The grouped family's kernels and configs on the ``moe`` sweep's weakest cases, timed as CUDA graphs (GPU).

    PYTHONPATH=src python3 tools/grouped_candidates.py --out $OUT/grouped-candidates.json [--budget 150]
        [--cases weak|all|NAME,...] [--dtype bf16|fp16]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/grouped_candidates.py --smoke --out /tmp/gc.json   # CPU

For each case, the forward (2-D x 3-D, the MoE experts' product) with the grouped bench's own inputs: its seeded,
skewed routing (``bench.group_sizes``: the same group sizes as the sweep), experts stored ``[E, N, K]`` and read
through their transpose, a ``[M, K]``. Rows of the field:

- ``loop`` (torch.mm over the non-empty groups) and ``F.grouped_mm``: the bench's two baselines (its ``_loop`` and
  ``second_baseline``); ``baseline`` below is the faster of the two here, as in the bench;
- ``auto``: ``tilegemm.grouped_mm`` as a user calls it (the kernel and config ``dispatch`` picks are recorded);
- ``tiled ...`` and ``tma ...``: each kernel by name through its launcher's config override (``run(p, config)``)
  on a grid around the config it would take for the case (``configs.choose_config``, ``configs.tma_config``):
  tile sizes, stages, warps, the group-M swizzle, tiled's K split, and tma's ``PROGRAMS_PER_SM``;
- ``gluon ...``: the warp-specialized kernel (where it takes the case) on each of its rings and two swizzle bands.

Each row is first run once and checked against an fp32 reference (``grouped_mm_reference`` in fp32, fp32
matmuls not in tf32): a relative error over the family's tolerance, NaN, or an exception (an out-of-resources
compile, say) records the row as failed, untimed. Then it is timed as replays of a CUDA graph of back-to-back
calls (``tilegemm.bench.runner.graph_us_per_call``; calls and replays sized to about 60 ms a row): GPU time, no
host. Unlike the bench's graph timing, one input set is replayed (the weights of these cases are 0.2-1.9 GB, past
L2 anyway; a, at most 0.27 GB, may partly stay in the 60 MB L2 at 512 tokens: the same for every row).

The work runs in passes under ``--budget`` seconds (compiles included; the default 150 keeps one run under 3
minutes on an H200): first every case's baselines, ``auto`` and a few core candidates, then the rest of the grid
case by case (weakest first), then a second timing of each case's baseline, auto and best row (the table reports
the least of a row's timings). Whatever the budget leaves out is marked ``skipped``. The JSON (``--out``) is
rewritten after every case of every pass; the last lines printed are a table: per case the baseline, auto and the
best candidate with its config, ratios against the baseline (above 1: faster).

``--cases``: ``weak`` (the default: the cases under 1.05x in the H200's graph run of the sweep,
``benchmarks/results/2026-12-03-h200/f592b34/grouped-moe-bf16-graph.json.xz``, weakest first), ``all`` (the whole
``moe`` sweep), or names such as ``mixtral/gate_up/t512`` or ``E,TOPK,H,I,T,product`` shapes (``8x2x4096x14336x512x
gate_up``: the bench's ``--shape`` syntax with ``x`` in place of commas), comma-separated. ``--smoke``: the bench's
``tiny`` cases on the CPU under ``TRITON_INTERPRET=1`` (times are the interpreter's, meaningless; the checks and
the JSON are the point).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from tilegemm.core.checks import relative_error
from tilegemm.core.runtime import interpreting
from tilegemm.ops.grouped import configs, dispatch
from tilegemm.ops.grouped.api import grouped_mm
from tilegemm.ops.grouped.bench import GroupedBench, _moe_cases, _tiny_cases
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

# The sweep's cases under 1.05x in f592b34's graph run (bf16 forward, auto against the faster baseline), weakest
# first: Mixtral's eight large experts, and DeepSeek-V2-Lite's gate/up at 16384 tokens.
WEAK = (
    ("mixtral/down/t4096", 0.89), ("mixtral/gate_up/t512", 0.93), ("mixtral/gate_up/t64", 0.94),
    ("mixtral/gate_up/t4096", 0.96), ("mixtral/down/t16384", 0.96), ("mixtral/gate_up/t1", 0.97),
    ("mixtral/down/t512", 1.00), ("mixtral/gate_up/t16384", 1.01), ("mixtral/gate_up/t8", 1.02),
    ("deepseek_v2_lite/gate_up/t16384", 1.05),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNELS = ("tiled", "tma", "gluon")  # the kernels timed by name
TARGET_MS = 60.0  # GPU time a row's graph replays take, about
GRAPH_MEMORY = 8 << 30  # outputs a graph of allocating calls (auto, the baselines) may hold, at most


# --- cases and their inputs -------------------------------------------------------------------------------------


def pick_cases(spec: str, smoke: bool) -> list:
    bench = GroupedBench()
    if smoke:
        return [c for c in _tiny_cases() if c.dims["kind"] == 0]
    known = {c.label: c for c in _moe_cases()}
    if spec == "weak":
        return [known[name] for name, _ in WEAK]
    if spec == "all":
        return list(known.values())
    cases = []
    for name in spec.split(","):
        name = name.strip()
        if name in known:
            cases.append(known[name])
        else:
            case = bench.parse_shape(name)  # raises BenchError naming the expected forms
            if case.dims["kind"] != 0:
                raise SystemExit(f"{name!r}: a MoE product (E,TOPK,H,I,T,product), not a batched one")
            cases.append(case)
    return cases


class Inputs:
    """One case's operands (as the bench makes them: experts ``[E, N, K]``, b their transpose), its fp32
    reference and the bench's baseline inputs."""

    def __init__(self, case, dtype, device):
        self.case = case
        G, M, N, K, sizes = GroupedBench()._dims(case)
        self.G, self.M, self.N, self.K, self.sizes = G, M, N, K, sizes
        gen = torch.Generator(device=device).manual_seed(2026)
        weight = (torch.randn(G, N, K, device=device, generator=gen) / math.sqrt(K)).to(dtype)
        self.a = torch.randn(M, K, device=device, generator=gen).to(dtype)
        self.b = weight.transpose(1, 2)
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
        self.offs = ends.to(device=device, dtype=torch.int32)
        bounds = [(g, int(hi) - n, int(hi)) for g, (n, hi) in enumerate(zip(sizes, ends.tolist())) if n]
        self.bench_inputs = dict(kind="moe", mode="fwd", a=self.a, b=self.b, offs=self.offs, bounds=bounds,
                                 precision="ieee")
        old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            self.ref = grouped_mm_reference(self.a, self.b, self.offs, dtype=torch.float32)
        finally:
            torch.set_float32_matmul_precision(old)
        self.tol = tolerance(dtype)

    def problem(self, out=None):
        out = torch.empty(self.M, self.N, dtype=self.a.dtype, device=self.a.device) if out is None else out
        return make_problem("2d3d", self.G, self.a, self.b, self.offs, None, out)

    def describe(self) -> dict:
        return dict(case=self.case.label, dims=self.case.dims, G=self.G, M=self.M, N=self.N, K=self.K,
                    sizes=self.sizes, rows_per_expert=self.M / self.G)


# --- the field --------------------------------------------------------------------------------------------------


def _valid(cfg: dict, smoke: bool) -> bool:
    least = 16  # tl.dot's least tile side
    if min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) < least or cfg["num_stages"] < 1:
        return False
    if not smoke and (cfg["BLOCK_N"] > 256 or cfg["BLOCK_K"] > 128 or cfg["BLOCK_M"] > 128
                      or cfg["num_stages"] > 6 or cfg["num_stages"] < 2):
        return False
    return cfg.get("SPLIT_K", 1) >= 1


def tiled_field(base: dict, K: int, smoke: bool) -> list[tuple[str, dict]]:
    """(pass, config) around tiled's own config: one knob at a time, and the tile size a step either way."""
    bm, bn, bk, st, sp = base["BLOCK_M"], base["BLOCK_N"], base["BLOCK_K"], base["num_stages"], base["SPLIT_K"]

    def warps(m, n):  # tiled's own rule (configs.choose_config)
        return 8 if m * n >= 128 * 128 else 4

    field = [
        ("core", {}),
        ("core", dict(BLOCK_M=bm // 2, num_warps=warps(bm // 2, bn), num_stages=3 if bm // 2 >= 64 else 4)),
        ("grid", dict(BLOCK_M=bm * 2, num_warps=warps(bm * 2, bn), num_stages=3 if bm * 2 >= 64 else 4)),
        ("grid", dict(BLOCK_N=bn * 2, num_warps=warps(bm, bn * 2))),
        ("grid", dict(BLOCK_N=bn // 2, num_warps=warps(bm, bn // 2))),
        ("grid", dict(BLOCK_M=bm // 2, BLOCK_N=bn * 2, num_warps=warps(bm // 2, bn * 2))),
        ("grid", dict(BLOCK_K=bk * 2, num_stages=max(st - 1, 2))),
        ("grid", dict(BLOCK_K=bk // 2, num_stages=st + 1)),
        ("grid", dict(num_stages=st + 1)),
        ("grid", dict(num_stages=st - 1)),
        ("grid", dict(num_warps=4 if base["num_warps"] == 8 else 8)),
        ("grid", dict(GROUP_M=4)),
        ("grid", dict(GROUP_M=16)),
    ]
    if -(-K // bk) >= 2 * 4 * sp:  # a K split while slices keep 4+ steps
        field.append(("grid", dict(SPLIT_K=sp * 2)))
    if sp > 1:
        field.append(("grid", dict(SPLIT_K=sp // 2)))
    return [(ps, dict(base, **change)) for ps, change in field if _valid(dict(base, **change), smoke)]


def tma_field(base: dict, smoke: bool) -> list[tuple[str, dict]]:
    """(pass, config) around tma's own config: narrower and shorter tiles (more units: the waves of a few hundred
    tiles), two programs an SM, stages, the swizzle's band."""
    bm, bn, bk, st = base["BLOCK_M"], base["BLOCK_N"], base["BLOCK_K"], base["num_stages"]
    half_m = dict(BLOCK_M=bm // 2, num_warps=4)  # one warp group a tile
    field = [
        ("core", {}),
        ("core", dict(BLOCK_N=bn // 2, num_stages=st + 1)),
        ("core", dict(FLATTEN=True)),  # the tile loop fused into the K loop: the next tile's loads start early
        ("core", dict(FLATTEN=True, num_stages=st - 1)),
        ("core", dict(FLATTEN=True, BLOCK_N=bn // 2, num_stages=st + 1)),
        ("grid", dict(num_stages=st + 1)),
        ("grid", dict(num_stages=st - 1)),
        ("grid", dict(GROUP_M=4)),
        ("grid", dict(GROUP_M=16)),
        ("grid", dict(BLOCK_N=bn // 2, PROGRAMS_PER_SM=2)),
        ("grid", dict(BLOCK_N=bn // 2, BLOCK_K=bk * 2)),
        ("grid", dict(half_m, num_stages=st + 1)),
        ("grid", dict(half_m, BLOCK_N=bn // 2, num_stages=st + 1, PROGRAMS_PER_SM=2)),
    ]
    return [(ps, dict(base, **change)) for ps, change in field if _valid(dict(base, **change), smoke)]


def _gluon_module():
    """:mod:`tilegemm.ops.grouped.gluon`, or None where Gluon does not import."""
    try:
        from tilegemm.ops.grouped import gluon
    except ImportError:
        return None
    return gluon


def gluon_field(module, base: dict) -> list[tuple[str, dict]]:
    """(pass, config) of kernel ``gluon``: its own config first, then its other rings and the swizzle's band."""
    field = [("core", base)] + [("core", dict(c)) for c in module.configs() if c != base]
    field += [("grid", dict(base, GROUP_M=4)), ("grid", dict(base, GROUP_M=16))]
    return field


def label(kernel: str, cfg: dict) -> str:
    short = dict(BLOCK_M="m", BLOCK_N="n", BLOCK_K="k", GROUP_M="g", SPLIT_K="split", num_warps="w",
                 num_stages="s", PROGRAMS_PER_SM="per_sm", FLATTEN="flat", STAGES="s", SHARED_OUT="shared_out")
    parts = [f"{short.get(k, k)}{v}" for k, v in cfg.items() if not (k in ("SPLIT_K", "PROGRAMS_PER_SM") and v == 1)]
    return f"{kernel} " + " ".join(parts)


def field_of(inp: Inputs, smoke: bool) -> list[dict]:
    """Every row of a case: name, kernel, config, pass, and a function returning the output."""
    rows = [dict(name="loop", kernel="loop", config=None, stage="core",
                 fn=lambda: GroupedBench()._loop(inp.bench_inputs, None)),
            dict(name="F.grouped_mm", kernel="F.grouped_mm", config=None, stage="core",
                 fn=lambda: torch.nn.functional.grouped_mm(inp.a, inp.b, offs=inp.offs)),
            dict(name="auto", kernel="auto", config=None, stage="core",
                 fn=lambda: grouped_mm(inp.a, inp.b, offs=inp.offs))]
    p = inp.problem()
    seen = set()
    from tilegemm.ops.grouped import tiled, tma

    kernels = [("tiled", tiled, tiled_field(configs.choose_config(p), inp.K, smoke))]
    if tma.why_not(p) is None:
        kernels.append(("tma", tma, tma_field(configs.tma_config(p), smoke)))
    gl_module = _gluon_module()
    if gl_module is not None and gl_module.why_not(p) is None:
        kernels.append(("gluon", gl_module, gluon_field(gl_module, gl_module.config(p))))
    for kernel, module, field in kernels:
        for stage, cfg in field:
            key = (kernel, tuple(sorted(cfg.items())))
            if key in seen:
                continue
            seen.add(key)
            rows.append(dict(name=label(kernel, cfg), kernel=kernel, config=cfg, stage=stage,
                             fn=_launcher(inp, module, cfg)))
    return rows


class _launcher:
    """A call of ``module.run`` with ``cfg`` into an output of its own, made at the first call (NaN, so a tile left
    unwritten fails the check) and dropped by :meth:`release` (the field of a large case would not fit at once)."""

    def __init__(self, inp: Inputs, module, cfg: dict):
        self.inp, self.module, self.cfg, self.p = inp, module, cfg, None

    def __call__(self):
        if self.p is None:
            inp = self.inp
            self.p = inp.problem(torch.full((inp.M, inp.N), float("nan"), dtype=inp.a.dtype, device=inp.a.device))
        self.module.run(self.p, dict(self.cfg))
        return self.p.out

    def release(self):
        self.p = None


# --- checking and timing ------------------------------------------------------------------------------------------


def event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_us(fn, out_bytes: int, smoke: bool) -> float:
    """GPU microseconds a call (a CUDA graph of back-to-back calls, replayed); the host's on the CPU."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from tilegemm.bench.runner import graph_us_per_call

    ms = max(event_ms(fn), 1e-3)
    calls = int(max(1, min(20, 15.0 / ms, GRAPH_MEMORY // max(out_bytes, 1))))
    reps = int(max(3, min(20, TARGET_MS / (calls * ms))))
    return graph_us_per_call(fn, calls=calls, reps=reps)


def run_row(row: dict, inp: Inputs, smoke: bool) -> None:
    """Check ``row`` against the fp32 reference, then time it; fills status, rel_err, us (or error)."""
    try:
        _check_and_time(row, inp, smoke)
    finally:
        getattr(row["fn"], "release", lambda: None)()


def _check_and_time(row: dict, inp: Inputs, smoke: bool) -> None:
    out_bytes = inp.M * inp.N * inp.a.element_size()
    t0 = time.monotonic()
    try:
        out = row["fn"]()
        if not smoke:
            torch.cuda.synchronize()
        err = relative_error(out, inp.ref)
    except Exception as e:  # noqa: BLE001 - a candidate that fails (resources, refusals) is a row, not the end
        row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}", seconds=time.monotonic() - t0)
        return
    row["rel_err"] = err
    if not err <= inp.tol:
        row.update(status="wrong", error=f"relative error {err:.3e} > {inp.tol:.1e}", seconds=time.monotonic() - t0)
        return
    try:
        row.setdefault("times_us", []).append(time_us(row["fn"], out_bytes, smoke))
    except Exception as e:  # noqa: BLE001 - e.g. a baseline a graph cannot capture
        row.update(status="error", error=f"timing: {type(e).__name__}: {str(e)[:300]}")
        return
    row.update(status="ok", us=min(row["times_us"]), seconds=row.get("seconds", 0.0) + time.monotonic() - t0)


def retime(row: dict, inp: Inputs, smoke: bool) -> None:
    if row.get("status") == "ok":
        try:
            row["times_us"].append(time_us(row["fn"], inp.M * inp.N * inp.a.element_size(), smoke))
        finally:
            getattr(row["fn"], "release", lambda: None)()
        row["us"] = min(row["times_us"])


# --- the run ------------------------------------------------------------------------------------------------------


def summary(entry: dict) -> dict:
    """Baseline (the faster of the two), auto, and the best kernel row of a case, with ratios."""
    rows = {r["name"]: r for r in entry["rows"]}
    base = [rows[n] for n in ("loop", "F.grouped_mm") if rows.get(n, {}).get("status") == "ok"]
    base = min(base, key=lambda r: r["us"]) if base else None
    auto = rows.get("auto") if rows.get("auto", {}).get("status") == "ok" else None
    cands = [r for r in entry["rows"] if r["kernel"] in KERNELS and r.get("status") == "ok"]
    best = min(cands, key=lambda r: r["us"]) if cands else None
    own = {}  # each kernel by name on the config it takes for the case (its field's first row)
    for r in entry["rows"]:
        if r["kernel"] in KERNELS and r["kernel"] not in own:
            own[r["kernel"]] = r
    for kernel, r in own.items():
        if base and r.get("status") == "ok":
            own[kernel] = base["us"] / r["us"]
        else:
            own[kernel] = None
    s = dict(baseline=base and base["name"], baseline_us=base and base["us"], auto_us=auto and auto["us"],
             tiled_own_ratio=own.get("tiled"), tma_own_ratio=own.get("tma"), gluon_own_ratio=own.get("gluon"),
             best=best and best["name"], best_kernel=best and best["kernel"], best_config=best and best["config"],
             best_us=best and best["us"])
    if base and auto:
        s["auto_ratio"] = base["us"] / auto["us"]
    if base and best:
        s["best_ratio"] = base["us"] / best["us"]
    if auto and best:
        s["best_over_auto"] = auto["us"] / best["us"]
    return s


def public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "fn"}


def write(path: str, meta: dict, entries: list[dict]) -> None:
    doc = dict(meta, elapsed_s=time.monotonic() - meta["_start"],
               cases=[dict({k: v for k, v in e.items() if k not in ("rows", "inputs")},
                           rows=[public(r) for r in e["rows"]], summary=summary(e)) for e in entries])
    doc.pop("_start")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def table(entries: list[dict]) -> None:
    """Per case: the faster baseline, auto (its kernel) and the best candidate, times and ratios to the baseline."""
    print()
    print("ratios: the baseline's time over the row's (above 1: faster); tiled, tma, gluon: each kernel by name on the")
    print("config it takes for the case; best: the fastest checked candidate; /auto: auto's time over the best's")
    print(f"{'case':32s} {'baseline us':>22s} {'auto us':>10s} {'auto':>5s} {'kernel':>6s} {'tiled':>5s} "
          f"{'tma':>5s} {'gluon':>5s} {'best us':>10s} {'best':>5s} {'/auto':>5s}  best candidate")
    logs = {"auto": [], "best": []}
    for e in entries:
        s = summary(e)
        f = lambda key, fmt: format(s[key], fmt) if s.get(key) is not None else "-"  # noqa: E731
        base = f"{f('baseline_us', '.1f')} {s['baseline'] or ''}"
        print(f"{e['case']:32s} {base:>22s} {f('auto_us', '.1f'):>10s} {f('auto_ratio', '.2f'):>5s} "
              f"{e['auto_kernel']:>6s} {f('tiled_own_ratio', '.2f'):>5s} {f('tma_own_ratio', '.2f'):>5s} "
              f"{f('gluon_own_ratio', '.2f'):>5s} {f('best_us', '.1f'):>10s} {f('best_ratio', '.2f'):>5s} {f('best_over_auto', '.2f'):>5s}  "
              f"{s['best'] or '-'}")
        for k in logs:
            if s.get(f"{k}_ratio") is not None:
                logs[k].append(math.log(s[f"{k}_ratio"]))
    for k, v in logs.items():
        if v:
            print(f"geomean {k} vs baseline: {math.exp(sum(v) / len(v)):.3f}x over {len(v)} cases, "
                  f"worst {math.exp(min(v)):.3f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON written after every case")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the whole run, compiles included")
    ap.add_argument("--cases", default="weak", help="weak, all, or case names / E,TOPK,H,I,T,product shapes")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--smoke", action="store_true", help="the tiny cases on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    start = time.monotonic()
    if args.smoke and not interpreting():
        raise SystemExit("--smoke runs under Triton's interpreter: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or --smoke under TRITON_INTERPRET=1")
    device = "cpu" if args.smoke else "cuda"
    dtype = DTYPES[args.dtype]
    cases = pick_cases(args.cases, args.smoke)
    meta = dict(tool="tools/grouped_candidates.py", argv=sys.argv[1:] if argv is None else argv, dtype=args.dtype,
                budget_s=args.budget, timing="cpu wall (smoke)" if args.smoke else
                "tilegemm.bench.runner.graph_us_per_call (CUDA graph replays, one input set)", _start=start)
    try:
        from tilegemm.core.hardware import machine_info

        meta["machine"] = machine_info().to_dict()
    except Exception as e:  # noqa: BLE001 - the record's header only
        meta["machine"] = f"unavailable: {e}"
    over = lambda: time.monotonic() - start > args.budget  # noqa: E731
    entries = []

    def log(e, r):
        what = f"{r['us']:.1f} us" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error', '')[:80]}"
        print(f"[{time.monotonic() - start:6.1f}s] {e['case']:30s} {r['name']:44s} {what}", flush=True)

    # pass 1: every case's inputs, baselines, auto and core candidates
    for case in cases:
        if over():
            break
        inp = Inputs(case, dtype, device)
        p = inp.problem()
        auto_kernel = dispatch.choose(p)
        auto_config = configs.tma_config(p) if auto_kernel == "tma" else configs.choose_config(p)
        e = dict(inp.describe(), auto_kernel=auto_kernel, auto_config=auto_config,
                 tiled_config=configs.choose_config(p), inputs=inp, rows=field_of(inp, args.smoke))
        entries.append(e)
        for r in e["rows"]:
            if r["stage"] == "core":
                if over():
                    break
                run_row(r, inp, args.smoke)
                log(e, r)
        write(args.out, meta, entries)
    # pass 2: the rest of the grid, case by case, the cases that share compiled kernels together (the kernels
    # specialize on the number of experts and the configs, not on the sizes: a model's cases of one tiled tile)
    groups = [(e["G"], e["tiled_config"]["BLOCK_M"]) for e in entries]
    for e in sorted(entries, key=lambda e: groups.index((e["G"], e["tiled_config"]["BLOCK_M"]))):
        for r in e["rows"]:
            if "status" not in r:
                if over():
                    break
                run_row(r, e["inputs"], args.smoke)
                log(e, r)
        write(args.out, meta, entries)
    # pass 3: a second timing of each case's baseline, auto and best row
    for e in entries:
        s = summary(e)
        for name in {s["baseline"], "auto", s["best"]} - {None}:
            if over():
                break
            retime(next(r for r in e["rows"] if r["name"] == name), e["inputs"], args.smoke)
        write(args.out, meta, entries)
    for e in entries:
        for r in e["rows"]:
            r.setdefault("status", "skipped")
    write(args.out, meta, entries)
    table(entries)
    print(f"{time.monotonic() - start:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
