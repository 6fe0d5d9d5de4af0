"""``tilegemm.nn.Linear``: ``torch.nn.Linear`` through ``tilegemm.matmul``, with an optional fused activation."""

from __future__ import annotations

import copy
import sys

import torch

from tilegemm.core.activations import check_activation
from tilegemm.ops.matmul import matmul


def sharding_rules_for(weight) -> None:
    """Register tilegemm's DTensor sharding rules when ``weight`` is a DTensor (a layer parallelized with torch's
    own styles): imported here, not at ``import tilegemm``, because ``torch.distributed.tensor`` is slow to import."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(weight, dtensor.DTensor):
        import tilegemm.parallel.rules  # noqa: F401 (registers the rules)


class Linear(torch.nn.Linear):
    """A drop-in ``torch.nn.Linear`` (same arguments, parameters and state dict), plus ``activation``: one of
    ``tilegemm.ACTIVATIONS`` applied in the GEMM's epilogue after the bias. Autograd runs through
    ``tilegemm.matmul`` (its backward GEMMs are tilegemm's too)."""

    def __init__(self, *args, activation: str | None = None, **kwargs):
        check_activation(activation)  # before the parameters are made: a typo fails here, not at forward
        super().__init__(*args, **kwargs)
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, activation: str | None = None) -> "Linear":
        """A ``Linear`` sharing ``linear``'s parameters (no copy)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")
        check_activation(activation)
        new = copy.copy(linear)
        new.__class__ = cls
        new._parameters = dict(linear._parameters)
        new._buffers = dict(linear._buffers)
        new._modules = dict(linear._modules)
        new.activation = activation
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.weight) is not torch.nn.Parameter:
            sharding_rules_for(self.weight)
        # [*, in] -> [M, in]: one GEMM, whatever the leading dims (flatten, not reshape(-1, in), which cannot
        # infer M when in_features is 0); a 1-D x is one row, as torch.matmul takes it.
        x2d = x.flatten(0, -2) if x.ndim > 2 else x
        out = matmul(x2d, self.weight.t(), bias=self.bias, activation=self.activation)  # [M, out]
        return out.unflatten(0, x.shape[:-1]) if x.ndim > 2 else out

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return extra + (f", activation={self.activation}" if self.activation else "")
