"""examples/resnet50.py --tiny: a small ResNet converted with tilegemm.nn.convert_, under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "resnet50.py")


def test_tiny_resnet_agrees_with_torch():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    env["TILEGEMM_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # the interpreter's torch calls are on tiny tensors: a thread pool only costs there
    done = subprocess.run([sys.executable, EXAMPLE, "--tiny"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    err = float(out.split("relative error ")[1].split()[0])
    assert err < 1e-2, out
    # gradients against the fp64 model's: tilegemm's and torch's own fp32 ones
    line = out.split("worst gradient relative error ")[1].splitlines()[0]  # "tilegemm A, cuDNN B; ..."
    ours, theirs = (float(line.split(f"{side} ")[1].split()[0].rstrip(",;")) for side in ("tilegemm", "cuDNN"))
    assert ours < 1e-2 and ours <= 2 * theirs + 1e-4, out


def test_tiny_refuses_batches_it_would_not_time():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGEMM_INTERPRET")}
    env["TILEGEMM_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, EXAMPLE, "--tiny", "--batches", "2"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 2 and "--tiny times nothing" in done.stderr, done.stderr[-2000:]
