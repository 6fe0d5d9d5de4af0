"""Diagnosis (not a test): which of tilegemm's modules run under ``torch.compile(mode="reduce-overhead")``
(torch's CUDA graph trees), and what each failure names.

CUDA graph trees warm a function up and record it with every allocation of the thread routed into the
graphs' private memory pool, then check that every tensor still alive in that pool is one the graph returns.
Each case compiles one small module (fp16, on the GPU), runs it a few times and compares with the same
module eagerly; a failure prints the error, with the allocations' origins (history recording on).

    PYTHONPATH=src python3 research/diagnose_cudagraph_trees.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch

import tilegemm.nn


def cases():
    def conv(c, k, r, s, stride, n, hw):
        m = torch.nn.Conv2d(c, k, r, stride=stride, padding=r // 2, bias=False)
        x = torch.randn(n, c, hw, hw).contiguous(memory_format=torch.channels_last)
        return m, x

    yield "conv 3x3 64->64 @56", *conv(64, 64, 3, 3, 1, 8, 56)
    yield "conv 1x1 s2 256->512 @56 (subsampled)", *conv(256, 512, 1, 1, 2, 8, 56)
    yield "conv 1x1 2048->512 @7 (split-K)", *conv(2048, 512, 1, 1, 1, 32, 7)
    yield "conv 1x1 64->256 @56 (gluon_f16)", *conv(64, 256, 1, 1, 1, 32, 56)
    yield "depthwise 3x3 144 @56", torch.nn.Conv2d(144, 144, 3, padding=1, groups=144), \
        torch.randn(8, 144, 56, 56).contiguous(memory_format=torch.channels_last)
    yield "linear 4096->4096 (M=8)", torch.nn.Linear(4096, 4096), torch.randn(8, 4096)
    yield "linear 184x168x14400 (split-K)", torch.nn.Linear(14400, 168), torch.randn(184, 14400)
    yield "int4 linear 4096->4096 (M=1)", "int4", torch.randn(1, 4096)
    yield "int4 linear 4096->4096 (M=64)", "int4", torch.randn(64, 4096)


def build(module, x):
    x = x.to(device="cuda", dtype=torch.float16)
    if module == "int4":
        lin = torch.nn.Linear(4096, 4096, bias=False).to(device="cuda", dtype=torch.float16)
        ours = tilegemm.nn.Int4Linear.from_linear(lin)
        ref = torch.nn.Linear(4096, 4096, bias=False).to(device="cuda", dtype=torch.float16)
        with torch.no_grad():
            ref.weight.copy_(ours.dequantize())
        return ours, ref, x
    ref = module.to(device="cuda", dtype=torch.float16)
    if x.dim() == 4:
        ref = ref.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    import copy

    ours = tilegemm.nn.convert_(torch.nn.Sequential(copy.deepcopy(ref)))
    return ours, ref, x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch._inductor.config as ic

    ic.triton.cudagraph_trees_history_recording = True
    torch.manual_seed(0)
    rows = []
    for name, module, x in cases():
        row = dict(case=name)
        try:
            ours, ref, x = build(module, x)
            with torch.no_grad():
                want = ref(x).float()
                fn = torch.compile(ours, mode="reduce-overhead", dynamic=False)
                for _ in range(4):
                    torch.compiler.cudagraph_mark_step_begin()
                    out = fn(x).float()
                torch.cuda.synchronize()
            row["rel_err"] = ((out - want).norm() / want.norm()).item()
            row["ok"] = True
            print(f"{name:42s} ok, rel.err {row['rel_err']:.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - each failure is reported
            row["ok"] = False
            row["error"] = "".join(traceback.format_exception_only(exc))[:6000]
            print(f"{name:42s} FAILED: {row['error'][:2500]}", flush=True)
        rows.append(row)
        torch._dynamo.reset()
    with open(os.path.join(args.out, "cudagraph-trees.json"), "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
