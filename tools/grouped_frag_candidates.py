"""Kernel ``frag`` of ``grouped_w4a16`` (4-bit experts on W4A16's fragment kernel) against ``dequant_dot`` and the
16-bit baseline at decode sizes, timed as CUDA graphs (GPU: an sm_90 one for ``frag``).

    PYTHONPATH=src python3 tools/grouped_frag_candidates.py --out $OUT/grouped-frag.json
        [--dtype bf16|fp16] [--tokens 1,8,64] [--configs] [--routing-seed N] [--budget 200]

Cases: the ``grouped_w4a16`` bench's ``moe`` sweep at 1, 8 and 64 tokens (Mixtral-8x7B, Qwen3-30B-A3B,
DeepSeek-V2-Lite; gate/up and down: 18 cases), each with the bench's own inputs (``GroupedW4A16Bench.prepare``:
seeded skewed routing, experts quantized in groups of 128, the dequantized 16-bit weight the baselines multiply, and
the fp64 reference). ``--routing-seed N`` draws the routing from seed N in place of the bench's (a held-out draw for
a rule fitted on the bench's). Rows of each case:

- ``baseline``: the bench's, the faster of the loop of cuBLAS products and ``F.grouped_mm`` (chosen while
  preparing; in fp16 ``F.grouped_mm`` refuses, so the loop);
- ``dequant_dot``, ``frag``, ``auto``: ``tilegemm.w4a16.grouped_matmul(..., kernel=...)`` as a user calls it (the
  sweep's product: ungated, no bias); ``auto`` should be ``frag`` on Hopper at these sizes;
- gate/up cases also ``gated dequant_dot`` and ``gated frag``: ``moe_gate_up_int4``'s product (``silu(gate) * up``,
  half the output columns), against the same baseline (the 16-bit route would need the activation and the gate on
  top);
- with ``--configs``: ``frag`` with each neighbour of its config (BM halved and doubled, the K split halved and
  doubled), through the launcher's config override.

Each row is first run once and checked against the bench's fp64 reference (relative error within the bench's
tolerance, no NaN); a failed check or an exception marks the row failed, untimed. Then it is timed as replays of a
CUDA graph of back-to-back calls (``tilegemm.bench.runner.graph_us_per_call``, sized to about 30 ms a row): GPU
time, no host. Whatever ``--budget`` seconds (compiles included) leave out is marked ``skipped``; the default run
(bf16, 18 cases) takes about 2 minutes on an H200. The JSON (``--out``) is rewritten after every case; the last lines
printed are a table: per case the baseline's microseconds and each kernel's ratio against it (above 1: faster),
then the geomean and the worst ratio of ``frag``, ``auto`` and ``dequant_dot``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.core.checks import relative_error
from tilegemm.core.runtime import new_output
from tilegemm.ops.grouped import api, frag
from tilegemm.ops.grouped.bench import GroupedW4A16Bench, _moe_cases
from tilegemm.ops.grouped.problem import GroupedInt4Problem

DTYPES = ("bf16", "fp16")
TARGET_MS = 30.0  # GPU time of a row's graph replays, about


def pick_cases(tokens: list[int]) -> list:
    return [c for c in _moe_cases() if c.dims["T"] in tokens]


def time_us(fn) -> float:
    """GPU microseconds a call, from a CUDA graph of back-to-back calls sized to about TARGET_MS."""
    from tilegemm.bench.runner import graph_us_per_call

    probe = graph_us_per_call(fn, calls=5, reps=3)
    calls = int(max(5, min(100, TARGET_MS * 1e3 / max(probe, 1.0) / 10)))
    return min(graph_us_per_call(fn, calls=calls, reps=10), graph_us_per_call(fn, calls=calls, reps=10))


def frag_config_run(x, w, offs, cfg: dict, gated: bool):
    """``frag`` with config ``cfg`` (the launcher's override), into a fresh output."""
    E, N, K = w.shape
    n_out = N // 2 if gated else N
    out = new_output((x.shape[0], n_out), x.dtype, x.device)
    fw, fzs = w.fragments(gated)
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, None, out, E, x.shape[0], n_out, K, w.group_k,
                           "silu" if gated else "none", gated, fw, fzs)
    frag.run(p, cfg)
    return out


def neighbours(cfg: dict, K: int) -> list[dict]:
    """frag's configs one step from ``cfg``: BM halved / doubled (8 .. 64), the K split halved / doubled."""
    out = []
    for bm in (cfg["BM"] // 2, cfg["BM"] * 2):
        if 8 <= bm <= 64:
            out.append(dict(cfg, BM=bm))
    steps = -(-K // 64)
    for split in (cfg["SPLIT_K"] // 2, cfg["SPLIT_K"] * 2):
        if 1 <= split <= steps and split != cfg["SPLIT_K"]:
            out.append(dict(cfg, SPLIT_K=split))
    return out


def use_routing_seed(seed: int) -> None:
    """Make the bench draw every case's routing from ``seed`` (its group sizes: ``bench.group_sizes``)."""
    from tilegemm.ops.grouped import bench as grouped_bench

    def group_sizes(T: int, E: int, topk: int) -> list[int]:
        ids = grouped_bench.routing(T, E, topk, seed).reshape(-1)
        return torch.bincount(ids, minlength=E).tolist()

    grouped_bench.group_sizes = group_sizes


def rows_of(inputs: dict, bench, dtype: str, gate_up: bool, configs: bool, ref: torch.Tensor) -> list:
    """(name, fn, reference) of a case's rows."""
    x, w4, offs = inputs["a"], inputs["w4"], inputs["offs"]
    rows = [("baseline", lambda: bench.baseline(inputs, dtype), ref)]
    for kernel in ("dequant_dot", "frag", "auto"):
        rows.append((kernel, lambda k=kernel: api.grouped_matmul(x, w4, offs, kernel=k), ref))
    half = ref.shape[1] // 2
    gated_ref = torch_activation(ref[:, :half], "silu") * ref[:, half:] if gate_up else None
    if gate_up:
        for kernel in ("dequant_dot", "frag"):
            rows.append((f"gated {kernel}", lambda k=kernel: api._int4(x, w4, offs, None, "silu", True, k),
                         gated_ref))
    if configs:
        own = frag.frag_config(_problem(x, w4, offs), w4.shape[1])
        for cfg in neighbours(own, w4.shape[2]):
            name = "frag " + " ".join(f"{k}{v}" for k, v in cfg.items() if k in ("BM", "SPLIT_K"))
            rows.append((name, lambda c=cfg: frag_config_run(x, w4, offs, c, False), ref))
    return rows


def _problem(x, w4, offs):
    E, N, K = w4.shape
    return GroupedInt4Problem(x, w4.qweight, w4.scales, w4.zeros, offs, None, None, E, x.shape[0], N, K, w4.group_k)


def run_case(case, dtype: str, configs: bool, deadline: float) -> dict:
    bench = GroupedW4A16Bench()
    prepared = bench.prepare(case, dtype, "cuda", 1, {})
    inputs = prepared.sets[0]
    tol = bench.tolerance(dtype)
    ref = prepared.reference
    gate_up = case.dims["product"] == 0
    E, M = case.dims["E"], case.dims["T"] * case.dims["topk"]
    result = dict(case=case.label, E=E, M=M, rows_per_expert=M / E, N=inputs["w4"].shape[1],
                  K=inputs["w4"].shape[2], baseline_kind=inputs.get("faster", "loop"), tolerance=tol,
                  frag_config=frag.frag_config(_problem(inputs["a"], inputs["w4"], inputs["offs"]),
                                               inputs["w4"].shape[1]),
                  rows=[])
    for name, fn, want in rows_of(inputs, bench, dtype, gate_up, configs, ref):
        row = dict(name=name)
        result["rows"].append(row)
        if time.monotonic() > deadline:
            row["status"] = "skipped"
            continue
        try:
            out = fn()
            torch.cuda.synchronize()
            if out.shape != want.shape:
                raise AssertionError(f"shape {tuple(out.shape)}, expected {tuple(want.shape)}")
            err = relative_error(out, want)
            row["rel_err"] = err
            if not err <= tol:
                row["status"] = "wrong"
                continue
            row["us"] = time_us(fn)
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a row that fails is recorded, the run goes on
            row["status"] = "failed"
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            torch.cuda.synchronize()
    base = next((r.get("us") for r in result["rows"] if r["name"] == "baseline"), None)
    for r in result["rows"]:
        if base and r.get("us"):
            r["vs_baseline"] = base / r["us"]
    del prepared, inputs
    torch.cuda.empty_cache()
    return result


def summary(cases: list) -> dict:
    out = {}
    for name in ("frag", "auto", "dequant_dot", "gated frag", "gated dequant_dot"):
        ratios = [r["vs_baseline"] for c in cases for r in c["rows"] if r["name"] == name and "vs_baseline" in r]
        if ratios:
            out[name] = dict(geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)), worst=min(ratios),
                             cases=len(ratios))
    return out


def table(cases: list, summ: dict) -> str:
    names = ("dequant_dot", "frag", "auto", "gated dequant_dot", "gated frag")
    lines = [f"{'case':34s} {'base us':>8s} " + " ".join(f"{n:>17s}" for n in names) + "  best config row"]
    for c in cases:
        by = {r["name"]: r for r in c["rows"]}
        base = by.get("baseline", {}).get("us")
        cells = []
        for n in names:
            r = by.get(n)
            if r is None:
                cells.append(f"{'':>17s}")
            elif "vs_baseline" in r:
                cells.append(f"{r['us']:8.1f} {r['vs_baseline']:6.2f}x ")
            else:
                cells.append(f"{r.get('status', '?'):>17s}")
        extra = [r for r in c["rows"] if r["name"].startswith("frag ") and "us" in r]
        best = min(extra, key=lambda r: r["us"]) if extra else None
        lines.append(f"{c['case']:34s} {base if base is None else round(base, 1)!s:>8s} " + " ".join(cells)
                     + (f"  {best['name']} {best['us']:.1f}" if best else ""))
    for n, s in summ.items():
        lines.append(f"{n}: geomean {s['geomean']:.2f}x, worst {s['worst']:.2f}x vs baseline over {s['cases']} cases")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--tokens", default="1,8,64", help="the sweep's token counts, comma-separated")
    parser.add_argument("--configs", action="store_true", help="also time frag's neighbouring configs")
    parser.add_argument("--routing-seed", type=int, default=None,
                        help="draw the routing from this seed in place of the bench's (a held-out draw)")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds; rows past it are skipped")
    args = parser.parse_args(argv)
    if args.routing_seed is not None:
        use_routing_seed(args.routing_seed)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (an sm_90 one for kernel frag)", file=sys.stderr)
        return 2
    reason = frag.why_not_gluon()
    if reason is not None:
        print(f"kernel frag cannot run here ({reason}): its rows will fail", file=sys.stderr)
    deadline = time.monotonic() + args.budget
    cases = pick_cases([int(t) for t in args.tokens.split(",")])
    doc = dict(tool="grouped_frag_candidates", dtype=args.dtype, gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, routing_seed=args.routing_seed, cases=[])
    for case in cases:
        start = time.monotonic()
        doc["cases"].append(run_case(case, args.dtype, args.configs, deadline))
        doc["summary"] = summary(doc["cases"])
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"{case.label}: {time.monotonic() - start:.1f} s", flush=True)
    print(table(doc["cases"], doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
