"""Survey on the GPU: every candidate config of every dense-GEMM rung on many shapes, against cuBLAS (not a test).

The shapes are drawn like the bench's ``random`` sweep (M log-uniform in 1..16384, N and K in 64..28672) but
from another seed (``--seed``, never the sweep's held-out seed), aligned only, N and K rounded to multiples of 16 (fewer
kernel variants to compile). ``auto``'s untimed choice for 16-bit products ranks candidates by data like
this (``tools/fit_survey.py`` builds the shipped tables from it): the sweep's own shapes stay unseen.

For each shape: cuBLAS, ``auto`` by its rules alone (the survey's own table turned off), and each config of ``autotuned`` (the pointer kernel),
``persistent_tma`` (its Triton configs and the Gluon kernel's) and ``split_k`` (its K splits above one; every
config for M <= 128), each checked against an fp32 product, then timed as the tuners time (do_bench median,
L2 cleared, replays of the recorded launch). The JSON is rewritten after every shape, so a run stopped by
``--budget`` (seconds) keeps what it measured; ``--start`` resumes a set.

    PYTHONPATH=src python3 tools/survey_configs.py --count 120 --start 0 --budget 520 [--dtype fp16] [--out DIR]
    PYTHONPATH=src python3 tools/survey_configs.py --count 240 --seed 7 --splits-only   (persistent_tma's K splits
        and cuBLAS on the shapes of a full survey of that seed: tools/fit_survey.py --supplement adds them)
    PYTHONPATH=src python3 tools/survey_configs.py --round --count 60 --seed 31 ...   (model-like round shapes)
    PYTHONPATH=src python3 tools/survey_configs.py --dtype fp8_e4m3 --layout NT ...   (fp8: NT only, against
        torch._scaled_mm with per-tensor scales and a bf16 output; tf32: against cuBLAS with TF32 on)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import tilegemm  # first: it chooses the interpreter or the GPU before torch and triton load
import torch
import triton.testing
from tilegemm.core import tuning
from tilegemm.core.hardware import machine_info
from tilegemm.core import replay
from tilegemm.ops.matmul import dispatch, persistent_tma, split_k
from tilegemm.ops.matmul.bench import RANDOM_SEED as SWEEP_SEED  # the bench's held-out random sweep: never surveyed
from tilegemm.ops.matmul.bench import _random_cases
from tilegemm.ops.matmul.configs import autotune_configs, prune_for
from tilegemm.ops.matmul.problem import make_problems

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
FP8_SCALES = (0.5, 2.0)  # per-tensor scales of fp8 operands (their product 1: the reference needs no rescaling)


def survey_shapes(count: int, seed: int, multiple: int = 16) -> list[tuple[int, int, int]]:
    """The aligned shapes of a random-sweep-like draw from ``seed``, N and K rounded up to multiples of
    ``multiple`` (8: as the sweep's, which compiles more kernel variants)."""
    if seed == SWEEP_SEED:
        raise SystemExit(f"seed {SWEEP_SEED} is the bench's held-out random sweep, which must stay unseen")
    unseen = {tuple(c.dims.values()) for c in _random_cases()}
    shapes = []
    for i, case in enumerate(_random_cases(3 * count, seed)):
        if i % 3 == 2:
            continue  # the draw's misaligned third
        m, n, k = case.dims["M"], case.dims["N"], case.dims["K"]
        n, k = -(-n // multiple) * multiple, -(-k // multiple) * multiple
        if (m, n, k) not in unseen:
            shapes.append((m, n, k))
    return shapes[:count]


# Hidden and intermediate sizes of the kind models use (N and K of --round draws)
ROUND_SIZES = (1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 9216, 10240, 11264, 12288, 14336,
               16384, 20480, 24576, 28672)


def round_shapes(count: int, seed: int) -> list[tuple[int, int, int]]:
    """Model-like shapes: N and K drawn from :data:`ROUND_SIZES`, M log-uniform in 128..8192 rounded to a
    multiple of 64, products up to 2^37 multiply-adds; never an (N, K) pair of the bench's ``models`` or ``llm``
    sweeps (those measure ``auto``)."""
    import math
    import random

    from tilegemm.ops.matmul.bench import _llm_cases, _model_cases

    held_out = {(c.dims["N"], c.dims["K"]) for c in _model_cases() + _llm_cases()}
    rng = random.Random(seed)
    shapes = []
    while len(shapes) < count:
        n, k = rng.choice(ROUND_SIZES), rng.choice(ROUND_SIZES)
        m = 64 * max(2, round(math.exp(rng.uniform(math.log(128), math.log(8192))) / 64))
        if (n, k) not in held_out and (m, n, k) not in shapes and m * n * k <= 2**37:  # each call under ~1 ms
            shapes.append((m, n, k))
    return shapes


def field(p, splits_only: bool = False) -> list[tuple[str, dict]]:
    """(rung, config) of every candidate for problem ``p``; ``splits_only``: ``persistent_tma``'s K splits only."""
    if splits_only:
        return [("persistent_tma", c) for c in persistent_tma.split_configs(p)] if persistent_tma.why_not(p) is None else []
    out = [("autotuned", c) for c in prune_for(autotune_configs(), p.a.element_size())]
    if persistent_tma.why_not(p) is None:
        out += [("persistent_tma", c) for c in persistent_tma.candidates(p)]
    out += [("split_k", c) for c in split_k.configs(p) if p.M <= 128 or c["SPLIT_K"] > 1]
    return out


class Operands:
    """A shape's operands in a surveyed dtype and layout, with how cuBLAS (``torch._scaled_mm`` for fp8, TF32
    on for tf32), ``tilegemm.matmul`` and a problem of the product are called on them."""

    def __init__(self, M: int, N: int, K: int, dtype: str, layout: str):
        torch.manual_seed(M * 31 + N * 7 + K)
        tdtype = DTYPES[dtype]
        made = torch.float32 if dtype.startswith("fp8") else tdtype

        def operand(rows, cols, transposed):
            x = torch.randn(*((cols, rows) if transposed else (rows, cols)), device="cuda", dtype=made).to(tdtype)
            return x.T if transposed else x

        self.a, self.b = operand(M, K, layout[0] == "T"), operand(K, N, layout[1] == "T")
        self.fp8 = dtype.startswith("fp8")
        if self.fp8 and layout != "NT":
            raise SystemExit("fp8 is surveyed NT only: torch._scaled_mm takes A row-major and B column-major")
        self.precision = "tf32" if dtype == "tf32" else "ieee"
        self.out_dtype = torch.bfloat16 if self.fp8 else tdtype
        self.scales = tuple(torch.tensor(s, device="cuda") for s in FP8_SCALES) if self.fp8 else (None, None)
        torch.backends.cuda.matmul.allow_tf32 = False  # an IEEE fp32 reference
        self.ref = torch.matmul(self.a.float(), self.b.float())
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"  # cuBLAS's tf32 baseline

    def cublas(self):
        if self.fp8:
            return torch._scaled_mm(self.a, self.b, *self.scales, out_dtype=torch.bfloat16)
        return torch.matmul(self.a, self.b)

    def tilegemm(self):
        if self.fp8:
            sa, sb = self.scales
            return tilegemm.matmul(self.a, self.b, scale_a=sa, scale_b=sb, out_dtype=self.out_dtype)
        return tilegemm.matmul(self.a, self.b, precision=self.precision)

    def problem(self, out):
        sa, sb = self.scales
        return make_problems(self.a, self.b, out, None, None, 1.0, 0.0, "none", self.precision, False,
                             (sa, 0, sb, 0))[0]


def survey(M: int, N: int, K: int, dtype: str, rep: int, layout: str = "NN", splits_only: bool = False) -> dict | None:
    """One shape's row; with ``splits_only``, None where M <= 16 or no K split is offered."""
    ops = Operands(M, N, K, dtype, layout)
    if splits_only and (M <= 16 or not field(ops.problem(torch.empty(M, N, device="cuda", dtype=ops.out_dtype)), True)):
        return None
    scale = ops.ref.norm().item()
    row = dict(M=M, N=N, K=K)
    row["cublas_us"] = triton.testing.do_bench(ops.cublas, warmup=5, rep=3 * rep, return_mode="median") * 1e3
    if splits_only:
        row["configs"] = measure(ops, splits_only, rep, scale)
        return row
    chosen = []
    original, surveyed = dispatch.choose_kernel, dispatch.surveyed
    dispatch.choose_kernel = lambda p: chosen.append(original(p)) or chosen[-1]
    dispatch.surveyed = lambda p: None  # the rules' choice: what the survey is measured against
    try:
        ops.tilegemm()
        row["auto_rung"] = chosen[0] if chosen else None
        row["auto_us"] = triton.testing.do_bench(ops.tilegemm, warmup=5, rep=3 * rep, return_mode="median") * 1e3
    finally:
        dispatch.choose_kernel, dispatch.surveyed = original, surveyed
        replay.cache("matmul").clear()  # the rules' recorded launches must not stand in for a later call
    row["configs"] = measure(ops, False, rep, scale)
    return row


def measure(ops: Operands, splits_only: bool, rep: int, scale: float) -> list[dict]:
    """Each candidate of :func:`field` checked and timed on ``ops``: ``{rung, config, us}`` or ``{..., error}``."""
    M, N = ops.ref.shape
    configs = []
    p0 = ops.problem(torch.empty(M, N, device="cuda", dtype=ops.out_dtype))
    for rung, cfg in field(p0, splits_only):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=ops.out_dtype)
        p = ops.problem(out)
        entry = dict(rung=rung, config=cfg)
        fn = tuning.replaying(lambda c, rung=rung, p=p: dispatch.launcher(rung)(p, c), cfg)  # as auto launches it
        try:
            fn()
            torch.cuda.synchronize()
            err = ((out.float() - ops.ref).norm() / scale).item()
            if not err < 1e-2:
                raise RuntimeError(f"wrong: rel err {err:.3g}")
            entry["us"] = triton.testing.do_bench(fn, warmup=3, rep=rep, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - a survey: record and go on
            entry["error"] = str(e)[:160]
        configs.append(entry)
    return configs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=120)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, default=None)
    ap.add_argument("--budget", type=float, default=520.0, help="seconds; stop before starting a shape past it")
    ap.add_argument("--rep", type=int, default=10, help="do_bench ms per config")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--multiple", type=int, default=16, choices=(8, 16), help="N and K rounded up to this")
    ap.add_argument("--layout", default="NN", choices=("NN", "NT", "TN", "TT"),
                    help="T: that operand is a transposed view (NT: nn.Linear's x @ W.T)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--round", action="store_true",
                    help="model-like round shapes (round_shapes) instead of the random-sweep-like draw")
    ap.add_argument("--splits-only", action="store_true",
                    help="cuBLAS and persistent_tma's K splits only, on the shapes with M > 16 where they are offered: "
                         "a supplement to a full survey of the same seed (tools/fit_survey.py --supplement)")
    args = ap.parse_args()
    if args.dtype.startswith("fp8") and args.multiple != 16:
        raise SystemExit("fp8 rows are 16-byte aligned only at multiples of 16 elements: --multiple 16")
    os.environ.setdefault("TILEGEMM_TUNING_CACHE", "0")  # shipped entries only: what a fresh user has
    draw = round_shapes(args.count, args.seed) if args.round else survey_shapes(args.count, args.seed, args.multiple)
    shapes = draw[args.start:args.stop]
    tag = ("-round" if args.round else "") + ("" if args.multiple == 16 else f"-m{args.multiple}")
    tag += "" if args.layout == "NN" else f"-{args.layout}"
    tag += "-splits" if args.splits_only else ""
    path = os.path.join(args.out, f"survey-{args.dtype}-s{args.seed}{tag}-{args.start}.json")
    doc = dict(machine=machine_info().to_dict(), git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"),
               dtype=args.dtype, seed=args.seed, multiple=args.multiple, layout=args.layout, start=args.start, rep_ms=args.rep, rows=[])
    t0 = time.time()
    for i, (M, N, K) in enumerate(shapes):
        if time.time() - t0 > args.budget:
            print(f"budget spent: stopped before shape {args.start + i}", flush=True)
            break
        row = survey(M, N, K, args.dtype, args.rep, args.layout, args.splits_only)
        if row is None:
            continue  # --splits-only: none offered for this shape
        doc["rows"].append(row)
        with open(path, "w") as f:
            json.dump(doc, f)
        timed = [c for c in row["configs"] if "us" in c]
        best = min(timed, key=lambda c: c["us"]) if timed else None
        if args.splits_only:
            print(f"{args.start + i:4d} {M:>6}x{N:<6}x{K:<6} cuBLAS {row['cublas_us']:8.1f} us  best split "
                  f"{row['cublas_us'] / best['us'] if best else 0:.2f}x ({len(timed)}/{len(row['configs'])} ok, "
                  f"{time.time() - t0:.0f} s)", flush=True)
            continue
        print(f"{args.start + i:4d} {M:>6}x{N:<6}x{K:<6} cuBLAS {row['cublas_us']:8.1f} us  auto({row['auto_rung']}) "
              f"{row['cublas_us'] / row['auto_us']:.2f}x  best {best['rung'] if best else '-'} "
              f"{row['cublas_us'] / best['us'] if best else 0:.2f}x  ({len(timed)}/{len(row['configs'])} ok, "
              f"{time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
