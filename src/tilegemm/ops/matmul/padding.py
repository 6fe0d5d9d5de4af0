"""``auto``'s aligned twin of a product whose rows are not 16-byte aligned.

Triton's pointer kernels read such rows two bytes at a time, without asynchronous copies, and TMA cannot
describe them at all: on the H200 a misaligned 1723x449x15855 fp16 product ran 1.9 ms where cuBLAS took 234
us (``benchmarks/results/2026-11-23-h200/a764849/``). Padding K and the leading dimensions alone is not
enough: a tile's loads along an odd N (or M) wrap at its end, so they stay two bytes wide
(``2026-11-23-h200/f2d002d/``). So the whole product is run as its twin with M, N and K rounded up to 16
bytes of elements: A and B copied into zeroed, aligned buffers in their own layouts, the bias too, the
product written into an aligned buffer, and its M x N corner copied into the output. Zeros along K add
nothing; the rows and columns past M and N are dropped. The twin takes the aligned paths, TMA included.

The copies are Triton launches over per-stream workspaces (:func:`tilegemm.core.workspace.buffer`), so a
plain call's launches (copies, product, copy back) are recorded and replayed like any other call's. The
copies cost passes over the operands and the output, so ``auto`` pads only where the cost model
(:mod:`tilegemm.ops.matmul.cost`) says the twin plus the copies beats the misaligned product by a margin
(:func:`padding_pays`), and never a call with ``c`` (it would be read past N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.launch import current_stream, keeping, launch, sequence_lock
from tilegemm.core.runtime import cdiv
from tilegemm.core.workspace import buffer


@triton.jit
def pad_copy_kernel(src_ptr, dst_ptr, R, C, stride_r, stride_c, RP, CP, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """dst[r, c] = src[r, c] inside R x C, 0 elsewhere in RP x CP; dst is row-major, rows CP elements apart."""
    blocks_c = tl.cdiv(CP, BLOCK_C)
    pid = tl.program_id(0).to(tl.int64)  # one flat grid: a second grid axis would cap at 65535 blocks
    offs_r = (pid // blocks_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (pid % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = offs_r.to(tl.int64)[:, None]
    c = offs_c.to(tl.int64)[None, :]
    inside = (r < R) & (c < C)
    values = tl.load(src_ptr + r * stride_r + c * stride_c, mask=inside, other=0.0)
    tl.store(dst_ptr + r * CP + c, values, mask=(r < RP) & (c < CP))


def _round_up(n: int, to: int) -> int:
    return cdiv(n, to) * to


def _copy(src: torch.Tensor, dst: torch.Tensor, keep: tuple) -> None:
    """``dst`` (row-major, rows ``dst.stride(0)`` apart) = ``src`` where it has values, 0 elsewhere."""
    rows_to, ld = dst.shape[0], dst.stride(0)
    block_r, block_c = 32, 128
    grid = (cdiv(rows_to, block_r) * cdiv(ld, block_c),)
    launch(pad_copy_kernel, grid, (src, dst, src.shape[0], src.shape[1], src.stride(0), src.stride(1), rows_to, ld),
           dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4), keep=keep, stream=current_stream())


def padded_operand(t: torch.Tensor, rows_to: int, cols_to: int, slot) -> torch.Tensor:
    """``t`` (2-D, one unit stride) as a ``rows_to x cols_to`` zero-padded copy in an aligned workspace buffer,
    in ``t``'s own layout (rows or columns 16 bytes apart). ``slot`` keeps the operands' buffers apart."""
    per = 16 // t.element_size()
    column_major = t.stride(0) == 1 and t.stride(1) != 1
    s = t.mT if column_major else t  # the storage view: rows apart by its leading dimension, unit columns
    r, c = (cols_to, rows_to) if column_major else (rows_to, cols_to)
    ld = _round_up(c, per)
    buf = buffer(t.device, t.dtype, r * ld, ("pad", slot))
    dst = buf[: r * ld].view(r, ld)
    _copy(s, dst, (buf,))
    view = dst[:, :c]
    return view.mT if column_major else view


def twin_shape(M: int, N: int, K: int, elem: int) -> tuple[int, int, int]:
    """M, N and K rounded up to 16 bytes of elements."""
    per = 16 // elem
    return _round_up(M, per), _round_up(N, per), _round_up(K, per)


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
# would stream it three times. Misaligned M <= 16 products ran 0.78x cuBLAS unpadded and 0.55x padded (H200,
# random sweep, benchmarks/results/2026-11-23-h200/a764849/ and f2d002d/).
PAD_MIN_MN = 16


def padding_pays(p) -> bool:
    """Whether ``auto`` should run problem ``p`` (rows not aligned) as its aligned twin: the cost model's best
    config of the twin plus the copies (a read and a write of both operands and of the output, four
    launches) against its best config of the product as it is."""
    from tilegemm.ops.matmul.configs import autotune_configs, prune_for
    from tilegemm.ops.matmul.cost import LAUNCH_US, device_rates, estimate_us, problem_estimator

    if min(p.M, p.N) <= PAD_MIN_MN:
        return False
    options = prune_for(autotune_configs(), p.a.element_size())
    misaligned = min(map(problem_estimator(p, aligned=False), options))
    if misaligned < PAD_MIN_US:
        return False
    elem, out_elem = p.a.element_size(), p.out.element_size()
    Mp, Np, Kp = twin_shape(p.M, p.N, p.K, elem)
    sms, peak, hbm = device_rates(p)
    twin = min(estimate_us(Mp, Np, Kp, 1, elem, out_elem, cfg, sms=sms, peak_tflops=peak, hbm_gbps=hbm)
               for cfg in options)
    copies = 2.0 * ((p.M * p.K + p.K * p.N) * elem + p.M * p.N * out_elem) / (hbm * 1e3) + 4 * LAUNCH_US
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
    Mp, Np, Kp = twin_shape(M, N, K, a.element_size())
    a2 = padded_operand(a, Mp, Kp, "a")
    b2 = padded_operand(b, Kp, Np, "b")
    kept = [a2, b2]
    bias2 = None
    if bias is not None:
        bias2 = padded_operand(bias.view(1, -1), 1, Np, "bias")[0]
        kept.append(bias2)
    ld = _round_up(Np, 16 // out.element_size())
    obuf = buffer(out.device, out.dtype, Mp * ld, ("pad", "out"))
    out2 = obuf[: Mp * ld].view(Mp, ld)[:, :Np]
    kept.append(out2)
    with keeping(*kept):
        gemm(a2, b2, bias2, out2)
    _copy(out2[:M, :N], out.view(M, N), (obuf,))
