"""The conv2d kernels' loads, compiled for sm_90 without a GPU: 16-byte asynchronous copies, no 2-byte loads.

Sizes are not specialized on (a new image size compiles nothing), so the kernels must say what the host
knows of them (DIV_C / DIV_K, masks written as ``offs // DIV < bound // DIV``); without that every load of
a ResNet-50 3x3 layer was a 2-byte ``ld.global.b16`` with no ``cp.async`` pipelining.
"""

from __future__ import annotations

from pathlib import Path

from conftest import compile_offline

SCRIPT = (Path(__file__).parent / "_load_widths.py").read_text()


def test_forward_and_both_gradients_load_16_bytes_at_a_time(tmp_path):
    counts = compile_offline(tmp_path, SCRIPT, [], timeout=600)
    for kernel in ("fwd", "dgrad", "wgrad"):
        ops = counts[kernel]
        assert ops.get("cp.async.cg.shared.global", 0) > 0, f"{kernel}: no 16-byte cp.async: {ops}"
        assert not any(op.startswith("ld.global.b16") for op in ops), f"{kernel}: 2-byte loads: {ops}"
        assert any(op.startswith("wgmma") for op in ops), f"{kernel}: no wgmma: {ops}"
