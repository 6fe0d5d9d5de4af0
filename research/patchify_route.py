"""Open question: which convolutions that tile the image (stride = filter, no padding: patch embeddings and
ConvNeXt's 2x2 downsampling layers) should take their gradients as one GEMM over the patches
(``ops/conv2d/patchify.py``)? ``auto`` takes it for stems of at most ``PATCHIFY_MAX_CHANNELS`` channels.

For every such zoo layer (batch 32, fp16, channels-last), the data and the weight gradient of: cuDNN
(aten.convolution_backward, one gradient, cudnn.benchmark), ``off`` (the route before: no layer on the GEMM
route), ``gemm`` (every such layer on it), each checked against cuDNN's fp32 gradient, then timed as CUDA-graph
replays (triton.testing.do_bench_cudagraph); ratio = cuDNN time / time. GPU only.

    PYTHONPATH=src python3 research/patchify_route.py --out $OUT/patchify-route.json [--from-channels 4]
        [--order smallest]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def layers() -> list[dict]:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "src", "tilegemm", "ops", "conv2d", "zoo.json")) as f:
        zoo = json.load(f)["layers"]
    return [d for d in zoo if d["R"] * d["S"] > 1 and d["stride"] == [d["R"], d["S"]] and d["padding"] == [0, 0]
            and d["groups"] == 1 and d["dilation"] == [1, 1]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--from-channels", type=int, default=0, help="only layers of at least this many input channels")
    ap.add_argument("--order", default="zoo", choices=["zoo", "smallest"], help="smallest: the fewest pixels first")
    args = ap.parse_args()

    import tilegemm  # noqa: F401 - settles the backend first
    import torch
    import triton.testing
    from tilegemm.ops.conv2d import dispatch, patchify
    from tilegemm.ops.conv2d.problem import DgradCall, WgradCall

    torch.backends.cudnn.benchmark = True
    rows = []
    chosen = [d for d in layers() if d["C"] >= args.from_channels]
    if args.order == "smallest":
        chosen.sort(key=lambda d: d["C"] * d["H"] * d["W"])
    for d in chosen:
        N, C, H, W, K, R, S = 32, d["C"], d["H"], d["W"], d["K"], d["R"], d["S"]
        x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(K, C, R, S, device="cuda") / (C * R * S) ** 0.5).half().contiguous(
            memory_format=torch.channels_last)
        P, Q = H // R, W // S
        dy = torch.randn(N, K, P, Q, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        conv = dict(stride=[R, S], padding=[0, 0, 0, 0], dilation=[1, 1], groups=1, precision="ieee")
        ref_dx, ref_dw, _ = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, [R, S], [0, 0],
                                                                [1, 1], False, [0, 0], 1, [True, True, False])
        label = f"{C}x{K}@{H}/{R}"
        for grad, ref in (("dgrad", ref_dx), ("wgrad", ref_dw)):
            mask = [grad == "dgrad", grad == "wgrad", False]
            calls = {"cudnn": lambda mask=mask: torch.ops.aten.convolution_backward(
                dy, x, w, None, [R, S], [0, 0], [1, 1], False, [0, 0], 1, mask)[0 if mask[0] else 1]}
            for name, limit in (("off", 0), ("gemm", 1 << 30)):
                def run(limit=limit, grad=grad):
                    patchify.PATCHIFY_MAX_CHANNELS = limit
                    if grad == "dgrad":
                        return dispatch.dgrad(DgradCall(dy=dy, weight=w, x_shape=[N, C, H, W], x_channels_last=True,
                                                        **conv))
                    return dispatch.wgrad(WgradCall(dy=dy, x=x, w_shape=[K, C, R, S], **conv))
                calls[name] = run
            times = {}
            for name, fn in calls.items():
                try:
                    out = fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 4e-3:
                        rows.append(dict(layer=label, grad=grad, call=name, error=f"relative error {err:.2e}"))
                        continue
                    times[name] = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001 - recorded
                    rows.append(dict(layer=label, grad=grad, call=name, error=f"{type(e).__name__}: {str(e)[:160]}"))
            for name, us in times.items():
                if "cudnn" in times:
                    rows.append(dict(layer=label, grad=grad, call=name, us=us, ratio=times["cudnn"] / us))
            print(f"{label:>16} {grad}: " + "  ".join(f"{n} {times['cudnn'] / t:.2f}x" for n, t in times.items()
                                                     if "cudnn" in times and n != "cudnn"), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)
    for grad in ("dgrad", "wgrad"):
        for name in ("off", "gemm"):
            for kind, test in (("stems", lambda lab: lab.startswith("3x")), ("others", lambda lab: not lab.startswith("3x"))):
                v = [r["ratio"] for r in rows if r.get("grad") == grad and r.get("call") == name and "ratio" in r
                     and test(r["layer"])]
                if v:
                    print(f"{grad} {name:>4} {kind}: geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f}x, "
                          f"worst {min(v):.3f}x ({len(v)})")
    print("errors:", [r for r in rows if "error" in r][:4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
