"""Shared fixtures: the device kernels run on, NaN-poisoned outputs, and the error check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
