"""examples/llama_decode.py --tiny: a two-layer Llama with tilegemm.nn.quantize_, greedy decode under the interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "llama_decode.py")


def load_example():
    spec = importlib.util.spec_from_file_location("llama_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_decode_runs_and_agrees(capsys):
    assert load_example().main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "14 Linears" in out  # 2 layers x (q, k, v, o, gate, up, down); lm_head kept
    assert "batch   2 eager" in out and "int4 prefill" in out
    line = next(l for l in out.splitlines() if l.startswith("int4 vs fp16-dequantized"))
    err = float(line.split("rel. error ")[1].split(",")[0])
    assert err < 1e-2, line
    assert "argmax agrees at 100.0%" in line
