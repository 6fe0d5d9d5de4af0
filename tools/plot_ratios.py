"""Plot a bench JSON's ratios against M: one line per weight shape (N x K), the geomean bold, for sweeps whose cases
name M, N and K (W4A16's ``llm``, ``w4-random``, ``formats``):

    python tools/plot_ratios.py RESULT.json[.xz] [...] [--kernel auto] [--targets w4a16]

Writes ``RESULT-ratios.png`` beside each. The y axis is the run's ratio (baseline time over the kernel's: above 1
faster), log-scaled, x is M (log2). ``--targets w4a16`` draws W4A16's geomean targets by M bucket (1-16: 3.0x,
32: 2.0x, 64: 1.6x, 128-256: 1.05x, 1024+: 1.0x) as steps. The formats sweep's cases that are not group-128
asymmetric are left out (their labels carry a suffix). Needs matplotlib."""

from __future__ import annotations

import argparse
import json
import lzma
import math
from collections import defaultdict
from pathlib import Path

W4A16_TARGETS = ((1, 16, 3.0), (32, 32, 2.0), (64, 64, 1.6), (128, 256, 1.05), (1024, 4096, 1.0))


def load(path: str) -> dict:
    text = lzma.open(path, "rt").read() if path.endswith(".xz") else Path(path).read_text()
    return json.loads(text)


def series(result: dict, kernel: str) -> dict[tuple[int, int], dict[int, float]]:
    """{(N, K): {M: ratio}} of ``kernel``'s correct rows with M, N, K dims and a plain label."""
    out: dict = defaultdict(dict)
    for row in result["rows"]:
        dims = row.get("dims") or {}
        if row.get("kernel") != kernel or row.get("ratio") is None or not {"M", "N", "K"} <= dims.keys():
            continue
        if row.get("status") not in (None, "ok", "correct") or "-" in str(row.get("shape", "")):
            continue
        out[dims["N"], dims["K"]][dims["M"]] = row["ratio"]
    return out


def plot(path: str, kernel: str, targets: str | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = load(path)
    lines = series(result, kernel)
    if not lines:
        raise SystemExit(f"{path}: no {kernel} rows with M, N and K")
    fig, ax = plt.subplots(figsize=(9, 5))
    by_m: dict = defaultdict(list)
    for (n, k), pts in sorted(lines.items()):
        ms = sorted(pts)
        ax.plot(ms, [pts[m] for m in ms], color="tab:blue", alpha=0.25, linewidth=1)
        for m in ms:
            by_m[m].append(math.log(pts[m]))
    ms = sorted(by_m)
    ax.plot(ms, [math.exp(sum(v) / len(v)) for v in (by_m[m] for m in ms)], color="tab:blue", linewidth=2.5,
            marker="o", label=f"{kernel}, geomean of {len(lines)} shapes")
    if targets == "w4a16":
        for lo, hi, t in W4A16_TARGETS:  # (a bucket of one M drawn a little wide, to be seen)
            ax.hlines(t, lo / 1.25, hi * 1.25, colors="tab:red", linewidth=2)
        ax.plot([], [], color="tab:red", linewidth=2, label="targets (geomean by M bucket)")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(by_m), [str(m) for m in sorted(by_m)])
    ax.set_yticks([0.5, 0.7, 1, 1.5, 2, 3, 4], ["0.5", "0.7", "1", "1.5", "2", "3", "4"])
    ax.minorticks_off()
    ax.set_xlabel("M (rows of x)")
    ax.set_ylabel(f"ratio to {result['meta'].get('baseline', 'the baseline')}")
    meta = result["meta"]
    ax.set_title(f"{meta.get('op')} {meta.get('dtype')} {meta.get('sweep') or ''}"
                 f"{' (CUDA graphs)' if meta.get('cuda_graph') else ''}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(path.removesuffix(".xz")).with_name(Path(path.removesuffix(".xz")).stem + "-ratios.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--targets", choices=["w4a16"], default=None)
    args = parser.parse_args(argv)
    for path in args.paths:
        print(f"wrote {plot(path, args.kernel, args.targets)}")


if __name__ == "__main__":
    main()
