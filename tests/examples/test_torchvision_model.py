"""examples/torchvision_model.py NAME --tiny: a small ResNeXt converted with tilegemm.nn.convert_, under the
interpreter; an unknown name is refused naming the choices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchvision_model.py")


def _run(*argv):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    env["TILEGEMM_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # the interpreter's torch calls are on tiny tensors: a thread pool only costs there
    return subprocess.run([sys.executable, EXAMPLE, *argv], capture_output=True, text=True, timeout=600, env=env)


def test_tiny_resnext_agrees_with_torch():
    done = _run("resnext50_32x4d", "--tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert float(out.split("relative error ")[1].split()[0]) < 1e-5, out
    line = out.split("worst gradient relative error ")[1].splitlines()[0]  # "tilegemm A, cuDNN B; ..."
    ours, theirs = (float(line.split(f"{side} ")[1].split()[0].rstrip(",;")) for side in ("tilegemm", "cuDNN"))
    assert ours < 1e-4 and ours <= 2 * theirs + 1e-4, out


def test_tiny_resnext_with_folded_batch_norms():
    done = _run("resnext50_32x4d", "--tiny", "--fold")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "batch norms folded" in out and int(out.split("fold_batchnorm: ")[1].split()[0]) > 0, out
    assert float(out.split("relative error ")[1].split()[0]) < 1e-5, out


def test_unknown_model_is_refused(monkeypatch, capsys):
    # in this process (the name is refused before any model is built or kernel run): a usage error, the message on
    # stderr and exit status 2, as the other examples' refusals
    from conftest import load_script

    example = load_script("examples", "torchvision_model.py")
    monkeypatch.setattr(sys, "argv", [EXAMPLE, "resnext50", "--tiny"])
    with pytest.raises(SystemExit) as done:
        example.main()
    message = capsys.readouterr().err
    assert done.value.code == 2
    assert "unknown torchvision classification model 'resnext50'; choose one of: alexnet" in message, message
