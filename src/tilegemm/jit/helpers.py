"""``@triton.jit`` helpers that tilegemm's kernels share: offsets, masks, tile order, epilogue.

Importing this module settles the backend first (see :mod:`tilegemm.core.runtime`), because Triton picks
compiler or interpreter when these functions are decorated.
"""

from tilegemm.core.runtime import ensure_backend

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# --- offsets and masks ------------------------------------------------------------------------------


@triton.jit
def offsets_1d(pid, BLOCK: tl.constexpr):
    """Element indices of block ``pid`` of a 1-D launch: ``pid * BLOCK + [0, BLOCK)``."""
    return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def offsets_2d(offs_0, offs_1, stride_0, stride_1):
    """Memory offsets of the grid ``offs_0 x offs_1``: a [len(offs_0), len(offs_1)] tile."""
    return offs_0[:, None] * stride_0 + offs_1[None, :] * stride_1


@triton.jit
def mask_1d(offs, size):
    return offs < size


@triton.jit
def mask_2d(offs_0, offs_1, size_0, size_1):
    """True where the [len(offs_0), len(offs_1)] tile lies inside a [size_0, size_1] tensor."""
    return (offs_0[:, None] < size_0) & (offs_1[None, :] < size_1)


# --- the same, telling the compiler what the host knows about divisibility --------------------------------
#
# Triton vectorizes a load or store (one 16-byte access, or cp.async into shared memory, instead of one
# access per element) only where it can prove that runs of consecutive elements start aligned and are
# kept or dropped together by the mask. For integer arguments it knows one fact, from its launch
# specialization: "a multiple of 16". A leading dimension of 5000 or 3000 fp16 elements (16-byte rows,
# but not 16-element ones) therefore turned every load of the K loop into single-element loads with no
# cp.async pipelining (docs/performance.md). The host passes the largest power
# of two (at most 16) dividing each stride and size (GemmProblem.divisors); these helpers use it.


@triton.jit
def offsets_2d_div(offs_0, offs_1, stride_0, stride_1, DIV_0: tl.constexpr, DIV_1: tl.constexpr):
    """:func:`offsets_2d`, with ``stride_0`` known to be a multiple of ``DIV_0`` and ``stride_1`` of ``DIV_1``.

    The hint must sit on an operation made here: ``tl.multiple_of`` on a function's argument is lost.
    Values of 16 add nothing (Triton knows that already); 1 means unknown.
    """
    off_0 = offs_0[:, None] * stride_0
    if DIV_0 > 1 and DIV_0 < 16:
        off_0 = tl.multiple_of(off_0, [DIV_0, DIV_0])
    off_1 = offs_1[None, :] * stride_1
    if DIV_1 > 1 and DIV_1 < 16:
        off_1 = tl.multiple_of(off_1, [DIV_1, DIV_1])
    return off_0 + off_1


@triton.jit
def below(offs, bound, DIV: tl.constexpr):
    """``offs < bound`` for a bound that is a multiple of ``DIV``, computed as ``offs // DIV < bound // DIV``.

    Both are the same when DIV divides the bound; the second shows the compiler that the mask is constant
    over aligned runs of DIV elements, so a masked access can still be vectorized. (A ``tl.multiple_of``
    hint on the bound would be lost when the bound is a kernel argument.)
    """
    if DIV > 1 and DIV < 16:
        return (offs // DIV) < (bound // DIV)
    return offs < bound


# --- which output tile a program computes -------------------------------------------------------------


@triton.jit
def tile_row_major(tile_id, num_tiles_n):
    """Row-major order: consecutive programs sweep one row of tiles, re-reading all of B per row."""
    return tile_id // num_tiles_n, tile_id % num_tiles_n


@triton.jit
def tile_grouped(tile_id, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr, SERPENTINE: tl.constexpr = False):
    """Grouped order: consecutive programs walk a band of GROUP_M tile rows column by column.

    Programs running at the same time then touch GROUP_M panels of A and a few panels of B, instead of
    one panel of A and every panel of B, so more of what they read is still in L2. With ``SERPENTINE``
    every other band walks its columns right to left, so a band starts on the panels of B that the band
    before it finished with (still in L2).
    """
    tiles_per_band = GROUP_M * num_tiles_n
    band = tile_id // tiles_per_band
    first_m = band * GROUP_M
    band_height = tl.minimum(num_tiles_m - first_m, GROUP_M)
    in_band = tile_id % tiles_per_band
    col = in_band // band_height
    if SERPENTINE:
        col = tl.where(band % 2 == 1, num_tiles_n - 1 - col, col)
    return first_m + in_band % band_height, col


def tile_order(cfg: dict, group_m: int = 8, serpentine: bool = False) -> dict:
    """The tile-order constexprs of :func:`tile_grouped` (``GROUP_M``, ``SERPENTINE``) from a config, with
    these defaults where the config has none (host side)."""
    return dict(GROUP_M=cfg.get("GROUP_M", group_m), SERPENTINE=bool(cfg.get("SERPENTINE", serpentine)))


@triton.jit
def tile_origin(tile_id, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SERPENTINE: tl.constexpr = False):
    """Row and column of the top-left element of tile ``tile_id`` in grouped order (:func:`tile_grouped`)."""
    pid_m, pid_n = tile_grouped(tile_id, num_tiles_m, num_tiles_n, GROUP_M, SERPENTINE)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


# --- epilogue ----------------------------------------------------------------------------------------


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    """Elementwise activation on an fp32 tile; names as in :data:`tilegemm.ops.matmul.ACTIVATIONS`."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        # erf form, like torch.nn.functional.gelu's default
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # tanh(u) = 2 * sigmoid(2u) - 1, so no libdevice call is needed (the interpreter has none)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * _sigmoid(2.0 * u)
    elif ACTIVATION == "silu":
        x = x * _sigmoid(x)
    elif ACTIVATION == "leaky_relu":
        x = tl.where(x >= 0.0, x, 0.01 * x)
    return x


@triton.jit
def through_registers(x):
    """``x`` unchanged, but computed in registers, so a following ``tl.dot`` takes it from there.

    Hopper's wgmma reads tf32 and fp8 operands from shared memory only when they are K-major; the first
    operand may instead come from registers, where the layout does not matter. An operand loaded straight
    from memory goes to shared memory; one that went through arithmetic stays in registers. ``+ 0.0``
    is that arithmetic: the compiler may not drop it (it turns -0.0 into +0.0), and it changes no product.
    fp8 has no arithmetic of its own, so it goes through fp16 and back (exactly: fp16 holds every fp8 value).
    """
    if x.dtype == tl.float32:
        return x + 0.0
    else:
        return (x.to(tl.float16) + 0.0).to(x.dtype)


@triton.jit
def mma(a, b, acc, INPUT_PRECISION: tl.constexpr, FAST_ACCUM: tl.constexpr):
    """``acc + a @ b`` on the tensor cores.

    fp8 products are promoted into the fp32 accumulator once per call (every BLOCK_K of K): Hopper's fp8
    MMA keeps fewer accumulator bits than fp32, and Triton otherwise lets the sum run imprecise over all
    of K. This matches ``torch._scaled_mm`` without ``use_fast_accum``. ``FAST_ACCUM`` skips the
    promotion (the MMA accumulates all of K itself), like ``use_fast_accum=True``: faster, less exact.
    """
    if a.dtype.is_fp8():
        if FAST_ACCUM:
            # No limit given: Triton's default on sm_90 (2**30) never promotes. 0 would promote after
            # every MMA instruction, the slowest choice.
            return tl.dot(a, b, acc)
        return tl.dot(a, b, acc, max_num_imprecise_acc=a.shape[1])
    else:
        return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def mma_ordered(a, b, acc, MMA_OPERANDS: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_ACCUM: tl.constexpr):
    """``acc + a @ b`` for a [BM, BK] tile ``a`` and a [BK, BN] tile ``b``, the operands ordered as
    ``MMA_OPERANDS`` says (see :func:`tilegemm.ops.matmul.problem.mma_operands`).

    tf32 and fp8 operands must be K-major in shared memory: ``"ab"`` takes them as loaded, ``"reg_a"``
    passes A through registers, ``"swap"`` computes the transposed tile ``B^T @ A^T`` with B^T in
    registers (``acc`` is then the [BN, BM] transposed accumulator).
    """
    if MMA_OPERANDS == "swap":
        return mma(through_registers(b.T), a.T, acc, INPUT_PRECISION, FAST_ACCUM)
    elif MMA_OPERANDS == "reg_a":
        return mma(through_registers(a), b, acc, INPUT_PRECISION, FAST_ACCUM)
    else:
        return mma(a, b, acc, INPUT_PRECISION, FAST_ACCUM)


@triton.jit
def scale_tile(acc, offs_m, offs_n, M, N, alpha, scale_a_ptr, scale_b_ptr, stride_sa, stride_sb,
               HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr):
    """``alpha * scale_a[rows] * scale_b[cols] * acc``: fp8 dequantization scales.

    A per-tensor scale is a vector with stride 0, so one code path serves both kinds.
    """
    acc = acc * alpha
    if HAS_SCALE_A:
        acc *= tl.load(scale_a_ptr + offs_m * stride_sa, mask=offs_m < M, other=0.0).to(tl.float32)[:, None]
    if HAS_SCALE_B:
        acc *= tl.load(scale_b_ptr + offs_n * stride_sb, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def epilogue_tile(acc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                  stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                  HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                  HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr):
    """activation(alpha * scales * acc + beta * c + bias) for one tile (rows ``offs_m``, columns ``offs_n``),
    returned for the caller to store (the TMA kernels store through a descriptor). Gluon kernels call it
    too: it takes its layouts from ``acc`` and the offsets."""
    acc = scale_tile(acc, offs_m, offs_n, M, N, alpha, scale_a_ptr, scale_b_ptr, stride_sa, stride_sb,
                     HAS_SCALE_A, HAS_SCALE_B)
    if HAS_C:
        c = tl.load(c_ptr + offsets_2d(offs_m, offs_n, stride_cm, stride_cn), mask=mask_2d(offs_m, offs_n, M, N),
                    other=0.0)
        acc += beta * c.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return apply_activation(acc, ACTIVATION)


@triton.jit
def epilogue_store(
    acc, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    offs_m, offs_n, M, N,
    stride_om, stride_on, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
    alpha, beta,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr, DIVISORS: tl.constexpr,
):
    """out = activation(alpha * scales * acc + beta * c + bias) for one [BM, BN] tile, masked to [M, N].

    ``DIVISORS`` is :attr:`tilegemm.ops.matmul.problem.GemmProblem.divisors`.
    """
    DIV_OM: tl.constexpr = DIVISORS[4]
    DIV_ON: tl.constexpr = DIVISORS[5]
    DIV_CM: tl.constexpr = DIVISORS[6]
    DIV_CN: tl.constexpr = DIVISORS[7]
    DIV_M: tl.constexpr = DIVISORS[8]
    DIV_N: tl.constexpr = DIVISORS[9]
    in_n = below(offs_n, N, DIV_N)
    mask = below(offs_m, M, DIV_M)[:, None] & in_n[None, :]
    acc = scale_tile(acc, offs_m, offs_n, M, N, alpha, scale_a_ptr, scale_b_ptr, stride_sa, stride_sb,
                     HAS_SCALE_A, HAS_SCALE_B)
    if HAS_C:
        c = tl.load(c_ptr + offsets_2d_div(offs_m, offs_n, stride_cm, stride_cn, DIV_CM, DIV_CN), mask=mask,
                    other=0.0)
        acc += beta * c.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=in_n, other=0.0)  # [BN]
        acc += bias.to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    tl.store(out_ptr + offsets_2d_div(offs_m, offs_n, stride_om, stride_on, DIV_OM, DIV_ON),
             acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- split reductions ------------------------------------------------------------------------------


@triton.jit
def store_summed_slices(total, dst, mask, ws, plane, part, count_ptr, tile, SPLIT: tl.constexpr):
    """Store fp32 ``total`` (this program's slice of a reduction split SPLIT ways) at pointers ``dst``: at once
    without a split; else the slice goes to plane ``part`` of the workspace (``ws``: this tile's pointers in plane
    0, planes ``plane`` elements apart) and the program that arrives last at ``tile`` (``count_ptr``'s counter,
    reset for the next launch) adds the planes in order (deterministic) and stores: one launch, replayable."""
    if SPLIT == 1:
        tl.store(dst, total.to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(ws + part * plane, total)
        tl.debug_barrier()  # every thread's stores before the (one-thread) release
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()  # and every thread's loads after the acquire
            summed = tl.zeros(total.shape, dtype=tl.float32)
            for sl in range(0, SPLIT):
                summed += tl.load(ws + sl * plane, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            tl.store(dst, summed.to(dst.dtype.element_ty), mask=mask)
