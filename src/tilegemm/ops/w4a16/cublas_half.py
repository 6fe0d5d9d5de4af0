"""The cuBLAS half of kernel ``dequant_cublas`` (:mod:`.dequant_cublas`): x times the weight already dequantized
to 16-bit, the bias and the activation, in plain torch. Apart from the Triton half so that the host fast path
(:mod:`.api`), which replays the dequantization launch and then runs this, imports no triton."""

from __future__ import annotations

import torch

from tilegemm.core.activations import torch_activation
from tilegemm.core.runtime import new_output


# Activations whose value on a 16-bit output that overflowed differs from their value on the sum (relu's does not)
ROUNDING_UNSAFE = ("gelu", "gelu_tanh", "silu", "leaky_relu")


def product(x: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None, activation: str, out: torch.Tensor,
            upcast: bool = False) -> None:
    """``out [M, N] = activation(x [M, K] @ wd.T + bias)`` with ``wd`` the dequantized weight ``[N, K]``."""
    # W [N, K] as F.linear takes it: cuBLAS then runs the product with the baseline's layout (from W.T [K, N]
    # it ran slower: docs/w4a16.md, "dequant_cublas")
    wt = wd.t()
    if upcast:  # CPU bf16 matmul is slow and not what the GPU does; fp32 holds every product exactly
        y = torch.matmul(x.float(), wt.float())
        if bias is not None:
            y = y + bias.float()
        if activation != "none":
            y = torch_activation(y, activation)
        out.copy_(y)
        return
    if activation in ROUNDING_UNSAFE:
        # the activation on the fp32 sum, as the other kernels apply it: on the 16-bit output, a sum past its range
        # is already inf, and silu / gelu of -inf are NaN (leaky_relu's -inf is finite a hundredth of it)
        y = _fp32_product(x, wt)
        if bias is not None:
            y += bias.float()
        out.copy_(torch_activation(y, activation))
        return
    # cuBLAS writes the output in place, the bias added by its epilogue: at M = 4096 on 8192 x 8192 a
    # separate bias pass and a copy into ``out`` each moved 2 x 64 MB more
    if bias is not None:
        torch.addmm(bias.to(x.dtype), x, wt, out=out)
    else:
        torch.matmul(x, wt, out=out)
    if activation != "none":
        out.copy_(torch_activation(out.float(), activation))


def _fp32_product(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``x @ wt`` written in fp32: cuBLAS's 16-bit product with an fp32 output where torch has it (CUDA), else the
    product of the fp32 copies (exact: every 16-bit value is an fp32 one)."""
    if x.is_cuda:
        try:
            return torch.mm(x, wt, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # (a torch without the overload for these operands)
            pass
    return torch.matmul(x.float(), wt.float())


def forward(x2: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """The output of a ``dequant_cublas`` call on the GPU whose weight is dequantized (``wd``, written by a replay
    of the dequantization): made and written as :func:`tilegemm.ops.w4a16.dispatch.forward` does (M, K > 0)."""
    out = new_output((x2.shape[0], wd.shape[0]), x2.dtype, x2.device)
    product(x2 if x2.stride(-1) == 1 else x2.contiguous(), wd, bias, activation, out)
    return out
