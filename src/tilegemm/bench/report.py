"""Showing and saving a bench result: a table, a summary, JSON, CSV and a PNG plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from tilegemm.bench.runner import BASELINE, BASELINE2, BASELINES, BenchResult
from tilegemm.core.files import atomic_write

CSV_FIELDS = ["op", "kernel", "shape", "dtype", "layout", "batch", "status", "rel_err", "tolerance", "ms", "ms_p20",
              "ms_p80", "metric", "value", "ratio", "ratio2", "pct_peak", "secondary", "secondary_pct_peak", "message"]


def _title(result: BenchResult) -> str:
    m = result.meta
    machine = m["machine"]
    where = machine["gpu"] or machine["backend"]
    title = f"{m['op']} {m['dtype']} on {where}: {m['metric']}"
    if m.get("baseline"):
        title += f", x {m['baseline']}"
    if m["layout"] != "NN" or m["batch"] != 1:
        title += f" (layout {m['layout']}, batch {m['batch']})"
    settings = _settings(m)
    if settings:
        title += f" ({settings})"
    if machine["interpreter"]:
        title += "\n[bold yellow]INTERPRETER: timings are NOT GPU performance[/]"
    return title


def _settings(meta: dict) -> str:
    """The run's settings that change what was timed, where not their defaults (a backward run's table and plot
    must not read as a forward one's): mode, memory format, fast accumulation, CUDA graphs."""
    parts = [f"mode {meta['mode']}" if meta.get("mode") not in (None, "fwd") else "",
             f"{meta['memory_format']}" if meta.get("memory_format") not in (None, "channels_last") else "",
             "fast accum" if meta.get("fast_accum") else "", "CUDA graphs" if meta.get("cuda_graph") else ""]
    return ", ".join(p for p in parts if p)


def _fmt_time(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms < 1:
        return f"{ms * 1e3:.1f}us"
    return f"{ms:.2f}ms" if ms < 1000 else f"{ms / 1e3:.1f}s"


def results_table(result: BenchResult) -> Table:
    """One row per (shape, kernel), a section per shape; the fastest correct kernel of a shape is starred."""
    summary = result.summary()
    base_name = result.meta.get("baseline") or "baseline"
    table = Table(title=_title(result))
    with_peak = result.meta.get("peak") is not None
    second = result.meta.get("secondary_metric")
    base2 = result.meta.get("second_baseline")
    columns = (["shape", "kernel", "time", result.meta["metric"]] + ([second, f"% {second} peak"] if second else [])
               + ["ratio"] + ([f"x {base2}"] if base2 else []) + (["% peak"] if with_peak else []) + ["error"])
    for column in columns:
        table.add_column(column, justify="left" if column in ("shape", "kernel") else "right", no_wrap=True)
    shapes = result.cases()
    # Under the interpreter a rate or ratio would be a CPU timing dressed as a GPU number: show "-" instead.
    gpu = not result.meta["machine"]["interpreter"]
    for i, shape in enumerate(shapes):
        rows = [r for r in result.rows if r.shape == shape]
        best = summary["best_per_shape"].get(shape)
        for j, row in enumerate(rows):
            name = base_name if row.kernel == BASELINE else base2 if row.kernel == BASELINE2 else row.kernel
            if row.kernel == best:
                name += " *"
            if row.status == "error":
                cells = [Text(f"error: {row.message[:50]}", style="red")] + [""] * (len(columns) - 3)
            else:
                ratio = "" if row.kernel == BASELINE else "-" if row.ratio is None or not gpu else f"{row.ratio:.2f}x"
                if gpu and row.ratio is not None and row.kernel != BASELINE and row.status == "ok":
                    ratio = Text(ratio, style="green" if row.ratio >= 1.0 else ("yellow" if row.ratio >= 0.9 else ""))
                err = "-" if row.rel_err is None else f"{row.rel_err:.0e}"
                if row.status == "wrong":
                    err = Text(f"WRONG {err}", style="bold red")
                if row.status == "unavailable":  # (the reason goes under the table: a long cell squeezes the rest)
                    cells = [Text("unavailable", style="dim")] + [""] * (len(columns) - 3)
                    table.add_row(shape if j == 0 else "", name, *cells,
                                  end_section=j == len(rows) - 1 and i < len(shapes) - 1)
                    continue
                cells = [_fmt_time(row.ms), f"{row.value:.3g}" if row.value is not None and gpu else "-"]
                if second:
                    cells += [f"{row.secondary:.0f}" if row.secondary is not None and gpu else "-",
                              f"{row.secondary_pct_peak:.0f}%" if row.secondary_pct_peak is not None and gpu else "-"]
                cells.append(ratio)
                if base2:
                    cells.append("" if row.kernel in BASELINES else "-" if row.ratio2 is None or not gpu
                                 else f"{row.ratio2:.2f}x")
                if with_peak:
                    cells.append(f"{row.pct_peak:.0f}%" if row.pct_peak is not None else "-")
                cells.append(err)
            table.add_row(shape if j == 0 else "", name, *cells, end_section=j == len(rows) - 1 and i < len(shapes) - 1)
    table.caption = "* fastest correct kernel for the shape"
    return table


def summary_table(result: BenchResult) -> Table:
    summary = result.summary()
    base = result.meta.get("baseline") or "baseline"
    table = Table(title=f"summary: ratio = {base} time / kernel time")
    base2 = result.meta.get("second_baseline")
    columns = ("kernel", "geomean", "worst (shape)", "best") + ((f"geomean x {base2}",) if base2 else ()) + (
        "% peak", "correct")
    for column in columns:
        table.add_column(column, justify="left" if column == "kernel" else "right", no_wrap=True)
    gpu = not result.meta["machine"]["interpreter"]
    for kernel, s in summary["kernels"].items():
        fmt = lambda v, spec=".2f", suffix="x": f"{v:{spec}}{suffix}" if v is not None and gpu else "-"  # noqa: E731
        correct = f"{s['correct']}/{s['cases']}" + (f" ({s['unavailable']} n/a)" if s.get("unavailable") else "")
        style = "bold red" if s["wrong"] or s["errors"] else ""
        cells = [kernel, fmt(s["geomean_ratio"]),
                 f"{fmt(s['worst_ratio'])} ({s['worst_shape']})" if s["worst_ratio"] and gpu else "-",
                 fmt(s["best_ratio"])]
        if base2:
            cells.append(fmt(s["geomean_ratio2"]))
        table.add_row(*cells, fmt(s["mean_pct_peak"], ".0f", "%"), Text(correct, style=style))
    return table


def _print_whole(console: Console, renderable) -> None:
    """Print a table at its natural width when the output is a file or a pipe: rich would otherwise fit it to
    80 columns and cut numbers short (``13.21…``); a terminal keeps its own width."""
    if console.is_terminal:
        console.print(renderable)
        return
    need = Measurement.get(console, console.options.update_width(10_000), renderable).maximum
    width = console.width
    console.width = max(width, need)
    try:
        console.print(renderable)
    finally:
        console.width = width


def unavailable_notes(result: BenchResult) -> list[str]:
    """One line per kernel (and reason) that could not run some cases: which, on how many, and why."""
    shapes: dict[tuple[str, str], int] = {}
    for row in result.rows:
        if row.status == "unavailable":
            shapes[(row.kernel, row.message)] = shapes.get((row.kernel, row.message), 0) + 1
    return [f"{kernel} unavailable on {n} case(s): {message}" for (kernel, message), n in shapes.items()]


def print_report(result: BenchResult, console: Console) -> None:
    if result.meta.get("model_description"):
        console.print(f"model {result.meta['model']}: {result.meta['model_description']}", highlight=False)
    _print_whole(console, results_table(result))
    for note in unavailable_notes(result):
        console.print(Text(note, style="dim"), soft_wrap=True)
    if any(k not in BASELINES for k in result.kernels()) and result.meta.get("baseline"):
        _print_whole(console, summary_table(result))
    host = result.meta.get("host_us_per_call")
    if host:
        console.print(f"host time per call on a tiny problem: tilegemm {host['tilegemm']:.1f} us, "
                      f"{result.meta['baseline']} {host['baseline']:.1f} us ({host['ratio']:.2f}x)")
    if result.meta["machine"]["interpreter"]:
        console.print("[yellow]Kernels ran under Triton's interpreter on the CPU: these timings say nothing about "
                      "GPU performance. Correctness checks are real.[/]")


def _finite(value):
    """``value`` with every non-finite float as None (JSON has no Infinity or NaN; a wrong kernel's error is inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(result: BenchResult, path) -> None:
    atomic_write(path, lambda f: json.dump(_finite(result.to_dict()), f, indent=1, default=str, allow_nan=False))


def write_csv(result: BenchResult, path) -> None:
    def write(f):
        machine = result.meta["machine"]
        for key in ("gpu", "sm_count", "driver", "cuda", "torch", "triton", "tilegemm", "git_commit", "timestamp",
                    "backend"):
            f.write(f"# {key}: {machine.get(key)}\n")
        for key in ("op", "dtype", "sweep", "model", "model_description", "mode", "layout", "batch", "memory_format",
                    "fast_accum", "cuda_graph", "timing", "note"):
            if result.meta.get(key) is not None:
                f.write(f"# {key}: {result.meta[key]}\n")
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: getattr(row, k) for k in CSV_FIELDS})

    atomic_write(path, write)


def write_plot(result: BenchResult, path, topk: int = 4) -> None:
    """TFLOPS (or GB/s) against the sweep for the top-k kernels by geometric-mean ratio, plus the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ylabel, series = plot_series(result, topk)
    shapes = result.cases()
    fig, ax = plt.subplots(figsize=(max(7.0, 0.55 * len(shapes) + 3), 4.8))
    for kernel, points in series.items():
        label = result.meta["baseline"] if kernel == BASELINE else kernel
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                linestyle="--" if kernel == BASELINE else "-", color="black" if kernel == BASELINE else None,
                label=label)
    interpreter = result.meta["machine"]["interpreter"]
    if interpreter:
        ax.set_yscale("log")
    peak = result.meta.get("peak")
    if peak and not interpreter:
        ax.axhline(peak, color="grey", linewidth=0.8, linestyle=":", label=f"peak {peak:g}")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=45 if len(shapes) > 6 else 0, ha="right" if len(shapes) > 6 else "center",
                       fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("shape (M x N x K)" if result.meta["op"] == "matmul" else
                  "case (batch, mode)" if result.meta.get("model") else "size")
    machine = result.meta["machine"]
    title = f"tilegemm {result.meta['op']} {result.meta['dtype']} on {machine['gpu'] or machine['backend']}"
    if result.meta.get("sweep"):
        title += f" ({result.meta['sweep']} sweep)"
    if _settings(result.meta):
        title += f"\n{_settings(result.meta)}"
    if machine["interpreter"]:
        title += "\nINTERPRETER: not GPU performance"
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    plain = not Path(path).suffix  # no suffix: a PNG under the very name given (matplotlib would add .png)
    fig.savefig(path, dpi=110, format="png" if plain else None)
    plt.close(fig)
    if plain or str(path).lower().endswith(".png"):
        _to_palette(path)


def plot_series(result: BenchResult, topk: int = 4) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """What :func:`write_plot` draws: the y label and, for the top-k kernels by geometric-mean ratio and the
    baseline, ``[(case position, y)]``. y is the rate on a GPU; under the interpreter, where the table shows no
    rate (a CPU timing is not a GPU number), it is the host time in ms, labelled as such."""
    summary = result.summary()["kernels"]
    ranked = sorted((k for k in summary if summary[k]["geomean_ratio"]),
                    key=lambda k: summary[k]["geomean_ratio"], reverse=True)
    if not ranked:  # no baseline: rank by mean rate
        ranked = sorted(summary, key=lambda k: -_mean_value(result, k))
    chosen = ranked[:topk] + ([BASELINE] if BASELINE in result.kernels() else [])
    position = {s: i for i, s in enumerate(result.cases())}
    interpreter = result.meta["machine"]["interpreter"]
    label = "time (ms) under Triton's interpreter on the CPU: not GPU performance" if interpreter \
        else result.meta["metric"]
    series = {}
    for kernel in chosen:
        rows = [r for r in result.rows if r.kernel == kernel and r.ok and (r.ms if interpreter else r.value)]
        series[kernel] = [(position[r.shape], r.ms if interpreter else r.value) for r in rows]
    return label, series


def _to_palette(path) -> None:
    """Rewrite a PNG plot with a 256-colour palette: a third of its RGBA size, the same picture to the eye (a
    sweep of 200 shapes makes an image 12000 pixels wide)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256)
    small.save(path, format="PNG", optimize=True)


def _mean_value(result: BenchResult, kernel: str) -> float:
    values = [r.value for r in result.rows if r.kernel == kernel and r.ok and r.value]
    return sum(values) / len(values) if values else 0.0
