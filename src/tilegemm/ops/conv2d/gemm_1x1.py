"""1x1 convolutions without padding: a plain GEMM, run by :func:`tilegemm.matmul`, or straight through
gluon_f16 with a config by rule for layers over many pixels (:func:`gluon_1x1`).

Channels-last, the input ``[N, C, H, W]`` is a row-major ``[N*H*W, C]`` matrix in place, and the output
``[N*H*W, K] = x @ w^T`` is the channels-last output. NCHW, each image is a ``[C, H*W]`` matrix and
``out[n] = w @ x[n]`` is the NCHW output, one batched GEMM with the weight broadcast; the bias then runs along
rows, so it enters as matmul's ``c`` (``[K, 1]``, added before the activation like a bias).

With a stride (ResNet's downsampling projections, 1x1 stride 2), channels-last only: the pixels the stride
keeps are gathered first into a row-major ``[N*P*Q, C]`` matrix (:func:`subsample_kernel`, a quarter of the
input's bytes at stride 2, into a per-stream workspace), then the same GEMM. The implicit-GEMM kernel ran these
layers at 0.22x-0.33x of cuDNN on the H200 (GPU time) (`benchmarks/results/2026-11-24-h200/ea09bc4/`), reading each pixel
through a gathered address where the GEMM reads whole rows.

The data gradient of such a layer is the transposed product spread out again (:func:`strided_dgrad`): the GEMM
``dy[N*P*Q, K] @ w[K, C]`` into a per-stream workspace, then :func:`spread_kernel` writes every input pixel's
gradient, that row where the stride kept the pixel and zeros elsewhere, in one pass over ``dx``.
"""

from __future__ import annotations

import torch
import triton

from tilegemm.ops.conv2d.problem import ConvProblem, channels_last

import triton.language as tl  # noqa: E402


@triton.jit
def subsample_kernel(src_ptr, dst_ptr, rows, C, P, Q, stride_n, stride_p, stride_q,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[(n*P + p)*Q + q, c] = src[n*stride_n + p*stride_p + q*stride_q + c]``: the pixels a strided 1x1
    convolution reads (channels contiguous), as the rows of a row-major ``[N*P*Q, C]`` matrix."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] output rows: pixels (n, p, q)
    n = r // (P * Q)
    p = (r // Q) % P
    q = r % Q
    src_row = n.to(tl.int64) * stride_n + p.to(tl.int64) * stride_p + q.to(tl.int64) * stride_q
    dst_row = r.to(tl.int64) * C
    r_ok = r < rows
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = r_ok[:, None] & (c < C)[None, :]
        v = tl.load(src_ptr + src_row[:, None] + c[None, :], mask=mask)
        tl.store(dst_ptr + dst_row[:, None] + c[None, :], v, mask=mask)


@triton.jit
def spread_kernel(src_ptr, dst_ptr, pixels, C, H, W, P, Q, SH: tl.constexpr, SW: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[(n*H + h)*W + w, c] = src[(n*P + h/SH)*Q + w/SW, c]`` where SH divides h and SW divides w, else 0:
    a strided 1x1 convolution's data gradient from its row-major ``[N*P*Q, C]`` product, every row of the
    row-major ``[N*H*W, C]`` output written (the inverse of :func:`subsample_kernel`, zeros between)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] output rows: pixels (n, h, w)
    w = r % W
    h = (r // W) % H
    n = r // (H * W)
    r_ok = r < pixels
    # A kept pixel's row of the product (h // SH < P holds for every h < H when SH divides h).
    hit = r_ok & (h % SH == 0) & (w % SW == 0) & (w // SW < Q)
    src_row = ((n * P + h // SH) * Q + w // SW) * C
    dst_row = r * C
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = (c < C)[None, :]
        v = tl.load(src_ptr + src_row[:, None] + c[None, :], mask=hit[:, None] & c_ok, other=0.0)
        tl.store(dst_ptr + dst_row[:, None] + c[None, :], v, mask=r_ok[:, None] & c_ok)


def dgrad_product(dy2d: torch.Tensor, w2d: torch.Tensor, image: tuple[int, int, int], precision: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``dy2d @ w2d`` (``[N*P*Q, K] @ [K, C]``): a 1x1 layer's data gradient over the ``image`` (N, P, Q) of
    output pixels, run as the transposed layer's forward (K -> C channels) would be: :func:`gluon_1x1` by its
    rule, else ``auto``'s choice (:func:`tilegemm.matmul`, or launched straight into ``out`` when given)."""
    from tilegemm.core.runtime import interpreting
    from tilegemm.ops.conv2d.problem import Geometry

    (K, C), (n, p, q) = w2d.shape, image
    done = gluon_1x1(dy2d, w2d, Geometry(n, K, p, q, C, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)), out=out)
    if done is not None:
        return done
    if out is None:
        from tilegemm.ops.matmul.api import matmul

        return matmul(dy2d, w2d, precision=precision)
    from tilegemm.ops.matmul.dispatch import launch_auto
    from tilegemm.ops.matmul.problem import make_problems

    upcast = dy2d.dtype == torch.bfloat16 and interpreting()
    for gp in make_problems(dy2d, w2d, out, None, None, 1.0, 0.0, "none", precision, upcast):
        launch_auto(gp)
    return out


def strided_dgrad(dy: torch.Tensor, weight: torch.Tensor, g, precision: str) -> torch.Tensor:
    """The data gradient of strided 1x1 layer ``g`` (:attr:`Geometry.is_strided_pointwise`) for a channels-last
    ``dy``: ``[N, C, H, W]``, channels-last. The product ``dy @ w`` over the kept pixels runs as the transposed
    layer's forward would (:func:`gluon_1x1` by its rule, else ``auto``'s choice), into a per-stream workspace
    that the launches keep (the call replays); :func:`spread_kernel` then writes ``dx``.

    ResNet-50's projections ran their data gradients on the phased implicit-GEMM kernel at 0.29x-0.45x of
    cuDNN's GPU time (e.g. 1024 -> 2048 at 14x14: 69.8 against 21.4 us; H200,
    `benchmarks/results/2026-11-24-h200/cd4832f/`), each output pixel gathered through its own address."""
    from tilegemm.core.launch import current_stream, keeping, launch, sequence_lock
    from tilegemm.core.runtime import cdiv, new_output
    from tilegemm.core.workspace import buffer

    rows = g.N * g.P * g.Q
    dy2d = dy.permute(0, 2, 3, 1).reshape(rows, g.K)  # a view of a channels-last dy
    w2d = weight.reshape(g.K, g.C)
    dx = new_output((g.N, g.H, g.W, g.C), dy.dtype, dy.device)
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        buf = buffer(dy.device, dy.dtype, rows * g.C, "conv2d-dgrad-spread")
        small = buf[: rows * g.C].view(rows, g.C)
        with keeping(buf):
            dgrad_product(dy2d, w2d, (g.N, g.P, g.Q), precision, out=small)
        block_r, block_c = 64, 64
        pixels = g.N * g.H * g.W
        launch(spread_kernel, (cdiv(pixels, block_r),), (small, dx, pixels, g.C, g.H, g.W, g.P, g.Q),
               dict(SH=g.stride[0], SW=g.stride[1], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4), keep=(buf,),
               stream=current_stream() if dy.is_cuda else None)
    return dx.permute(0, 3, 1, 2)


# The weight gradient of a stride-1 1x1 layer, ``dw[K, C] = dy^T @ x`` over the N*H*W pixels: few output tiles over
# a long reduction. split_k's untimed choice ranked big tiles in a wave of slices first (128x256x100352, 256 -> 128
# at 56x56: 128x256 tiles in 132 slices, slower than any of the five configs timed fastest), where 64x64x128
# tiles on a 6-deep pipeline in one wave of slices ran best or within 4% of best on the four such layers with up
# to 16 of those tiles (35.2 us against 33.3 for cuBLAS there; H200, tools/time_candidates.py,
# benchmarks/results/2026-11-25-h200/7e2b5b8/candidates-*-TN.json). Layers with more tiles keep split_k's choice
# (2048x512x1568: 64x128 tiles unsplit, its best).
WGRAD_TILE = (64, 64, 128, 4, 6)  # BLOCK_M, BLOCK_N, BLOCK_K (16-bit), warps, stages


def pointwise_wgrad(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` for a 1x1 layer's weight gradient (``a = dy^T`` ``[K, NHW]``, ``b = x`` ``[NHW, C]``), through
    ``split_k`` on a GPU: for 16-bit operands with at most one 64x64 tile an SM, :data:`WGRAD_TILE` in one wave of
    K slices; otherwise split_k's own choice (on ResNet-50's twelve 1x1 layers split_k ran 0.85x cuDNN's weight
    gradient where auto's general choice ran 0.74x; H200, CUDA graphs,
    ``benchmarks/results/2026-11-24-h200/f063e9f/wgrad-1x1.json``). Elsewhere ``auto``."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.runtime import cdiv, interpreting, new_output
    from tilegemm.ops.matmul import split_k
    from tilegemm.ops.matmul.api import matmul
    from tilegemm.ops.matmul.problem import make_problems

    if not a.is_cuda or interpreting():
        return matmul(a, b, precision=precision)
    bm, bn, bk, warps, stages = WGRAD_TILE
    (M, K), N = a.shape, b.shape[1]
    tiles = cdiv(M, bm) * cdiv(N, bn)
    sms = sm_count(a.device)
    if a.element_size() != 2 or b.dtype != a.dtype or tiles > sms:
        return matmul(a, b, precision=precision, kernel="split_k")
    cfg = split_k.make_config(bm, bn, bk, warps, stages, split_k.wave_split(tiles, cdiv(K, bk), sms))
    out = new_output((M, N), a.dtype, a.device)
    for p in make_problems(a, b, out, None, None, 1.0, 0.0, "none", precision, False):
        split_k.run(p, cfg)
    return out


def applies(p: ConvProblem) -> str | None:
    """None when this kernel takes the problem, else why not."""
    g = p.geo
    if g.is_pointwise:
        return None
    if g.is_strided_pointwise:
        if not channels_last(p.x):
            return ("gemm_1x1 takes strided 1x1 filters with a channels-last input only (NCHW inputs and channel "
                    "slices go to implicit_gemm)")
        return None
    return "gemm_1x1 takes 1x1 filters with no padding and groups=1 only"


def subsampled(x: torch.Tensor, g) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kept pixels of channels-last ``x`` as a row-major ``[N*P*Q, C]`` matrix, the workspace holding it)."""
    from tilegemm.core.launch import current_stream, launch
    from tilegemm.core.runtime import cdiv
    from tilegemm.core.workspace import buffer

    rows = g.N * g.P * g.Q
    buf = buffer(x.device, x.dtype, rows * g.C, "conv2d-subsample")
    xs = buf[: rows * g.C].view(rows, g.C)
    sn, _, sh, sw = x.stride()
    block_r, block_c = 32, 64
    launch(subsample_kernel, (cdiv(rows, block_r),),
           (x, xs, rows, g.C, g.P, g.Q, sn, sh * g.stride[0], sw * g.stride[1]),
           dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4), keep=(buf,),
           stream=current_stream() if x.is_cuda else None)
    return xs, buf


def _gluon_operands(a: torch.Tensor, b: torch.Tensor, bias) -> bool:
    """What gluon_f16 needs of a GEMM's operands and of the process: 16-bit CUDA tensors of one dtype, a bias of
    that dtype at unit stride, and an sm_90 GPU under Triton 3.6 (whose Gluon the kernel is written in; asked
    before anything imports it)."""
    from tilegemm.core.runtime import interpreting

    if interpreting() or not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        return False
    if bias is not None and (bias.dtype != a.dtype or bias.stride(0) != 1):
        return False
    from tilegemm.core.hardware import why_not_gluon

    return why_not_gluon() is None


def gluon_usable(x: torch.Tensor, weight: torch.Tensor, bias, out_dtype) -> bool:
    """Whether the tensors of a 1x1 call let :func:`gluon_1x1` run it (the geometry's side is
    :func:`tilegemm.ops.conv2d.configs.pointwise_gluon_tile`): :func:`_gluon_operands`, and a channels-last
    ``x``, ``x`` and the weight 16-byte aligned, an output of ``x``'s dtype."""
    if out_dtype != x.dtype or x.stride(1) != 1 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    return _gluon_operands(x, weight, bias)


def gluon_1x1(a: torch.Tensor, b: torch.Tensor, g, bias=None, activation: str = "none",
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``a @ b`` (``[M, C] @ [C, K]``: 1x1 layer ``g`` as a GEMM, or its data gradient's) through gluon_f16 with
    the tile :func:`tilegemm.ops.conv2d.configs.pointwise_gluon_tile` gives for ``g``, into ``out`` (a
    row-major 16-bit ``[M, K]``; a new one by default); or None where that rule or the kernel does not take
    the call (then :func:`tilegemm.matmul` runs it)."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.ops.conv2d.configs import pointwise_gluon_tile

    if not _gluon_operands(a, b, bias):
        return None
    sms = sm_count(a.device)
    tile = pointwise_gluon_tile(g, sms)
    if tile is None:
        return None
    from tilegemm.core.launch import launch
    from tilegemm.core.runtime import new_output
    from tilegemm.ops.matmul import gluon_f16
    from tilegemm.ops.matmul.persistent_tma import ensure_allocator, why_not
    from tilegemm.ops.matmul.problem import make_problems

    if out is None:
        out = new_output((a.shape[0], b.shape[1]), a.dtype, a.device)
    (gp,) = make_problems(a, b, out, None, bias, 1.0, 0.0, activation, "ieee", False)
    if why_not(gp) or gluon_f16.why_not(gp):
        return None
    ensure_allocator()
    launch(*gluon_f16.launch_args(gp, gluon_config(tile), sms))
    return out


def gluon_config(tile: tuple[int, int, int, int]) -> dict:
    """The gluon_f16 config of ``tile`` (BLOCK_M, BLOCK_N, BLOCK_K, STAGES), its output buffer unshared."""
    from tilegemm.ops.matmul.gluon_f16 import NUM_WARPS

    bm, bn, bk, stages = tile
    return dict(GLUON_F16=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, SHARED_OUT=False,
                num_warps=NUM_WARPS)


def run(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    from tilegemm.ops.matmul.api import matmul

    reason = applies(p)
    if reason:
        from tilegemm.core.registry import NotApplicable

        raise NotApplicable(reason)
    g = p.geo
    w2d = p.weight.reshape(g.K, g.C)  # [K, C]
    act = None if p.activation == "none" else p.activation
    if g.is_strided_pointwise:
        from tilegemm.core.launch import keeping, sequence_lock

        with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
            xs, buf = subsampled(p.x, g)
            with keeping(buf):
                out = matmul(xs, w2d.t(), bias=p.bias, activation=act, out_dtype=p.out_dtype,
                             precision=p.precision)
        out = out.view(g.N, g.P, g.Q, g.K).permute(0, 3, 1, 2)  # [N, K, P, Q], channels-last
    elif p.out_format == torch.channels_last or channels_last(p.x):
        x2d = p.x.permute(0, 2, 3, 1).reshape(g.N * g.H * g.W, g.C)  # [NHW, C], a view when channels-last
        into = None if p.out is None else p.out.permute(0, 2, 3, 1).view(g.N * g.H * g.W, g.K)
        out = gluon_1x1(x2d, w2d.t(), g, p.bias, p.activation, into) if p.out_dtype == p.x.dtype else None
        if out is None:
            out = matmul(x2d, w2d.t(), bias=p.bias, activation=act, out_dtype=p.out_dtype, precision=p.precision)
        out = out.view(g.N, g.H, g.W, g.K).permute(0, 3, 1, 2)  # [N, K, H, W], channels-last
    else:
        x3d = p.x.reshape(g.N, g.C, g.H * g.W)  # [N, C, HW]
        c = None if p.bias is None else p.bias.view(g.K, 1)
        out = matmul(w2d, x3d, c=c, activation=act, out_dtype=p.out_dtype, precision=p.precision)  # [N, K, HW]
        out = out.view(g.N, g.K, g.H, g.W)
    if p.out_format == torch.contiguous_format and not out.is_contiguous():
        out = out.contiguous()
    if p.out is not None and out.data_ptr() != p.out.data_ptr():  # a GEMM that made its own output
        return p.out.copy_(out)
    return out
