"""examples/tensor_parallel.py started without torchrun, or asked for NCCL where there is none: one line saying
how to run it, exit status 2, no traceback. (Its run on gloo ranks is tests/parallel/test_parallel_ranks.py's.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "tensor_parallel.py")
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(*args, **env):
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    base["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), base.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, SCRIPT, *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=300)


def _one_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  warnings.warn")]  # (the interpreter's warning, on machines without a GPU)
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    return lines[0]


def test_without_torchrun_says_how_to_run_it():
    line = _one_line(_run())
    assert "no torchrun environment" in line and "torchrun --standalone --nproc-per-node 2 " in line, line


def test_gpu_without_nccl_says_so():
    if torch.distributed.is_nccl_available() and torch.cuda.is_available():
        pytest.skip("this machine has NCCL and a GPU")
    line = _one_line(_run("--gpu", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511"))
    assert "--gpu needs NCCL and a CUDA GPU" in line and "examples/tensor_parallel.py --gpu" in line, line
