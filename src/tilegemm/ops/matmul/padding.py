"""``auto``'s aligned twin of a product whose rows are not 16-byte aligned.

Triton's pointer kernels read such rows two bytes at a time, without asynchronous copies, and TMA cannot
describe them at all (how slow that ran: docs/rungs/auto.md). Padding K and the leading dimensions alone is not
enough: a tile's loads along an odd N (or M) wrap at its end, so they stay two bytes wide. So the whole product is run as its twin with M, N and K rounded up to 16
bytes of elements: A and B copied into zeroed, aligned buffers in their own layouts, the bias too, the
product written into an aligned buffer, and its M x N corner copied into the output. Zeros along K add
nothing; the rows and columns past M and N are dropped. The twin takes the aligned paths, TMA included.

The copies are Triton launches over per-stream workspaces (:func:`tilegemm.core.workspace.buffer`), so a plain
call's launches (both operands' copies in one, the product, the copy back) are recorded and replayed like any
other call's. The copies cost passes over the operands and the output, so ``auto`` pads only where the cost model
(:mod:`tilegemm.ops.matmul.cost`) says the twin plus the copies beats the misaligned product by a margin
(:func:`padding_pays`), and never a call with ``c`` (it would be read past N).

Rows 16 bytes apart but not 128 (a leading dimension a multiple of 8 elements but not of 64 in 16-bit) are read
at full width, yet a tile's rows then straddle 128-byte lines, and large products ran slower than with 128-byte
rows (docs/rungs/auto.md). ``auto`` copies such
an operand into a buffer whose rows are 128 bytes apart, same shape and layout, where the cost model prices the
copy below what it wins (:func:`restride_plan`); the twin's buffers are laid out the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import current_stream, keeping, launch, sequence_lock
from tilegemm.core.runtime import cdiv
from tilegemm.core.workspace import buffer
from tilegemm.ops.matmul import cost, split_k
from tilegemm.ops.matmul.configs import autotune_configs, prune_for


@triton.jit
def _copy_block(src_ptr, dst_ptr, R, C, stride_r, stride_c, RP, CP, block, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Block ``block`` (row-major over the blocks of RP x CP) of dst[r, c] = src[r, c] inside R x C, 0 elsewhere
    in RP x CP; dst is row-major, rows CP elements apart."""
    blocks_c = tl.cdiv(CP, BLOCK_C)
    offs_r = (block // blocks_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (block % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = offs_r.to(tl.int64)[:, None]
    c = offs_c.to(tl.int64)[None, :]
    inside = (r < R) & (c < C)
    values = tl.load(src_ptr + r * stride_r + c * stride_c, mask=inside, other=0.0)
    tl.store(dst_ptr + r * CP + c, values, mask=(r < RP) & (c < CP))


@triton.jit
def pad_copy_kernel(src_ptr, dst_ptr, R, C, stride_r, stride_c, RP, CP, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """dst[r, c] = src[r, c] inside R x C, 0 elsewhere in RP x CP; dst is row-major, rows CP elements apart."""
    pid = tl.program_id(0).to(tl.int64)  # one flat grid: a second grid axis would cap at 65535 blocks
    _copy_block(src_ptr, dst_ptr, R, C, stride_r, stride_c, RP, CP, pid, BLOCK_R, BLOCK_C)


@triton.jit
def pad_copy2_kernel(src_ptr, dst_ptr, R, C, stride_r, stride_c, RP, CP, blocks,
                     src2_ptr, dst2_ptr, R2, C2, stride2_r, stride2_c, RP2, CP2,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Two of :func:`pad_copy_kernel`'s copies in one launch: its first ``blocks`` programs the first."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < blocks:
        _copy_block(src_ptr, dst_ptr, R, C, stride_r, stride_c, RP, CP, pid, BLOCK_R, BLOCK_C)
    else:
        _copy_block(src2_ptr, dst2_ptr, R2, C2, stride2_r, stride2_c, RP2, CP2, pid - blocks, BLOCK_R, BLOCK_C)


def _round_up(n: int, to: int) -> int:
    return cdiv(n, to) * to


COPY_BLOCK = (32, 128)  # rows x columns a copy's program


def _copy_args(src: torch.Tensor, dst: torch.Tensor) -> tuple[tuple, int]:
    """(the copy kernel's arguments for ``dst`` = ``src`` padded, how many programs it takes)."""
    rows_to, ld = dst.shape[0], dst.stride(0)
    blocks = cdiv(rows_to, COPY_BLOCK[0]) * cdiv(ld, COPY_BLOCK[1])
    return (src, dst, src.shape[0], src.shape[1], src.stride(0), src.stride(1), rows_to, ld), blocks


def _copy(src: torch.Tensor, dst: torch.Tensor, keep: tuple) -> None:
    """``dst`` (row-major, rows ``dst.stride(0)`` apart) = ``src`` where it has values, 0 elsewhere."""
    args, blocks = _copy_args(src, dst)
    launch(pad_copy_kernel, (blocks,), args, dict(BLOCK_R=COPY_BLOCK[0], BLOCK_C=COPY_BLOCK[1], num_warps=4),
           keep=keep, stream=current_stream())


def _copy2(first: tuple, second: tuple, keep: tuple) -> None:
    """Two :func:`_copy` calls, each ``(src, dst)``, in one launch (same dtype)."""
    args, blocks = _copy_args(*first)
    args2, blocks2 = _copy_args(*second)
    launch(pad_copy2_kernel, (blocks + blocks2,), args + (blocks,) + args2,
           dict(BLOCK_R=COPY_BLOCK[0], BLOCK_C=COPY_BLOCK[1], num_warps=4), keep=keep, stream=current_stream())


ROW_BYTES = 128  # the copies' rows (or columns) start this many bytes apart: whole 128-byte lines


def padded_operands(*specs: tuple) -> list[torch.Tensor]:
    """Each ``(t, rows_to, cols_to, slot)``: ``t`` (2-D, one unit stride) as a ``rows_to x cols_to``
    zero-padded copy in an aligned workspace buffer, in ``t``'s own layout (rows or columns :data:`ROW_BYTES`
    apart); ``slot`` keeps the operands' buffers apart. Copies of one dtype go two to a launch."""
    copies, views = [], []
    for t, rows_to, cols_to, slot in specs:
        per = ROW_BYTES // t.element_size()
        column_major = t.stride(0) == 1 and t.stride(1) != 1
        s = t.mT if column_major else t  # the storage view: rows apart by its leading dimension, unit columns
        r, c = (cols_to, rows_to) if column_major else (rows_to, cols_to)
        ld = _round_up(c, per)
        buf = buffer(t.device, t.dtype, r * ld, ("pad", slot))
        dst = buf[: r * ld].view(r, ld)
        copies.append((s, dst, buf))
        view = dst[:, :c]
        views.append(view.mT if column_major else view)
    while copies:
        s, dst, buf = copies.pop(0)
        mate = next((i for i, other in enumerate(copies) if other[0].dtype == s.dtype), None)
        if mate is None:
            _copy(s, dst, (buf,))
        else:
            s2, dst2, buf2 = copies.pop(mate)
            _copy2((s, dst), (s2, dst2), (buf, buf2))
    return views


def twin_shape(M: int, N: int, K: int, elem: int, out_elem: int | None = None) -> tuple[int, int, int]:
    """M, N and K rounded up to 16 bytes of elements; N to 16 bytes of the output's too (``out_elem``, narrower
    than the operands' for fp32 products written in 16 bits): a TMA store writes whole 16-byte units, and
    ``persistent_tma.why_not`` refuses rows that end inside one."""
    per = 16 // elem
    return _round_up(M, per), _round_up(N, 16 // min(elem, out_elem or elem)), _round_up(K, per)


PADDED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def can_pad(a: torch.Tensor, b: torch.Tensor, c, bias, out: torch.Tensor) -> bool:
    """Whether :func:`run_padded` takes this call: 2-D 16- or 32-bit operands with a unit stride each, no
    ``c``, no bias or a contiguous 1-D one, a contiguous output."""
    return (a.dim() == 2 and b.dim() == 2 and a.dtype in PADDED_DTYPES and b.dtype == a.dtype
            and 1 in a.stride() and 1 in b.stride() and c is None and out.is_contiguous()
            and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1)))


# Pad only where the misaligned product is estimated to take at least this long: below it the extra launches
# and their host time weigh more than what the aligned loads win.
PAD_MIN_US = 15.0
PAD_GAIN = 0.7  # and the copies plus the twin at most this fraction of the misaligned product
# Not where M or N is this small: such a product streams the other operand once, memory-bound, and a copy
# would stream it three times (docs/rungs/auto.md).
PAD_MIN_MN = 16


def padding_pays(p) -> bool:
    """Whether ``auto`` should run problem ``p`` (rows not aligned) as its aligned twin: the cost model's best
    config of the twin plus the copies (a read and a write of both operands and of the output, three launches: the
    operands' copies, the product, the copy back) against its best config of the product as it is, each over
    ``autotuned``'s configs and ``split_k``'s (its unsplit ones too). For the product as it is that is a lower
    bound: ``auto`` runs ``split_k`` alone for M <= 128, and splits K for larger M only where the split is
    estimated 15% faster (the A/B of the choice as written here: docs/rungs/auto.md)."""
    if min(p.M, p.N) <= PAD_MIN_MN:
        return False
    options = prune_for(autotune_configs(), p.a.element_size()) + split_k.configs(p)
    misaligned = min(map(cost.problem_estimator(p, aligned=False), options))
    if misaligned < PAD_MIN_US:
        return False
    elem, out_elem = p.a.element_size(), p.out.element_size()
    Mp, Np, Kp = twin_shape(p.M, p.N, p.K, elem, out_elem)
    sms, peak, hbm = cost.device_rates(p)
    twin = min(cost.estimate_us(Mp, Np, Kp, 1, elem, out_elem, cfg, sms=sms, peak_tflops=peak, hbm_gbps=hbm)
               for cfg in options)
    copies = 2.0 * ((p.M * p.K + p.K * p.N) * elem + p.M * p.N * out_elem) / (hbm * 1e3) + 3 * cost.LAUNCH_US
    return twin + copies < PAD_GAIN * misaligned


def run_padded(a: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor, gemm) -> None:
    """``out = gemm(a2, b2, bias2, out2)[:M, :N]`` over the aligned twin: ``gemm`` computes the product of the
    padded operands into ``out2`` with the padded bias; its launches keep the buffers as their own (a replay
    passes them as recorded)."""
    with sequence_lock:  # the buffers are shared by the calls on this stream: no other thread in between
        _run_padded(a, b, bias, out, gemm)


def _run_padded(a, b, bias, out, gemm) -> None:
    M, K = a.shape
    N = b.shape[1]
    Mp, Np, Kp = twin_shape(M, N, K, a.element_size(), out.element_size())
    specs = [(a, Mp, Kp, "a"), (b, Kp, Np, "b")]
    if bias is not None:
        specs.append((bias.view(1, -1), 1, Np, "bias"))
    kept = padded_operands(*specs)  # A and B in one launch
    a2, b2 = kept[:2]
    bias2 = None
    if bias is not None:
        bias2 = kept[2] = kept[2][0]
    ld = _round_up(Np, ROW_BYTES // out.element_size())
    obuf = buffer(out.device, out.dtype, Mp * ld, ("pad", "out"))
    out2 = obuf[: Mp * ld].view(Mp, ld)[:, :Np]
    kept.append(out2)
    with keeping(*kept):
        gemm(a2, b2, bias2, out2)
    _copy(out2[:M, :N], out.view(M, N), (obuf,))


# Restriding (see the module's docstring). Share of a product's time that an operand whose rows are 16 bytes
# apart but not 128 costs, by how its tiles are read: K-major (A row-major, B column-major) or M/N-major
# (measured on the H100: docs/rungs/auto.md).
RESTRIDE_SHARE = {"k": 0.11, "mn": 0.22}
RESTRIDE_MARGIN = 0.7  # a copy must cost at most this fraction of what it is estimated to win
RESTRIDE_COPY_US = 5.0  # a copy's launch and its ramp, on top of its bytes
# Not below this K: a program's loop is then a few steps and its time the prologue and the output's stores
# (K = 280 and 400 lost 7%-9% with copies that the estimate priced as paying).
RESTRIDE_MIN_K = 512
RESTRIDE_MAX_BYTES = 1 << 30  # operands larger than this are read as they are (the copy's buffer is kept)
RESTRIDE_DTYPES = (torch.float16, torch.bfloat16)  # measured there only
# The product's time, for the estimate: at this fraction of the dtype's vendor peak (cuBLAS's large 16-bit
# products on the H100: about 0.6; only large products pay).
RESTRIDE_PEAK_FRACTION = 0.6


def _line_misaligned(t: torch.Tensor, lines_along: int) -> bool:
    """Whether ``t``'s rows (or columns: its non-unit stride) start other than 128 bytes apart, or its first
    does; ``lines_along`` is how many of them there are (one: only the base counts)."""
    size = t.element_size()
    lead = max(t.stride())
    return (t.data_ptr() % ROW_BYTES != 0) or (lines_along > 1 and lead * size % ROW_BYTES != 0)


def restride_plan(p, a: torch.Tensor, b: torch.Tensor) -> str:
    """Which of A and B (``""``, ``"a"``, ``"b"`` or ``"ab"``) ``auto`` copies into buffers whose rows are
    128 bytes apart before a 2-D 16-bit product whose rows are 16-byte aligned: each operand whose rows are
    not, where its copy (a read and a write, one launch) costs under :data:`RESTRIDE_MARGIN` of its share
    (:data:`RESTRIDE_SHARE`) of the product's estimated time, from K = :data:`RESTRIDE_MIN_K`."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype not in RESTRIDE_DTYPES or b.dtype != a.dtype:  # 2-D: one product
        return ""
    if 1 not in a.stride() or 1 not in b.stride() or p.K < RESTRIDE_MIN_K:
        return ""
    _, peak, hbm = cost.device_rates(p)
    product_us = 2.0 * p.M * p.N * p.K / (peak * RESTRIDE_PEAK_FRACTION * 1e6)
    plan = ""
    # (name, tensor, K-major, how many rows or columns its non-unit stride spaces)
    for name, t, k_major, lines in (("a", a, a.stride(1) == 1, p.M if a.stride(1) == 1 else p.K),
                                    ("b", b, b.stride(0) == 1, p.N if b.stride(0) == 1 else p.K)):
        nbytes = t.shape[0] * t.shape[1] * t.element_size()
        if nbytes > RESTRIDE_MAX_BYTES or not _line_misaligned(t, lines):
            continue
        copy_us = 2.0 * nbytes / (hbm * 1e3) + RESTRIDE_COPY_US
        if copy_us < RESTRIDE_MARGIN * RESTRIDE_SHARE["k" if k_major else "mn"] * product_us:
            plan += name
    return plan


def run_restrided(a: torch.Tensor, b: torch.Tensor, plan: str, gemm) -> None:
    """``gemm(a2, b2)`` where ``a2`` / ``b2`` are ``a`` / ``b`` copied into buffers whose rows are 128 bytes
    apart when ``plan`` names them (:func:`restride_plan`), else the tensors as given."""
    with sequence_lock:  # the buffers are shared by the calls on this stream: no other thread in between
        specs = [(t, t.shape[0], t.shape[1], name) for t, name in ((a, "a"), (b, "b")) if name in plan]
        copies = iter(padded_operands(*specs))  # both in one launch where both are copied
        a2 = next(copies) if "a" in plan else a
        b2 = next(copies) if "b" in plan else b
        with keeping(*(t for t, name in ((a2, "a"), (b2, "b")) if name in plan)):
            gemm(a2, b2)
