"""GPU timing of batched 16-bit products (not a test): the ``batched`` sweeps' cases of ``tilegemm bench --op matmul``
and ``--op grouped`` (their union), each run by

- ``torch.matmul`` (batched cuBLAS, the baseline the sweeps compare against);
- ``auto`` as shipped (``dispatch.GLUON_F16_BATCHED`` as the source sets it), ``auto+gluon`` with that
  switch on (the rule a flip of the switch would ship), and for outputs narrower than ``dispatch.NARROW_N``
  ``auto+narrow`` with ``GLUON_F16_BATCHED_NARROW`` on too; where M <= ``dispatch.SMALL_M``, ``auto+off`` with
  the small-M rule off (``GLUON_F16_BATCHED_MIN_M`` past SMALL_M: split_k) and ``auto+mR`` with it from R rows
  (this case's M, and 65);
- ``persistent_tma`` (its Triton kernel with its untimed config: what ``auto`` runs there today);
- ``gluon_f16``'s batched launch in each of its configs (``*``: the one ``gluon_f16.batched_config`` picks
  untimed, what ``auto+gluon`` runs).

Every candidate is first run into a NaN-poisoned output and checked, batch by batch, against an fp32 torch
reference (relative error within ``reference.tolerance``); a wrong or failing candidate is reported and not timed.
Then each is timed as ``triton.testing.do_bench`` medians (L2 cleared before each call, as the bench times) of
replays of its recorded launches (``tuning.replaying``, as a repeated call runs them), ``--rounds`` rounds
alternating over the candidates, the median of the rounds kept; all in this one process. ``--precompile J``
first compiles every candidate's kernels into Triton's disk cache in J spawned worker processes (nothing is
timed there). One call takes about 2-3 minutes on one H200 (fp16, NN, every case).

    PYTHONPATH=src python3 tools/batched_candidates.py --out $OUT/batched-candidates-fp16.json
        [--dtype fp16|bf16] [--layout NN|NT|TN|TT] [--cases 2048x2048x128/b32,...] [--rounds 2] [--precompile 8]

``--cases`` takes any labels (held-out shapes too), else both sweeps' cases.

What to read in the table (printed last, one line a case, ratios torch time / candidate time): the geomean and
worst line of each column; ``auto+gluon`` against ``auto`` says whether to flip ``GLUON_F16_BATCHED``,
``auto+narrow`` against ``auto`` on the narrow cases whether to flip ``GLUON_F16_BATCHED_NARROW``; ``gluon best``
against the ``*`` config (named in the last column) whether ``gluon_f16.batched_config`` picks well.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def sweep_cases() -> list[tuple[int, int, int, int]]:
    """(B, M, N, K) of both ``batched`` sweeps, matmul's first, each once."""
    from tilegemm.ops.grouped import bench as grouped_bench
    from tilegemm.ops.matmul import bench as matmul_bench

    out = []
    for case in matmul_bench._batched_cases() + grouped_bench._batched_cases():
        d = case.dims
        key = (d["B"], d["M"], d["N"], d["K"])
        if key not in out:
            out.append(key)
    return out


def label(case) -> str:
    B, M, N, K = case
    return f"{M}x{N}x{K}/b{B}"


def parse_label(text: str) -> tuple[int, int, int, int]:
    """(B, M, N, K) of a ``MxNxK/bB`` label."""
    try:
        dims, batch = text.split("/b")
        M, N, K = (int(v) for v in dims.split("x"))
        return int(batch), M, N, K
    except ValueError:
        raise SystemExit(f"not a MxNxK/bB label: {text!r}") from None


def operands(case, dtype, layout, seed=0):
    B, M, N, K = case
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(rows, cols, transposed):
        shape = (B, cols, rows) if transposed else (B, rows, cols)
        t = torch.randn(shape, device="cuda", generator=g).to(dtype)
        return t.mT if transposed else t

    return make(M, K, layout[0] == "T"), make(K, N, layout[1] == "T")


def candidates(p) -> list[tuple[str, dict]]:
    """(name, spec) of every tilegemm candidate; spec says how :func:`launcher` runs it."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.matmul import gluon_f16, persistent_tma

    from tilegemm.ops.matmul import dispatch
    from tilegemm.ops.matmul.dispatch import NARROW_N, SMALL_M

    out = [("auto", dict(kind="auto", switches={})),
           ("auto+gluon", dict(kind="auto", switches=dict(GLUON_F16_BATCHED=True)))]
    if p.M <= SMALL_M:  # the small-M rule's threshold: off, and lowered to this case's rows and to 65
        out.append(("auto+off", dict(kind="auto", switches=dict(GLUON_F16_BATCHED_MIN_M=SMALL_M + 1))))
        for m in sorted({p.M, 65} - {dispatch.GLUON_F16_BATCHED_MIN_M}):
            if m <= p.M:
                out.append((f"auto+m{m}", dict(kind="auto", switches=dict(GLUON_F16_BATCHED_MIN_M=m))))
    if p.N < NARROW_N:
        out.append(("auto+narrow", dict(kind="auto", switches=dict(GLUON_F16_BATCHED=True,
                                                                   GLUON_F16_BATCHED_NARROW=True))))
    out.append(("persistent_tma", dict(kind="persistent_tma")))
    if persistent_tma.batched_gluon_f16(p) is not None:  # (an sm_90 GPU, a problem its batched launch takes)
        picked = gluon_f16.batched_config(p, sm_count(p.out.device))
        for cfg in gluon_f16.configs(p.out.element_size()):
            name = "g{}x{}s{}{}".format(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"], "sh" if cfg["SHARED_OUT"] else "")
            out.append((name + ("*" if cfg == picked else ""), dict(kind="gluon_f16", config=cfg)))
    return out


def launcher(p, spec: dict):
    """``launch(cfg)`` for :func:`tilegemm.core.tuning.replaying`: one run of candidate ``spec`` on ``p``."""
    from tilegemm.ops.matmul import dispatch, persistent_tma

    def run(_cfg):
        if spec["kind"] == "auto":
            with switched(dispatch, spec["switches"]):
                dispatch.launch_auto(p)
        elif spec["kind"] == "persistent_tma":
            persistent_tma.run(p)
        else:
            persistent_tma.run_gluon_f16(p, spec["config"])

    return run


class switched:
    """``with switched(dispatch, {NAME: value}):`` auto's module constants set for the block, then restored."""

    def __init__(self, module, values: dict):
        self.module, self.values = module, values

    def __enter__(self):
        self.old = {k: getattr(self.module, k) for k in self.values}
        for k, v in self.values.items():
            setattr(self.module, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.module, k, v)


def rung_of(p, spec: dict) -> str:
    from tilegemm.ops.matmul import dispatch

    if spec["kind"] != "auto":
        return spec["kind"]
    with switched(dispatch, spec["switches"]):
        return dispatch.choose_kernel(p)


def problem(a, b, out):
    from tilegemm.ops.matmul.problem import make_problems

    found = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)
    assert len(found) == 1, "one batched launch a case"
    return found[0]


def _precompile_worker(jobs):
    """Run each (case, dtype, layout, candidate name) once: its kernels compile into Triton's disk cache."""
    from tilegemm.core.launch import ensure_allocator

    ensure_allocator()
    failed = []
    for case, dtype_name, layout, name in jobs:
        try:
            a, b = operands(case, DTYPES[dtype_name], layout)
            p = problem(a, b, torch.empty(case[0], case[1], case[2], device="cuda", dtype=DTYPES[dtype_name]))
            spec = dict(candidates(p))[name]
            launcher(p, spec)(None)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported; the main process checks and reports it again
            failed.append(f"{label(case)} {name}: {str(e)[:120]}")
    return failed


def precompile(cases, dtype_name, layout, workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    jobs = []
    for case in cases:
        a, b = operands(case, DTYPES[dtype_name], layout)
        p = problem(a, b, torch.empty(case[0], case[1], case[2], device="cuda", dtype=DTYPES[dtype_name]))
        jobs += [(case, dtype_name, layout, name) for name, _ in candidates(p)]
    start = time.perf_counter()
    # One candidate's runs in one worker: its cases share compiled kernels (one compile, then its disk cache).
    names = list(dict.fromkeys(job[3] for job in jobs))
    chunks = [[job for job in jobs if names.index(job[3]) % workers == i] for i in range(workers)]
    chunks = [chunk for chunk in chunks if chunk]
    try:
        with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn")) as pool:
            failed = [f for done in pool.map(_precompile_worker, chunks) for f in done]
    except Exception as e:  # noqa: BLE001 - a worker died: what it left uncompiled compiles while checking
        print(f"precompile stopped ({type(e).__name__}: {e}); the rest compiles while checking", file=sys.stderr)
        return
    print(f"precompiled {len(jobs)} candidate runs in {workers} workers: {time.perf_counter() - start:.0f} s"
          + (f", {len(failed)} failed" if failed else ""), file=sys.stderr)


def rel_errs(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst batch's relative error (inf where an element is NaN: not written)."""
    if torch.isnan(out).any():
        return math.inf
    return max(((out[i].float() - ref[i]).norm() / ref[i].norm().clamp_min(1e-30)).item() for i in range(out.shape[0]))


def print_table(rows: list[dict], labels: list[str], base: dict) -> list[dict]:
    """The table (printed last): failures, then one line a case with each column's ratio (torch time /
    candidate time; ``gluon best``: the fastest gluon_f16 config), then each column's geomean and worst.
    ``base``: torch's us per case label. Returns the failed rows."""
    failures = [r for r in rows if "error" in r]
    for r in failures:
        print(f"FAILED {r['case']} {r['kernel']}: {r['error'][:100]}")
    columns = list(dict.fromkeys(r["kernel"].rstrip("*") for r in rows if r["kernel"] != "torch.matmul"))
    columns.append("gluon best")
    widths = [max(8, len(c)) for c in columns]
    first = max([len("geomean")] + [len(lab) for lab in labels])
    print(f"{'case':<{first}}  {'torch us':>9}  " + "  ".join(f"{c:>{w}}" for c, w in zip(columns, widths))
          + "  auto's rungs (as shipped | switched) / gluon pick")
    per_col: dict[str, list[float]] = {c: [] for c in columns}
    for lab in labels:
        got = {r["kernel"].rstrip("*"): r for r in rows if r["case"] == lab}
        gluon = [r["ratio"] for name, r in got.items() if name.startswith("g") and "ratio" in r]
        if gluon:
            got["gluon best"] = dict(ratio=max(gluon))
        cells = []
        for c, w in zip(columns, widths):
            r = got.get(c)
            if r is None or "ratio" not in r:
                cells.append(f"{'-' if r is None else 'FAIL':>{w}}")
            else:
                per_col[c].append(r["ratio"])
                cells.append(f"{r['ratio']:>{w - 1}.3f}x")
        auto_rung = " | ".join(r.get("rung", "?") for k, r in got.items() if k.startswith("auto"))
        pick = next((r["kernel"] for r in rows if r["case"] == lab and r["kernel"].endswith("*")), "-")
        print(f"{lab:<{first}}  {base.get(lab, float('nan')):>9.1f}  " + "  ".join(cells) + f"  {auto_rung} / {pick}")
    for name, reduce in (("geomean", lambda v: math.exp(statistics.fmean(math.log(x) for x in v))), ("worst", min)):
        cells = [f"{reduce(per_col[c]):>{w - 1}.3f}x" if per_col[c] else f"{'-':>{w}}" for c, w in zip(columns, widths)]
        print(f"{name:<{first}}  {'':>9}  " + "  ".join(cells))
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "batched-candidates.json"))
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--layout", default="NN", choices=["NN", "NT", "TN", "TT"])
    ap.add_argument("--cases", default="", help="comma-separated MxNxK/bB labels, any (default: both sweeps' cases)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precompile", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 1)),
                    help="worker processes compiling first (0: compile while checking)")
    args = ap.parse_args()

    import triton.testing

    from tilegemm.core import tuning
    from tilegemm.core.hardware import machine_info
    from tilegemm.core.launch import ensure_allocator
    from tilegemm.ops.matmul import dispatch
    from tilegemm.ops.matmul.reference import tolerance

    if tuning.timing_enabled():
        raise SystemExit("unset TILEGEMM_TUNE: the candidates are timed as they run untimed")
    started = time.perf_counter()
    dtype = DTYPES[args.dtype]
    cases = sweep_cases()
    if args.cases:
        wanted = args.cases.split(",")
        cases = [parse_label(w) for w in wanted]  # any MxNxK/bB: held-out cases as well as the sweeps'
    if args.precompile > 0:
        precompile(cases, args.dtype, args.layout, args.precompile)
    ensure_allocator()
    tol = tolerance(dtype)

    field = []  # (case, name, fn)
    rows = []
    for case in cases:
        B, M, N, K = case
        a, b = operands(case, dtype, args.layout)
        ref = torch.matmul(a.float(), b.float())
        torch_out = torch.matmul(a, b)
        rows.append(dict(case=label(case), kernel="torch.matmul", err=rel_errs(torch_out, ref)))
        field.append((case, "torch.matmul", lambda a=a, b=b: torch.matmul(a, b)))
        # A fresh NaN-filled output per candidate: each must write every element itself.
        for name, spec in candidates(problem(a, b, torch.empty(B, M, N, device="cuda", dtype=dtype))):
            out = torch.full((B, M, N), float("nan"), device="cuda", dtype=dtype)
            p = problem(a, b, out)
            row = dict(case=label(case), kernel=name, rung=rung_of(p, spec), config=spec.get("config"))
            fn = tuning.replaying(launcher(p, spec), {})
            try:
                fn()
                torch.cuda.synchronize()
                row["err"] = rel_errs(out, ref)
            except Exception as e:  # noqa: BLE001 - a diagnosis: record it, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if "error" not in row and not row["err"] <= tol:
                row["error"] = f"wrong: relative error {row['err']:.2e} (bound {tol:.1e})"
            rows.append(row)
            if "error" not in row:
                field.append((case, name, fn))

    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for case, name, fn in field:
            ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
            times.setdefault((label(case), name), []).append(ms)
    for row in rows:
        runs = times.get((row["case"], row["kernel"]))
        if runs:
            row["us"] = statistics.median(runs) * 1e3
            row["runs_us"] = [t * 1e3 for t in runs]
    base = {r["case"]: r["us"] for r in rows if r["kernel"] == "torch.matmul" and "us" in r}
    for row in rows:
        if "us" in row and row["case"] in base:
            row["ratio"] = base[row["case"]] / row["us"]

    meta = dict(machine=machine_info().to_dict(), dtype=args.dtype, layout=args.layout, rounds=args.rounds,
                timing="triton.testing.do_bench median (L2 cleared before each call) of replays, median of rounds",
                switches_as_shipped=dict(GLUON_F16_BATCHED=dispatch.GLUON_F16_BATCHED,
                                         GLUON_F16_BATCHED_NARROW=dispatch.GLUON_F16_BATCHED_NARROW,
                                         GLUON_F16_BATCHED_MIN_M=dispatch.GLUON_F16_BATCHED_MIN_M), wall_s=None)
    meta["wall_s"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    failures = print_table(rows, [label(c) for c in cases], base)
    print(f"{len(field)} timed, {len(failures)} failed, {meta['wall_s']:.0f} s; JSON: {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
