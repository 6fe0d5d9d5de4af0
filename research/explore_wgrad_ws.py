"""Exploration on the GPU: the warp-specialized weight gradient (research/wgrad_ws.py) against the shipped
``tma_wgrad`` and cuDNN (not a test).

First checks the kernel on odd geometries (groups, strides, dilation, channel counts off the tile, one image)
against the float32 weight gradient, twice each (the two results must be equal bit for bit: the split's
reduction has a fixed order). Then, for each layer of a conv2d sweep that ``tma_wgrad`` takes: cuDNN's weight
gradient, tilegemm's (``torch.ops.tilegemm.conv2d_wgrad``, the registered op that autograd calls: ``tma_wgrad``
on these layers) and the new kernel at several (pixels a step, input-channel tile, ring slots) configs, each
checked, timed as CUDA-graph replays (GPU time alone). fp16, channels-last.
Writes ``$OUT/wgrad-ws-<sweep>.json``; prints a table.

    PYTHONPATH=src:research python3 research/explore_wgrad_ws.py [--sweep resnet50]
"""

from __future__ import annotations

import argparse
import json
import os

CONFIGS = ((64, 128, 6), (128, 128, 3), (32, 128, 8), (64, 256, 4))
ODD = (  # N, C, H, W, K, R, S, stride, pad, dilation, groups
    (3, 24, 9, 11, 40, 3, 3, 1, 1, 1, 1),
    (2, 136, 14, 14, 200, 3, 3, 2, 1, 1, 1),
    (1, 64, 7, 7, 64, 3, 3, 1, 2, 2, 1),
    (4, 64, 10, 12, 96, 3, 1, 1, 1, 1, 2),
    (2, 32, 16, 16, 16, 5, 5, 1, 2, 1, 1),
    (5, 256, 7, 7, 512, 3, 3, 1, 1, 1, 1),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()

    import tilegemm  # noqa: F401
    import torch
    import triton.testing as tt
    import wgrad_ws
    from tilegemm.bench.base import bench_op
    from tilegemm.core.hardware import sm_count

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    sms = sm_count(torch.device("cuda"))
    out = dict(commit=os.environ.get("TILEGEMM_GIT_COMMIT"), gpu=torch.cuda.get_device_name(), checks=[], rows=[])

    def tensors(N, C, H, W, K, R, S, st, pad, dil, groups):
        g = wgrad_ws.geometry((N, C, H, W), (K, C // groups, R, S), [st, st], [pad] * 4, [dil, dil], groups)
        x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = torch.randn(K, C // groups, R, S, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        dy = torch.randn(N, K, g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        conv_args = ([st, st], [pad, pad], [dil, dil], False, [0, 0], groups)
        return g, x, w, dy, conv_args

    if not args.skip_checks:
        for dims in ODD:
            g, x, w, dy, conv_args = tensors(*dims)
            ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                      [False, True, False])[1]
            for pix, bn, stages in CONFIGS:
                for programs in (sms, 7, 1):
                    try:
                        one = wgrad_ws.run(dy, x, g, x.dtype, pix, bn, stages, programs)
                        two = wgrad_ws.run(dy, x, g, x.dtype, pix, bn, stages, programs)
                        torch.cuda.synchronize()
                        err = float((one.float() - ref).norm() / ref.norm())
                        same = bool(torch.equal(one, two))
                        res = dict(dims=dims, cfg=[pix, bn, stages, programs], rel_err=err, same=same)
                    except Exception as e:  # noqa: BLE001 - exploration: record and go on
                        res = dict(dims=dims, cfg=[pix, bn, stages, programs], error=str(e)[:300])
                    out["checks"].append(res)
                    if "error" in res or res["rel_err"] > 1e-2 or not res["same"]:
                        print("CHECK FAILED", res, flush=True)
        bad = sum(1 for c in out["checks"] if "error" in c or c["rel_err"] > 1e-2 or not c["same"])
        print(f"checks: {len(out['checks'])}, failed {bad}", flush=True)

    for case in bench_op("conv2d").cases(args.sweep):
        d = case.dims
        if d["R"] == 1 or d["groups"] != 1:
            continue
        g, x, w, dy, conv_args = tensors(d["N"], d["C"], d["H"], d["W"], d["K"], d["R"], d["S"], d["stride"],
                                         d["pad"], 1, 1)
        if wgrad_ws.unusable(dy, x, g):
            continue
        ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                                  [False, True, False])[1]
        row = dict(layer=case.label, dims=d)
        cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args, [False, True, False])[1]
        row["cudnn"] = dict(us=tt.do_bench_cudagraph(cudnn, rep=40) * 1e3)
        fn = lambda: torch.ops.tilegemm.conv2d_wgrad(dy, x, list(w.shape), list(g.stride), list(g.padding),
                                                     list(g.dilation), g.groups, "default")
        got = fn()
        row["shipped"] = dict(us=tt.do_bench_cudagraph(fn, rep=40) * 1e3,
                              rel_err=float((got.float() - ref).norm() / ref.norm()))
        for pix, bn, stages in CONFIGS:
            for programs in (sms, 2 * sms):
                key = f"ws{pix}x{bn}s{stages}p{programs}"
                fn = lambda: wgrad_ws.run(dy, x, g, x.dtype, pix, bn, stages, programs)
                try:
                    got = fn()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    row[key] = dict(error=str(e)[:200])
                    continue
                err = float((got.float() - ref).norm() / ref.norm())
                row[key] = dict(us=tt.do_bench_cudagraph(fn, rep=40) * 1e3, rel_err=err)
        out["rows"].append(row)
        best = min((v["us"], k) for k, v in row.items() if k.startswith("ws") and "us" in v and v["rel_err"] < 1e-2)
        print(f"{case.label:28s} cuDNN {row['cudnn']['us']:6.1f}  shipped {row['shipped']['us']:6.1f}  best "
              f"{best[0]:6.1f} {best[1]}  " + " ".join(f"{v['us']:.1f}" if "us" in v else "x"
                                                       for k, v in row.items() if k.startswith("ws")), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"wgrad-ws-{args.sweep}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
