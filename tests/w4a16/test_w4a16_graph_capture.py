"""w4a16.matmul inside a CUDA graph: the fragment layout must exist before the capture (its packing would run on
every replay, and a capture refuses its host copies), so a first call inside a capture fails clearly and a warmed
weight captures and replays right with new inputs."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_rel_close

from tilegemm import w4a16
from tilegemm.ops.w4a16.reference import reference


def _capture(fn):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return g, out


@pytest.mark.gpu
def test_a_first_call_inside_a_capture_names_the_missing_fragment_layout():
    w = w4a16.quantize(torch.randn(1536, 2176, device="cuda", dtype=torch.float16) * 0.02, 128)
    x = torch.randn(3, 2176, device="cuda", dtype=torch.float16)
    # a warm-up at a batch size auto gives to dequant_cublas (a narrow weight from 129 rows) makes no fragments
    w4a16.matmul(torch.randn(256, 2176, device="cuda", dtype=torch.float16), w)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="call w.fragments"):
        _capture(lambda: w4a16.matmul(x, w))
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 64, 1024])
def test_a_warmed_weight_captures_and_replays_with_new_inputs(M):
    w = w4a16.quantize(torch.randn(1536, 2176, device="cuda", dtype=torch.float16) * 0.02, 128)
    x = torch.randn(M, 2176, device="cuda", dtype=torch.float16)
    w.fragments()
    w4a16.matmul(x, w)  # warm: compiles, and makes any split workspace outside the capture
    torch.cuda.synchronize()
    g, out = _capture(lambda: w4a16.matmul(x, w))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, reference(x, w), 2e-3)
