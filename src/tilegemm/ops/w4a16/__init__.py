"""W4A16: fp16/bf16 activations times 4-bit weights (``activation(x @ dequantize(w).T + bias)``).

The format (:class:`Int4Weight`, quantize, importers) is in :mod:`.format`; the public function in :mod:`.api`,
its checks in :mod:`.checks`, the ``torch.library`` op in :mod:`.op`, the call's record in :mod:`.problem`,
``auto`` in :mod:`.dispatch`, one file per kernel (:mod:`.gemv`, :mod:`.frag_wgmma`, :mod:`.mma`,
:mod:`.dequant_cublas`, its cuBLAS half in :mod:`.cublas_half`), their configs in :mod:`.configs`, the plain-torch
oracle in :mod:`.reference`.
Nothing here imports triton: a kernel module is imported when its kernel first runs.
"""

import torch as _torch

from tilegemm.core.hardware import why_not_gluon
from tilegemm.core.registry import KernelSpec, OpSpec, register, register_op


register_op(OpSpec(
    name="w4a16", summary="4-bit weights (group-wise scales and zeros) times fp16/bf16 activations",
    bench="tilegemm.ops.w4a16.bench:W4A16Bench",
    pseudo={"auto": "picks the kernel by M: frag_wgmma on Hopper up to 128 rows, or 512 against wide weights "
                    "(elsewhere gemv for a few rows, mma up to 128), dequant_cublas above (the default)"},
))
register(KernelSpec(
    op="w4a16", name="gemv", order=10, target="tilegemm.ops.w4a16.gemv:run",
    summary="CUDA cores, split-K: wide loads of packed weights, zero/scale out of the inner loop (small M)",
))
register(KernelSpec(
    op="w4a16", name="frag_wgmma", order=16, target="tilegemm.ops.w4a16.frag_wgmma:run",
    why_not=why_not_gluon, tags=("sm_90", "gluon"), dtypes=("fp16", "bf16"),
    summary="the fragments through Hopper's wgmma, x from a cp.async ring in shared memory (any M; auto: small M)",
))
register(KernelSpec(
    op="w4a16", name="mma", order=20, target="tilegemm.ops.w4a16.mma:run",
    summary="tensor cores: weights dequantized in registers before tl.dot, split-K when tiles are few",
))
register(KernelSpec(
    op="w4a16", name="dequant_cublas", order=30, target="tilegemm.ops.w4a16.dequant_cublas:run",
    summary="dequantize the weight to 16-bit (one Triton pass), then torch.matmul (cuBLAS): a large-M candidate",
))

from tilegemm.ops.w4a16.format import (  # noqa: E402
    GROUP_SIZES,
    Int4Weight,
    dequantize,
    fits_fragments,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    quantize,
    validate,
)
# entry points of the fragment layout for other families (grouped_w4a16's frag): its K-split rule and layout check
from tilegemm.ops.w4a16.configs import FRAG_WGMMA_PROGRAMS_PER_SM, split_within  # noqa: E402,F401


def fragment_kernel():
    """The module of ``frag_wgmma`` (it imports triton): the fragment layout's Gluon pieces (``_issue``,
    ``_plain_step``, ``_w_offsets``, ``_zs_start``) for another family's kernel that reads the same layout (the
    4-bit experts' ``frag``). Imported when asked, so that importing this package imports no kernel."""
    from tilegemm.ops.w4a16 import frag_wgmma

    return frag_wgmma
from tilegemm.ops.w4a16.api import ACTIVATIONS, matmul  # noqa: E402
# entry point for the grouped op's checks: the weight that a registered op's flat arguments make, checked
from tilegemm.ops.w4a16.checks import weight_of_op_args  # noqa: E402,F401
# entry point for the grouped op: the fragment layout an op may read where it runs (a module's while it stands)
from tilegemm.ops.w4a16.op import contiguous_parts, fragment_layout  # noqa: E402,F401

# torch.load(weights_only=True), torch's default, rebuilds an Int4Weight from tensors and ints only.
_torch.serialization.add_safe_globals([Int4Weight])
from tilegemm.ops.w4a16.format import _rebuild  # noqa: E402

_torch.serialization.add_safe_globals([_rebuild])

# grouped_matmul (4-bit experts) joins this namespace from tilegemm.ops.grouped, whose kernel it runs: that family
# imports this package for Int4Weight, so this one cannot import it back.
__all__ = ["ACTIVATIONS", "GROUP_SIZES", "Int4Weight", "dequantize", "from_awq", "from_compressed_tensors", "from_gptq",
           "grouped_matmul", "matmul", "quantize"]
