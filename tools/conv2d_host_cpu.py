"""The Python host path of a replayed ``tilegemm.conv2d`` call, on a CPU (no GPU needed):

    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/conv2d_host_cpu.py [--calls 20000] [--profile]

A replay needs CUDA tensors, so here the CUDA-only tests of the key (``checks._replayable``: ``x.is_cuda``, not
the interpreter) are inverted (same cost), and the recorded launch is a no-op that stands in the replay cache
under the call's key: what is timed is everything above the launch (the key, its lookup, the output's
allocation), the part of a replayed call that the GPU host runs as Python. Layers (batch 32, fp16, with a bias):
the SE block's 1x1 on a one-pixel image (348 -> 3712), 888 -> 84 on one pixel, 48 -> 48 at 28x28 and 320 -> 320
at 14x14 channels-last. Prints microseconds per call of the public function, of ``tilegemm.nn.Conv2d``, of the
key alone and of the lookup with the allocation; ``--profile`` adds a cProfile of the public calls (by own time).
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
from tilegemm.ops.conv2d import checks  # noqa: E402
from tilegemm.ops.conv2d.op import REPLAYS  # noqa: E402

CL = torch.channels_last

LAYERS = [  # (label, N, C, H, K, channels-last)
    ("SE 348->3712 1x1", 32, 348, 1, 3712, False),
    ("888->84 1x1", 32, 888, 1, 84, False),
    ("48->48 28x28 cl", 32, 48, 28, 48, True),
    ("320->320 14x14 cl", 32, 320, 14, 320, True),
]


def _cpu_replayable():
    """checks._replayable with its CUDA-only tests inverted (the same work a call, passing on the CPU)."""
    src = textwrap.dedent(inspect.getsource(checks._replayable))
    src = src.replace("or not x.is_cuda:", "or x.is_cuda:").replace("if (interpreting() or", "if (not interpreting() or")
    if src.count("x.is_cuda:") != 1 or "not interpreting()" not in src:
        raise RuntimeError("checks._replayable changed: update this tool's inversion of its CUDA tests")
    scope = dict(vars(checks))
    first = inspect.getsourcelines(checks._replayable)[1]
    exec(compile("\n" * (first - 1) + src, checks.__file__, "exec"), scope)  # (the profile shows its own lines)
    return scope["_replayable"]


class NoLaunch:
    """A recorded replay whose launch does nothing (its output: what the real one would allocate)."""

    def __init__(self, out: torch.Tensor, channels_last: bool):
        self.output = (tuple(out.shape), out.dtype, out.device, channels_last)

    def __call__(self, *tensors) -> bool:
        return True


def per_call_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true", help="a cProfile of the public calls")
    args = parser.parse_args()
    checks._replayable = _cpu_replayable()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU host, launch a no-op; us per call (best of 5 x {args.calls})")
    print(f"{'layer':22s} {'conv2d':>8s} {'module':>8s} {'key':>8s} {'lookup+alloc':>13s}")
    profiles = []
    with torch.no_grad():
        for label, N, C, H, K, cl in LAYERS:
            x = torch.randn(N, C, H, H, dtype=torch.float16)
            if cl:
                x = x.contiguous(memory_format=CL)
            module = tilegemm.nn.Conv2d(C, K, 1).half()
            w, b = module.weight, module.bias
            key = checks.forward_key(x, w, b, 1, 0, 1, 1, "none", None, "auto")
            mkey = checks.forward_key(x, w, b, module.stride, module.padding, module.dilation, module.groups,
                                      "none", None, "auto")
            if key is None or mkey is None:
                raise RuntimeError("no replay key: the inverted tests did not take")
            out = torch.empty(N, K, H, H, dtype=torch.float16, memory_format=CL if cl else torch.contiguous_format)
            REPLAYS.entries[key] = NoLaunch(out, cl and H > 1)
            REPLAYS.entries[mkey] = NoLaunch(out, cl and H > 1)
            tensors = (x, w, b)

            def call():
                return tilegemm.conv2d(x, w, b)

            if call().shape != out.shape or module(x).shape != out.shape:
                raise RuntimeError("the fake replay was not taken")
            row = [per_call_us(call, args.calls), per_call_us(lambda: module(x), args.calls),
                   per_call_us(lambda: checks.forward_key(x, w, b, 1, 0, 1, 1, "none", None, "auto"), args.calls),
                   per_call_us(lambda: REPLAYS.replayed(key, tensors), args.calls)]
            print(f"{label:22s} {row[0]:8.2f} {row[1]:8.2f} {row[2]:8.2f} {row[3]:13.2f}")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    call()
                prof.disable()
                profiles.append((label, prof))
    for label, prof in profiles:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(f"\n== {label}")
        print("\n".join(s.getvalue().splitlines()[:40]))


if __name__ == "__main__":
    main()
