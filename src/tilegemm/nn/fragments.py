"""Whether a fragment layout a module keeps (``Int4Weight.fragments()``, which the decode kernels read instead of
the 4-bit parts) still stands for the parts it was made of.

A part may be written in place (a newer ``_version``), have its storage swapped (``.data =``, which bumps no
version) or be replaced by another tensor (``torch.func.functional_call``, assignment,
``load_state_dict(assign=True)``). An address does not tell tensors apart (a freed part's is reused by the next
one), so a record knows the tensors by identity, through weak references: it keeps none of them alive. The check
runs at every forward of a decode step, so it reads each tensor's address and version and nothing more.
"""

from __future__ import annotations

import weakref

import torch


def part_state(t: torch.Tensor) -> tuple:
    """What an in-place write to ``t`` changes: its storage's address and its version (None for an inference
    tensor, which keeps no version counter: a write to it is not seen)."""
    return t.data_ptr(), None if t.is_inference() else t._version


def _states(parts) -> tuple:
    try:
        return tuple([(t.data_ptr(), t._version) for t in parts])
    except RuntimeError:  # an inference tensor among them
        return tuple([part_state(t) for t in parts])


def record(parts, layout, extra) -> tuple:
    """A record of the fragment ``layout`` (its tensors) made of ``parts`` for ``extra`` (what else it depends
    on: a group size), which the module holds until any of them changes."""
    return extra, tuple([weakref.ref(t) for t in (*parts, *layout)]), _states(parts)


def same_tensors(rec, parts, layout, extra) -> bool:
    """Whether ``parts`` and ``layout`` are the very tensors ``rec`` was made of (torch.compile traces this)."""
    if rec is None or rec[0] != extra:
        return False
    tensors = (*parts, *layout)
    if len(rec[1]) != len(tensors):
        return False
    for ref, t in zip(rec[1], tensors):
        if ref() is not t:
            return False
    return True


def stands_for(rec, parts, layout, extra) -> bool:
    """Whether ``rec``'s layout stands for ``parts``: the same tensors, none written since."""
    return same_tensors(rec, parts, layout, extra) and rec[2] == _states(parts)
