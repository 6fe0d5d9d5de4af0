"""The Python host path of a ``tilegemm.nn.Conv2d`` call under autograd (forward and backward), on a CPU:

    PYTHONPATH=src python3 tools/conv2d_train_host_cpu.py [--calls 2000] [--profile]

As ``tools/conv2d_host_cpu.py``: the CUDA-only tests of the replay keys (``checks._replayable``) are inverted, and
every recorded replay is a no-op standing under the call's key; the kernels' own routes (``dispatch.forward``,
``dgrad``, ``wgrad``) return the ops' fakes (outputs of the right shape and layout). So what is timed is the Python
of an eager training step's convolution: the public call and its checks, the registered op's autograd, the op
body's key and replay, the backward's two keys and replays. Layer: a grouped 3x3 (32 -> 32 channels, 8 groups) on a
4x4 image, batch 1, fp16 channels-last, no bias. Prints microseconds a forward and a forward with backward (best
of 9 rounds), beside torch's own fp32 convolution on the CPU (which computes: not a host floor); ``--profile``
adds a cProfile of the steps (docs/performance.md, "Host time of a training step").
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import pstats
import textwrap
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import tilegemm  # noqa: E402
from tilegemm.ops.conv2d import checks, dispatch, op  # noqa: E402
from tilegemm.ops.conv2d.op import REPLAYS  # noqa: E402

CL = torch.channels_last


def _cpu_replayable():
    """checks._replayable with its CUDA-only tests inverted (the same work a call, passing on the CPU)."""
    src = textwrap.dedent(inspect.getsource(checks._replayable))
    src = src.replace("or not x.is_cuda:", "or x.is_cuda:").replace("if (interpreting() or", "if (not interpreting() or")
    if src.count("x.is_cuda:") != 1 or "not interpreting()" not in src:
        raise RuntimeError("checks._replayable changed: update this tool's inversion of its CUDA tests")
    scope = dict(vars(checks))
    first = inspect.getsourcelines(checks._replayable)[1]
    exec(compile("\n" * (first - 1) + src, checks.__file__, "exec"), scope)
    return scope["_replayable"]


class NoLaunch:
    """A recorded replay whose launch does nothing (its output: what the real one would allocate)."""

    def __init__(self, out: torch.Tensor, channels_last: bool):
        self.output = (tuple(out.shape), out.dtype, out.device, channels_last)

    def __call__(self, *tensors) -> bool:
        return True


def stub() -> None:
    checks._replayable = _cpu_replayable()
    dispatch.forward = lambda c: op._conv2d_fake(*c.op_args())
    dispatch.dgrad = lambda c: op._dgrad_fake(*c.op_args())
    dispatch.wgrad = lambda c: op._wgrad_fake(*c.op_args())

    def store(key, launches, tensors, out, memory_format=torch.contiguous_format):
        REPLAYS.entries[key] = NoLaunch(out, memory_format == CL)

    REPLAYS.store = store


def best_us(fn, calls: int, rounds: int = 9) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    stub()
    torch.manual_seed(0)
    N, C, H, K, G = 1, 32, 4, 32, 8
    conv = tilegemm.nn.Conv2d.from_conv(torch.nn.Conv2d(C, K, 3, padding=1, groups=G, bias=False).half())
    x = torch.randn(N, C, H, H, dtype=torch.float16).contiguous(memory_format=CL).requires_grad_(True)
    gy = torch.randn(N, K, H, H, dtype=torch.float16).contiguous(memory_format=CL)
    ref = torch.nn.Conv2d(C, K, 3, padding=1, groups=G, bias=False)
    xr = torch.randn(N, C, H, H).contiguous(memory_format=CL).requires_grad_(True)
    gr = torch.randn(N, K, H, H).contiguous(memory_format=CL)

    def step():
        conv(x).backward(gy)

    print(f"torch {torch.__version__}, CPU host, launches stubbed; us a call (best of 9 x {args.calls})")
    print(f"tilegemm.nn.Conv2d: forward {best_us(lambda: conv(x), args.calls):.1f}, "
          f"forward+backward {best_us(step, args.calls):.1f}")
    print(f"torch fp32 (computes): forward {best_us(lambda: ref(xr), args.calls):.1f}, "
          f"forward+backward {best_us(lambda: ref(xr).backward(gr), args.calls):.1f}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            step()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print("\n".join(s.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
