"""``Int4Linear``: a drop-in ``nn.Linear`` with a 4-bit weight, and ``quantize_`` to swap a model's layers."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tilegemm.nn.moe import quantize_experts_
from tilegemm.ops.w4a16.format import Int4Weight, fits_fragments, from_awq, from_gptq, quantize

_BUFFERS = ("qweight", "scales", "zeros", "perm")


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` held as an :class:`~tilegemm.ops.w4a16.format.Int4Weight`.

    The weight's parts are buffers (``qweight``, ``scales``, ``zeros``, ``perm``; ``perm`` is empty unless the
    weight came from an act-order GPTQ checkpoint), so ``.to()``, ``state_dict`` and ``load_state_dict`` work as
    for any module; ``bias`` is a parameter. Make one with :meth:`from_linear`, :meth:`from_gptq`,
    :meth:`from_awq`, or construct an empty one and load a state dict into it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = 128,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        w = quantize(torch.zeros(out_features, in_features, dtype=dtype, device=device), group_size)
        self._set_weight(w)
        # Frozen like the weight (an inference layer), as from_weight makes it: a trainable bias would keep every
        # call off the replay fast path under grad mode.
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def _set_weight(self, w: Int4Weight) -> None:
        for name, t in w.tensors().items():
            if t is None:
                t = torch.empty(0, dtype=torch.int64, device=w.device)
            self.register_buffer(name, t)
        self.group_size = w.group_size
        self._set_fragments(w)

    def _set_fragments(self, w: Int4Weight) -> None:
        # The fragment kernel's layout of the weight (Int4Weight.fragments()), made once, kept as buffers that move
        # with the module and are not saved (they follow from the others); empty where that kernel cannot run
        # (a group length that is not a multiple of 64).
        fw, fzs = w.fragments() if fits_fragments(w.group_k) else (torch.empty(0, dtype=torch.int32, device=w.device),) * 2
        self.register_buffer("fweight", fw, persistent=False)
        self.register_buffer("fzs", fzs, persistent=False)

    @property
    def weight(self) -> Int4Weight:
        """The 4-bit weight, a view on the buffers (no copy)."""
        return self._weight((self.fweight, self.fzs) if self.fweight.numel() else None)

    def _weight(self, frag=None) -> Int4Weight:
        perm = self.perm if self.perm.numel() else None
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size,
                          (self.out_features, self.in_features), perm, frag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tilegemm.ops.w4a16.api import matmul

        return matmul(x, self.weight, bias=self.bias)

    def dequantize(self) -> torch.Tensor:
        from tilegemm.ops.w4a16.format import dequantize

        return dequantize(self.weight)

    @classmethod
    def from_weight(cls, w: Int4Weight, bias: torch.Tensor | None = None) -> "Int4Linear":
        N, K = w.shape
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = K, N
        mod._set_weight(w)
        mod.bias = nn.Parameter(bias.detach().to(w.dtype).clone(), requires_grad=False) if bias is not None else None
        return mod

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = False) -> "Int4Linear":
        """Quantize an ``nn.Linear`` (round-to-nearest, per group); fp32 layers get fp16 scales."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = quantize(linear.weight.detach(), group_size, symmetric)
        return cls.from_weight(w, linear.bias)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None) -> "Int4Linear":
        return cls.from_weight(from_gptq(qweight, qzeros, scales, g_idx), bias)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None) -> "Int4Linear":
        return cls.from_weight(from_awq(qweight, qzeros, scales), bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint may hold another layout than this module was built with (act-order perm, another
        # group size): take its shapes, then let nn.Module copy the values.
        for name in _BUFFERS:
            incoming = state_dict.get(prefix + name)
            if incoming is not None and incoming.shape != getattr(self, name).shape:
                self._buffers[name] = torch.empty_like(incoming, device=getattr(self, name).device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        G = self.scales.shape[0]
        self.group_size = -1 if G == 1 else self.in_features // G
        if not error_msgs:
            self._set_fragments(self._weight())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, dtype={self.scales.dtype}")


def quantize_(model: nn.Module, group_size: int = 128, filter: Callable[[str, nn.Module], bool] | None = None,
              symmetric: bool = False) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` (that ``filter(name, module)`` accepts) by an
    :class:`Int4Linear`, and the experts of transformers' MoE blocks by 4-bit stacked ones
    (:func:`tilegemm.nn.moe.quantize_experts_`); returns ``model``. Layers whose in_features the group size does
    not divide are kept."""
    targets = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and (filter is None or filter(name, module)):
            K = module.in_features
            if K % 8 == 0 and (group_size == -1 or K % group_size == 0):
                targets.append(name)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int4Linear.from_linear(getattr(parent, child), group_size, symmetric))
    quantize_experts_(model, group_size, filter, symmetric)  # transformers' MoE blocks: their 3-D experts
    return model
