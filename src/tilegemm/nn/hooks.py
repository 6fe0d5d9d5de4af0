"""Hooks on a module, for the transforms that replace it or change what it computes."""

from __future__ import annotations

import torch


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward, forward-pre, backward or backward-pre hooks of its own: a transform that
    replaces it would drop them, one that folds it into another module would change what they see."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))
