"""The copy and RGB-to-grey kernels.

Both are pure bandwidth: each element is read once and written once, so the work per program is sized so
that every thread moves 16 bytes per access and enough programs are in flight to cover memory latency.
"""

from __future__ import annotations

import torch
import triton

from tilegemm.jit.helpers import mask_1d, offsets_1d
from tilegemm.core.launch import launch

import triton.language as tl  # noqa: E402


def _block_for(element_size: int) -> int:
    # 16 KiB per program: 8 warps x 32 threads x 16 bytes x 4 accesses each.
    return 16384 // element_size


@triton.jit
def copy_contiguous_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = offsets_1d(tl.program_id(0).to(tl.int64), BLOCK)  # [BLOCK], int64: n may pass 2^31
    mask = mask_1d(offs, n)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def copy_strided_kernel(
    x_ptr, out_ptr, n,
    size_1, size_2, size_3, size_4, size_5,
    stride_0, stride_1, stride_2, stride_3, stride_4, stride_5,
    BLOCK: tl.constexpr,
):
    # Gather: split each flat output index into 6 coordinates (dims padded with size 1 in front).
    offs = offsets_1d(tl.program_id(0).to(tl.int64), BLOCK)
    mask = mask_1d(offs, n)
    rest = offs
    i5 = rest % size_5
    rest = rest // size_5
    i4 = rest % size_4
    rest = rest // size_4
    i3 = rest % size_3
    rest = rest // size_3
    i2 = rest % size_2
    rest = rest // size_2
    i1 = rest % size_1
    i0 = rest // size_1
    src = i0 * stride_0 + i1 * stride_1 + i2 * stride_2 + i3 * stride_3 + i4 * stride_4 + i5 * stride_5
    tl.store(out_ptr + offs, tl.load(x_ptr + src, mask=mask), mask=mask)


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    # Triton has no bool pointers here; move booleans as bytes.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def copy_flat(x: torch.Tensor, out: torch.Tensor) -> None:
    x, out = _storage_view(x), _storage_view(out)
    n = out.numel()
    block = _block_for(x.element_size())
    grid = (triton.cdiv(n, block),)
    if x.is_contiguous():
        launch(copy_contiguous_kernel, grid, (x, out, n), dict(BLOCK=block, num_warps=8))
        return
    pad = 6 - x.dim()
    sizes = [1] * pad + list(x.shape)
    strides = [0] * pad + list(x.stride())
    launch(copy_strided_kernel, grid, (x, out, n, *sizes[1:], *strides), dict(BLOCK=block, num_warps=8))


@triton.jit
def grey_kernel(
    img_ptr, out_ptr, H, W,
    stride_ib, stride_ic, stride_ih, stride_iw, stride_ob,
    w_r, w_g, w_b,
    PLANES_CONTIGUOUS: tl.constexpr, IS_UINT8: tl.constexpr, INDEX_64: tl.constexpr, STREAM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: BLOCK pixels of one image (axis 1 is the batch); the output is contiguous.
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    offs = offsets_1d(pid, BLOCK)
    mask = mask_1d(offs, H * W)
    img_ptr += tl.program_id(1).to(tl.int64) * stride_ib
    out_ptr += tl.program_id(1).to(tl.int64) * stride_ob
    if PLANES_CONTIGUOUS:
        src = offs  # rows follow each other: one flat run per plane, 16-byte accesses
    else:
        src = (offs // W) * stride_ih + (offs % W) * stride_iw
    policy: tl.constexpr = "evict_first" if STREAM else ""
    r = tl.load(img_ptr + src, mask=mask, eviction_policy=policy).to(tl.float32)
    g = tl.load(img_ptr + stride_ic + src, mask=mask, eviction_policy=policy).to(tl.float32)
    b = tl.load(img_ptr + 2 * stride_ic + src, mask=mask, eviction_policy=policy).to(tl.float32)
    grey = w_r * r + w_g * g + w_b * b
    if IS_UINT8:
        grey = tl.minimum(tl.maximum(grey + 0.5, 0.0), 255.0)  # round to nearest, then truncate
    tl.store(out_ptr + offs, grey.to(out_ptr.dtype.element_ty), mask=mask)


# Launch shape: small programs with streaming loads spread an image over the SMs evenly (docs/ladder.md).
GREY_TUNING = dict(STREAM=True, num_warps=4, block_bytes=1024)


def grey_planar(img: torch.Tensor, out: torch.Tensor) -> None:
    from tilegemm.ops.guide.api import GREY_WEIGHTS

    H, W = img.shape[-2:]
    lead = img.shape[:-3]
    batch = 1
    for size in lead:
        batch *= size
    try:
        img3 = img.view(batch, 3, H, W)
    except RuntimeError:  # batch dims that do not merge into one stride: one launch per leading index
        for i in range(img.shape[0]):
            grey_planar(img[i], out[i])
        return
    out2 = out.view(batch, H * W)
    planes_contiguous = img3.stride(3) == 1 and img3.stride(2) == W
    block = GREY_TUNING["block_bytes"] // img.element_size()
    grid = (triton.cdiv(H * W, block), batch)
    span = max(abs(img3.stride(1)) * 2 + (H - 1) * abs(img3.stride(2)) + (W - 1) * abs(img3.stride(3)), H * W)
    args = (img3, out2, H, W, img3.stride(0), img3.stride(1), img3.stride(2), img3.stride(3), out2.stride(0),
            *GREY_WEIGHTS)
    launch(grey_kernel, grid, args,
           dict(PLANES_CONTIGUOUS=planes_contiguous, IS_UINT8=img.dtype == torch.uint8,
                INDEX_64=span + block >= 2**31, STREAM=GREY_TUNING["STREAM"], BLOCK=block,
                num_warps=GREY_TUNING["num_warps"]))
