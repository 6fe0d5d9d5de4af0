"""tools/conv2d_gpu_check.py: its dry run under the interpreter checks every layer in both input formats (with the
channels-last weight a converted model has) and finds the output and both gradients in torch's layouts."""

from __future__ import annotations

import json

import pytest

from tilegemm.core.runtime import interpreting

from conftest import load_script


def test_dry_run_passes_in_both_input_formats(tmp_path):
    if not interpreting():
        pytest.skip("the tool's dry run is the interpreter's")
    tool = load_script("tools", "conv2d_gpu_check.py")
    out = tmp_path / "check.json"
    rc = tool.main(["--dry-run", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows
    for row in rows:
        # an NCHW x with a channels-last weight: a channels-last layer (output, grad x, grad weight), as torch's
        for fmt in ("nhwc", "nchw"):
            assert f"{fmt}_error" not in row, row
            assert row[f"{fmt}_format_kept"], (row["shape"], fmt)
        assert row["ok"], row
    assert rc == 0
