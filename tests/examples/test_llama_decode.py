"""examples/llama_decode.py --tiny: a one-layer Llama with tilegemm.nn.quantize_, greedy decode under the
interpreter."""

from __future__ import annotations

import pytest

from conftest import load_script
from cpu_threads import one_cpu_thread  # noqa: F401 (autouse: torch on one CPU thread)

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")


def load_example():
    return load_script("examples", "llama_decode.py")


def test_tiny_decode_runs_and_agrees(capsys):
    # a batch of 3: the interpreter runs the decode steps of 1 or 2 rows through its slower one-row kernel
    assert load_example().main(["--tiny", "--layers", "1", "--batches", "3", "--prompt", "4", "--new", "3"]) == 0
    out = capsys.readouterr().out
    assert "7 Linears" in out  # 1 layer x (q, k, v, o, gate, up, down); lm_head kept
    assert "batch   3 eager" in out and "int4 prefill" in out
    line = next(l for l in out.splitlines() if l.startswith("int4 vs fp16-dequantized"))
    err = float(line.split("rel. error ")[1].split(",")[0])
    assert err < 1e-2, line
    assert "argmax agrees at 100.0%" in line


def test_tiny_decode_with_joined_projections(capsys):
    assert load_example().main(["--tiny", "--layers", "1", "--fuse", "--batches", "1", "--prompt", "4",
                                "--new", "2"]) == 0
    out = capsys.readouterr().out
    assert "fuse_projections_: 2 groups joined" in out  # 1 layer x (q/k/v, gate/up)
    line = next(l for l in out.splitlines() if l.startswith("int4 vs fp16-dequantized"))
    assert float(line.split("rel. error ")[1].split(",")[0]) < 1e-2, line


def test_modes_it_cannot_run_are_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runs every mode")
    args = ["--tiny", "--layers", "1", "--batches", "1", "--prompt", "2", "--new", "1"]
    assert load_example().main(args + ["--modes", "bogus"]) == 2
    assert "unknown mode(s) ['bogus']" in capsys.readouterr().err
    assert load_example().main(args + ["--modes", "graph"]) == 2
    assert "['graph'] need a CUDA GPU" in capsys.readouterr().err
