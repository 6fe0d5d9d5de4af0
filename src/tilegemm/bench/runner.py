"""The bench loop: for every case and kernel, check the result against the reference, then time it."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from tilegemm.bench.base import BenchOp, Case, ModelBench, geomean, memory_shortfall
from tilegemm.core.hardware import MachineInfo, host_memory_available, machine_info, peak_gbps
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import interpreting

BASELINE = "baseline"
BASELINE2 = "baseline2"  # an op's second baseline (w4a16: torch's int4 kernel), where it has one
BASELINES = (BASELINE, BASELINE2)
SCHEMA = "tilegemm-bench/1"


@dataclass
class Row:
    op: str
    kernel: str  # a registered name, or "baseline"
    shape: str
    dims: dict
    x: float
    dtype: str
    layout: str
    batch: int
    status: str  # "ok", "wrong", "error", "unavailable"
    rel_err: float | None = None
    tolerance: float | None = None
    ms: float | None = None  # median
    ms_p20: float | None = None
    ms_p80: float | None = None
    metric: str = "TFLOPS"
    value: float | None = None  # TFLOPS or GB/s at the median time
    ratio: float | None = None  # baseline time / this time (>1: faster than the baseline)
    ratio2: float | None = None  # second baseline's time / this time, where the op has a second baseline
    pct_peak: float | None = None
    secondary: float | None = None  # the op's secondary metric (e.g. GB/s of weight traffic), if it has one
    secondary_pct_peak: float | None = None  # ... as % of the GPU's memory bandwidth
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class BenchResult:
    meta: dict
    rows: list[Row] = field(default_factory=list)

    def kernels(self) -> list[str]:
        return list(dict.fromkeys(r.kernel for r in self.rows))

    def cases(self) -> list[str]:
        return list(dict.fromkeys(r.shape for r in self.rows))

    def summary(self) -> dict:
        """Per kernel: geometric-mean and worst ratio to the baseline over the correct cases; best per shape.
        ``cases`` counts the cases the kernel ran (``correct`` of them right); ``unavailable`` those it cannot
        take here."""
        per_kernel = {}
        for kernel in self.kernels():
            if kernel in BASELINES:
                continue
            every = [r for r in self.rows if r.kernel == kernel]
            rows = [r for r in every if r.status != "unavailable"]  # a case it cannot take is not a wrong one
            good = [r for r in rows if r.ok and r.ratio]
            good2 = [r.ratio2 for r in rows if r.ok and r.ratio2]
            worst = min(good, key=lambda r: r.ratio) if good else None
            per_kernel[kernel] = dict(
                geomean_ratio=geomean([r.ratio for r in good]),
                geomean_ratio2=geomean(good2),
                worst_ratio=worst.ratio if worst else None,
                worst_shape=worst.shape if worst else None,
                best_ratio=max((r.ratio for r in good), default=None),
                mean_pct_peak=(statistics.fmean([r.pct_peak for r in good if r.pct_peak is not None])
                               if any(r.pct_peak is not None for r in good) else None),
                correct=sum(r.ok for r in rows),
                wrong=sum(r.status == "wrong" for r in rows),
                errors=sum(r.status == "error" for r in rows),
                cases=len(rows),
                unavailable=len(every) - len(rows),
            )
        best = {}
        for shape in self.cases():
            good = [r for r in self.rows if r.shape == shape and r.ok and r.ms]
            if good:
                winner = min(good, key=lambda r: r.ms)
                best[shape] = winner.kernel
        return dict(kernels=per_kernel, best_per_shape=best)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchResult":
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a tilegemm bench file (schema {data.get('schema')!r}, expected {SCHEMA!r})")
        return cls(data["meta"], [Row(**row) for row in data["rows"]])

    def to_dict(self) -> dict:
        return dict(schema=SCHEMA, meta=self.meta, rows=[asdict(r) for r in self.rows], summary=self.summary())


# --- timing ---------------------------------------------------------------------------------------------


def _cycle(sets: list[dict], fn: Callable[[dict], object]) -> Callable[[], object]:
    it = itertools.cycle(sets)
    return lambda: fn(next(it))


def time_samples(fn: Callable[[], object], warmup_ms: float, rep_ms: float, cuda_graph: bool) -> list[float]:
    """Times of single calls (or graph replays) in milliseconds."""
    if interpreting():
        return _time_on_host(fn, rep_ms)
    import triton.testing

    if cuda_graph:
        with torch.cuda.stream(torch.cuda.Stream()):
            result = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="all")
    else:
        # do_bench clears L2 before every timed call, so each call reads its inputs from memory.
        result = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return [float(v) for v in (result if isinstance(result, list) else [result])]


def summarize(times: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of a list of times."""
    times = sorted(times)
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else times * 9
    return statistics.median(times), q[1], q[7]


def _time_on_host(fn, rep_ms: float) -> list[float]:
    # No warm-up call: the correctness check just ran the same function. One call can outlast rep_ms here
    # (the interpreter runs a GEMM for seconds), and the time says nothing about GPUs: one sample then.
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while not times or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def host_us_per_call(fn, calls: int = 1000, repeats: int = 5) -> float:
    """Best-of-``repeats`` wall time per call of ``fn`` over ``calls`` back-to-back calls, in microseconds."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def graph_us_per_call(fn, calls: int = 20, reps: int = 20) -> float:
    """GPU microseconds per call of ``fn`` without the host: ``calls`` calls captured in one CUDA graph (after a
    warm call on a side stream), replayed ``reps`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def host_overhead(op: BenchOp, device: str) -> dict | None:
    """Host time per call on a tiny problem (GPU work negligible): tilegemm's default call and the baseline's."""
    probe = op.overhead_probe(device)
    if probe is None:
        return None
    result = {name: host_us_per_call(fn) for name, fn in zip(("tilegemm", "baseline"), probe)}
    result["ratio"] = result["tilegemm"] / result["baseline"]
    return result


def rotation_count(bytes_per_set: int, machine: MachineInfo, cuda_graph: bool) -> int:
    """Input sets to rotate through: enough to overflow L2 twice in graph mode (do_bench flushes L2 itself)."""
    if not cuda_graph or not machine.l2_bytes:
        return 1
    want = -(-2 * machine.l2_bytes // max(bytes_per_set, 1))
    return int(max(1, min(want, 16)))


# --- the loop -------------------------------------------------------------------------------------------


def run_bench(
    op: BenchOp,
    cases: list[Case],
    dtype: str,
    kernels: list[str],
    *,
    baseline: bool = True,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    cuda_graph: bool = False,
    options: dict | None = None,
    sweep: str | None = None,
    on_step: Callable[[str], None] | None = None,
    rounds: int | None = None,
    precompile: int = 0,
    on_note: Callable[[str], None] | None = None,
) -> BenchResult:
    """Check and time ``kernels`` (and the baseline) on each case.

    Timing is split into ``rounds`` (default 3 on a GPU, 1 under the interpreter) of ``rep_ms / rounds``
    each; every round times every kernel, in alternating order, so a drift in clocks or temperature during
    a case reaches the baseline and the kernels alike. A row's time is the median of all its samples.

    ``precompile`` J > 0 (-1: min(16, CPUs - 1)) first compiles every case's kernels in J worker processes
    (:mod:`tilegemm.bench.precompile`), all of which have exited before anything here is timed; ``on_note``
    gets its one-line notes (a failed case, the summary).
    """
    options = dict(options or {})
    options.setdefault("batch", 1)
    if not options.get("layout"):
        options["layout"] = op.default_layout(dtype)
    machine = machine_info()
    device = "cpu" if machine.interpreter else "cuda"
    if rounds is None:
        rounds = 1 if machine.interpreter else 3
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    peak = op.peak(machine.gpu, dtype)
    bandwidth = peak_gbps(machine.gpu) if op.secondary_metric == "GB/s" else None
    baseline_name = op.baseline_label(dtype) if not machine.interpreter else op.cpu_baseline_name
    meta = dict(
        op=op.name, dtype=dtype, metric=op.metric, secondary_metric=op.secondary_metric or None, sweep=sweep, baseline=baseline_name if baseline else None,
        kernels=kernels, layout=options["layout"], batch=options["batch"],
        fast_accum=bool(options.get("fast_accum")), mode=options.get("mode", "fwd"), warmup_ms=warmup_ms, rep_ms=rep_ms,
        cuda_graph=cuda_graph, rounds=rounds, peak=peak, machine=machine.to_dict(),
        timing=("interpreter: host wall-clock, NOT GPU performance" if machine.interpreter else
                "triton.testing.do_bench_cudagraph (graph replays, inputs rotated past L2)" if cuda_graph else
                "triton.testing.do_bench (L2 cleared before each call), median of events"),
    )
    if "memory_format" in op.options:
        meta["memory_format"] = options.get("memory_format") or "channels_last"
    meta.update(op.run_meta(cases))
    if machine.interpreter:
        meta["note"] = "Kernels ran under Triton's interpreter on the CPU: timings are NOT GPU performance."
    result = BenchResult(meta)
    if precompile:
        from tilegemm.bench import precompile as pre

        if isinstance(op, ModelBench):
            raise ValueError(f"precompile does not apply to a model entry ({op.name})")
        try:  # before the host probe too: no worker runs while anything is timed
            meta["precompile"] = pre.precompile(op, cases, dtype, kernels, options, precompile, device,
                                                on_note or (lambda line: None))
        except KeyboardInterrupt:
            meta["interrupted"] = f"stopped while precompiling, before the first of {len(cases)} cases"
            return result
    if not machine.interpreter:
        meta["host_us_per_call"] = host_overhead(op, device)
    second = baseline and op.second_baseline_name and op.second_baseline_reason(device) is None
    if second:
        meta["second_baseline"] = op.second_baseline_name
    names = ([BASELINE] if baseline else []) + ([BASELINE2] if second else []) + kernels

    # Seconds of the checks, each a row's first call: tilegemm's compile there (unless precompiled), cuDNN's
    # benchmark-mode search for each new shape (docs/bench.md, "Precompiling").
    first_calls = meta["first_call_s"] = dict(baselines=0.0, kernels=0.0)
    done = 0  # cases complete
    try:
        for done, case in enumerate(cases):
            step = lambda kernel: on_step(f"{case.label} {kernel}") if on_step else None  # noqa: E731
            # Under the interpreter the inputs live in host memory: a case too large for it is an error row, not
            # an allocation the OS kills the process for (a GPU's out-of-memory is caught below instead).
            shortfall = machine.interpreter and memory_shortfall(op, case, dtype, options, host_memory_available())
            if shortfall:
                for kernel in names:
                    result.rows.append(_row(op, case, dtype, kernel, options, "error", message=shortfall))
                    step(kernel)
                continue
            try:
                first = op.prepare(case, dtype, device, 1, options)
                n_sets = rotation_count(first.bytes_per_set, machine, cuda_graph)
                prepared = op.prepare(case, dtype, device, n_sets, options) if n_sets > 1 else first
            except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as exc:
                if not _out_of_memory(exc):
                    raise
                first = prepared = None  # a first set made before the second ran out: freed before the next case
                _release(device)
                for kernel in names:
                    result.rows.append(_row(op, case, dtype, kernel, options, "error", message=_message(exc)))
                    step(kernel)
                continue
            overflow = _nonfinite(prepared.reference)
            if overflow:  # nothing can be checked against it: say so rather than call every kernel wrong
                for kernel in names:
                    result.rows.append(_row(op, case, dtype, kernel, options, "error", message=overflow))
                    step(kernel)
                del prepared, first  # before the next case's inputs are made, as a case that ran frees them
                _release(device)
                continue
            tol = op.tolerance(dtype)
            # Check each kernel (this also compiles and tunes), then time them all, round by round.
            checked = {}
            for kernel in names:
                start = time.perf_counter()
                checked[kernel] = _check(op, case, dtype, kernel, prepared, tol, options)
                first_calls["baselines" if kernel in BASELINES else "kernels"] += time.perf_counter() - start
                step(kernel)
            timed = [kernel for kernel in names if isinstance(checked[kernel], _Checked)]
            samples: dict[str, list[float]] = {kernel: [] for kernel in timed}
            for r in range(rounds):
                for kernel in (timed[:] if r % 2 == 0 else timed[::-1]):  # copies: a failing kernel leaves `timed`
                    c = checked[kernel]
                    try:
                        with c.context():
                            samples[kernel] += time_samples(_cycle(prepared.sets, c.call), warmup_ms, rep_ms / rounds,
                                                            cuda_graph)
                    except Exception as exc:  # noqa: BLE001 - a launch failing mid-timing is reported, not fatal
                        checked[kernel] = _row(op, case, dtype, kernel, options, "error", message=_message(exc))
                        timed.remove(kernel)
                        samples.pop(kernel)
            rows = {}
            for kernel in names:
                c = checked[kernel]
                if isinstance(c, _Checked):
                    ms, p20, p80 = summarize(samples[kernel])
                    value = op.rate(case, dtype, ms, options)
                    second = op.secondary_rate(case, dtype, ms, options) if kernel not in BASELINES else None
                    rows[kernel] = _row(op, case, dtype, kernel, options, c.status, rel_err=c.err,
                                        tolerance=None if c.err is None else c.tol, ms=ms, ms_p20=p20, ms_p80=p80,
                                        value=value, pct_peak=(100.0 * value / peak) if peak else None,
                                        secondary=second,
                                        secondary_pct_peak=(100.0 * second / bandwidth) if second and bandwidth else None)
                else:
                    rows[kernel] = c
            base = rows.get(BASELINE)
            base_ms = base.ms if base is not None and base.ok else None
            base2 = rows.get(BASELINE2)
            base2_ms = base2.ms if base2 is not None and base2.ok else None
            for kernel in names:
                row = rows[kernel]
                if row.ms and base_ms:
                    row.ratio = base_ms / row.ms
                if row.ms and base2_ms and row.kernel not in BASELINES:
                    row.ratio2 = base2_ms / row.ms
                result.rows.append(row)
            del prepared, first
            _release(device)
        done = len(cases)
    except KeyboardInterrupt:  # a time limit's SIGINT: the cases done so far are kept, and said to be partial
        meta["interrupted"] = f"stopped after {done} of {len(cases)} cases"
    for key in first_calls:
        first_calls[key] = round(first_calls[key], 3)
    return result


def _row(op, case, dtype, kernel, options, status, **kw) -> Row:
    return Row(op=op.name, kernel=kernel, shape=case.label, dims=case.dims, x=case.x, dtype=dtype,
               layout=options["layout"], batch=case.dims.get("B", options["batch"]), status=status, metric=op.metric,
               **kw)


@dataclass
class _Checked:
    call: Callable[[dict], object]  # runs the kernel on one input set
    context: Callable[[], object]  # the precision context (tf32 or not) to call it in
    status: str
    err: float | None
    tol: float | None = None  # the bound err was held to


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: the GPU's, or the host's (torch's CPU allocator raises a
    RuntimeError, which a case larger than :meth:`BenchOp.case_bytes` says may still reach)."""
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


def _message(exc: Exception) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "out of memory"
    if _out_of_memory(exc):
        return f"out of host memory: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"[:300]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _check(op, case, dtype, kernel, prepared, tol, options) -> "_Checked | Row":
    """Run ``kernel`` once and compare with the reference: a :class:`_Checked`, or an error row."""
    if kernel == BASELINE:
        call, context = (lambda inputs: op.baseline(inputs, dtype)), (lambda: op.baseline_context(dtype))
    elif kernel == BASELINE2:
        call, context = (lambda inputs: op.second_baseline(inputs, dtype)), (lambda: op.baseline_context(dtype))
        tol = op.second_baseline_tolerance(dtype)
    else:
        call, context = (lambda inputs: op.run(kernel, inputs, dtype)), (lambda: op.baseline_context(None))
    try:
        # Correctness first (this call also compiles and, for autotuned kernels, tunes).
        with context():
            out = call(prepared.sets[0])
        if kernel == BASELINE and not op.baseline_computes_result:
            err, status = None, "ok"
        else:
            err = _rel_err(out, prepared.reference)
            status = "ok" if err <= tol else "wrong"
        del out
    except NotApplicable as exc:
        return _row(op, case, dtype, kernel, options, "unavailable", message=_message(exc))
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to compile or launch is reported, not fatal
        return _row(op, case, dtype, kernel, options, "error", message=_message(exc))
    return _Checked(call, context, status, err, tol)


def _release(device: str) -> None:
    """Return a finished case's inputs to the device before the next case makes its own."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _nonfinite(reference) -> str:
    """A message where the case's reference (a tensor, or tensors in a list, tuple or dict) holds inf or NaN: its
    inputs overflow the reference's own dtype (a random model's activations, say), so no result can be checked."""
    if isinstance(reference, dict):
        parts = list(reference.values())
    elif isinstance(reference, (list, tuple)):
        parts = list(reference)
    else:
        parts = [reference]
    for t in parts:
        if isinstance(t, (list, tuple, dict)):
            found = _nonfinite(t)
            if found:
                return found
        elif isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return (f"the reference holds {int((~torch.isfinite(t)).sum())} inf or NaN values of {t.numel()}: this "
                    f"case's inputs overflow {t.dtype} there, so no result was checked or timed")
    return ""


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    from tilegemm.core.checks import relative_error

    return relative_error(out, ref)
