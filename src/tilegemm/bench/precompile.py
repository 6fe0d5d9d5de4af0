"""``tilegemm bench --precompile J``: compile a sweep's kernels in J worker processes before anything is timed.

A sweep's first call of each (case, kernel) compiles that call's kernel variants, one after another in the bench
process, and Triton's compiler is single-threaded host work: on the conv2d zoo most of a part's wall time
(docs/bench.md, "Precompiling"). Here J spawned workers each take a share of the cases and make every timed
kernel's call once on one input set, so each variant lands in Triton's on-disk cache in parallel; the bench
process then runs the sweep as before, its first calls loading cached binaries.

Nothing a worker does reaches a result: the workers have all exited before the bench times anything (no GPU
contention), they time nothing (``TILEGEMM_TUNE=0``: no contended timing picks or records a config), and what
they leave is only Triton's cache, whose entries are keyed by everything that makes a binary. A case a worker
could not compile (an exception, or the worker died) is reported in one line and simply compiled by the bench
process when it reaches it.

This module imports neither torch nor triton at its top. The workers' environment is set by the bench process
before they are spawned, since a spawned interpreter imports the bench's main module (and torch) first.
"""

from __future__ import annotations

import os
import time
from typing import Callable

MAX_AUTO_WORKERS = 16  # --precompile -1: min(16, CPUs - 1), one CPU left to the bench process
JOIN_S = 60.0  # how long a worker that closed its pipe may take to exit before it is terminated


def auto_jobs() -> int:
    """The worker count of ``--precompile -1``: one per CPU this process may run on, less one, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cpus - 1))


def resolve_jobs(jobs: int) -> int:
    """``--precompile``'s value as a worker count: 0 off, -1 :func:`auto_jobs`, else itself."""
    if jobs == -1:
        return auto_jobs()
    if jobs < 0:
        raise ValueError(f"--precompile takes a worker count >= 0, or -1 for min(16, CPUs - 1); got {jobs}")
    return jobs


def split(n_cases: int, workers: int) -> list[list[int]]:
    """Case indices per worker: every ``workers``-th from the worker's own, so that each share holds a like mix
    of the sweep (its cases are ordered by size or kind); every index in exactly one share, no empty share."""
    workers = max(1, min(workers, n_cases))
    return [list(range(w, n_cases, workers)) for w in range(workers)] if n_cases else []


def unavailable_reason() -> str | None:
    """Why there is nothing to precompile here (the interpreter compiles nothing; no CUDA GPU), or None."""
    from tilegemm.core.runtime import interpreting

    if interpreting():
        return "Triton's interpreter compiles nothing"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


def triton_cache_dir() -> str | None:
    """The folder of Triton's on-disk cache in this process: ``TRITON_CACHE_DIR`` where set, else Triton's
    default (both as ``triton.knobs`` resolves them), or None where this triton does not say."""
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # noqa: BLE001 - an older triton: workers inherit the environment, which is what it reads
        return os.environ.get("TRITON_CACHE_DIR")


def _message(exc: BaseException) -> str:
    """One line: the exception's type, its first and (where there are more) last non-empty lines (a Triton
    CompilationError's first line is only the source position; the error itself comes last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else "".join(lines)
    return f"{type(exc).__name__}: {text}"[:300]


def compile_cases(op, cases, dtype: str, kernels: list[str], options: dict, device: str,
                  report: Callable[[int, list[str]], None]) -> None:
    """Make every kernel's call once on each case, in order: ``cases`` is [(index, Case)], and ``report(index,
    errors)`` follows each case (errors: one ``"kernel: message"`` per kernel that raised; a kernel that does not
    take the case raises NotApplicable, which compiles nothing and is no error)."""
    import gc

    import torch

    from tilegemm.core.registry import NotApplicable

    for index, case in cases:
        errors = []
        try:
            inputs = op.precompile_inputs(case, dtype, device, options)
        except Exception as exc:  # noqa: BLE001 - the bench process will meet (and report) it itself
            report(index, [f"inputs: {_message(exc)}"])
            continue
        for kernel in kernels:
            try:
                with op.baseline_context(None):  # the precision context the bench calls tilegemm's rows in
                    op.run(kernel, inputs, dtype)
                if device == "cuda":
                    torch.cuda.synchronize()  # a failed launch surfaces here, against this kernel
            except NotApplicable:
                pass
            except Exception as exc:  # noqa: BLE001 - reported; the bench process compiles it when it gets there
                errors.append(f"{kernel}: {_message(exc)}")
        del inputs
        report(index, errors)  # first: a faulted context raises again in the cleanup below
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()  # J workers share the GPU's memory: hold only the case at hand


def _worker(op_name: str, cases, dtype: str, kernels: list[str], options: dict, device: str,
            cache_dir: str | None, conn) -> None:
    """A spawned worker's body: :func:`compile_cases`, each case's outcome sent to the bench process as
    ``(index, errors)``, a failure outside a case as ``(None, message)``. Its environment (``TILEGEMM_TUNE=0``,
    the cache folder) was set by the bench process before the spawn (:func:`_worker_env`): the spawned
    interpreter imports the bench's main module, and with it torch and triton, before this body runs."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the bench process, which stops the workers
    os.environ["TILEGEMM_TUNE"] = "0"  # (already inherited; kept for a caller that spawns this body itself)
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    try:
        from tilegemm.bench.base import bench_op

        op = bench_op(op_name)
        compile_cases(op, cases, dtype, kernels, options, device, lambda i, errors: conn.send((i, errors)))
    except Exception as exc:  # noqa: BLE001 - a worker that could not start, or failed between cases
        conn.send((None, _message(exc)))
    finally:
        conn.close()


class _worker_env:
    """The workers' environment, set in the bench process around their spawn (spawn copies ``os.environ`` when a
    process starts) and restored after: no timing under contention (``TILEGEMM_TUNE=0``), the bench process's
    Triton cache folder."""

    def __init__(self, cache_dir: str | None):
        self.values = {"TILEGEMM_TUNE": "0", **({"TRITON_CACHE_DIR": cache_dir} if cache_dir else {})}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _context():
    import multiprocessing

    return multiprocessing.get_context("spawn")  # fork would copy the bench process's CUDA state


def run_workers(op_name: str, cases: list, dtype: str, kernels: list[str], options: dict, device: str,
                workers: int, on_note: Callable[[str], None] = lambda line: None) -> dict:
    """Compile ``cases`` in ``workers`` spawned processes (:func:`split`) and wait for every one to exit.
    Returns ``precompiled`` (cases whose every kernel's call returned) and ``failed`` ([{case, message}], each
    also given to ``on_note`` as one line)."""
    from multiprocessing.connection import wait

    ctx = _context()
    cache_dir = triton_cache_dir()
    shares = split(len(cases), workers)
    procs, pending = [], {}  # pending: receiving end -> (process, indices not yet reported)
    outcome: dict[int, list[str]] = {}
    setup: dict[int, str] = {}  # worker number -> why it could not start
    try:
        for w, share in enumerate(shares):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(op_name, [(i, cases[i]) for i in share], dtype, kernels, options, device,
                                     cache_dir, send))
            with _worker_env(cache_dir):
                proc.start()
            send.close()  # the worker holds the only sending end: its exit ends the stream
            procs.append(proc)
            pending[recv] = (w, proc)
        while pending:
            for conn in wait(list(pending)):
                w, _ = pending[conn]
                try:
                    index, errors = conn.recv()
                except Exception:  # noqa: BLE001 - EOF: the worker finished, or died (mid-message, perhaps)
                    conn.close()
                    del pending[conn]
                    continue
                if index is None:
                    setup[w] = errors
                else:
                    outcome[index] = errors
        for proc in procs:
            proc.join(JOIN_S)
            if proc.is_alive():  # (its pipe closed: it only failed to exit; timing must not start beside it)
                proc.terminate()
                proc.join()
    except BaseException:  # KeyboardInterrupt above all: no worker may outlive the bench process's wait
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join()
        raise
    failed = []
    for w, share in enumerate(shares):
        code = procs[w].exitcode
        for i in share:
            if i in outcome:
                if outcome[i]:
                    failed.append(dict(case=cases[i].label, message="; ".join(outcome[i])))
            else:
                started = any(j in outcome for j in share)
                why = ((f"worker failed after its case {max(j for j in share if j in outcome) + 1}: {setup[w]}"
                        if started else f"worker could not start: {setup[w]}") if w in setup
                       else f"worker exited with code {code} before finishing it")
                failed.append(dict(case=cases[i].label, message=why))
    for f in failed:
        on_note(f"precompile: {f['case']}: {f['message']} (compiled when the sweep gets there)")
    return dict(precompiled=len(cases) - len(failed), failed=failed)


def precompile(op, cases: list, dtype: str, kernels: list[str], options: dict, jobs: int, device: str,
               on_note: Callable[[str], None] = lambda line: None) -> dict | None:
    """``--precompile jobs`` before a sweep: None when off (0); otherwise what the run's JSON ``meta`` records
    under ``precompile`` (workers, cases, precompiled, failed, wall_s, triton_cache; or ``skipped`` with the
    reason where there is nothing to compile here, said in one line to ``on_note``)."""
    jobs = resolve_jobs(jobs)
    if jobs == 0:
        return None
    reason = unavailable_reason()
    if reason is not None:
        on_note(f"--precompile {jobs}: nothing to precompile ({reason}); the sweep compiles as it goes")
        return dict(workers=0, requested=jobs, skipped=reason)
    workers = min(jobs, len(cases))
    start = time.perf_counter()
    done = run_workers(op.name, cases, dtype, kernels, options, device, workers, on_note)
    wall = time.perf_counter() - start
    failed = done["failed"]
    on_note(f"precompile: {done['precompiled']}/{len(cases)} cases compiled by {workers} workers in {wall:.1f} s"
            + (f"; {len(failed)} failed" if failed else ""))
    return dict(workers=workers, cases=len(cases), precompiled=done["precompiled"], failed=failed,
                wall_s=round(wall, 2), triton_cache=triton_cache_dir())
