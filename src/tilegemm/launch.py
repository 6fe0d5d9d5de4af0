"""Kernel launches, and replaying a recorded launch to cut host time on repeated calls.

Launching through ``kernel[grid](...)`` costs about 16 us of host time in Triton 3.6 (argument binding,
specialization, cache key, knobs); calling the compiled kernel directly costs about 7 us (measured on an
H200, scripts/launch_profile.py). For a small GEMM that difference is most of the call.

So every tilegemm launcher goes through :func:`launch`. While :func:`recording` is active, each launch is
remembered as (compiled kernel, grid, full parameter list). An op that sees a call whose shapes, strides,
dtypes, device and 16-byte alignment all match an earlier one (everything Triton specializes on) can then
replay it with :class:`Replay`, swapping in the new tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tilegemm.runtime import interpreting

_state = threading.local()


@dataclass
class Launch:
    compiled: Any
    grid: tuple[int, int, int]
    params: list


def launch(kernel, grid, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, remembered when a recording is active."""
    compiled = kernel[grid](*args, **kwargs)
    record = getattr(_state, "launches", None)
    if record is not None:
        if compiled is None or interpreting() or getattr(_state, "spoiled", False):
            _state.spoiled = True
        else:
            g = tuple(grid(kwargs) if callable(grid) else grid)
            g = g + (1,) * (3 - len(g))
            names = kernel.arg_names
            params = list(args) + [kwargs[name] for name in names[len(args):]]
            record.append(Launch(compiled, g, params))
    return compiled


def not_replayable() -> None:
    """Called by a launcher whose launches must not be replayed (e.g. they use a growable workspace)."""
    if getattr(_state, "launches", None) is not None:
        _state.spoiled = True


class recording:
    """Context manager collecting the launches made inside it; ``.launches`` is None if any was unusable."""

    def __enter__(self):
        self._outer = getattr(_state, "launches", None), getattr(_state, "spoiled", False)
        _state.launches, _state.spoiled = [], False
        return self

    def __exit__(self, *exc):
        launches, spoiled = _state.launches, _state.spoiled
        _state.launches, _state.spoiled = self._outer
        self.launches = None if (spoiled or exc[0] is not None) else launches
        return False


class Replay:
    """One recorded launch, replayable with new tensors in the same parameter slots."""

    __slots__ = ("runner", "params", "slots", "shape")

    def __init__(self, launch_: Launch, tensors: tuple, shape=None):
        self.shape = shape  # the output shape, for ops that allocate it
        self.runner = launch_.compiled[launch_.grid]
        self.params = list(launch_.params)
        # A launcher may pass a view of a call's tensor (same data pointer): the compiled kernel only
        # reads the pointer, so the call's tensor can stand in for it.
        ptrs = [t.data_ptr() for t in tensors]
        self.slots = []  # (param index, position in ``tensors``)
        for i, value in enumerate(self.params):
            if hasattr(value, "data_ptr"):
                ptr = value.data_ptr()
                if ptr not in ptrs:
                    raise LookupError("a tensor parameter is not one of the call's tensors")
                self.slots.append((i, ptrs.index(ptr)))

    def __call__(self, *tensors) -> None:
        params = self.params.copy()
        for i, j in self.slots:
            params[i] = tensors[j]
        self.runner(*params)


class ReplayCache:
    """Replays keyed by everything Triton specializes on; bounded, cleared when full."""

    def __init__(self, maxsize: int = 4096):
        self.maxsize = maxsize
        self.entries: dict = {}

    def get(self, key):
        return self.entries.get(key)

    def store(self, key, launches, tensors, shape=None) -> None:
        if launches is None or len(launches) != 1:
            return
        if len({t.data_ptr() for t in tensors}) < len(tensors):
            return  # aliased tensors: their slots could not be told apart on replay
        try:
            replay = Replay(launches[0], tensors, shape)
        except LookupError:
            return
        if len(self.entries) >= self.maxsize:
            self.entries.clear()
        self.entries[key] = replay

    def clear(self) -> None:
        self.entries.clear()
