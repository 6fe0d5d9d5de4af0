"""The column-reusing depthwise forward (``research/depthwise_cols.py``, an exploration kernel) against
``F.conv2d``: strides, dilations, a channel multiplier, output widths that are no multiple of the group of
columns, bias and activation. Runs under the interpreter (``PYTHONPATH=src:research``, from the repository
root, with ``tests/`` for its conftest) and on a GPU alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import depthwise_cols  # research/depthwise_cols.py: run with PYTHONPATH=src:research
from tilegemm.ops.conv2d.problem import geometry_of

CASES = [  # (N, C, H, W, R, S, stride, dilation, multiplier, COLS)
    (2, 16, 9, 11, 3, 3, (1, 1), (1, 1), 1, 4),
    (1, 32, 8, 7, 3, 3, (2, 2), (1, 1), 1, 2),
    (2, 16, 10, 9, 5, 5, (1, 1), (2, 2), 1, 4),
    (1, 16, 7, 7, 3, 3, (2, 2), (1, 1), 2, 4),
    (1, 16, 6, 13, 3, 3, (1, 1), (1, 1), 1, 8),
    (1, 16, 5, 6, 3, 2, (1, 2), (2, 1), 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}c{}h{}w{}r{}s{}-st{}-dil{}-m{}-cols{}".format(*c))
def test_matches_f_conv2d(case):
    N, C, H, W, R, S, stride, dilation, mult, cols = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pad = (dilation[0] * (R - 1) // 2, dilation[1] * (S - 1) // 2)
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    x = torch.randn(N, C, H, W, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C * mult, 1, R, S, generator=gen).to(device)
    b = torch.randn(C * mult, generator=gen).to(device)
    g = geometry_of(x.shape, w.shape, list(stride), [pad[0], pad[0], pad[1], pad[1]], list(dilation), C)
    out = depthwise_cols.run(x, w, g, dict(BLOCK_M=8, COLS=cols, BLOCK_N=16, num_warps=4), bias=b,
                             activation="relu")
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), stride, pad, dilation, C))
    assert out.shape == ref.shape and out.is_contiguous(memory_format=torch.channels_last)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
