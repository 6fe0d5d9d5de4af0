"""The sm_90 SASS of a ``frag_wgmma`` launch, compiled without a GPU: instruction counts of its K-step loop.

    TRITON_INTERPRET=0 TILEGEMM_INTERPRET=0 PYTHONPATH=src python research/sass_w4a16.py --M 1 --N 8192 --K 8192 \
        [--set GSCALE=1] [--dump out.sass]

The launch is built by the kernel's own host code (``frag_wgmma.launch_args``) over CPU tensors, compiled
through Triton's pipeline for sm_90 (ptxas included), and disassembled with the nvdisasm Triton ships. The
loop is the longest backward branch's body; its instructions are counted by opcode and per weight.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch

import tilegemm  # noqa: F401  (the runtime choice before triton)
from tilegemm.ops.w4a16 import format as fmt
from tilegemm.ops.w4a16 import frag_wgmma
from tilegemm.ops.w4a16.configs import frag_wgmma_config


def compile_launch(kernel, args, kwargs):
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=dict(options.__dict__))


def sass_of(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_body(sass: str) -> list[str]:
    """Instructions of the longest loop (a branch back to an earlier label)."""
    lines = [l for l in sass.splitlines()]
    labels, instrs = {}, []
    for l in lines:
        m = re.match(r"\s*\.(L_x_\d+):", l)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", l)
        if m:
            instrs.append(m.group(1))
    best = (0, 0)
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+(?:\S+\s+)?`?\(?\.(L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            if i - labels[m.group(1)] > best[1] - best[0]:
                best = (labels[m.group(1)], i + 1)
    return instrs[best[0]:best[1]]


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    return ins.split()[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, default=1)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--K", type=int, default=8192)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--set", action="append", default=[], help="NAME=INT: a config value")
    ap.add_argument("--dump")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    w = fmt.quantize(torch.randn(a.N, a.K, dtype=dt), group_size=a.group)
    fw, fzs = w.fragments()
    x = torch.empty(a.M, a.K, dtype=dt)
    out = torch.empty(a.M, a.N, dtype=dt)
    cfg = frag_wgmma_config(a.M, a.N, a.K, torch.device("cpu"))
    for s in a.set:
        k, v = s.split("=")
        cfg[k] = int(v)
    kernel, grid, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, a.N, a.K, a.group, "none", cfg)
    compiled = compile_launch(kernel, args, kwargs)
    sass = sass_of(compiled.asm["cubin"])
    if a.dump:
        open(a.dump, "w").write(sass)
    body = loop_body(sass)
    hist = collections.Counter(opcode(i) for i in body)
    per_step = 64 * kwargs.get("KH", 1) * 16 * kwargs["RH"] * kwargs["num_warps"]  # weights a program dequantizes per K step
    threads = 32 * kwargs["num_warps"]
    print(f"config {cfg} grid {grid} shared {compiled.metadata.shared}")
    print(f"loop: {len(body)} instructions a thread a step, {len(body) * threads / per_step:.2f} per weight")
    print(", ".join(f"{k} {v}" for k, v in hist.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
