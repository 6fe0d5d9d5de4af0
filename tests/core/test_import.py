"""Importing tilegemm does no GPU work, compiles nothing and imports no kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
        kernel_modules = [m for m in sys.modules if m.startswith("tilegemm.ops.matmul.") and m.rsplit(".", 1)[1] not in
                          ("api", "checks", "configs", "dispatch", "survey", "op", "reference", "problem")]
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


def test_triton_imported_first_in_the_wrong_mode_gives_a_clear_error():
    out = _run(
        """
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["TILEGEMM_INTERPRET"] = "1"
        import triton.language  # imported for the GPU compiler, before tilegemm could choose
        import torch, tilegemm
        try:
            tilegemm.matmul(torch.randn(4, 4), torch.randn(4, 4))
        except RuntimeError as err:
            print("RuntimeError", "TILEGEMM_INTERPRET=1" in str(err))
        """
    )
    assert out == "RuntimeError True"


def test_torch_compile_after_tilegemm_still_interprets():
    # torch._dynamo imports triton; importing tilegemm first (CPU-only torch) has already chosen the interpreter.
    out = _run(
        """
        import os
        os.environ.pop("TRITON_INTERPRET", None); os.environ.pop("TILEGEMM_INTERPRET", None)
        import torch
        if torch.backends.cuda.is_built():
            print("skip")
        else:
            import tilegemm, torch._dynamo
            out = tilegemm.matmul(torch.ones(3, 5), torch.ones(5, 2))
            print(float(out.sum()))
        """
    )
    assert out in ("30.0", "skip")


def test_interpreter_warning_points_at_the_callers_line():
    import numpy

    if tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.4 (constraints.txt); this environment has "
                    f"{numpy.__version__}")
    out = _run(
        """
        import os, warnings
        os.environ["TILEGEMM_INTERPRET"] = "1"
        import torch, tilegemm
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tilegemm.matmul(torch.randn(2, 3), torch.randn(3, 4))
        found = [w for w in caught if w.category.__name__ == "InterpreterWarning"]
        print(len(found), os.path.basename(found[0].filename), found[0].lineno)
        """
    )
    count, filename, line = out.split()
    assert count == "1" and filename not in ("runtime.py", "api.py", "dispatch.py"), out
    assert int(line) == 7, f"the warning should name the line calling tilegemm.matmul: {out}"


def test_models_and_parallel_are_attributes_loaded_on_first_use():
    """The docs write tilegemm.models.from_pretrained after a bare `import tilegemm`."""
    out = _run(
        """
        import sys
        import tilegemm
        before = [m in sys.modules for m in ("tilegemm.models", "tilegemm.parallel", "transformers")]
        print(before, callable(tilegemm.models.from_pretrained), hasattr(tilegemm.parallel, "__name__"))
        """
    )
    assert out == "[False, False, False] True True"
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        tilegemm.nonesuch
