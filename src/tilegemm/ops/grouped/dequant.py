"""Kernel ``dequant_grouped`` of ``grouped_w4a16``: 4-bit experts at prefill sizes, in two steps.

1. One Triton pass dequantizes the stacked experts into a 16-bit scratch ``W [E, N, K]``, K contiguous: a packed
   word holds eight K steps of one weight row, so its eight values are 16 contiguous bytes of a row of W. Experts
   that ``offs`` gives no rows are skipped (read on the device; the product never reads them). The
   arithmetic is ``dequant_dot``'s (:func:`tilegemm.ops.grouped.int4.dequantize_nibbles`): bit for bit
   :func:`tilegemm.ops.w4a16.format.dequantize`.
2. The 16-bit grouped product of x and ``W.transpose(1, 2)`` (``[E, K, N]``, column-major per expert: the layout
   ``tma`` reads through a ``[G, N, K]`` descriptor, and ``tiled`` through its strides) on the kernel the 16-bit
   ``auto`` picks for it (:func:`tilegemm.ops.grouped.dispatch.choose`), whose epilogue is ``dequant_dot``'s: bias
   ``[N]`` or ``[E, N]``, the activation, the gate (``activation(gate) * up`` over the two halves of the weight's
   rows, as ``moe_gate_up`` runs it), zeros past ``offs[-1]``.

The scratch holds at most ``dispatch.INT4_DEQUANT_MAX_BYTES``: a larger weight is dequantized and multiplied a
slice of the output's columns at a time (every expert's columns ``[n0, n0 + C)``; gated, the gate's and the up
projection's), each product storing its own columns of the output. Nothing reads ``offs`` on the host.

The scratch is the call's own (``torch.empty``: the caching allocator's, or a CUDA graph's pool under capture), so
the call is not recorded for the host fast path (:func:`tilegemm.core.launch.spoil`): a kept per-stream scratch
would hold up to the bound of memory for good, and at the sizes this kernel runs the host's time is hidden by the
GPU's. Measurements: docs/grouped.md, "4-bit experts at prefill".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import launch, spoil
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv, interpreting, new_output
from tilegemm.ops.grouped import dispatch
from tilegemm.ops.grouped.configs import INT4_DEQUANT_PASS
from tilegemm.ops.grouped.int4 import dequantize_nibbles
from tilegemm.ops.grouped.problem import GroupedInt4Problem, make_problem


@triton.jit
def dequant_experts_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, offs_ptr, K, N_SRC, NW, n_lo, split_at, jump, group_k,
                           UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # This program: packed rows [BLOCK_R] (8 BLOCK_R K steps) of scratch rows [BLOCK_N] of expert program_id(2).
    # Scratch row j holds the weight's row j + n_lo, or j + n_lo + jump from split_at on (a slice of a gated
    # weight: the gate's rows, then the up projection's).
    e = tl.program_id(2).to(tl.int64)
    # An expert no row is routed to: the product never reads its weight, so it is not written (offs read here)
    rows = tl.load(offs_ptr + e) - tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    if rows > 0:
        _dequant_block(qw_ptr, s_ptr, z_ptr, w_ptr, e, K, N_SRC, NW, n_lo, split_at, jump, group_k, UPCAST, BLOCK_R,
                       BLOCK_N)


@triton.jit
def _dequant_block(qw_ptr, s_ptr, z_ptr, w_ptr, e, K, N_SRC, NW, n_lo, split_at, jump, group_k,
                   UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n = j + n_lo + tl.where(j >= split_at, jump, 0)  # the weight's rows: qweight's columns
    ok = (r < K // 8)[:, None] & (j < NW)[None, :]
    words = tl.load(qw_ptr + e * (K // 8) * N_SRC + r[:, None] * N_SRC + n[None, :], mask=ok, other=0)  # [BR, BN]
    g = (8 * r) // group_k  # the eight K steps of a packed row share a group (groups are whole words)
    sz = e * tl.cdiv(K, group_k) * N_SRC + g[:, None] * N_SRC + n[None, :]
    s = tl.load(s_ptr + sz, mask=ok, other=0.0)
    z = tl.load(z_ptr + sz, mask=ok, other=0.0)
    shifts = tl.arange(0, 8) * 4
    q = (words[:, None, :] >> shifts[None, :, None]) & 15  # [BR, 8, BN]: K step 8r + i
    w = dequantize_nibbles(q, s[:, None, :], z[:, None, :], s_ptr.dtype.element_ty, UPCAST)
    w = tl.reshape(tl.permute(w.to(w_ptr.dtype.element_ty), (2, 0, 1)), (BLOCK_N, 8 * BLOCK_R))  # rows of W
    k = tl.program_id(0) * 8 * BLOCK_R + tl.arange(0, 8 * BLOCK_R)
    tl.store(w_ptr + e * NW * K + j[:, None].to(tl.int64) * K + k[None, :], w,
             mask=(j < NW)[:, None] & (k < K)[None, :])


def dequantize_experts(p: GroupedInt4Problem, w: torch.Tensor, n_lo: int, columns: int) -> None:
    """Write into ``w`` (``[E, NW, K]``, contiguous) the 16-bit rows of every expert's weight that the output's
    columns ``[n_lo, n_lo + columns)`` need: those rows, and gated the up projection's ``p.N`` further on. Experts
    that ``p.offs`` gives no rows are left unwritten."""
    block_r, block_n, warps = INT4_DEQUANT_PASS
    nw = w.shape[1]
    n_src = p.qweight.shape[2]
    split_at, jump = (columns, p.N - columns) if p.gated else (nw, 0)
    grid = (cdiv(p.K // 8, block_r), cdiv(nw, block_n), p.groups)
    launch(dequant_experts_kernel, grid,
           (p.qweight, p.scales, p.zeros, w, p.offs, p.K, n_src, nw, n_lo, split_at, jump, p.group_k),
           dict(UPCAST=interpreting() and w.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_N=block_n,
                num_warps=warps))


def _bias_slice(p: GroupedInt4Problem, n0: int, columns: int):
    """The bias of the output's columns ``[n0, n0 + columns)``, as the 16-bit product takes it (gated: the gate's
    columns, then the up projection's, ``columns`` apart)."""
    if p.bias is None or columns == p.N:
        return p.bias
    gate = p.bias[..., n0:n0 + columns]
    if not p.gated:
        return gate
    return torch.cat((gate, p.bias[..., p.N + n0:p.N + n0 + columns]), dim=-1)


def why_not(p: GroupedInt4Problem) -> str | None:
    """None when this kernel takes ``p``; otherwise why not."""
    if dispatch.dequant_chunk(p) == 0:
        return (f"not even one slice of the output's columns dequantizes within dispatch.INT4_DEQUANT_MAX_BYTES = "
                f"{dispatch.INT4_DEQUANT_MAX_BYTES} bytes (E = {p.groups}, K = {p.K})")
    return None


def run(p: GroupedInt4Problem, config: dict | None = None) -> None:
    reason = why_not(p)
    if reason is not None:
        raise NotApplicable(f"grouped_w4a16 kernel 'dequant_grouped' does not take this problem: {reason}")
    if p.M == 0 or p.N == 0:
        return
    spoil()  # the scratch is this call's own: a replay would pass the recorded one (see the module's notes)
    columns = dispatch.dequant_chunk(p)
    halves = 2 if p.gated else 1
    w = new_output((p.groups, halves * columns, p.K), p.dtype, p.x.device)  # NaN while poisoning: unwritten shows
    for n0 in range(0, p.N, columns):
        c = min(columns, p.N - n0)
        # the last, narrower slice: a contiguous prefix of the scratch
        wc = w if c == columns else w.view(-1)[:p.groups * halves * c * p.K].view(p.groups, halves * c, p.K)
        dequantize_experts(p, wc, n0, c)
        out = p.out if c == p.N else p.out[:, n0:n0 + c]
        q = make_problem("2d3d", p.groups, p.x, wc.transpose(1, 2), p.offs, _bias_slice(p, n0, c), out, "ieee",
                         p.activation, p.gated)
        dispatch.launch(q, "auto")
