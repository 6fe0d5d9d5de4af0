"""Promoted fp8 GEMM on Hopper written in Gluon: the promotion add overlaps the next K step's MMAs.

fp8 products on Hopper's tensor cores accumulate with fewer bits than fp32, so (like ``torch._scaled_mm``
without ``use_fast_accum``) every 128-wide K step's MMAs go into a fresh partial tile that is then added
into the fp32 accumulator. In Triton 3.6 ``tl.dot(..., max_num_imprecise_acc=BLOCK_K)`` makes each warp
group wait for its MMAs before that add, so the tensor cores idle during every add (docs/rungs/persistent_tma.md).

Gluon (Triton's lower-level dialect) lets the kernel say which MMAs it waits for. Here K steps alternate
between two partial tiles: step k's MMAs are issued into one, then the kernel waits only for step k-1's
(``warpgroup_mma_wait(1)``) and adds that partial while step k runs. Same arithmetic, same order of adds
(the gain: docs/rungs/persistent_tma.md).

Two kernels, both persistent grids walking 128x128 tiles in grouped order, tiles loaded by TMA into a
ring of ``STAGES`` shared-memory slots, the output stored through TMA, two warp groups of 64 rows each
doing the MMAs. A partial tile costs 64 registers a thread, so the double-buffered partials fit beside the
accumulator (about 205 registers, no spills); a 128x256 tile would not.

- ``matmul_fp8_overlap_kernel``: one partition of eight warps that also issue the loads (a tile's first
  K steps go out before the previous tile's epilogue). Triton fences each TMA load with CTA-wide
  ``bar.sync``s, which hold the two warp groups in step: both wait for their MMAs and add at the same time.
- ``matmul_fp8_ws_kernel`` (configs with ``WS``): warp-specialized. A producer warp group keeps the ring
  full; each consumer warp group waits only on mbarriers ("ready" per slot, and an "empty" barrier both
  consumers arrive on once their MMAs have read a slot), so one can add its partial while the other's MMAs
  run. Its TMA descriptors are made on the host (:func:`descriptors`) and passed as kernel parameters:
  made by each partition on the device, they cost GPU time before the first load. Its speed, and that of a
  two-CTA cluster variant (cuBLAS's schedule, slower here): docs/rungs/persistent_tma.md.

Both take A row-major and B column-major (both K-major, the layout ``torch._scaled_mm`` takes),
TMA-aligned, 2-D; :func:`why_not` says when. The ``persistent_tma`` rung times both among its candidates for
such problems, on sm_90 with Triton 3.6 only (Gluon is experimental and its API moves between versions).
Gluon has no interpreter: the suite compiles them for sm_90 without a GPU, and the GPU tests run them.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from tilegemm.core.hardware import HOPPER_SMEM_PER_BLOCK
from tilegemm.jit.helpers import epilogue_tile, tile_order, tile_origin
from tilegemm.jit.gluon import host_descriptor
from tilegemm.ops.matmul.gluon_f16 import fill_ring
from tilegemm.ops.matmul.problem import GemmProblem
from tilegemm.core.runtime import cdiv

BLOCK_M = BLOCK_N = BLOCK_K = 128
NUM_WARPS = 8  # two warp groups, 64 rows of the tile each
CONFIG_KEY = "GLUON_FP8"  # marks this kernel's configs among persistent_tma's candidates


@gluon.jit
def _load_step(count, kstep, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES: gl.constexpr,
               BK: gl.constexpr, pred):
    """TMA loads of K step ``kstep`` of the tile at (m0, n0) into ring slot ``count % STAGES`` when ``pred``;
    returns the count of loads issued so far."""
    slot = count % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [m0, kstep * BK], bar, a_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(b_desc, [n0, kstep * BK], bar, b_bufs.index(slot), pred)
    return count + pred.to(gl.int32)


@gluon.jit
def _issue_mma(count, partial, ready, a_bufs, b_bufs, STAGES: gl.constexpr, ROW0: gl.constexpr,
               ROWS: gl.constexpr):
    """Wait for ring slot ``count % STAGES`` to land, then issue the MMAs of its A rows ROW0 ... ROW0 + ROWS
    into ``partial`` (from zero), without waiting for them. Returns the next count and the in-flight partial."""
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    a = a_bufs.index(slot).slice(ROW0, ROWS)
    partial = warpgroup_mma(a, b_bufs.index(slot).permute((1, 0)), partial, use_acc=False, is_async=True)
    return count + 1, partial


@gluon.jit
def _scalar_scales(alpha, scale_a_ptr, scale_b_ptr, SCALAR_A: gl.constexpr, SCALAR_B: gl.constexpr):
    """alpha times the per-tensor scales (``SCALAR_A`` / ``SCALAR_B``), loaded once per program.

    A per-tensor scale reaches the shared epilogue as a stride-0 vector, which every tile's epilogue
    loaded again (34 loads a warp, their latency between the tile's last MMA and its store). Folded into
    alpha here, the epilogue does one multiply (the gain: docs/rungs/persistent_tma.md)."""
    scale = alpha
    if SCALAR_A:
        scale = scale * gl.load(scale_a_ptr).to(gl.float32)
    if SCALAR_B:
        scale = scale * gl.load(scale_b_ptr).to(gl.float32)
    return scale


@gluon.jit
def matmul_fp8_overlap_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_am, stride_bn, stride_om,
    stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
    alpha, beta,
    HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr, SCALAR_A: gl.constexpr, SCALAR_B: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, num_warps: gl.constexpr,
):
    # A is [M, K] and B is given as its transpose [N, K], both with K contiguous (what wgmma reads for fp8).
    a_ty: gl.constexpr = a_ptr.dtype.element_ty
    b_ty: gl.constexpr = b_ptr.dtype.element_ty
    o_ty: gl.constexpr = out_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], a_ty)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], b_ty)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], o_ty)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], b_layout)
    o_desc = tma.make_tensor_descriptor(out_ptr, [M, N], [stride_om, 1], [BLOCK_M, BLOCK_N], o_layout)
    # Warps stacked along M: each warp group owns 64 rows and issues m64 x n128 x k32 MMAs.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])

    a_bufs = gl.allocate_shared_memory(a_ty, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_ty, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    o_smem = gl.allocate_shared_memory(o_ty, [BLOCK_M, BLOCK_N], o_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    steps = gl.cdiv(K, BLOCK_K)
    scale = _scalar_scales(alpha, scale_a_ptr, scale_b_ptr, SCALAR_A, SCALAR_B)
    # Loads run AHEAD K steps in front of the MMAs. The slot a load fills was last read by the MMAs of
    # two steps back, which have been waited for by then (at most one step's MMAs are in flight).
    AHEAD: gl.constexpr = STAGES - 2
    loads = 0
    mmas = 0
    m0, n0 = tile_origin(gl.program_id(0), tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
    for i in gl.static_range(AHEAD):
        loads = _load_step(loads, i, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K, i < steps)
    for tile in range(gl.program_id(0), tiles, NUM_SMS):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        # The two partial tiles (their registers; every MMA into them starts from zero). Made per tile, so
        # they are dead during the epilogue.
        p0 = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        p1 = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        loads = _load_step(loads, AHEAD, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K,
                           AHEAD < steps)
        mmas, q0 = _issue_mma(mmas, p0, ready, a_bufs, b_bufs, STAGES, 0, BLOCK_M)
        # Two K steps per iteration, so each partial tile keeps its registers: while one step's MMAs run
        # into one partial, the other partial (the step before) is waited for and added.
        for j in range((steps - 1) // 2):
            k1 = 2 * j + 1
            loads = _load_step(loads, k1 + AHEAD, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K,
                               k1 + AHEAD < steps)
            mmas, q1 = _issue_mma(mmas, p1, ready, a_bufs, b_bufs, STAGES, 0, BLOCK_M)
            p0 = warpgroup_mma_wait(1, deps=(q0,))
            acc += p0
            loads = _load_step(loads, k1 + 1 + AHEAD, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES,
                               BLOCK_K, k1 + 1 + AHEAD < steps)
            mmas, q0 = _issue_mma(mmas, p0, ready, a_bufs, b_bufs, STAGES, 0, BLOCK_M)
            p1 = warpgroup_mma_wait(1, deps=(q1,))
            acc += p1
        if (steps - 1) % 2 == 1:  # one K step left over
            mmas, q1 = _issue_mma(mmas, p1, ready, a_bufs, b_bufs, STAGES, 0, BLOCK_M)
            p0 = warpgroup_mma_wait(1, deps=(q0,))
            acc += p0
            p1 = warpgroup_mma_wait(0, deps=(q1,))
            acc += p1
        else:
            p0 = warpgroup_mma_wait(0, deps=(q0,))
            acc += p0

        # The next tile's first loads go out before this tile's epilogue, so they overlap it.
        out_m0 = m0
        out_n0 = n0
        m0, n0 = tile_origin(tile + NUM_SMS, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        for i in gl.static_range(AHEAD):
            loads = _load_step(loads, i, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K,
                               (i < steps) & (tile + NUM_SMS < tiles))

        offs_m = out_m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        offs_n = out_n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        acc = epilogue_tile(acc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                            stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, scale, beta,
                            HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B)
        tma.store_wait(pendings=0)  # the previous tile's store has left o_smem
        o_smem.store(acc.to(o_ty))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [out_m0, out_n0], o_smem)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _ws_consumer(a_bufs, b_bufs, o_bufs, ready, empty, o_desc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                 M, N, K, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                 HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
                 HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr, SCALAR_A: gl.constexpr,
                 SCALAR_B: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr, SERPENTINE: gl.constexpr, NUM_SMS: gl.constexpr, WG: gl.constexpr):
    """Warp group ``WG`` (0 or 1): the MMAs, promotion and epilogue of rows WG * BLOCK_M / 2 ... of every
    tile of this program; ``o_desc`` describes the output in [BLOCK_M / 2, BLOCK_N] blocks.

    ``SCALAR_A`` / ``SCALAR_B``: that scale is one number (per tensor), folded into alpha
    (:func:`_scalar_scales`); ``HAS_SCALE_A`` / ``HAS_SCALE_B`` say whether a per-row / per-column vector
    is left to apply."""
    ROWS: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = WG * ROWS
    o_smem = o_bufs.index(WG)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    steps = gl.cdiv(K, BLOCK_K)
    scale = _scalar_scales(alpha, scale_a_ptr, scale_b_ptr, SCALAR_A, SCALAR_B)
    count = 0
    for tile in range(gl.program_id(0), tiles, NUM_SMS):
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        p0 = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        p1 = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        prev = count % STAGES
        count, q0 = _issue_mma(count, p0, ready, a_bufs, b_bufs, STAGES, ROW0, ROWS)
        # As in the one-partition kernel: two K steps an iteration, so each partial keeps its registers.
        # Once step k's MMAs are issued, step k - 1's are waited for, its slot is released to the producer
        # (both warp groups arrive) and its partial is added while step k runs.
        for j in range((steps - 1) // 2):
            cur = count % STAGES
            count, q1 = _issue_mma(count, p1, ready, a_bufs, b_bufs, STAGES, ROW0, ROWS)
            p0 = warpgroup_mma_wait(1, deps=(q0,))
            mbarrier.arrive(empty.index(prev), count=1)
            acc += p0
            prev = cur
            cur = count % STAGES
            count, q0 = _issue_mma(count, p0, ready, a_bufs, b_bufs, STAGES, ROW0, ROWS)
            p1 = warpgroup_mma_wait(1, deps=(q1,))
            mbarrier.arrive(empty.index(prev), count=1)
            acc += p1
            prev = cur
        if (steps - 1) % 2 == 1:  # one K step left over
            cur = count % STAGES
            count, q1 = _issue_mma(count, p1, ready, a_bufs, b_bufs, STAGES, ROW0, ROWS)
            p0 = warpgroup_mma_wait(1, deps=(q0,))
            mbarrier.arrive(empty.index(prev), count=1)
            acc += p0
            p1 = warpgroup_mma_wait(0, deps=(q1,))
            mbarrier.arrive(empty.index(cur), count=1)
            acc += p1
        else:
            p0 = warpgroup_mma_wait(0, deps=(q0,))
            mbarrier.arrive(empty.index(prev), count=1)
            acc += p0
        _ws_epilogue(acc, tile, tiles_m, tiles_n, o_smem, o_desc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                     M, N, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, scale, beta,
                     HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, BLOCK_M, BLOCK_N, GROUP_M,
                     SERPENTINE, WG)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_epilogue(acc, tile, tiles_m, tiles_n, o_smem, o_desc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N,
                 stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, scale, beta,
                 HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
                 HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, SERPENTINE: gl.constexpr,
                 WG: gl.constexpr):
    """A consumer warp group's rows of tile ``tile``: the epilogue on ``acc``, stored through TMA."""
    ROWS: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = WG * ROWS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    m0, n0 = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N, SERPENTINE)
    offs_m = m0 + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    acc = epilogue_tile(acc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                        stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, scale, beta,
                        HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B)
    tma.store_wait(pendings=0)  # this warp group's previous store has left its buffer
    o_smem.store(acc.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [m0 + ROW0, n0], o_smem)


@gluon.jit
def matmul_fp8_ws_kernel(
    a_desc, b_desc, o_desc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
    alpha, beta,
    HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr, SCALAR_A: gl.constexpr, SCALAR_B: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, SERPENTINE: gl.constexpr, NUM_SMS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    # The descriptors are made on the host (:func:`descriptors`) and arrive as kernel parameters: A as
    # [M, K], B as its transpose [N, K], the output as [M, N] in half-tile blocks. Made on the device
    # instead (each partition its own: a device-made descriptor is fenced for the warp that made it),
    # they cost each launch GPU time before the first load (docs/rungs/persistent_tma.md).
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2, BLOCK_M // 2, BLOCK_N], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warp groups release a slot
    gl.warp_specialize([
        (_ws_consumer, (a_bufs, b_bufs, o_bufs, ready, empty, o_desc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                        M, N, K, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                        HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, SCALAR_A, SCALAR_B,
                        BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SERPENTINE, NUM_SMS, 0)),
        (_ws_consumer, (a_bufs, b_bufs, o_bufs, ready, empty, o_desc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                        M, N, K, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                        HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, SCALAR_A, SCALAR_B,
                        BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SERPENTINE, NUM_SMS, 1)),
        # The producer warp group: gluon_f16's loop, with A as [M, K] and B as [N, K] (B_T).
        (fill_ring, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_SMS,
                     False, True, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SERPENTINE)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# --- host side ---------------------------------------------------------------------------------------------



def configs(out_element_size: int) -> list[dict]:
    """Both kernels at the ring depths that fit beside the output tile in shared memory (a stage is 32 KB
    of A and B; the warp-specialized kernel's two 64-row output buffers take the bytes of one 128-row
    tile). ``WS`` marks the warp-specialized kernel; its ``num_warps`` counts the first consumer warp group,
    the other two warp groups are added by ``gl.warp_specialize``."""
    out_bytes = BLOCK_M * BLOCK_N * out_element_size
    depths = [s for s in (4, 5, 6) if s * (BLOCK_M + BLOCK_N) * BLOCK_K + out_bytes + 1024 <= HOPPER_SMEM_PER_BLOCK]
    return ([dict(GLUON_FP8=True, STAGES=s, num_warps=NUM_WARPS) for s in depths]
            + [dict(GLUON_FP8=True, WS=True, STAGES=s, num_warps=4) for s in depths])


# Registers a thread asks for (setmaxnreg) in the warp-specialized kernel: each consumer warp group holds
# its 64-row accumulator and two partials (192 a thread, about 205 in all); the producer needs few.
# 2 * 128 * 232 + 128 * 40 <= 65536.
WS_CONSUMER_REGS = 232
WS_PRODUCER_REGS = 40

# The warp-specialized kernel's tile order: bands of 12 tile rows, every other band walked right to left
# (jit_helpers.tile_grouped). Under sustained load the H200 holds these GEMMs at its 700 W limit, and the
# SM clock falls with the DRAM and L2 traffic a tile order causes: against bands of 8 walked one way, this
# order ran 1.6% faster at 8192^3 and 0.3% at 16384^3 (bands of 32: 6% slower); tools/profile_counters.py.
# A config may still set GROUP_M and SERPENTINE (explorations do).
WS_GROUP_M = 12


def why_not(p: GemmProblem) -> str | None:
    """None when this kernel takes the problem (given that TMA can describe it); otherwise why not."""
    if not p.dtype.is_floating_point or p.a.element_size() != 1:
        return "not an fp8 problem"
    if p.fast_accum:
        return "fast accumulation needs no promotion (the Triton kernel is as fast)"
    if p.batch != 1:
        return "batched"
    if p.a_strides[2] != 1 or p.b_strides[1] != 1:
        return "needs A row-major and B column-major (K contiguous in both)"
    return None


def descriptors(p: GemmProblem):
    """Host-side TMA descriptors for the warp-specialized kernel: A as [M, K], B as its transpose [N, K]
    (both K-major, :func:`why_not`), the output as [M, N] in [BLOCK_M / 2, BLOCK_N] blocks (one per consumer
    warp group)."""
    a, b = (host_descriptor(*box) for box in p.tma_boxes(BLOCK_M, BLOCK_N, BLOCK_K))
    return a, b, host_descriptor(p.out, [p.M, p.N], p.out_strides[1], [BLOCK_M // 2, BLOCK_N])


def launch_args(p: GemmProblem, cfg: dict, num_sms: int):
    """(kernel, grid, args, constexpr kwargs) for :func:`tilegemm.core.launch.launch`."""
    grid = (min(num_sms, cdiv(p.M, BLOCK_M) * cdiv(p.N, BLOCK_N)),)
    flags = p.kernel_flags()
    epilogue = (p.c_strides[1], p.c_strides[2], p.bias_stride, p.scale_a_stride, p.scale_b_stride, p.alpha, p.beta)
    # A per-tensor scale (stride 0) is folded into alpha in the kernel (_scalar_scales); only vectors are
    # left for the epilogue.
    scalar_a = flags["HAS_SCALE_A"] and p.scale_a_stride == 0
    scalar_b = flags["HAS_SCALE_B"] and p.scale_b_stride == 0
    ws = bool(cfg.get("WS"))
    kwargs = dict(HAS_C=flags["HAS_C"], HAS_BIAS=flags["HAS_BIAS"], ACTIVATION=p.activation,
                  HAS_SCALE_A=flags["HAS_SCALE_A"] and not scalar_a, SCALAR_A=scalar_a,
                  HAS_SCALE_B=flags["HAS_SCALE_B"] and not scalar_b, SCALAR_B=scalar_b,
                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=cfg["STAGES"],
                  GROUP_M=cfg.get("GROUP_M", 8), NUM_SMS=num_sms, num_warps=cfg["num_warps"])
    if ws:
        args = (*descriptors(p), *p.epilogue_pointers(), p.M, p.N, p.K, *epilogue)
        kwargs.update(**tile_order(cfg, WS_GROUP_M, True), PRODUCER_WARPS=cfg.get("PRODUCER_WARPS", 4),
                      CONSUMER_REGS=WS_CONSUMER_REGS, PRODUCER_REGS=WS_PRODUCER_REGS)
        return matmul_fp8_ws_kernel, grid, args, kwargs
    args = (p.a, p.b, p.out, *p.epilogue_pointers(), p.M, p.N, p.K,
            p.a_strides[1], p.b_strides[2], p.out_strides[1], *epilogue)
    return matmul_fp8_overlap_kernel, grid, args, kwargs
