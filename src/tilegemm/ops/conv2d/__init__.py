"""2-D convolution: ``activation(conv2d(x, weight) + bias)``, forward and backward, as implicit GEMMs.

The public function in :mod:`.api`, its checks in :mod:`.checks`, the ``torch.library`` ops (forward, data and
weight gradients) in :mod:`.op`, the records of a call in :mod:`.problem`, ``auto`` and the routes of the forward
and the gradients in :mod:`.dispatch`, configs in :mod:`.configs`, the plain-torch oracle in :mod:`.reference`.
Kernels, each a file beside this one, registered here by name; nothing here imports triton (a kernel module
is imported when its kernel first runs).
"""

from tilegemm.core.hardware import why_not_gluon
from tilegemm.core.registry import KernelSpec, OpSpec, register, register_op


register_op(OpSpec(
    name="conv2d", summary="2-D convolution (F.conv2d semantics) with fused bias and activation; fwd and bwd",
    bench="tilegemm.ops.conv2d.bench:Conv2dBench",
    pseudo={"auto": "tma_implicit_gemm where TMA can describe the call (Hopper, 16-bit, channels-last) but stems "
                    "of few output channels (implicit_gemm's stem kernel), else gemm_1x1 for pointwise, depthwise "
                    "for depthwise, grouped_direct for groups of at most 8 channels, implicit_gemm otherwise (the "
                    "default)"},
))
register(KernelSpec(
    op="conv2d", name="implicit_gemm", order=10, target="tilegemm.ops.conv2d.implicit_gemm:run",
    summary="implicit GEMM over channels-last pixels: K loop over filter taps, then channels; any conv; "
            "stems (at most 8 channels) over output rows, every tap a constant",
))
register(KernelSpec(
    op="conv2d", name="tma_implicit_gemm", order=15, target="tilegemm.ops.conv2d.tma_fwd:run",
    why_not=why_not_gluon, tags=("sm_90", "gluon"), dtypes=("fp16", "bf16"),
    summary="implicit GEMM whose input tiles are TMA boxes of a strided 5-D view (padding by TMA's zero fill); "
            "odd channel counts over zero-padded operands",
))
register(KernelSpec(
    op="conv2d", name="gemm_1x1", order=20, target="tilegemm.ops.conv2d.gemm_1x1:run",
    summary="1x1, stride 1, unpadded, one group: tilegemm.matmul on the channels-last view",
))
register(KernelSpec(
    op="conv2d", name="depthwise", order=30, target="tilegemm.ops.conv2d.depthwise:run",
    summary="direct kernel for groups = C: taps summed elementwise over [pixels, channels] tiles",
))

register(KernelSpec(
    op="conv2d", name="grouped_direct", order=35, target="tilegemm.ops.conv2d.grouped_direct:run",
    summary="direct kernel for few channels a group (2-16): fp32 multiply-adds over [pixels, groups x channels]",
))

register(KernelSpec(
    op="conv2d", name="grouped_packed", order=36, target="tilegemm.ops.conv2d.grouped_packed:run",
    summary="grouped layers on tensor cores: several whole groups a tile, the weight tile block-diagonal "
            "(pointer kernel, any layout and dtype)",
))
register(KernelSpec(
    op="conv2d", name="grouped_packed_tma", order=37, target="tilegemm.ops.conv2d.grouped_packed:run_tma",
    why_not=why_not_gluon, tags=("sm_90", "gluon"), dtypes=("fp16", "bf16"),
    summary="grouped layers as tma_implicit_gemm over GT times fewer groups with a block-diagonal weight "
            "(written each call)",
))

from tilegemm.ops.conv2d.api import conv2d  # noqa: E402

__all__ = ["conv2d"]
