"""The examples in the docs run: each page's ```python blocks, in order, as one script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(page: Path) -> str:
    return "\n\n".join(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))


@pytest.mark.parametrize(
    "page,expected",
    [
        ("docs/debugging.md", ["caught: load of", "add_bias_v2 is right on (10, 7)", "textbook tile kernel"]),
        ("README.md", []),
        ("docs/grouped.md", []),
    ],
)
def test_examples_run(page, expected, tmp_path):
    script = _script(ROOT / page)
    assert script.strip(), f"{page} has no python example"
    path = tmp_path / "example.py"  # @triton.jit needs its source in a file
    path.write_text(script)
    # A clean environment: the page itself must set whatever it needs (this process exported TRITON_INTERPRET).
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    if page in ("README.md", "docs/grouped.md") and not _gpu():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in expected:
        assert text in done.stdout, f"{text!r} not in the output of {page}:\n{done.stdout}"


def _gpu() -> bool:
    from tilegemm.core.runtime import interpreting

    return not interpreting()


def test_print_if_shows_only_the_chosen_program(tmp_path):
    script = _script(ROOT / "docs/debugging.md")
    path = tmp_path / "example.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=env).stdout
    assert out.count("mask") == 1, "print_if should print in exactly one program (pid 1, 1)"
