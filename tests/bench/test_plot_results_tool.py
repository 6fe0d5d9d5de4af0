"""tools/plot_results.py: a bench JSON (plain or xz) re-plotted beside itself; files it cannot read, or that are
not bench results, named on one line each (exit 1), no arguments the usage (exit 2)."""

from __future__ import annotations

import importlib.util
import lzma
from pathlib import Path

import pytest

from tilegemm.cli import main as cli
from tilegemm.core.runtime import interpreting

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "tools" / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not interpreting(), reason="a tiny bench run under the interpreter")
def test_a_result_is_plotted_beside_itself(tmp_path):
    result = tmp_path / "r.json"
    assert cli(["bench", "--shape", "16,16,16", "--kernels", "naive", "--quiet", "--no-save",
                "--json", str(result)]) == 0
    packed = tmp_path / "p.json.xz"
    packed.write_bytes(lzma.compress(result.read_bytes()))
    assert _tool().main([str(result), str(packed)]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0 and (tmp_path / "p.png").stat().st_size > 0


def test_bad_files_are_named_and_skipped(tmp_path, capsys):
    (tmp_path / "a.csv").write_text("M,N,K\n1,2,3\n")
    (tmp_path / "b.json").write_text("[1, 2]")
    (tmp_path / "c.json.xz").write_bytes(b"not xz")
    tool = _tool()
    assert tool.main([str(tmp_path / "missing.json"), str(tmp_path / "a.csv"), str(tmp_path / "b.json"),
                      str(tmp_path / "c.json.xz")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("plot_results: ") for line in err)
    assert "missing.json: cannot read it" in err[0] and "a.csv: not JSON" in err[1]
    assert "b.json: not a bench result" in err[2] and "c.json.xz: cannot read it" in err[3]
    assert tool.main([]) == 2 and "plot_results.py RESULT.json" in capsys.readouterr().err
    (tmp_path / "d.json").write_text('{"rows": [], "meta": {}}')  # the schema's keys, none of the values
    (tmp_path / "e.json.xz").write_bytes(lzma.compress(b'{"rows": []}')[:20])  # a truncated archive
    assert tool.main([str(tmp_path / "d.json"), str(tmp_path / "e.json.xz")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "d.json: not a" in err[0] and "e.json.xz: cannot read it" in err[1]
