"""What the W4A16 Triton kernels share: the K step within a group, the split-K workspace, the last-arrival reduction."""

from __future__ import annotations

import torch
import triton

from tilegemm.core.workspace import split_workspace
from tilegemm.jit.helpers import apply_activation

import triton.language as tl  # noqa: E402


def block_k_for(block_k: int, group_k: int, K: int) -> int:
    """BLOCK_K for a config: every K step lies in one group (one row of scales per step), so BLOCK_K
    divides the group length; with one group for all of K any power of two does (K is masked)."""
    if group_k >= K:
        return block_k
    while group_k % block_k:
        block_k //= 2
    return block_k


def workspace(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial-sum planes and int32 arrival counters for split-K (:mod:`tilegemm.core.workspace`)."""
    return split_workspace(device, floats, counters)


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
               HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """out[offs_m, offs_n] = activation(acc + bias), masked to [M, N]; ``acc`` fp32 [BM, BN]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_and_store(acc, out_ptr, bias_ptr, ws_ptr, count_ptr, tile, split, offs_m, offs_n, M, N, stride_om,
                     HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT_K):
    """Split-K: hand this slice's partial tile over; the program that arrives last at the tile adds the
    slices in order (deterministic) and stores the result. Without split, store at once."""
    if SPLIT_K == 1:
        store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, ACTIVATION)
    else:
        inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # planes are [M, N], row-major
        tl.store(ws_tile + split * M * N, acc, mask=inside)
        # A scalar atomic runs on one thread: the barrier puts every thread's stores before its release.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()  # and every thread's loads after the acquire
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(ws_tile + s * M * N, mask=inside, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            store_tile(total, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, ACTIVATION)
