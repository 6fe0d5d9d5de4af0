"""Diagnosis on the GPU: why ``auto`` loses on shapes of the random sweep (not a test).

For each shape: cuBLAS, ``auto`` (and the rung it chose), every rung named by ``kernel=``, and ``auto`` on
operands zero-padded so that K and every leading dimension is a multiple of 8 elements (the pad's own time
included: ``F.pad`` of both operands, then the product of the padded ones; zeros along K add nothing). Each
result is checked against an fp64 product first. Times are do_bench medians, cuBLAS and the variants
alternating over ``--rounds`` rounds. For tf32 and fp8 (``--dtype tf32`` / ``fp8_e4m3``) the baseline is the bench's (cuBLAS with TF32 on;
``torch._scaled_mm`` with per-tensor scales, A row-major and B column-major, bf16 out) and there is no padded
variant. Each row also names how many launches ``auto``'s replay holds and its host time per call (100 calls
back to back, no sync). Writes ``$OUT/diagnose-random-<dtype>.json``; prints a table.

    PYTHONPATH=src:research python3 research/diagnose_random.py 184x168x14400 526x773x7638 [--dtype fp16]
    PYTHONPATH=src:research python3 research/diagnose_random.py --worst FILE.json --count 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton.testing

import tilegemm
from tilegemm.core.hardware import machine_info
from tilegemm.ops.matmul import dispatch

from diagnose_survey import host_us  # noqa: E402  (host time per call, back to back without a sync)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
RUNGS = ("autotuned", "split_k", "persistent_tma", "grouped")


def padded_product(a, b):
    """a @ b through operands padded to multiples of 8 along K and the leading dimensions (row-major both)."""
    M, K = a.shape
    N = b.shape[1]
    kp, np_ = -(-K // 8) * 8, -(-N // 8) * 8
    ap = F.pad(a, (0, kp - K)) if kp != K else a
    bp = F.pad(b, (0, np_ - N, 0, kp - K)) if (kp, np_) != (K, N) else b
    return tilegemm.matmul(ap, bp[:, :N])


def timed_against_cublas(fns: dict, rounds: int, rep: int) -> dict:
    """{name: {us, ratio}} for callables ``fns`` (one named "cuBLAS", the baseline): do_bench medians taken
    alternating over ``rounds`` rounds, the median of the rounds."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
    base = statistics.median(times["cuBLAS"]) if "cuBLAS" in times else float("nan")
    return {name: dict(us=statistics.median(t) * 1e3, ratio=base / statistics.median(t)) for name, t in times.items()}


def write_rows(name: str, dtype: str, rows: list) -> None:
    """``rows`` with the machine and commit, as ``$OUT/<name>``."""
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), git_commit=os.environ.get("TILEGEMM_GIT_COMMIT"),
                       dtype=dtype, rows=rows), f, indent=1)


def make_variants(dtype: str, M: int, N: int, K: int) -> tuple[dict, torch.Tensor]:
    """({name: callable}, fp64-derived reference) for one shape in ``dtype`` as the bench makes its inputs."""
    if dtype == "fp8_e4m3":
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).T  # column-major: what _scaled_mm takes
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
        ref = (a.double() @ b.double()).float()
        variants = {"cuBLAS": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
                    "auto": lambda: tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
        for rung in RUNGS:
            variants[rung] = lambda rung=rung: tilegemm.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                               kernel=rung)
        return variants, ref
    a = torch.randn(M, K, device="cuda", dtype=DTYPES[dtype])
    b = torch.randn(K, N, device="cuda", dtype=DTYPES[dtype])
    ref = (a.double() @ b.double()).float()
    if dtype == "tf32":
        def cublas():
            torch.backends.cuda.matmul.allow_tf32 = True
            return torch.matmul(a, b)

        variants = {"cuBLAS": cublas, "auto": lambda: tilegemm.matmul(a, b, precision="tf32")}
        for rung in RUNGS:
            variants[rung] = lambda rung=rung: tilegemm.matmul(a, b, precision="tf32", kernel=rung)
        return variants, ref
    variants = {"cuBLAS": lambda: torch.matmul(a, b), "auto": lambda: tilegemm.matmul(a, b),
                "padded": lambda: padded_product(a, b)}
    for rung in RUNGS:
        variants[rung] = lambda rung=rung: tilegemm.matmul(a, b, kernel=rung)
    return variants, ref


def recorded_launches():
    """How many launches the newest replay entry holds (the call just made), or None where none was kept."""
    from tilegemm.ops.matmul import replay

    entries = replay._cache.entries
    if not entries:
        return None
    newest = next(reversed(entries.values()))
    return len(getattr(newest, "replays", [newest]))


def worst_shapes(path: str, count: int) -> list[str]:
    rows = json.load(open(path))["rows"]
    auto = sorted((r for r in rows if r["kernel"] == "auto" and r.get("ratio")), key=lambda r: r["ratio"])
    return [r["shape"] for r in auto[:count]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--worst", help="a bench JSON: take its worst auto shapes")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shapes = list(args.shapes) + (worst_shapes(args.worst, args.count) if args.worst else [])
    chosen = []
    original = dispatch.choose_kernel

    def spy(p):
        rung = original(p)
        chosen.append(rung)
        return rung

    surveyed = dispatch.surveyed

    def spy_survey(p):
        picked = surveyed(p)
        if picked is not None:
            chosen.append(f"{picked[0]} {picked[1]}")
        return picked

    dispatch.choose_kernel = spy
    dispatch.surveyed = spy_survey
    results = []
    for shape in shapes:
        M, N, K = (int(x) for x in shape.split("x"))
        torch.manual_seed(0)
        variants, ref = make_variants(args.dtype, M, N, K)
        per = 16 // (1 if args.dtype.startswith("fp8") else DTYPES[args.dtype].itemsize)  # elements in 16 bytes
        row = dict(shape=shape, aligned=K % per == 0 and N % per == 0, variants={})
        ok = {}
        for name, fn in variants.items():
            chosen.clear()
            try:
                out = fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - diagnosis: record and go on
                row["variants"][name] = dict(error=str(e)[:200])
                continue
            if name == "auto":
                row["auto_rung"] = chosen[0] if chosen else None
                row["auto_launches"] = recorded_launches()
                row["auto_host_us"] = host_us(fn, 100)
            if not err < 1e-2:
                row["variants"][name] = dict(error=f"wrong: rel err {err}")
                continue
            ok[name] = fn
        row["variants"].update(timed_against_cublas(ok, args.rounds, rep=60))
        base = row["variants"].get("cuBLAS", {}).get("us", float("nan")) / 1e3
        results.append(row)
        v = row["variants"]
        cells = " ".join(f"{n}={v[n]['ratio']:.2f}" if "ratio" in v.get(n, {}) else f"{n}=ERR" for n in variants if n != "cuBLAS")
        print(f"{shape:>20} cuBLAS {base * 1e3:8.1f} us  auto->{row.get('auto_rung')} "
              f"[{row.get('auto_launches')} launches, host {row.get('auto_host_us', 0):.1f} us]  {cells}", flush=True)
    write_rows(f"diagnose-random-{args.dtype}.json", args.dtype, results)


if __name__ == "__main__":
    main()
