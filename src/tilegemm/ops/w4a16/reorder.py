"""x's inputs put in an act-order weight's stored order, ``x2[:, perm]``, by one small Triton gather.

Every plain act-order call reorders x by :func:`reorder_columns` and then runs the kernel auto picks for the
natural-order weight, eager or captured into a CUDA graph alike (one route: a captured call never loads a kernel
its eager warm-up did not). As CUDA graphs on the H200 ``index_select`` along the last dim took 4.2-5.0 us a call
at M <= 16 where a Triton gather (this one's first form) took 1.35-1.75, and a product on x reordered by it ran
0.85-0.88 of the natural order's speed at M = 1..128 where frag_wgmma reading x through perm (``GATHER``) ran 0.70
at M = 1 and less above (docs/w4a16.md, "Act-order"). Its launch is recorded and replayed as its own entry
(``op.REORDERS``), so the host fast path pays a replayed launch for it, not Triton's launch wrapper.
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import launch
from tilegemm.core.runtime import cdiv, ensure_backend, new_output

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# A program gathers about ELEMENTS elements, one 16-byte store a thread. A model, not a measurement: each gathered
# element is its own L1 request, about a cycle each on its SM, so small programs spread over many SMs shorten the
# call. The form measured (one row of 1024 columns a program, docs/w4a16.md "Act-order") is this one at M = 1;
# tools/w4a16_actorder_line.py times the gather alone.
ELEMENTS = 1024
ROWS = 4  # rows a program at most: perm's slice (ELEMENTS / rows columns) reused over them
WARPS = 4


@triton.jit
def reorder_kernel(x_ptr, perm_ptr, out_ptr, M, K, stride_xm, stride_xk, stride_p, stride_om, blocks_k,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[m, j] = x[m, perm[j]]`` over this program's block of rows and block of columns: perm's slice loaded
    once, x's elements gathered (2-byte loads), each output row's slice stored contiguously (16-byte stores where
    out's rows are 16-byte aligned, K a multiple of 8). One flat grid axis: no limit on M from the grid."""
    pid = tl.program_id(0)
    pid_m, pid_k = pid // blocks_k, pid % blocks_k
    j = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j_ok, m_ok = j < K, rows < M
    src = tl.load(perm_ptr + j.to(tl.int64) * stride_p, mask=j_ok, other=0).to(tl.int64)
    rows = rows.to(tl.int64)  # x may hold 2^31 elements or more
    ok = m_ok[:, None] & j_ok[None, :]
    vals = tl.load(x_ptr + rows[:, None] * stride_xm + src[None, :] * stride_xk, mask=ok)
    tl.store(out_ptr + rows[:, None] * stride_om + j[None, :], vals, mask=ok)


def reorder_columns(x2: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x2.index_select(1, perm)`` for 2-D ``x2`` (any strides) and 1-D integer ``perm`` of x2's width (any
    stride), as a new contiguous tensor written by :func:`reorder_kernel` (no launch when it is empty). Called by
    ``w4a16.matmul``'s plain calls (a call that autograd or a tracer watches takes ``index_select``) and by the op
    called with perm."""
    if x2.dim() != 2 or perm.dim() != 1 or perm.shape[0] != x2.shape[1]:
        raise ValueError(f"reorder_columns: x2 [M, K] and perm [K], got {list(x2.shape)} and {list(perm.shape)}")
    M, K = x2.shape
    out = new_output((M, K), x2.dtype, x2.device)
    if M == 0 or K == 0:
        return out
    block_m = min(ROWS, triton.next_power_of_2(M))
    block_k = min(ELEMENTS // block_m, max(16, triton.next_power_of_2(K)))
    blocks_k = cdiv(K, block_k)
    launch(reorder_kernel, (cdiv(M, block_m) * blocks_k,),
           (x2, perm, out, M, K, x2.stride(0), x2.stride(1), perm.stride(0), out.stride(0), blocks_k),
           dict(BLOCK_M=block_m, BLOCK_K=block_k, num_warps=WARPS))
    return out
