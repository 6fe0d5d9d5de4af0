"""``tilegemm bench --precompile J``: the option, the split of a sweep among workers, failures reported and the sweep
going on, and the note where there is nothing to compile. Workers run in this process (an inline stand-in for the
spawn context) on spy kernels, except one test that spawns a real worker under the interpreter."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from tilegemm.bench import precompile as pre
from tilegemm.bench.base import bench_op
from tilegemm.bench.runner import run_bench
from tilegemm.cli import build_parser, main
from tilegemm.core.runtime import interpreting

cpu_only = pytest.mark.skipif(not interpreting(), reason="what precompile does without a GPU")
FWD = dict(mode="fwd", layout="NN", batch=1)


class _InlineProcess:
    """A worker run in this process when started (its SIGINT handler restored after), its exit code that of a
    SystemExit it raises: a crash, as the bench process sees one."""

    started: list = []

    def __init__(self, target, args, daemon=None):
        self.target, self.args, self.exitcode = target, args, None
        _InlineProcess.started.append(self)

    def start(self):
        handler = signal.getsignal(signal.SIGINT)
        try:
            self.target(*self.args)
            self.exitcode = 0
        except SystemExit as exc:
            self.exitcode = exc.code
        finally:
            signal.signal(signal.SIGINT, handler)

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False

    def terminate(self):
        pass


class _InlineContext:
    Process = _InlineProcess

    @staticmethod
    def Pipe(duplex=True):
        return multiprocessing.Pipe(duplex)


@pytest.fixture
def inline(monkeypatch):
    """Workers in this process, GPU or not; the environment they set is restored after the test."""
    _InlineProcess.started = []
    monkeypatch.setattr(pre, "_context", lambda: _InlineContext)
    monkeypatch.setattr(pre, "unavailable_reason", lambda: None)
    monkeypatch.setenv("TILEGEMM_TUNE", "1")  # the workers must turn it off for themselves
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR") or pre.triton_cache_dir() or "/tmp")
    return _InlineProcess


@pytest.fixture
def spy(monkeypatch):
    """Conv2d's worker inputs and calls recorded, no kernel run: [(case label, kernel)] in call order."""
    from tilegemm.ops.conv2d.bench import Conv2dBench

    calls = []
    monkeypatch.setattr(Conv2dBench, "precompile_inputs",
                        lambda self, case, dtype, device, options: dict(label=case.label,
                                                                        tune=os.environ["TILEGEMM_TUNE"]))
    monkeypatch.setattr(Conv2dBench, "run", lambda self, kernel, inputs, dtype: calls.append(
        (inputs["label"], kernel, inputs["tune"])))
    return calls


def _cases(n: int):
    op = bench_op("conv2d")
    return [op.parse_shape(f"2,8,{6 + i},{6 + i},16,3,3,1,1") for i in range(n)]


def test_the_option_parses():
    parse = lambda *a: build_parser(["bench"]).parse_args(["bench", *a])  # noqa: E731
    assert parse().precompile == 0
    assert parse("--precompile", "15").precompile == 15
    assert parse("--precompile", "-1").precompile == -1


@pytest.mark.parametrize("argv, needle", [
    (["--precompile", "-2"], "--precompile takes a worker count >= 0, or -1"),
    (["--op", "conv2d", "--model", "resnet50", "--precompile", "2"], "--precompile does not apply to --model"),
])
def test_bad_precompile_arguments_exit_2_with_one_line(argv, needle, capsys):
    assert main(["bench", *argv, "--quiet", "--no-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tilegemm: error:") and needle in err, err


def test_minus_one_is_one_worker_per_cpu_but_one_at_most_16(monkeypatch):
    for cpus, want in ((1, 1), (2, 1), (8, 7), (16, 15), (17, 16), (128, 16)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)), raising=False)
        assert pre.resolve_jobs(-1) == want
    assert pre.resolve_jobs(0) == 0 and pre.resolve_jobs(5) == 5
    with pytest.raises(ValueError, match="worker count"):
        pre.resolve_jobs(-3)


def test_the_split_holds_every_case_exactly_once():
    for n in range(0, 41):
        for workers in range(1, 20):
            shares = pre.split(n, workers)
            assert sorted(i for s in shares for i in s) == list(range(n))
            assert len(shares) == min(workers, n) and all(shares)


def test_zero_changes_nothing(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("precompile 0 must start nothing")

    op = bench_op("conv2d")
    monkeypatch.setattr(pre, "run_workers", refuse)
    monkeypatch.setattr(pre, "unavailable_reason", refuse)
    assert pre.precompile(op, _cases(1), "fp32", ["auto"], FWD, 0, "cpu") is None
    monkeypatch.setattr(pre, "precompile", refuse)
    result = run_bench(op, _cases(1), "fp32", ["auto"], rep_ms=1, options=dict(mode="fwd"), precompile=0)
    assert "precompile" not in result.meta
    assert all(r.status == "ok" for r in result.rows)


def test_the_workers_call_every_kernel_on_every_case_once(inline, spy):
    cases = _cases(7)
    done = pre.run_workers("conv2d", cases, "fp32", ["auto", "implicit_gemm"], FWD, "cpu", 3)
    assert done == dict(precompiled=7, failed=[])
    assert len(inline.started) == 3
    assert sorted((label, kernel) for label, kernel, _ in spy) == sorted(
        (c.label, k) for c in cases for k in ("auto", "implicit_gemm"))
    assert {tune for _, _, tune in spy} == {"0"}, "a worker times nothing (no contended tuning)"
    cache = os.environ["TRITON_CACHE_DIR"]
    assert all(p.args[6] == cache for p in inline.started), "the bench process's Triton cache goes to every worker"


def test_a_failing_case_is_reported_in_one_line_and_the_sweep_goes_on(inline, monkeypatch):
    from tilegemm.ops.conv2d.bench import Conv2dBench

    cases = _cases(3)
    bad = cases[1].label
    real = Conv2dBench.precompile_inputs

    def inputs(self, case, dtype, device, options):
        if case.label == bad:  # only in the workers: the bench process prepares its own inputs
            raise RuntimeError("compiler crashed\nsecond line")
        return real(self, case, dtype, device, options)

    monkeypatch.setattr(Conv2dBench, "precompile_inputs", inputs)
    notes = []
    result = run_bench(bench_op("conv2d"), cases, "fp32", ["auto"], rep_ms=1, options=dict(mode="fwd"), precompile=2,
                       on_note=notes.append)
    meta = result.meta["precompile"]
    assert meta["workers"] == 2 and meta["cases"] == 3 and meta["precompiled"] == 2 and meta["wall_s"] >= 0
    assert meta["failed"] == [dict(case=bad, message="inputs: RuntimeError: compiler crashed ... second line")]
    failed = [n for n in notes if bad in n]
    assert len(failed) == 1 and "\n" not in failed[0] and "compiler crashed" in failed[0]
    assert any(n.startswith("precompile: 2/3 cases compiled by 2 workers") for n in notes)
    assert {r.shape for r in result.rows} == {c.label for c in cases}
    assert all(r.status == "ok" for r in result.rows), "the bench process compiled the failed case itself"


def test_a_crashed_worker_reports_each_case_it_left(inline, spy, monkeypatch):
    from tilegemm.ops.conv2d.bench import Conv2dBench

    cases = _cases(6)  # shares: 0, 2, 4 and 1, 3, 5
    real = Conv2dBench.precompile_inputs

    def inputs(self, case, dtype, device, options):
        if case.label == cases[2].label:
            raise SystemExit(-11)  # as a segfault ends a process: nothing after it is sent
        return real(self, case, dtype, device, options)

    monkeypatch.setattr(Conv2dBench, "precompile_inputs", inputs)
    notes = []
    done = pre.run_workers("conv2d", cases, "fp32", ["auto"], FWD, "cpu", 2, notes.append)
    assert done["precompiled"] == 4
    assert done["failed"] == [dict(case=cases[i].label, message="worker exited with code -11 before finishing it")
                              for i in (2, 4)]
    assert len(notes) == 2
    assert sorted(label for label, _, _ in spy) == sorted(cases[i].label for i in (0, 1, 3, 5))


def test_a_worker_that_cannot_start_reports_its_cases(inline, monkeypatch):
    import tilegemm.bench.base as base

    def broken(name):
        raise ImportError("no such module")

    monkeypatch.setattr(base, "bench_op", broken)
    done = pre.run_workers("conv2d", _cases(2), "fp32", ["auto"], FWD, "cpu", 1)
    assert done["precompiled"] == 0
    assert all(f["message"] == "worker could not start: ImportError: no such module" for f in done["failed"])


@cpu_only
def test_without_a_gpu_it_is_a_note_and_nothing_more(monkeypatch, capsys):
    monkeypatch.setattr(pre, "run_workers", lambda *a, **k: pytest.fail("no worker without a GPU"))
    notes = []
    result = run_bench(bench_op("conv2d"), _cases(1), "fp32", ["auto"], rep_ms=1, options=dict(mode="fwd"),
                       precompile=-1, on_note=notes.append)
    assert len(notes) == 1 and "nothing to precompile (Triton's interpreter compiles nothing)" in notes[0]
    assert result.meta["precompile"]["skipped"] and all(r.status == "ok" for r in result.rows)
    assert main(["bench", "--shape", "8,8,8", "--kernels", "naive", "--precompile", "4", "--quiet",
                 "--no-save"]) == 0
    err = capsys.readouterr().err
    assert err.count("nothing to precompile") == 1


def test_no_cuda_is_said_too(monkeypatch):
    import torch

    import tilegemm.core.runtime as runtime

    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pre.unavailable_reason() == "no CUDA GPU"


@cpu_only
def test_a_spawned_worker_compiles_its_case_and_reports_a_failure():
    """The real thing, under the interpreter: a spawned process (its arguments pickled), one case, a kernel
    that runs and one that is not registered."""
    cases = _cases(1)
    done = pre.run_workers("conv2d", cases, "fp32", ["implicit_gemm", "nope"], FWD, "cpu", 1)
    assert done["precompiled"] == 0
    [failed] = done["failed"]
    assert failed["case"] == cases[0].label and failed["message"].startswith("nope: ValueError: unknown conv2d")


def test_the_cli_says_each_failure_in_one_line_and_records_the_run(inline, monkeypatch, tmp_path, capsys):
    import json

    from tilegemm.ops.conv2d.bench import Conv2dBench

    shapes = ["2,8,6,6,16,3,3,1,1", "2,8,7,7,16,3,3,1,1"]
    long = "x" * 150  # wider than any console: still one line

    def inputs(self, case, dtype, device, options):
        if case.dims["H"] == 7:
            raise RuntimeError(long)
        return dict(label=case.label)

    monkeypatch.setattr(Conv2dBench, "precompile_inputs", inputs)
    path = tmp_path / "run.json"
    argv = ["bench", "--op", "conv2d", "--dtype", "fp32", "--kernels", "auto", "--precompile", "2", "--quiet",
            "--no-save", "--json", str(path)]
    for shape in shapes:
        argv += ["--shape", shape]
    real_run = Conv2dBench.run
    monkeypatch.setattr(Conv2dBench, "run", lambda self, kernel, inputs, dtype: None if "label" in inputs
                        else real_run(self, kernel, inputs, dtype))
    assert main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("precompile")]
    assert len(err) == 2 and long in err[0] and err[1].startswith("precompile: 1/2 cases compiled by 2 workers")
    meta = json.loads(path.read_text())["meta"]
    assert meta["precompile"]["precompiled"] == 1 and len(meta["precompile"]["failed"]) == 1
    assert set(meta["first_call_s"]) == {"baselines", "kernels"}


def test_ctrl_c_while_precompiling_ends_the_run_with_what_it_has(inline, monkeypatch):
    from tilegemm.ops.conv2d.bench import Conv2dBench

    def interrupt(self, case, dtype, device, options):
        raise KeyboardInterrupt

    monkeypatch.setattr(Conv2dBench, "precompile_inputs", interrupt)
    result = run_bench(bench_op("conv2d"), _cases(2), "fp32", ["auto"], rep_ms=1, options=dict(mode="fwd"),
                       precompile=2)
    assert result.rows == [] and "while precompiling" in result.meta["interrupted"]
