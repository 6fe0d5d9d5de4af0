"""tf32 GEMM with B row-major on Hopper, written in Gluon: the B^T tile goes through registers, and a K
step's registers stay untouched until its MMAs are waited for.

wgmma reads tf32 operands from shared memory only K-major. With B row-major ([K, N], N contiguous: the NN
layout) the kernels compute the transposed tile ``C^T = B^T @ A^T``: A^T (K-major when A is row-major) is
read from shared memory, B^T comes from registers, loaded out of the shared-memory tile TMA filled.
Triton 3.6 keeps three MMA groups in flight at the end of such a K step and then writes the same
registers for the next step while those MMAs may still read them; ptxas serializes the MMAs of the
flattened loop (which hides it) and the unflattened loop gives wrong tiles (docs/rungs/persistent_tma.md).

Here the K loop takes two steps per iteration and loads their B^T fragments into two sets of registers,
so a set is written again only after the ``warpgroup_mma_wait`` that retires the MMAs reading it; one
MMA group is in flight beside the one being issued (``warpgroup_mma_wait(1)``). (Passing the fragment
as a ``deps`` of the wait is not enough: the compiler copies a loop-carried value and still reloads the
registers the MMA reads.)

The kernel: a persistent grid walking 256x128 output tiles (C's rows x columns) in grouped order, two
warp groups each owning 64 of the tile's 128 columns (the MMA's rows: m64n256k8 instructions); a ring of
``STAGES`` slots of A [256, 32] and B [32, 128] tiles filled by TMA ``STAGES - 2`` steps ahead; the
epilogue (alpha, beta * C, bias, activation) applied to the transposed tile and stored straight from
registers (each store instruction of a warp writes eight whole 32-byte sectors).

On an H200 it ran 0.99x / 0.95x / 0.94x / 0.99x of cuBLAS (TF32) at 2048^3 .. 16384^3 with every tile
checked, where ``autotuned`` ran 0.80x-0.92x (``scripts/explore_tf32_gluon.py``); at 1024^3, with 32
tiles for 132 SMs, 0.58x. ``persistent_tma`` times it among its candidates for tf32 NN problems.

Written against Triton 3.6's Gluon API, for sm_90; :func:`usable` says which problems it takes. Gluon has
no interpreter: the suite compiles it for sm_90 without a GPU, the GPU tests run it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

import torch

from tilegemm.hardware import HOPPER_SMEM_PER_BLOCK
from tilegemm.jit_helpers import apply_activation, tile_origin
from tilegemm.ops.matmul.problem import GemmProblem

BLOCK_M, BLOCK_N, BLOCK_K = 256, 128, 32
NUM_WARPS = 8  # two warp groups, 64 of the tile's columns each
CONFIG_KEY = "GLUON_TF32"  # marks this kernel's configs among persistent_tma's candidates


@gluon.jit
def _load_step(count, kstep, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES: gl.constexpr,
               BK: gl.constexpr, pred):
    """TMA loads of K step ``kstep`` (A [BM, BK] at (m0, k), B [BK, BN] at (k, n0)) into ring slot
    ``count % STAGES`` when ``pred``; returns the count of loads issued so far."""
    slot = count % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [m0, kstep * BK], bar, a_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(b_desc, [kstep * BK, n0], bar, b_bufs.index(slot), pred)
    return count + pred.to(gl.int32)


@gluon.jit
def _step(count, acc, use_acc, ready, a_bufs, b_bufs, frag_layout: gl.constexpr, STAGES: gl.constexpr):
    """Wait for ring slot ``count % STAGES``, load its B^T fragment into registers and issue
    ``acc (+)= B^T @ A^T`` without waiting. Returns the next count, the in-flight accumulator and the
    fragment (whose registers must not be written until the MMA is waited for)."""
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    frag = b_bufs.index(slot).permute((1, 0)).load(frag_layout)  # [BN, BK]
    acc = warpgroup_mma(frag, a_bufs.index(slot).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    return count + 1, acc, frag


@gluon.jit
def matmul_tf32_nn_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_bk, stride_om,
    stride_cm, stride_cn, stride_bias,
    alpha, beta,
    HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, num_warps: gl.constexpr,
):
    # A is [M, K] (K contiguous), B is [K, N] (N contiguous); the output [M, N] (N contiguous).
    o_ty: gl.constexpr = out_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float32)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.float32)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N], b_layout)
    # The accumulator is the transposed tile [BN, BM]: warps stacked along its rows (C's columns), each
    # warp group 64 of them, m64 x n256 x k8 MMAs.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 8])
    frag_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)

    a_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_K, BLOCK_N], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    steps = gl.cdiv(K, BLOCK_K)
    # Loads run AHEAD K steps in front of the MMAs. The slot a load fills was last read two steps back:
    # its fragment load finished then, and its MMAs were waited for in the step after.
    AHEAD: gl.constexpr = STAGES - 2
    loads = 0
    mmas = 0
    m0, n0 = tile_origin(gl.program_id(0), tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
    for i in gl.static_range(AHEAD):
        loads = _load_step(loads, i, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K, i < steps)
    for tile in range(gl.program_id(0), tiles, NUM_SMS):
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=acc_layout)
        loads = _load_step(loads, AHEAD, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K,
                           AHEAD < steps)
        mmas, acc, fa = _step(mmas, acc, False, ready, a_bufs, b_bufs, frag_layout, STAGES)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # waits for nothing (one group in flight): a tensor again
        # Two K steps per iteration, their fragments in two sets of registers (fa, fb): a set is written
        # again only after the wait that retires the MMAs reading it. (One step per iteration would write
        # the same registers at the top of the next step while the last MMAs may still read them.)
        for j in range((steps - 1) // 2):
            k1 = 2 * j + 1
            loads = _load_step(loads, k1 + AHEAD, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K,
                               k1 + AHEAD < steps)
            mmas, acc, fb = _step(mmas, acc, True, ready, a_bufs, b_bufs, frag_layout, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # step k1 - 1 done: fa is free
            loads = _load_step(loads, k1 + 1 + AHEAD, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES,
                               BLOCK_K, k1 + 1 + AHEAD < steps)
            mmas, acc, fa = _step(mmas, acc, True, ready, a_bufs, b_bufs, frag_layout, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # step k1 done: fb is free
        if (steps - 1) % 2 == 1:  # one K step left over
            mmas, acc, fb = _step(mmas, acc, True, ready, a_bufs, b_bufs, frag_layout, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))
        acc = warpgroup_mma_wait(0, deps=(acc,))

        # The next tile's first loads go out before this tile's epilogue, so they overlap it.
        out_m0 = m0
        out_n0 = n0
        m0, n0 = tile_origin(tile + NUM_SMS, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        for i in gl.static_range(AHEAD):
            loads = _load_step(loads, i, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BLOCK_K,
                               (i < steps) & (tile + NUM_SMS < tiles))

        # Epilogue on the transposed tile: acc[i, j] is C[out_m0 + j, out_n0 + i].
        offs_n = out_n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        offs_m = out_m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        rows = offs_m.to(gl.int64)[None, :]
        acc = acc * alpha
        if HAS_C:
            c = gl.load(c_ptr + rows * stride_cm + offs_n[:, None] * stride_cn, mask=mask, other=0.0)
            acc += beta * c.to(gl.float32)
        if HAS_BIAS:
            acc += gl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
        acc = apply_activation(acc, ACTIVATION)
        gl.store(out_ptr + rows * stride_om + offs_n[:, None], acc.to(o_ty), mask=mask)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


# --- host side ---------------------------------------------------------------------------------------------


def configs(out_element_size: int = 4) -> list[dict]:
    """Ring depths that fit in shared memory (a stage is 48 KB: A 256x32 and B 32x128 in fp32). The output
    goes straight from registers, whatever its size (the argument is there to match gluon_fp8.configs)."""
    stage = (BLOCK_M + BLOCK_N) * BLOCK_K * 4
    return [dict(GLUON_TF32=True, STAGES=s, num_warps=NUM_WARPS) for s in (3, 4)
            if s * stage + 1024 <= HOPPER_SMEM_PER_BLOCK]


def usable(p: GemmProblem) -> str | None:
    """None when this kernel takes the problem (given that TMA can describe it); otherwise why not."""
    if p.dtype != torch.float32 or p.input_precision != "tf32":
        return "not a tf32 problem"
    if p.batch != 1:
        return "batched"
    if p.a_strides[2] != 1 or p.b_strides[2] != 1:
        return "needs A and B row-major (the NN layout)"
    if p.out_strides[2] != 1:
        return "needs a row-major output"
    return None


def launch_args(p: GemmProblem, cfg: dict, num_sms: int):
    """(kernel, grid, args, constexpr kwargs) for :func:`tilegemm.launch.launch`."""
    tiles = triton.cdiv(p.M, BLOCK_M) * triton.cdiv(p.N, BLOCK_N)
    flags = p.kernel_flags()
    c, bias, _, _ = p.epilogue_pointers()
    args = (
        p.a, p.b, p.out, c, bias,
        p.M, p.N, p.K,
        p.a_strides[1], p.b_strides[1], p.out_strides[1],
        p.c_strides[1], p.c_strides[2], p.bias_stride,
        p.alpha, p.beta,
    )
    kwargs = dict(HAS_C=flags["HAS_C"], HAS_BIAS=flags["HAS_BIAS"], ACTIVATION=p.activation,
                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=cfg["STAGES"], GROUP_M=8,
                  NUM_SMS=num_sms, num_warps=cfg["num_warps"])
    return matmul_tf32_nn_kernel, (min(num_sms, tiles),), args, kwargs
