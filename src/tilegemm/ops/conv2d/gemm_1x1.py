"""1x1 convolutions with stride 1 and no padding: a plain GEMM, run by :func:`tilegemm.matmul`.

Channels-last, the input ``[N, C, H, W]`` is a row-major ``[N*H*W, C]`` matrix in place, and the output
``[N*H*W, K] = x @ w^T`` is the channels-last output. NCHW, each image is a ``[C, H*W]`` matrix and
``out[n] = w @ x[n]`` is the NCHW output, one batched GEMM with the weight broadcast; the bias then runs along
rows, so it enters as matmul's ``c`` (``[K, 1]``, added before the activation like a bias).
"""

from __future__ import annotations

import torch

from tilegemm.ops.conv2d.problem import ConvProblem, channels_last


def applies(p: ConvProblem) -> str | None:
    """None when this kernel takes the problem, else why not."""
    if not p.geo.is_pointwise:
        return "gemm_1x1 takes 1x1 filters with stride 1, no padding and groups=1 only"
    return None


def run(p: ConvProblem, config: dict | None = None) -> torch.Tensor:
    from tilegemm.ops.matmul.api import matmul

    reason = applies(p)
    if reason:
        from tilegemm.core.registry import NotApplicable

        raise NotApplicable(reason)
    g = p.geo
    w2d = p.weight.reshape(g.K, g.C)  # [K, C]
    act = None if p.activation == "none" else p.activation
    if p.out_format == torch.channels_last or channels_last(p.x):
        x2d = p.x.permute(0, 2, 3, 1).reshape(g.N * g.H * g.W, g.C)  # [NHW, C], a view when channels-last
        out = matmul(x2d, w2d.t(), bias=p.bias, activation=act, out_dtype=p.out_dtype, precision=p.precision)
        out = out.view(g.N, g.H, g.W, g.K).permute(0, 3, 1, 2)  # [N, K, H, W], channels-last
    else:
        x3d = p.x.reshape(g.N, g.C, g.H * g.W)  # [N, C, HW]
        c = None if p.bias is None else p.bias.view(g.K, 1)
        out = matmul(w2d, x3d, c=c, activation=act, out_dtype=p.out_dtype, precision=p.precision)  # [N, K, HW]
        out = out.view(g.N, g.K, g.H, g.W)
    if p.out_format == torch.contiguous_format and not out.is_contiguous():
        out = out.contiguous()
    return out
