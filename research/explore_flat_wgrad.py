"""Exploration on the GPU: the few-channel (``FLAT``) weight gradient's K step and warps (not a test).

The pointer kernel's FLAT weight gradient (columns = (r, s, c), for fewer than 16 channels a group) on a few
stems and few-channel layers: the shipped config (64-deep K steps, 8 warps) against 32-deep steps on 4 and 8
warps, each checked against cuDNN's weight gradient in fp32 and timed as CUDA-graph replays, fp16,
channels-last. Prints a table; writes ``$OUT/flat-wgrad.json``.

    PYTHONPATH=src python3 research/explore_flat_wgrad.py
"""
import json
import os

import torch
import triton.testing as tt

import tilegemm  # noqa: F401  (the backend choice before triton)
from tilegemm.core.hardware import sm_count
from tilegemm.ops.conv2d import configs, implicit_gemm
from tilegemm.ops.conv2d.problem import geometry_of

LAYERS = (  # N, C, H, K, R, stride, pad
    (32, 3, 224, 64, 7, 2, 3),  # ResNet-50's stem
    (64, 3, 224, 32, 3, 2, 1),  # MobileNetV2's stem
    (32, 4, 112, 32, 5, 1, 2),
    (32, 8, 56, 64, 3, 1, 1),
    (16, 3, 512, 16, 3, 1, 1),
)
VARIANTS = (("shipped", {}), ("bk32-w4", dict(BLOCK_K=32, num_warps=4)), ("bk32-w8", dict(BLOCK_K=32, num_warps=8)),
            ("bk64-w4", dict(BLOCK_K=64, num_warps=4)))
torch.backends.cudnn.benchmark = True
cl = torch.channels_last
rows = []
for N, C, H, K, R, st, pad in LAYERS:
    g = geometry_of((N, C, H, H), (K, C, R, R), [st, st], [pad] * 4, [1, 1], 1)
    x = torch.randn(N, C, H, H, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = torch.randn(K, C, R, R, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    dy = torch.randn(N, K, g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    conv_args = ([st, st], [pad, pad], [1, 1], False, [0, 0], 1)
    ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *conv_args,
                                              [False, True, False])[1]
    shipped = configs.wgrad_config(g, torch.float16, sm_count(x.device))
    row = dict(layer=f"n{N}c{C}h{H}k{K}r{R}/{st}", shipped=shipped, cudnn_us=tt.do_bench_cudagraph(
        lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args, [False, True, False]), rep=30) * 1e3)
    for name, change in VARIANTS:
        cfg = dict(shipped, **change)
        fn = lambda cfg=cfg: implicit_gemm.wgrad(dy, x, g, "ieee", False, torch.float16, cfg)
        out = fn()
        row[name] = dict(err=float((out.float() - ref).norm() / ref.norm()), us=tt.do_bench_cudagraph(fn, rep=30) * 1e3)
    rows.append(row)
    print(row["layer"], f"cuDNN {row['cudnn_us']:.1f}", " ".join(f"{n} {row[n]['us']:.1f}" + ("" if row[n]["err"] < 4e-3 else "ERR")
                                                              for n, _ in VARIANTS), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "flat-wgrad.json"), "w") as f:
    json.dump(rows, f, indent=1)
