"""The command line does what it says or fails at once with one line and exit code 2: the cases a new user met
(an empty shapes file, options that cannot apply here, an unwritable output path, a forced GPU backend without
a GPU), and the bench's output (the summary, tables at 80 columns and in files, the plot under the interpreter)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tilegemm.bench.report import plot_series, print_report, results_table
from tilegemm.bench.runner import BASELINE, BenchResult, Row
from tilegemm.cli import build_parser, main
from tilegemm.core.runtime import interpreting

ROOT = Path(__file__).resolve().parents[2]
cpu_only = pytest.mark.skipif(not interpreting(), reason="what the CLI does without a GPU")


def _one_line_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tilegemm: error:") and needle in err, err


def test_an_empty_shapes_file_is_an_error(tmp_path, capsys):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("# nothing but a comment\n\n")
    _one_line_exit_2(["bench", "--shapes", str(shapes), "--quiet", "--no-save"], "no shapes in --shapes file", capsys)


@cpu_only
def test_cuda_graph_under_the_interpreter_is_an_error(capsys):
    _one_line_exit_2(["bench", "--cuda-graph", "--shape", "8,8,8", "--quiet", "--no-save"], "--cuda-graph", capsys)


@cpu_only
def test_kernels_that_cannot_run_here_are_an_error(capsys):
    _one_line_exit_2(["bench", "--kernels", "gluon_f16", "--shape", "8,8,8", "--quiet", "--no-save"],
                     "gluon_f16", capsys)


@pytest.mark.parametrize("flag", ["--out", "--json", "--csv", "--plot"])
def test_an_unwritable_output_path_fails_before_the_bench(flag, monkeypatch, capsys):
    import tilegemm.bench.runner as runner

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))
    path = "/proc/nope" if flag == "--out" else "/proc/nope/r.out"
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", flag, path], "/proc/nope", capsys)


def _cli(env_extra: dict, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    env.update(env_extra)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "tilegemm.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@cpu_only
def test_a_forced_gpu_backend_without_a_gpu_fails_in_one_line():
    # the commands, then tilegemm.matmul from Python, in one process started with the backend forced
    commands = [["info"], ["bench", "--shape", "8,8,8", "--no-save"], ["tune"], ["warmup"]]
    code = (f"from tilegemm.cli import main\nprint([main(argv) for argv in {commands!r}])\n"
            "import torch, tilegemm\n"
            "try:\n    tilegemm.matmul(torch.randn(4, 4), torch.randn(4, 4))\n"
            "except ValueError as e:\n    print('matmul:', e)\n")
    done = _cli({"TILEGEMM_INTERPRET": "0"}, code=code)
    out = done.stdout.strip()
    assert out.splitlines()[0] == "[2, 2, 2, 2]", done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("tilegemm: error: TILEGEMM_INTERPRET=0") for line in lines), lines
    said = out.partition("matmul:")[2]  # matmul's error says the same
    assert "TILEGEMM_INTERPRET=0" in said and "no CUDA GPU" in said and "GPU is in use" not in said, out


def test_triton_imported_first_gets_advice_that_applies():
    code = ("import triton, torch, tilegemm\n"
            "try:\n    tilegemm.matmul(torch.randn(4, 4), torch.randn(4, 4))\n"
            "except RuntimeError as e:\n    print(e)\n")
    out = _cli({"TILEGEMM_INTERPRET": "1"}, code=code).stdout
    assert "TRITON_INTERPRET=1" in out and "Set TILEGEMM_INTERPRET=1" not in out, out


@cpu_only
def test_tune_under_the_interpreter_returns_at_once(monkeypatch, capsys):
    import tilegemm.cli as cli

    entry = cli._op_entry
    monkeypatch.setattr(cli, "_op_entry", lambda *a: (entry(*a)[0], lambda *_, **__: pytest.fail("tuning ran")))
    assert main(["tune"]) == 0 and main(["tune", "--sweep", "llm"]) == 0
    assert capsys.readouterr().out.count("nothing to tune") == 2


def test_tune_shows_its_progress(monkeypatch, capsys):
    import tilegemm.cli as cli

    entry = cli._op_entry
    monkeypatch.setattr(cli, "_op_entry", lambda *a: (entry(*a)[0], lambda *_, **__: None))
    assert main(["tune", "--shape", "8,8,8", "--shape", "16,8,8"]) == 0
    out = capsys.readouterr().out
    assert "[1/2] tuning 8x8x8" in out and "[2/2] tuning 16x8x8" in out


def test_every_command_describes_itself():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        assert parser.description, f"`tilegemm {name} --help` has no description"


def test_help_imports_neither_triton_nor_the_kernels():
    code = ("import sys\nfrom tilegemm.cli import main\n"
            "for argv in (['--help'], ['info', '--help'], ['puzzles', '--help'], ['tune', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('LOADED', 'triton' in sys.modules, 'tilegemm.bench.base' in sys.modules)\n")
    out = _cli({}, code=code).stdout
    assert "LOADED False False" in out, out[-500:]


def test_info_shows_summaries_verbatim(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")  # one line per kernel
    assert main(["info"]) == 0
    assert "summed elementwise over [pixels, channels] tiles" in capsys.readouterr().out


# --- the report --------------------------------------------------------------------------------------------


def _result(interpreter: bool, statuses=("ok", "unavailable", "unavailable")) -> BenchResult:
    machine = dict(gpu=None if interpreter else "NVIDIA H200", backend="Triton interpreter (CPU)",
                   interpreter=interpreter)
    meta = dict(op="matmul", dtype="fp16", metric="TFLOPS", baseline="cuBLAS", layout="NN", batch=1, machine=machine,
                peak=None)
    rows = []
    for shape in ("4096x4096x4096", "16x28672x8192"):
        rows.append(Row("matmul", BASELINE, shape, {}, 1.0, "fp16", "NN", 1, "ok", ms=1.0, value=123.456))
        for i, status in enumerate(statuses):
            msg = "needs an sm_90 GPU with Gluon: this one is a very long reason indeed" if status != "ok" else ""
            rows.append(Row("matmul", f"kernel_number_{i}", shape, {}, 1.0, "fp16", "NN", 1, status,
                            rel_err=1e-4 if status == "ok" else None, ms=0.9 if status == "ok" else None,
                            value=137.174 if status == "ok" else None, ratio=1.1111 if status == "ok" else None,
                            message=msg))
    return BenchResult(meta, rows)


def test_the_summary_does_not_count_unavailable_kernels_as_incorrect():
    s = _result(False).summary()["kernels"]
    assert s["kernel_number_0"]["correct"] == s["kernel_number_0"]["cases"] == 2
    assert s["kernel_number_1"]["cases"] == 0 and s["kernel_number_1"]["unavailable"] == 2
    out = io.StringIO()
    print_report(_result(False), Console(file=out, width=80))
    text = out.getvalue()
    assert "2/2" in text and "0/2" not in text


@pytest.mark.parametrize("width", [80, 200])
def test_numbers_stay_whole_in_a_file_or_a_narrow_terminal(width):
    out = io.StringIO()
    print_report(_result(False), Console(file=out, width=width))  # a StringIO is not a terminal: like `> file`
    text = out.getvalue()
    assert "…" not in text, text
    for number in ("137", "1.11x", "123", "geomean", "correct", "16x28672x8192"):
        assert number in text, (number, text)
    assert "needs an sm_90 GPU with Gluon" in text  # the reason, once, under the table


def test_a_narrow_terminal_keeps_the_columns_readable():
    console = Console(file=io.StringIO(), width=80, force_terminal=True)
    console.print(results_table(_result(False)))
    text = console.file.getvalue()
    assert "1.11x" in text and "137" in text, text


def test_the_plot_under_the_interpreter_shows_times_not_rates():
    label, series = plot_series(_result(True), topk=4)
    assert "ms" in label and "interpreter" in label.lower()
    assert series["kernel_number_0"] == [(0, 0.9), (1, 0.9)]
    label, series = plot_series(_result(False), topk=4)
    assert label == "TFLOPS" and series["kernel_number_0"] == [(0, 137.174), (1, 137.174)]


# --- the docs say what the CLI does ---------------------------------------------------------------------


def test_the_bench_page_names_every_command():
    text = (ROOT / "docs/bench.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"tilegemm {name}" in text, f"docs/bench.md does not mention `tilegemm {name}`"


def test_docs_cite_test_files_that_exist():
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for cited in re.findall(r"`(tests/[\w/.-]+\.py)", page.read_text()):
            assert (ROOT / cited).exists(), f"{page.relative_to(ROOT)} cites {cited}, which does not exist"


# --- the property: any command line runs (exit 0) or is refused in one line (exit 2), never a traceback ----------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SHAPES = {"matmul": ["8,8,8", "1,1,1", "0,4,4", "8x8", "a,b,c"], "w4a16": ["1,8,128", "2,8,100", "1,8"],
          "conv2d": ["1,2,4,4,2,3,3,1,1", "1,2,2,2,2,3,3", "1,2,4,4"]}


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(op=st.sampled_from(["matmul", "w4a16", "conv2d", "fft"]), data=st.data())
def test_any_bench_command_line_runs_or_fails_in_one_line(op, data, capsys):
    argv = ["bench", "--op", op, "--quiet", "--no-save", "--warmup", "0", "--rep", "1", "--no-baseline"]
    argv += ["--shape", data.draw(st.sampled_from(SHAPES.get(op, ["8,8,8"])))]
    for flag, values in (("--dtype", ["fp16", "fp32", "bf16", "fp8", "int8"]), ("--kernels", ["auto", "naive", "gemv",
                         "implicit_gemm", "nope", ","]), ("--layout", ["NT", "TT"]), ("--batch", ["2", "0"]),
                         ("--mode", ["bwd"]), ("--memory-format", ["nchw"]), ("--topk", ["0"]), ("--rounds", ["2"])):
        if data.draw(st.integers(0, 3)) == 0:
            argv += [flag, data.draw(st.sampled_from(values))]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc in (0, 2), (argv, rc, captured.err[-2000:])
    if rc == 2:
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("tilegemm: error:"), (argv, err)
    else:
        assert "error:" not in captured.out and "WRONG" not in captured.out, (argv, captured.out)


def test_a_shapes_file_that_is_not_text_is_an_error(tmp_path, capsys):
    shapes = tmp_path / "shapes.bin"
    shapes.write_bytes(bytes(range(128, 256)))
    _one_line_exit_2(["bench", "--shapes", str(shapes), "--quiet", "--no-save"], "is not text", capsys)


def test_a_batched_case_with_batch_is_an_error_before_any_run(capsys):
    _one_line_exit_2(["bench", "--sweep", "batched", "--batch", "2", "--quiet", "--no-save"],
                     "--batch 2 does not apply to", capsys)


@pytest.mark.parametrize("name", ["TILEGEMM_INTERPRET", "TRITON_INTERPRET"])
def test_a_bad_interpreter_flag_is_one_line(tmp_path, name):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("TILEGEMM_INTERPRET", None)
    env[name] = "bogus"
    run = subprocess.run([sys.executable, "-m", "tilegemm_cli", "info"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == f"tilegemm: error: {name}='bogus': expected 1 or 0 (or true/false, yes/no, on/off)"


@cpu_only
def test_a_kernel_named_twice_runs_once(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "--kernels", "naive,naive", "--shape", "8,8,8", "--quiet", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert sum(r["kernel"] == "naive" for r in rows) == 1, rows


def test_json_holds_no_infinity(tmp_path):
    # a wrong kernel's error is inf: written as null, which every JSON parser reads
    import json

    from tilegemm.bench.report import write_json

    row = Row(op="matmul", kernel="k", shape="s", dims={"e": float("nan")}, x=1.0, dtype="fp16", layout="NN",
              batch=1, status="wrong", rel_err=float("inf"), ms=1.0)
    result = BenchResult(meta={"op": "matmul"}, rows=[row])
    write_json(result, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert data["rows"][0]["rel_err"] is None and data["rows"][0]["dims"]["e"] is None


@pytest.mark.parametrize("argv,flag", [
    (["--shapes", ""], "--shapes"), (["--shape", "8,8,8", "--json", ""], "--json"), (["--dtype", " "], "--dtype"),
    (["--sweep", ""], "--sweep"), (["--op", "w4a16", "--model", ""], "--model"), (["--kernels", ""], "--kernels"),
    (["--op", "w4a16", "--model", "llama", "--checkpoint", ""], "--checkpoint"), (["--out", ""], "--out"),
])
def test_an_empty_option_is_an_error_not_its_absence(argv, flag, monkeypatch, capsys):
    # read as not given, --shapes '' ran the default sweep and --checkpoint '' random weights
    import tilegemm.bench.runner as runner

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))
    _one_line_exit_2(["bench", "--quiet", *argv], f"{flag} is empty", capsys)


@pytest.mark.parametrize("argv", [["tune", "--kernels", "", "--shape", "8,8,8"], ["warmup", "--dtype", ""]])
def test_tune_and_warmup_refuse_empty_options(argv, capsys):
    _one_line_exit_2(argv, "is empty", capsys)


def test_tune_refuses_a_list_of_no_kernels(capsys):
    # "--kernels ," tuned nothing and said so with exit status 0
    _one_line_exit_2(["tune", "--kernels", ",", "--shape", "8,8,8"], "--kernels names no kernel", capsys)


def test_two_outputs_of_one_path_are_an_error(tmp_path, monkeypatch, capsys):
    # the CSV was written over the JSON, both reported as written
    import tilegemm.bench.runner as runner

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))
    same = str(tmp_path / "r.out")
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", "--no-save", "--json", same, "--csv", same],
                     "--json and --csv name the same file", capsys)
    os.symlink(same, tmp_path / "link")  # (through a link too)
    _one_line_exit_2(["bench", "--shape", "8,8,8", "--quiet", "--no-save", "--csv", same, "--plot",
                      str(tmp_path / "link")], "--csv and --plot name the same file", capsys)


def test_the_writers_write_through_a_link_and_into_a_fifo(tmp_path):
    # renamed over, a link became a plain file (its target never written) and a FIFO or device a plain file
    import threading

    from tilegemm.core.files import atomic_write

    target = tmp_path / "target.json"
    (tmp_path / "link.json").symlink_to(target)
    atomic_write(tmp_path / "link.json", lambda f: f.write("one"))
    assert (tmp_path / "link.json").is_symlink() and target.read_text() == "one"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    atomic_write(fifo, lambda f: f.write("two"))
    reader.join(timeout=10)
    assert got == ["two"] and fifo.is_fifo()


@cpu_only
def test_a_plot_without_a_suffix_is_written_under_its_name(tmp_path, capsys):
    plot = tmp_path / "rates"
    assert main(["bench", "--kernels", "naive", "--shape", "8,8,8", "--quiet", "--no-save", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "rates.png").exists()
    assert f"wrote {plot}" in " ".join(capsys.readouterr().out.split())  # (rich wraps the line)


def test_custom_shapes_get_labels_of_their_own():
    from tilegemm.bench.base import bench_op

    copy, conv, grouped = bench_op("copy"), bench_op("conv2d"), bench_op("grouped")
    labels = [copy.parse_shape(t).label for t in ("1048576", "1048577", "1024", "1000", "4M", "16k")]
    assert labels == ["1M", "1048577", "1K", "1000", "4M", "16K"]
    assert copy.parse_shape(labels[0]).dims == copy.parse_shape("1048576").dims  # (a label reads back)
    assert conv.parse_shape("2,8,9,9,16,3,3,1,0").label != conv.parse_shape("2,8,9,9,16,3,3,1,1").label
    assert grouped.parse_shape("4,2,64,32,4,gate_up").label != grouped.parse_shape("8,2,64,32,4,gate_up").label


@cpu_only
def test_a_shape_given_twice_runs_once_and_the_csv_names_the_mode(tmp_path, capsys):
    import json

    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    assert main(["bench", "--op", "conv2d", "--kernels", "auto", "--shape", "1,4,5,5,8,3,3", "--shape",
                 "1x4x5x5x8x3x3", "--mode", "dgrad", "--quiet", "--no-save", "--json", str(out), "--csv",
                 str(table)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sum(r["kernel"] == "auto" for r in rows) == 1, rows
    assert "# mode: dgrad\n" in table.read_text()
    assert "(mode dgrad)" in " ".join(capsys.readouterr().out.split())  # the table's title
