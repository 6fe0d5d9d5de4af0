"""Fingerprints of the sm_90 code of the GEMM kernels, compiled without a GPU: did a refactor change it?

Compiles the pointer kernel (``grouped``, which ``autotuned`` and ``split_k`` share the K loop of) and
``persistent_tma`` for Hopper in five operand modes (fp16 as loaded; tf32 swapped and with A through
registers; fp8 as loaded and swapped), strips line info and debug sections from the PTX, and prints a short
hash of each. Run it at two commits: equal hashes mean the GPU runs the same instructions.

    TRITON_INTERPRET=0 TILEGEMM_INTERPRET=0 PYTHONPATH=src python3 tools/ptx_fingerprint.py [--dump DIR]

(Triton compiles for a target given by hand here, so no GPU or CUDA driver is needed; ptxas ships with Triton.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tilegemm.ops.matmul.grouped import matmul_grouped_kernel
from tilegemm.ops.matmul.persistent_tma import matmul_persistent_tma_kernel

# name, operand type, MMA_OPERANDS, input precision, bytes per element
MODES = [("fp16", "*fp16", "ab", "ieee", 2), ("tf32-swap", "*fp32", "swap", "tf32", 4),
         ("tf32-reg_a", "*fp32", "reg_a", "tf32", 4), ("fp8", "*fp8e4nv", "ab", "ieee", 1),
         ("fp8-swap", "*fp8e4nv", "swap", "ieee", 1)]
UNIT_STRIDES = ("stride_ak", "stride_bn", "stride_on", "stride_cn")


def code_of(ptx: str) -> str:
    """The instructions of a PTX file: no debug sections, line info or comments."""
    kept = []
    for line in ptx.split(".section")[0].splitlines():
        t = line.strip()
        if not t or t.startswith((".loc", ".file", "//", "$L__tmp", "$L__func")):
            continue
        kept.append(re.sub(r"\s+//.*", "", t))
    return "\n".join(kept)


def compile_ptx(kernel, operand: str, mma_operands: str, precision: str, size: int, persistent: bool) -> str:
    flags = dict(HAS_C=False, HAS_BIAS=True, ACTIVATION="relu", INPUT_PRECISION=precision, HAS_SCALE_A=size == 1,
                 HAS_SCALE_B=size == 1, MMA_OPERANDS=mma_operands, GROUP_M=8, FAST_ACCUM=False,
                 BLOCK_M=128, BLOCK_N=128, BLOCK_K=128 // size if size < 4 else 32)
    if persistent:
        flags.update(A_T=False, B_T=mma_operands != "swap", NUM_SMS=132, FLATTEN=True, WARP_SPECIALIZE=0,
                     HOST_DESC=False)  # pointers, as the fingerprints were taken
    else:
        flags.update(UPCAST=False, INDEX_64=False, DIVISORS=(16,) * 11)
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr"):
            sig[name] = operand if name in ("a_ptr", "b_ptr") else "*fp32" if name.startswith("scale") else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in flags:
            sig[name], constexprs[(i,)] = "constexpr", flags[name]
        elif name in UNIT_STRIDES:
            sig[name], constexprs[(i,)] = "constexpr", 1
        elif name in ("alpha", "beta"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8, num_stages=3))
    return compiled.asm["ptx"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", help="also write each kernel's stripped PTX into this folder (to diff)")
    args = ap.parse_args()
    prints = {}
    for mode, operand, mma_operands, precision, size in MODES:
        for name, kernel, persistent in (("grouped", matmul_grouped_kernel, False),
                                         ("persistent_tma", matmul_persistent_tma_kernel, True)):
            code = code_of(compile_ptx(kernel, operand, mma_operands, precision, size, persistent))
            prints[f"{name}/{mode}"] = hashlib.sha1(code.encode()).hexdigest()[:12]
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{name}-{mode}.ptx"), "w") as f:
                    f.write(code)
    print(json.dumps(prints, indent=1))


if __name__ == "__main__":
    main()
