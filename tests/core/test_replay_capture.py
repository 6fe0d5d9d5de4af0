"""core.replay: a CUDA-graph capture never replays a recorded call (it takes the call's own path, which marks the
workspaces the graph uses); elsewhere a recorded call replays."""

from __future__ import annotations

import pytest
import torch

from tilegemm.core import replay


class _Hit:
    output = ((2, 3), torch.float32, torch.device("cpu"), False)

    def __init__(self):
        self.calls = 0

    def __call__(self, *tensors):
        self.calls += 1
        return True


@pytest.fixture
def cache():
    c = replay.ReplayCache("test-replay-capture")
    yield c
    del replay._CACHES["test-replay-capture"]


@pytest.mark.parametrize("stream, capturing, replays", [(1, True, False), (1, False, True), (0, True, True)],
                         ids=["capturing", "not-capturing", "default-stream"])
def test_a_capture_takes_the_call_s_own_path(cache, monkeypatch, stream, capturing, replays):
    hit = cache.entries["k"] = _Hit()
    monkeypatch.setattr(replay, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    out = cache.replayed("k", ())
    assert (out is not None) == replays and hit.calls == int(replays)
    if replays:
        assert out.shape == (2, 3)
