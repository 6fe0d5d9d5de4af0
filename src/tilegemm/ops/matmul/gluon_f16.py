"""16-bit GEMM on Hopper in Gluon, warp-specialized and cooperative: a producer warp group loads, two
consumer warp groups share each output tile.

The layout cuBLAS runs for fp16/bf16 at 2048^3 and 4096^3 on an H200 (its kernel names, read with
``tools/cublas_kernels.py``: ``..._256x128_64x4_1x2_h_bz_coopA_NNT``) is a 256x128 tile whose two
consumer warp groups take 128 rows each. Per K step a warp group then reads a 128x64 slice of A and the
64x128 tile of B from shared memory, a fifth less than the 64x64 + 64x256 a warp group of a 128x256 tile
reads (what ``persistent_tma``'s Triton kernel runs).

- a producer warp group (40 registers a thread) walks the program's tiles in grouped order and keeps a
  ring of ``STAGES`` shared-memory slots filled through TMA; each slot has a "ready" barrier (its copies
  landed) and an "empty" barrier that needs both consumers' arrivals (both have read it);
- consumer warp group ``WG`` (0 or 1) takes rows ``WG * BLOCK_M / 2 ...`` of every tile: it waits on a
  slot's "ready" barrier, issues its MMAs, keeps one MMA group in flight and frees the slot before; then
  the epilogue (fused ops, conversion, TMA store of its half through its own shared-memory buffer).

The TMA descriptors are made on the host (:func:`descriptors`) and passed as kernel parameters; made
by each partition on the device (as until c56e370) they cost about 2 us a launch. A repeated call
replays its launch over the new tensors (:mod:`tilegemm.core.launch`). 16-bit wgmma reads either operand order
from shared memory, so A and B may each be row- or column-major (NN/NT/TN/TT), described to TMA as they lie
(:attr:`GemmProblem.tma_view`). Outputs are 16-bit (the output buffers sit beside the ring).

Batched products (``BATCHED``): the output and each batched operand are described in 3-D with a box of 1 along
the batch (:func:`batched_descriptors`; an operand broadcast over the batch keeps its 2-D descriptor), and the
programs walk (batch, tile) work units, each batch's tiles in the grouped order. Why and how:
docs/rungs/persistent_tma.md#batched-products-on-gluon_f16 (``auto`` takes them there behind
``dispatch.GLUON_F16_BATCHED``). Unbatched launches compile to the code they had before.

Its speed against cuBLAS and Triton's kernel: docs/rungs/persistent_tma.md. ``persistent_tma`` times its configs
beside Triton's for 16-bit problems (the H200 ships it at 4096^3). What cuBLAS has that this lacks: its two-CTA
clusters, which share operand loads through TMA multicast (not in Triton 3.6; measured by hand in the same doc).

Written against Triton 3.6's Gluon API, for sm_90. Gluon has no interpreter: the suite compiles it for
sm_90 without a GPU, the GPU tests run it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilegemm.core.hardware import ring_fits
from tilegemm.jit.gluon import (
    CONSUMER_REGS, PRODUCER_REGS, batched_host_descriptor, consume_k_steps, flat_slot, host_descriptor,
    release_ring_barriers, ring_barriers,
)
from tilegemm.jit.helpers import epilogue_tile, tile_order, tile_origin
from tilegemm.ops.matmul.problem import GemmProblem
from tilegemm.core.runtime import cdiv

BLOCK_K = 64
CONFIG_KEY = "GLUON_F16"  # marks this kernel's configs among persistent_tma's candidates
NUM_WARPS = 4  # the first consumer warp group; warp_specialize adds the second and the producer's



@gluon.jit
def fill_ring(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, programs,
              A_T: gl.constexpr, B_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SERPENTINE: gl.constexpr,
              batch=None, BATCHED: gl.constexpr = False, A_BATCHED: gl.constexpr = False,
              B_BATCHED: gl.constexpr = False):
    """A producer's loop (also :mod:`gluon_fp8`'s): every K step of every tile of this program (tiles
    program_id, program_id + programs, ... in grouped order) into ring slot ``count % STAGES``, once the
    slot's "empty" barrier says its previous contents were read; its "ready" barrier counts the bytes in.
    A is described as [M, K] or (A_T) [K, M], B as [K, N] or (B_T) [N, K]; ``SERPENTINE`` as in
    :func:`tilegemm.jit.helpers.tile_grouped` (the consumers must walk the same order).
    ``BATCHED``: ``batch`` products, walked as (batch, tile) work units (:func:`_work_unit`); A (A_BATCHED) and
    B (B_BATCHED) are then described in 3-D ([batch, rows, cols], a box of 1 along the batch), or in 2-D where
    broadcast over the batch. Unbatched callers pass none of these (None and False are constexprs)."""
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m, tiles_n, steps, first, units = _work_units(M, N, K, batch, BLOCK_M, BLOCK_N, BLOCK_K, BATCHED)
    count = 0
    for unit in range(first, units, programs):
        bid, tile = _work_unit(unit, tiles_m * tiles_n, BATCHED)
        m0, n0 = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N, SERPENTINE)
        for ks in range(steps):
            slot = count % STAGES
            # The slot's previous contents (step count - STAGES) were read. A new barrier counts as having
            # completed the phase before its first, so the first lap does not wait.
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            k0 = ks * BLOCK_K
            if A_BATCHED:
                if A_T:
                    tma.async_copy_global_to_shared(a_desc, [bid, k0, m0], bar, a_bufs.index(slot))
                else:
                    tma.async_copy_global_to_shared(a_desc, [bid, m0, k0], bar, a_bufs.index(slot))
            elif A_T:
                tma.async_copy_global_to_shared(a_desc, [k0, m0], bar, a_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(a_desc, [m0, k0], bar, a_bufs.index(slot))
            if B_BATCHED:
                if B_T:
                    tma.async_copy_global_to_shared(b_desc, [bid, n0, k0], bar, b_bufs.index(slot))
                else:
                    tma.async_copy_global_to_shared(b_desc, [bid, k0, n0], bar, b_bufs.index(slot))
            elif B_T:
                tma.async_copy_global_to_shared(b_desc, [n0, k0], bar, b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [k0, n0], bar, b_bufs.index(slot))
            count += 1


@gluon.jit
def _work_units(M, N, K, batch, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                BATCHED: gl.constexpr):
    """(tiles_m, tiles_n, K steps, this program's first work unit, the work units) of the producer's and the
    consumers' loops: a unit a tile, or (``BATCHED``) a (batch, tile) pair."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    first = gl.program_id(0)  # (read before the count of units, as the unbatched loop always did)
    if BATCHED:
        units = tiles_m * tiles_n * batch
    else:
        units = tiles_m * tiles_n
    return tiles_m, tiles_n, steps, first, units


@gluon.jit
def _work_unit(unit, tiles, BATCHED: gl.constexpr):
    """(batch, tile within the batch) of work unit ``unit`` (unbatched: (0, unit)): units are numbered
    batch-major, so the programs at work at once walk one batch's tiles in grouped order and share its operands
    in L2."""
    if BATCHED:
        bid = unit // tiles
        tile = unit - bid * tiles
    else:
        bid = 0
        tile = unit
    return bid, tile


@gluon.jit
def _consumer(a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, c_ptr, bias_ptr,
              M, N, K, stride_cm, stride_cn, stride_bias, alpha, beta,
              HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
              A_T: gl.constexpr, B_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SERPENTINE: gl.constexpr,
              NUM_SMS: gl.constexpr, SHARED_OUT: gl.constexpr, WG: gl.constexpr,
              batch=None, stride_cb=None, BATCHED: gl.constexpr = False, A_BATCHED: gl.constexpr = False,
              B_BATCHED: gl.constexpr = False):
    """Warp group ``WG`` (0 or 1): the MMAs and epilogue of rows WG * BLOCK_M / 2 ... of every tile. With
    ``SHARED_OUT`` the two warp groups take turns at one output buffer (``turn`` barriers), which leaves
    room for a fourth ring slot. ``o_desc`` describes the output in [BLOCK_M / 2, BLOCK_N] blocks
    (``BATCHED``: in 3-D, [batch, M, N] in [1, BLOCK_M / 2, BLOCK_N] boxes; C read at batch stride ``stride_cb``)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = WG * ROWS
    o_ty: gl.constexpr = o_desc.dtype
    if BATCHED:
        o_box = o_bufs.index(0 if SHARED_OUT else WG)  # [1, ROWS, BLOCK_N], what the 3-D store takes
        o_smem = flat_slot(o_bufs, 0 if SHARED_OUT else WG, ROWS, BLOCK_N, True)  # the same bytes as a 2-D tile
    else:
        o_smem = o_bufs.index(0 if SHARED_OUT else WG)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    tiles_m, tiles_n, steps, first, units = _work_units(M, N, K, batch, BLOCK_M, BLOCK_N, BLOCK_K, BATCHED)
    count = 0
    j = 0  # tiles done
    for unit in range(first, units, NUM_SMS):
        bid, tile = _work_unit(unit, tiles_m * tiles_n, BATCHED)
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc, count = consume_k_steps(a_bufs, b_bufs, ready, empty, acc, count, steps, ROW0, ROWS, A_T, B_T, STAGES,
                                     A_BATCHED, B_BATCHED)

        m0, n0 = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N, SERPENTINE)
        offs_m = m0 + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        c_tile = c_ptr
        if BATCHED:
            if HAS_C:
                c_tile = c_ptr + bid.to(gl.int64) * stride_cb  # (a C broadcast over the batch: stride 0)
        acc = epilogue_tile(acc, c_tile, bias_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N,
                            stride_cm, stride_cn, stride_bias, 0, 0, alpha, beta,
                            HAS_C, HAS_BIAS, ACTIVATION, False, False)
        if SHARED_OUT:
            # Warp group 0 goes first in every tile (its first wait passes: a new barrier counts the phase
            # before its first); each hands the buffer on once its store has read it.
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
            o_smem.store(acc.to(o_ty))
            fence_async_shared()
            if BATCHED:
                tma.async_copy_shared_to_global(o_desc, [bid, m0 + ROW0, n0], o_box)
            else:
                tma.async_copy_shared_to_global(o_desc, [m0 + ROW0, n0], o_smem)
            tma.store_wait(pendings=0)
            mbarrier.arrive(turn.index(1 - WG), count=1)
        else:
            tma.store_wait(pendings=0)  # this warp group's previous store has left its buffer
            o_smem.store(acc.to(o_ty))
            fence_async_shared()
            if BATCHED:
                tma.async_copy_shared_to_global(o_desc, [bid, m0 + ROW0, n0], o_box)
            else:
                tma.async_copy_shared_to_global(o_desc, [m0 + ROW0, n0], o_smem)
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def matmul_f16_coop_kernel(
    a_desc, b_desc, o_desc, c_ptr, bias_ptr,
    M, N, K,
    stride_cm, stride_cn, stride_bias,
    alpha, beta,
    A_T: gl.constexpr, B_T: gl.constexpr,
    HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, SERPENTINE: gl.constexpr, NUM_SMS: gl.constexpr, SHARED_OUT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    batch=None, stride_cb=None, BATCHED: gl.constexpr = False, A_BATCHED: gl.constexpr = False,
    B_BATCHED: gl.constexpr = False,
):
    # The descriptors are made on the host (:func:`descriptors`): A as [M, K] or (A_T) [K, M], B as [K, N]
    # or (B_T) [N, K], the output as [M, N] in [BLOCK_M / 2, BLOCK_N] blocks. The ring's slots take the
    # descriptors' swizzled layouts.
    # BATCHED (:func:`batched_descriptors`): ``batch`` products walked as (batch, tile) work units; the output,
    # and A (A_BATCHED) and B (B_BATCHED) unless broadcast over the batch, are described in 3-D with a box of
    # 1 along the batch, so a tile never crosses into the next batch and TMA clips each batch's edges. Their
    # slots are [1, rows, cols] boxes (read as 2-D tiles: :func:`~tilegemm.jit.gluon.flat_slot`). Unbatched launches pass none of this
    # (None and False are constexprs), so they compile to the code they compiled to before.
    if A_BATCHED:
        if A_T:
            a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 1, BLOCK_K, BLOCK_M], a_desc.layout)
        else:
            a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 1, BLOCK_M, BLOCK_K], a_desc.layout)
    elif A_T:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_K, BLOCK_M], a_desc.layout)
    else:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if B_BATCHED:
        if B_T:
            b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 1, BLOCK_N, BLOCK_K], b_desc.layout)
        else:
            b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 1, BLOCK_K, BLOCK_N], b_desc.layout)
    elif B_T:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    if BATCHED:
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [1 if SHARED_OUT else 2, 1, BLOCK_M // 2, BLOCK_N],
                                           o_desc.layout)
    else:
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [1 if SHARED_OUT else 2, BLOCK_M // 2, BLOCK_N],
                                           o_desc.layout)
    ready, empty, turn = ring_barriers(STAGES)
    # (The argument tuples are written out in the call: a tuple assigned to a name would turn its
    # constexprs into tensors.)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, c_ptr, bias_ptr,
                     M, N, K, stride_cm, stride_cn, stride_bias, alpha, beta,
                     HAS_C, HAS_BIAS, ACTIVATION, A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SERPENTINE,
                     NUM_SMS, SHARED_OUT, 0, batch, stride_cb, BATCHED, A_BATCHED, B_BATCHED)),
        (_consumer, (a_bufs, b_bufs, o_bufs, ready, empty, turn, o_desc, c_ptr, bias_ptr,
                     M, N, K, stride_cm, stride_cn, stride_bias, alpha, beta,
                     HAS_C, HAS_BIAS, ACTIVATION, A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SERPENTINE,
                     NUM_SMS, SHARED_OUT, 1, batch, stride_cb, BATCHED, A_BATCHED, B_BATCHED)),
        (fill_ring, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_SMS,
                     A_T, B_T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SERPENTINE,
                     batch, BATCHED, A_BATCHED, B_BATCHED)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    release_ring_barriers(ready, empty, turn, STAGES)


# --- host side ---------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N) -> its (ring depth, SHARED_OUT) configs. A consumer warp group holds 128 accumulator
# registers a thread in the first two tiles, 64 in the 128x128 one (for problems of one to two such tiles
# per SM; a 128x64 tile trailed autotuned and is not offered: docs/rungs/persistent_tma.md). A 256x128 tile has 3 stages of 48 KB beside two output buffers, 4 beside
# one the warp groups take turns at; the 128x128 tile 6 of 32 KB beside two.
TILES = {(256, 128): ((3, False), (4, True)), (128, 256): ((3, False), (4, True)), (128, 128): ((6, False),)}
# Tile order of a tile shape (GROUP_M, SERPENTINE; others 8, False: jit_helpers.tile_grouped). The 132
# programs at work at once cover about GROUP_M rows of tiles by 132 / GROUP_M columns; for 128x256 tiles 16
# rows make that footprint square (16 x 128 rows of A, 8 x 256 columns of B: 32 MB of operands at 4096^3
# against 41 MB in bands of 8), and serpentine bands start on the panels of B the band before left in L2
# (the gain: docs/rungs/persistent_tma.md).
ORDER = {(128, 256): (16, True)}


def _fits(bm: int, bn: int, stages: int, shared_out: bool, bk: int = BLOCK_K) -> bool:
    return ring_fits(bm, bn, bk, stages, bm * bn * 2 // (2 if shared_out else 1))


def configs(out_element_size: int = 2) -> list[dict]:
    """The :data:`TILES` configs (the rings that fit beside their output buffers), in :data:`ORDER`'s tile order."""
    out = []
    for (bm, bn), depths in TILES.items():
        order = dict(zip(("GROUP_M", "SERPENTINE"), ORDER[bm, bn])) if (bm, bn) in ORDER else {}
        out += [dict(GLUON_F16=True, BLOCK_M=bm, BLOCK_N=bn, STAGES=s, SHARED_OUT=so, num_warps=NUM_WARPS, **order)
                for s, so in depths if _fits(bm, bn, s, so)]
    return out


# Batched products, untimed (:func:`batched_config`): a 128x128 tile is taken where it needs fewer waves of
# work units than the 32K-element tiles by this factor (its smaller tiles run each flop slower), and from
# BATCHED_LONG_K_STEPS K steps the 4-deep ring with the output buffer shared (the H200's pick at fp16 4096^3);
# shorter K keeps a buffer per warp group, so each store overlaps the next tile's MMAs (attention's S x S
# products over K = 64..128 are bound by their stores). Estimates, not fitted: tools/batched_candidates.py times them
# against each case's best config (docs/rungs/persistent_tma.md#batched-products-on-gluon_f16).
BATCHED_SMALL_TILE_SPEED = 0.85
BATCHED_LONG_K_STEPS = 32
# Batched outputs of at most this many columns take the 128x128 tile (0: off, a candidate of
# tools/grouped_rule_candidates.py with dispatch.GLUON_F16_BATCHED_NARROW on): one tile wide, a 256x128 tile reads
# B's panel once per 256 rows where a 128x128 one does per 128, but makes half the work units, and a 128x256 tile
# computes twice the columns there are
BATCHED_NARROW_SMALL_TILE_N = 0


def batched_config(p: GemmProblem, num_sms: int, options: list[dict] | None = None) -> dict:
    """The config a batched problem takes untimed: of :func:`configs` (or ``options``, a subset), the tile
    whose work units (``batch`` x tiles) take the fewest waves over ``num_sms`` programs, weighted by tile
    size (:data:`BATCHED_SMALL_TILE_SPEED`); 128x256 before 256x128 where N >= M (its serpentine bands: the
    2-D order); then the ring by K (:data:`BATCHED_LONG_K_STEPS`). Outputs of at most
    :data:`BATCHED_NARROW_SMALL_TILE_N` columns take the 128x128 tile."""
    options = options if options is not None else configs(p.out.element_size())
    if p.N <= BATCHED_NARROW_SMALL_TILE_N:
        options = [c for c in options if (c["BLOCK_M"], c["BLOCK_N"]) == (128, 128)] or options
    wide_first = p.N >= p.M
    shared_out = cdiv(p.K, BLOCK_K) >= BATCHED_LONG_K_STEPS

    def cost(cfg: dict) -> tuple:
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        units = cdiv(p.M, bm) * cdiv(p.N, bn) * p.batch
        speed = 1.0 if bm * bn >= 256 * 128 else BATCHED_SMALL_TILE_SPEED
        waves = cdiv(units, num_sms) * (bm * bn) / (256 * 128) / speed
        prefer = 0 if (bn > bm) == wide_first else 1
        ring = 0 if bool(cfg.get("SHARED_OUT", False)) == shared_out else 1
        return waves, prefer, ring

    return dict(min(options, key=cost))


def why_not(p: GemmProblem) -> str | None:
    """None when this kernel takes the problem (given that TMA can describe it: ``persistent_tma.why_not``,
    which for a batched problem asks 16-byte batch strides, 0 allowed for an operand); otherwise why not."""
    if p.a.dtype not in (torch.float16, torch.bfloat16) or p.b.dtype != p.a.dtype:
        return "not a 16-bit problem"
    if p.out.element_size() != 2:
        return "needs a 16-bit output"
    if p.scale_a is not None or p.scale_b is not None:
        return "scales are for fp8"
    if p.batch != 1:
        if p.out_strides[0] == 0:
            return "batched: the output has no batch stride"
        # Work units are numbered in int32 (128x128 is the smallest tile).
        if cdiv(p.M, 128) * cdiv(p.N, 128) * p.batch >= 2**31:
            return "batched: more work units than int32 numbers"
    return None


def descriptors(p: GemmProblem, cfg: dict):
    """Host-side TMA descriptors of A, B and the output for config ``cfg``, as the operands lie
    (:attr:`GemmProblem.tma_view`); the output in [BLOCK_M / 2, BLOCK_N] blocks, one per consumer. A config
    may name its own K step (``BLOCK_K``, a power of two from 16: narrow operands); the shipped ones take 64.
    A batched problem's: :func:`batched_descriptors`."""
    if p.batch != 1:
        return batched_descriptors(p, cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    a, b = (host_descriptor(*box) for box in p.tma_boxes(bm, bn, cfg.get("BLOCK_K", BLOCK_K)))
    return a, b, host_descriptor(p.out, [p.M, p.N], p.out_strides[1], [bm // 2, bn])


def batched_descriptors(p: GemmProblem, cfg: dict):
    """:func:`descriptors` of a batched problem: the output, and each operand with a batch stride, in 3-D
    ([batch, rows, cols], boxes [1, rows, cols]: a tile never crosses a batch, TMA clips each batch's edges); an
    operand broadcast over the batch (stride 0) in 2-D, as unbatched (the kernel reads it at every batch)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    descs = []
    for box, batch_stride in zip(p.tma_boxes(bm, bn, cfg.get("BLOCK_K", BLOCK_K)), (p.a_strides[0], p.b_strides[0])):
        descs.append(host_descriptor(*box) if batch_stride == 0 else batched_host_descriptor(
            box[0], p.batch, batch_stride, box[1], box[2], box[3]))
    out = batched_host_descriptor(p.out, p.batch, p.out_strides[0], [p.M, p.N], p.out_strides[1], [bm // 2, bn])
    return (*descs, out)


def launch_args(p: GemmProblem, cfg: dict, num_sms: int):
    """(kernel, grid, args, constexpr kwargs) for :func:`tilegemm.core.launch.launch`."""
    a_t, b_t, _, _ = p.tma_view
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = cdiv(p.M, bm) * cdiv(p.N, bn) * p.batch
    flags = p.kernel_flags()
    c, bias, _, _ = p.epilogue_pointers()
    args = descriptors(p, cfg) + (c, bias, p.M, p.N, p.K, p.c_strides[1], p.c_strides[2], p.bias_stride,
                                  p.alpha, p.beta)
    kwargs = dict(A_T=a_t, B_T=b_t, HAS_C=flags["HAS_C"], HAS_BIAS=flags["HAS_BIAS"], ACTIVATION=p.activation,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg.get("BLOCK_K", BLOCK_K), STAGES=cfg["STAGES"],
                  **tile_order(cfg), NUM_SMS=num_sms,
                  SHARED_OUT=cfg.get("SHARED_OUT", False), CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS, num_warps=cfg["num_warps"])
    if p.batch != 1:
        # (An unbatched launch passes none of these: its compiled code is the one it had before batches.)
        kwargs.update(batch=p.batch, stride_cb=p.c_strides[0], BATCHED=True, A_BATCHED=p.a_strides[0] != 0,
                      B_BATCHED=p.b_strides[0] != 0)
    return matmul_f16_coop_kernel, (min(num_sms, tiles),), args, kwargs
