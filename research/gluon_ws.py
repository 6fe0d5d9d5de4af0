"""16-bit GEMM on Hopper in Gluon, warp-specialized: a producer warp group loads, two consumer warp groups
take turns at the MMAs. An exploration kernel: no rung launches it (see the end of this docstring).

In ``persistent_tma`` (Triton) every warp of a program does everything: it issues the TMA loads, waits,
issues the MMAs, and runs the epilogue, during which the tensor cores have nothing to do. Here the warps
of a program split the work three ways (``gl.warp_specialize``):

- a producer warp group (4 warps, few registers) walks the program's tiles and K steps and keeps a ring of
  ``STAGES`` shared-memory slots filled through TMA; each slot has a "ready" barrier (the copies landed)
  and an "empty" barrier (its MMAs have read it);
- two consumer warp groups own alternate tiles of the program (tile 0, 2, 4... and tile 1, 3, 5...), each a
  whole ``BLOCK_M x BLOCK_N`` tile with its own accumulator.

The consumers take turns at the K loop (a pair of "turn" barriers): while one warp group runs its tile's
MMAs the other runs its epilogue (fused ops, conversion, TMA store), and the tensor cores stay busy across
tile boundaries (the "ping-pong" schedule). Each consumer keeps one MMA group in flight
(``warpgroup_mma_wait(1)``) and frees the slot of the step before.

Layouts: 16-bit wgmma reads either operand order from shared memory, so A and B may each be row- or
column-major (NN/NT/TN/TT), described to TMA as they lie. The output goes through shared memory and TMA,
so this kernel takes 16-bit outputs only (two output tiles of fp32 do not fit beside the ring).
:func:`usable` says when it applies (TMA must also describe the operands: ``persistent_tma.describable``).

Measured on an H200 it beat ``persistent_tma`` only at 2048^3 (fp16 NN 0.97x of cuBLAS against 0.90x) and
lost from 4096^3 up (0.93x-0.97x against 0.96x-1.02x), so it is not among any rung's candidates;
``research/explore_gluon_ws.py`` times it (docs/rungs/persistent_tma.md has the numbers and what it took
to make it run). Written against Triton 3.6's Gluon API, for sm_90. Gluon has no interpreter: the suite
compiles it for sm_90 without a GPU, the GPU tests run it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from tilegemm.core.hardware import HOPPER_SMEM_PER_BLOCK
from tilegemm.jit.helpers import epilogue_tile, tile_grouped
from tilegemm.ops.matmul.gluon_f16 import fill_ring, host_descriptor
from tilegemm.ops.matmul.problem import GemmProblem

BLOCK_K = 64
# Registers a thread asks for (setmaxnreg) in the second consumer warp group and in the producer's. The
# program starts with 168 a thread (64K over 12 warps); Triton gives the default partition (the first
# consumer) what the other two leave: 3 * 168 - 232 - 40 = 232. ptxas still compiles every partition
# within 168, so the accumulator (128 a thread) leaves 40 for the rest.
CONSUMER_REGS = 232
PRODUCER_REGS = 40


@gluon.jit
def _operands(a_bufs, b_bufs, slot, A_T: gl.constexpr, B_T: gl.constexpr):
    """Slot ``slot``'s tiles as the [BM, BK] and [BK, BN] views the MMA reads."""
    a = a_bufs.index(slot)
    b = b_bufs.index(slot)
    if A_T:
        a = a.permute((1, 0))
    if B_T:
        b = b.permute((1, 0))
    return a, b


@gluon.jit
def _consumer(a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, M, N, K, programs,
              c_ptr, bias_ptr, stride_cm, stride_cn, stride_bias, alpha, beta,
              HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
              A_T: gl.constexpr, B_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, WG: gl.constexpr):
    """Warp group ``WG`` (0 or 1): MMAs and epilogue of this program's tiles number WG, WG + 2, ..."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    o_ty: gl.constexpr = o_desc.dtype
    o_smem = o_bufs.index(WG)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    count = WG * steps  # ring position of this warp group's first K step
    j = 0  # tiles this warp group has done
    for tile in range(gl.program_id(0) + WG * programs, tiles_m * tiles_n, 2 * programs):
        # Take turns at the K loop. Besides the ping-pong, this keeps a warp group from waiting on a ring
        # slot a whole lap ahead of the producer, where a barrier's phase parity would read as done.
        # (Warp group 0's first wait passes at once: a new barrier counts the phase before its first.)
        mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        a, b = _operands(a_bufs, b_bufs, slot, A_T, B_T)
        acc = warpgroup_mma(a, b, acc, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # waits for nothing (one group in flight): a tensor again
        for ks in range(1, steps):
            prev = slot
            count += 1
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            a, b = _operands(a_bufs, b_bufs, slot, A_T, B_T)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # Step ks - 1's MMAs are done once at most one group (step ks) is in flight: free its slot.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1)
        mbarrier.arrive(turn.index(1 - WG), count=1)  # all this tile's slots were waited for: the other's turn
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(slot), count=1)
        j += 1
        count += 1 + steps  # past this tile's last step and the other warp group's tile

        pid_m, pid_n = tile_grouped(tile, tiles_m, tiles_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        acc = epilogue_tile(acc, c_ptr, bias_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N,
                            stride_cm, stride_cn, stride_bias, 0, 0, alpha, beta,
                            HAS_C, HAS_BIAS, ACTIVATION, False, False)
        tma.store_wait(pendings=0)  # this warp group's previous store has left its buffer
        o_smem.store(acc.to(o_ty))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [m0, n0], o_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def matmul_ws_kernel(
    a_desc, b_desc, o_desc, c_ptr, bias_ptr,
    M, N, K,
    stride_cm, stride_cn, stride_bias,
    alpha, beta, programs,
    A_T: gl.constexpr, B_T: gl.constexpr,
    HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    # The descriptors come from the host (:func:`descriptors`), as the operands lie: A is [M, K] or (A_T)
    # [K, M]; B is [K, N] or (B_T) [N, K]. (A descriptor made on the device is fenced for the warp that
    # made it only; the producer's TMA copies then faulted or hung on an H200.)
    ty: gl.constexpr = a_desc.dtype
    o_ty: gl.constexpr = o_desc.dtype
    a_block: gl.constexpr = a_desc.block_type.shape
    b_block: gl.constexpr = b_desc.block_type.shape
    a_layout: gl.constexpr = a_desc.layout
    b_layout: gl.constexpr = b_desc.layout
    o_layout: gl.constexpr = o_desc.layout

    a_bufs = gl.allocate_shared_memory(ty, [STAGES] + a_block, a_layout)
    b_bufs = gl.allocate_shared_memory(ty, [STAGES] + b_block, b_layout)
    o_bufs = gl.allocate_shared_memory(o_ty, [2, BLOCK_M, BLOCK_N], o_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    # (The argument tuples are written out in the call: a tuple assigned to a name would turn its
    # constexprs into tensors.)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, M, N, K, programs,
                     c_ptr, bias_ptr, stride_cm, stride_cn, stride_bias, alpha, beta, HAS_C, HAS_BIAS, ACTIVATION,
                     A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, 0)),
        (_consumer, (a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, M, N, K, programs,
                     c_ptr, bias_ptr, stride_cm, stride_cn, stride_bias, alpha, beta, HAS_C, HAS_BIAS, ACTIVATION,
                     A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, 1)),
        (fill_ring, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, programs,
                     A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, False)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


# --- host side ---------------------------------------------------------------------------------------------

NUM_WARPS = 4  # the first consumer warp group; the second and the producer warp are added by warp_specialize


def _fits(bm: int, bn: int, stages: int) -> bool:
    ring = stages * (bm + bn) * BLOCK_K * 2
    return ring + 2 * bm * bn * 2 + 1024 <= HOPPER_SMEM_PER_BLOCK


def configs() -> list[dict]:
    """Tile shapes a warp group owns (128 fp32 accumulator registers a thread either way) and ring depths
    that fit beside the two output tiles."""
    out = []
    for bm, bn in ((128, 128), (64, 256)):
        for stages in (3, 4, 5):
            if _fits(bm, bn, stages):
                out.append(dict(GLUON_WS=True, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, num_warps=NUM_WARPS))
    return out


def usable(p: GemmProblem) -> str | None:
    """None when this kernel takes the problem (given that TMA can describe it); otherwise why not."""
    if p.a.dtype not in (torch.float16, torch.bfloat16):
        return "not a 16-bit problem"
    if p.out.element_size() != 2:
        return "needs a 16-bit output"
    if p.batch != 1:
        return "batched"
    if p.scale_a is not None or p.scale_b is not None:
        return "scales are for fp8"
    return None


def descriptors(p: GemmProblem, cfg: dict):
    """Host-side TMA descriptors of A, B and the output for config ``cfg``, as the operands lie
    (:attr:`GemmProblem.tma_view`)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    a, b = (host_descriptor(*box) for box in p.tma_boxes(bm, bn, BLOCK_K))
    return a, b, host_descriptor(p.out, [p.M, p.N], p.out_strides[1], [bm, bn])


def launch_args(p: GemmProblem, cfg: dict, num_sms: int):
    """(kernel, grid, args, constexpr kwargs) for :func:`tilegemm.core.launch.launch`."""
    a_t, b_t, _, _ = p.tma_view
    tiles = triton.cdiv(p.M, cfg["BLOCK_M"]) * triton.cdiv(p.N, cfg["BLOCK_N"])
    flags = p.kernel_flags()
    # Two tiles in flight per program (one per consumer warp group).
    grid = (min(num_sms, triton.cdiv(tiles, 2)),)
    c, bias, _, _ = p.epilogue_pointers()
    args = descriptors(p, cfg) + (
        c, bias, p.M, p.N, p.K, p.c_strides[1], p.c_strides[2], p.bias_stride, p.alpha, p.beta, grid[0],
    )
    kwargs = dict(A_T=a_t, B_T=b_t, HAS_C=flags["HAS_C"], HAS_BIAS=flags["HAS_BIAS"],
                  ACTIVATION=p.activation, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK_K,
                  STAGES=cfg["STAGES"], GROUP_M=8, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  num_warps=cfg["num_warps"])
    return matmul_ws_kernel, grid, args, kwargs
