"""Hooks on a module, for the transforms that replace it or change what it computes."""

from __future__ import annotations

import torch


def tilegemm_hook(fn):
    """Mark ``fn`` as a hook tilegemm registers itself (a check, no change to what the module computes): the
    transforms' :func:`has_hooks` and :func:`has_forward_hooks` do not count it."""
    fn.tilegemm_hook = True
    return fn


def _users(hooks) -> bool:
    return any(not getattr(fn, "tilegemm_hook", False) for fn in hooks.values())


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward or forward-pre hooks other than tilegemm's own (:func:`tilegemm_hook`)."""
    return _users(module._forward_hooks) or _users(module._forward_pre_hooks)


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward, forward-pre, backward or backward-pre hooks of its own (tilegemm's own checks
    aside): a transform that replaces it would drop them, one that folds it into another module would change what
    they see."""
    return has_forward_hooks(module) or bool(module._backward_hooks or getattr(module, "_backward_pre_hooks", None))


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
