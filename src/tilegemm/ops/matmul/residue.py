"""Small-M products whose B rows are not 16-byte aligned, read in 16-byte vectors by residue class.

When B's leading dimension ``L`` (in elements) is not a multiple of 8 (16-bit), row ``o`` starts ``o * L``
elements into B: 2-byte aligned at best, so a tile kernel loads it two bytes at a time and, with no
``cp.async`` for such loads, waits on each step. With few rows of A (M <= 16) the product is a stream over B,
and that stream ran at about 1 TB/s (6x5661x26729 fp16 in 300 us, where cuBLAS took 229).

The rows fall into ``VEC`` residue classes (``VEC`` = 16 bytes / element): every row ``o = c + VEC * t`` of
class ``c`` starts ``r_c = (c * L) mod VEC`` elements past a 16-byte boundary. A program reads rows of one
class only, each from ``r_c`` elements before its start, so every row it loads begins on a 16-byte boundary
and loads in whole vectors; the first ``r_c`` values of a row are the previous row's last ones, and the
last few past the row's end the next row's first ones.

- **NN** (B contiguous along N; the rows are K's): a program's tile columns are then output columns shifted
  by ``r_c``, different for each class. Each (class, K slice) program writes its partial tile into a plane
  of its own, at its shifted columns, and :func:`tilegemm.ops.matmul.split_reduce.launch_reduction` adds the
  ``VEC x slices`` planes and applies the epilogue. The values read from a neighbouring row land in columns
  outside the output and are dropped.
- **NT** (B = W.T with W's rows along K: an ``nn.Linear`` whose ``in_features`` is not a multiple of 8): a program's tile rows
  are output columns of one class, and it reads A from ``r_c`` columns before each step, so that A's and
  B's columns meet; values from a neighbouring row are set to zero (they could be infinite) and meet zeros
  of A. One K slice stores through the epilogue directly; more go through the planes.

The last row of B is read apart with exact masks (reading past it could leave the allocation). A B whose own
first element is not 16-byte aligned (a sliced view) is not taken (:func:`why_not`).
"""

from __future__ import annotations

import torch
import triton

from tilegemm.core.hardware import sm_count
from tilegemm.core.launch import current_stream, launch, sequence_lock
from tilegemm.core.runtime import cdiv, interpreting
from tilegemm.core.workspace import split_workspace
from tilegemm.jit.helpers import epilogue_store
from tilegemm.ops.matmul.split_reduce import launch_reduction

import triton.language as tl  # noqa: E402


@triton.jit
def _load_a(a_ptr, offs_m, cols, M, bound, stride_am, stride_ak, UPCAST: tl.constexpr, INDEX_64: tl.constexpr):
    """A[rows, cols] for cols in [0, bound), zero elsewhere (an fp32 tile under the interpreter's bf16)."""
    mask = (offs_m < M)[:, None] & ((cols >= 0) & (cols < bound))[None, :]
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        cols = cols.to(tl.int64)
    a = tl.load(a_ptr + offs_m[:, None] * stride_am + cols[None, :] * stride_ak, mask=mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
    return a


@triton.jit
def matmul_residue_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_ob, stride_om, stride_on,
    stride_cb, stride_cm, stride_cn,
    stride_bias, stride_sa, stride_sb,
    alpha, beta,
    ws_ptr, count_ptr,
    SLICES, PLANES,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr, MMA_OPERANDS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, DIVISORS: tl.constexpr,
    INNER_N: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr, DIRECT: tl.constexpr,
):
    """Axis 0: (window, class) with the class fastest; axis 1: the K slice; axis 2: the batch. ``O`` names B's
    strided dimension (its rows), ``I`` its contiguous one; ``PLANES``: planes a batch in ``ws_ptr``."""
    pid = tl.program_id(0)
    cls = pid % VEC
    window = pid // VEC
    s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    a_ptr += pid_b * stride_ab
    out_ptr += pid_b * stride_ob
    c_ptr += pid_b * stride_cb
    ws_ptr += pid_b * PLANES * M * N
    if INNER_N:
        LD = stride_bk
        OUTER = K
        INNER = N
    else:
        LD = stride_bn
        OUTER = N
        INNER = K
    base = pid_b * stride_bb  # this batch's B, in elements from b_ptr (16-byte aligned)
    if INDEX_64:
        LD = LD.to(tl.int64)  # row offsets past 32 bits
    shift = (base + cls * LD) % VEC  # how far this class's rows start past a 16-byte boundary
    offs_m = tl.arange(0, BLOCK_M)  # (A's offsets are made 64-bit in _load_a where INDEX_64)
    j = tl.arange(0, BLOCK_I)
    u = tl.arange(0, BLOCK_O)
    # Columns past the row's end are read up to the next 16 bytes (whole vectors); mask in whole vectors.
    vectors = (INNER + shift + VEC - 1) // VEC
    last = OUTER - 1 + 0 * pid_b  # B's last row, read apart (64-bit: an int64 tensor even where OUTER is 1)
    if INNER_N:
        # Rows are K's: this class's rows in this slice, BLOCK_O a step; columns the window's, shifted.
        rows = (OUTER - cls + VEC - 1) // VEC
        steps = tl.cdiv(tl.cdiv(OUTER, VEC), BLOCK_O)
        per = tl.cdiv(steps, SLICES)
        t_begin = s * per * BLOCK_O
        t_end = tl.minimum(rows, t_begin + per * BLOCK_O)
        cols = window * BLOCK_I + j  # position past the 16-byte boundary; output column cols - shift
        col_ok = (cols // VEC) < vectors
        acc = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        for t0 in range(t_begin, t_end, BLOCK_O):
            t = t0 + u
            o = cls + VEC * t
            row_ok = (t < t_end) & (o < last)
            row_off = tl.multiple_of(base + o * LD - shift, VEC)
            b = tl.load(b_ptr + row_off[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
            a = _load_a(a_ptr, offs_m, tl.where(row_ok, o, -1), M, K, stride_am, stride_ak, UPCAST, INDEX_64)
            if UPCAST:
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        n = cols - shift
        t_last = last // VEC
        if (last % VEC == cls) & (t_last >= t_begin) & (t_last < t_end):
            b = tl.load(b_ptr + base + last * LD + n, mask=(n >= 0) & (n < N), other=0.0)
            a = tl.load(a_ptr + offs_m * stride_am + last * stride_ak, mask=offs_m < M, other=0.0)
            acc += a.to(tl.float32)[:, None] * b.to(tl.float32)[None, :]
        plane = ws_ptr + (cls * SLICES + s) * M * N
        tl.store(plane + offs_m[:, None] * N + n[None, :], acc,
                 mask=(offs_m < M)[:, None] & ((n >= 0) & (n < N))[None, :])
    else:
        # Rows are N's (output columns): BLOCK_O of this class's rows, all of this slice's K in steps.
        t = window * BLOCK_O + u
        o = cls + VEC * t
        if INDEX_64:
            o = o.to(tl.int64)  # output columns, in the epilogue's offsets too
        row_ok = o < last
        row_off = tl.multiple_of(base + o * LD - shift, VEC)
        steps = tl.cdiv(INNER + VEC - 1, BLOCK_I)
        per = tl.cdiv(steps, SLICES)
        i_begin = s * per * BLOCK_I
        i_end = tl.minimum(steps * BLOCK_I, i_begin + per * BLOCK_I)
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for i0 in range(i_begin, i_end, BLOCK_I):
            cols = i0 + j
            k = cols - shift
            k_ok = (k >= 0) & (k < K)
            b = tl.load(b_ptr + row_off[:, None] + cols[None, :],
                        mask=row_ok[:, None] & ((cols // VEC) < vectors)[None, :], other=0.0)
            b = tl.where(k_ok[None, :], b, 0.0)  # a neighbouring row's values: zero, whatever they are
            a = _load_a(a_ptr, offs_m, k, M, K, stride_am, stride_ak, UPCAST, INDEX_64)
            if UPCAST:
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION)
        t_last = last // VEC
        if (last % VEC == cls) & (t_last >= window * BLOCK_O) & (t_last < window * BLOCK_O + BLOCK_O):
            tail = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for i0 in range(i_begin, i_end, BLOCK_I):
                k = i0 + j - shift
                k_ok = (k >= 0) & (k < K)
                b = tl.load(b_ptr + base + last * LD + k, mask=k_ok, other=0.0)
                a = _load_a(a_ptr, offs_m, k, M, K, stride_am, stride_ak, True, INDEX_64)
                tail += tl.sum(a * b.to(tl.float32)[None, :], axis=1)
            acc += tl.where((t == t_last)[None, :], tail[:, None], 0.0)
        if DIRECT:
            epilogue_store(acc, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, o, M, N,
                           stride_om, stride_on, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
                           alpha, beta, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B, DIVISORS)
        else:
            tl.store(ws_ptr + s * M * N + offs_m[:, None] * N + o[None, :], acc,
                     mask=(offs_m < M)[:, None] & (o < N)[None, :])


# --- host side ----------------------------------------------------------------------------------------------

# (BLOCK_O, BLOCK_I, warps, stages) for 16-bit operands: NN's tile is BLOCK_O rows of K by BLOCK_I columns of
# N; NT's BLOCK_O output columns by BLOCK_I of K. With the K split filling PROGRAMS_PER_SM programs an SM: the
# best of the tiles and occupancies measured (docs/rungs/split_k.md).
TILES = {"NN": (32, 256, 4, 3), "NT": (64, 128, 4, 3)}
PROGRAMS_PER_SM = {"NN": 4, "NT": 8}
MIN_STEPS = 2  # steps a K slice keeps at least
PLANE_SHARE = 0.25  # the planes (written and read) may cost at most this share of B's bytes
# Below this many bytes of B the product is over in a few microseconds, and the path before (split_k's
# misaligned rule, one launch) ran as fast or faster (docs/rungs/split_k.md).
MIN_B_BYTES = 8 << 20


def why_not(p) -> str | None:
    """None when this kernel takes ``p``: M <= 16, 16-bit, B contiguous along N (NN) or K (NT) with its rows not
    16 bytes apart but its first element 16-byte aligned, at least :data:`MIN_B_BYTES` of it; for NN the ``VEC``
    planes within :data:`PLANE_SHARE` of B's bytes (K of at least 128 M); on a GPU. Otherwise why not."""
    if interpreting() and not TAKE_UNDER_INTERPRETER:
        return "a GPU path: the interpreter takes the aligned kernels"
    if p.M > 16:
        return "M above 16"
    if p.dtype not in (torch.float16, torch.bfloat16) or p.b.dtype != p.dtype:
        return "not a 16-bit problem"
    layout = _layout(p)
    if layout is None:
        return "B contiguous along neither N nor K"
    if p.b.data_ptr() % 16:
        return "B's first element is not 16-byte aligned"
    vec = 16 // p.b.element_size()
    ld = p.b_strides[1] if layout == "NN" else p.b_strides[2]
    if ld % vec == 0 or (p.N if layout == "NN" else p.K) < vec:
        return "B's rows are 16-byte aligned, or shorter than a vector"
    b_bytes = p.K * p.N * p.b.element_size()
    if not TAKE_UNDER_INTERPRETER and b_bytes < MIN_B_BYTES:
        return "B under MIN_B_BYTES: the aligned kernels' one launch is as fast"
    if not TAKE_UNDER_INTERPRETER and layout == "NN" and vec * _plane_bytes(p) > PLANE_SHARE * b_bytes:
        return "the NN planes pass PLANE_SHARE of B's bytes"
    if p.batch * vec * p.M * p.N >= 2**31:
        return "plane offsets pass 32 bits within a batch"
    return None


TAKE_UNDER_INTERPRETER = False  # tests: let the interpreter take it, and any size of product


def _plane_bytes(p) -> int:
    """Bytes one plane costs: written by the product, read by the reduction."""
    return p.M * p.N * 4 * 2


def _layout(p) -> str | None:
    if p.b_strides[2] == 1 and p.b_strides[1] >= p.N:
        return "NN"
    if p.b_strides[1] == 1 and p.b_strides[2] >= p.K:
        return "NT"
    return None


def config(p) -> dict:
    """The tile and K split for ``p`` (:data:`TILES`): slices until about :data:`PROGRAMS_PER_SM` programs an
    SM, each slice at least :data:`MIN_STEPS` steps, the planes within :data:`PLANE_SHARE` of B's bytes."""
    layout = _layout(p)
    vec = 16 // p.b.element_size()
    bo, bi, warps, stages = TILES[layout]
    if layout == "NN":
        steps = cdiv(cdiv(p.K, vec), bo)
        planes_per_slice = vec
    else:
        steps = cdiv(p.K + vec - 1, bi)
        planes_per_slice = 1
    programs = _windows(p, layout, bo, bi) * vec * p.batch
    target = PROGRAMS_PER_SM[layout] * (1 if interpreting() else sm_count(p.out.device))
    b_bytes = p.K * p.N * p.b.element_size()
    slices = 1
    while (programs * slices * 2 <= target and steps >= MIN_STEPS * slices * 2
           and planes_per_slice * slices * 2 * _plane_bytes(p) <= PLANE_SHARE * b_bytes
           and p.batch * planes_per_slice * slices * 2 * p.M * p.N < 2**31):
        slices *= 2
    return dict(LAYOUT=layout, BLOCK_O=bo, BLOCK_I=bi, num_warps=warps, num_stages=stages, SLICES=slices)


def launch_args(p, cfg: dict, ws: torch.Tensor, count: torch.Tensor):
    """(kernel, grid, args, constexpr kwargs) of the product for :func:`tilegemm.core.launch.launch`."""
    layout, slices = cfg["LAYOUT"], cfg["SLICES"]
    vec = 16 // p.b.element_size()
    bo, bi = cfg["BLOCK_O"], cfg["BLOCK_I"]
    windows = _windows(p, layout, bo, bi)
    planes = planes_of(p, cfg)
    flags = dict(p.kernel_flags(), INNER_N=layout == "NN", VEC=vec, BLOCK_M=16, BLOCK_O=bo, BLOCK_I=bi,
                 DIRECT=planes == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    args = (*p.kernel_args(), ws, count, slices, planes)
    return matmul_residue_kernel, (windows * vec, slices, p.batch), args, flags


def _windows(p, layout: str, bo: int, bi: int) -> int:
    """Programs a class and K slice: NN's windows of BLOCK_I columns over N and the up to VEC - 1 columns a
    class is shifted by; NT's BLOCK_O of the class's N / VEC rows each."""
    vec = 16 // p.b.element_size()
    return cdiv(p.N + vec - 1, bi) if layout == "NN" else cdiv(cdiv(p.N, vec), bo)


def planes_of(p, cfg: dict) -> int:
    """Planes a batch the product writes for the reduction (0: none)."""
    vec = 16 // p.b.element_size()
    return vec * cfg["SLICES"] if cfg["LAYOUT"] == "NN" else (0 if cfg["SLICES"] == 1 else cfg["SLICES"])


def run(p, cfg: dict | None = None) -> None:
    """Launch the product (and, where it has planes, their reduction) on the current stream."""
    cfg = dict(config(p), **(cfg or {}))
    planes = planes_of(p, cfg)
    if planes * p.M * p.N >= 2**31:
        raise ValueError(f"residue: {planes} planes of {p.M}x{p.N} pass 32-bit offsets; use fewer K slices")
    if planes == 0:  # the epilogue stores directly: no workspace (the output stands in for its pointers)
        kernel, grid, args, flags = launch_args(p, cfg, p.out, p.out)
        launch(kernel, grid, args, flags)
        return
    ws, count = split_workspace(p.out.device, p.batch * planes * p.M * p.N, 1, tag="residue")
    kernel, grid, args, flags = launch_args(p, cfg, ws, count)
    stream = current_stream() if p.out.is_cuda else 0
    with sequence_lock:  # the planes are the stream's: no other thread's launches between the two
        launch(kernel, grid, args, flags, keep=(ws, count), stream=stream)
        launch_reduction(p, ws, count, planes, stream)
