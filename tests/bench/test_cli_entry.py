"""The command's entry point (tilegemm_cli): help answered without importing torch or the package."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
import tilegemm_cli
try:
    code = tilegemm_cli.main({argv!r})
except SystemExit as exit_:
    code = exit_.code
print('imported:', 'torch' in sys.modules, 'tilegemm' in sys.modules, 'code:', code)
"""


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["info", "--help"], 0), (["tune", "-h"], 0), ([], 2),
                                        (["nope", "--help"], 2), (["--version"], 0)])
def test_help_imports_neither_torch_nor_tilegemm(argv, code):
    out = subprocess.run([sys.executable, "-c", CODE.format(argv=argv)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == f"imported: False False code: {code}", out.stdout + out.stderr
    if code == 2 and argv:
        assert out.stderr.startswith("tilegemm: error:") and len(out.stderr.strip().splitlines()) == 1


def test_commands_run_through_the_package():
    out = subprocess.run([sys.executable, "-c", CODE.format(argv=["puzzles", "--trials", "0"])], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "imported: True True code: 2", out.stdout + out.stderr
    assert "--trials must be >= 1" in out.stderr


def test_version_names_the_installed_distribution():
    from importlib import metadata

    out = subprocess.run([sys.executable, "-c", CODE.format(argv=["--version"])], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines()[0] == f"tilegemm {metadata.version('tilegemm')}", out.stdout + out.stderr
