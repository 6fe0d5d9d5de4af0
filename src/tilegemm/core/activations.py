"""The epilogue activations every family fuses, by name, and their plain-torch definitions (the oracle and
the backward pass differentiate these)."""

from __future__ import annotations

import torch

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "leaky_relu")


def check_activation(activation) -> str:
    """``activation`` as a name from :data:`ACTIVATIONS` (None means ``"none"``); ValueError otherwise."""
    activation = "none" if activation is None else activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of: {', '.join(ACTIVATIONS)}")
    return activation


def torch_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    F = torch.nn.functional
    if activation == "relu":
        return F.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    if activation == "leaky_relu":
        return F.leaky_relu(x, 0.01)
    return x
