"""The host fast path of every op: replays of earlier plain calls, one cache per family, one API.

A family computes a call's replay key (everything Triton specializes its launches on, or None when the call may
not be replayed: a tracer, mode or autograd watching, the interpreter, a tensor subclass) and then:

    out = REPLAYS.replayed(key, tensors)         # the output, or None: nothing recorded, or it declined
    with REPLAYS.recording(key, tensors) as kept:
        out = kept(forward(call))                # the launches made in the block kept under key with out

The family launches inside the block itself, so a call's route runs downward (the family calls the shared
pipeline; the pipeline never calls back into the family).

``tensors`` are the call's tensors in a fixed order; the output is the last tensor of a replay. A replay
allocates the output as the recorded call's was (shape, dtype, device, memory format: the key fixes them) and
launches the recorded kernels with the new tensors in the recorded ones' slots (:class:`tilegemm.core.launch.
Replay`). The replay path is written for host time (a plain 16-bit ``tilegemm.matmul`` replays in about 2 us on
an H200's host, docs/performance.md): a dict lookup, one allocation, the launch.

:func:`cache` finds a family's cache by name (``cache("matmul").count()``); :func:`clear` forgets them all.
"""

from __future__ import annotations

import torch

from contextlib import contextmanager

from tilegemm.core.launch import Replay, ReplaySequence, current_stream, functorch_level, recording
from tilegemm.core.runtime import new_output

_CACHES: dict[str, "ReplayCache"] = {}
_CHANNELS_LAST = torch.channels_last


class ReplayCache:
    """Replays of one family's calls by key; bounded, cleared when full.

    ``aliases_in_key``: the family's key says which of a call's tensors share a data pointer (``x @ x.mT``), so
    calls that alias are kept too (they replay right only for calls that alias the same way)."""

    def __init__(self, name: str, aliases_in_key: bool = False, maxsize: int = 4096):
        if name in _CACHES:
            raise ValueError(f"a replay cache named {name!r} exists")
        self.name = name
        self.aliases_in_key = aliases_in_key
        self.maxsize = maxsize
        self.entries: dict = {}
        _CACHES[name] = self

    def replayed(self, key, tensors: tuple) -> torch.Tensor | None:
        """The output of a replay with ``tensors`` of the call recorded under ``key``, or None: none recorded,
        or it declined (recorded for another stream or device)."""
        hit = self.entries.get(key)
        if hit is None:
            return None
        if current_stream() and torch.cuda.is_current_stream_capturing():  # (a capture never runs on stream 0)
            # A CUDA-graph capture takes the call's own path, whose workspaces are marked as the graph's
            # (core/workspace.py) so that a larger call replacing one holds it for the graph; a replay's would not be.
            return None
        if functorch_level() is not None:  # torch.func's wrapped tensors (batched, grad-tracking) go through the op
            return None
        shape, dtype, device, channels_last = hit.output
        # channels-last in one allocation: a permuted view of an NHWC tensor costs a second torch call
        out = new_output(shape, dtype, device, _CHANNELS_LAST if channels_last else None)
        return out if hit(*tensors, out) else None

    @contextmanager
    def recording(self, key, tensors: tuple, memory_format=torch.contiguous_format):
        """A block whose launches are kept under ``key`` for :meth:`replayed`, with the output the block passes
        to the function it is given (``out = kept(out)``), when they can be replayed with ``tensors`` and an
        output allocated in ``memory_format`` (contiguous, or channels-last for 4-D). Nothing is kept when the
        block raises or passes no output."""
        outputs = []

        def kept(out: torch.Tensor) -> torch.Tensor:
            outputs.append(out)
            return out

        with recording() as rec:
            yield kept
        if outputs:
            self.store(key, rec.launches, tensors, outputs[-1], memory_format)

    def store(self, key, launches, tensors: tuple, out: torch.Tensor, memory_format=torch.contiguous_format) -> None:
        """Keep ``launches`` (one, or a few in order) under ``key``, replayable with ``tensors`` and an output like
        ``out``. Not kept: no launches, or too many; an output a replay would not allocate alike; tensors sharing
        a data pointer where the key does not say how they alias (their slots could not be told apart); a
        parameter that is no tensor of the call's nor a launcher's workspace."""
        if not launches or len(launches) > ReplaySequence.MAX_LAUNCHES:
            return
        channels_last = memory_format == torch.channels_last
        if channels_last and out.dim() != 4 or not out.is_contiguous(memory_format=memory_format):
            return
        tensors = (*tensors, out)
        if not self.aliases_in_key and len({t.data_ptr() for t in tensors}) < len(tensors):
            return
        output = (tuple(out.shape), out.dtype, out.device, channels_last)
        try:
            if len(launches) == 1:
                replay = Replay(launches[0], tensors, output)
            else:
                replay = ReplaySequence([Replay(one, tensors, output) for one in launches], output)
        except LookupError:
            return
        if len(self.entries) >= self.maxsize:
            self.entries.clear()
        self.entries[key] = replay

    def get(self, key):
        """The replay kept under ``key``, or None."""
        return self.entries.get(key)

    def clear(self) -> None:
        """Forget every recorded replay."""
        self.entries.clear()

    def count(self) -> int:
        """How many calls' launches are kept."""
        return len(self.entries)


def cache(name: str) -> ReplayCache:
    """The replay cache of the family ``name`` (``"matmul"``, ``"w4a16"``, ``"conv2d"``, ``"grouped"``, ``"guide"``)."""
    if name not in _CACHES:
        raise ValueError(f"no replay cache {name!r}; known: {', '.join(sorted(_CACHES))}")
    return _CACHES[name]


def clear() -> None:
    """Forget the recorded replays of every family."""
    for one in _CACHES.values():
        one.clear()
