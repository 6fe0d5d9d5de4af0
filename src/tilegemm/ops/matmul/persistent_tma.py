"""Rung ``persistent_tma``: one program per SM looping over tiles, tiles moved by Hopper's TMA engine.

What changes against ``autotuned``:
- a persistent grid: about one program per SM walks the tiles in grouped order, so there is no tail of
  half-empty waves and no per-tile launch cost;
- loads and the output store go through TMA descriptors: the TMA engine copies whole tiles between global
  and shared memory, so no thread computes addresses or masks (out-of-range parts of a tile read as zeros
  and are not written). Configs with ``HOST_DESC`` (every candidate) take descriptors made on the host
  (:func:`host_descriptors`), which saves each launch GPU time (docs/rungs/persistent_tma.md); without it each
  program makes its own;
- the epilogue is split in two halves along N, so fewer registers are live while storing.

TMA needs a unit stride in the last dim and 16-byte aligned base and strides. A transposed operand is
described as its transpose and the loaded tile transposed back. Batched 16-bit problems (``BATCHED``) walk
(batch, tile) work units with 3-D descriptors ([batch, rows, cols], blocks [1, rows, cols]; an operand
broadcast over the batch keeps its 2-D one). Problems TMA cannot describe, other batched problems, and GPUs
before Hopper go to ``autotuned`` (see :func:`why_not`).
"""

from __future__ import annotations

import torch
import triton

from tilegemm.core import tuning
from tilegemm.core.hardware import sm_count, tma_aligned, why_not_gluon
from tilegemm.jit.helpers import epilogue_tile, mma_ordered, tile_grouped, tile_order
from tilegemm.core.launch import current_stream, ensure_allocator, launch, sequence_lock
from tilegemm.core.workspace import split_workspace
from tilegemm.core.registry import NotApplicable
from tilegemm.ops.matmul import autotuned
from tilegemm.ops.matmul.problem import GemmProblem
from tilegemm.ops.matmul.split_k import wave_split as units_wave_split
from tilegemm.ops.matmul.split_reduce import launch_reduction
from tilegemm.core.runtime import cdiv, interpreting

import triton.language as tl  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@triton.jit
def _load_tile(desc, row, col, TRANSPOSED: tl.constexpr):
    """The [rows, cols] tile at (row, col) of a matrix whose descriptor may describe its transpose."""
    if TRANSPOSED:
        return desc.load([col, row]).T
    else:
        return desc.load([row, col])


@triton.jit
def _load_batch_tile(desc, bid, row, col, TRANSPOSED: tl.constexpr, BATCHED: tl.constexpr,
                     ROWS: tl.constexpr, COLS: tl.constexpr):
    """:func:`_load_tile` of batch ``bid``: a 3-D descriptor ([batch, rows, cols], blocks [1, ...]) where the
    operand is batched, the 2-D one of :func:`_load_tile` where it is broadcast (batch stride 0)."""
    if BATCHED:
        if TRANSPOSED:
            return desc.load([bid, col, row]).reshape(COLS, ROWS).T
        else:
            return desc.load([bid, row, col]).reshape(ROWS, COLS)
    else:
        return _load_tile(desc, row, col, TRANSPOSED)


@triton.jit
def _zero_tile(ROWS: tl.constexpr, COLS: tl.constexpr, MMA_OPERANDS: tl.constexpr):
    """A zero fp32 accumulator for a [ROWS, COLS] output tile (held transposed when the operands swap)."""
    if MMA_OPERANDS == "swap":
        return tl.zeros((COLS, ROWS), dtype=tl.float32)
    else:
        return tl.zeros((ROWS, COLS), dtype=tl.float32)


@triton.jit
def _as_tile(acc, MMA_OPERANDS: tl.constexpr):
    """The accumulator as the [BM, BN] output tile (transposed back when the operands were swapped)."""
    if MMA_OPERANDS == "swap":
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _store_tile(acc, out_desc, m0, n0, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_cm, stride_cn,
                stride_bias, stride_sa, stride_sb, alpha, beta, HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                ACTIVATION: tl.constexpr, HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, bid=None, BATCHED: tl.constexpr = False):
    """The epilogue of a whole [BLOCK_M, BLOCK_N] fp32 tile at (m0, n0), stored through ``out_desc`` in two
    [BM, BN/2] halves (fewer registers live while storing). BATCHED: ``out_desc`` is 3-D and the tile is batch
    ``bid``'s (``c_ptr`` already at that batch)."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    offs_m = m0 + tl.arange(0, BLOCK_M)
    halves = tl.reshape(acc, (BLOCK_M, 2, HALF_N)).permute(0, 2, 1)
    left, right = tl.split(halves)
    offs_l = n0 + tl.arange(0, HALF_N)
    left = epilogue_tile(left, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_l, M, N,
                         stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                         HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B)
    if BATCHED:
        out_desc.store([bid, m0, n0], left.to(out_desc.dtype).reshape(1, BLOCK_M, HALF_N))
    else:
        out_desc.store([m0, n0], left.to(out_desc.dtype))
    right = epilogue_tile(right, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_l + HALF_N, M, N,
                          stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                          HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B)
    if BATCHED:
        out_desc.store([bid, m0, n0 + HALF_N], right.to(out_desc.dtype).reshape(1, BLOCK_M, HALF_N))
    else:
        out_desc.store([m0, n0 + HALF_N], right.to(out_desc.dtype))


@triton.jit
def matmul_persistent_tma_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_a, stride_b, stride_om,
    stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
    alpha, beta, ws_ptr, SPLIT_K,
    A_T: tl.constexpr, B_T: tl.constexpr,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FAST_ACCUM: tl.constexpr,
    HOST_DESC: tl.constexpr, SERPENTINE: tl.constexpr, SPLIT: tl.constexpr = False,
    batch=None, stride_cb=None, BATCHED: tl.constexpr = False, A_BATCHED: tl.constexpr = False,
    B_BATCHED: tl.constexpr = False, UPCAST: tl.constexpr = False,
):
    # BATCHED: ``batch`` products (16-bit, unsplit, host descriptors: :func:`triton_launch_args`); the work units
    # are (batch, tile), batch-major. The output's descriptor is 3-D, A's and B's too where A_BATCHED /
    # B_BATCHED (else broadcast: one 2-D matrix for every batch); C's batch stride is ``stride_cb``. Unbatched
    # launches pass none of these (None is a constexpr), so their compiled code is the same as without them.
    # Descriptors: A is [M, K] (or [K, M] when transposed), B is [K, N] (or [N, K]); the last stride is 1;
    # the output [M, N] in [BLOCK_M, BLOCK_N / 2] blocks. HOST_DESC: a_ptr, b_ptr and out_ptr are those
    # descriptors, made on the host (:func:`host_descriptors`); otherwise each program makes them.
    HALF_N: tl.constexpr = BLOCK_N // 2
    if HOST_DESC:
        a_desc = a_ptr
        b_desc = b_ptr
        out_desc = out_ptr
    else:
        if A_T:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1],
                                               block_shape=[BLOCK_K, BLOCK_M])
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        if B_T:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_om, 1],
                                             block_shape=[BLOCK_M, HALF_N])

    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    slice_steps = tl.cdiv(k_steps, SPLIT_K)
    # Each program takes every NUM_SMS-th work unit: a tile (in grouped order) and, with SPLIT, one of SPLIT_K
    # slices of its K steps (SPLIT_K is 1 without). Units are numbered slice-major, so the programs at work at
    # once read the same K range of neighbouring tiles (shared in L2) as they would unsplit.
    # WARP_SPECIALIZE: 0 off; 1 on the K loop; 2 on the tile loop (Triton splits loads and MMAs into warp groups).
    WS_TILES: tl.constexpr = WARP_SPECIALIZE == 2
    WS_K: tl.constexpr = WARP_SPECIALIZE == 1
    if BATCHED:
        tl.static_assert(HOST_DESC and not SPLIT, "batched launches take host descriptors and no K split")
        units = tiles * batch
    else:
        units = tiles * SPLIT_K
    for unit in tl.range(tl.program_id(0), units, NUM_SMS, flatten=FLATTEN, warp_specialize=WS_TILES):
        if BATCHED:
            bid = unit // tiles
            tile = unit - bid * tiles
            k_first = 0
            k_last = k_steps
        elif not SPLIT:
            tile = unit
            k_first = 0
            k_last = k_steps
        else:
            part = unit // tiles
            tile = unit - part * tiles
            k_first = part * slice_steps
            k_last = tl.minimum(k_first + slice_steps, k_steps)
        pid_m, pid_n = tile_grouped(tile, tiles_m, tiles_n, GROUP_M, SERPENTINE)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = _zero_tile(BLOCK_M, BLOCK_N, MMA_OPERANDS)
        for ks in tl.range(k_first, k_last, warp_specialize=WS_K):
            k0 = ks * BLOCK_K
            if BATCHED:
                a = _load_batch_tile(a_desc, bid, m0, k0, A_T, A_BATCHED, BLOCK_M, BLOCK_K)
                b = _load_batch_tile(b_desc, bid, k0, n0, B_T, B_BATCHED, BLOCK_K, BLOCK_N)
            else:
                a = _load_tile(a_desc, m0, k0, A_T)
                b = _load_tile(b_desc, k0, n0, B_T)
            if UPCAST:  # (interpreter only) Triton 3.6's interpreter computes bf16 dots wrongly; fp32 dots are exact
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = mma_ordered(a, b, acc, MMA_OPERANDS, INPUT_PRECISION, FAST_ACCUM)
        acc = _as_tile(acc, MMA_OPERANDS)
        offs_m = m0 + tl.arange(0, BLOCK_M)

        if SPLIT:
            # A slice's partial tile goes to its fp32 plane of the workspace ([SPLIT_K, M, N], row-major; an
            # empty slice stores zeros); split_k_reduce_kernel, launched next, adds the planes and applies the
            # epilogue.
            offs_n = n0 + tl.arange(0, BLOCK_N)
            inside = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            tl.store(ws_ptr + part * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=inside)
        elif BATCHED:
            c_batch = c_ptr
            if HAS_C:
                c_batch = c_ptr + bid.to(tl.int64) * stride_cb
            _store_tile(acc, out_desc, m0, n0, c_batch, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_cm,
                        stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta, HAS_C, HAS_BIAS, ACTIVATION,
                        HAS_SCALE_A, HAS_SCALE_B, BLOCK_M, BLOCK_N, bid, True)
        else:
            _store_tile(acc, out_desc, m0, n0, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_cm,
                        stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta, HAS_C, HAS_BIAS, ACTIVATION,
                        HAS_SCALE_A, HAS_SCALE_B, BLOCK_M, BLOCK_N)


# --- host side ---------------------------------------------------------------------------------------------


def make_config(bm, bn, bk, warps, stages, flatten=True, ws=0, host_desc=True) -> dict:
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, FLATTEN=flatten, WARP_SPECIALIZE=ws,
               num_warps=warps, num_stages=stages)
    if host_desc:
        cfg["HOST_DESC"] = True
    return cfg


def configs(dtype_bytes: int, mma_operands: str = "ab") -> list[dict]:
    """Candidate configs for operands of ``dtype_bytes`` bytes meeting the MMA as ``mma_operands`` says
    (:func:`tilegemm.ops.matmul.problem.mma_operands`); one small config under the interpreter."""
    if interpreting():
        return [make_config(32, 32, 16, 4, 1, flatten=False)]
    return hopper_configs(dtype_bytes, mma_operands)


def hopper_configs(dtype_bytes: int, mma_operands: str) -> list[dict]:
    """The configs :func:`configs` gives on a GPU."""
    if dtype_bytes == 1:  # fp8
        out = [make_config(128, 256, 128, 8, 3), make_config(128, 256, 128, 8, 4), make_config(256, 128, 128, 8, 3),
               make_config(128, 128, 128, 8, 4), make_config(128, 128, 128, 4, 4), make_config(128, 256, 128, 8, 3, flatten=False)]
    elif dtype_bytes >= 4:  # tf32 / fp32 operands
        # The warp-specialized, unflattened config is for K-major operands only (see below).
        out = [make_config(128, 128, 32, 8, 3), make_config(128, 128, 32, 4, 4), make_config(128, 256, 32, 8, 3), make_config(256, 128, 32, 8, 3),
               make_config(128, 64, 32, 4, 4), make_config(64, 128, 32, 4, 4), make_config(128, 256, 32, 8, 3, flatten=False, ws=1)]
    else:
        out = [
            make_config(128, 256, 64, 8, 3),
            make_config(128, 256, 64, 8, 3, flatten=False),
            make_config(256, 128, 64, 8, 3),
            make_config(128, 128, 64, 8, 4),
            make_config(128, 128, 64, 4, 4),
            make_config(128, 64, 64, 4, 4),
            make_config(64, 128, 64, 4, 4),
            # 1024^3: 128 tiles, 128-wide K steps (ahead of the 64-wide steps above: docs/rungs/persistent_tma.md).
            make_config(64, 128, 128, 4, 4),
            # Small M (64..128): about one 64x64 tile per SM, fed by a 6-deep pipeline of 128-wide K steps
            # (docs/rungs/persistent_tma.md).
            make_config(64, 64, 128, 4, 6, flatten=False),
        ]
    if mma_operands != "ab":
        # An operand through registers (tf32/fp8 with B not K-major, or A not K-major): the tile loop stays
        # flattened into the K loop and without warp specialization. Unflattened, these loops ran faster because
        # ptxas no longer serializes their wgmma (its info C7515), but on the H200 they computed wrong tiles;
        # flattened and serialized, every tile was right (docs/rungs/persistent_tma.md).
        # tests/test_persistent_tma_sm90.py forces each of these candidates on the GPU.
        unique = []
        for cfg in out:
            cfg = dict(cfg, FLATTEN=True, WARP_SPECIALIZE=0)
            if cfg not in unique:
                unique.append(cfg)
        out = unique
    return out


def why_not(p: GemmProblem) -> str | None:
    """None when TMA can move this problem's tiles; otherwise why not."""
    if p.batch != 1:
        reason = why_not_batched(p)
        if reason is not None:
            return reason
    _, sam, sak = p.a_strides
    _, sbk, sbn = p.b_strides
    if sak != 1 and sam != 1:
        return "A has no unit stride"
    if sbn != 1 and sbk != 1:
        return "B has no unit stride"
    _, _, stride_a, stride_b = p.tma_view
    # An operand broadcast along its rows (stride 0, e.g. an expand): no descriptor of a 2-D tile has been checked
    # to read it on the GPU, so it goes to a kernel that reads through pointers (a batch stride of 0 is fine: the
    # descriptor stays 2-D, docs/rungs/persistent_tma.md).
    if stride_a == 0 or stride_b == 0:
        return "an operand's rows are broadcast (stride 0)"
    if not tma_aligned(p.a, stride_a) or not tma_aligned(p.b, stride_b):
        return "an operand's base or row stride is not 16-byte aligned"
    if p.out_strides[2] != 1 or not tma_aligned(p.out, p.out_strides[1]):
        return "the output is not 16-byte aligned"
    # A TMA store writes the whole 16-byte unit that holds a row's last column (zeros past N on the H200: the GPU
    # test of padded output rows, docs/rungs/persistent_tma.md; triton-lang/triton#11583): an output whose rows end
    # inside one, with memory after them (a view of wider rows), goes elsewhere. tilegemm's outputs never do.
    if p.N * p.out.element_size() % 16 and p.out_strides[1] > p.N:
        return "the output's rows end inside a 16-byte unit of a wider row (a TMA store would write past N)"
    if min(p.M, p.N, p.K) < 16:
        return "a dimension is smaller than 16"
    return None


def why_not_batched(p: GemmProblem) -> str | None:
    """None when the batched path takes ``p`` (batch > 1): fp16/bf16 operands, and batch strides TMA can step
    (16-byte multiples; 0 for an operand broadcast over the batch). The rest of :func:`why_not` applies too."""
    if p.a.element_size() != 2 or p.b.element_size() != 2:
        return "batched problems are taken for fp16/bf16 operands only"
    if p.scale_a is not None or p.scale_b is not None:
        return "batched problems take no scales"
    if not tma_aligned(p.a, p.a_strides[0]) or not tma_aligned(p.b, p.b_strides[0]):
        return "an operand's batch stride is not 16-byte aligned"
    if p.out_strides[0] == 0 or not tma_aligned(p.out, p.out_strides[0]):
        return "the output's batch stride is not 16-byte aligned"
    return None


# The CONFIG_KEY of each Gluon kernel module: a config carrying one of them launches that kernel.
GLUON_CONFIG_KEYS = ("GLUON_FP8", "GLUON_TF32", "GLUON_F16")


def gluon_kernel_for(p: GemmProblem):
    """The module of the Gluon kernel that takes ``p``, else None: :mod:`tilegemm.ops.matmul.gluon_fp8` for
    promoted fp8 (A row-major, B column-major), :mod:`tilegemm.ops.matmul.gluon_tf32` for tf32 NN and TT
    (an operand through registers), :mod:`tilegemm.ops.matmul.gluon_f16` for 16-bit operands with a 16-bit
    output. They are written for sm_90 against Triton 3.6's Gluon API (experimental, it moves between
    versions), and Gluon has no interpreter."""
    if why_not_gluon() is not None or p.batch != 1:
        # (A batched 16-bit problem reaches gluon_f16 by auto's own rule, dispatch.GLUON_F16_BATCHED, or by name.)
        return None
    from tilegemm.ops.matmul import gluon_f16, gluon_fp8, gluon_tf32

    # One kernel per operand width (each refuses the others' dtypes): only that one is asked.
    module = {1: gluon_fp8, 2: gluon_f16, 4: gluon_tf32}.get(p.a.element_size())
    return module if module is not None and module.why_not(p) is None else None


def candidates(p: GemmProblem) -> list[dict]:
    """The configs timed for ``p``: Triton's, a Gluon kernel's where one applies, and the K splits
    (:func:`split_configs`)."""
    gluon = gluon_kernel_for(p)
    extra = gluon.configs(p.out.element_size()) if gluon is not None else []
    return configs(p.a.element_size(), p.mma_operands) + extra + split_configs(p)


# 16-bit tiles offered with a K split (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; fp8 takes them with K steps of
# the same bytes, :func:`split_tiles`). For products with few output tiles and a long K; which tile wins depends
# on the shape (docs/rungs/persistent_tma.md). ``auto`` ranks them with the other candidates by the survey
# (:mod:`tilegemm.ops.matmul.survey`), where their split is ``"wave"``.
SPLIT_TILES = ((128, 128, 64, 4, 4), (64, 128, 128, 4, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3),
               (256, 128, 64, 8, 3))


def split_tiles(elem: int) -> tuple:
    """:data:`SPLIT_TILES` for operands of ``elem`` bytes: fp8 steps twice as deep in K (the same bytes a step).
    The 64x128 tile's fp8 steps are 256 deep, so its partial sums are promoted to fp32 every 256 K rather than
    every 128 as in the unsplit fp8 configs (within the fp8 bound of the tests either way)."""
    return SPLIT_TILES if elem == 2 else tuple((bm, bn, bk * 2 // elem, w, s) for bm, bn, bk, w, s in SPLIT_TILES)


def wave_split(p: GemmProblem, cfg: dict) -> int:
    """The K split that makes ``cfg``'s tiles of ``p`` about one wave of work units, each slice at least 4 K steps
    (:func:`tilegemm.ops.matmul.split_k.wave_split`)."""
    tiles = cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    return units_wave_split(tiles, cdiv(p.K, cfg["BLOCK_K"]), sm_count(p.out.device))


def split_configs(p: GemmProblem) -> list[dict]:
    """:func:`split_tiles` with the K split of one wave (:func:`wave_split`) where that split is above one: for
    16-bit and fp8 operands meeting the MMA from shared memory, on a GPU."""
    elem = p.a.element_size()
    if interpreting() or elem > 2 or p.b.element_size() != elem or p.mma_operands != "ab" or p.batch != 1:
        return []  # (a batched problem has a batch of tiles to spread: no split)
    out = []
    for tile in split_tiles(elem):
        cfg = make_config(*tile)
        split = wave_split(p, cfg)
        if split > 1:
            out.append(dict(cfg, SPLIT_K=split))
    return out


def offers_split(p: GemmProblem, cfg: dict) -> bool:
    """Whether ``cfg`` (its SPLIT_K aside) is one of :func:`split_configs`'s for ``p``."""
    def plain(c: dict) -> dict:
        return {k: v for k, v in c.items() if k != "SPLIT_K"}

    return any(plain(cfg) == plain(c) for c in split_configs(p))


def host_descriptors(p: GemmProblem, cfg: dict):
    """Triton host-side TMA descriptors of A, B (as :attr:`GemmProblem.tma_view` says they lie) and the
    output (in [BLOCK_M, BLOCK_N / 2] blocks) for config ``cfg``."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if p.batch != 1:
        return batched_descriptors(p, cfg)
    a, b = (TensorDescriptor(t, shape, [stride, 1], block)
            for t, shape, stride, block in p.tma_boxes(bm, bn, cfg["BLOCK_K"]))
    return a, b, TensorDescriptor(p.out, [p.M, p.N], [p.out_strides[1], 1], [bm, bn // 2])


def batched_descriptors(p: GemmProblem, cfg: dict):
    """:func:`host_descriptors` of a batched problem: 3-D ([batch, rows, cols], blocks [1, rows, cols]) for the
    output and each operand with a batch stride; 2-D, as unbatched, for an operand broadcast over the batch
    (stride 0; the kernel reads it at every batch)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    descs = []
    for (t, shape, stride, block), batch_stride in zip(p.tma_boxes(bm, bn, cfg["BLOCK_K"]),
                                                       (p.a_strides[0], p.b_strides[0])):
        if batch_stride == 0:
            descs.append(TensorDescriptor(t, shape, [stride, 1], block))
        else:
            descs.append(TensorDescriptor(t, [p.batch, *shape], [batch_stride, stride, 1], [1, *block]))
    out = TensorDescriptor(p.out, [p.batch, p.M, p.N], [p.out_strides[0], p.out_strides[1], 1], [1, bm, bn // 2])
    return (*descs, out)


def triton_launch_args(p: GemmProblem, cfg: dict, num_sms: int, ws: torch.Tensor | None = None):
    """(kernel, grid, args, constexpr kwargs) of the Triton kernel for :func:`tilegemm.core.launch.launch`;
    ``ws``: the planes of a config with ``SPLIT_K`` > 1 (:func:`launch_config` makes them)."""
    a_t, b_t, stride_a, stride_b = p.tma_view
    if p.batch != 1:
        # Batched: host descriptors (3-D where batched) and no split; the unbatched launch passes none of this.
        cfg = dict(cfg, HOST_DESC=True)
        ws = None
    split = cfg.get("SPLIT_K", 1) if ws is not None else 1  # no planes, no split
    tiles = cdiv(p.M, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"]) * split * p.batch
    flags = p.kernel_flags()
    operands = host_descriptors(p, cfg) if cfg.get("HOST_DESC") else (p.a, p.b, p.out)
    args = (
        *operands, *p.epilogue_pointers(),
        p.M, p.N, p.K,
        stride_a, stride_b, p.out_strides[1],
        p.c_strides[1], p.c_strides[2], p.bias_stride,
        p.scale_a_stride, p.scale_b_stride,
        p.alpha, p.beta, p.out if ws is None else ws, split,
    )
    kwargs = dict(A_T=a_t, B_T=b_t, HAS_C=flags["HAS_C"], HAS_BIAS=flags["HAS_BIAS"], ACTIVATION=p.activation,
                  INPUT_PRECISION=p.input_precision, HAS_SCALE_A=flags["HAS_SCALE_A"],
                  HAS_SCALE_B=flags["HAS_SCALE_B"], MMA_OPERANDS=flags["MMA_OPERANDS"], NUM_SMS=num_sms,
                  FAST_ACCUM=flags["FAST_ACCUM"], SPLIT=ws is not None, **({"UPCAST": True} if p.upcast else {}),
                  **{"WARP_SPECIALIZE": 0, "HOST_DESC": False, **cfg, **tile_order(cfg)})
    kwargs.pop("SPLIT_K", None)  # a runtime argument: one compiled kernel serves every split
    if p.batch != 1:
        kwargs.update(batch=p.batch, stride_cb=p.c_strides[0], BATCHED=True, A_BATCHED=p.a_strides[0] != 0, B_BATCHED=p.b_strides[0] != 0)
    return matmul_persistent_tma_kernel, (min(num_sms, tiles),), args, kwargs


def launch_config(p: GemmProblem, cfg: dict) -> None:
    num_sms = sm_count(p.out.device)
    if any(cfg.get(key) for key in GLUON_CONFIG_KEYS):
        gluon = gluon_kernel_for(p)
        if gluon is not None and cfg.get(gluon.CONFIG_KEY):
            launch(*gluon.launch_args(p, cfg, num_sms))
            return
        cfg = configs(p.a.element_size(), p.mma_operands)[0]  # a config tuned for another problem under the same key
    split = split_of(p, cfg)
    if split == 1:
        launch(*triton_launch_args(p, dict(cfg, SPLIT_K=1), num_sms))
        return
    cfg = dict(cfg, SPLIT_K=split)
    stream = current_stream() if p.out.is_cuda else 0
    ws, count = split_workspace(p.out.device, split * p.M * p.N, 1, tag="persistent_tma_split")
    with sequence_lock:  # the planes are the stream's: no other thread's launches between the two
        kernel, grid, args, kwargs = triton_launch_args(p, cfg, num_sms, ws)
        launch(kernel, grid, args, kwargs, keep=(ws,), stream=stream)
        launch_reduction(p, ws, count, split, stream)


def split_of(p: GemmProblem, cfg: dict) -> int:
    """The K split a config launches with: its ``SPLIT_K`` (1 without) as the number of slices its slice length
    makes (``cdiv(steps, cdiv(steps, SPLIT_K))``: no slice left without a K step), and 1 where the planes'
    offsets would pass 32 bits."""
    split = cfg.get("SPLIT_K", 1)
    if split <= 1 or p.batch != 1:  # (batched launches have no split: a neighbour's split config runs unsplit)
        return 1
    split = slices(cdiv(p.K, cfg["BLOCK_K"]), split)
    return 1 if split * p.M * p.N >= 2**31 else split


def slices(steps: int, split: int) -> int:
    """The slices a split of ``steps`` K steps in ``split`` launches: as many as its slice length makes."""
    return cdiv(steps, cdiv(steps, split))


def tuning_key(p: GemmProblem) -> str:
    """The key this rung's tuned config for ``p`` is kept under."""
    return p.tuning_key("persistent_tma")


def tuned_config(p: GemmProblem) -> dict | None:
    """The config this rung has for ``p``'s shape class (tuned, or shipped), or None before it is tuned."""
    return tuning.lookup(tuning_key(p))


def run(p: GemmProblem, config: dict | None = None) -> None:
    reason = why_not(p)
    if reason is not None:
        autotuned.run(p)
        return
    ensure_allocator()
    if config is not None:
        launch_config(p, config)  # a config asked for: launched as it is, or its error raised
        return
    config = tuning.lookup_or_tune(tuning_key(p), lambda: candidates(p), lambda cfg: launch_config(p, cfg))
    if config.get("SPLIT_K", 1) > 1:
        # A K split tuned for its own class (perhaps a neighbour's: tuning.nearest): the wave split of its
        # tile here, as the candidates are made.
        config = dict(config, SPLIT_K=wave_split(p, config))
    try:
        launch_config(p, config)
    except OutOfResources as err:
        launch_first_fitting(p, config, err)


def launch_first_fitting(p: GemmProblem, failed: dict, error: OutOfResources) -> None:
    """Launch the first of ``p``'s candidates, other than ``failed``, whose kernel fits the SM's shared memory,
    and keep it for the shape class (untimed, this process). A config chosen without timing (a neighbouring
    class's, the first candidate, a survey's pick) can need more than the SM has with this output dtype and
    epilogue (an fp8 case: docs/rungs/persistent_tma.md). Raises the last error if none fits.
    (A measured entry of the class, tuned without this epilogue, stays the class's first choice: a call that is
    not replayed tries it again.)"""
    for cfg in candidates(p):
        if cfg == failed:
            continue
        try:
            launch_config(p, cfg)
        except OutOfResources as err:
            error = err
            continue
        tuning.remember_untimed(tuning_key(p), cfg)
        return
    raise error


def _run_gluon(p: GemmProblem, name: str, module, config: dict | None = None) -> None:
    """Launch one Gluon kernel alone (``kernel="gluon_f16"`` etc.): ``config``, or the configs of that kernel
    only, tuned under a key of its own; a problem it does not take raises instead of falling back."""
    reason = why_not(p) or module.why_not(p)
    if reason is not None:
        raise NotApplicable(f"matmul kernel {name!r} does not take this problem: {reason}")
    ensure_allocator()
    num_sms = sm_count(p.out.device)
    if config is None:
        # Untimed, a batched problem takes the kernel's batched rule (gluon_f16.batched_config) where it has one.
        rule = getattr(module, "batched_config", None) if p.batch != 1 else None
        fallback = (lambda options: rule(p, num_sms, options)) if rule is not None else None
        config = tuning.lookup_or_tune(p.tuning_key(name), lambda: module.configs(p.out.element_size()),
                                       lambda cfg: launch(*module.launch_args(p, cfg, num_sms)), fallback=fallback)
    launch(*module.launch_args(p, config, num_sms))


def batched_gluon_f16(p: GemmProblem):
    """:mod:`tilegemm.ops.matmul.gluon_f16` where its batched launch takes ``p`` (a batched 16-bit product with a
    16-bit output that TMA can describe, on an sm_90 GPU), else None."""
    if p.batch == 1 or why_not_gluon() is not None or why_not(p) is not None:
        return None
    from tilegemm.ops.matmul import gluon_f16

    return gluon_f16 if gluon_f16.why_not(p) is None else None


def run_gluon_f16(p: GemmProblem, config: dict | None = None) -> None:
    from tilegemm.ops.matmul import gluon_f16

    _run_gluon(p, "gluon_f16", gluon_f16, config)


def run_gluon_fp8(p: GemmProblem, config: dict | None = None) -> None:
    from tilegemm.ops.matmul import gluon_fp8

    _run_gluon(p, "gluon_fp8", gluon_fp8, config)


def run_gluon_tf32(p: GemmProblem, config: dict | None = None) -> None:
    from tilegemm.ops.matmul import gluon_tf32

    _run_gluon(p, "gluon_tf32", gluon_tf32, config)
