"""examples/moe_decode.py --tiny: a one-layer Qwen3-MoE, its experts on grouped_mm, on tilegemm and 4-bit, greedy
decode under the interpreter."""

from __future__ import annotations

import pytest

from conftest import load_script
from cpu_threads import one_cpu_thread  # noqa: F401 (autouse: torch on one CPU thread)

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")


def load_example():
    return load_script("examples", "moe_decode.py")


def test_tiny_moe_decode_runs_and_agrees(capsys):
    assert load_example().main(["--tiny", "--layers", "1", "--batches", "2", "--prompt", "4", "--new", "2"]) == 0
    out = capsys.readouterr().out
    assert "top 2, 1 layers" in out
    line = next(l for l in out.splitlines() if l.startswith("batch   2 eager"))
    assert "grouped_mm prefill" in line and "tilegemm prefill" in line and "tilegemm 4-bit prefill" in line
    experts = next(l for l in out.splitlines() if l.startswith("experts against grouped_mm's"))
    errs = [float(experts.split(f"{k} ")[1].split(",")[0].split(" ")[0]) for k in ("16-bit", "4-bit")]
    assert all(e < 1e-2 for e in errs), experts
    for name in ("tilegemm vs", "tilegemm 4-bit vs"):
        agree = next(l for l in out.splitlines() if l.startswith(name))
        assert float(agree.split("rel. error ")[1].split(",")[0]) < 1e-2, agree


def test_no_gpu_without_tiny_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runs the full-size model")
    assert load_example().main([]) == 2
    assert "use --tiny" in capsys.readouterr().err


def test_modes_it_cannot_run_are_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runs every mode")
    assert load_example().main(["--tiny", "--modes", "bogus"]) == 2
    assert "unknown mode(s) ['bogus']" in capsys.readouterr().err
    assert load_example().main(["--tiny", "--modes", "eager,graph"]) == 2
    assert "['graph'] need a CUDA GPU" in capsys.readouterr().err
