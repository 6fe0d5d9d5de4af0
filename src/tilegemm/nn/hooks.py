"""Hooks on a module, for the transforms that replace it or change what it computes."""

from __future__ import annotations

import torch


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward, forward-pre, backward or backward-pre hooks of its own: a transform that
    replaces it would drop them, one that folds it into another module would change what they see."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


# What a module carries that is not its weights: its forward and backward hooks (the dicts themselves, so the
# handles the caller holds still remove them). State-dict hooks stay behind: they were made for the old tensors.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def carry_over(old: torch.nn.Module, new: torch.nn.Module) -> torch.nn.Module:
    """``new`` given ``old``'s forward/backward hooks and its training flag (what a transform replacing ``old``
    puts in its place). The flag goes to ``new`` and the submodules made for it; those it shares with ``old`` keep
    their own."""
    for name in _HOOK_DICTS:
        hooks = getattr(old, name, None)
        if hooks:
            setattr(new, name, hooks)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
    shared = {id(m) for m in old.modules()}
    for m in new.modules():
        if id(m) not in shared:
            m.training = old.training
    return new
