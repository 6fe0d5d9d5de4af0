"""``tilegemm.nn.Conv2d``: ``torch.nn.Conv2d`` whose forward and backward run tilegemm's conv2d kernels."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tilegemm.core.activations import check_activation
from tilegemm.nn.linear import sharding_rules_for
from tilegemm.ops.conv2d import conv2d


class Conv2d(torch.nn.Conv2d):
    """A drop-in ``torch.nn.Conv2d`` (same arguments, parameters and state dict), plus ``activation``: one of
    ``tilegemm.ACTIVATIONS`` applied in the kernel's epilogue after the bias (default none).

    Padding modes other than ``"zeros"`` pad with ``F.pad`` first, as torch does, then convolve unpadded.
    Inputs may be NCHW or channels-last; the output keeps the input's memory format.
    """

    def __init__(self, *args, activation: str | None = None, **kwargs):
        check_activation(activation)  # before the parameters are made: a typo fails here, not at forward
        super().__init__(*args, **kwargs)
        self.activation = activation

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, activation: str | None = None) -> "Conv2d":
        """A ``Conv2d`` sharing ``conv``'s parameters and buffers (no copy: an optimizer over ``conv``'s
        parameters keeps training it)."""
        if not isinstance(conv, torch.nn.Conv2d):
            raise TypeError(f"from_conv takes a torch.nn.Conv2d, got {type(conv).__name__}")
        check_activation(activation)
        new = copy.copy(conv)  # shallow: the same Parameter objects
        new.__class__ = cls
        new._parameters = dict(conv._parameters)
        new._buffers = dict(conv._buffers)
        new._modules = dict(conv._modules)
        new.activation = activation
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parameters from their dict: ``self.weight`` goes through Module.__getattr__, a sizable part of a
        # replayed call's host time (docs/conv2d.md, "Host fast path"). A parametrized or reassigned weight or
        # bias is not in the dict: read as torch's forward reads it.
        params = self._parameters
        if "weight" in params and "bias" in params:
            weight, bias = params["weight"], params["bias"]
        else:
            weight, bias = self.weight, self.bias
        if type(weight) is not torch.nn.Parameter:
            sharding_rules_for(weight)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return conv2d(x, weight, bias, self.stride, padding, self.dilation, self.groups, self.activation)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return extra + (f", activation={self.activation}" if self.activation else "")
