"""`tilegemm bench --model`: a whole model on tilegemm's layers against the same model on torch's. The tiny sweeps
run here under the interpreter; the GPU sweeps' cases at a reduced size run with ``-m gpu``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tilegemm.bench.base import BenchError, bench_op, model_entries
from tilegemm.bench.runner import BASELINE, run_bench
from tilegemm.cli import main
from tilegemm.core.runtime import interpreting
from cpu_threads import one_cpu_thread  # noqa: F401 (autouse: torch on one CPU thread)

interpreter_only = pytest.mark.skipif(not interpreting(), reason="what the interpreter runs differs on a GPU")


def _bench_json(tmp_path, *argv) -> dict:
    path = tmp_path / "r.json"
    assert main(["bench", *argv, "--quiet", "--no-save", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _check_rows(data: dict, metric: str, labels: list[str], kernels=("auto",)) -> dict:
    """Every row correct and in the model's metric; the tilegemm rows have a ratio; the rate is the batch per
    second."""
    rows = data["rows"]
    assert [(r["shape"], r["kernel"]) for r in rows] == [(s, k) for s in labels for k in (BASELINE, *kernels)]
    for r in rows:
        assert r["status"] == "ok" and r["rel_err"] <= r["tolerance"], r
        assert r["metric"] == metric and r["value"] == pytest.approx(r["dims"]["batch"] / (r["ms"] * 1e-3))
    assert all(r["ratio"] is not None and r["ratio"] > 0 for r in rows if r["kernel"] in kernels)
    for kernel in kernels:
        assert data["summary"]["kernels"][kernel]["correct"] == len(labels)
    return {(r["shape"], r["kernel"]): r for r in rows}


def test_llama_tiny_sweep(tmp_path, capsys):
    pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
    data = _bench_json(tmp_path, "--op", "w4a16", "--model", "llama", "--sweep", "tiny")
    meta = data["meta"]
    assert meta["op"] == "w4a16:llama" and meta["metric"] == "tokens/s" and meta["model"] == "llama"
    assert "2 layers" in meta["model_description"] and "quantize_ g32" in meta["model_description"]
    rows = _check_rows(data, "tokens/s", ["b1 eager", "b2 eager"])
    for label in ("b1 eager", "b2 eager"):
        assert rows[(label, BASELINE)]["rel_err"] == 0  # the fp16 model's logits are the reference
        assert rows[(label, "auto")]["rel_err"] > 0  # the int4 kernels sum in another order than torch's Linear
        assert rows[(label, "auto")]["dims"]["layers"] == 2
    assert "model llama: a tiny Llama" in capsys.readouterr().out


def test_llama_fused_row():
    # --kernels fused: the int4 model with its projections joined, a row checked as auto's is (the tiny sweep's
    # first batch; test_llama_tiny_sweep runs auto's rows through the command line, so this runs fused's alone)
    pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
    op = bench_op("w4a16").model_bench("llama")
    op.check_kernel("fused")
    result = run_bench(op, op.cases("tiny")[:1], "fp16", ["fused"], rep_ms=1, warmup_ms=0)
    assert [(r.shape, r.kernel) for r in result.rows] == [("b1 eager", k) for k in (BASELINE, "fused")]
    for r in result.rows:
        assert r.status == "ok" and r.rel_err <= r.tolerance, r
    assert result.rows[1].rel_err > 0  # the int4 model's logits, not the fp16 reference's
    assert "fuse_projections_" in result.meta["model_description"]


def test_qwen2_is_a_second_architecture(tmp_path, capsys):
    # the tiny model; under the interpreter its first batch alone (--shape 1 runs the tiny model there), the sweep's
    # two cases being test_llama_tiny_sweep's
    pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
    argv, labels = ((["--shape", "1"], ["b1 eager"]) if interpreting() else
                    (["--sweep", "tiny"], ["b1 eager", "b2 eager"]))
    data = _bench_json(tmp_path, "--op", "w4a16", "--model", "qwen2", *argv)
    meta = data["meta"]
    assert meta["op"] == "w4a16:qwen2" and meta["model"] == "qwen2"
    assert meta["model_description"].startswith("a tiny Qwen2 ") and "2 layers" in meta["model_description"]
    rows = _check_rows(data, "tokens/s", labels)
    assert all(rows[(label, "auto")]["rel_err"] > 0 for label in labels)
    assert "model qwen2: a tiny Qwen2" in capsys.readouterr().out


def test_the_second_architecture_is_qwen2_with_4bit_biased_projections():
    pytest.importorskip("transformers")
    import tilegemm.nn
    from tilegemm.models import llama

    torch.manual_seed(0)
    model = llama.build(tiny=True, device="cpu", arch="qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    int4 = llama.quantized_copy(model, llama.TINY_GROUP)
    q = int4.model.layers[0].self_attn.q_proj
    assert isinstance(q, tilegemm.nn.Int4Linear) and q.bias is not None  # Qwen2's q/k/v carry biases
    assert not isinstance(int4.lm_head, tilegemm.nn.Int4Linear)
    with pytest.raises(ValueError, match="unknown architecture 'gpt2': choose one of llama, qwen2"):
        llama.build(tiny=True, arch="gpt2")
    # the layer estimate follows each architecture's shapes (Llama-3-8B's layer is 436 MB in fp16)
    assert llama._layer_gib(llama.LLAMA3_8B) == pytest.approx(0.406, abs=0.002)
    assert llama._layer_gib(llama.QWEN2_7B) == pytest.approx(0.434, abs=0.002)


def test_resnet_tiny_sweep(tmp_path, capsys):
    # (its fold row: test_shapes_are_batch_sizes_and_files_are_named_after_the_model, over two cases)
    data = _bench_json(tmp_path, "--op", "conv2d", "--model", "resnet50", "--sweep", "tiny")
    meta = data["meta"]
    assert meta["op"] == "conv2d:resnet50" and meta["metric"] == "images/s" and meta["model"] == "resnet50"
    assert "two-block ResNet" in meta["model_description"] and "convert_" in meta["model_description"]
    rows = _check_rows(data, "images/s", ["b2 eager"])
    assert rows[("b2 eager", "auto")]["dims"] == dict(batch=2, image=16, mode="eager", config="tiny")
    assert "model resnet50:" in capsys.readouterr().out


def test_shapes_are_batch_sizes_and_files_are_named_after_the_model(tmp_path, monkeypatch):
    # (one image, then two: the first and the second form of a shape) with --kernels auto,fold: a second tilegemm
    # row, the model converted with its batch norms folded, checked as the first; a row fold that computed the
    # unfolded model would pass too, so the folds of the model it ran are counted. The folded copy is kept with the
    # models: the second case must not take it for one of the three models
    from tilegemm.models.bench import ResNet50Bench

    folded = []
    fold = ResNet50Bench._folded
    monkeypatch.setattr(ResNet50Bench, "_folded", lambda self, ours: folded.append(fold(self, ours)) or folded[-1])
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--op", "conv2d", "--model", "resnet50", "--shape", "1", "--shape", "2,eager",
                 "--kernels", "auto,fold", "--quiet"]) == 0
    written = sorted(p.name for p in (tmp_path / "tilegemm-bench").iterdir())
    assert len(written) == 3 and all(name.startswith("conv2d-resnet50-") for name in written), written
    data = json.loads(next((tmp_path / "tilegemm-bench").glob("*.json")).read_text())
    assert data["meta"]["sweep"] == "custom" and "fold_batchnorm=True" in data["meta"]["model_description"]
    _check_rows(data, "images/s", [r["shape"] for r in data["rows"][::3]], ("auto", "fold"))
    assert len(data["rows"]) == 6
    norms = [m for m in folded[0].modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and len(folded[0].tilegemm_folded) == len(norms)  # every batch norm of the tiny ResNet folded
    if interpreting():
        assert data["meta"]["dtype"] == "fp32"  # fp32 under the interpreter
        assert [r["shape"] for r in data["rows"][::3]] == ["b1 eager", "b2 eager"]
    csv_text = next((tmp_path / "tilegemm-bench").glob("*.csv")).read_text()
    assert "# model: resnet50" in csv_text and "# model_description: a two-block ResNet" in csv_text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--op", "w4a16", "--model", "gpt"], "op w4a16 has no model 'gpt'; choose one of: llama, qwen2"),
        (["--model", "llama"], "op matmul has no model entries; those there are: --op conv2d --model resnet50, "
                               "--op grouped --model qwen3_moe, --op grouped --model mixtral, --op grouped_w4a16 "
                               "--model qwen3_moe, --op grouped_w4a16 --model mixtral, --op w4a16 --model llama, "
                               "--op w4a16 --model qwen2"),
        (["--op", "conv2d", "--model", "resnet50", "--layers", "3"], "--layers does not apply to --model resnet50"),
        (["--layers", "3"], "--layers sets a model entry's decoder layers: give the model with --model"),
        (["--op", "grouped", "--model", "mixtral", "--layers", "0"], "--layers must be >= 1, got 0"),
        (["--op", "w4a16", "--model", "llama", "--checkpoint", "ckpt", "--layers", "3"],
         "--layers does not apply with --checkpoint: the checkpoint's config sets the layers"),
        (["--op", "w4a16", "--model", "llama", "--kernels", "grouped"],
         "--kernels takes all or auto, or auto,fused, not 'grouped'"),
        (["--op", "conv2d", "--model", "resnet50", "--kernels", "naive"], "--kernels takes all or auto, or auto,fold, not"),
        (["--op", "conv2d", "--model", "resnet50", "--layout", "TN"], "--layout TN does not apply to --model resnet50"),
        (["--op", "conv2d", "--model", "resnet50", "--mode", "bwd"], "--mode bwd does not apply to --model resnet50"),
        (["--op", "w4a16", "--model", "llama", "--batch", "4"], "--batch 4 does not apply to --model llama"),
        (["--op", "w4a16", "--model", "llama", "--fast-accum"], "--fast-accum does not apply to --model llama"),
        (["--op", "w4a16", "--model", "llama", "--cuda-graph"], "--cuda-graph does not apply to --model llama"),
        (["--op", "w4a16", "--model", "llama", "--dtype", "bf16"], "op w4a16:llama has no dtype 'bf16'"),
        (["--op", "conv2d", "--model", "resnet50", "--sweep", "huge"], "has no sweep 'huge'; choose one of: inference, tiny"),
        (["--op", "conv2d", "--model", "resnet50", "--shape", "0"], "malformed --model resnet50 shape '0'"),
        (["--op", "conv2d", "--model", "resnet50", "--shape", "8,32"], "malformed --model resnet50 shape '8,32'"),
    ],
)
def test_bad_model_arguments_exit_2_with_one_line(argv, needle, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tilegemm: error:") and needle in err, err


@interpreter_only
@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--op", "conv2d", "--model", "resnet50", "--shape", "2,compile"], "runs in mode eager here, not 'compile'"),
        (["--op", "w4a16", "--model", "llama", "--sweep", "decode"], "needs a CUDA GPU; under the interpreter run "
                                                                     "--sweep tiny"),
        (["--op", "grouped", "--model", "mixtral", "--layers", "5"], "--layers sets the depth of the full-size model, "
                                                                      "which runs on a GPU"),
    ],
)
def test_gpu_only_cases_are_refused_under_the_interpreter(argv, needle, capsys):
    pytest.importorskip("transformers")
    assert main(["bench", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_missing_libraries_name_the_extra(monkeypatch, capsys):
    from tilegemm.models import resnet

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    monkeypatch.setitem(sys.modules, "torchvision", None)
    assert main(["bench", "--op", "w4a16", "--model", "llama", "--sweep", "tiny"]) == 2
    assert "needs transformers: pip install 'tilegemm[models]'" in capsys.readouterr().err
    assert main(["bench", "--op", "conv2d", "--model", "resnet50", "--sweep", "inference"]) == 2
    assert "needs torchvision: pip install 'tilegemm[models]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"pip install 'tilegemm\[models\]'"):
        resnet.make_model(tiny=False)
    assert isinstance(resnet.make_model(tiny=True), torch.nn.Module)  # the tiny one needs no torchvision


def test_model_entries_are_listed_and_built():
    assert sorted(model_entries()) == [("conv2d", "resnet50"), ("grouped", "mixtral"), ("grouped", "qwen3_moe"),
                                       ("grouped_w4a16", "mixtral"), ("grouped_w4a16", "qwen3_moe"),
                                       ("w4a16", "llama"), ("w4a16", "qwen2")]
    op = bench_op("w4a16").model_bench("llama", layers=3)
    assert op.name == "w4a16:llama" and op.layers == 3 and op.kernel_names() == ["auto"]
    with pytest.raises(BenchError, match="no model 'llama'"):
        bench_op("conv2d").model_bench("llama")


def test_importing_the_models_imports_no_model_library():
    code = """
        import sys, torch
        import tilegemm
        lazy = "tilegemm.models" not in sys.modules
        import tilegemm.cli, tilegemm.models.bench, tilegemm.models.llama, tilegemm.models.resnet
        from tilegemm.bench.base import model_entries
        model_entries()
        print(lazy, "transformers" in sys.modules, "torchvision" in sys.modules, torch.cuda.is_initialized())
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "False", "False"]


def test_a_repeated_decode_step_writes_the_same_slot():
    """Decoder(repeat=True): every step is the first step after the prompt (the bench times it many times);
    without it, transformers >= 5 writes each step one slot further on."""
    pytest.importorskip("transformers")
    from tilegemm.models import llama

    torch.manual_seed(0)
    model = llama.build(tiny=True, device="cpu")
    prompt = torch.randint(0, llama.TINY["vocab_size"], (2, 5))
    dec = llama.Decoder(model, 2, 6, "cpu", graph=False, repeat=True)
    dec.prefill(prompt)
    first = dec.next_logits().clone()
    for _ in range(3):
        assert torch.equal(dec.next_logits(), first)
    assert all(int(c) == 6 for c in dec.counters)  # slot 5 written each time: the counter ends one past it
    # the same step from a fresh cache, with the prompt and its next token in one forward: the same logits
    with torch.no_grad():
        full = model(input_ids=torch.cat([prompt, dec.ids], 1)).logits[:, -1].float()
    assert float((first.float() - full).norm() / full.norm()) < 1e-2


# --- the GPU cases, at a reduced size (the full sweeps are for `tilegemm bench`)


@pytest.mark.gpu
def test_llama_gpu_cases_two_layers():
    pytest.importorskip("transformers")
    from tilegemm.models.bench import LlamaDecodeBench

    op = LlamaDecodeBench(layers=2)
    cases = op.cases("decode")
    assert [c.label for c in cases] == ["b1 graph", "b1 compile", "b16 graph", "b16 compile"]
    assert all(c.dims["layers"] == 2 and c.dims["prompt"] == 512 for c in cases)
    result = run_bench(op, cases, "fp16", ["auto"], warmup_ms=5, rep_ms=30, sweep="decode")
    assert "2 layers (of 32)" in result.meta["model_description"]
    for row in result.rows:
        assert row.status == "ok", (row.shape, row.kernel, row.status, row.rel_err, row.message)
        assert row.kernel == BASELINE or (row.ratio and row.rel_err > 0)


@pytest.mark.gpu
def test_qwen2_gpu_cases_two_layers():
    pytest.importorskip("transformers")
    from tilegemm.models.bench import Qwen2DecodeBench

    op = Qwen2DecodeBench(layers=2)
    cases = op.cases("decode")
    result = run_bench(op, cases[:1], "fp16", ["auto"], warmup_ms=5, rep_ms=30, sweep="decode")
    assert "Qwen2-7B shapes" in result.meta["model_description"] and "2 layers (of 28)" in result.meta["model_description"]
    for row in result.rows:
        assert row.status == "ok", (row.shape, row.kernel, row.status, row.rel_err, row.message)


@pytest.mark.gpu
def test_resnet50_gpu_cases_batch_8():
    pytest.importorskip("torchvision")
    from tilegemm.models.bench import ResNet50Bench

    op = ResNet50Bench(batches=(8,))
    cases = op.cases("inference")
    assert [c.label for c in cases] == ["b8 eager", "b8 graph", "b8 compile", "b8 compile-graph"]
    result = run_bench(op, cases, "fp16", ["auto"], warmup_ms=5, rep_ms=30, sweep="inference")
    assert 'torch.compile(mode="reduce-overhead")' in result.meta["model_description"]
    assert len(result.rows) == 8
    for row in result.rows:  # both sides within fp16's bound of the fp32 model, tf32 off
        assert row.status == "ok", (row.shape, row.kernel, row.status, row.rel_err, row.message)
        assert row.kernel == BASELINE or row.ratio
