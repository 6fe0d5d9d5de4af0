"""Which kernel runs narrow 1x1 convolutions over many pixels best?

Most 1x1 layers over many pixels move bytes more than they compute: a GEMM with a small K or N over
10k-800k rows. For each stride-1 1x1 layer of ResNet-50 and MobileNetV2 (batch 64, fp16, channels-last) this times from CUDA graphs
(GPU time alone): cuDNN, ``tilegemm.conv2d`` with ``auto``, ``tma_implicit_gemm`` and ``gemm_1x1``, and
``tilegemm.matmul`` on the ``[N*H*W, C] x [C, K]`` view with ``auto`` and ``gluon_f16`` (tuned), and each
``gluon_f16`` config launched directly. Every variant is checked
against cuDNN in fp32 first; a wrong or refusing one is recorded, never ranked. Prints a table (time, ratio to
cuDNN, DRAM rate of input + output bytes); writes ``--out`` after every layer.

    PYTHONPATH=src:research python3 research/explore_pointwise_narrow.py --out pointwise.json
"""

from __future__ import annotations

import argparse
import json

def _layers():
    """name: (N, C, H, K) of every distinct stride-1 1x1 layer of ResNet-50 (batch 32) and MobileNetV2 (64)."""
    from tilegemm.ops.conv2d.bench import mobilenet_v2_layers, resnet50_layers

    out = {}
    for net, n, layers in (("resnet", 32, resnet50_layers()), ("mbv2", 64, mobilenet_v2_layers())):
        for C, H, K, R, s, groups in layers:
            if R == 1 and s == 1 and groups == 1:
                out[f"{net}-{C}->{K}@{H}"] = (n, C, H, K)
    return out


MATMUL_KERNELS = ("auto", "gluon_f16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="")
    args = ap.parse_args()
    LAYERS = _layers()

    import tilegemm
    import torch
    import torch.nn.functional as F
    from graph_timing import checked_graph_us, pointwise_case, print_variants
    from tilegemm.core.hardware import machine_info

    torch.backends.cudnn.benchmark = True
    results = []
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import launch
    from tilegemm.ops.matmul import gluon_f16
    from tilegemm.ops.matmul.problem import make_problems

    sms = sm_count(torch.device("cuda"))
    for name in (args.layers.split(",") if args.layers else LAYERS):
        N, C, H, K = LAYERS[name]
        x, w, ref, moved, x2d, w2d, ref2d = pointwise_case(N, C, H, K)
        row = dict(layer=name, dims=LAYERS[name], bytes=moved, variants={})

        timed = checked_graph_us

        row["variants"]["cuDNN"] = timed(lambda: F.conv2d(x, w), ref)
        for kernel in ("auto", "tma_implicit_gemm", "gemm_1x1"):
            row["variants"][f"conv2d {kernel}"] = timed(lambda k=kernel: tilegemm.conv2d(x, w, kernel=k), ref)
        for kernel in MATMUL_KERNELS:
            row["variants"][f"matmul {kernel}"] = timed(lambda k=kernel: tilegemm.matmul(x2d, w2d, kernel=k), ref2d)
        M = x2d.shape[0]
        for cfg in gluon_f16.configs():
            def gluon(cfg=cfg):
                out = torch.empty(M, K, device="cuda", dtype=torch.float16)
                p = make_problems(x2d, w2d, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
                launch(*gluon_f16.launch_args(p, cfg, sms))
                return out

            label = "gluon {BLOCK_M}x{BLOCK_N} s{STAGES}{o}".format(o=" shared" if cfg["SHARED_OUT"] else "", **cfg)
            row["variants"][label] = timed(gluon, ref2d)
        results.append(row)
        print(f"== {name} ({moved / 1e6:.1f} MB)")
        print_variants(row["variants"], moved, width=26)
        with open(args.out, "w") as f:
            json.dump(dict(machine=machine_info().to_dict(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
