"""Dense GEMM: ``activation(alpha * (a @ b) + beta * c + bias)``.

The rungs of the ladder, each a file beside this one, registered here by name, with the Gluon kernels that
``persistent_tma`` launches on Hopper (each also selectable alone). Other families reach matmul through
:func:`make_problems` and :func:`launch` only (docs/internals.md). Nothing here imports triton: a kernel
module is imported when its kernel first runs.
"""

from tilegemm.core.hardware import why_not_gluon, why_not_tma
from tilegemm.core.registry import KernelSpec, OpSpec, register, register_op

register_op(OpSpec(
    name="matmul", summary="dense GEMM with a fused epilogue: fp16, bf16, fp32/tf32, fp8; any layout; batched",
    bench="tilegemm.ops.matmul.bench:MatmulBench", tune="tilegemm.ops.matmul.tune:tune",
    warmup="tilegemm.ops.matmul.tune:warmup",
    tunable=("auto", "autotuned", "persistent_tma", "split_k", "gluon_f16", "gluon_fp8", "gluon_tf32"),
    pseudo={"auto": "picks the best rung for the problem (the default)"},
))
register(KernelSpec(
    op="matmul", name="naive", order=10, target="tilegemm.ops.matmul.naive:run",
    summary="textbook tile kernel: one program per output tile, row-major launch order, fixed blocks",
))
register(KernelSpec(
    op="matmul", name="grouped", order=20, target="tilegemm.ops.matmul.grouped:run",
    summary="naive + grouped (swizzled) launch order, so programs running together share tiles in L2",
))
register(KernelSpec(
    op="matmul", name="autotuned", order=30, target="tilegemm.ops.matmul.autotuned:run",
    summary="grouped + block sizes, warps and pipeline stages chosen by timing per shape",
))
register(KernelSpec(
    op="matmul", name="split_k", order=40, target="tilegemm.ops.matmul.split_k:run",
    summary="for skinny problems: K split over several programs whose partial tiles are summed in a fixed order",
))
register(KernelSpec(
    op="matmul", name="persistent_tma", order=50, target="tilegemm.ops.matmul.persistent_tma:run",
    why_not=why_not_tma, tags=("sm_90",),
    summary="Hopper: one program per SM over tiles in grouped order, TMA tile loads/stores, split epilogue",
))
register(KernelSpec(
    op="matmul", name="gluon_f16", order=51, target="tilegemm.ops.matmul.persistent_tma:run_gluon_f16",
    why_not=why_not_gluon, tags=("sm_90", "gluon", "variant of persistent_tma"), dtypes=("fp16", "bf16"),
    summary="persistent_tma's Gluon kernel for 16-bit operands: a TMA producer, two cooperative wgmma consumers",
))
register(KernelSpec(
    op="matmul", name="gluon_fp8", order=52, target="tilegemm.ops.matmul.persistent_tma:run_gluon_fp8",
    why_not=why_not_gluon, tags=("sm_90", "gluon", "variant of persistent_tma"),
    dtypes=("fp8_e4m3", "fp8_e5m2"),
    summary="persistent_tma's Gluon kernels for promoted fp8 (A row-major, B column-major), warp-specialized",
))
register(KernelSpec(
    op="matmul", name="gluon_tf32", order=53, target="tilegemm.ops.matmul.persistent_tma:run_gluon_tf32",
    why_not=why_not_gluon, tags=("sm_90", "gluon", "variant of persistent_tma"), dtypes=("tf32",),
    summary="persistent_tma's Gluon kernel for tf32 NN/TT: one operand through registers, wgmma",
))

from tilegemm.ops.matmul.api import matmul  # noqa: E402
from tilegemm.core.activations import ACTIVATIONS  # noqa: E402
from tilegemm.ops.matmul.dispatch import launch  # noqa: E402
from tilegemm.ops.matmul.problem import GemmProblem, make_problems  # noqa: E402

# The internal entry points other families call (docs/internals.md): make_problems cuts a product into
# GemmProblems, launch runs one with auto's choice or a named rung and config.
__all__ = ["ACTIVATIONS", "GemmProblem", "launch", "make_problems", "matmul"]
