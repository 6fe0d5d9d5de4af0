"""Where the host time of a replayed ``tilegemm.conv2d`` goes, and what the registered op adds (GPU machine).

A compiled model calls ``torch.ops.tilegemm.conv2d`` for every convolution; this times one small ResNet-50
layer (batch 1, so the GPU never holds the host back) per call, best of five runs of 2000 back-to-back calls:
``F.conv2d`` (cuDNN), the public function (a replay), the registered op through the dispatcher (what Inductor's
code calls), the op's Python function without the dispatcher, and the replay's parts.

    PYTHONPATH=src python3 research/profile_conv_host_call.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    import tilegemm
    from tilegemm.bench.runner import host_us_per_call
    from tilegemm.ops.conv2d import op as conv_op
    from tilegemm.ops.conv2d import replay

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    x = torch.randn(1, 64, 14, 14, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = torch.nn.Parameter(torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=cl))
    op_args = (x, w, None, [1, 1], [1, 1, 1, 1], [1, 1], 1, "none", "default", "auto")
    raw = conv_op._conv2d_op._init_fn  # the decorated Python function itself
    key = replay.replay_key("fwd", x, w, None, ([1, 1], [1, 1, 1, 1], [1, 1], 1), "none", "default", "auto", "op", None)

    def per_call(fn):
        return host_us_per_call(fn, calls=2000)

    with torch.no_grad():
        for f in (lambda: F.conv2d(x, w, padding=1), lambda: tilegemm.conv2d(x, w, padding=1),
                  lambda: torch.ops.tilegemm.conv2d.default(*op_args)):
            f()
        torch.cuda.synchronize()
        rows = {
            "F.conv2d (cuDNN)": per_call(lambda: F.conv2d(x, w, padding=1)),
            "tilegemm.conv2d (replay)": per_call(lambda: tilegemm.conv2d(x, w, padding=1)),
            "torch.ops.tilegemm.conv2d": per_call(lambda: torch.ops.tilegemm.conv2d.default(*op_args)),
            "the op's function, no dispatcher": per_call(lambda: raw(*op_args)),
            "replay_key (op's)": per_call(lambda: replay.replay_key(
                "fwd", x, w, None, ([1, 1], [1, 1], [1, 1], 1), "none", "default", "auto", "op", None)),
            "replayed (key made)": per_call(lambda: replay.replayed(key, (x, w))),
            "torch.empty_like": per_call(lambda: torch.empty_like(x)),
        }
    print(f"{torch.cuda.get_device_name()}, conv 1x64x14x14 3x3 fp16 channels-last, host us per call")
    for name, us in rows.items():
        print(f"{name:36s} {us:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), us=rows), f, indent=1)


if __name__ == "__main__":
    main()
