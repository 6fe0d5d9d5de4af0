"""Split reductions' scratch memory: fp32 partial-sum planes and int32 arrival counters, one pair per
(device, stream) and reduction, for the kernels that hand partial tiles to the last program to arrive (the
W4A16 kernels, split_k).

Launches on one stream run in order, so they can share it: every launch leaves the counters at zero, and the
planes need no zeroing (each slice writes all of its own before it counts itself in). A call that needs more
replaces the stream's pair with a larger one; replays recorded with the old pair keep it alive and keep using
it (it is large enough for them).

Under ``torch.compile(mode="reduce-overhead")`` torch's CUDA graph trees warm a compiled function up and
record it on a stream of their own with every allocation routed into the graphs' private pool, then require
that nothing in that pool outlives the call but the function's outputs. A kept workspace would; so there
(:func:`in_graph_tree`) each call gets its own scratch, freed when it returns (the graph keeps its memory),
and no call is recorded for replay.
"""

from __future__ import annotations

import sys

import torch

from tilegemm.core.launch import current_stream


def in_graph_tree() -> bool:
    """True while torch's CUDA graph trees warm up or record a function on this thread: the current stream is
    a tree manager's own. Cheap on torch's default stream and where they were never used (torch._inductor's
    module not imported, or no manager made)."""
    stream = current_stream()
    if not stream:  # torch's default stream: never a tree manager's (each has a stream of its own)
        return False
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        if not containers:
            return False
        for container in containers.values():
            manager = container.tree_manager
            if manager is not None and manager.stream.cuda_stream == stream:
                return True
    except Exception:  # noqa: BLE001 - torch's internals moved: behave as before they were known
        return False
    return False

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# A CUDA graph keeps no reference to the memory its kernels read and write. Scratch a capture used is marked
# (``_used_in_capture``, by id: each is still in the tables above while marked), and when a larger call replaces it,
# or release() drops it, it moves to ``_held_by_graphs`` instead of being freed (else the allocator could hand
# memory a graph replays into to another tensor). release(graphs=True) lets them go, once those graphs are gone.
_used_in_capture: set[int] = set()
_held_by_graphs: dict[int, torch.Tensor] = {}


def _mark(*tensors: torch.Tensor) -> None:
    _used_in_capture.update(id(t) for t in tensors)


def _retire(*tensors) -> None:
    """Scratch leaving the tables: held if a capture used it, else let go."""
    for t in tensors:
        if t is not None and id(t) in _used_in_capture:
            _used_in_capture.discard(id(t))
            _held_by_graphs[id(t)] = t
_zero_eagerly: set = set()  # workspaces made during a capture: their zeros ran in that graph only


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_workspace(device: torch.device, floats: int, counters: int, tag=None,
                    zeroed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(planes, counters) with room for at least ``floats`` fp32 values and ``counters`` int32 counters.

    ``tag`` keeps users apart whose planes hold different contracts; ``zeroed``: the planes start at zero
    (for a reduction that adds into them with atomics and leaves them zeroed again)."""
    if device.type == "cuda" and in_graph_tree():  # this call's own (see the module's notes)
        planes = (torch.zeros if zeroed else torch.empty)(max(floats, 1), dtype=torch.float32, device=device)
        return planes, torch.zeros(max(counters, 1), dtype=torch.int32, device=device)
    key = (device, current_stream() if device.type == "cuda" else 0, tag)
    ws, count = _workspaces.get(key, (None, None))
    capturing = _capturing(device)
    if ws is None or ws.numel() < floats or count.numel() < counters:
        # grown by at least half, as buffer() grows: a few replacements, each held by its replays (and graphs)
        floats = max(floats, ws.numel() * 3 // 2 if ws is not None else 0, 1 << 20)
        counters = max(counters, count.numel() * 3 // 2 if count is not None else 0, 1 << 12)
        _retire(ws, count)
        ws = (torch.zeros if zeroed else torch.empty)(floats, dtype=torch.float32, device=device)
        count = torch.zeros(counters, dtype=torch.int32, device=device)
        _workspaces[key] = (ws, count)
        if capturing:  # zeroed in this graph only: the next eager call zeroes them first
            _zero_eagerly.add(key)
    elif capturing:
        # Zeroes made in another graph's capture do not run in this one: it zeroes the counters itself (the
        # kernels leave them at zero, so outside that case this writes zeros over zeros).
        count.zero_()
        if zeroed:
            ws.zero_()
    elif key in _zero_eagerly:
        _zero_eagerly.discard(key)
        count.zero_()
        if zeroed:
            ws.zero_()
    if capturing:
        _mark(ws, count)
    return ws, count


_buffers: dict[tuple, torch.Tensor] = {}


def buffer(device: torch.device, dtype: torch.dtype, numel: int, tag) -> torch.Tensor:
    """A flat scratch tensor of at least ``numel`` elements, one per (device, stream, dtype, tag): for
    copies a call makes and its kernels read (matmul's padded operands). Launches on one stream run in order,
    so calls on it can share it; a call that needs more replaces it, and replays recorded with the old one
    keep it alive."""
    if device.type == "cuda" and in_graph_tree():  # this call's own (see the module's notes)
        return torch.empty(max(numel, 1), dtype=dtype, device=device)
    key = (device, current_stream() if device.type == "cuda" else 0, dtype, tag)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        # Grown by at least half over the one it replaces: a network's layers growing call by call (a backward pass from the
        # deep layers out) replace it a few times, not once a layer, each replaced one held by its replays.
        grown = buf.numel() * 3 // 2 if buf is not None else 0
        _retire(buf)
        buf = _buffers[key] = torch.empty(max(numel, grown, 1 << 16), dtype=dtype, device=device)
    if _capturing(device):
        _mark(buf)
    return buf


def release(graphs: bool = False) -> None:
    """Drop the kept scratch tensors (:func:`buffer`'s and :func:`split_workspace`'s) of every device and stream:
    the next calls allocate afresh. The NCHW route of conv2d keeps activation-sized ones (an input's and an
    output's copy per stream and dtype). Replays recorded with them keep theirs until their caches are cleared
    (:func:`tilegemm.core.replay.clear`). Scratch a CUDA-graph capture used stays held, since the graph may replay;
    ``graphs=True`` lets it go too: only once every graph captured with tilegemm's calls is gone."""
    for buf in _buffers.values():
        _retire(buf)
    for pair in _workspaces.values():
        _retire(*pair)
    _buffers.clear()
    _workspaces.clear()
    _zero_eagerly.clear()
    if graphs:
        _held_by_graphs.clear()
        _used_in_capture.clear()
