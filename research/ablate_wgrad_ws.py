"""Exploration on the GPU: where research/wgrad_ws.py's time goes (not a test). For a few ResNet-50 3x3 layers:
the kernel whole, without its TMA loads (the ring's barriers arrive at once, the MMAs read stale slots), and
without its MMAs; the shipped tma_wgrad; cuDNN; and a plain TN GEMM of the same M x N x K (the K out x 9C x
N*P*Q product with im2col'd input, by tilegemm.matmul). CUDA-graph replays, fp16. Prints a table.

    PYTHONPATH=src:research python3 research/ablate_wgrad_ws.py
"""
import json
import os

import tilegemm
import torch
import triton.testing as tt
import wgrad_ws
from tilegemm.ops.conv2d import tma_wgrad
from tilegemm.ops.conv2d.problem import geometry_of

torch.backends.cudnn.benchmark = True
cl = torch.channels_last
rows = []
for (N, C, H, K, st) in ((32, 512, 7, 512, 1), (32, 256, 14, 256, 1), (32, 128, 28, 128, 1), (32, 64, 56, 64, 1), (32, 512, 14, 512, 2), (32, 256, 28, 256, 2), (32, 128, 56, 128, 2)):
    g = geometry_of((N, C, H, H), (K, C, 3, 3), [st, st], [1] * 4, [1, 1], 1)
    x = torch.randn(N, C, H, H, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = torch.randn(K, C, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    dy = torch.randn(N, K, g.P, g.Q, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    conv_args = ([st, st], [1, 1], [1, 1], False, [0, 0], 1)
    row = dict(layer=f"{C}@{H}s{st}")
    row["cudnn"] = tt.do_bench_cudagraph(
        lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args, [False, True, False])[1], rep=40) * 1e3
    row["shipped"] = tt.do_bench_cudagraph(lambda: tma_wgrad.run(dy, x, g, x.dtype), rep=40) * 1e3
    ref = tma_wgrad.run(dy, x, g, x.dtype)
    got = tma_wgrad.run(dy, x, g, x.dtype, memory_format=torch.channels_last)
    row["shipped_cl_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
    row["shipped_cl"] = tt.do_bench_cudagraph(lambda: tma_wgrad.run(dy, x, g, x.dtype, memory_format=torch.channels_last), rep=40) * 1e3
    got = wgrad_ws.run(dy, x, g, x.dtype, 64, 128, 6, 132, memory_format=torch.channels_last)
    row["ws_cl_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
    for pix, bn, stages, programs, regs in ((64, 128, 6, 132, 232), (64, 64, 3, 264, 96), (64, 64, 4, 264, 96),
                                            (64, 128, 3, 264, 96), (128, 64, 2, 264, 96)):
        key = f"ws_cl{pix}x{bn}s{stages}p{programs}"
        extra = dict(CONSUMER_REGS=regs, maxnreg=80) if regs < 232 else {}  # two programs an SM
        fn = lambda: wgrad_ws.run(dy, x, g, x.dtype, pix, bn, stages, programs, memory_format=torch.channels_last,
                                  **extra)
        try:
            got = fn()
            torch.cuda.synchronize()
            row[key + "_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
            row[key] = tt.do_bench_cudagraph(fn, rep=40) * 1e3
        except Exception as e:  # noqa: BLE001 - exploration
            row[key] = str(e)[:80]
    for pix, bn, stages in ():
        for name, flags in (("noepi", dict(EPILOGUE=False)),):
            fn = lambda: wgrad_ws.run(dy, x, g, x.dtype, pix, bn, stages, 132, **flags)
            fn()
            row[f"{name}{pix}"] = tt.do_bench_cudagraph(fn, rep=40) * 1e3
    a = dy.permute(0, 2, 3, 1).reshape(-1, K).t()  # [K, NPQ], transposed view
    b = torch.randn(a.shape[1], 9 * C, device="cuda", dtype=torch.float16)
    tilegemm.matmul(a, b)
    row["gemm"] = tt.do_bench_cudagraph(lambda: tilegemm.matmul(a, b), rep=40) * 1e3
    row["cublas"] = tt.do_bench_cudagraph(lambda: torch.matmul(a, b), rep=40) * 1e3
    rows.append(row)
    print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "ablate-wgrad-ws.json"), "w") as f:
    json.dump(rows, f, indent=1)
