"""The record of one ``tilegemm.w4a16.matmul`` call: its arguments travel in it from the public function to the
kernel's launcher (plain Python: no triton here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class W4A16Problem:
    """``out [M, N] = activation(x [M, K] @ W.T + bias)`` for one call; ``x`` already 2-D and, for act-order,
    permuted, or with ``perm`` set: read through it by the kernel (``x[:, perm] @ W.T``).

    The call's arguments (the weight's tensors, not the :class:`~tilegemm.ops.w4a16.format.Int4Weight` that holds
    them, so that the ``torch.library`` op can take them) and, once :func:`tilegemm.ops.w4a16.dispatch.forward`
    made it, the output; a launcher reads every field but ``kernel``.
    """

    x: torch.Tensor  # [M, K], fp16/bf16, unit stride along K
    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N]
    bias: torch.Tensor | None  # [N]
    out: torch.Tensor | None  # [M, N]; None until dispatch.forward makes it
    group_k: int  # inputs per group (K for group_size -1)
    activation: str
    upcast: bool = False  # bf16 under the interpreter: dot in fp32
    fweight: torch.Tensor | None = None  # the fragment layout (Int4Weight.fragments()), when a fragment kernel may run
    fzs: torch.Tensor | None = None
    kernel: str = "auto"  # the kernel asked for
    perm: torch.Tensor | None = None  # act-order: x's inputs in the weight's stored order, int [K]; None: x is so

    @property
    def M(self) -> int:
        return self.x.shape[0]

    @property
    def N(self) -> int:
        return self.qweight.shape[1]

    @property
    def K(self) -> int:
        return self.x.shape[1]

    def op_args(self) -> tuple:
        """The arguments of ``tilegemm::w4a16_matmul`` (:mod:`tilegemm.ops.w4a16.op`), in its schema's order."""
        return (self.x, self.qweight, self.scales, self.zeros, self.fweight, self.fzs, self.bias, self.group_k,
                self.activation, self.kernel, self.perm)

    @classmethod
    def of_op_args(cls, x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel,
                   perm=None) -> "W4A16Problem":
        """The inverse of :meth:`op_args`."""
        return cls(x=x, qweight=qweight, scales=scales, zeros=zeros, bias=bias, out=None, group_k=group_k,
                   activation=activation, fweight=fweight, fzs=fzs, kernel=kernel, perm=perm)
