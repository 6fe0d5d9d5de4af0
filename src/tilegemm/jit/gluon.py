"""The parts of the warp-specialized Gluon skeleton (sm_90) that every family's Gluon GEMM shares: host-side TMA
descriptors (2-D, and 3-D with a box of one along the leading dim), ring slots read as the 2-D tiles the MMAs take,
a consumer's K loop over one tile, the ring's barriers, and the partitions' register budgets. The skeleton itself (a TMA producer warp group, two consumer warp groups, a
"ready" and an "empty" mbarrier a slot) is :mod:`tilegemm.ops.matmul.gluon_f16`; the grouped family's MoE forward
(:mod:`tilegemm.ops.grouped.gluon`) runs on it too. Imported by kernel modules only (it imports Gluon)."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Registers a thread asks for (setmaxnreg): a consumer's accumulator is 128 a thread (128 rows x 128
# columns or 64 x 256 over one warp group); the producer needs few. 2 * 128 * 232 + 128 * 40 <= 65536.
CONSUMER_REGS = 232
PRODUCER_REGS = 40

# Gluon's element types of the torch dtypes the Gluon kernels' host descriptors describe.
GL_TYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
            torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


def host_descriptor(base: torch.Tensor, shape: list[int], stride: int, block: list[int]) -> TensorDescriptor:
    """A host-side TMA descriptor (a kernel parameter) of the 2-D row-major view ``shape`` with row stride
    ``stride`` over ``base``'s memory, in ``block`` boxes with the default swizzled layout."""
    layout = gl.NVMMASharedLayout.get_default_for(block, GL_TYPES[base.dtype])
    return TensorDescriptor(base, shape, [stride, 1], block, layout)


def batched_host_descriptor(base: torch.Tensor, batch: int, batch_stride: int, shape: list[int], stride: int,
                            block: list[int]) -> TensorDescriptor:
    """The 3-D descriptor ``[batch, *shape]`` (batch stride ``batch_stride``, row stride ``stride``) in boxes
    ``[1, *block]`` with the swizzle :func:`host_descriptor` gives the 2-D ``block``: a box is then the bytes of
    the 2-D tile, laid out as the MMAs and the epilogue read them (:func:`flat_slot`)."""
    flat = gl.NVMMASharedLayout.get_default_for(block, GL_TYPES[base.dtype])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=flat.swizzle_byte_width,
                                  element_bitwidth=flat.element_bitwidth, rank=3)
    return TensorDescriptor(base, [batch, *shape], [batch_stride, stride, 1], [1, *block], layout)


@gluon.jit
def flat_slot(bufs, slot, ROWS: gl.constexpr, COLS: gl.constexpr, IS_3D: gl.constexpr):
    """Slot ``slot`` of a ring (or output buffer) as the 2-D [ROWS, COLS] tile the MMAs or the epilogue use: a
    slot of a 3-D descriptor's box ([1, ROWS, COLS], IS_3D) is the same bytes in the same swizzle."""
    if IS_3D:
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=bufs.layout.swizzle_byte_width,
                                                    element_bitwidth=bufs.layout.element_bitwidth, rank=2)
        return bufs.index(slot)._reinterpret(bufs.dtype, [ROWS, COLS], layout)
    else:
        return bufs.index(slot)


@gluon.jit
def ring_operands(a_bufs, b_bufs, slot, ROW0: gl.constexpr, ROWS: gl.constexpr, A_T: gl.constexpr,
                  B_T: gl.constexpr, A_3D: gl.constexpr = False, B_3D: gl.constexpr = False):
    """Slot ``slot``'s [ROWS, BK] rows of A from ROW0 and its [BK, BN] tile of B, as the MMA reads them; A is held
    [BM, BK] or (A_T) [BK, BM], B [BK, BN] or (B_T) [BN, BK] (A_3D / B_3D: the ring holds a 3-D descriptor's
    [1, rows, cols] boxes, :func:`flat_slot`)."""
    if A_3D:
        a_rows: gl.constexpr = a_bufs.shape[2]
        a_cols: gl.constexpr = a_bufs.shape[3]
        a_slot = flat_slot(a_bufs, slot, a_rows, a_cols, True)
    else:
        a_slot = a_bufs.index(slot)
    if A_T:
        a = a_slot.slice(ROW0, ROWS, dim=1).permute((1, 0))
    else:
        a = a_slot.slice(ROW0, ROWS)
    if B_3D:
        b_rows: gl.constexpr = b_bufs.shape[2]
        b_cols: gl.constexpr = b_bufs.shape[3]
        b = flat_slot(b_bufs, slot, b_rows, b_cols, True)
    else:
        b = b_bufs.index(slot)
    if B_T:
        b = b.permute((1, 0))
    return a, b


@gluon.jit
def consume_k_steps(a_bufs, b_bufs, ready, empty, acc, count, steps, ROW0: gl.constexpr, ROWS: gl.constexpr,
                    A_T: gl.constexpr, B_T: gl.constexpr, STAGES: gl.constexpr, A_3D: gl.constexpr = False,
                    B_3D: gl.constexpr = False):
    """A consumer warp group's K loop over one tile (``steps`` >= 1 ring slots from slot ``count % STAGES``): each
    slot waited for on its "ready" barrier, its MMAs issued with one group kept in flight, and the slot before
    freed on its "empty" barrier once its MMAs are done; the first MMA overwrites ``acc``. Returns the finished
    accumulator and the count past the tile's last slot."""
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    a, b = ring_operands(a_bufs, b_bufs, slot, ROW0, ROWS, A_T, B_T, A_3D, B_3D)
    acc = warpgroup_mma(a, b, acc, use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(1, deps=(acc,))  # waits for nothing (one group in flight): a tensor again
    for ks in range(1, steps):
        prev = slot
        count += 1
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        a, b = ring_operands(a_bufs, b_bufs, slot, ROW0, ROWS, A_T, B_T, A_3D, B_3D)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # Step ks - 1's MMAs are done once at most one group (step ks) is in flight: free its slot.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(slot), count=1)
    return acc, count + 1


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(ready, empty, turn): a ring slot's "ready" barrier (one arrival: the producer's expected bytes) and "empty"
    one (both consumer warp groups release the slot), and the two consumers' turns at a shared output buffer."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warp groups release a slot
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return ready, empty, turn


@gluon.jit
def release_ring_barriers(ready, empty, turn, STAGES: gl.constexpr):
    """Invalidate :func:`ring_barriers`' barriers once the partitions are done."""
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
