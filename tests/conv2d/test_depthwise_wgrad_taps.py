"""The depthwise weight gradient on ``depthwise_wgrad_taps_kernel`` (every tap a program over slices of output
rows; ``auto``'s route) and on the per-tap kernel by config, against an fp64 reference."""

import pytest
import torch

from tilegemm.ops.conv2d import depthwise
from tilegemm.ops.conv2d.configs import depthwise_wgrad_config, depthwise_wgrad_taps_config
from tilegemm.ops.conv2d.problem import geometry_of

# (N, C, H, W, R, S, stride, padding (h, w), dilation, channel multiplier)
CASES = [
    (2, 16, 9, 9, 3, 3, 1, (1, 1), 1, 1),
    (1, 24, 7, 8, 5, 5, 2, (2, 2), 1, 1),
    (2, 8, 10, 10, 3, 3, 1, (2, 2), 2, 1),
    (1, 16, 11, 6, 7, 7, 1, (3, 3), 1, 1),
    (1, 6, 5, 5, 3, 3, 1, (1, 1), 1, 2),
    (1, 16, 6, 6, 1, 7, 1, (0, 3), 1, 1),
    (1, 17, 1, 1, 3, 3, 1, (1, 1), 1, 1),
    (3, 5, 13, 4, 3, 3, 3, (0, 1), 1, 1),
]


def _layer(case, device="cpu", dtype=torch.float32):
    N, C, H, W, R, S, st, pad, dil, mult = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    x = torch.randn(N, C, H, W, generator=gen).to(device, dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C * mult, 1, R, S, generator=gen)
    g = geometry_of(x.shape, w.shape, [st, st], [pad[0], pad[0], pad[1], pad[1]], [dil, dil], C)
    dy = torch.randn(N, C * mult, g.P, g.Q, generator=gen).to(device, dtype) \
        .contiguous(memory_format=torch.channels_last)
    # (in fp64 where the tensors are: the CPU's depthwise fp64 backward of a batch-32 layer takes minutes)
    ref = torch.ops.aten.convolution_backward(dy.double(), x.double(), w.double().to(device), None, [st, st],
                                              list(pad), [dil, dil], False, [0, 0], C, [False, True, False])[1].cpu()
    return x, dy, g, ref


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [None, 1, 3])
def test_all_taps_matches_reference(case, split, device):
    x, dy, g, ref = _layer(case, device)
    cfg = depthwise_wgrad_taps_config(g, torch.float32)
    if split:
        cfg["SPLIT"] = split
    out = depthwise.wgrad(dy, x, g, torch.float32, cfg).cpu()
    assert out.shape == ref.shape and not out.isnan().any()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_auto_takes_the_walk_else_all_taps_and_per_tap_stays_by_config(device):
    x, dy, g, ref = _layer(CASES[0], device)
    assert depthwise_wgrad_config(g, torch.float32).get("WALK")  # (docs/conv2d.md, "Depthwise weight gradient")
    assert depthwise_wgrad_config(g, torch.float32, taps=True).get("ALL_TAPS")
    _, _, g_mult, _ = _layer(CASES[4])  # a channel multiplier: the walk does not take it
    assert depthwise_wgrad_config(g_mult, torch.float32).get("ALL_TAPS")
    per_tap = depthwise_wgrad_config(g, torch.float32, taps=False)
    assert not per_tap.get("ALL_TAPS") and not per_tap.get("WALK")
    for cfg in (None, per_tap):
        out = depthwise.wgrad(dy, x, g, torch.float32, cfg).cpu()
        assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(32, 96, 56, 56, 7, 7, 1, (3, 3), 1, 1), (32, 144, 28, 28, 3, 3, 2, (1, 1), 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_taps_gpu(case, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, dy, g, ref = _layer(case, "cuda", dtype)  # ref: fp64 of the rounded inputs
    out = depthwise.wgrad(dy, x, g, torch.float32, depthwise_wgrad_taps_config(g, dtype))
    assert not out.isnan().any()
    assert (out.double().cpu() - ref).norm() / ref.norm() < 1e-4
