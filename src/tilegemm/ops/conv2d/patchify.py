"""Gradients of convolutions whose filter tiles the image: stride equal to the filter, no padding, no dilation,
one group (the patch embeddings of ViT and Swin, ConvNeXt's stem). Each output pixel reads its own patch, so both
gradients are one GEMM over the patches:

- the data gradient ``[N*P*Q, K] @ [K, R*S*C]``, each row a patch's gradient, written back into its place (rows
  and columns past the last whole patch get zeros: no patch reads them);
- the weight gradient ``[K, N*P*Q] @ [N*P*Q, R*S*C]``, the patches gathered into rows first (one copy of x), on
  the 1x1 weight gradient's split GEMM (few output tiles over a long reduction).

``auto`` takes them for few input channels (:func:`takes`): the stems, whose pointer kernels read a pixel's 3
channels a tap at a time; measured in docs/conv2d.md, "Patch embeddings".
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import spoil
from tilegemm.ops.conv2d.problem import Geometry
from tilegemm.ops.matmul import matmul

PATCHIFY_MAX_CHANNELS = 7  # up to here (channel counts no TMA route takes: C % 8 != 0 below 8) the GEMM route


def tiles_image(g: Geometry) -> bool:
    """Whether the filter tiles the image: stride = filter size (more than one tap), no padding or dilation,
    one group."""
    return (g.groups == 1 and g.R * g.S > 1 and tuple(g.stride) == (g.R, g.S) and not any(g.padding)
            and tuple(g.dilation) == (1, 1))


def takes(g: Geometry) -> bool:
    """Whether ``auto`` runs the gradients of ``g`` here: a filter that tiles the image over at most
    :data:`PATCHIFY_MAX_CHANNELS` input channels."""
    return tiles_image(g) and g.C <= PATCHIFY_MAX_CHANNELS


def _pixels(t: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` (any layout) as ``[N, H, W, C]``: a view of a channels-last tensor."""
    return t.permute(0, 2, 3, 1)


def patches(x: torch.Tensor, g: Geometry) -> torch.Tensor:
    """x's patches as rows ``[N*P*Q, R*S*C]``, each row (r, s, c)-ordered (a copy)."""
    P, Q, R, S = g.P, g.Q, g.R, g.S
    xs = _pixels(x)[:, : P * R, : Q * S]  # [N, P*R, Q*S, C]: the pixels some patch reads
    return xs.unflatten(1, (P, R)).unflatten(3, (Q, S)).permute(0, 1, 3, 2, 4, 5).reshape(g.N * P * Q, R * S * g.C)


def dgrad(dy: torch.Tensor, weight: torch.Tensor, x_shape, x_format, g: Geometry, precision: str) -> torch.Tensor:
    """grad of x ``[N, C, H, W]`` in ``x_format``."""
    from tilegemm.ops.conv2d.implicit_gemm import empty_4d

    spoil()  # torch's copies run between the launches: a replay of the launches alone would leave them out
    P, Q, R, S = g.P, g.Q, g.R, g.S
    dy2 = _pixels(dy).reshape(g.N * P * Q, g.K)  # a view of a channels-last dy
    w2 = weight.permute(0, 2, 3, 1).reshape(g.K, R * S * g.C)  # [K, (r, s, c)]
    cols = matmul(dy2, w2, precision=precision)  # [N*P*Q, R*S*C]
    dx = empty_4d(x_shape, dy.dtype, dy.device, x_format)
    dxp = _pixels(dx)
    if P * R < g.H or Q * S < g.W:
        dxp.zero_()  # pixels past the last whole patch: no output read them
    dxp[:, : P * R, : Q * S].unflatten(1, (P, R)).unflatten(3, (Q, S)).copy_(
        cols.view(g.N, P, Q, R, S, g.C).permute(0, 1, 3, 2, 4, 5))
    return dx


def wgrad(dy: torch.Tensor, x: torch.Tensor, g: Geometry, precision: str,
          memory_format: torch.memory_format) -> torch.Tensor:
    """grad of the weight ``[K, C, R, S]`` in ``memory_format``."""
    from tilegemm.ops.conv2d.gemm_1x1 import pointwise_wgrad

    spoil()  # the patches' copy is torch's: a replay of the GEMM alone would read the first call's
    dy2 = _pixels(dy).reshape(g.N * g.P * g.Q, g.K)
    dw = pointwise_wgrad(dy2.t(), patches(x, g), precision)  # [K, (r, s, c)]
    dw = dw.view(g.K, g.R, g.S, g.C).permute(0, 3, 1, 2)  # [K, C, R, S], channels-last strides
    return dw if memory_format == torch.channels_last else dw.contiguous()
