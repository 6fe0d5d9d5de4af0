"""examples/resnet50.py --tiny: a small ResNet converted with tilegemm.nn.convert_, under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "resnet50.py")


def test_tiny_resnet_agrees_with_torch():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    env["TILEGEMM_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, EXAMPLE, "--tiny"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    err = float(out.split("relative error ")[1].split()[0])
    assert err < 1e-2, out
    grad = float(out.split("worst gradient relative error ")[1].split()[0])
    assert grad < 1e-2, out
