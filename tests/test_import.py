"""Importing tilegemm does no GPU work, compiles nothing and imports no kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import tilegemm


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_is_lazy():
    out = _run(
        """
        import sys, torch
        import tilegemm
        tilegemm.kernels("matmul")
        kernel_modules = [m for m in sys.modules if m.startswith("tilegemm.matmul.") and m not in
                          ("tilegemm.matmul.op", "tilegemm.matmul.problem")]
        print(torch.cuda.is_initialized(), "triton" in sys.modules, kernel_modules)
        """
    )
    assert out == "False False []"


def test_backend_is_chosen_by_env():
    out = _run(
        """
        import os
        os.environ["TILEGEMM_INTERPRET"] = "1"
        import tilegemm, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(tilegemm.interpreting(), os.environ["TRITON_INTERPRET"], len(caught))
        """
    )
    assert out == "True 1 1"


def test_kernels_lists_the_ladder_in_order():
    listing = tilegemm.kernels("matmul")
    assert list(listing)[:3] == ["naive", "grouped", "autotuned"]
    assert "auto" in listing
    assert all(isinstance(text, str) and text for text in listing.values())
