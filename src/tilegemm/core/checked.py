"""Argument checks a registered op's body runs once per argument layout.

A registered op called directly (``torch.ops.tilegemm.*``), from a compiled graph or under autograd checks its
arguments itself, since nothing before it did; those checks read shapes, strides, dtypes and devices only (never a
GPU tensor's values: no host sync), so one pass per layout says all they can. :func:`check_once` remembers the
layouts that passed, so a compiled model's calls pay for a tuple of layouts rather than the checks (docs/internals.md,
"Runtime").
"""

from __future__ import annotations

import torch

_PASSED: set = set()
MAX_LAYOUTS = 4096  # forgotten all at once past this many: a model's layers make a few hundred


def _layout(args: tuple) -> tuple | None:
    """The layouts of ``args`` (tensors by type, shape, strides, dtype and device; other values as they are) and,
    with GPU tensors among them, the current device; None where a tensor is not on a GPU: a CPU tensor's values
    may be checked (a permutation, offsets)."""
    out, cuda = [], False
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cuda:
                return None
            out.append((type(a), a.shape, a.stride(), a.dtype, a.device))
            cuda = True
        else:
            out.append(a)
    # the current device too: a check may ask whether a kernel runs on it (why_not_gluon does)
    return (torch.cuda.current_device() if cuda else None, *out)


def check_once(check, *args) -> None:
    """``check(*args)``, unless arguments of the same layout passed it before."""
    key = _layout(args)
    if key is not None:
        key = (check, key)
        try:
            if key in _PASSED:
                return
        except TypeError:  # an unhashable argument: checked every time
            key = None
    check(*args)
    if key is not None:
        if len(_PASSED) >= MAX_LAYOUTS:
            _PASSED.clear()
        _PASSED.add(key)


def forget() -> None:
    """Forget the layouts that passed (tests)."""
    _PASSED.clear()
