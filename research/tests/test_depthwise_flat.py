"""The per-row flattened depthwise forward (``research/depthwise_flat.py``, an exploration kernel) against
``F.conv2d``: odd sizes, channel counts not multiples of 8, 5x5 and non-square filters, strides, dilations,
channel multipliers, asymmetric and zero padding, bias and activation, blocks that straddle rows, NCHW
outputs, outputs poisoned with NaN. Runs under the interpreter
(``PYTHONPATH=src:research``) and on a GPU alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import depthwise_flat  # research/depthwise_flat.py: run with PYTHONPATH=src:research

CASES = [  # (N, C, H, W, R, S, stride, padding, dilation, multiplier, BLOCK, ROWS_PER, channels-last out)
    (2, 16, 9, 11, 3, 3, (1, 1), (1, 1), (1, 1), 1, 64, 4, True),
    (2, 16, 9, 11, 3, 3, (1, 1), (1, 1), (1, 1), 1, 64, 4, False),
    (1, 24, 7, 5, 3, 3, (1, 1), (1, 1), (1, 1), 1, 32, 3, True),
    (1, 12, 6, 13, 5, 5, (1, 1), (2, 2), (1, 1), 1, 128, 8, False),
    (2, 8, 10, 9, 3, 3, (1, 1), (2, 2), (2, 2), 1, 64, 5, True),
    (1, 8, 10, 9, 3, 3, (1, 1), (1, 2), (1, 2), 1, 64, 2, True),
    (1, 16, 5, 6, 3, 2, (1, 1), (0, 1), (1, 1), 1, 16, 2, True),
    (1, 40, 1, 1, 3, 3, (1, 1), (1, 1), (1, 1), 1, 64, 4, True),
    (3, 3, 4, 4, 3, 3, (1, 1), (0, 0), (1, 1), 1, 16, 1, True),
    (2, 16, 9, 11, 3, 3, (2, 2), (1, 1), (1, 1), 1, 64, 2, True),
    (1, 24, 12, 7, 5, 5, (2, 2), (2, 2), (1, 1), 1, 64, 3, False),
    (1, 8, 9, 10, 3, 3, (2, 1), (1, 1), (1, 1), 2, 32, 2, True),
    (2, 5, 7, 7, 3, 3, (1, 1), (1, 1), (1, 1), 3, 32, 4, True),
    (1, 16, 8, 8, 3, 3, (1, 2), (1, 1), (1, 1), 1, 16, 8, True),
    (1, 8, 12, 5, 3, 3, (1, 1), (3, 1), (1, 1), 1, 32, 5, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}c{}h{}w{}r{}s{}-st{}-pad{}-dil{}-m{}-b{}-rows{}-cl{}".format(*c))
def test_matches_f_conv2d(case):
    N, C, H, W, R, S, stride, pad, dil, mult, block, rows, cl = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    x = torch.randn(N, C, H, W, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C * mult, 1, R, S, generator=gen).to(device)
    b = torch.randn(C * mult, generator=gen).to(device)
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), stride, pad, dil, C))
    out = torch.full(ref.shape, float("nan"), device=device)
    if cl:
        out = out.contiguous(memory_format=torch.channels_last)
    depthwise_flat.run(x, w, b, stride, pad, dil, dict(BLOCK=block, ROWS_PER=rows, STAGES=2 if rows % 2 else 1), activation="relu",
                       out=out)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
