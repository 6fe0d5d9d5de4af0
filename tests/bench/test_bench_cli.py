"""The bench command: its files, its checks and its errors (timings are never asserted)."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from tilegemm.core import registry
from tilegemm.core.runtime import interpreting
from tilegemm.bench.base import bench_op
from tilegemm.bench.runner import BASELINE, run_bench
from tilegemm.cli import main
from cpu_threads import one_cpu_thread  # noqa: F401 (autouse: torch on one CPU thread)


def test_bench_writes_json_csv_png(tmp_path, capsys):
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "csv", "png")}
    # (the second shape in the other form; smaller under the interpreter, which runs every default kernel on it)
    square = "32x32x32" if interpreting() else "64x64x64"
    rc = main(["bench", "--shape", "33,17,40", "--shape", square, "--quiet", "--no-save",
               "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--plot", str(paths["png"])])
    assert rc == 0
    out = capsys.readouterr().out
    assert ("INTERPRETER" in out) == interpreting() and "33x17x40" in out and "summary" in out and "geomean" in out

    mask = os.umask(0)
    os.umask(mask)
    for path in paths.values():  # like any file the user writes: 0666 less the umask, not a private 0600
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, oct(path.stat().st_mode)
    data = json.loads(paths["json"].read_text())
    assert data["schema"] == "tilegemm-bench/1"
    machine = data["meta"]["machine"]
    for key in ("gpu", "sm_count", "driver", "cuda", "torch", "triton", "tilegemm", "git_commit", "timestamp"):
        assert key in machine
    assert machine["interpreter"] is interpreting()
    assert ("NOT GPU performance" in data["meta"].get("note", "")) == interpreting()
    rows = data["rows"]
    default = bench_op("matmul").kernel_names("fp16")  # what runs here: the Gluon kernels need an sm_90 GPU
    assert {r["kernel"] for r in rows} == {BASELINE, *default}
    # on a GPU a kernel that does not take a shape (the Gluon kernels: 33x17x40's rows are not 16-byte aligned,
    # or not their dtype) shows as unavailable; the interpreter runs every default kernel on both
    ran = [r for r in rows if r["status"] != "unavailable" or interpreting()]
    assert all(r["status"] == "ok" and r["rel_err"] <= r["tolerance"] for r in ran)
    assert {r["kernel"] for r in ran} >= {BASELINE, "naive", "grouped", "auto"}
    assert all(r["ms"] > 0 and r["ms_p20"] <= r["ms"] <= r["ms_p80"] for r in ran)
    assert all(r["ratio"] is not None for r in ran if r["kernel"] != BASELINE)
    assert set(data["summary"]["kernels"]) == {r["kernel"] for r in ran} - {BASELINE}

    text = paths["csv"].read_text()
    assert "# triton:" in text and "# git_commit:" in text
    table = list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))
    assert len(table) == len(rows) and table[0]["op"] == "matmul"

    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(paths["png"]) as im:
        assert im.mode == "P" and im.size[0] > 500, "a palette image of the plot"


def test_default_bench_saves_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--shape", "20,20,20", "--kernels", "naive", "--quiet"]) == 0
    written = sorted(p.suffix for p in (tmp_path / "tilegemm-bench").iterdir())
    assert written == [".csv", ".json", ".png"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["bench", "--op", "fft"], "unknown op 'fft'"),
        (["bench", "--dtype", "fp8"], "has no dtype 'fp8'"),
        (["bench", "--dtype", "int4"], "has no dtype 'int4'"),
        (["bench", "--shape", "12,x"], "malformed matmul shape '12,x'"),
        (["bench", "--shape", "0,4,4"], "sizes must be >= 1"),
        (["bench", "--kernels", "naive,turbo"], "unknown matmul kernel 'turbo'"),
        (["bench", "--sweep", "huge"], "no sweep 'huge'"),
        (["bench", "--sweep", "square", "--shape", "4,4,4"], "either --sweep or --shape"),
        (["bench", "--batch", "0"], "--batch must be >= 1"),
        (["bench", "--rounds", "0"], "--rounds must be >= 1"),
        (["bench", "--fast-accum"], "--fast-accum applies to --op matmul with an fp8 --dtype only"),
        (["bench", "--shapes", "/no/such/file"], "cannot read --shapes file"),
        (["bench", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tilegemm: error:") and needle in err


def test_shapes_file(tmp_path, capsys):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("# M,N,K\n17,9,33\n\n8x8x8  # tiny\n")
    assert main(["bench", "--shapes", str(shapes), "--kernels", "grouped", "--quiet", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "17x9x33" in out and "8x8x8" in out


def _write_garbage(p):
    p.out.fill_(1.0)


@pytest.fixture
def broken_kernel():
    """A registered matmul kernel that writes ones: the bench must flag it, never rank it."""
    spec = registry.KernelSpec(op="matmul", name="broken", summary="test only: writes ones",
                               target="test_bench_cli:_write_garbage", order=99)
    registry.register(spec)
    yield "broken"
    registry.unregister("matmul", "broken")


def test_a_wrong_kernel_is_flagged_and_not_ranked(broken_kernel, capsys):
    op = bench_op("matmul")
    result = run_bench(op, [op.parse_shape("40,40,40")], "fp16", ["grouped", broken_kernel], rep_ms=1)
    rows = {r.kernel: r for r in result.rows}
    assert rows["broken"].status == "wrong" and rows["broken"].rel_err > 0.5
    assert rows["grouped"].status == "ok"
    summary = result.summary()
    assert summary["kernels"]["broken"]["wrong"] == 1 and summary["kernels"]["broken"]["geomean_ratio"] is None
    assert summary["best_per_shape"]["40x40x40"] != "broken"
    assert main(["bench", "--shape", "40,40,40", "--kernels", "broken", "--quiet", "--no-save"]) == 1
    assert "WRONG" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "tf32", "fp8_e4m3", "fp8_e5m2"])
def test_every_dtype_checks_out(dtype):
    op = bench_op("matmul")
    # On a GPU fp8's baseline is torch._scaled_mm: A row-major, B column-major, sizes multiples of 16 (the
    # interpreter's baseline is the same formula on the CPU, any layout)
    gpu_fp8 = dtype.startswith("fp8") and not interpreting()
    M, N, K = (32, 48, 64) if gpu_fp8 else (24, 40, 56)
    result = run_bench(op, [op.parse_shape(f"{M},{N},{K}")], dtype, ["naive"], rep_ms=1,
                       options=dict(layout="NT" if gpu_fp8 else "TN"))
    assert [r.status for r in result.rows] == ["ok", "ok"]
    assert result.rows[1].dims == {"M": M, "N": N, "K": K}


def test_fp8_defaults_to_the_nt_layout_of_scaled_mm(capsys):
    op = bench_op("matmul")
    result = run_bench(op, [op.parse_shape("32,48,64")], "fp8_e4m3", ["grouped", "split_k"], rep_ms=1)
    assert [r.status for r in result.rows] == ["ok", "ok", "ok"]
    assert all(r.layout == "NT" for r in result.rows)
    assert main(["bench", "--dtype", "fp8_e5m2", "--shape", "16,16,32", "--kernels", "naive", "--quiet",
                 "--no-save"]) == 0


def test_fp8_fast_accum_reaches_both_sides(tmp_path, monkeypatch):
    import tilegemm

    seen = []
    real = tilegemm.matmul
    # the fp8 calls only (on a GPU the bench's host probe also calls matmul, in fp16)
    monkeypatch.setattr(tilegemm, "matmul", lambda *a, **kw: (
        a[0].element_size() == 1 and seen.append(kw.get("fast_accum")), real(*a, **kw))[1])
    path = tmp_path / "r.json"
    assert main(["bench", "--dtype", "fp8_e4m3", "--fast-accum", "--shape", "16,32,64", "--kernels", "grouped",
                 "--quiet", "--no-save", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["fast_accum"] is True and seen and all(seen)
    assert all(r["status"] == "ok" for r in data["rows"])


def test_batched_layout_rows_count_the_batch():
    op = bench_op("matmul")
    case = op.parse_shape("16,16,16")
    result = run_bench(op, [case], "fp16", ["grouped"], rep_ms=1, options=dict(layout="TT", batch=3))
    row = result.rows[1]
    assert row.status == "ok" and row.batch == 3 and row.layout == "TT"
    assert op.work(case, "fp16", dict(batch=3)) == 3 * 2 * 16**3


def test_the_batched_sweeps_cases_carry_their_batch():
    from tilegemm.bench.base import BenchError

    op = bench_op("matmul")
    cases = op.sweeps["batched"]()
    assert len(cases) >= 10 and len({c.label for c in cases}) == len(cases)
    assert all(c.dims["B"] >= 2 and c.label.endswith(f"/b{c.dims['B']}") for c in cases)
    case = cases[0]
    assert op.work(case, "fp16", dict(batch=1)) == 2.0 * case.dims["B"] * case.dims["M"] * case.dims["N"] * case.dims["K"]
    with pytest.raises(BenchError, match="--batch 4 does not apply"):
        op.work(case, "fp16", dict(batch=4))
    small = type(case)("17x9x33/b3", dict(M=17, N=9, K=33, B=3), 0.0)  # a batched case, run under the interpreter
    result = run_bench(op, [small], "fp16", ["grouped", "auto"], rep_ms=1, options=dict(layout="NT", batch=1))
    rows = [r for r in result.rows if r.kernel in ("grouped", "auto")]
    assert rows and all(r.status == "ok" and r.batch == 3 for r in rows)


def test_rounds_time_every_kernel_in_alternating_order(monkeypatch):
    from tilegemm.bench import runner

    op = bench_op("matmul")
    order = []
    real_run, real_baseline = op.run, op.baseline
    monkeypatch.setattr(op, "run", lambda kernel, inputs, dtype: (order.append(kernel), real_run(kernel, inputs, dtype))[1])
    monkeypatch.setattr(op, "baseline", lambda inputs, dtype: (order.append(BASELINE), real_baseline(inputs, dtype))[1])
    timed = []
    real_samples = runner.time_samples

    def spy(fn, warmup_ms, rep_ms, cuda_graph):
        start = len(order)
        times = real_samples(fn, warmup_ms, rep_ms, cuda_graph)
        timed.append((order[start], rep_ms, len(times)))
        return times

    monkeypatch.setattr(runner, "time_samples", spy)
    result = run_bench(op, [op.parse_shape("16,16,16")], "fp16", ["naive", "grouped"], rep_ms=3, rounds=3)
    assert [k for k, _, _ in timed] == [BASELINE, "naive", "grouped", "grouped", "naive", BASELINE,
                                        BASELINE, "naive", "grouped"]
    assert all(rep == pytest.approx(1.0) for _, rep, _ in timed)
    assert result.meta["rounds"] == 3
    rows = {r.kernel: r for r in result.rows}
    assert [r.kernel for r in result.rows] == [BASELINE, "naive", "grouped"]
    assert all(r.status == "ok" and r.ms_p20 <= r.ms <= r.ms_p80 for r in rows.values())
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        run_bench(op, [op.parse_shape("16,16,16")], "fp16", ["naive"], rounds=0)


def test_a_kernel_failing_while_timed_is_reported_and_the_others_still_timed(monkeypatch):
    op = bench_op("matmul")
    calls = {"naive": 0}
    real_run = op.run

    def run(kernel, inputs, dtype):
        if kernel == "naive":
            calls["naive"] += 1
            if calls["naive"] > 1:  # the check passes, the timing fails
                raise RuntimeError("launch failed")
        return real_run(kernel, inputs, dtype)

    monkeypatch.setattr(op, "run", run)
    # One round: the kernel after the failing one must still be timed in the same pass.
    result = run_bench(op, [op.parse_shape("16,16,16")], "fp16", ["naive", "grouped"], rep_ms=3, rounds=1)
    rows = {r.kernel: r for r in result.rows}
    assert rows["naive"].status == "error" and "launch failed" in rows["naive"].message
    assert rows["grouped"].status == "ok" and rows["grouped"].ms > 0 and rows["grouped"].ratio is not None


def test_info_runs(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert ("interpreter" if interpreting() else "cuda") in out.lower() and "naive" in out and "triton" in out


@pytest.mark.parametrize("slug, says", [("nvidia-h200", "nvidia-h200.json"),
                                         ("nvidia-h100-pcie", "a sibling GPU's: none ship for nvidia-h100-pcie"),
                                         ("nvidia-a100-sxm4-80gb", "none for this GPU")])
def test_info_names_the_tuned_file_in_use(slug, says, monkeypatch):
    from tilegemm import cli
    from tilegemm.core import tuning

    monkeypatch.setattr(tuning, "_device_tag", lambda: (slug, "3.6.0"))
    text = cli._tuning_text()
    assert says in text
    if "sibling" in says:
        assert "nvidia-h100-80gb-hbm3.json" in text


def test_peaks_table():
    from tilegemm.core.hardware import peak_gbps, peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H200", "tf32") == pytest.approx(494.7)
    assert peak_gbps("NVIDIA H200") == pytest.approx(4800)
    assert peak_tflops("NVIDIA L40S", "fp16") is None  # "L4" must not match L40S
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312)
    assert peak_tflops("Some Future GPU", "fp16") is None
    assert peak_tflops("NVIDIA H800", "fp16") == pytest.approx(989.4)
    assert torch.float16.itemsize == 2


def test_a_second_baseline_gets_its_own_row_and_ratio(monkeypatch):
    """An op with a second baseline (w4a16: torch's int4 kernel on CUDA) times it as a row of its own and
    gives every kernel a second ratio; here matmul is given one (torch.matmul in fp32) for the test."""
    from tilegemm.bench.report import results_table, summary_table
    from tilegemm.bench.runner import BASELINE2

    op = bench_op("matmul")
    monkeypatch.setattr(type(op), "second_baseline_name", "fp32 torch", raising=False)
    monkeypatch.setattr(type(op), "second_baseline_reason", lambda self, device: None)
    monkeypatch.setattr(type(op), "second_baseline",
                        lambda self, inputs, dtype: torch.matmul(inputs["a"].float(), inputs["b"].float()))
    result = run_bench(op, [op.parse_shape("24,40,56")], "fp16", ["grouped"], rep_ms=1)
    rows = {r.kernel: r for r in result.rows}
    assert [r.kernel for r in result.rows] == [BASELINE, BASELINE2, "grouped"]
    assert rows[BASELINE2].status == "ok" and rows["grouped"].ratio2 is not None
    assert result.meta["second_baseline"] == "fp32 torch"
    assert result.summary()["kernels"]["grouped"]["geomean_ratio2"] is not None
    assert "x fp32 torch" in [c.header for c in results_table(result).columns]
    assert "geomean x fp32 torch" in [c.header for c in summary_table(result).columns]


def test_results_table_renders_rows_without_a_ratio(monkeypatch):
    """A kernel row that ran where its baseline did not (torch._scaled_mm refuses K not a multiple of 16)
    has no ratio: the GPU table shows "-" for it instead of failing after the whole sweep ran."""
    from rich.console import Console

    from tilegemm.bench.report import results_table

    op = bench_op("matmul")

    def refuse(self, inputs, dtype):
        raise RuntimeError("the baseline does not take this shape")

    monkeypatch.setattr(type(op), "baseline", refuse)
    result = run_bench(op, [op.parse_shape("24,40,56")], "fp16", ["grouped"], rep_ms=1)
    rows = {r.kernel: r for r in result.rows}
    assert rows["grouped"].status == "ok" and rows["grouped"].ratio is None
    result.meta["machine"]["interpreter"] = False  # render as on a GPU, where ratios are shown
    table = results_table(result)
    Console(record=True, width=200).print(table)
    kernels = next(c for c in table.columns if c.header == "kernel")._cells
    ratios = next(c for c in table.columns if c.header == "ratio")._cells
    assert str(ratios[[str(k).rstrip(" *") for k in kernels].index("grouped")]) == "-"


def test_an_interrupted_bench_keeps_the_cases_done(monkeypatch):
    """A time limit's SIGINT mid-sweep: the finished cases are returned (and written), the result says so."""
    op = bench_op("matmul")
    cases = [op.parse_shape("16,16,16"), op.parse_shape("24,24,24"), op.parse_shape("32,32,32")]
    prepare = op.prepare

    def interrupt_third(case, *args, **kw):
        if case.label == cases[2].label:
            raise KeyboardInterrupt
        return prepare(case, *args, **kw)

    monkeypatch.setattr(op, "prepare", interrupt_third)
    result = run_bench(op, cases, "fp16", ["grouped"], rep_ms=1)
    assert {r.shape for r in result.rows} == {cases[0].label, cases[1].label}
    assert all(r.status == "ok" for r in result.rows if r.kernel == "grouped")
    assert result.meta["interrupted"] == "stopped after 2 of 3 cases"


def test_an_interrupted_bench_writes_its_json_and_exits_130(tmp_path, monkeypatch):
    import json

    op = bench_op("matmul")
    prepare = op.prepare
    seen = []

    def interrupt_second(case, *args, **kw):
        seen.append(case.label)
        if len(set(seen)) == 2:
            raise KeyboardInterrupt
        return prepare(case, *args, **kw)

    monkeypatch.setattr(type(op), "prepare", lambda self, case, *a, **k: interrupt_second(case, *a, **k))
    path = tmp_path / "run.json"
    code = main(["bench", "--shape", "16,16,16", "--shape", "24,24,24", "--kernels", "grouped", "--quiet",
                 "--no-save", "--json", str(path)])
    assert code == 130
    saved = json.loads(path.read_text())
    assert saved["meta"]["interrupted"] == "stopped after 1 of 2 cases"
    assert {r["shape"] for r in saved["rows"]} == {"16x16x16"}


@pytest.mark.parametrize("op_name, sweep", [("matmul", "random"), ("w4a16", "w4-random")])
def test_a_seeded_sweep_draws_the_held_out_seed_unless_given_another(op_name, sweep):
    op = bench_op(op_name)
    held_out, again, other = op.cases(sweep), op.cases(sweep), op.cases(f"{sweep}:2026")
    assert [c.dims for c in held_out] == [c.dims for c in again]
    assert len(other) == len(held_out)
    assert [c.dims for c in other] != [c.dims for c in held_out]
    assert [c.dims for c in op.cases(f"{sweep}:2026")] == [c.dims for c in other]
    with pytest.raises(Exception, match="integer seed"):
        op.cases(f"{sweep}:abc")


def test_the_retired_random_seed_still_names_its_shapes():
    # The random sweep's earlier seed, read while rules were fitted, keeps its shapes under random:2026.
    from tilegemm.ops.matmul.bench import _random_cases
    assert [c.dims for c in bench_op("matmul").cases("random:2026")] == [c.dims for c in _random_cases(seed=2026)]
    assert [c.dims for c in bench_op("matmul").cases("random")][0] != _random_cases(seed=2026)[0].dims


@pytest.mark.parametrize("wrap", [lambda t: t, lambda t: [t.clone(), t], lambda t: {"logits": t}])
def test_a_reference_that_overflows_is_reported_not_blamed_on_the_kernels(monkeypatch, wrap):
    op = bench_op("matmul")
    real_prepare = op.prepare

    def prepare(*args, **kwargs):
        p = real_prepare(*args, **kwargs)
        ref = p.reference.clone()
        ref.view(-1)[3] = float("inf")
        p.reference = wrap(ref)
        return p

    monkeypatch.setattr(op, "prepare", prepare)
    result = run_bench(op, [op.parse_shape("16,16,16"), op.parse_shape("8,8,8")], "fp16", ["naive"], rep_ms=1)
    assert len(result.rows) == 4  # both cases, baseline and kernel each
    for r in result.rows:
        assert r.status == "error" and "reference holds 1 inf or NaN" in r.message and r.ms is None, r


def test_a_case_whose_reference_overflows_frees_its_inputs_before_the_next(monkeypatch):
    # Such a case is skipped, and its inputs must not live on while the next case makes its own (a large model's
    # would double the peak): by the time the next prepare runs, the previous prepared case is gone.
    import weakref

    op = bench_op("matmul")
    real_prepare = op.prepare
    made = []

    def prepare(*args, **kwargs):
        if made:
            assert all(ref() is None for ref in made), "the previous case's inputs are still alive"
        p = real_prepare(*args, **kwargs)
        p.reference.view(-1)[0] = float("nan")
        made.append(weakref.ref(p))
        return p

    monkeypatch.setattr(op, "prepare", prepare)
    result = run_bench(op, [op.parse_shape("16,16,16"), op.parse_shape("8,8,8"), op.parse_shape("4,4,4")], "fp16",
                       ["naive"], rep_ms=1)
    assert len(made) == 3 and len(result.rows) == 6
    assert all(r.status == "error" for r in result.rows)
