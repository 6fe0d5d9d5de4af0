"""tf32 GEMM on Hopper with one operand through registers, written in Gluon: NN (A and B row-major) and
TT (both column-major). A K step's registers stay untouched until its MMAs are waited for.

wgmma reads tf32 operands from shared memory only K-major; its first operand may come from registers in
any layout. With B row-major ([K, N], N contiguous: NN) the kernel computes the transposed tile
``C^T = B^T @ A^T``: A^T (K-major when A is row-major) is read from shared memory, B^T comes from
registers, loaded out of the shared-memory tile TMA filled. With both column-major (TT) it computes
``C = A @ B`` with A's tile through registers and B (K-major) from shared memory. Both are one kernel:
``acc = X^T @ Y^T`` for an X ([K, R], R contiguous) whose fragments go through registers and a Y ([S, K],
K contiguous) read from shared memory, the tensors as they lie; ``SWAPPED`` says whether acc is C^T.
Triton 3.6's own loop for this keeps three MMA groups in flight at the end of a K step and then writes
the same registers for the next step while those MMAs may still read them; ptxas serializes the MMAs of
the flattened loop (which hides it) and the unflattened loop gives wrong tiles (docs/rungs/persistent_tma.md).

Here the K loop takes two steps per iteration and loads their fragments into two sets of registers, so a
set is written again only after the ``warpgroup_mma_wait`` that retires the MMAs reading it; one MMA
group is in flight beside the one being issued (``warpgroup_mma_wait(1)``). (Passing the fragment as a
``deps`` of the wait is not enough: the compiler copies a loop-carried value and still reloads the
registers the MMA reads.)

The kernel: a persistent grid walking [128, 256] accumulator tiles in grouped order, two warp groups each
owning 64 of the tile's rows (m64n256k8 instructions); a ring of ``STAGES`` slots of Y [256, 32] and
X [32, 128] tiles filled by TMA ``STAGES - 2`` steps ahead; the epilogue (alpha, beta * C, bias,
activation) applied to the tile as it lies and stored straight from registers (each store instruction of
a warp writes eight whole 32-byte sectors).

Its speed against cuBLAS and ``autotuned``: docs/rungs/persistent_tma.md. ``persistent_tma`` times it among its
candidates for tf32 NN and TT problems.

Written against Triton 3.6's Gluon API, for sm_90; :func:`why_not` says which problems it takes. Gluon has
no interpreter: the suite compiles it for sm_90 without a GPU, the GPU tests run it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

import torch

from tilegemm.core.hardware import HOPPER_SMEM_PER_BLOCK
from tilegemm.jit.helpers import apply_activation, tile_origin
from tilegemm.ops.matmul.problem import GemmProblem
from tilegemm.core.runtime import cdiv

# The accumulator tile is [BLOCK_R, BLOCK_S]: R rows from the operand in registers, S columns from the one
# in shared memory (NN: R runs along N and S along M, the tile being C^T's; TT: R along M, S along N).
BLOCK_R, BLOCK_S, BLOCK_K = 128, 256, 32
NUM_WARPS = 8  # two warp groups, 64 of the tile's rows each
CONFIG_KEY = "GLUON_TF32"  # marks this kernel's configs among persistent_tma's candidates


@gluon.jit
def _load_step(count, kstep, y_desc, x_desc, s0, r0, ready, y_bufs, x_bufs, STAGES: gl.constexpr,
               BK: gl.constexpr, pred):
    """TMA loads of K step ``kstep`` (Y [BS, BK] at (s0, k), X [BK, BR] at (k, r0)) into ring slot
    ``count % STAGES`` when ``pred``; returns the count of loads issued so far."""
    slot = count % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, y_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(y_desc, [s0, kstep * BK], bar, y_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(x_desc, [kstep * BK, r0], bar, x_bufs.index(slot), pred)
    return count + pred.to(gl.int32)


@gluon.jit
def _step(count, acc, use_acc, ready, y_bufs, x_bufs, frag_layout: gl.constexpr, STAGES: gl.constexpr):
    """Wait for ring slot ``count % STAGES``, load its X^T fragment into registers and issue
    ``acc (+)= X^T @ Y^T`` without waiting. Returns the next count, the in-flight accumulator and the
    fragment (whose registers must not be written until the MMA is waited for)."""
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    frag = x_bufs.index(slot).permute((1, 0)).load(frag_layout)  # [BR, BK]
    acc = warpgroup_mma(frag, y_bufs.index(slot).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    return count + 1, acc, frag


@gluon.jit
def matmul_tf32_regs_kernel(
    y_ptr, x_ptr, out_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_y, stride_x, stride_om,
    stride_cm, stride_cn, stride_bias,
    alpha, beta,
    SWAPPED: gl.constexpr, HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    BLOCK_R: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, num_warps: gl.constexpr,
):
    # Y is [S, K] (K contiguous, read by the MMA from shared memory); X is [K, R] (R contiguous, its X^T
    # fragments go through registers); acc = X^T @ Y^T is [R, S]. SWAPPED (NN): Y = A, X = B, acc = C^T.
    # Not swapped (TT): Y = B^T, X = A^T (the tensors as they lie), acc = C. The output is [M, N], N contiguous.
    o_ty: gl.constexpr = out_ptr.dtype.element_ty
    if SWAPPED:
        S = M
        R = N
    else:
        S = N
        R = M
    y_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, BLOCK_K], gl.float32)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_R], gl.float32)
    y_desc = tma.make_tensor_descriptor(y_ptr, [S, K], [stride_y, 1], [BLOCK_S, BLOCK_K], y_layout)
    x_desc = tma.make_tensor_descriptor(x_ptr, [K, R], [stride_x, 1], [BLOCK_K, BLOCK_R], x_layout)
    # Warps stacked along the accumulator's rows, each warp group 64 of them: m64 x n256 x k8 MMAs.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_S, 8])
    frag_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)

    y_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_S, BLOCK_K], y_layout)
    x_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_K, BLOCK_R], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    tiles_s = gl.cdiv(S, BLOCK_S)
    tiles_r = gl.cdiv(R, BLOCK_R)
    tiles = tiles_s * tiles_r
    steps = gl.cdiv(K, BLOCK_K)
    # Loads run AHEAD K steps in front of the MMAs. The slot a load fills was last read two steps back:
    # its fragment load finished then, and its MMAs were waited for in the step after.
    AHEAD: gl.constexpr = STAGES - 2
    loads = 0
    mmas = 0
    s0, r0 = tile_origin(gl.program_id(0), tiles_s, tiles_r, GROUP_M, BLOCK_S, BLOCK_R)
    for i in gl.static_range(AHEAD):
        loads = _load_step(loads, i, y_desc, x_desc, s0, r0, ready, y_bufs, x_bufs, STAGES, BLOCK_K, i < steps)
    for tile in range(gl.program_id(0), tiles, NUM_SMS):
        acc = gl.zeros((BLOCK_R, BLOCK_S), dtype=gl.float32, layout=acc_layout)
        loads = _load_step(loads, AHEAD, y_desc, x_desc, s0, r0, ready, y_bufs, x_bufs, STAGES, BLOCK_K,
                           AHEAD < steps)
        mmas, acc, fa = _step(mmas, acc, False, ready, y_bufs, x_bufs, frag_layout, STAGES)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # waits for nothing (one group in flight): a tensor again
        # Two K steps per iteration, their fragments in two sets of registers (fa, fb): a set is written
        # again only after the wait that retires the MMAs reading it. (One step per iteration would write
        # the same registers at the top of the next step while the last MMAs may still read them.)
        for j in range((steps - 1) // 2):
            k1 = 2 * j + 1
            loads = _load_step(loads, k1 + AHEAD, y_desc, x_desc, s0, r0, ready, y_bufs, x_bufs, STAGES, BLOCK_K,
                               k1 + AHEAD < steps)
            mmas, acc, fb = _step(mmas, acc, True, ready, y_bufs, x_bufs, frag_layout, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # step k1 - 1 done: fa is free
            loads = _load_step(loads, k1 + 1 + AHEAD, y_desc, x_desc, s0, r0, ready, y_bufs, x_bufs, STAGES,
                               BLOCK_K, k1 + 1 + AHEAD < steps)
            mmas, acc, fa = _step(mmas, acc, True, ready, y_bufs, x_bufs, frag_layout, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # step k1 done: fb is free
        if (steps - 1) % 2 == 1:  # one K step left over
            mmas, acc, fb = _step(mmas, acc, True, ready, y_bufs, x_bufs, frag_layout, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))
        acc = warpgroup_mma_wait(0, deps=(acc,))

        # The next tile's first loads go out before this tile's epilogue, so they overlap it.
        out_s0 = s0
        out_r0 = r0
        s0, r0 = tile_origin(tile + NUM_SMS, tiles_s, tiles_r, GROUP_M, BLOCK_S, BLOCK_R)
        for i in gl.static_range(AHEAD):
            loads = _load_step(loads, i, y_desc, x_desc, s0, r0, ready, y_bufs, x_bufs, STAGES, BLOCK_K,
                               (i < steps) & (tile + NUM_SMS < tiles))

        # Epilogue: acc[i, j] is C[s, r] (SWAPPED) or C[r, s], r = out_r0 + i, s = out_s0 + j.
        offs_r = out_r0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, acc_layout))
        offs_s = out_s0 + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, acc_layout))
        if SWAPPED:
            rows = offs_s[None, :]
            cols = offs_r[:, None]
        else:
            rows = offs_r[:, None]
            cols = offs_s[None, :]
        mask = (rows < M) & (cols < N)
        rows64 = rows.to(gl.int64)
        acc = acc * alpha
        if HAS_C:
            c = gl.load(c_ptr + rows64 * stride_cm + cols * stride_cn, mask=mask, other=0.0)
            acc += beta * c.to(gl.float32)
        if HAS_BIAS:  # loaded along the tile's column index, then broadcast
            if SWAPPED:
                acc += gl.load(bias_ptr + offs_r * stride_bias, mask=offs_r < N, other=0.0).to(gl.float32)[:, None]
            else:
                acc += gl.load(bias_ptr + offs_s * stride_bias, mask=offs_s < N, other=0.0).to(gl.float32)[None, :]
        acc = apply_activation(acc, ACTIVATION)
        gl.store(out_ptr + rows64 * stride_om + cols, acc.to(o_ty), mask=mask)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


# --- host side ---------------------------------------------------------------------------------------------


def configs(out_element_size: int = 4) -> list[dict]:
    """Ring depths that fit in shared memory (a stage is 48 KB: A 256x32 and B 32x128 in fp32). The output
    goes straight from registers, whatever its size (the argument is there to match gluon_fp8.configs)."""
    stage = (BLOCK_S + BLOCK_R) * BLOCK_K * 4
    return [dict(GLUON_TF32=True, STAGES=s, num_warps=NUM_WARPS) for s in (3, 4)
            if s * stage + 1024 <= HOPPER_SMEM_PER_BLOCK]


def _layout(p: GemmProblem) -> str | None:
    """"NN" (A and B row-major), "TT" (both column-major) or None."""
    if p.a_strides[2] == 1 and p.b_strides[2] == 1:
        return "NN"
    if p.a_strides[1] == 1 and p.b_strides[1] == 1:
        return "TT"
    return None


def why_not(p: GemmProblem) -> str | None:
    """None when this kernel takes the problem (given that TMA can describe it); otherwise why not."""
    if p.dtype != torch.float32 or p.input_precision != "tf32":
        return "not a tf32 problem"
    if p.batch != 1:
        return "batched"
    if _layout(p) is None:
        return "needs A and B both row-major (NN) or both column-major (TT)"
    if p.out_strides[2] != 1:
        return "needs a row-major output"
    return None


def launch_args(p: GemmProblem, cfg: dict, num_sms: int):
    """(kernel, grid, args, constexpr kwargs) for :func:`tilegemm.core.launch.launch`."""
    swapped = _layout(p) == "NN"
    if swapped:  # Y = A [M, K], X = B [K, N]
        y, stride_y, x, stride_x = p.a, p.a_strides[1], p.b, p.b_strides[1]
    else:  # Y = B^T [N, K], X = A^T [K, M], as they lie
        y, stride_y, x, stride_x = p.b, p.b_strides[2], p.a, p.a_strides[2]
    tiles = cdiv(p.M, BLOCK_S if swapped else BLOCK_R) * cdiv(p.N, BLOCK_R if swapped else BLOCK_S)
    flags = p.kernel_flags()
    c, bias, _, _ = p.epilogue_pointers()
    args = (
        y, x, p.out, c, bias,
        p.M, p.N, p.K,
        stride_y, stride_x, p.out_strides[1],
        p.c_strides[1], p.c_strides[2], p.bias_stride,
        p.alpha, p.beta,
    )
    kwargs = dict(SWAPPED=swapped, HAS_C=flags["HAS_C"], HAS_BIAS=flags["HAS_BIAS"], ACTIVATION=p.activation,
                  BLOCK_R=BLOCK_R, BLOCK_S=BLOCK_S, BLOCK_K=BLOCK_K, STAGES=cfg["STAGES"], GROUP_M=8,
                  NUM_SMS=num_sms, num_warps=cfg["num_warps"])
    return matmul_tf32_regs_kernel, (min(num_sms, tiles),), args, kwargs
