"""Whether a fragment layout a module keeps (``Int4Weight.fragments()``, which the decode kernels read instead of
the 4-bit parts) still stands for the parts it was made of.

A part may be written in place (a newer ``_version``), have its storage swapped (``.data =``, which bumps no
version) or be replaced by another tensor (``torch.func.functional_call``, assignment,
``load_state_dict(assign=True)``). An address does not tell tensors or storages apart (a freed one's is reused by
the next), so a record knows the tensors by identity and their storages by weak references that expire when the
storage is freed: it keeps none of them alive. The module asks :func:`stands_for` at every eager forward; the ops
ask :func:`layout_for` when they run, which is how a graph compiled by torch.compile checks: at every call of the
graph, of the tensors it is called with, nothing of the check traced. Each check reads each tensor's address and
version and each storage reference's expiry, and nothing more.
"""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def part_state(t: torch.Tensor) -> tuple:
    """What an in-place write to ``t`` changes: its storage's address and its version (None for an inference
    tensor, which keeps no version counter: a write to it is not seen)."""
    return t.data_ptr(), None if t.is_inference() else t._version


def _states(parts) -> tuple:
    try:
        return tuple([(t.data_ptr(), t._version) for t in parts])
    except RuntimeError:  # an inference tensor among them
        return tuple([part_state(t) for t in parts])


class _Kept:
    """What :func:`layout_for` reads of a record: held by the record, found by the ``id`` of any of its layout's
    tensors."""

    __slots__ = ("extra", "refs", "states", "storages", "__weakref__")

    def __init__(self, extra, refs, states, storages):
        self.extra, self.refs, self.states, self.storages = extra, refs, states, storages


_LIVE = weakref.WeakValueDictionary()  # id of a layout's tensor -> its record's _Kept, while the record is held


def record(parts, layout, extra) -> tuple:
    """A record of the fragment ``layout`` (its tensors) made of ``parts`` for ``extra`` (what else it depends
    on: a group size), which the module holds until any of them changes: ``(extra, references, states, storages,
    kept)``."""
    refs = tuple([weakref.ref(t) for t in (*parts, *layout)])
    states = _states(parts)
    storages = tuple([StorageWeakRef(t.untyped_storage()) for t in parts])
    kept = _Kept(extra, refs, states, storages)
    for t in layout:
        _LIVE[id(t)] = kept
    return extra, refs, states, storages, kept


def same_tensors(rec, parts, layout, extra) -> bool:
    """Whether ``parts`` and ``layout`` are the very tensors ``rec`` was made of."""
    if rec is None or rec[0] != extra:
        return False
    tensors = (*parts, *layout)
    if len(rec[1]) != len(tensors):
        return False
    for ref, t in zip(rec[1], tensors):
        if ref() is not t:
            return False
    return True


# (StorageWeakRef.expired goes through TypedStorage's Python classmethod: four times the time of the builtin)
_storage_expired = torch.UntypedStorage._expired


def _unwritten(states, storages, parts) -> bool:
    return states == _states(parts) and not any([_storage_expired(s.cdata) for s in storages])


def stands_for(rec, parts, layout, extra) -> bool:
    """Whether ``rec``'s layout stands for ``parts``: the same tensors, none written or given another storage
    since."""
    return same_tensors(rec, parts, layout, extra) and _unwritten(rec[2], rec[3], parts)


def layout_for(parts, layout):
    """The fragment ``layout`` where an op may read it for ``parts``, else None (the op then reads the parts).
    ``layout`` as given where no module recorded it (a caller's own ``Int4Weight``: its layout is its to keep);
    a module's only while its record stands for these very parts, unwritten. What a graph compiled by torch.compile
    asks when it runs: traced with a layer's own parts, it may be called with others (``functional_call``) or after
    a write, and a regionally compiled block's graph serves every layer."""
    kept = _LIVE.get(id(layout[0]))
    if kept is None:
        return layout
    refs, n = kept.refs, len(kept.states)
    if len(parts) != n:
        return None
    for ref, t in zip(refs, parts):
        if ref() is not t:
            return None
    recorded = [ref() for ref in refs[n:]]
    for t in layout:
        if not any([t is u for u in recorded]):
            return None  # (a tensor now at a recorded one's id, the record's own having been freed)
    try:
        return layout if _unwritten(kept.states, kept.storages, parts) else None
    except (RuntimeError, NotImplementedError):  # (parts with no address: the op reads them)
        return None


def standing_tensors(rec) -> tuple | None:
    """``(parts, layout)`` of ``rec`` where its tensors are alive and its parts unwritten, else None (what a copy
    of the module may record again, of the copies of these tensors)."""
    if rec is None:
        return None
    tensors = [r() for r in rec[1]]
    n = len(rec[2])
    if any([t is None for t in tensors]) or not _unwritten(rec[2], rec[3], tensors[:n]):
        return None
    return tuple(tensors[:n]), tuple(tensors[n:])
