"""x's inputs put in an act-order weight's stored order, ``x2[:, perm]``, by one small Triton gather.

As CUDA graphs on the H200, ``torch.index_select`` along the last dim took 4.2-5.0 us a call at M <= 16 where this
kernel takes 1.35-1.75, and an act-order product with x reordered by it ran 0.85x-0.88x the natural order's speed
at M = 1..128 where x read through perm inside frag_wgmma ran 0.70x at M = 1 and less above (docs/w4a16.md,
"Act-order"). Launched from Python its host cost is far above index_select's, so eager calls keep those routes and
only calls captured into a CUDA graph (where host time is paid once) take it.
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import launch, plain_call
from tilegemm.core.runtime import cdiv, ensure_backend, interpreting
from tilegemm.ops.w4a16.dispatch import capturing

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK = 1024  # columns a program: one row's slice, perm's indices loaded once a program
MAX_ROWS = 65535  # grid axis 1 (one row a program along it); more rows: index_select


@triton.jit
def reorder_kernel(x_ptr, perm_ptr, out_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr):
    """``out[m, j] = x[m, perm[j]]`` for the columns ``j`` of this program's block of row ``m``."""
    m = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < K
    src = tl.load(perm_ptr + j, mask=ok, other=0)
    tl.store(out_ptr + m * stride_om + j, tl.load(x_ptr + m * stride_xm + src, mask=ok), mask=ok)


def reorder_columns(x2: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x2.index_select(1, perm)`` for 2-D ``x2`` and a 1-D int64 ``perm`` of x2's width. A plain call (no
    autograd, tracer or mode to see it) captured into a CUDA graph, or under the interpreter (its tests), runs
    :func:`reorder_kernel`; others, and shapes it does not take, ``index_select``."""
    M, K = x2.shape
    if (M == 0 or K == 0 or M > MAX_ROWS or x2.stride(1) != 1 or perm.stride(0) != 1
            or not (interpreting() or capturing(x2)) or not plain_call(x2, perm)):
        return x2.index_select(1, perm)
    out = torch.empty((M, K), device=x2.device, dtype=x2.dtype)
    launch(reorder_kernel, (cdiv(K, BLOCK), M), (x2, perm, out, K, x2.stride(0), out.stride(0)),
           dict(BLOCK=BLOCK, num_warps=4))
    return out
