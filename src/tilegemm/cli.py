"""The ``tilegemm`` command: ``bench``, ``info``, ``tune``, ``warmup``, ``puzzles``.

Every import of the kernels, the bench and rich is inside the command that needs it, so ``--help`` answers
without loading them (only ``bench --help`` asks the registry for its ops, dtypes and sweeps).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import sys
import tempfile
from pathlib import Path

from tilegemm_cli import EXAMPLES, UsageError, build_parser  # noqa: F401 (the parser lives outside the package)


def _read_shapes_file(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UsageError(f"cannot read --shapes file {path!r}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--shapes file {path!r} is not text (one shape per line)") from None
    shapes = [line.split("#", 1)[0].strip() for line in lines]
    shapes = [s for s in shapes if s]
    if not shapes:  # (not the default sweep: on a GPU that is minutes of shapes nobody asked for)
        raise UsageError(f"no shapes in --shapes file {path!r} (one M,N,K per line; '#' starts a comment)")
    return shapes


def _refuse_empty(args, *flags: str) -> None:
    """A UsageError for a string option given as '' (or blanks): read as not given, it ran something else (the
    default sweep for ``--shapes ''``, random weights for ``--checkpoint ''``) or wrote nothing."""
    for flag in flags:
        value = getattr(args, flag, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{flag.replace('_', '-')} is empty")


def _writable_dir(path: Path, what: str) -> None:
    """Make directory ``path`` (as the bench would, after its run) or raise a UsageError now, before the run."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"cannot write {what} under {str(path)!r}: it is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write {what} under {str(path)!r}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"cannot write {what} under {str(path)!r}: permission denied")
    try:  # as the writers do (a temporary file beside the target): root passes os.access where nothing can be made
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UsageError(f"cannot write {what} under {str(path)!r}: {err.strerror or err}") from None


def _check_outputs(args) -> None:
    """Every file the bench will write can be written: checked before the run, not after it."""
    given = {}
    for flag in ("json", "csv", "plot"):
        path = getattr(args, flag)
        if path:
            same = given.get(os.path.realpath(path))
            if same:  # (the second writer replaced the first's file: the JSON was lost under the CSV)
                raise UsageError(f"--{same} and --{flag} name the same file {path!r}: give each its own")
            given[os.path.realpath(path)] = flag
            if Path(path).is_dir():
                raise UsageError(f"--{flag} {path!r} is a directory; give a file path")
            _writable_dir(Path(path).parent, f"--{flag} {path!r}")
    if args.plot and Path(args.plot).suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if Path(args.plot).suffix[1:].lower() not in formats:
            raise UsageError(f"--plot {args.plot!r}: matplotlib writes no {Path(args.plot).suffix!r} files; give one "
                             f"of {', '.join('.' + f for f in sorted(formats))}")
    if not args.no_save:
        _writable_dir(Path(args.out), "the bench's files (--out)")


def _check_host_memory(op, cases, dtype, options, console) -> None:
    """Under the interpreter: a UsageError for a case larger than the host's free memory (before anything is
    allocated: the OS would kill the process mid-allocation), and a warning for a case that would run for long."""
    from tilegemm.bench.base import interpreter_slow, memory_shortfall
    from tilegemm.core.hardware import host_memory_available

    available = host_memory_available()
    for case in cases:
        shortfall = memory_shortfall(op, case, dtype, options, available)
        if shortfall:
            raise UsageError(f"{shortfall}: under Triton's interpreter every tensor lives in host memory; give a "
                             "smaller shape")
    slow = [case.label for case in cases if interpreter_slow(op, case, dtype, options)]
    if slow:
        more = f" and {len(slow) - 3} more" if len(slow) > 3 else ""
        console.print(f"warning: under Triton's interpreter {', '.join(slow[:3])}{more} may run for a long time (each "
                      "kernel runs on the CPU, block by block: docs/bench.md, \"Under the interpreter\"); tiny shapes "
                      "take seconds", highlight=False, markup=False, soft_wrap=True)


def _unavailable_reason(op_name: str, kernel: str) -> str | None:
    from tilegemm.core import registry

    try:
        return registry.get(op_name, kernel).unavailable_reason()
    except ValueError:  # auto, or a model's entry: they run wherever the op does
        return None


def cmd_bench(args, console, err_console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tilegemm.bench.base import BenchError, bench_op
    from tilegemm.bench.report import print_report, write_csv, write_json, write_plot
    from tilegemm.bench.runner import run_bench
    from tilegemm.core.hardware import compute_capability
    from tilegemm.core.runtime import interpreting

    _refuse_empty(args, "shapes", "checkpoint", "model", "dtype", "sweep", "kernels", "json", "csv", "plot", "out")
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    if args.no_save and args.out is not None:
        raise UsageError(f"--out {args.out!r} says where the bench's files go and --no-save writes none: give one")
    if args.topk is not None and args.no_save and not args.plot:
        raise UsageError("--topk sets the plot's kernels, and --no-save without --plot draws no plot")
    args.out = "tilegemm-bench" if args.out is None else args.out
    args.topk = 4 if args.topk is None else args.topk
    if args.topk < 1:
        raise UsageError(f"--topk must be >= 1, got {args.topk}")
    # (nan passes every comparison, and an infinite --rep never ends a GPU timing loop)
    if not (math.isfinite(args.warmup) and args.warmup >= 0 and math.isfinite(args.rep) and args.rep > 0):
        raise UsageError(f"--warmup must be >= 0 and --rep > 0, both finite (milliseconds); got --warmup "
                         f"{args.warmup:g} --rep {args.rep:g}")
    if args.rounds is not None and args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    if args.precompile < -1:
        raise UsageError(f"--precompile takes a worker count >= 0, or -1 for min(16, CPUs - 1); got {args.precompile}")
    try:
        op = bench_op(args.op)
        if args.checkpoint and not args.model:
            raise UsageError("--checkpoint names the model to load: give it with --model (--op w4a16 --model llama)")
        if args.layers is not None and not args.model:
            raise UsageError("--layers sets a model entry's decoder layers: give the model with --model")
        if args.layers is not None and args.layers < 1:
            raise UsageError(f"--layers must be >= 1, got {args.layers}")
        if args.layers is not None and args.checkpoint:
            raise UsageError("--layers does not apply with --checkpoint: the checkpoint's config sets the layers")
        if args.model:
            kwargs = {k: v for k, v in (("checkpoint", args.checkpoint), ("layers", args.layers)) if v}
            try:  # from here on the model's adapter: its sweeps, dtypes, kernel, rows
                op = op.model_bench(args.model, **kwargs)
            except TypeError:
                flags = " and ".join(f"--{k}" for k in kwargs)
                raise UsageError(f"{flags} does not apply to --model {args.model}") from None
            if args.layers is not None and interpreting():
                raise UsageError("--layers sets the depth of the full-size model, which runs on a GPU; under "
                                 "Triton's interpreter the tiny model (2 layers) runs")
            if args.cuda_graph:
                raise UsageError(f"--cuda-graph does not apply to --model {args.model}: its cases say how each "
                                 "model runs (eager, graph, compile)")
            if args.precompile:
                raise UsageError(f"--precompile does not apply to --model {args.model}: a model's layers compile "
                                 "in its own first calls")
        if args.cuda_graph and interpreting():
            raise UsageError("--cuda-graph needs a CUDA GPU: under Triton's interpreter there are no CUDA graphs to "
                             "time")
        dtype = args.dtype or op.default_dtype()
        op.check_dtype(dtype, compute_capability())
        texts = list(args.shape) + (_read_shapes_file(args.shapes) if args.shapes else [])
        if texts:
            if args.sweep:
                raise UsageError("give either --sweep or --shape/--shapes, not both")
            cases, sweep = [op.parse_shape(t) for t in texts], "custom"
            # a shape given twice runs once, as a kernel named twice does
            cases = list({(c.label, tuple(sorted(c.dims.items()))): c for c in cases}.values())
        else:
            sweep = args.sweep or (op.cpu_sweep if interpreting() else op.gpu_sweep)
            cases = op.cases(sweep)
        if args.kernels.strip() == "all":
            kernels = op.kernel_names(dtype)
        else:
            kernels = list(dict.fromkeys(k.strip() for k in args.kernels.split(",") if k.strip()))  # (once each)
            if not kernels:
                raise UsageError("--kernels is empty")
            for k in kernels:
                op.check_kernel(k)
            reasons = {k: _unavailable_reason(op.name, k) for k in kernels}
            if all(reasons.values()):
                raise UsageError("no kernel of --kernels can run here: "
                                 + "; ".join(f"{k}: {r}" for k, r in reasons.items()))
    except BenchError as err:
        raise UsageError(str(err)) from None
    options = dict(layout=args.layout, batch=args.batch, fast_accum=args.fast_accum, mode=args.mode,
                   memory_format=args.memory_format)
    try:
        op.check_options(options, dtype)
        batch_of = getattr(op, "batch_of", None)
        for case in cases if batch_of is not None else ():  # (a case's own batch against --batch: before any run)
            batch_of(case, options)
        if interpreting():
            _check_host_memory(op, cases, dtype, options, err_console)
    except BenchError as err:
        raise UsageError(str(err)) from None
    _check_outputs(args)

    total = len(cases) * (len(kernels) + (0 if args.no_baseline else 1))
    progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err_console, transient=True, disable=args.quiet)
    with progress:
        task = progress.add_task("benchmarking", total=total)

        def on_step(what: str) -> None:
            progress.update(task, advance=1, description=f"{what:<28}")

        try:  # (a model entry's checkpoint is read at its first case: a damaged one is a usage error)
            result = run_bench(op, cases, dtype, kernels, baseline=not args.no_baseline, warmup_ms=args.warmup,
                               rep_ms=args.rep, cuda_graph=args.cuda_graph, rounds=args.rounds,
                               options=options, sweep=sweep, on_step=on_step, precompile=args.precompile,
                               on_note=lambda line: err_console.print(line, highlight=False, markup=False,
                                                                      soft_wrap=True))
        except BenchError as err:
            raise UsageError(str(err)) from None
    print_report(result, console)
    if result.meta.get("interrupted"):
        console.print(f"interrupted: {result.meta['interrupted']} (the report and files hold those)")

    paths = dict(json=args.json, csv=args.csv, plot=args.plot)
    if not args.no_save:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        part = sweep.replace(":", "-").replace("/", "of")  # zoo:0/4 -> zoo-0of4: one file name
        stem = Path(args.out) / f"{op.name.replace(':', '-')}-{dtype}-{part}-{stamp}"
        for key, suffix in (("json", ".json"), ("csv", ".csv"), ("plot", ".png")):
            paths[key] = paths[key] or str(stem) + suffix
    writers = dict(json=write_json, csv=write_csv, plot=lambda r, p: write_plot(r, p, topk=args.topk))
    unwritten = []
    for key, path in paths.items():
        if path:
            try:  # (checked before the run; a disk that fills or a folder removed since still loses only this file)
                writers[key](result, path)
            except OSError as err:
                unwritten.append(f"cannot write {path}: {err.strerror or err}")
                continue
            except Exception as err:  # noqa: BLE001 (matplotlib's backends: .pgf needs a LaTeX install, say)
                first = str(err).splitlines()[0] if str(err) else ""
                unwritten.append(f"cannot write {path}: {type(err).__name__}: {first}")
                continue
            console.print(f"wrote {path}")
    for line in unwritten:
        print(f"tilegemm: error: {line}", file=sys.stderr)

    bad = [r for r in result.rows if r.status in ("wrong", "error")]
    if bad:
        console.print(f"[bold red]{len(bad)} result(s) wrong or failed: "
                      + ", ".join(f"{r.kernel}@{r.shape} ({r.status})" for r in bad[:8]) + "[/]")
        return 1
    if unwritten:
        return 1
    return 130 if result.meta.get("interrupted") else 0  # (a shell's code for SIGINT: the sweep is partial)


def cmd_info(args, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    from tilegemm.core import registry
    from tilegemm.core.hardware import machine_info, peaks_for

    info = machine_info()
    table = Table(title="tilegemm info", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("backend", info.backend + ("  (timings are not GPU performance)" if info.interpreter else "")),
        ("GPU", info.gpu or "none in use"),
        ("SMs / L2 / memory", f"{info.sm_count} / {_mb(info.l2_bytes)} / {_mb(info.memory_bytes)}"
         if info.gpu else "-"),
        ("compute capability", info.compute_capability or "-"),
        ("driver / CUDA", f"{info.driver or '-'} / {info.cuda or '-'}"),
        ("peaks (datasheet, dense)", _peaks_text(peaks_for(info.gpu)) if info.gpu else "-"),
        ("torch / triton / numpy", f"{info.torch} / {info.triton} / {info.numpy}"),
        ("python / tilegemm", f"{info.python} / {info.tilegemm}"),
        ("git commit", info.git_commit or "-"),
        ("triton cache (compiled kernels)", _triton_cache_dir()),
        ("tuned configs (tilegemm tune)", _tuning_text()),
    ]
    for what, value in rows:
        table.add_row(what, escape(value))
    console.print(table)
    kernels = Table(title="registered kernels")
    for column in ("op", "kernel", "what it is"):
        kernels.add_column(column)
    for op in registry.ops():
        for name, summary in registry.kernels(op).items():
            kernels.add_row(op, name, escape(summary))  # "[pixels, channels]" is text, not rich markup
    console.print(kernels)
    return 0


def _mb(n) -> str:
    return f"{n / 2**20:.0f} MiB" if n else "-"


def _peaks_text(peaks: dict) -> str:
    if not peaks:
        return "n/a (GPU not in tilegemm's table)"
    parts = [f"{k} {v:g} TFLOPS" for k, v in peaks.items() if k != "tbps"]
    return ", ".join(parts) + f"; memory {peaks['tbps']:g} TB/s"


def _tuning_text() -> str:
    from tilegemm.core import tuning

    where = str(tuning.cache_file()) if tuning._disk_enabled() else "memory only"
    shipped = tuning.shipped_file()
    if not shipped.exists():
        return f"{where}; shipped defaults: none for this GPU (auto's rules decide)"
    own = tuning._device_tag()[0]
    sibling = "" if shipped.stem == own else f" (a sibling GPU's: none ship for {own})"
    return f"{where}; shipped defaults: {shipped.name}{sibling}"


def _triton_cache_dir() -> str:
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # older triton
        import os

        return os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))


def _op_entry(name: str, entry: str, what: str):
    """(the op's spec, the function its ``entry`` (``tune``, ``warmup``) names), or a UsageError naming the ops
    that have one."""
    from tilegemm.core import registry

    try:
        spec = registry.op(name)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if getattr(spec, entry) is None:
        having = [o for o in registry.ops() if getattr(registry.op(o), entry)]
        raise UsageError(f"op {name!r} has nothing to {what}; ops that do: {', '.join(having)}")
    return spec, registry.resolve(getattr(spec, entry))


def cmd_tune(args, console) -> int:
    from rich.table import Table

    from tilegemm.bench.base import BenchError, bench_op
    from tilegemm.core import tuning
    from tilegemm.core.registry import NotApplicable
    from tilegemm.core.runtime import interpreting

    _refuse_empty(args, "dtype", "sweep", "kernels")
    spec, tune = _op_entry(args.op, "tune", "tune")
    op = bench_op(args.op)
    dtype = args.dtype or op.default_dtype()
    try:
        op.check_dtype(dtype, None)
        if args.shape and args.sweep:
            raise UsageError("give either --sweep or --shape, not both")
        cases = [op.parse_shape(t) for t in args.shape] if args.shape else op.cases(args.sweep or op.tune_sweep)
    except BenchError as err:
        raise UsageError(str(err)) from None
    kernels = [r.strip() for r in args.kernels.split(",") if r.strip()]
    if not kernels:
        raise UsageError(f"--kernels names no kernel: give one or more of {', '.join(spec.tunable)}")
    for kernel in kernels:
        if kernel not in spec.tunable:
            raise UsageError(f"--kernels takes {', '.join(spec.tunable)} for op {args.op}, not {kernel!r}")
    reasons = {k: r for k in kernels if (r := _unavailable_reason(op.name, k))}
    if reasons:
        raise UsageError("kernel(s) of --kernels that cannot run here: "
                         + "; ".join(f"{k}: {r}" for k, r in reasons.items()))
    if interpreting() and args.shape:  # the tuning path makes the case's inputs (bench.prepare) in host memory
        _check_host_memory(op, cases, dtype, dict(batch=1), console)
    if interpreting() and not args.shape:  # as warmup: one config per kernel, and a sweep takes minutes there
        console.print("[yellow]No GPU in use: under Triton's interpreter each kernel has one config, so there is "
                      "nothing to tune. Run `tilegemm tune` on the GPU the configs are for (--shape runs given "
                      "shapes through the tuning path here, untimed).[/]")
        return 0
    if tuning._disk_enabled():  # (checked now: the configs are saved as each is tuned)
        _writable_dir(tuning.cache_dir(), "the tuning cache ($TILEGEMM_CACHE_DIR or ~/.cache/tilegemm)")
    before = set(tuning.entries())
    with tuning.timing():  # the call path times nothing unless asked; here it is asked
        for i, case in enumerate(cases, 1):  # one case at a time, so that a long sweep shows where it is
            console.print(f"[{i}/{len(cases)}] tuning {case.label}", highlight=False, markup=False)
            try:
                tune(op, [case], dtype, kernels)
            except NotApplicable as err:  # a kernel that does not take this dtype or shape: said, not a traceback
                raise UsageError(f"cannot tune {case.label} in {dtype}: {err}") from None
    added = {k: v for k, v in tuning.entries().items() if k not in before}
    table = Table(title=f"tuned {len(added)} new shape class(es)")
    table.add_column("key", no_wrap=True)
    table.add_column("config")
    for k, v in added.items():
        table.add_row(k, ", ".join(f"{n}={x}" for n, x in v.items()))
    console.print(table)
    where = tuning.cache_file() if tuning._disk_enabled() else "memory only (disk cache off)"
    console.print(f"tuning cache: {where}")
    return 0


def cmd_warmup(args, console) -> int:
    import time

    from tilegemm.core.runtime import interpreting

    _refuse_empty(args, "dtype")
    _, warmup = _op_entry(args.op, "warmup", "warm up")
    extra = {}
    if args.shape or args.dtype:
        from tilegemm.bench.base import BenchError, bench_op

        if not args.shape:
            raise UsageError("--dtype applies with --shape only (the shipped classes carry their own dtypes)")
        op = bench_op(args.op)
        dtype = args.dtype or op.default_dtype()
        try:
            op.check_dtype(dtype, None)
            extra = dict(cases=[op.parse_shape(t) for t in args.shape], dtype=dtype)
        except BenchError as err:
            raise UsageError(str(err)) from None
    if interpreting():
        console.print("[yellow]No GPU in use: under Triton's interpreter nothing is compiled, so there is nothing "
                      "to warm up.[/]")
        return 0
    start = time.perf_counter()
    warmed = warmup(on_key=lambda key: console.print(f"compiling {key}", highlight=False), **extra)
    what = "shapes" if extra else "shape classes"
    console.print(f"warmed {len(warmed)} {what} of {args.op} in {time.perf_counter() - start:.1f} s; "
                  f"Triton's cache: {_triton_cache_dir()}")
    return 0


def cmd_puzzles(args, console) -> int:
    import os
    import subprocess

    from tilegemm.core import runtime

    if args.trials < 1:
        raise UsageError(f"--trials must be >= 1, got {args.trials}")
    if runtime._interpret is None and "triton" not in sys.modules:
        os.environ["TILEGEMM_INTERPRET"] = "1"
    elif not runtime.interpreting():
        # The GPU compiler is already chosen in this process: run the puzzles in a fresh interpreter one.
        env = dict(os.environ, TILEGEMM_INTERPRET="1", TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "tilegemm.cli", "puzzles", "--trials", str(args.trials)]
        return subprocess.run(cmd, env=env).returncode
    from tilegemm.learn.puzzles import run_all

    return run_all(trials=args.trials, console=console)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    import warnings

    from tilegemm.core.runtime import InterpreterWarning

    # The bench and info output say plainly when the interpreter runs; the warning would repeat it.
    warnings.simplefilter("ignore", InterpreterWarning)
    console = Console()
    err_console = Console(stderr=True)
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if args.command in ("bench", "info", "tune", "warmup"):
            from tilegemm.core.runtime import missing_gpu

            problem = missing_gpu()
            if problem:
                raise UsageError(problem)
        if args.command == "bench":
            return cmd_bench(args, console, err_console)
        if args.command == "info":
            return cmd_info(args, console)
        if args.command == "puzzles":
            return cmd_puzzles(args, console)
        if args.command == "tune":
            return cmd_tune(args, console)
        if args.command == "warmup":
            return cmd_warmup(args, console)
        raise UsageError(f"unknown command {args.command!r}")
    except UsageError as err:
        print(f"tilegemm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
