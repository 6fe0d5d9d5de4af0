"""1x1 convolutions without padding: a plain GEMM, run by :func:`tilegemm.matmul`, or straight through
gluon_f16 with a tile by rule for layers over many pixels (:func:`gluon_1x1`). matmul is reached through its
entry points only (:func:`tilegemm.ops.matmul.make_problems`, :func:`tilegemm.ops.matmul.launch`).

Channels-last, the input ``[N, C, H, W]`` is a row-major ``[N*H*W, C]`` matrix in place, and the output
``[N*H*W, K] = x @ w^T`` is the channels-last output. NCHW, each image is a ``[C, H*W]`` matrix and
``out[n] = w @ x[n]`` is the NCHW output, one batched GEMM with the weight broadcast; the bias then runs along
rows, so it enters as matmul's ``c`` (``[K, 1]``, added before the activation like a bias).

With a stride (ResNet's downsampling projections, 1x1 stride 2), channels-last only: the pixels the stride
keeps are gathered first into a row-major ``[N*P*Q, C]`` matrix (:func:`subsample_kernel`, a quarter of the
input's bytes at stride 2, into a per-stream workspace), then the same GEMM: the implicit-GEMM kernel, reading
each pixel through a gathered address where the GEMM reads whole rows, ran these layers far slower
(docs/conv2d.md, "1x1 layers").

The data gradient of such a layer is the transposed product spread out again (:func:`strided_dgrad`): the GEMM
``dy[N*P*Q, K] @ w[K, C]`` into a per-stream workspace, then :func:`spread_kernel` writes every input pixel's
gradient, that row where the stride kept the pixel and zeros elsewhere, in one pass over ``dx``.
"""

from __future__ import annotations

import torch
import triton

from tilegemm.core.hardware import pipeline_fits, sm_count, why_not_gluon
from tilegemm.core.launch import current_stream, keeping, launch, sequence_lock
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv, interpreting, new_output
from tilegemm.core.workspace import buffer
from tilegemm.ops.conv2d.problem import ConvProblem, channels_last
from tilegemm.ops.matmul import launch as launch_gemm, make_problems, matmul

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


def dgrad_product(dy2d: torch.Tensor, w2d: torch.Tensor, tile: tuple | None, precision: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``dy2d @ w2d`` (``[N*P*Q, K] @ [K, C]``): a 1x1 layer's data gradient, run as the transposed layer's forward
    (K -> C channels) would be: :func:`gluon_1x1` with ``tile`` (that layer's, from
    :func:`tilegemm.ops.conv2d.dispatch.transposed_gluon_tile`), else ``auto``'s choice (:func:`tilegemm.matmul`,
    or launched straight into ``out`` when given)."""
    done = gluon_1x1(dy2d, w2d, tile, out=out)
    if done is not None:
        return done
    if out is None:
        return matmul(dy2d, w2d, precision=precision)
    upcast = dy2d.dtype == torch.bfloat16 and interpreting()
    for gp in make_problems(dy2d, w2d, out, None, None, 1.0, 0.0, "none", precision, upcast):
        launch_gemm(gp)
    return out


def strided_dgrad(dy: torch.Tensor, weight: torch.Tensor, g, precision: str, tile: tuple | None = None) -> torch.Tensor:
    """The data gradient of strided 1x1 layer ``g`` (:attr:`Geometry.is_strided_pointwise`) for a channels-last
    ``dy``: ``[N, C, H, W]``, channels-last. The product ``dy @ w`` over the kept pixels runs as the transposed
    layer's forward would (:func:`gluon_1x1` with ``tile``, else ``auto``'s choice), into a per-stream workspace
    that the launches keep (the call replays); :func:`spread_kernel` then writes ``dx``. (The phased implicit-GEMM
    kernel, each output pixel gathered through its own address, ran these far slower: docs/conv2d.md, "1x1
    layers".)"""
    rows = g.N * g.P * g.Q
    dy2d = dy.permute(0, 2, 3, 1).reshape(rows, g.K)  # a view of a channels-last dy
    w2d = weight.reshape(g.K, g.C)
    dx = new_output((g.N, g.H, g.W, g.C), dy.dtype, dy.device)
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        buf = buffer(dy.device, dy.dtype, rows * g.C, "conv2d-dgrad-spread")
        small = buf[: rows * g.C].view(rows, g.C)
        with keeping(buf):
            dgrad_product(dy2d, w2d, tile, precision, out=small)
        block_r, block_c = 64, 64
        pixels = g.N * g.H * g.W
        launch(spread_kernel, (cdiv(pixels, block_r),), (small, dx, pixels, g.C, g.H, g.W, g.P, g.Q),
               dict(SH=g.stride[0], SW=g.stride[1], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4), keep=(buf,),
               stream=current_stream() if dy.is_cuda else None)
    return dx.permute(0, 3, 1, 2)


# The weight gradient of a stride-1 1x1 layer, ``dw[K, C] = dy^T @ x`` over the N*H*W pixels: few output tiles over
# a long reduction, in one wave of K slices. Where the 64x64 tiles fit one an SM, the tile of WGRAD_TILES that pads
# the output least (then, where 64x64 makes at most WGRAD_FEW_TILES, the fewest tiles: more K slices; else the
# first, 64x64 on its deeper ring); from WGRAD_WIDE_WORK multiply-adds the 128x256 tile, whose K slices re-read
# the operands a quarter as often, unless it pads the output past WGRAD_WIDE_PADDING times the least (a narrow
# side: its MMAs would mostly multiply padding). Layers with more tiles keep split_k's choice
# (docs/conv2d.md, "1x1 layers").
WGRAD_TILES = ((64, 64, 128, 4, 6), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4))  # BLOCK_M, _N, _K (16-bit), warps, stages
WGRAD_WIDE_TILE = (128, 256, 64, 8, 3)
WGRAD_WIDE_WORK = 1 << 32  # pixels x K x C (ResNet-50's 256 -> 128 at 56x56, 3.3G, keeps 64x64: docs/conv2d.md)
WGRAD_FEW_TILES = 4
WGRAD_WIDE_PADDING = 1.25
WGRAD_TILE = WGRAD_TILES[0]  # the tile whose count gates the rule


def wgrad_tile(M: int, N: int, K: int, fits=lambda tile: True) -> tuple[int, int, int, int, int] | None:
    """The split_k tile of :data:`WGRAD_TILES` / :data:`WGRAD_WIDE_TILE` for the weight gradient ``[M, K] @ [K, N]``
    (M output channels, N input channels, K pixels), among those ``fits`` keeps (the GPU's shared memory a block:
    docs/conv2d.md, "1x1 layers"); None if it keeps none."""
    def area(t):  # the output as the tile pads it
        return cdiv(M, t[0]) * t[0] * cdiv(N, t[1]) * t[1]

    tiles = [t for t in WGRAD_TILES if fits(t)]
    if not tiles:
        return None
    if M * N * K >= WGRAD_WIDE_WORK and fits(WGRAD_WIDE_TILE) and \
            area(WGRAD_WIDE_TILE) <= WGRAD_WIDE_PADDING * min(map(area, WGRAD_TILES)):
        return WGRAD_WIDE_TILE
    few = cdiv(M, WGRAD_TILE[0]) * cdiv(N, WGRAD_TILE[1]) <= WGRAD_FEW_TILES
    return min(tiles, key=lambda t: (area(t), cdiv(M, t[0]) * cdiv(N, t[1]) if few else 0))


def wave_split(tiles: int, k_steps: int, sms: int) -> int:
    """K slices that make ``tiles`` output tiles about one wave of programs, each slice at least 4 K steps long
    (at most 256 slices)."""
    return max(1, min(sms // max(tiles, 1), k_steps // 4, 256))


def pointwise_wgrad_config(M: int, N: int, K: int, device, sms: int) -> dict | None:
    """split_k's config for the 16-bit weight gradient ``[M, K] @ [K, N]`` on ``device``: :func:`wgrad_tile`'s tile
    among those whose ring fits the GPU's shared memory a block, in one wave of K slices added in the last
    program's epilogue (SLICES); None where no tile fits."""
    tile = wgrad_tile(M, N, K, lambda t: pipeline_fits(t[0], t[1], t[2], 2, t[4], device))
    if tile is None:
        return None
    bm, bn, bk, warps, stages = tile
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                SPLIT_K=wave_split(cdiv(M, bm) * cdiv(N, bn), cdiv(K, bk), sms), SLICES=True, num_warps=warps,
                num_stages=stages)


def pointwise_wgrad(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` for a 1x1 layer's weight gradient (``a = dy^T`` ``[K, NHW]``, ``b = x`` ``[NHW, C]``), through
    matmul's ``split_k`` on a GPU (faster there than auto's general choice: docs/conv2d.md, "1x1 layers"): for
    16-bit operands with at most one 64x64 tile an SM, :func:`wgrad_tile`'s tile in one wave of K slices;
    otherwise split_k's own choice. Elsewhere ``auto``."""
    if not a.is_cuda or interpreting():
        return matmul(a, b, precision=precision)
    (M, K), N = a.shape, b.shape[1]
    sms = sm_count(a.device)
    few = a.element_size() == 2 and b.dtype == a.dtype and cdiv(M, WGRAD_TILE[0]) * cdiv(N, WGRAD_TILE[1]) <= sms
    cfg = pointwise_wgrad_config(M, N, K, a.device, sms) if few else None
    if cfg is None:  # (other operands, more tiles, or no tile of the rule fitting the GPU)
        return matmul(a, b, precision=precision, kernel="split_k")
    out = new_output((M, N), a.dtype, a.device)
    for p in make_problems(a, b, out, None, None, 1.0, 0.0, "none", precision, False):
        launch_gemm(p, kernel="split_k", config=cfg)
    return out


def why_not(p: ConvProblem) -> str | None:
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
    that dtype at unit stride, and an sm_90 GPU under Triton 3.6 (whose Gluon the kernel is written in)."""
    if interpreting() or not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        return False
    if bias is not None and (bias.dtype != a.dtype or bias.stride(0) != 1):
        return False
    return why_not_gluon() is None


def gluon_usable(x: torch.Tensor, weight: torch.Tensor, bias, out_dtype) -> bool:
    """Whether the tensors of a 1x1 call let :func:`gluon_1x1` run it (the geometry's side is
    :func:`tilegemm.ops.conv2d.dispatch.pointwise_gluon_tile`): :func:`_gluon_operands`, and a channels-last
    ``x``, ``x`` and the weight 16-byte aligned, an output of ``x``'s dtype."""
    if out_dtype != x.dtype or x.stride(1) != 1 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    return _gluon_operands(x, weight, bias)


def gluon_1x1(a: torch.Tensor, b: torch.Tensor, tile: tuple | None, bias=None, activation: str = "none",
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``a @ b`` (``[M, C] @ [C, K]``: a 1x1 layer as a GEMM, or its data gradient's) through gluon_f16 with
    ``tile`` (BLOCK_M, BLOCK_N, BLOCK_K, STAGES: :func:`tilegemm.ops.conv2d.dispatch.pointwise_gluon_tile`),
    into ``out`` (a row-major 16-bit ``[M, K]``; a new one by default); or None where there is no tile or the
    kernel does not take the call (then :func:`tilegemm.matmul` runs it)."""
    if not _gluon_operands(a, b, bias) or tile is None:
        return None
    if out is None:
        out = new_output((a.shape[0], b.shape[1]), a.dtype, a.device)
    (gp,) = make_problems(a, b, out, None, bias, 1.0, 0.0, activation, "ieee", False)
    try:
        launch_gemm(gp, kernel="gluon_f16", config=gluon_config(tile))
    except NotApplicable:  # raised before anything is launched
        return None
    return out


GLUON_F16_WARPS = 4  # gluon_f16's num_warps: its first consumer warp group (it adds the others itself)


def gluon_config(tile: tuple[int, int, int, int]) -> dict:
    """The gluon_f16 config of ``tile`` (BLOCK_M, BLOCK_N, BLOCK_K, STAGES), its output buffer unshared."""
    bm, bn, bk, stages = tile
    return dict(GLUON_F16=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, SHARED_OUT=False,
                num_warps=GLUON_F16_WARPS)


# 1x1 layers over few pixels with a channel count that is no multiple of 16 bytes (squeeze-and-excitation blocks on a
# one-pixel image: 348 -> 3712 or 888 -> 84 at batch 32). tilegemm.matmul runs such a product as its aligned twin
# (operands and bias copied into padded buffers, the product, its corner copied back): four launches, behind cuDNN
# on the host and on the GPU (docs/conv2d.md, "1x1 layers"). With so few rows the product is a stream over the weight, which the copies read three times; the pointer kernel reads rows
# as they lie, so the layer is one launch of split_k's kernel, its K slices added in the same launch.
FEW_ROWS = (16, 128)  # rows (N*P*Q) above the first, at most the second: at or below 16, matmul pads no
#   operand and reads such rows by its own measured rules (residue classes, narrow split tiles; no copies)
FEW_ROWS_TILE_N = 64  # the tile's output channels; its rows: the rows' power of two (32 to 128)
FEW_ROWS_STEP_BYTES = 128  # a K step's bytes of a row (64 channels in 16-bit, 32 in fp32)
FEW_ROWS_MIN_STEPS = 2  # K steps a slice keeps at least
FEW_ROWS_MAX_PLANE_BYTES = 64 * 1024  # a tile's fp32 planes, added by the last program to arrive (one launch)


def takes_few_rows(rows: int, C: int, K: int, elem: int) -> bool:
    """Whether a stride-1 1x1 layer's ``[rows, C] x [C, K]`` product runs as :func:`few_rows_product` (one launch)
    rather than through :func:`tilegemm.matmul`: rows within :data:`FEW_ROWS` and C or K no multiple of 16 bytes."""
    per = 16 // elem
    return FEW_ROWS[0] < rows <= FEW_ROWS[1] and bool(C % per or K % per)


def few_rows_config(M: int, N: int, K: int, elem: int, sms: int, block_m: int | None = None,
                    block_n: int = FEW_ROWS_TILE_N, step_bytes: int = FEW_ROWS_STEP_BYTES) -> dict:
    """split_k's config for :func:`few_rows_product`: a tile of the rows' power of two (32 to 128) by
    :data:`FEW_ROWS_TILE_N` channels, K steps of :data:`FEW_ROWS_STEP_BYTES`, and K in 2, 4, 8... slices while
    the programs stay within one wave, each slice keeps at least :data:`FEW_ROWS_MIN_STEPS` steps and a tile's
    planes stay within :data:`FEW_ROWS_MAX_PLANE_BYTES` (added in the same launch, ``APART`` off). ``block_m``, ``block_n`` and
    ``step_bytes`` set another tile, split by the same rule (tools/conv2d_small_1x1.py times some)."""
    bm = block_m or min(128, max(32, triton.next_power_of_2(M)))
    bn = block_n
    bk = step_bytes // elem
    tiles = cdiv(M, bm) * cdiv(N, bn)
    steps = cdiv(K, bk)
    split = 1
    while (tiles * split * 2 <= sms and steps >= FEW_ROWS_MIN_STEPS * split * 2
           and split * 2 * bm * bn * 4 <= FEW_ROWS_MAX_PLANE_BYTES):
        split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, SLICES=True, APART=False,
                num_warps=4, num_stages=3)


def few_rows_product(a: torch.Tensor, b: torch.Tensor, bias, activation: str, precision: str, upcast: bool,
                     out_dtype, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``activation(a @ b + bias)`` (``[M, C] @ [C, K]``, rows of any alignment) in one launch of matmul's
    ``split_k`` with :func:`few_rows_config` (or ``config``), into ``out`` (row-major ``[M, K]``; a new one of
    ``out_dtype`` by default)."""
    if out is None:
        out = new_output((a.shape[0], b.shape[1]), out_dtype, a.device)
    (gp,) = make_problems(a, b, out, None, bias, 1.0, 0.0, activation, precision, upcast)
    if config is None:
        config = few_rows_config(gp.M, gp.N, gp.K, a.element_size(), sm_count(a.device))
    launch_gemm(gp, kernel="split_k", config=config)
    return out


def run(p: ConvProblem, config: tuple | None = None) -> torch.Tensor:
    """The convolution as a GEMM; ``config``: the gluon_f16 tile of a channels-last stride-1 layer (None: the GEMM
    through :func:`tilegemm.matmul`)."""
    reason = why_not(p)
    if reason:
        raise NotApplicable(reason)
    g = p.geo
    w2d = p.weight.reshape(g.K, g.C)  # [K, C]
    act = None if p.activation == "none" else p.activation
    if g.is_strided_pointwise:
        with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
            xs, buf = subsampled(p.x, g)
            with keeping(buf):
                out = matmul(xs, w2d.t(), bias=p.bias, activation=act, out_dtype=p.out_dtype,
                             precision=p.precision)
        out = out.view(g.N, g.P, g.Q, g.K).permute(0, 3, 1, 2)  # [N, K, P, Q], channels-last
    elif p.out_format == torch.channels_last or channels_last(p.x) or g.H * g.W == 1:
        # (one pixel, as in squeeze-and-excitation blocks: NCHW and channels-last are the same bytes, and one
        # [N, C] x [C, K] product reads the weight once where the NCHW branch's batch of N GEMVs reads it N times)
        x2d = p.x.permute(0, 2, 3, 1).reshape(g.N * g.H * g.W, g.C)  # [NHW, C], a view when channels-last
        into = None if p.out is None else p.out.permute(0, 2, 3, 1).view(g.N * g.H * g.W, g.K)
        out = gluon_1x1(x2d, w2d.t(), config, p.bias, p.activation, into) if p.out_dtype == p.x.dtype else None
        if out is None and takes_few_rows(x2d.shape[0], g.C, g.K, p.x.element_size()):
            out = few_rows_product(x2d, w2d.t(), p.bias, p.activation, p.precision, p.upcast, p.out_dtype, into)
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
