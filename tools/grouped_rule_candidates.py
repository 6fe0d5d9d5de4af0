"""``auto``'s rule variants on the grouped family's two open targets, timed as the bench times them (GPU).

    PYTHONPATH=src python3 tools/grouped_rule_candidates.py --out $OUT/grouped-rule-candidates.json
        [--parts moe,batched] [--budget 190] [--rounds 3] [--rep-ms 60] [--precompile 15]
    TILEGEMM_INTERPRET=1 PYTHONPATH=src python3 tools/grouped_rule_candidates.py --smoke --out /tmp/rc.json   # CPU

The targets (docs/grouped.md, "Measured"): the ``moe`` forward's worst case, Mixtral-8x7B's down projection at 4096
tokens (kernel ``gluon``'s 128-row tiles), and the ``batched`` sweep against ``torch.matmul`` (``tilegemm.matmul`` on
3-D operands). Cases:

- ``moe``: Mixtral's down projection at 512, 4096 and 16384 tokens, bf16 and fp16: the grouped bench's own cases
  (``GroupedBench``: its seeded, skewed routing, experts stored ``[E, N, K]``) and baselines (the faster of the cuBLAS
  loop and ``F.grouped_mm``, picked per case as the bench picks it; ``F.grouped_mm`` also its own row in bf16, where a
  CUDA graph captures it);
- ``batched``: the matmul bench's ``batched`` sweep (``MatmulBench``), fp16 NN, every case (the ones fine today catch
  regressions), the weakest first, against ``torch.matmul``.

Rows: the baselines, ``auto`` as shipped, and each candidate of :data:`MOE` / :data:`BATCHED`: ``auto`` with a few
module constants (knobs) set around each of its calls, so that a winner ships as those constants' change. Each row
records the route it took (kernel and config, as ``dispatch`` picks them under its knobs). Replay caches, untimed
config choices and ``dispatch``'s remembered decisions are dropped whenever the knobs change, so no row replays
another's launch or keeps another's choice.

Each row is checked first: one call, tilegemm's outputs NaN-poisoned (``set_poisoning``), against the bench's fp64
reference: the whole output's relative error and every 128 x 128 tile's (one tile of a partial sum left out barely
moves the whole) within the bench's tolerance. A wrong or failing tilegemm row is printed as FAILED, is not timed,
and makes the exit status 1. Then a case's rows are timed as the bench's ``--cuda-graph`` rows are
(``tilegemm.bench.runner.time_samples``: ``do_bench_cudagraph`` over input sets rotated past L2), ``--rounds`` rounds
in alternating order, ``--rep-ms`` in all a row, the median of its samples kept. ``--precompile J`` first compiles
every row's kernels (each row's call once on each case, nothing timed) in J spawned processes. The default run is
sized to about 3 minutes on one H200; cases not begun within ``--budget`` seconds are marked skipped.

The JSON (``--out``) is rewritten after every case; the last lines printed are a table a part: per case the
baseline's microseconds and each row's ratio to it (above 1: faster), then each column's geomean and worst.
``--smoke``: tiny cases on the CPU under the interpreter (the rules' GPU kernels do not run there; the checks, the
knobs' plumbing and the JSON are the point).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

from tilegemm.core.runtime import interpreting, set_poisoning

# --- the candidates ---------------------------------------------------------------------------------------------
# (name, why, knobs): each knob ("module", "NAME", value) is set while the row's calls run; a value may be a function
# of the module (a threshold relative to another constant). Modules by short name:
MODULES = {
    "grouped.configs": "tilegemm.ops.grouped.configs",
    "grouped.dispatch": "tilegemm.ops.grouped.dispatch",
    "matmul.dispatch": "tilegemm.ops.matmul.dispatch",
    "matmul.gluon_f16": "tilegemm.ops.matmul.gluon_f16",
}
GLUON_OFF = ("grouped.dispatch", "GLUON_FORWARD", False)
TAIL = ("grouped.configs", "TMA_TAIL_SPLIT", 4)
STAGES_3 = ("grouped.configs", "TMA_STAGES", 3)
MOE = (
    ("tma", "tma's 128-row tiles where gluon runs: their gap on Mixtral's experts was within the runs' noise",
     (GLUON_OFF,)),
    ("tma_s3", "the same, 3 stages: ahead of 4 at 16384 tokens in one run, behind in another", (GLUON_OFF, STAGES_3)),
    ("tail", "tma's tail split where auto runs tma (512 tokens: a third wave of 64-row units a fraction full)",
     (TAIL,)),
    ("tma_tail", "tma with its tail split where gluon runs (4096 tokens: a ninth wave a third full)",
     (GLUON_OFF, TAIL)),
    ("tma_s3_tail", "the same, 3 stages", (GLUON_OFF, STAGES_3, TAIL)),
    ("gluon_256x128", "gluon's 256 x 128 tile (cuBLAS's for large products), never timed",
     (("grouped.configs", "GLUON_BLOCK", (256, 128)),)),
    ("tma_half", "tma's 64-row tiles up to 2048 rows an expert, gluon above: half the rows a group wastes",
     (("grouped.configs", "TMA_HALF_TILE_MAX_ROWS", 2048),)),
)
NARROW = ("matmul.dispatch", "GLUON_F16_BATCHED_NARROW", True)
BATCHED = (
    ("narrow", "gluon_f16's batched launch for outputs narrower than NARROW_N too, its own tile rule",
     (NARROW,)),
    ("narrow_128", "the same, the 128x128 tile for N <= 128 (twice the work units of 256x128, no wasted columns)",
     (NARROW, ("matmul.gluon_f16", "BATCHED_NARROW_SMALL_TILE_N", 128))),
    ("small_m_split_k", "split_k's tiles (not persistent: several programs an SM, every tile in flight) for batches "
     "of at most SMALL_M rows: the small-M rule off",
     (("matmul.dispatch", "GLUON_F16_BATCHED_MIN_M", lambda m: m.SMALL_M + 1),)),
)
CANDIDATES = {"moe": MOE, "batched": BATCHED}

# Case order, weakest first: Mixtral's down projection at 4096 tokens is the target, the other two sizes its
# neighbours; the batched sweep's cases under 0.95x in the H200's graph run at 174f010
# (benchmarks/results/2026-12-04-h200/174f010/batched-fp16-NN-graph.json), then the rest.
MOE_CASES = ("mixtral/down/t4096", "mixtral/down/t512", "mixtral/down/t16384")
BATCHED_WEAK = ("1000x1000x1000/b4", "1024x64x1024/b32", "512x64x512/b64", "128x128x128/b256", "4096x128x4096/b8",
                "2048x128x2048/b32", "4096x4096x128/b8", "2048x2048x128/b32")
TILE = 128  # the side of the tiles each output's error is also checked by


# --- knobs ------------------------------------------------------------------------------------------------------


def module(short: str):
    return importlib.import_module(MODULES[short])


def knobs_of(part: str, name: str) -> tuple:
    return dict((n, k) for n, _, k in CANDIDATES[part]).get(name, ())


def describe(knobs: tuple) -> list[str]:
    out = []
    for short, attr, value in knobs:
        value = value(module(short)) if callable(value) else value
        out.append(f"{short}.{attr}={value!r}")
    return out


def forget() -> None:
    """Drop what a call under other knobs left behind: recorded replays, untimed config choices, matmul's
    remembered rule decisions."""
    from tilegemm.core import replay, tuning
    from tilegemm.ops.matmul import dispatch

    replay.clear()
    tuning.forget()
    dispatch._decisions.clear()


class Knobs:
    """``with Knobs(knobs):`` the module constants set for the block, then restored; the caches are dropped when
    the knobs differ from the last block's (:func:`forget`)."""

    current = None  # the knobs the caches' entries were made under

    def __init__(self, knobs: tuple):
        self.knobs = tuple(knobs)

    def __enter__(self):
        if Knobs.current != self.knobs:
            forget()
            Knobs.current = self.knobs
        self.saved = []
        for short, attr, value in self.knobs:
            m = module(short)
            if not hasattr(m, attr):
                raise AttributeError(f"{MODULES[short]} has no knob {attr}")
            self.saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, value(m) if callable(value) else value)
        return self

    def __exit__(self, *exc):
        for m, attr, value in reversed(self.saved):
            setattr(m, attr, value)


# --- cases, inputs and routes -----------------------------------------------------------------------------------


def bench_op(part: str):
    if part == "moe":
        from tilegemm.ops.grouped.bench import GroupedBench

        return GroupedBench()
    from tilegemm.ops.matmul.bench import MatmulBench

    return MatmulBench()


def cases_of(part: str, smoke: bool) -> list:
    if part == "moe":
        from tilegemm.ops.grouped.bench import _moe_cases, _tiny_cases

        if smoke:
            return [c for c in _tiny_cases() if c.dims["kind"] == 0 and c.dims["product"] == 1]
        known = {c.label: c for c in _moe_cases()}
        return [known[label] for label in MOE_CASES]
    from tilegemm.ops.matmul.bench import _batched_cases, _mnk

    if smoke:
        return [_mnk(17, 24, 32, b=3), _mnk(40, 16, 24, b=2)]
    cases = _batched_cases()
    weak = [c for label in BATCHED_WEAK for c in cases if c.label == label]
    return weak + [c for c in cases if c not in weak]


def compile_inputs(part: str, op, case, dtype: str, device: str) -> dict:
    """One input set of ``case`` without a reference (the shapes, strides and alignment pick the compiled
    kernels; the values do not matter): what a precompiling process calls."""
    if part == "batched":
        return op.precompile_inputs(case, dtype, device, {})
    G, M, N, K, sizes = op._dims(case)
    t = op.dtypes[dtype]
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    return dict(kind="moe", mode="fwd", precision="ieee", offs=offs, a=torch.zeros(M, K, dtype=t, device=device),
                b=torch.zeros(G, N, K, dtype=t, device=device).transpose(1, 2))


def _short(cfg: dict | None) -> str:
    """A config in a few characters, every key of it (rows of one route run the same launch: timed once)."""
    if not cfg:
        return ""
    names = dict(BLOCK_M="m", BLOCK_N="n", BLOCK_K="k", GROUP_M="g", num_warps="w", num_stages="s", STAGES="s",
                 SHARED_OUT="shared", TAIL_SPLIT="tail", SPLIT_K="split", SERPENTINE="serp", GLUON_F16="")
    return " ".join(f"{names.get(k, k)}{v}" for k, v in cfg.items() if not (k == "GLUON_F16" and v))


def route(part: str, inputs: dict) -> str:
    """The kernel and config ``auto`` picks for ``inputs`` under the knobs in force (what the row's call runs)."""
    if part == "moe":
        from tilegemm.ops.grouped import configs, dispatch
        from tilegemm.ops.grouped.problem import make_problem

        a, b, offs = inputs["a"], inputs["b"], inputs["offs"]
        p = make_problem("2d3d", b.shape[0], a, b, offs, None,
                         torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device))
        kernel = dispatch.choose(p)
        if kernel == "gluon":
            from tilegemm.ops.grouped import gluon

            cfg = gluon.config(p)
        else:
            cfg = configs.tma_config(p) if kernel == "tma" else configs.choose_config(p)
        return f"{kernel} {_short(cfg)}"
    from tilegemm.core import tuning
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.matmul import dispatch
    from tilegemm.ops.matmul.problem import make_problems

    a, b = inputs["a"], inputs["b"]
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    rung = dispatch.choose_kernel(p)
    if rung != "gluon_f16":
        return rung
    from tilegemm.ops.matmul import gluon_f16

    cfg = tuning.lookup(p.tuning_key("gluon_f16")) or gluon_f16.batched_config(p, sm_count(out.device))
    return f"gluon_f16 {_short(cfg)}"


# --- checking ---------------------------------------------------------------------------------------------------


def worst_tile_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error of any TILE x TILE tile of a 2-D output, or of any batch's (3-D)."""
    from tilegemm.core.checks import tile_errors

    if out.dim() == 2:
        return float(tile_errors(out, ref, TILE, TILE).max())
    return max(float(tile_errors(out[i], ref[i], TILE, TILE).max()) for i in range(out.shape[0]))


def check(row: dict, prepared, tol: float) -> None:
    """One call of ``row`` on the first input set, outputs NaN-poisoned: fills rel_err and tile_err, status
    wrong or error where it fails."""
    from tilegemm.core.checks import relative_error

    old = set_poisoning(True)
    try:
        with row["context"]():
            out = row["call"](prepared.sets[0])
        if row["kind"] == "baseline":
            row["rel_err"] = relative_error(out, prepared.reference)
            return  # (a baseline's error is recorded, never held to tilegemm's bound)
        row["rel_err"] = relative_error(out, prepared.reference)
        row["tile_err"] = worst_tile_error(out, prepared.reference)
        if not (row["rel_err"] <= tol and row["tile_err"] <= tol):
            row.update(status="wrong", error=f"relative error {row['rel_err']:.2e}, worst {TILE}x{TILE} tile "
                                             f"{row['tile_err']:.2e} (bound {tol:.1e})")
    except Exception as exc:  # noqa: BLE001 - a row that fails (a compile, a refusal) is reported, not the end
        lines = str(exc).strip().splitlines()  # (a compile error's last line says what went wrong)
        row.update(status="error", error=f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300])
    finally:
        set_poisoning(old)


# --- one case ---------------------------------------------------------------------------------------------------


def case_rows(part: str, op, dtype: str, device: str) -> list[dict]:
    """The rows of a case: baselines (calls and contexts as the bench's), auto, the candidates."""
    rows = [dict(name="torch.matmul" if part == "batched" else "baseline", kind="baseline", knobs=(),
                 call=lambda inputs: op.baseline(inputs, dtype), context=lambda: op.baseline_context(dtype))]
    if part == "moe" and device == "cuda" and dtype == "bf16" and op.second_baseline_reason(device) is None:
        # (outside bf16 F.grouped_mm's fallback reads offs on the host: no graph captures it)
        rows.append(dict(name="F.grouped_mm", kind="baseline", knobs=(),
                         call=lambda inputs: op.second_baseline(inputs, dtype),
                         context=lambda: op.baseline_context(dtype)))
    for name, knobs in [("auto", ())] + [(n, k) for n, _, k in CANDIDATES[part]]:
        def call(inputs, knobs=knobs):
            with Knobs(knobs):
                return op.run("auto", inputs, dtype)

        rows.append(dict(name=name, kind="auto" if name == "auto" else "candidate", knobs=knobs, call=call,
                         context=lambda: op.baseline_context(None)))
    return rows


def run_case(part: str, op, case, dtype: str, device: str, args, log) -> list[dict]:
    from tilegemm.bench.runner import _cycle, rotation_count, summarize, time_samples
    from tilegemm.core.hardware import machine_info

    graphs = device == "cuda"
    first = op.prepare(case, dtype, device, 1, {})
    n_sets = rotation_count(first.bytes_per_set, machine_info(), graphs)
    prepared = op.prepare(case, dtype, device, n_sets, {}) if n_sets > 1 else first
    tol = op.tolerance(dtype)
    rows = case_rows(part, op, dtype, device)
    for row in rows:
        row.update(part=part, case=case.label, dtype=dtype, status="ok", tol=tol)
        if row["kind"] != "baseline":
            with Knobs(row["knobs"]):
                try:
                    row["route"] = route(part, prepared.sets[0])
                except Exception as exc:  # noqa: BLE001 - the call's own check says what is wrong
                    row["route"] = f"? ({type(exc).__name__})"
        check(row, prepared, tol)
        if row["status"] != "ok" and row["kind"] != "baseline":
            log(f"FAILED {part} {case.label} {dtype} {row['name']}: {row['error']}")
    # a row whose route an earlier row of the case took runs the same launches: timed once, its twin's times copied
    seen = {}
    for row in rows:
        if row["kind"] != "baseline" and row["status"] == "ok" and not row.get("route", "?").startswith("?"):
            if row["route"] in seen:
                row["same_as"] = seen[row["route"]]["name"]
            else:
                seen[row["route"]] = row
    timed = [r for r in rows if r["status"] == "ok" and "same_as" not in r]
    samples = {id(r): [] for r in timed}
    for n in range(args.rounds):
        for row in (timed if n % 2 == 0 else timed[::-1]):
            if row["status"] != "ok":
                continue
            try:
                with row["context"]():
                    samples[id(row)] += time_samples(_cycle(prepared.sets, row["call"]), 0.0, args.rep_ms / args.rounds,
                                                     graphs)
            except Exception as exc:  # noqa: BLE001 - a launch failing while timed (a baseline a graph refuses)
                row.update(status="error", error=f"timing: {type(exc).__name__}: {str(exc)[:200]}")
    for row in timed:
        if row["status"] == "ok":
            ms, p20, p80 = summarize(samples[id(row)])
            row.update(us=ms * 1e3, us_p20=p20 * 1e3, us_p80=p80 * 1e3, samples=len(samples[id(row)]))
    for row in rows:
        twin = next((r for r in rows if r["name"] == row.get("same_as")), None)
        if twin is not None:
            row.update({k: twin[k] for k in ("us", "us_p20", "us_p80", "samples") if k in twin})
            if twin["status"] != "ok":
                row.update(status=twin["status"], error=f"as {twin['name']}: {twin.get('error', '')}")
    base = rows[0].get("us")
    auto = next((r.get("us") for r in rows if r["name"] == "auto"), None)
    for row in rows:
        if row.get("us"):
            row["ratio"] = base / row["us"] if base else None
            row["vs_auto"] = auto / row["us"] if auto else None
        what = f"{row['us']:9.1f} us" if row.get("us") else f"{row['status']}: {row.get('error', '')[:60]}"
        what += f" (= {row['same_as']})" if "same_as" in row else ""
        log(f"  {part} {case.label:22s} {dtype} {row['name']:16s} {what}  {row.get('route', '')}")
    del prepared, first
    return [public(r) for r in rows]


def public(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k not in ("call", "context", "knobs")}
    out["knobs"] = describe(row["knobs"])
    return out


# --- precompiling -----------------------------------------------------------------------------------------------


def _compile_group(jobs: list) -> list[str]:
    """A spawned process's share: each (part, case label, dtype, row name)'s call once (kernels into Triton's disk
    cache, nothing timed). Returns the failures, one line each."""
    from tilegemm.core.launch import ensure_allocator

    ensure_allocator()
    failed = []
    for part, label, dtype, name in jobs:
        try:
            op = bench_op(part)
            case = next(c for c in cases_of(part, False) if c.label == label)
            inputs = compile_inputs(part, op, case, dtype, "cuda")
            with Knobs(knobs_of(part, name)), op.baseline_context(None):
                op.run("auto", inputs, dtype)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the main process meets it again and reports it
            failed.append(f"{part} {label} {dtype} {name}: {type(exc).__name__}: {str(exc)[:120]}")
    return failed


def precompile(plan: list, workers: int, timeout_s: float, log) -> None:
    """Compile every row's kernels in ``workers`` spawned processes: moe's per (dtype, row) over its cases (they
    share kernels), the batched sweep's per (row, case); at most ``timeout_s`` seconds, then the rest compiles
    while checking."""
    import multiprocessing

    groups = []
    for part, cases, dtypes in plan:
        names = ["auto"] + [n for n, _, _ in CANDIDATES[part]]
        for dtype in dtypes:
            for name in names:
                jobs = [(part, c.label, dtype, name) for c in cases]
                groups += [jobs] if part == "moe" else [[job] for job in jobs]
    start = time.monotonic()
    old = os.environ.get("TILEGEMM_TUNE")
    os.environ["TILEGEMM_TUNE"] = "0"  # (spawned processes copy the environment: no timing picks a config there)
    pool = multiprocessing.get_context("spawn").Pool(max(1, min(workers, len(groups))))
    try:
        pending = pool.imap_unordered(_compile_group, groups)
        failed = []
        for _ in groups:
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                raise multiprocessing.TimeoutError
            failed += pending.next(timeout=left)
        log(f"precompiled {len(groups)} groups in {time.monotonic() - start:.0f} s"
            + (f"; {len(failed)} failed: " + "; ".join(failed[:4]) if failed else ""))
    except multiprocessing.TimeoutError:
        log(f"precompile stopped after {timeout_s:.0f} s: the rest compiles while checking")
    finally:
        pool.terminate()
        pool.join()
        if old is None:
            os.environ.pop("TILEGEMM_TUNE", None)
        else:
            os.environ["TILEGEMM_TUNE"] = old


# --- the run ----------------------------------------------------------------------------------------------------


def summary(rows: list[dict]) -> dict:
    """Per part and dtype, each row name's geomean and worst ratio to the baseline over the cases timed, and its
    geomean against auto."""
    out = {}
    keys = sorted({(r["part"], r["dtype"]) for r in rows})
    for part, dtype in keys:
        mine = [r for r in rows if r["part"] == part and r["dtype"] == dtype]
        cols = {}
        for name in dict.fromkeys(r["name"] for r in mine if r["kind"] != "baseline" or r["name"] == "F.grouped_mm"):
            ratios = [r["ratio"] for r in mine if r["name"] == name and r.get("ratio")]
            vs_auto = [r["vs_auto"] for r in mine if r["name"] == name and r.get("vs_auto")]
            failed = [r["case"] for r in mine if r["name"] == name and r["status"] in ("wrong", "error")]
            cols[name] = dict(geomean=geomean(ratios), worst=min(ratios) if ratios else None, cases=len(ratios),
                              geomean_vs_auto=geomean(vs_auto), failed=failed)
        out[f"{part}/{dtype}"] = cols
    return out


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def table(rows: list[dict]) -> None:
    """A table a part: per case and dtype the baseline's us and every row's ratio to it; each column's geomean
    and worst."""
    for part in dict.fromkeys(r["part"] for r in rows):
        mine = [r for r in rows if r["part"] == part]
        names = list(dict.fromkeys(r["name"] for r in mine if r["kind"] != "baseline" or r["name"] == "F.grouped_mm"))
        widths = [max(6, len(n)) for n in names]
        print(f"\n{part}: ratio = baseline time / row time (above 1: faster); baseline "
              + ("torch.matmul" if part == "batched" else "the faster of the cuBLAS loop and F.grouped_mm"))
        first = max(len("geomean fp16"), *(len(f"{r['case']} {r['dtype']}") for r in mine))
        print(f"{'case':<{first}} {'base us':>9}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
        cases = list(dict.fromkeys((r["case"], r["dtype"]) for r in mine))
        per_col = {(n, d): [] for n in names for d in {d for _, d in cases}}
        for case, dtype in cases:
            got = {r["name"]: r for r in mine if (r["case"], r["dtype"]) == (case, dtype)}
            base = next(r for r in got.values() if r["kind"] == "baseline")
            cells = []
            for n, w in zip(names, widths):
                r = got.get(n)
                if r is None:
                    cells.append(f"{'-':>{w}}")
                elif r["status"] in ("wrong", "error") and r["kind"] != "baseline":
                    cells.append(f"{'FAIL':>{w}}")
                elif r.get("ratio"):
                    per_col[n, dtype].append(r["ratio"])
                    cells.append(f"{r['ratio']:>{w - 1}.3f}x")
                else:
                    cells.append(f"{r['status'][:w]:>{w}}")
            us = f"{base['us']:9.1f}" if base.get("us") else f"{base['status']:>9}"
            print(f"{case + ' ' + dtype:<{first}} {us}  " + "  ".join(cells))
        for dtype in sorted({d for _, d in cases}):
            for label, reduce in (("geomean", geomean), ("worst", min)):
                cells = [f"{reduce(per_col[n, dtype]):>{w - 1}.3f}x" if per_col[n, dtype] else f"{'-':>{w}}"
                         for n, w in zip(names, widths)]
                print(f"{label + ' ' + dtype:<{first}} {'':>9}  " + "  ".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON, rewritten after every case")
    ap.add_argument("--parts", default="moe,batched", help="moe, batched or both (comma-separated)")
    ap.add_argument("--moe-dtypes", default="bf16,fp16")
    ap.add_argument("--batched-dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--budget", type=float, default=190.0, help="seconds: cases not begun by then are skipped")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=float, default=60.0, help="timing a row gets on a case, over all rounds")
    ap.add_argument("--precompile", type=int, default=min(15, max(0, (os.cpu_count() or 2) - 1)),
                    help="processes compiling every row's kernels first (0: compile while checking)")
    ap.add_argument("--smoke", action="store_true", help="tiny cases on the CPU under the interpreter")
    args = ap.parse_args(argv)
    start = time.monotonic()
    if args.smoke and not interpreting():
        raise SystemExit("--smoke runs under Triton's interpreter: set TILEGEMM_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or --smoke under the interpreter")
    from tilegemm.core import tuning

    if tuning.timing_enabled():
        raise SystemExit("unset TILEGEMM_TUNE: auto's rows run as an untuned process runs them")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.rounds, args.rep_ms = 1, 1.0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in CANDIDATES for p in parts):
        raise SystemExit(f"--parts takes {', '.join(CANDIDATES)}")
    plan = []
    for part in parts:
        dtypes = [d.strip() for d in args.moe_dtypes.split(",")] if part == "moe" else [args.batched_dtype]
        plan.append((part, cases_of(part, args.smoke), dtypes))

    def log(line: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {line}", flush=True)

    from tilegemm.core.hardware import machine_info

    meta = dict(tool="tools/grouped_rule_candidates.py", argv=sys.argv[1:] if argv is None else argv,
                machine=machine_info().to_dict(), rounds=args.rounds, rep_ms=args.rep_ms,
                timing=("interpreter: host wall-clock, not GPU performance" if args.smoke else
                        "tilegemm.bench.runner.time_samples, cuda_graph: do_bench_cudagraph over input sets rotated "
                        "past L2, rounds in alternating order, the median of all samples"),
                candidates={part: [dict(name=n, why=why, knobs=describe(k)) for n, why, k in CANDIDATES[part]]
                            for part in parts})
    if args.precompile > 0 and not args.smoke:
        precompile(plan, args.precompile, 0.45 * args.budget, log)
    if device == "cuda":
        from tilegemm.core.launch import ensure_allocator

        ensure_allocator()
    rows: list[dict] = []

    def write() -> None:
        doc = dict(meta, elapsed_s=time.monotonic() - start, summary=summary(rows), rows=rows)
        tmp = args.out + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, args.out)

    # each case in every dtype before the next case (the weakest first)
    order = [(part, case, dtype) for part, cases, dtypes in plan for case, dtype in itertools.product(cases, dtypes)]
    for part, case, dtype in order:
        op = bench_op(part)
        if time.monotonic() - start > args.budget:
            rows.append(dict(part=part, case=case.label, dtype=dtype, name="baseline", kind="baseline",
                             status="skipped", knobs=[]))
            continue
        try:
            rows += run_case(part, op, case, dtype, device, args, log)
        except torch.cuda.OutOfMemoryError as exc:
            log(f"FAILED {part} {case.label} {dtype}: out of memory ({exc})")
            rows.append(dict(part=part, case=case.label, dtype=dtype, name="baseline", kind="baseline",
                             status="error", error="out of memory", knobs=[]))
        if device == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        write()
    write()
    failures = [r for r in rows if r["kind"] != "baseline" and r["status"] in ("wrong", "error")]
    skipped = sorted({f"{r['part']} {r['case']} {r['dtype']}" for r in rows if r["status"] == "skipped"})
    for r in failures:
        print(f"FAILED {r['part']} {r['case']} {r['dtype']} {r['name']}: {r.get('error', '')}")
    if skipped:
        print(f"skipped (over --budget): {', '.join(skipped)}")
    table([r for r in rows if r["status"] != "skipped"])
    print(f"\n{len(failures)} failed; {time.monotonic() - start:.0f} s; JSON: {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
