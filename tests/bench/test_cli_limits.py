"""A command line that pushes limits fails at once in one line: a case larger than the host's memory under the
interpreter (refused before anything is allocated, not killed by the OS), a timing budget that is not a finite
number, a negative size; and each bench op's memory estimate bounds what preparing a case allocates."""

from __future__ import annotations

import pytest
import torch

import tilegemm.bench.runner as runner
import tilegemm.core.hardware as hardware
from tilegemm.bench.base import bench_op, memory_shortfall
from tilegemm.cli import main
from tilegemm.core.runtime import interpreting

cpu_only = pytest.mark.skipif(not interpreting(), reason="the host-memory guard runs under the interpreter")


def _one_line_exit_2(argv, needles, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tilegemm: error:"), err
    for needle in needles:
        assert needle in err, err


@pytest.fixture
def no_run(monkeypatch):
    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))


@cpu_only
@pytest.mark.parametrize("op, shape", [
    ("matmul", "100000,100000,100000"),
    ("conv2d", "1000,512,512,512,64,3,3"),
    ("grouped", "128,8,100000,100000,100,gate_up"),
    ("grouped_w4a16", "128,8,100000,100000,100,gate_up"),
    ("w4a16", "100000,1000000,1000192"),
    ("copy", "100000000000"),
    ("grey", "100000,100000"),
])
def test_a_case_larger_than_host_memory_is_refused_before_allocating(op, shape, no_run, capsys):
    _one_line_exit_2(["bench", "--op", op, "--shape", shape, "--quiet", "--no-save"],
                     ["needs about", "GiB of memory", "is available", "interpreter"], capsys)


@cpu_only
def test_the_refusal_names_the_memory_this_machine_has(monkeypatch, no_run, capsys):
    monkeypatch.setattr(hardware, "host_memory_available", lambda: 3 * 2**30)
    # 20000^2 fp16 operands, their float64 copies, the float64 product and an fp16 output: 12e9 bytes
    _one_line_exit_2(["bench", "--shape", "20000,20000,20000", "--quiet", "--no-save"],
                     ["matmul 20000x20000x20000 (fp16) needs about 11.2 GiB", "3 GiB is available"], capsys)


def test_host_memory_is_read_from_the_kernel():
    available = hardware.host_memory_available()
    assert available is None or available > 2**20


@cpu_only
def test_a_case_that_would_run_for_hours_is_warned_of(monkeypatch, capsys):
    class Ran(Exception):
        pass

    def run_bench(*a, **k):
        raise Ran

    monkeypatch.setattr(runner, "run_bench", run_bench)
    with pytest.raises(Ran):
        main(["bench", "--shape", "2000,2000,2000", "--shape", "8,8,8", "--quiet", "--no-save"])
    err = capsys.readouterr().err
    assert "warning:" in err and "2000x2000x2000 may run for a long time" in err and "8x8x8" not in err, err


def test_the_runner_reports_a_case_too_large_for_the_host_as_an_error_row(monkeypatch):
    op = bench_op("matmul")
    monkeypatch.setattr(runner, "host_memory_available", lambda: 2**20)
    monkeypatch.setattr(op, "prepare", lambda *a, **k: pytest.fail("inputs were made"))
    monkeypatch.setattr(runner, "machine_info", lambda: hardware.MachineInfo(backend="cpu", interpreter=True))
    result = runner.run_bench(op, [op.parse_shape("1024,1024,1024")], "fp16", ["naive"], rep_ms=1)
    assert [(r.kernel, r.status) for r in result.rows] == [("baseline", "error"), ("naive", "error")]
    assert all("needs about" in r.message and "1 MiB is available" in r.message for r in result.rows)


@pytest.mark.parametrize("error, raised", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 57600000000 bytes."), False),
    (MemoryError(), False),
    (RuntimeError("some other failure"), True),
])
def test_a_host_allocation_that_fails_is_an_error_row(monkeypatch, error, raised):
    op = bench_op("matmul")

    def prepare(*a, **k):
        raise error

    monkeypatch.setattr(op, "prepare", prepare)
    if raised:  # not an allocation: a bug, not a row
        with pytest.raises(RuntimeError, match="some other failure"):
            runner.run_bench(op, [op.parse_shape("8,8,8")], "fp16", ["naive"], rep_ms=1)
        return
    result = runner.run_bench(op, [op.parse_shape("8,8,8")], "fp16", ["naive"], rep_ms=1)
    assert {r.status for r in result.rows} == {"error"}
    assert all("out of" in r.message for r in result.rows), [r.message for r in result.rows]


def _bytes(value) -> int:
    """Bytes of the tensors (and 4-bit weights) in ``value``, a tensor or nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return getattr(value, "nbytes", 0)  # an Int4Weight: its packed values, scales and zeros


@pytest.mark.parametrize("op_name, shape, dtype, options", [
    ("matmul", "40,24,56", "fp16", {}),
    ("matmul", "8,16,32", "fp32", dict(batch=3)),
    ("conv2d", "2,8,9,9,16,3,3,1,1", "fp16", dict(mode="fwd")),
    ("conv2d", "2,8,9,9,16,3,3,2,1", "fp32", dict(mode="bwd")),
    ("grouped", "4,2,64,32,17,gate_up", "bf16", dict(mode="fwd")),
    ("grouped", "3,17,24,32", "fp16", dict(mode="bwd")),
    ("grouped_w4a16", "4,2,128,128,9,down", "fp16", {}),
    ("w4a16", "3,96,256", "fp16", {}),
    ("copy", "4096", "fp32", {}),
    ("grey", "64,48", "uint8", {}),
])
def test_the_memory_estimate_bounds_what_a_case_holds(op_name, shape, dtype, options):
    op = bench_op(op_name)
    case = op.parse_shape(shape)
    options = dict(dict(batch=1, layout=None), **options)
    prepared = op.prepare(case, dtype, "cpu", 1, options)
    held = _bytes([prepared.sets[0], prepared.reference])
    assert held <= op.case_bytes(case, dtype, options)
    assert memory_shortfall(op, case, dtype, options, held - 1)
    assert not memory_shortfall(op, case, dtype, options, None)


@pytest.mark.parametrize("flags", [["--rep", "nan"], ["--rep", "inf"], ["--warmup", "nan"], ["--warmup", "-1"],
                                   ["--rep", "0"]])
def test_a_timing_budget_must_be_a_finite_number(flags, no_run, capsys):
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", "--no-save", *flags], ["finite"], capsys)


@pytest.mark.parametrize("op, shape", [("matmul", "-1,8,8"), ("copy", "-5"), ("grey", "-4,4")])
def test_a_negative_size_is_named_as_such(op, shape, no_run, capsys):
    _one_line_exit_2(["bench", "--op", op, "--shape", shape, "--quiet", "--no-save"], [repr(shape), ">= 1"], capsys)


@cpu_only
def test_tune_refuses_a_shape_larger_than_host_memory(monkeypatch, capsys):
    import tilegemm.cli as cli

    entry = cli._op_entry
    monkeypatch.setattr(cli, "_op_entry", lambda *a: (entry(*a)[0], lambda *_, **__: pytest.fail("tuning ran")))
    _one_line_exit_2(["tune", "--shape", "100000,100000,100000"], ["needs about 279 GiB", "is available"], capsys)


def test_a_plot_format_matplotlib_cannot_write_fails_before_the_bench(tmp_path, no_run, capsys):
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", "--no-save", "--plot", str(tmp_path / "p.xyz")],
                     ["matplotlib writes no '.xyz' files", ".png"], capsys)


@pytest.mark.parametrize("flag", ["--json", "--out"])
def test_a_folder_where_no_file_can_be_made_fails_before_the_bench(flag, no_run, capsys):
    # /proc exists, and root passes os.access on it, but no file can be made there
    path = "/proc/r.json" if flag == "--json" else "/proc"
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", flag, path] + (["--no-save"] if flag != "--out" else []),
                     ["cannot write", "'/proc'"], capsys)


@cpu_only
def test_a_file_that_cannot_be_written_after_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    import tilegemm.bench.report as report

    def full(result, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", full)
    csv = tmp_path / "r.csv"
    argv = ["bench", "--shape", "8,8,8", "--kernels", "naive", "--no-baseline", "--rep", "1", "--quiet", "--no-save",
            "--json", str(tmp_path / "r.json"), "--csv", str(csv)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == f"tilegemm: error: cannot write {tmp_path / 'r.json'}: No space left on device"
    assert "wrote" in captured.out and csv.exists()  # the other file still written


@cpu_only
def test_a_plot_backend_that_fails_after_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    # matplotlib lists .pgf, whose writer then needs LaTeX: its error is no OSError
    import tilegemm.bench.report as report

    def no_latex(result, path, topk=None):
        raise RuntimeError("latex was not able to process the following string:\nmore")

    monkeypatch.setattr(report, "write_plot", no_latex)
    argv = ["bench", "--shape", "8,8,8", "--kernels", "naive", "--no-baseline", "--rep", "1", "--quiet", "--no-save",
            "--plot", str(tmp_path / "r.pgf")]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip() == (f"tilegemm: error: cannot write {tmp_path / 'r.pgf'}: RuntimeError: "
                                               "latex was not able to process the following string:")


@pytest.mark.parametrize("argv, needle", [
    (["--out", "somewhere", "--no-save"], "--no-save writes none"),
    (["--topk", "3", "--no-save"], "--no-save without --plot draws no plot"),
])
def test_options_that_contradict_no_save_fail_before_the_bench(argv, needle, no_run, capsys):
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", *argv], [needle], capsys)


def test_a_grouped_w4a16_shape_whose_k_4_bit_weights_cannot_take_is_one_line(no_run, capsys):
    # gate_up's K is HIDDEN, down's INTERMEDIATE: 4-bit weights need it a multiple of 8
    _one_line_exit_2(["bench", "--op", "grouped_w4a16", "--shape", "4,2,36,64,8,gate_up", "--no-save"],
                     ["HIDDEN = 36", "multiple of 8"], capsys)
    _one_line_exit_2(["bench", "--op", "grouped_w4a16", "--shape", "4,2,32,36,8,down", "--no-save"],
                     ["INTERMEDIATE = 36", "multiple of 8"], capsys)


@cpu_only
def test_tune_refuses_a_kernel_that_cannot_run_here(monkeypatch, capsys):
    import tilegemm.cli as cli

    entry = cli._op_entry
    monkeypatch.setattr(cli, "_op_entry", lambda *a: (entry(*a)[0], lambda *_, **__: pytest.fail("tuning ran")))
    _one_line_exit_2(["tune", "--shape", "8,8,8", "--kernels", "gluon_f16"],
                     ["cannot run here: gluon_f16", "sm_90"], capsys)
