"""Grouped GEMM: products whose groups have data-dependent sizes (mixture-of-experts layers) and batched ones.

``tilegemm.grouped_mm`` follows ``torch.nn.functional.grouped_mm``; ``tilegemm.w4a16.grouped_matmul`` runs
4-bit experts; :mod:`tilegemm.nn.moe` plugs both into transformers' MoE blocks. The public functions are in
:mod:`.api`, checks in :mod:`.checks`, the torch.library op in :mod:`.op`, one file per kernel (:mod:`.tiled`,
:mod:`.tma`, :mod:`.gluon`, :mod:`.tma_k`, :mod:`.int4`, :mod:`.dequant`, :mod:`.frag`); a MoE layer's token routing around its
products in :mod:`.routing` (``moe_route``, ``moe_combine``, ``group_columns``). Nothing here imports triton: a kernel
module is imported when its kernel first runs.
"""

from tilegemm.core.hardware import why_not_gluon, why_not_tma
from tilegemm.core.registry import KernelSpec, OpSpec, register, register_op

register_op(OpSpec(
    name="grouped", summary="grouped GEMM (MoE experts, jagged groups read on the device) and batched products",
    bench="tilegemm.ops.grouped.bench:GroupedBench",
    pseudo={"auto": "picks the kernel for the problem (the default)"},
))
register(KernelSpec(
    op="grouped", name="tiled", order=10, target="tilegemm.ops.grouped.tiled:run",
    dtypes=("fp16", "bf16", "fp32", "tf32"),
    summary="one launch for every layout: programs find their group by scanning offs on the device",
))
register(KernelSpec(
    op="grouped", name="tma", order=20, target="tilegemm.ops.grouped.tma:run", why_not=why_not_tma,
    tags=("sm_90",), dtypes=("fp16", "bf16"),
    summary="Hopper, the MoE forward (2-D x 3-D): persistent, A and B tiles by TMA (descriptors made on the device)",
))
register(KernelSpec(
    op="grouped", name="gluon", order=25, target="tilegemm.ops.grouped.gluon:run", why_not=why_not_gluon,
    tags=("sm_90", "gluon"), dtypes=("fp16", "bf16"),
    summary="Hopper, the MoE forward (2-D x 3-D) on the dense gluon_f16 skeleton: a TMA producer warp group, two "
            "consumer warp groups, row tiles planned on the device from offs",
))
register(KernelSpec(
    op="grouped", name="tma_k", order=30, target="tilegemm.ops.grouped.tma_k:run", why_not=why_not_tma,
    tags=("sm_90",), dtypes=("fp16", "bf16"),
    summary="Hopper, 2-D x 2-D with groups along K (the MoE weight gradient): persistent, TMA boxes cut at each "
            "group's end",
))
register_op(OpSpec(
    name="grouped_w4a16", summary="4-bit experts: x[rows of g] @ dequantize(w)[g].T, groups jagged as in grouped",
    bench="tilegemm.ops.grouped.bench:GroupedW4A16Bench",
    pseudo={"auto": "picks the kernel for the problem (the default)"},
))
register(KernelSpec(
    op="grouped_w4a16", name="dequant_dot", order=10, target="tilegemm.ops.grouped.int4:run",
    dtypes=("fp16", "bf16"),
    summary="the 4-bit weight dequantized in registers inside the K loop, then tl.dot, groups found as in tiled",
))
register(KernelSpec(
    op="grouped_w4a16", name="dequant_grouped", order=20, target="tilegemm.ops.grouped.dequant:run",
    dtypes=("fp16", "bf16"),
    summary="prefill: one pass writes the experts' 16-bit weight, then the 16-bit grouped product (auto's: tma or "
            "gluon on Hopper)",
))

register(KernelSpec(
    op="grouped_w4a16", name="frag", order=30, target="tilegemm.ops.grouped.frag:run", why_not=why_not_gluon,
    tags=("sm_90", "gluon"), dtypes=("fp16", "bf16"),
    summary="decode: W4A16's fragment kernel on the stacked experts' fragments (wgmma, cp.async ring), the expert "
            "a grid axis, its rows read from offs on the device, K split",
))

from tilegemm.ops.grouped.api import batched_matmul, grouped_matmul, grouped_mm  # noqa: E402
from tilegemm.ops.grouped.routing import group_columns, moe_combine, moe_route  # noqa: E402
import tilegemm.ops.w4a16 as _w4a16  # noqa: E402

# The public name of the 4-bit experts is tilegemm.w4a16.grouped_matmul: set here, since w4a16 cannot import this
# family (it imports w4a16's Int4Weight).
_w4a16.grouped_matmul = grouped_matmul

__all__ = ["batched_matmul", "group_columns", "grouped_matmul", "grouped_mm", "moe_combine", "moe_route"]
