"""Build the shipped survey table of one GPU from ``tools/survey_configs.py`` runs (offline, no GPU needed).

``auto`` takes an unseen shape's rung and config from the table of its dtype family and layout (:mod:`tilegemm.ops.matmul.survey`):
the candidates that ran best on the surveyed shapes nearest to it. The table keeps, per surveyed shape, each
candidate's efficiency (the shape's best time over the candidate's time), rounded, for candidates within
:data:`tilegemm.ops.matmul.survey.FLOOR` of the best; the others count as that floor. ``split_k`` configs whose
split was the one that fills a wave (above 8) are kept as ``"wave"``, recomputed for each problem.

``--check`` prints the leave-one-out score of the choice on the surveyed shapes (each shape chosen from the
others' data), against the shape's best candidate and ``auto`` as the survey ran it through the op (its rules, when the
survey ran before a table shipped or with it turned off: the op's time includes its host path).

    python3 tools/fit_survey.py benchmarks/results/2026-11-24-h200/b3a0245/survey-fp16-s*.json.xz [--check]
        [--supplement SPLITS.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tilegemm.ops.matmul.survey import FLOOR, SCHEMA, family, identity, rank, table_path  # noqa: E402  (no GPU needed)


def read(path: str) -> dict:
    """A survey's JSON, plain or xz-compressed (``.json.xz``, as the committed surveys are stored)."""
    import lzma

    with (lzma.open(path, "rt") if str(path).endswith(".xz") else open(path)) as f:
        return json.load(f)


def load(paths: list[str]):
    """(gpu name, layout, dtype, rows) where each row is (M, N, K, cublas_us, auto_us, {candidate: us}). The
    surveys must share their GPU, layout and dtype family (fp16 and bf16 share one)."""
    gpu, layout, dtype, rows = None, None, None, []
    for path in paths:
        doc = read(path)
        name, lay, dt = doc["machine"]["gpu"], doc.get("layout", "NN"), doc.get("dtype", "fp16")
        if family(dt) is None:
            raise SystemExit(f"{path} surveyed {dt}, which no table speaks for")
        if gpu not in (None, name) or layout not in (None, lay) or (dtype is not None and family(dt) != family(dtype)):
            raise SystemExit(f"{path} is from {name}, layout {lay}, {dt}; the others from {gpu}, layout {layout}, "
                             f"{dtype}")
        gpu, layout, dtype = name, lay, dtype or dt
        for r in doc["rows"]:
            timed = {identity(c["rung"], c["config"]): c["us"] for c in r["configs"] if "us" in c}
            if timed:
                rows.append((r["M"], r["N"], r["K"], r["cublas_us"], r["auto_us"], timed))
    return gpu, layout, dtype, rows


def supplement(rows, paths: list[str], gpu: str, layout: str, dtype: str):
    """``rows`` with the candidates of ``--splits-only`` surveys (``tools/survey_configs.py``) of the same shapes
    added. A supplement ran in another process, so its times are put on the full survey's scale by the two
    runs' cuBLAS times of the shape (its candidates' time x full cuBLAS / supplement cuBLAS)."""
    by_shape = {(M, N, K): i for i, (M, N, K, *_) in enumerate(rows)}
    rows = list(rows)
    added = 0
    for path in paths:
        doc = read(path)
        name, lay, dt = doc["machine"]["gpu"], doc.get("layout", "NN"), doc.get("dtype", "fp16")
        if name != gpu or lay != layout or family(dt) != family(dtype):
            raise SystemExit(f"{path} is from {name}, layout {lay}, {dt}; the surveys from {gpu}, {layout}, {dtype}")
        for r in doc["rows"]:
            i = by_shape.get((r["M"], r["N"], r["K"]))
            if i is None:
                continue  # a shape the full surveys lack (another seed or range)
            M, N, K, cublas, auto, timed = rows[i]
            scale = cublas / r["cublas_us"]
            extra = {identity(c["rung"], c["config"]): c["us"] * scale for c in r["configs"] if "us" in c}
            rows[i] = (M, N, K, cublas, auto, {**timed, **extra})
            added += len(extra)
    print(f"supplements: {added} timed candidates added")
    return rows


def table(gpu: str, sources: list[str], rows, layout: str = "NN", dtype: str = "fp16") -> dict:
    configs = sorted({c for *_, timed in rows for c in timed})
    index = {c: i for i, c in enumerate(configs)}
    shapes = []
    for M, N, K, _, _, timed in rows:
        best = min(timed.values())
        kept = sorted((index[c], round(best / us, 3)) for c, us in timed.items() if best / us >= FLOOR)
        shapes.append([M, N, K, [list(x) for x in kept]])
    return dict(schema=SCHEMA, gpu=gpu, sources=sources, dtype=dtype, family=family(dtype), layouts=[layout],
                configs=[[rung, json.loads(cfg)] for rung, cfg in configs], shapes=shapes)


def check(doc: dict, rows, sms: int) -> None:
    def gm(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    configs = [(r, json.dumps(c, sort_keys=True)) for r, c in doc["configs"]]
    picked, best, auto = [], [], []
    for i, (M, N, K, cublas, auto_us, timed) in enumerate(rows):
        others = doc["shapes"][:i] + doc["shapes"][i + 1:]
        order = rank(others, (M, N, K), [configs.index(c) for c in timed], doc["configs"], sms)  # as auto ranks
        picked.append(cublas / timed[configs[order[0]]])
        best.append(cublas / min(timed.values()))
        auto.append(cublas / auto_us)
    print(f"{len(rows)} shapes; against cuBLAS, geomean (worst): best candidate {gm(best):.3f} ({min(best):.2f}), "
          f"leave-one-out choice {gm(picked):.3f} ({min(picked):.2f}), auto through the op {gm(auto):.3f} "
          f"({min(auto):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("surveys", nargs="+")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--supplement", nargs="*", default=[],
                    help="--splits-only surveys of the same shapes, their candidates added to the table")
    ap.add_argument("--write", action="store_true",
                    help="write src/tilegemm/tuned/survey/<gpu>[-<family>][-<layout>].json")
    args = ap.parse_args()
    gpu, layout, dtype, rows = load(args.surveys)
    if args.supplement:
        rows = supplement(rows, args.supplement, gpu, layout, dtype)
    sources = [str(Path(p).resolve().relative_to(ROOT)) if Path(p).resolve().is_relative_to(ROOT) else p
               for p in args.surveys + args.supplement]
    doc = table(gpu, sources, rows, layout, dtype)
    if args.check:
        check(doc, rows, read(args.surveys[0])["machine"]["sm_count"])
    if args.write:
        path = table_path(gpu, layout, doc["family"], own=True)  # this GPU's file, never a sibling's it reads
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        print(f"wrote {path.relative_to(ROOT)}: {len(doc['shapes'])} shapes, {len(doc['configs'])} configs, "
              f"{path.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
