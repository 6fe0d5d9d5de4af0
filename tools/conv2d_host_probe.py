"""Host time per call of a replayed ``tilegemm.conv2d`` forward (run on the GPU machine):

    PYTHONPATH=src python tools/conv2d_host_probe.py [--calls 1000]

Two fp16 layers at batch 32: the 1x1 of an SE block on a 1x1 image (348 -> 3712 channels, bias) and a 3x3
64 -> 64 at 56x56 (channels-last, padding 1). Microseconds per call of:

- ``conv2d replay``: the public function under no_grad (the first call records, the timed ones replay);
- ``nn.Conv2d replay``: a ``tilegemm.nn.Conv2d`` with the same weights, called as a module;
- ``conv2d fresh``: the full Python path (checks, geometry, config, Triton's launch), the replay key forced off;
- ``forward_key``, ``new_output``, ``launch only``: the replay's three parts alone (the key, the output's
  allocation, the recorded launches with a preallocated output);
- ``F.conv2d``: cuDNN (``cudnn.benchmark`` on), as a user calls it;
- for the SE layer, ``matmul [N, C] @ [C, K]``: ``tilegemm.matmul`` on the layer as one GEMM over its pixels
  (what a channels-last 1x1 route runs), replayed.

``host`` is bench.runner.host_us_per_call (back-to-back calls, one sync: the host's time, or the GPU's where
that is longer); ``gpu`` is the call's GPU time from a CUDA graph of 20 calls. It prints how many launches the
kept replay makes, then a cProfile top 15 (by own time) of the replayed calls of each layer.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.bench.runner import graph_us_per_call as gpu_us, host_us_per_call
from tilegemm.core.launch import ReplaySequence
from tilegemm.core.replay import cache
from tilegemm.core.runtime import new_output
from tilegemm.ops.conv2d import api, checks

CL = torch.channels_last




class fresh_path:
    """Within it, conv2d calls take the full path every time (no replay key, nothing recorded)."""

    def __enter__(self):
        self.saved = api.forward_key
        api.forward_key = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        api.forward_key = self.saved


def layer(label, N, C, H, W, K, R, padding, bias, calls):
    torch.manual_seed(0)
    x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = (torch.randn(K, C, R, R, device="cuda") / (C * R * R) ** 0.5).half().contiguous(memory_format=CL)
    b = torch.randn(K, device="cuda", dtype=torch.float16) if bias else None
    module = tilegemm.nn.Conv2d(C, K, R, padding=padding, bias=bias).cuda().half().to(memory_format=CL)
    with torch.no_grad():
        module.weight.copy_(w)
        if bias:
            module.bias.copy_(b)
    tensors = (x, w) if b is None else (x, w, b)
    replays = cache("conv2d")
    replays.clear()
    ours = lambda: tilegemm.conv2d(x, w, b, 1, padding)  # noqa: E731
    with torch.no_grad():
        ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), 1, padding)
        out = ours()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        key = checks.forward_key(x, w, b, 1, padding, 1, 1, "none", None, "auto")
        hit = replays.get(key)
        launches = 0 if hit is None else len(hit.replays) if isinstance(hit, ReplaySequence) else 1
        print(f"\n== {label}: kept {hit is not None}, {launches} launch(es) a replay, rel err {err:.1e}")
        fns = {"conv2d replay": ours, "nn.Conv2d replay": lambda: module(x)}
        if hit is not None:
            shape, dtype, device, channels_last = hit.output
            fmt = CL if channels_last else None
            kept = new_output(shape, dtype, device, fmt)
            fns["forward_key"] = lambda: checks.forward_key(x, w, b, 1, padding, 1, 1, "none", None, "auto")
            fns["new_output"] = lambda: new_output(shape, dtype, device, fmt)
            fns["launch only"] = lambda: hit(*tensors, kept)
        fns["F.conv2d"] = lambda: F.conv2d(x, w, b, 1, padding)
        if R == 1 and H * W == 1:
            x2d, w2d = x.view(N, C), w.view(K, C)
            fns["matmul [N, C] @ [C, K]"] = lambda: tilegemm.matmul(x2d, w2d.t(), bias=b)
        print(f"{'':28s} {'host us':>9s} {'gpu us':>9s}")
        for name, fn in fns.items():
            print(f"{name:28s} {host_us_per_call(fn, calls):9.1f} {gpu_us(fn):9.1f}")
        with fresh_path():
            print(f"{'conv2d fresh':28s} {host_us_per_call(ours, calls):9.1f}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            ours()
        prof.disable()
        torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print("\n".join(s.getvalue().splitlines()[:32]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per timing and in the profile")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    layer("SE 1x1: n32 c348 1x1 -> 3712, bias", 32, 348, 1, 1, 3712, 1, 0, True, args.calls)
    layer("3x3: n32 c64 56x56 -> 64, channels-last", 32, 64, 56, 56, 64, 3, 1, False, args.calls)


if __name__ == "__main__":
    main()
