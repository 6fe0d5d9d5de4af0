"""``tilegemm.nn.Conv2d``: ``torch.nn.Conv2d`` whose forward and backward run tilegemm's conv2d kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilegemm.core.activations import check_activation, torch_activation
from tilegemm.nn.linear import NotScriptable, refuse_other_forward, shallow_copy_as, sharding_rules_for
from tilegemm.ops.conv2d import conv2d
from tilegemm.ops.conv2d.checks import DTYPES, check_padded_size

_KERNEL_DTYPES = frozenset(DTYPES)


class Conv2d(NotScriptable, torch.nn.Conv2d):
    """A drop-in ``torch.nn.Conv2d`` (same arguments, parameters and state dict), plus ``activation``: one of
    ``tilegemm.ACTIVATIONS`` applied in the kernel's epilogue after the bias (default none).

    Padding modes other than ``"zeros"`` pad with ``F.pad`` first, as torch does, then convolve unpadded.
    Inputs may be NCHW or channels-last; the output is channels-last where the input or the weight is (as
    torch's), else NCHW. A weight in a dtype the kernels do not take (float64, after ``.double()``) runs torch's
    convolution.
    """

    _tilegemm_fold = None  # a batch norm folded into it for eval mode: tilegemm.nn.fold.Fold (fold_batchnorm_)

    def __init__(self, *args, activation: str | None = None, **kwargs):
        check_activation(activation)  # before the parameters are made: a typo fails here, not at forward
        super().__init__(*args, **kwargs)
        self.activation = activation

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, activation: str | None = None) -> "Conv2d":
        """A ``Conv2d`` sharing ``conv``'s parameters, buffers and submodules (no copy: an optimizer over
        ``conv``'s parameters keeps training it). The hooks ``conv`` has are copied: a hook added to either module
        later stays on that one. A parametrized ``conv`` (``torch.nn.utils.parametrize``, e.g.
        ``parametrizations.weight_norm``) gives a parametrized ``Conv2d`` over the same parametrizations and original
        tensors. A module whose forward is not ``torch.nn.Conv2d``'s (replaced on the instance, or a subclass's own)
        or a lazy one that has not made its parameters yet raises ValueError: the copy would run something else."""
        if not isinstance(conv, torch.nn.Conv2d):
            raise TypeError(f"from_conv takes a torch.nn.Conv2d, got {type(conv).__name__}")
        check_activation(activation)
        refuse_other_forward(conv, torch.nn.Conv2d, cls, ("forward", "_conv_forward"), "Conv2d.from_conv")
        if "forward" in vars(conv):  # copied along, it would run instead of tilegemm's forward
            raise ValueError("tilegemm.nn.Conv2d.from_conv: this nn.Conv2d's forward was replaced on the instance "
                             "(a tensor-parallel plan, accelerate's device_map hooks), and the copy would keep running "
                             "it instead of tilegemm's forward: convert first, then apply those")
        new = shallow_copy_as(conv, cls)
        new.activation = activation
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parameters from their dict: ``self.weight`` goes through Module.__getattr__, a sizable part of a
        # replayed call's host time (docs/conv2d.md, "Host fast path"). A parametrized or reassigned weight or
        # bias is not in the dict: read as torch's forward reads it.
        params = self._parameters
        plain = "weight" in params and "bias" in params
        if plain:
            weight, bias = params["weight"], params["bias"]
        else:
            weight, bias = self.weight, self.bias
        activation = self.activation
        fold = self._tilegemm_fold
        if fold is not None and fold.active():  # the batch norm after it, folded (tilegemm.nn.fold_batchnorm_)
            weight, bias = fold.parameters(weight, bias, cacheable=plain)
            activation = fold.activation
        if weight.dtype not in _KERNEL_DTYPES:  # float64 (``.double()``): no kernel takes it, torch's conv does
            return torch_activation(self._conv_forward(x, weight, bias), activation or "none")
        if type(weight) is not torch.nn.Parameter:
            sharding_rules_for(weight)
        padding = self.padding
        if self.padding_mode != "zeros":
            left, right, top, bottom = self._reversed_padding_repeated_twice
            if isinstance(x, torch.Tensor) and x.dim() >= 2:  # named before F.pad (its own: a storage overflow)
                check_padded_size(self.padding, x.shape[-2], x.shape[-1], (top, bottom, left, right))
            # (circular F.pad returns NCHW from a channels-last x: the output's format then follows torch's module,
            # as it does when the module is traced)
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return conv2d(x, weight, bias, self.stride, padding, self.dilation, self.groups, activation)

    def extra_repr(self) -> str:
        extra = super().extra_repr() + (f", activation={self.activation}" if self.activation else "")
        fold = self._tilegemm_fold
        if fold is not None:
            extra += ", batch norm folded" + (f" with {fold.activation}" if fold.activation else "")
        return extra
