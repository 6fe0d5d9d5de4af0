"""x's inputs put in an act-order weight's stored order, ``x2[:, perm]``, by one small Triton gather.

Every plain act-order call reorders x by :func:`reorder_columns` and then runs the kernel auto picks for the
natural-order weight, eager or captured into a CUDA graph alike (one route: a captured call never loads a kernel
its eager warm-up did not). As CUDA graphs a Triton gather took a third of ``index_select``'s time at small M, and
a product on x reordered by it ran ahead of frag_wgmma reading x through perm (``GATHER``) at every M measured
(docs/w4a16.md, "Act-order"). Its launch is recorded and replayed as its own entry
(``op.REORDERS``), so the host fast path pays a replayed launch for it, not Triton's launch wrapper.
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import launch
from tilegemm.core.runtime import cdiv, ensure_backend, new_output

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# A program gathers rows of x a chunk of ELEMENTS columns at a time, one 16-byte store a thread. Each gathered element
# is its own 32-byte sector, so the bytes moved follow how many programs share a row: a row's sectors are fetched
# once by each program that gathers from it (and reused from its L1 across that program's chunks). Hence one row a
# program and as few programs a row as still give about PROGRAMS_PER_SM programs an SM: at M = 1 a row spreads over
# its K / ELEMENTS chunks (the form first measured); from M = 4 x SMs, one
# program walks a whole row. docs/w4a16.md, "Act-order".
ELEMENTS = 1024
PROGRAMS_PER_SM = 4
WARPS = 4


@triton.jit
def reorder_kernel(x_ptr, perm_ptr, out_ptr, M, K, stride_xm, stride_xk, stride_p, stride_om, blocks_k, chunks,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[m, j] = x[m, perm[j]]`` over this program's block of rows and ``chunks`` consecutive blocks of
    columns: perm's slice loaded a block at a time, x's elements gathered (2-byte loads, cached: later chunks find
    the row's sectors in L1), each output row's slice stored contiguously (16-byte stores where out's rows are
    16-byte aligned, K a multiple of 8). One flat grid axis: no limit on M from the grid."""
    pid = tl.program_id(0)
    groups_k = tl.cdiv(blocks_k, chunks)
    pid_m, pid_g = pid // groups_k, pid % groups_k
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    rows = rows.to(tl.int64)  # x may hold 2^31 elements or more
    for c in range(0, chunks):
        j = (pid_g * chunks + c) * BLOCK_K + tl.arange(0, BLOCK_K)
        j_ok = j < K
        src = tl.load(perm_ptr + j.to(tl.int64) * stride_p, mask=j_ok, other=0).to(tl.int64)
        ok = m_ok[:, None] & j_ok[None, :]
        vals = tl.load(x_ptr + rows[:, None] * stride_xm + src[None, :] * stride_xk, mask=ok)
        tl.store(out_ptr + rows[:, None] * stride_om + j[None, :], vals, mask=ok)


def gather_grid(M: int, K: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_K, blocks_k, chunks a program, programs) of :func:`reorder_kernel` at one row a program: the
    row's ``blocks_k`` column blocks split over as few programs as still make about PROGRAMS_PER_SM an SM."""
    block_k = min(ELEMENTS, max(16, triton.next_power_of_2(K)))
    blocks_k = cdiv(K, block_k)
    per_row = max(1, min(blocks_k, cdiv(PROGRAMS_PER_SM * sms, M)))
    chunks = cdiv(blocks_k, per_row)
    return block_k, blocks_k, chunks, M * cdiv(blocks_k, chunks)


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
    from tilegemm.core.hardware import sm_count

    block_k, blocks_k, chunks, programs = gather_grid(M, K, sm_count(x2.device))
    launch(reorder_kernel, (programs,),
           (x2, perm, out, M, K, x2.stride(0), x2.stride(1), perm.stride(0), out.stride(0), blocks_k, chunks),
           dict(BLOCK_M=1, BLOCK_K=block_k, num_warps=WARPS))
    return out
