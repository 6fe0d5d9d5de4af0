"""Exploration on the GPU: the TMA weight gradient's channel tiles per layer (not a test).

For each layer of a conv2d sweep that ``tma_wgrad`` takes: cuDNN's weight gradient and ``tma_wgrad.run`` with
[64 | 128] x [64 | 128] channel tiles (output x input channels), each with the pixel split its cost model
picks for that tile, checked against cuDNN's result in fp32 and timed as CUDA-graph replays (GPU time alone).
fp16, channels-last, cuDNN in benchmark mode. Writes ``$OUT/wgrad-tiles-<sweep>.json``; prints a table.

    PYTHONPATH=src python3 research/explore_wgrad_tiles.py [--sweep resnet50]
"""

from __future__ import annotations

import argparse
import json
import os

TILES = ((64, 64), (128, 64), (64, 128), (128, 128))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", default="resnet50")
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d import op, tma_wgrad
    from tilegemm.ops.conv2d.problem import geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    sms = sm_count(torch.device("cuda"))
    rows = []
    for case in bench_op("conv2d").cases(args.sweep):
        d = case.dims
        st, pad, groups = d["stride"], d["pad"], d["groups"]
        if d["R"] == 1 or groups != 1:
            continue
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"], d["R"], d["S"]), [st, st], [pad] * 4,
                        [1, 1], 1)
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = torch.randn(d["K"], d["C"], d["R"], d["S"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        dy = torch.randn(d["N"], d["K"], g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        if not op._tma_usable(x, None, g, dy):
            continue
        conv_args = ([st, st], [pad, pad], [1, 1], False, [0, 0], 1)
        ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                  [False, True, False])[1]
        row = dict(layer=case.label, dims=d)
        cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args, [False, True, False])[1]
        row["cudnn"] = dict(us=tt.do_bench_cudagraph(cudnn, rep=40) * 1e3)
        for bm, bn in TILES:
            cfg = tma_wgrad.config(g, sms, bm, bn)
            fn = lambda cfg=cfg: tma_wgrad.run(dy, x, g, x.dtype, cfg)
            try:
                got = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - exploration: record and go on
                row[f"{bm}x{bn}"] = dict(error=str(e)[:200])
                continue
            err = float((got.float() - ref).norm() / ref.norm())
            us = tt.do_bench_cudagraph(fn, rep=40) * 1e3
            row[f"{bm}x{bn}"] = dict(us=us, rel_err=err, split=cfg["SPLIT"])
        rows.append(row)
        print(f"{case.label:28s} cuDNN {row['cudnn']['us']:6.1f}  " + "  ".join(
            f"{k} {v['us']:6.1f} (s{v['split']})" + ("" if v["rel_err"] < 1e-2 else " ERR")
            if "us" in v else f"{k} failed" for k, v in row.items() if "x" in k and isinstance(v, dict)), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"wgrad-tiles-{args.sweep}.json"), "w") as f:
        json.dump(dict(commit=os.environ.get("TILEGEMM_GIT_COMMIT"), gpu=torch.cuda.get_device_name(), rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
