"""Split workspaces (``core.workspace.split_workspace``) and CUDA graph captures: counters made during one
capture are zeroed in that graph only, so later graphs and the next eager call zero them themselves."""

from __future__ import annotations

import torch

from tilegemm.core import workspace


def test_counters_made_in_a_capture_are_zeroed_by_later_graphs_and_the_next_eager_call(monkeypatch):
    cpu = torch.device("cpu")  # the capture is simulated: the logic is the device-independent part
    workspace.release()
    capturing = [True]
    monkeypatch.setattr(workspace, "_capturing", lambda device: capturing[0])
    try:
        ws, count = workspace.split_workspace(cpu, 64, 8, tag="test")
        count.fill_(5)  # (what the memory holds eagerly: the capture's zeros run only when that graph replays)
        capturing[0] = False
        ws2, count2 = workspace.split_workspace(cpu, 64, 8, tag="test")
        assert count2 is count and not count.any(), "the first eager call after the capture zeroes the counters"
        count.fill_(3)
        capturing[0] = True  # another graph's capture: it zeroes them in its own graph
        _, count3 = workspace.split_workspace(cpu, 64, 8, tag="test")
        assert count3 is count and not count.any()
        count.fill_(4)
        capturing[0] = False  # later eager calls leave them as the kernels left them
        _, count4 = workspace.split_workspace(cpu, 64, 8, tag="test")
        assert count4 is count and (count == 4).all()
    finally:
        workspace.release()


def test_zeroed_planes_made_in_a_capture_are_zeroed_again_outside_it(monkeypatch):
    cpu = torch.device("cpu")
    workspace.release()
    capturing = [True]
    monkeypatch.setattr(workspace, "_capturing", lambda device: capturing[0])
    try:
        ws, _ = workspace.split_workspace(cpu, 64, 8, tag="test-zeroed", zeroed=True)
        ws.fill_(1.5)
        capturing[0] = False
        ws2, _ = workspace.split_workspace(cpu, 64, 8, tag="test-zeroed", zeroed=True)
        assert ws2 is ws and not ws.any()
    finally:
        workspace.release()


def test_scratch_a_capture_used_outlives_its_replacement(monkeypatch):
    # a graph keeps no reference to its kernels' scratch: a later, larger call on the capture's stream replaces
    # the stream's scratch, and the one the graph replays with must stay allocated (held by the workspace) until
    # release(graphs=True); scratch no capture used is let go as before
    import gc
    import weakref

    cpu = torch.device("cpu")
    workspace.release(graphs=True)
    capturing = [False]
    monkeypatch.setattr(workspace, "_capturing", lambda device: capturing[0])
    try:
        eager_made = workspace.buffer(cpu, torch.int32, 100, tag="test-held")  # made eagerly ...
        capturing[0] = True
        assert workspace.buffer(cpu, torch.int32, 100, tag="test-held") is eager_made  # ... used in a capture
        captured = weakref.ref(eager_made)
        planes, counters = (weakref.ref(t) for t in workspace.split_workspace(cpu, 64, 8, tag="test-held"))
        capturing[0] = False
        del eager_made
        eager = weakref.ref(workspace.buffer(cpu, torch.int32, 10, tag="test-eager"))
        bigger = workspace.buffer(cpu, torch.int32, 1 << 20, tag="test-held")  # replaces the stream's buffer
        workspace.split_workspace(cpu, 1 << 22, 1 << 14, tag="test-held")
        workspace.buffer(cpu, torch.int32, 1 << 20, tag="test-eager")
        gc.collect()
        assert bigger is not captured() and captured() is not None
        assert planes() is not None and counters() is not None
        assert eager() is None  # scratch no capture used is dropped when replaced
        held = len(workspace._held_by_graphs)
        assert held == 3
        workspace.release()  # the kept tables go; what graphs may replay into stays held
        gc.collect()
        assert captured() is not None and len(workspace._held_by_graphs) == held
        workspace.release(graphs=True)
        gc.collect()
        assert captured() is None and planes() is None and counters() is None
    finally:
        workspace.release(graphs=True)


def test_repeated_captures_hold_a_few_replacements(monkeypatch):
    # captures of ever larger calls: the scratch grows by half at least, so what stays held is a few tensors
    cpu = torch.device("cpu")
    workspace.release(graphs=True)
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    try:
        for i in range(64):
            workspace.split_workspace(cpu, (1 << 20) + i * (1 << 16), 8, tag="test-grow")
            workspace.buffer(cpu, torch.int32, (1 << 16) + i * (1 << 12), tag="test-grow")
        assert len(workspace._held_by_graphs) <= 12
    finally:
        workspace.release(graphs=True)
