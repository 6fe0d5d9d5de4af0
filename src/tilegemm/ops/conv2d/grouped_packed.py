"""Grouped convolutions with few channels a group on tensor cores: several groups in one MMA tile, the weight
tile block-diagonal.

Seen as GEMMs, a group of C/groups = Cg input and K/groups = Kg output channels is a product whose reduction
(a tap's Cg channels) and width (Kg) are far below a tensor-core tile: ``implicit_gemm`` and
``tma_implicit_gemm`` run one group a program, a 16-channel group in a 16-wide tile of 16-deep steps (a 3x3
is nine short steps a tile), and ``grouped_direct`` runs groups of up to 8 on CUDA cores, one load per channel
and tap. Here one program's tile holds ``GT`` whole groups: its output columns are the GT*Kg channels of groups
``grp0 .. grp0 + GT - 1`` and each K step reads, for one tap, the GT*Cg input channels of those groups, one
contiguous run of a channels-last pixel (wide loads, the same bytes ``F.conv2d`` needs). The weight tile
``[GT*Cg, GT*Kg]`` is block-diagonal: input channel i feeds output column j only where both are of the same
group (``i // Cg == j // Kg``), zeros elsewhere, so one ``tl.dot`` does all GT groups. It multiplies GT times
the useful products (8 channels a group in a 64x64 tile: 1 in 8 used); these layers are bound by the bytes
they move and the tensor cores have that to spare, where the narrow tiles before were bound by their steps
(docs/conv2d.md, "Grouped convolutions with few channels a group"). Those zeros also meet the other groups'
inputs: an inf or NaN input makes the tile's other groups' outputs at that pixel NaN (docs/conv2d.md, "Several
groups a tensor-core tile").

Two forms:

- ``grouped_packed`` (:func:`run`): the pointer kernel below, any GT, any groups, strides, dilation, padding,
  dtype (fp32 through tf32 or ieee dots), NCHW or channels-last; the block-diagonal weight tile is loaded
  masked from the weight as it lies (no copy, one launch).
- ``grouped_packed_tma`` (:func:`run_tma`, Hopper, 16-bit channels-last): the same convolution is one with
  ``groups / GT`` groups of GT*Cg channels whose weight is block-diagonal. :func:`expand_weight_kernel` writes
  that weight (channels-last, its channels padded to the TMA kernel's step where GT*Cg needs it) into a
  per-stream workspace on every call (a replay then reads an updated weight afresh), and ``tma_implicit_gemm``
  runs the coarser layer (in place over x's own channels, as :mod:`tilegemm.ops.conv2d.padded` does; GT must
  divide the groups).

``auto`` sends 16-bit layers of up to 56 channels a group here
(:func:`tilegemm.ops.conv2d.configs.takes_grouped_packed`).

The other way, :func:`block_diagonal` takes a layer's weight gradient out of its coarser grouping's: ``auto``'s
weight gradient of layers of few channels a group runs ``tma_wgrad`` on :func:`coarse_geometry` and keeps the
diagonal blocks (:func:`tilegemm.ops.conv2d.configs.coarse_wgrad_groups`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tilegemm.core.launch import current_stream, launch, sequence_lock
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv, ensure_backend
from tilegemm.ops.conv2d.configs import grouped_packed_config, grouped_packed_tiles
from tilegemm.ops.conv2d.implicit_gemm import _conv_args, _divisor, _tap_mma, allocate_out, pointer_weight
from tilegemm.ops.conv2d.problem import ConvProblem, Geometry, needs_index_64

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tilegemm.jit.helpers import apply_activation  # noqa: E402

# Sizes, strides and hyper-parameters that change with the image or the layer are not specialized on (a new
# layer compiles nothing new but for its group shape): what the loads' widths need is said by the DIV_*
# constexprs instead, each at most 8 (16 bytes of a 16-bit dtype, the widest load).
_SIZES = ["H", "W", "P", "Q", "M", "G", "C", "K", "pad_h", "pad_w", "sxn", "sxh", "sxw", "son", "sop", "soq",
          "stride_wk", "stride_wr", "stride_ws", "str_h", "str_w", "dil_h", "dil_w"]
_MOST_DIV = 8

MOST_CHANNELS_OUT = 128  # a tile's output columns: K/groups must fit one tile (GT >= 1)


@triton.jit(do_not_specialize=_SIZES)
def grouped_packed_fwd_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    H, W, P, Q, M, G, C, K,
    sxn, sxh, sxw, stride_xc,
    stride_wk, stride_wc, stride_wr, stride_ws,
    son, sop, soq, stride_ok,
    stride_bias,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, CG: tl.constexpr, KG: tl.constexpr, GT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    INDEX_64: tl.constexpr, DIV_X: tl.constexpr, DIV_PX: tl.constexpr, DIV_O: tl.constexpr,
    DIV_PO: tl.constexpr, DIV_W: tl.constexpr, TAPS_FLAT: tl.constexpr, TCP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Which tile: output pixels [BM] x the GT*KG output channels of groups grp0 .. grp0 + GT - 1 [BN]. The
    # channel tiles of one pixel tile are neighbours in launch order (they read the same pixels).
    TC: tl.constexpr = GT * CG  # input channels a tile reads (one run of each pixel)
    TK: tl.constexpr = GT * KG  # output channels a tile writes
    C_STEPS: tl.constexpr = (TC + BLOCK_K - 1) // BLOCK_K
    tiles_n = tl.cdiv(G, GT)
    pid = tl.program_id(0)
    pid_n = pid % tiles_n
    pid_m = pid // tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    q = offs_m % Q
    p = (offs_m // Q) % P
    n = offs_m // (P * Q)
    h0 = p * str_h - pad_h  # [BM] the window's corner in the unpadded input
    w0 = q * str_w - pad_w
    m_ok = offs_m < M

    # The tile's first input and output channels: multiples of what the host knows divides them, so that a
    # channels-last pixel's run loads and stores 16 bytes at a time (C and K are not specialized on).
    c_base = tl.multiple_of(pid_n * TC, DIV_X)
    k_base = tl.multiple_of(pid_n * TK, DIV_O)
    k = k_base + offs_n  # [BN] output channel
    n_ok = (offs_n < TK) & ((k // DIV_O) < (K // DIV_O))  # K is a multiple of DIV_O: exact
    lg_n = offs_n // KG  # [BN] each column's group within the tile
    # Pixel strides in units the host knows divide them (DIV_PX): x's rows then provably 16-byte aligned.
    x_rows = x_ptr + n * (sxn * DIV_PX)  # [BM]
    # Column j's filter seen from the tile's first input channel: its group's row starts lg_n * CG channels
    # later, so input row i of the tile reads element i - lg_n * CG of it, contiguous along i (16-byte loads of
    # a channels-last weight; the filter strides in units of DIV_W for the same reason).
    w_cols = w_ptr + k * (stride_wk * DIV_W) - (lg_n * CG) * stride_wc  # [BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TAPS_FLAT:
        # Few channels a tile (TC under BLOCK_K): a K step holds T = BLOCK_K / TCP taps of the tile's channels
        # (TCP: TC to a power of two), loaded as [BM, T, TCP] and [T, TCP, BN] tiles whose last axes are plain
        # aranges (each tap's channels one aligned contiguous run: 16-byte loads; a flat (tap, channel) index
        # split by // and % hid that from the compiler, and its loads were 2 bytes wide) and flattened for the
        # dot: 2 groups of 8 over a 3x3 take three 64-deep steps, not nine 16-deep ones.
        T: tl.constexpr = BLOCK_K // TCP
        offs_t = tl.arange(0, T)
        offs_c = tl.arange(0, TCP)
        cf = c_base + offs_c  # [TCP]
        cf_ok = (offs_c < TC) & ((cf // DIV_X) < (C // DIV_X))
        lg_f = offs_c // CG
        diag_f = (lg_f[:, None] == lg_n[None, :]) & cf_ok[:, None] & n_ok[None, :]  # [TCP, BN]
        for step in range(0, (R * S + T - 1) // T):
            tap = step * T + offs_t  # [T]
            r = tap // S
            s = tap - r * S
            h = h0[:, None] + (r * dil_h)[None, :]  # [BM, T]
            w = w0[:, None] + (s * dil_w)[None, :]
            pix_ok = m_ok[:, None] & (tap < R * S)[None, :] & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            rows = x_rows[:, None] + h * (sxh * DIV_PX) + w * (sxw * DIV_PX)  # [BM, T]
            a = tl.load(rows[:, :, None] + (cf * stride_xc)[None, None, :],
                        mask=pix_ok[:, :, None] & cf_ok[None, None, :], other=0.0)  # [BM, T, TCP]
            taps = (r * stride_wr + s * stride_ws) * DIV_W  # [T]
            b = tl.load(w_cols[None, None, :] + taps[:, None, None] + (offs_c * stride_wc)[None, :, None],
                        mask=(tap < R * S)[:, None, None] & diag_f[None, :, :], other=0.0)  # [T, TCP, BN]
            acc = _tap_mma(tl.reshape(a, (BLOCK_M, BLOCK_K)), tl.reshape(b, (BLOCK_K, BLOCK_N)), acc, UPCAST, "ab",
                           INPUT_PRECISION)
    for it in range(0, 0 if TAPS_FLAT else R * S * C_STEPS):
        rs = it // C_STEPS
        i = (it - rs * C_STEPS) * BLOCK_K + offs_k  # [BK] input channel within the tile
        r = rs // S
        s = rs - r * S
        h = h0 + r * dil_h
        w = w0 + s * dil_w
        pix_ok = m_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W)  # zero padding
        c = c_base + i
        c_ok = (i < TC) & ((c // DIV_X) < (C // DIV_X))  # [BK] (C a multiple of DIV_X: exact)
        a = tl.load(x_rows[:, None] + (h * (sxh * DIV_PX) + w * (sxw * DIV_PX))[:, None]
                    + (c * stride_xc)[None, :], mask=pix_ok[:, None] & c_ok[None, :], other=0.0)  # [BM, BK]
        lg_c = i // CG  # [BK] each row's group within the tile
        # The block-diagonal weight tile: w[k, i - lg*CG, r, s] where input row i and column k share a group.
        diag = (lg_c[:, None] == lg_n[None, :]) & c_ok[:, None] & n_ok[None, :]
        b = tl.load(w_cols[None, :] + (i * stride_wc)[:, None] + (r * stride_wr + s * stride_ws) * DIV_W,
                    mask=diag, other=0.0)  # [BK, BN]
        acc = _tap_mma(a, b, acc, UPCAST, "ab", INPUT_PRECISION)

    # Epilogue: bias, activation, store through the output's strides (NCHW or channels-last).
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    out_rows = n * (son * DIV_PO) + p * (sop * DIV_PO) + q * (soq * DIV_PO)  # [BM]
    tl.store(out_ptr + out_rows[:, None] + (k * stride_ok)[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# --- launchers ------------------------------------------------------------------------------------------


def check(g: Geometry) -> None:
    """NotApplicable unless the kernel takes ``g``: K/groups at most :data:`MOST_CHANNELS_OUT` (a tile holds
    whole groups)."""
    if g.Kg > MOST_CHANNELS_OUT:
        raise NotApplicable(f"grouped_packed takes at most {MOST_CHANNELS_OUT} output channels a group; "
                            f"got K/groups={g.Kg}")


def _pixel_divisor(t: torch.Tensor, dims) -> int:
    """The largest power of two (at most :data:`_MOST_DIV`) dividing ``t``'s strides along ``dims``."""
    d = _MOST_DIV
    for i in dims:
        d = min(d, _divisor(t.stride(i)) if t.stride(i) else d)
    return d


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _index_64(p: ConvProblem, out: torch.Tensor) -> bool:
    return p.index_64 or needs_index_64(out)


def run(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    """Forward through the pointer kernel; the output in ``p.out_format``. x, the weight and the output are read
    and written through their strides as they lie. ``config``: :func:`grouped_packed_config`'s keys (``GT``
    groups a tile, ``BLOCK_M``, ``num_warps``, ``num_stages``; ``BLOCK_N``/``BLOCK_K`` follow from GT;
    ``TAPS_FLAT``: K steps over (tap, channel) as one index, for tiles of fewer channels than a K step)."""
    g = p.geo
    check(g)
    cfg = dict(config or grouped_packed_config(g, p.dtype))
    gt = cfg.pop("GT")
    if not 1 <= gt <= g.groups:
        raise ValueError(f"grouped_packed: GT (groups a tile) must be in [1, groups={g.groups}], got {gt}")
    bn, bk = grouped_packed_tiles(g, gt, p.dtype, cfg.get("TAPS_FLAT", False))
    cfg.setdefault("TAPS_FLAT", False)
    cfg["TCP"] = _pow2(gt * g.Cg)
    if cfg["TAPS_FLAT"] and cfg.get("BLOCK_K", bk) % cfg["TCP"]:
        raise ValueError(f"grouped_packed: TAPS_FLAT needs BLOCK_K a multiple of {cfg['TCP']} (GT*C/groups to a "
                         f"power of two), got {cfg['BLOCK_K']}")
    cfg.setdefault("BLOCK_N", bn)
    cfg.setdefault("BLOCK_K", bk)
    if cfg["BLOCK_N"] < gt * g.Kg:
        raise ValueError(f"grouped_packed: BLOCK_N={cfg['BLOCK_N']} under GT*K/groups={gt * g.Kg}")
    with sequence_lock:  # a weight's workspace is shared by the calls on this stream
        # an NCHW-strided weight (nn.Conv2d's default) copied channels-last: its tiles' loads 16 bytes wide
        w, keep = pointer_weight(p.weight)
        return _run(p, w, keep, cfg, gt, current_stream() if keep else None)


def _run(p: ConvProblem, w: torch.Tensor, keep: tuple, cfg: dict, gt: int, stream) -> torch.Tensor:
    g = p.geo
    out = allocate_out(p)
    M = g.N * g.P * g.Q
    bias = p.bias if p.bias is not None else out
    x = p.x
    dpx, dpo, dw = _pixel_divisor(x, (0, 2, 3)), _pixel_divisor(out, (0, 2, 3)), _pixel_divisor(w, (0, 2, 3))
    # what divides a tile's first channel and the channel count (the load masks constant over such runs)
    div_x = min(_divisor(gt * g.Cg), _divisor(g.C), _MOST_DIV) if x.stride(1) == 1 else 1
    div_o = min(_divisor(gt * g.Kg), _divisor(g.K), _MOST_DIV) if out.stride(1) == 1 else 1
    args = (x, w, out, bias, g.H, g.W, g.P, g.Q, M, g.groups, g.C, g.K,
            x.stride(0) // dpx, x.stride(2) // dpx, x.stride(3) // dpx, x.stride(1),
            w.stride(0) // dw, w.stride(1), w.stride(2) // dw, w.stride(3) // dw,
            out.stride(0) // dpo, out.stride(2) // dpo, out.stride(3) // dpo, out.stride(1),
            p.bias.stride(0) if p.bias is not None else 0, *_conv_args(g))
    flags = dict(R=g.R, S=g.S, CG=g.Cg, KG=g.Kg, GT=gt, HAS_BIAS=p.bias is not None, ACTIVATION=p.activation,
                 INPUT_PRECISION=p.precision, UPCAST=p.upcast, INDEX_64=_index_64(p, out), DIV_X=div_x,
                 DIV_PX=dpx, DIV_O=div_o, DIV_PO=dpo, DIV_W=dw)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(g.groups, gt),)
    launch(grouped_packed_fwd_kernel, grid, args, {**flags, **cfg}, keep=keep, stream=stream)
    return out


# --- the TMA form: a coarser grouping with a block-diagonal weight -------------------------------------------


@triton.jit
def expand_weight_kernel(w_ptr, out_ptr, total, RS, S, CG, KG, GT, CP,
                         stride_wk, stride_wc, stride_wr, stride_ws, BLOCK: tl.constexpr):
    """``out[k, r, s, j] = w[k, j - lg * CG, r, s]`` where ``lg = j // CG`` is the group of output channel k
    within its GT-group block (``(k % (GT*KG)) // KG``) and ``j < GT*CG``; 0 elsewhere: row-major
    ``[K, R, S, CP]``, the block-diagonal weight of the layer with GT times fewer groups (channels-last)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < total
    j = e % CP
    rs = (e // CP) % RS
    k = e // (CP * RS)
    r = rs // S
    s = rs - r * S
    lg = j // CG
    real = ok & (j < GT * CG) & (lg == (k % (GT * KG)) // KG)
    v = tl.load(w_ptr + k.to(tl.int64) * stride_wk + (j - lg * CG) * stride_wc + r * stride_wr + s * stride_ws,
                mask=real, other=0.0)
    tl.store(out_ptr + e, v, mask=ok)


@triton.jit
def block_diagonal_kernel(src_ptr, dst_ptr, total, CG, KG, GT, RS, S,
                          stride_sk, stride_sc, stride_sr, stride_ss, stride_dk, stride_dc, stride_dr, stride_ds,
                          BLOCK: tl.constexpr):
    """``dst[k, c, r, s] = src[k, lg * CG + c, r, s]`` with ``lg = (k // KG) % GT``: the inverse of
    :func:`expand_weight_kernel`, a layer's ``[K, CG, R, S]`` weight (gradient) out of the block-diagonal one of the
    layer with GT times fewer groups (both through their strides, any layout). Two kernels, not one: the expansion
    writes every element of the wide weight, zeros too, where this one reads only the diagonal blocks (over the
    wide elements it would run GT times the programs, all but one in GT storing nothing)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    rs = i % RS
    c = (i // RS) % CG
    k = i // (RS * CG)
    r = rs // S
    s = rs - r * S
    lg = (k // KG) % GT
    v = tl.load(src_ptr + k.to(tl.int64) * stride_sk + (lg * CG + c) * stride_sc + r * stride_sr + s * stride_ss,
                mask=ok)
    tl.store(dst_ptr + k.to(tl.int64) * stride_dk + c * stride_dc + r * stride_dr + s * stride_ds, v, mask=ok)


def coarse_geometry(g: Geometry, gt: int) -> Geometry:
    """The layer ``g`` seen with GT times fewer groups (GT divides the groups)."""
    if gt < 1 or g.groups % gt:
        raise ValueError(f"GT={gt} must divide the groups ({g.groups})")
    return replace(g, groups=g.groups // gt)


def expand_weight(weight: torch.Tensor, g: Geometry, gt: int, channels: int, out: torch.Tensor | None = None,
                  stream=None, keep: tuple = ()) -> torch.Tensor:
    """The block-diagonal weight of :func:`coarse_geometry` ``(g, gt)``, ``[K, channels, R, S]`` channels-last
    (``channels`` >= GT*Cg: zeros past them), written by one launch of :func:`expand_weight_kernel` into ``out``
    (a flat buffer of at least that many elements) or a new tensor."""
    total = g.K * g.R * g.S * channels
    if out is None:
        out = torch.empty(total, dtype=weight.dtype, device=weight.device)
    launch(expand_weight_kernel, (cdiv(total, 1024),),
           (weight, out, total, g.R * g.S, g.S, g.Cg, g.Kg, gt, channels, *weight.stride()),
           dict(BLOCK=1024, num_warps=4), keep=keep, stream=stream)
    return out[:total].view(g.K, g.R, g.S, channels).permute(0, 3, 1, 2)


def block_diagonal(coarse: torch.Tensor, g: Geometry, gt: int, out: torch.Tensor, stream=None,
                   keep: tuple = ()) -> torch.Tensor:
    """``g``'s weight (gradient) ``[K, C/groups, R, S]`` out of that of :func:`coarse_geometry` ``(g, gt)``
    (``[K, GT*C/groups, R, S]``, or more channels: those past GT*C/groups unread), its diagonal blocks, written
    into ``out`` (any layout) by one launch of :func:`block_diagonal_kernel` (:func:`expand_weight`'s inverse);
    ``out``."""
    if gt < 1 or g.groups % gt:
        raise ValueError(f"GT={gt} must divide the groups ({g.groups})")
    want = (g.K, g.Cg, g.R, g.S)
    if coarse.dim() != 4 or (coarse.shape[0], coarse.shape[2], coarse.shape[3]) != (g.K, g.R, g.S) \
            or coarse.shape[1] < gt * g.Cg:
        raise ValueError(f"block_diagonal: the coarse weight must be [{g.K}, >= {gt * g.Cg}, {g.R}, {g.S}] "
                         f"(GT={gt} groups of {g.Cg} channels); got {list(coarse.shape)}")
    if tuple(out.shape) != want or out.dtype != coarse.dtype or out.device != coarse.device:
        raise ValueError(f"block_diagonal: out must be {list(want)} of {coarse.dtype} on {coarse.device}; got "
                         f"{list(out.shape)} of {out.dtype} on {out.device}")
    total = out.numel()
    launch(block_diagonal_kernel, (cdiv(total, 1024),),
           (coarse, out, total, g.Cg, g.Kg, gt, g.R * g.S, g.S, *coarse.stride(), *out.stride()),
           dict(BLOCK=1024, num_warps=4), keep=keep, stream=stream)
    return out


def tma_plan(x: torch.Tensor, g: Geometry, gt: int) -> tuple[Geometry, int, int | None] | str:
    """(the geometry the TMA kernel runs, the expanded weight's channels a group, x's own channels where the
    kernel reads them in place with padded ones) for ``x`` and GT groups a tile, or why the TMA form does not
    take the layer (in words)."""
    from tilegemm.ops.conv2d import padded, tma_fwd

    if gt < 1 or g.groups % gt:
        return f"GT={gt} does not divide the groups ({g.groups})"
    gc = coarse_geometry(g, gt)
    if gc.Cg % 16 == 0:
        reason = tma_fwd.why_not_input(x, None, gc)
        return reason if reason else (gc, gc.Cg, None)
    reason = padded.why_not(x, None, gc)
    if reason:
        return reason
    if not padded.reads_in_place(x, gc):
        return "the input would be copied (C/groups*GT not a multiple of 8, or x not read in place by TMA)"
    pl = padded.plan(x, gc)
    return pl.geo, pl.geo.Cg, g.C


def why_not_tma(p: ConvProblem, gt: int) -> str | None:
    """None when :func:`run_tma` takes ``p`` with GT groups a tile; otherwise why not."""
    from tilegemm.core.hardware import why_not_gluon
    from tilegemm.core.runtime import interpreting

    if p.x.dtype not in (torch.float16, torch.bfloat16) or p.weight.dtype != p.x.dtype:
        return "not 16-bit"
    if not p.x.is_cuda or interpreting() or torch.cuda.get_device_capability(p.x.device)[0] != 9:
        return "not on a Hopper GPU"
    if (reason := why_not_gluon()) is not None:
        return reason
    plan = tma_plan(p.x, p.geo, gt)
    return plan if isinstance(plan, str) else None


def run_tma(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    """Forward through ``tma_implicit_gemm`` over the coarser grouping (see the module's docstring); ``config``:
    ``GT`` (groups a tile; default :func:`tilegemm.ops.conv2d.configs.grouped_packed_tma_groups`) and, optionally,
    the TMA kernel's own keys (default its cost model's for the coarse layer)."""
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.workspace import buffer
    from tilegemm.ops.conv2d import tma_fwd
    from tilegemm.ops.conv2d.configs import grouped_packed_tma_groups

    cfg = dict(config or {})
    gt = cfg.pop("GT", None) or grouped_packed_tma_groups(p.geo)
    reason = why_not_tma(p, gt)
    if reason:
        raise NotApplicable(f"grouped_packed_tma does not take this convolution (GT={gt}): {reason}")
    gk, channels, x_channels = tma_plan(p.x, p.geo, gt)
    out = allocate_out(p)
    with sequence_lock:  # the workspace is shared by the calls on this stream: no other thread in between
        stream = current_stream()
        buf = buffer(p.x.device, p.x.dtype, p.geo.K * p.geo.R * p.geo.S * channels, "conv2d-packed-weight")
        wx = expand_weight(p.weight, p.geo, gt, channels, out=buf, stream=stream, keep=(buf,))
        tcfg = cfg or tma_fwd.config(gk, p.dtype, sm_count(p.x.device))
        kernel, grid, args, kwargs = tma_fwd.launch_args(p.x, wx, out, p.bias, gk, p.activation, tcfg,
                                                         x_channels=x_channels)
        launch(kernel, grid, args, kwargs, keep=(buf,), stream=stream)
    return out
