"""NCHW tensors for the channels-last kernels: transposed by a Triton kernel into per-stream workspaces.

The implicit-GEMM kernels walk the channels of a pixel contiguously, so an NCHW (plain contiguous) input has to
become channels-last first. On Hopper a 16-bit NCHW forward (:func:`tilegemm.ops.conv2d.dispatch.forward`) makes one
channels-last copy of ``x`` here, runs the channels-last kernel ``auto`` picks for that copy, and writes the
NCHW output: the TMA kernel stores it directly (its epilogue switches to pixel-major stores), the others
write channels-last into a workspace that :func:`to_nchw` transposes into the output. The weight, when it is NCHW
too, is made ``[K, R, S, C/groups]`` the same way. Being Triton launches into kept workspaces (not torch
copies), these calls are recorded and replayed like channels-last ones
(:mod:`tilegemm.ops.conv2d.replay`). Before this route an NCHW input ran the pointer kernels over torch's
copies, with the output stored through NCHW strides, far slower (docs/conv2d.md, "NCHW inputs").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.runtime import cdiv

BLOCK = 64  # a program's tile: 64 x 64 elements (8 KB of 16-bit data), read and written in 128-byte rows


@triton.jit
def transpose_kernel(src_ptr, dst_ptr, R, C, tiles_c, tiles, stride_sb, stride_sr, stride_db, stride_dc,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[b, c, r] = src[b, r, c]`` for r < R, c < C: ``src``'s rows at ``stride_sr`` with its columns at
    unit stride, ``dst``'s rows (one per c) at ``stride_dc`` with r at unit stride. Loaded along c and stored
    along r, each coalesced (Triton moves the tile between the two layouts through shared memory)."""
    pid = tl.program_id(0)
    b = pid // tiles
    t = pid - b * tiles
    tr = t // tiles_c
    r = (tr * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = ((t - tr * tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (r < R)[:, None] & (c < C)[None, :]
    v = tl.load(src_ptr + b.to(tl.int64) * stride_sb + r[:, None] * stride_sr + c[None, :], mask=mask)
    tl.store(dst_ptr + b.to(tl.int64) * stride_db + c[None, :] * stride_dc + r[:, None], v, mask=mask)


def _transpose(src: torch.Tensor, dst: torch.Tensor, batches: int, rows: int, cols: int, strides: tuple,
               keep: tuple) -> None:
    from tilegemm.core.launch import current_stream, launch

    tiles_c = cdiv(cols, BLOCK)
    tiles = cdiv(rows, BLOCK) * tiles_c
    launch(transpose_kernel, (batches * tiles,), (src, dst, rows, cols, tiles_c, tiles, *strides),
           dict(BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=4), keep=keep,
           stream=current_stream() if src.is_cuda else None)


def planar(t: torch.Tensor) -> bool:
    """True for a 4-D NCHW tensor this module transposes: plain contiguous and not also channels-last."""
    return t.dim() == 4 and t.is_contiguous() and t.stride(1) != 1


def workspace_view(t: torch.Tensor, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a channels-last view ``[B, C, H, W]`` of the per-stream workspace ``tag``, the workspace): where
    :func:`fill` puts ``t``'s values. Nothing launched yet."""
    return channels_last_workspace(tuple(t.shape), t.dtype, t.device, tag)


def channels_last_workspace(shape: tuple, dtype: torch.dtype, device: torch.device,
                            tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a channels-last view of ``shape`` ``[B, C, H, W]`` of the per-stream workspace ``tag``, the workspace)."""
    from tilegemm.core.workspace import buffer

    B, C, H, W = shape
    n = B * C * H * W
    buf = buffer(device, dtype, n, tag)
    return buf[:n].as_strided((B, C, H, W), (H * W * C, 1, W * C, C)), buf


def fill(t: torch.Tensor, view: torch.Tensor, buf: torch.Tensor) -> None:
    """Write ``t`` (:func:`planar`) into ``view`` (from :func:`workspace_view`): one launch."""
    B, C, H, W = t.shape
    # src[b, c, hw] -> dst[b, hw, c]: rows are channels, columns pixels
    _transpose(t, view, B, C, H * W, (t.stride(0), t.stride(1), H * W * C, C), keep=(buf,))


def to_channels_last(t: torch.Tensor, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(``t`` ``[B, C, H, W]`` (:func:`planar`) as a channels-last view of a workspace holding its values, the
    workspace). One launch; call under :data:`tilegemm.core.launch.sequence_lock` and keep the workspace (the
    calls on a stream share it)."""
    view, buf = workspace_view(t, tag)
    fill(t, view, buf)
    return view, buf


def weight_channels_last(w: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(the weight ``[K, C/groups, R, S]`` channels-last, the workspaces to keep): a CUDA NCHW weight transposed
    by a launch (so the call replays, reading the weight as it is then), otherwise torch's copy where one is needed
    (such a call is not replayed). Call under :data:`tilegemm.core.launch.sequence_lock`."""
    if planar(w) and w.is_cuda:
        view, buf = to_channels_last(w, "conv2d-weight-nhwc")
        return view, (buf,)
    w = w.contiguous(memory_format=torch.channels_last)
    if w.data_ptr() % 16:  # already channels-last but not 16-byte aligned (a view into a flat buffer): TMA needs it
        w = torch.empty_like(w, memory_format=torch.channels_last).copy_(w)
    return w, ()


def to_nchw(src: torch.Tensor, out: torch.Tensor, keep: tuple = ()) -> torch.Tensor:
    """``out`` (a plain contiguous ``[N, K, P, Q]``) with the values of ``src`` (channels-last, pixels packed). One
    launch; ``keep``: the workspace ``src`` lies in."""
    N, K, P, Q = src.shape
    # src[n, pq, k] -> out[n, k, pq]: rows are pixels, columns channels
    _transpose(src, out, N, P * Q, K, (src.stride(0), K, out.stride(0), out.stride(1)), keep=keep)
    return out
