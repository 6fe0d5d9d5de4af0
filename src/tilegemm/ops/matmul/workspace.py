"""Workspaces for kernels that reduce partial tiles inside one launch (``split_k``, ``persistent_tma``'s
stream-K configs): fp32 scratch plus arrival counters, zeroed once and left zeroed by every launch."""

from __future__ import annotations

import torch

from tilegemm.launch import current_stream

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device, floats: int, counters: int, planes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """At least ``floats`` fp32 values and ``counters`` int32 counters, per (device, stream, kind).

    Launches on one stream run in order, so they can share one workspace. Every kernel leaves the
    counters at zero. ``planes=False``: a reduction by atomic adds, which needs the floats zeroed (every
    launch leaves them so). ``planes=True``: partial tiles stored whole before they are read, which
    leaves them behind; those kernels share a workspace of their own.

    A larger call replaces a stream's workspace with a larger one; replays recorded with the old one
    keep it alive and keep using it, which is safe because every launch leaves it as it found it.
    """
    key = (device, current_stream() if device.type == "cuda" else 0, planes)
    ws, count = _workspaces.get(key, (None, None))
    if ws is None or ws.numel() < floats or count.numel() < counters:
        floats = max(floats, ws.numel() if ws is not None else 0, 1 << 20)
        counters = max(counters, count.numel() if count is not None else 0, 1 << 12)
        ws = torch.zeros(floats, dtype=torch.float32, device=device)
        count = torch.zeros(counters, dtype=torch.int32, device=device)
        _workspaces[key] = (ws, count)
    return ws, count
