"""Kernel ``tma_k``: the 2-D x 2-D product with groups along K (the MoE weight gradient) on Hopper, operand tiles
moved by TMA into wgmma, persistent over the output tiles.

a ``[M, K]``, b ``[K, N]``, ``offs`` cutting K into G ranges; ``out[g] = a[:, Kg] @ b[Kg]`` ``[G, M, N]``. The
MoE backward passes ``dB = grouped(A^T, dY)``: a is the transpose of the row-major tokens ``[T, H]`` (unit stride
along M: stored ``[K, M]``) and b the row-major output gradient ``[T, N]`` (stored ``[K, N]``); both are read in
place with K as the descriptors' outer dim. Operands with K innermost are refused (``tiled`` runs them): a group
starts at any token, and the innermost coordinate of a Triton descriptor load must be 16-byte aligned.

The descriptors are made on the device, once per group a program has tiles in, with the group's end ``offs[g]``
as their K extent: a tile's K steps start at the group's first token, and TMA zero-fills the last step's box past
``offs[g]``, so no box reads another group's tokens and no step needs a mask (host descriptors over all of K would
need the last step's tiles masked in registers, a trip out of shared memory and back for wgmma). The base
pointers stay the tensors' own (16-byte aligned whatever ``offs[g-1]`` is): only the start coordinate moves.

Every group has the same ``cdiv(M, BM) * cdiv(N, BN)`` output tiles, so no scan of ``offs`` finds a tile's group:
the units (tiles, group-major, each group's in :func:`~tilegemm.ops.grouped.tiled.swizzle` order) are dealt
round-robin to at most one program an SM; a program walks the groups, makes its descriptors where it has units,
and runs them. An empty group's tiles store zeros (plus the bias), as ``tiled`` does. The epilogue stores through
pointers masked to M and N (fp32 ``out_dtype`` allowed). Measurements: docs/grouped.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.hardware import sm_count, tma_aligned, why_not_tma
from tilegemm.core.launch import ensure_allocator, launch
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv, interpreting
from tilegemm.ops.grouped.problem import GroupedProblem
from tilegemm.ops.grouped.tiled import swizzle

# BLOCK_M, BLOCK_N, BLOCK_K: the forward ``tma``'s tile (configs.TMA_BLOCK): 48 KB a stage, two warp groups of
# 64 x 256 (the dense TMA rung's tile for large 16-bit products); M and N of the weight gradient are the model's
# hidden and intermediate sizes, thousands each, so full tiles
TMA_K_BLOCK = (128, 256, 64)
TMA_K_STAGES = 3  # 3 x 48 KB of the SM's 227 KB in flight: TMA two K steps ahead (as ``tma``)
TMA_K_GROUP_M = 8  # bands of 8 row tiles: the programs running together share a's and b's panels in L2
TMA_K_PROGRAMS_PER_SM = 1  # 147 KB of shared memory a program (3 stages and the barriers): one fits an SM


@triton.jit
def grouped_tma_k_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, offs_ptr,
    G, M, N, K, PROGRAMS,
    s_ak, s_bk, s_og, s_om, s_on, s_cg, s_cn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):
    # a is stored [K, M] (row stride s_ak), b [K, N] (row stride s_bk): K is the outer dim of both.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tiles_m * tiles_n
    for g in range(0, G):
        first = g * per_group
        u0 = first + (pid - first % PROGRAMS + PROGRAMS) % PROGRAMS  # this program's first unit in group g
        if u0 < first + per_group:
            # the group's K range, clamped to [0, K] as ``tiled`` clamps it (bad offs: wrong numbers, no fault)
            k_hi = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), K)
            k_lo = tl.minimum(tl.maximum(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 0), k_hi)
            k_ext = tl.maximum(k_hi, 1)  # (a descriptor's dims are at least 1; an empty group loads nothing)
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[k_ext, M], strides=[s_ak, 1],
                                               block_shape=[BLOCK_K, BLOCK_M])
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[k_ext, N], strides=[s_bk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
            steps = tl.cdiv(k_hi - k_lo, BLOCK_K)
            g64 = tl.cast(g, tl.int64)  # (the interpreter's loop index is a Python int)
            out_g = out_ptr + g64 * s_og
            for u in range(u0, first + per_group, PROGRAMS):
                tile_m, tile_n = swizzle(u - first, tiles_m, tiles_n, GROUP_M)
                m0 = tile_m * BLOCK_M
                n0 = tile_n * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ks in tl.range(0, steps, num_stages=STAGES):
                    k0 = k_lo + ks * BLOCK_K
                    x = a_desc.load([k0, m0]).T  # [BM, BK], M-major in shared memory: wgmma reads it so
                    w = b_desc.load([k0, n0])
                    if UPCAST:  # the interpreter's bf16 dot is wrong: multiply fp32 copies there
                        x = x.to(tl.float32)
                        w = w.to(tl.float32)
                    acc = tl.dot(x, w, acc)
                offs_m = m0 + tl.arange(0, BLOCK_M)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                ok_n = offs_n < N
                if HAS_BIAS:  # [N] or [G, N]: every row of the group's tile (an empty group's too, as tiled)
                    c_ptrs = bias_ptr + g64 * s_cg + offs_n[None, :] * s_cn
                    acc += tl.load(c_ptrs, mask=ok_n[None, :], other=0.0).to(tl.float32)
                o_ptrs = out_g + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :] * s_on
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & ok_n[None, :])


# --- host side ---------------------------------------------------------------------------------------------


def _k_stride(t: torch.Tensor) -> int | None:
    """The K stride (elements) of a 2-D operand ``[K, X]`` stored K-outer (X unit-stride; a dim of one counts as
    unit-stride, and a K of one takes the smallest stride TMA does), or None where it is not so stored."""
    if t.stride(1) != 1 and t.shape[1] > 1:
        return None
    return t.stride(0) if t.shape[0] > 1 else 16 // t.element_size()


def why_not(p: GroupedProblem) -> str | None:
    """None when this kernel takes ``p``; otherwise why not."""
    reason = why_not_tma()
    if reason is not None:
        return reason
    if p.layout != "2d2d":
        return f"takes the 2-D x 2-D product (groups along K: the MoE weight gradient) only, not {p.layout}"
    if p.dtype not in (torch.float16, torch.bfloat16):
        return f"takes fp16 and bf16 operands, not {p.dtype}"
    if p.gated or p.activation != "none":
        return "has no gated or activation epilogue (the 2-D x 2-D product has none)"
    if p.K == 0:
        return "K is 0 (a descriptor needs a dimension of at least one)"
    a_t, b = p.a.T, p.b  # both as [K, X]
    if any(t.stride(d) == 0 and t.shape[d] > 1 for t in (a_t, b) for d in range(2)):
        return "an operand is broadcast (a stride of 0): TMA reads each row from its own address"
    # a group starts at any token; with K innermost that token would be TMA's innermost coordinate, which Triton's
    # descriptors need 16-byte aligned: K must be the outer (strided) dim of both, as the MoE backward has it
    if _k_stride(a_t) is None:
        return "a is not M-contiguous (a [M, K] with unit stride along M: the transposed tokens of the backward)"
    if _k_stride(b) is None:
        return "b is not N-contiguous (b [K, N] with unit stride along N: the backward's output gradient)"
    if not tma_aligned(a_t, _k_stride(a_t)):
        return "a's base or K stride is not 16-byte aligned"
    if not tma_aligned(b, _k_stride(b)):
        return "b's base or K stride is not 16-byte aligned"
    return None


def config(p: GroupedProblem) -> dict:
    """:data:`TMA_K_BLOCK` and its pipeline; small tiles under the interpreter. ``PROGRAMS_PER_SM``: the
    persistent grid's programs an SM (two, with tiles whose stages fit twice, let one program's epilogue overlap
    the other's K loop)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    bm, bn, bk = TMA_K_BLOCK
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=TMA_K_GROUP_M, PROGRAMS_PER_SM=TMA_K_PROGRAMS_PER_SM,
                num_warps=8, num_stages=TMA_K_STAGES)


def run(p: GroupedProblem, config_: dict | None = None) -> None:
    reason = why_not(p)
    if reason is not None:
        raise NotApplicable(f"grouped kernel 'tma_k' does not take this problem: {reason}")
    if p.M == 0 or p.N == 0 or p.groups == 0:
        return
    cfg = dict(config_ or config(p))
    warps, stages = cfg.pop("num_warps", 8), cfg.pop("num_stages", TMA_K_STAGES)
    per_sm = cfg.pop("PROGRAMS_PER_SM", 1)
    units = p.groups * cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    programs = min(units, 1 if interpreting() else per_sm * sm_count(p.out.device))
    a, b, out, bias = p.a, p.b, p.out, p.bias
    c = (0, 0)
    if bias is not None:
        c = (bias.stride(0), bias.stride(1)) if bias.dim() == 2 else (0, bias.stride(0))
    ensure_allocator()
    args = (a, b, out, bias if bias is not None else out, p.offs, p.groups, p.M, p.N, p.K, programs,
            _k_stride(a.T), _k_stride(b), out.stride(0), out.stride(1), out.stride(2), *c)
    flags = dict(HAS_BIAS=bias is not None, UPCAST=interpreting() and p.dtype == torch.bfloat16, STAGES=stages,
                 **cfg, num_warps=warps, num_stages=stages)
    launch(grouped_tma_k_kernel, (programs,), args, flags)
