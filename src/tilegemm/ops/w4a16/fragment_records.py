"""Whether a fragment layout a module keeps (``Int4Weight.fragments()``, which the decode kernels read instead of
the 4-bit parts) still stands for the parts it was made of.

A part may be written in place (a newer ``_version``), have its storage swapped (``.data =``, which bumps no
version) or be replaced by another tensor (``torch.func.functional_call``, assignment,
``load_state_dict(assign=True)``). An address does not tell tensors or storages apart (a freed one's is reused by
the next), so a record knows the tensors by identity and their storages by weak references that expire when the
storage is freed: it keeps none of them alive. The module asks :func:`stands_for` at every eager forward and
:func:`traced_stands_for` while torch.compile traces (a graph carries the layout only where it stood then); the
ops ask :func:`layout_for` when they run, which is how a compiled graph checks at every call, of the tensors it is
called with. Each check reads each tensor's address and version and each storage reference's expiry, and nothing
more.
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
    """What :func:`layout_for` and :func:`unwritten_when_traced` read of a record: held by the record, found by the
    ``id`` of any of its layout's tensors."""

    __slots__ = ("extra", "refs", "states", "storages", "__weakref__")

    def __init__(self, extra, refs, states, storages):
        self.extra, self.refs, self.states, self.storages = extra, refs, states, storages


# id of a layout's tensor -> weak references to the _Kept of every record made of it (a layout two modules share
# has two), while they are held
_LIVE: dict = {}
_SWEEP_MIN = 1024  # entries of _LIVE before the first sweep of dropped records' ids
_SWEEP_AT = _SWEEP_MIN


def _live(i: int) -> list:
    """The held records' _Kept of layout tensor id ``i`` (newest first); forgets the dropped ones."""
    refs = _LIVE.get(i)
    if not refs:
        return []
    kept = [k for k in (r() for r in refs) if k is not None]
    if len(kept) != len(refs):
        if kept:
            _LIVE[i] = [weakref.ref(k) for k in kept]
        else:
            del _LIVE[i]
    return kept[::-1]


def record(parts, layout, extra) -> tuple:
    """A record of the fragment ``layout`` (its tensors) made of ``parts`` for ``extra`` (what else it depends
    on: a group size), which the module holds until any of them changes: ``(extra, references, states, storages,
    kept)``."""
    refs = tuple([weakref.ref(t) for t in (*parts, *layout)])
    states = _states(parts)
    storages = tuple([StorageWeakRef(t.untyped_storage()) for t in parts])
    kept = _Kept(extra, refs, states, storages)
    for t in layout:
        _live(id(t))  # (drops the references of records no longer held)
        _LIVE.setdefault(id(t), []).append(weakref.ref(kept))
    global _SWEEP_AT
    if len(_LIVE) >= _SWEEP_AT:  # ids whose records were all dropped, never asked for again: forgotten
        for i in list(_LIVE):
            _live(i)
        _SWEEP_AT = max(_SWEEP_MIN, 2 * len(_LIVE))
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


def _covers(kept, parts, layout) -> bool:
    """Whether ``kept``'s record was made of these very ``parts`` and ``layout``, the parts unwritten since."""
    refs, n = kept.refs, len(kept.states)
    if len(parts) != n:
        return False
    for ref, t in zip(refs, parts):
        if ref() is not t:
            return False
    recorded = [ref() for ref in refs[n:]]
    for t in layout:
        if not any([t is u for u in recorded]):
            return False  # (a tensor now at a recorded one's id, the record's own having been freed)
    try:
        return _unwritten(kept.states, kept.storages, parts)
    except (RuntimeError, NotImplementedError):  # (parts with no address: the op reads them)
        return False


def layout_for(parts, layout):
    """The fragment ``layout`` where an op may read it for ``parts``, else None (the op then reads the parts).
    ``layout`` as given where no module recorded it (a caller's own ``Int4Weight``: its layout is its to keep);
    a module's only while one of its records stands for these very parts, unwritten. Asked when the op runs, so a
    graph compiled by torch.compile checks at every call: traced with a layer's layout standing, it may run after a
    part was written (a graph guards no version) or with other parts (``functional_call``)."""
    held = _live(id(layout[0]))
    if not held:
        return layout
    return layout if any([_covers(kept, parts, layout) for kept in held]) else None


def unwritten_when_traced(extra, n_parts: int, *ids: int) -> bool:
    """Whether a record of ``extra`` stands for the tensors of ``ids`` (``n_parts`` parts', then a layout's
    ``id``s), its parts unwritten, asked of the real tensors while torch.compile traces: a constant of the graph,
    which then carries the layout (the op checks it again when it runs: :func:`layout_for`). Its arguments are
    constants (torch 2.11's Dynamo passes a constant function nothing else); Dynamo guards the graph on the identity
    of the tensors whose ``id`` it read, so each layer's is checked for it (a repeated block compiled on its own is
    compiled for each layer: docs/w4a16.md, "The fragment layout ...")."""
    if len(ids) <= n_parts:
        return False
    for kept in _live(ids[n_parts]):
        if kept.extra != extra or len(ids) != len(kept.refs) or len(kept.states) != n_parts:
            continue
        tensors = [r() for r in kept.refs]
        if any([t is None or id(t) != i for t, i in zip(tensors, ids)]):
            continue
        try:
            if _unwritten(kept.states, kept.storages, tensors[:n_parts]):
                return True
        except (RuntimeError, NotImplementedError):  # (fake tensors, as a non-strict export has, have no address)
            return False
    return False


def traced_stands_for(parts, layout, extra) -> bool:
    """:func:`stands_for` while torch.compile traces: its answer a constant of the graph. The traced code reads no
    record: Dynamo would take a weak reference's referent for the tensor it was given, and guard on that one."""
    return unwritten_when_traced(extra, len(parts), *[id(t) for t in (*parts, *layout)])


# The mark torch.compiler.assume_constant_result sets, set by hand: the decorator imports torch._dynamo, which
# imports triton, and importing tilegemm must not (core/runtime.py marks its constants the same way).
unwritten_when_traced._dynamo_marked_constant = True


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
