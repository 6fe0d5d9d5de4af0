"""Shared fixtures: the device kernels run on, NaN-poisoned outputs, and the error check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tilegemm.runtime import interpreting, set_poisoning


@pytest.fixture(scope="session")
def device() -> str:
    return "cpu" if interpreting() else "cuda"


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every kernel output starts as NaN, so an element a kernel forgets to write fails the check."""
    old = set_poisoning(True)
    yield
    set_poisoning(old)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    from tilegemm.checks import relative_error

    return relative_error(out, ref)


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), "output has NaN: some element was never written"
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def pytest_collection_modifyitems(config, items):
    if not interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def compile_offline(tmp_path, source: str, argument, timeout: int = 600):
    """Run ``source`` (a script that compiles kernels for a GPU given by hand, e.g. sm_90) with the compiler
    instead of the interpreter, passing ``argument`` as JSON; returns the JSON its last stdout line holds.
    No GPU is needed: Triton ships ptxas. A fresh Triton cache under ``tmp_path`` keeps runs apart."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TILEGEMM_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    script = tmp_path / "compile.py"
    script.write_text(source)
    run = subprocess.run([sys.executable, str(script), json.dumps(argument)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# Prepended to a compile_offline script that compiles a Gluon kernel for sm_90: defines compile_sm90.
GLUON_SM90 = textwrap.dedent(
    """
    import os, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource


    def compile_sm90(kernel, sig, constexprs, attrs, num_warps):
        \"\"\"(compiled kernel, its PTX, what ``ptxas -v`` says about it) for sm_90; no GPU needed.\"\"\"
        compiled = triton.compile(GluonASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps))
        ptx = compiled.asm["ptx"]
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                                  capture_output=True, text=True).stderr
        return compiled, ptx, info
    """
)
