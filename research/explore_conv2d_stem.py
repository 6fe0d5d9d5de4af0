"""How fast do few-channel first layers (stems) run as window convolutions, and with which tile?

For each stem (fp16; ResNet-50's 7x7 stride 2 at batch 32 and 256, VGG's 3x3 stride 1, MobileNetV2's 3x3
stride 2 at batch 64) this times from CUDA graphs (GPU time alone): cuDNN channels-last and NCHW,
``tilegemm.conv2d`` (``auto``) on both, the pointer kernel ``implicit_gemm``, and the window route's parts: the
padded copy, the weight rearrangement and the TMA kernel over the window view with its shipped config and a
grid of tiles (64 / 128 pixels, ring slots 3-7, 4 or 8 warps). Every variant is checked against cuDNN in fp32
first; a wrong or failing one is recorded, never ranked. Writes ``--out``; prints a table.

    PYTHONPATH=src:research python3 research/explore_conv2d_stem.py --out stem.json
"""

from __future__ import annotations

import argparse
import json

LAYERS = {  # name: (N, C, H, W, K, R, S, stride, padding)
    "resnet50-b32": (32, 3, 224, 224, 64, 7, 7, 2, 3),
    "resnet50-b256": (256, 3, 224, 224, 64, 7, 7, 2, 3),
    "vgg-b32": (32, 3, 224, 224, 64, 3, 3, 1, 1),
    "mobilenetv2-b64": (64, 3, 224, 224, 32, 3, 3, 2, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()

    import tilegemm
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from tilegemm.core.hardware import machine_info, sm_count
    from tilegemm.core.launch import launch
    from tilegemm.ops.conv2d import tma_fwd
    from tilegemm.ops.conv2d.configs import _patch, tma_stem_config
    from tilegemm.ops.conv2d.implicit_gemm import allocate_out
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    sms = sm_count(torch.device("cuda"))
    results = []

    def graph_us(fn):
        return tt.do_bench_cudagraph(fn, rep=40) * 1e3

    for name in args.layers.split(","):
        N, C, H, W, K, R, S, s, pad = LAYERS[name]
        x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        xn = x.contiguous()
        w = (torch.randn(K, C, R, S, device="cuda") * 0.1).half()
        ref = F.conv2d(x.float(), w.float(), None, s, pad)
        g = geometry_of(x.shape, w.shape, [s, s], [pad] * 4, [1, 1], 1)
        row = dict(layer=name, dims=LAYERS[name], flops=g.flops(), variants={}, configs=[])

        def record(label, fn, check=True):
            try:
                if check:
                    out = fn()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-3:
                        row["variants"][label] = dict(error=f"rel err {err:.2e}")
                        return
                row["variants"][label] = dict(us=graph_us(fn))
            except Exception as e:  # noqa: BLE001 - exploration: record and go on
                row["variants"][label] = dict(error=str(e)[:200])

        record("cuDNN", lambda: F.conv2d(x, w, None, s, pad))
        record("cuDNN NCHW", lambda: F.conv2d(xn, w, None, s, pad))
        record("auto", lambda: tilegemm.conv2d(x, w, None, s, pad))
        record("auto NCHW", lambda: tilegemm.conv2d(xn, w, None, s, pad))
        record("implicit_gemm", lambda: tilegemm.conv2d(x, w, None, s, pad, kernel="implicit_gemm"))

        # the window route's parts
        xv, wv, xbuf, wbuf, gv = tma_fwd.stem_operands(x, w, g)
        record("copy input + weight", lambda: tma_fwd.stem_operands(x, w, g), check=False)
        record("copy NCHW input + weight", lambda: tma_fwd.stem_operands(xn, w, g), check=False)
        p = ConvProblem(xv, wv, None, gv, torch.float16, cl, "none", "ieee", False)
        shipped = tma_stem_config(gv, sms)
        row["shipped"] = shipped
        row["window"] = dict(C=gv.C, H=gv.H, W=gv.W, R=gv.R, stride=gv.stride, padding=gv.padding)
        grid = [shipped]
        for rows in (64, 128, 256):
            bi, bh, bw, _ = _patch(gv, rows)
            for stages in (3, 4, 5, 7):
                for warps in (4, 8):
                    if rows == 256 and warps == 4:
                        continue
                    grid.append(dict(BI=bi, BH=bh, BW=bw, BLOCK_N=min(128, max(16, K)), BLOCK_K=shipped["BLOCK_K"],
                                     STAGES=stages, num_warps=warps))
        for cfg in grid:
            def main_kernel(cfg=cfg):
                out = allocate_out(p)
                kernel, grd, a, kw = tma_fwd.launch_args(xv, wv, out, None, gv, "none", cfg)
                launch(kernel, grd, a, kw)
                return out

            label = "main " + " ".join(f"{k}={v}" for k, v in cfg.items())
            record(label, main_kernel)
            row["configs"].append(dict(config=cfg, **row["variants"].pop(label)))
        results.append(row)
        base = row["variants"]["cuDNN"].get("us")
        print(f"== {name}: window {row['window']}, shipped {shipped}")
        for label, v in row["variants"].items():
            print(f"  {label:24s} " + (f"{v['us']:8.1f} us {base / v['us']:5.2f}x" if "us" in v else v["error"]))
        ok = sorted((c for c in row["configs"] if "us" in c), key=lambda c: c["us"])
        for c in ok[:6]:
            print(f"  main {c['us']:8.1f} us  {c['config']}")
        for c in row["configs"]:
            if "error" in c:
                print(f"  FAILED {c['config']}: {c['error'][:100]}")
    with open(args.out, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
