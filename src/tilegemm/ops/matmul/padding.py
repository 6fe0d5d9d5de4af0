"""``auto``'s zero-padded copies of operands whose rows are not 16-byte aligned.

Triton's pointer kernels read such rows two bytes at a time, without asynchronous copies, and TMA cannot
describe them at all: on the H200 a misaligned 1723x449x15855 fp16 product ran 1.9 ms where cuBLAS took 234
us (``benchmarks/results/2026-11-23-h200/a764849/``). Copied into buffers whose rows start 16 bytes apart,
with K rounded up to a multiple of the alignment and the new K columns (rows) zero, the same product takes the
aligned path, TMA included; zeros along K add nothing to the result.

The copies are Triton launches into per-stream workspaces (:func:`tilegemm.core.workspace.buffer`), so a
plain call's launches (the copies and the GEMM over the copies) are recorded and replayed like any other
call's. A copy costs a pass over the operand, so ``auto`` pads only where the cost model
(:mod:`tilegemm.ops.matmul.cost`) says the aligned product plus the copies beats the misaligned product by a
margin (:func:`padding_pays`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import current_stream, keeping, launch
from tilegemm.core.runtime import cdiv
from tilegemm.core.workspace import buffer


@triton.jit
def pad_copy_kernel(src_ptr, dst_ptr, R, C, stride_r, stride_c, CP, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst[r, c] = src[r, c] inside R x C, 0 elsewhere; dst is row-major with rows CP elements apart."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = offs_r.to(tl.int64)[:, None]
    c = offs_c.to(tl.int64)[None, :]
    inside = (r < R) & (c < C)
    values = tl.load(src_ptr + r * stride_r + c * stride_c, mask=inside, other=0.0)
    tl.store(dst_ptr + r * CP + c, values, mask=c < CP)


def _round_up(n: int, to: int) -> int:
    return cdiv(n, to) * to


def padded_operand(t: torch.Tensor, k_dim: int, k_to: int, slot: int) -> torch.Tensor:
    """``t`` (2-D, one unit stride) copied into an aligned workspace buffer in its own layout: its K dimension
    (``k_dim``: 1 for A, 0 for B) grown to ``k_to`` with zeros and its leading dimension padded to 16 bytes.
    ``slot`` keeps A's buffer apart from B's."""
    per = 16 // t.element_size()
    column_major = t.stride(0) == 1 and t.stride(1) != 1
    s = t.mT if column_major else t  # the storage view: rows apart by its leading dimension, unit columns
    s_k_dim = 1 - k_dim if column_major else k_dim
    rows, cols = s.shape
    rows_to = k_to if s_k_dim == 0 else rows
    cols_to = k_to if s_k_dim == 1 else cols
    ld = _round_up(cols_to, per)
    buf = buffer(t.device, t.dtype, rows_to * ld, ("pad", slot))
    dst = buf[: rows_to * ld].view(rows_to, ld)
    block_r, block_c = 32, 128
    grid = (cdiv(rows_to, block_r), cdiv(ld, block_c))
    launch(pad_copy_kernel, grid, (s, dst, rows, cols, s.stride(0), s.stride(1), ld),
           dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4), keep=(buf,), stream=current_stream())
    view = dst[:, :cols_to]
    return view.mT if column_major else view


def padded_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A', B') for ``a @ b`` with 2-D operands: K rounded up to 16 bytes of elements."""
    k_to = _round_up(a.shape[1], 16 // a.element_size())
    return padded_operand(a, 1, k_to, 0), padded_operand(b, 0, k_to, 1)


# Pad only where the misaligned product is estimated to take at least this long: below it the two extra
# launches and their host time weigh more than what the aligned loads win.
PAD_MIN_US = 15.0
PAD_GAIN = 0.7  # and the copies plus the aligned product at most this fraction of the misaligned one


PADDED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def can_pad(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`padded_pair` takes these operands: 2-D, 16- or 32-bit, each with a unit stride."""
    return (a.dim() == 2 and b.dim() == 2 and a.dtype in PADDED_DTYPES and b.dtype == a.dtype
            and 1 in a.stride() and 1 in b.stride())


def padding_pays(p) -> bool:
    """Whether ``auto`` should pad problem ``p`` (rows not aligned): the cost model's best aligned config plus
    the copies (a read and a write of both operands, two launches) against its best misaligned config."""
    from tilegemm.ops.matmul.configs import autotune_configs, prune_for
    from tilegemm.ops.matmul.cost import LAUNCH_US, device_rates, problem_estimator

    options = prune_for(autotune_configs(), p.a.element_size())
    misaligned = min(map(problem_estimator(p, aligned=False), options))
    if misaligned < PAD_MIN_US:
        return False
    aligned = min(map(problem_estimator(p, aligned=True), options))
    hbm = device_rates(p)[2]
    copies = 2.0 * (p.M * p.K + p.K * p.N) * p.a.element_size() / (hbm * 1e3) + 2 * LAUNCH_US
    return aligned + copies < PAD_GAIN * misaligned


def run_padded(a: torch.Tensor, b: torch.Tensor, gemm) -> None:
    """``gemm(a2, b2)`` over padded copies of ``a`` and ``b``; its launches keep the copies' buffers as
    their own (a replay passes them as recorded)."""
    a2, b2 = padded_pair(a, b)
    with keeping(a2, b2):
        gemm(a2, b2)
