"""Importing tilegemm does no GPU work, compiles nothing and imports no kernel."""

from __future__ import annotations

import textwrap

import pytest

import tilegemm
from fresh_kit import run_fresh

# What each test runs in a fresh process (by the test's name): all of them by the fixture below, once.
SCRIPTS = {name: textwrap.dedent(code) for name, code in {
    "lazy": """
        import sys, torch
        import tilegemm
        tilegemm.kernels("matmul")
        kernel_modules = [m for m in sys.modules if m.startswith("tilegemm.ops.matmul.") and m.rsplit(".", 1)[1] not in
                          ("api", "checks", "configs", "dispatch", "survey", "op", "reference", "problem")]
        print(torch.cuda.is_initialized(), "triton" in sys.modules, kernel_modules)
        """,
    "env": """
        import os
        os.environ["TILEGEMM_INTERPRET"] = "1"
        import tilegemm, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(tilegemm.interpreting(), os.environ["TRITON_INTERPRET"], len(caught))
        """,
    "triton_first": """
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["TILEGEMM_INTERPRET"] = "1"
        import triton.language  # imported for the GPU compiler, before tilegemm could choose
        import torch, tilegemm
        try:
            tilegemm.matmul(torch.randn(4, 4), torch.randn(4, 4))
        except RuntimeError as err:
            print("RuntimeError", "TILEGEMM_INTERPRET=1" in str(err))
        """,
    # torch._dynamo imports triton; importing tilegemm first (CPU-only torch) has already chosen the interpreter.
    "compile_after": """
        import os
        os.environ.pop("TRITON_INTERPRET", None); os.environ.pop("TILEGEMM_INTERPRET", None)
        import torch
        if torch.backends.cuda.is_built():
            print("skip")
        else:
            import tilegemm, torch._dynamo
            out = tilegemm.matmul(torch.ones(3, 5), torch.ones(5, 2))
            print(float(out.sum()))
        """,
    "warning_line": """
        import os, warnings
        os.environ["TILEGEMM_INTERPRET"] = "1"
        import torch, tilegemm
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tilegemm.matmul(torch.randn(2, 3), torch.randn(3, 4))
        found = [w for w in caught if w.category.__name__ == "InterpreterWarning"]
        print(len(found), os.path.basename(found[0].filename), found[0].lineno)
        """,
    "attributes": """
        import sys
        import tilegemm
        before = [m in sys.modules for m in ("tilegemm.models", "tilegemm.parallel", "transformers")]
        print(before, callable(tilegemm.models.from_pretrained), hasattr(tilegemm.parallel, "__name__"))
        """,
    "short_names": """
        import tilegemm.w4a16, tilegemm.debug, tilegemm.puzzles
        from tilegemm.w4a16 import quantize
        from tilegemm.debug import bounds_checked
        import tilegemm.ops.w4a16, tilegemm.learn.debug, tilegemm.learn.puzzles
        print(tilegemm.w4a16 is tilegemm.ops.w4a16, quantize is tilegemm.ops.w4a16.quantize,
              tilegemm.debug is tilegemm.learn.debug, bounds_checked is tilegemm.learn.debug.bounds_checked,
              tilegemm.puzzles is tilegemm.learn.puzzles)
        """,
}.items()}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    return run_fresh(SCRIPTS, tmp_path_factory.mktemp("import"), timeout=300)


def _run(fresh, name: str) -> str:
    returncode, stdout, stderr = fresh[name]
    assert returncode == 0, stderr
    return stdout.strip()


def test_import_is_lazy(fresh):
    assert _run(fresh, "lazy") == "False False []"


def test_backend_is_chosen_by_env(fresh):
    assert _run(fresh, "env") == "True 1 1"


def test_kernels_lists_the_ladder_in_order():
    listing = tilegemm.kernels("matmul")
    assert list(listing)[:3] == ["naive", "grouped", "autotuned"]
    assert "auto" in listing
    assert all(isinstance(text, str) and text for text in listing.values())


def test_triton_imported_first_in_the_wrong_mode_gives_a_clear_error(fresh):
    assert _run(fresh, "triton_first") == "RuntimeError True"


def test_torch_compile_after_tilegemm_still_interprets(fresh):
    assert _run(fresh, "compile_after") in ("30.0", "skip")


def test_interpreter_warning_points_at_the_callers_line(fresh):
    import numpy

    if tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.4 (constraints.txt); this environment has "
                    f"{numpy.__version__}")
    out = _run(fresh, "warning_line")
    count, filename, line = out.split()
    assert count == "1" and filename not in ("runtime.py", "api.py", "dispatch.py"), out
    assert int(line) == 7, f"the warning should name the line calling tilegemm.matmul: {out}"


def test_models_and_parallel_are_attributes_loaded_on_first_use(fresh):
    """The docs write tilegemm.models.from_pretrained after a bare `import tilegemm`."""
    assert _run(fresh, "attributes") == "[False, False, False] True True"
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        tilegemm.nonesuch


def test_the_short_names_import_as_modules(fresh):
    """The README names tilegemm.w4a16, tilegemm.debug and tilegemm.puzzles: `import` and `from ... import` them."""
    assert _run(fresh, "short_names") == "True True True True True"
