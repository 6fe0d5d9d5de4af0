"""The Python host path of a replayed ``tilegemm.conv2d`` call, on a CPU (no GPU needed):

    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/conv2d_host_cpu.py [--calls 20000] [--profile]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/conv2d_host_cpu.py --train [--calls 2000] [--profile]

A replay needs CUDA tensors, so here the CUDA-only tests of the key (``checks._replayable``: ``x.is_cuda``, not
the interpreter) are inverted (same cost), and the recorded launch is a no-op that stands in the replay cache
under the call's key: what is timed is everything above the launch (the key, its lookup, the output's
allocation), the part of a replayed call that the GPU host runs as Python. Layers (batch 32, fp16, with a bias):
the SE block's 1x1 on a one-pixel image (348 -> 3712), 888 -> 84 on one pixel, 48 -> 48 at 28x28 and 320 -> 320
at 14x14 channels-last. Prints microseconds per call of the public function, of ``tilegemm.nn.Conv2d``, of the
key alone and of the lookup with the allocation; ``--profile`` adds a cProfile of the public calls (by own time).

``--train``: a ``tilegemm.nn.Conv2d`` call under autograd, forward and backward, as an eager training step makes
it. The kernels' own routes (``dispatch.forward``, ``dgrad``, ``wgrad``) return the ops' fakes (outputs of the
right shape and layout) and every recorded replay is a no-op, so what is timed is the Python of the public call and
its checks, the registered op's autograd, the op body's key and replay, the backward's two keys and replays. Layer:
a grouped 3x3 (32 -> 32 channels, 8 groups) on a 4x4 image, batch 1, fp16 channels-last, no bias; beside torch's
own fp32 convolution on the CPU (which computes: not a host floor); docs/performance.md, "Host time of a training
step".
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


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _print_profile(prof, rows: int, lines: int) -> None:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(rows)
    print("\n".join(s.getvalue().splitlines()[:lines]))


def train(calls: int, profile: bool) -> None:
    """``--train``: a Conv2d's forward and backward under autograd, the kernels' routes stubbed by the ops' fakes."""
    from tilegemm.ops.conv2d import dispatch, op

    dispatch.forward = lambda c: op._conv2d_fake(*c.op_args())
    dispatch.dgrad = lambda c: op._dgrad_fake(*c.op_args())
    dispatch.wgrad = lambda c: op._wgrad_fake(*c.op_args())

    def store(key, launches, tensors, out, memory_format=torch.contiguous_format):
        REPLAYS.entries[key] = NoLaunch(out, memory_format == CL)

    REPLAYS.store = store
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

    print(f"torch {torch.__version__}, CPU host, launches stubbed; us a call (best of 9 x {calls})")
    print(f"tilegemm.nn.Conv2d: forward {per_call_us(lambda: conv(x), calls, 9):.1f}, "
          f"forward+backward {per_call_us(step, calls, 9):.1f}")
    print(f"torch fp32 (computes): forward {per_call_us(lambda: ref(xr), calls, 9):.1f}, "
          f"forward+backward {per_call_us(lambda: ref(xr).backward(gr), calls, 9):.1f}")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            step()
        prof.disable()
        _print_profile(prof, 30, 45)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=None, help="calls a round (20000; --train: 2000)")
    parser.add_argument("--profile", action="store_true", help="a cProfile of the public calls")
    parser.add_argument("--train", action="store_true", help="a Conv2d's forward and backward under autograd")
    args = parser.parse_args()
    checks._replayable = _cpu_replayable()
    if args.train:
        return train(args.calls or 2000, args.profile)
    args.calls = args.calls or 20000
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
        print(f"\n== {label}")
        _print_profile(prof, 25, 40)


if __name__ == "__main__":
    main()
