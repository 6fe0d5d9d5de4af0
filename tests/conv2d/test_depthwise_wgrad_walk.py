"""The depthwise weight gradient on ``depthwise_wgrad_walk_kernel`` (every tap its own accumulator, each filter
row's input columns kept in registers while a program walks an output row), against an fp64 reference."""

import pytest
import torch

from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d import depthwise
from tilegemm.ops.conv2d.configs import DEPTHWISE_WGRAD_WALK_ROW_TAPS, depthwise_wgrad_walk_config, walk_takes
from tilegemm.ops.conv2d.problem import geometry_of

# (N, C, H, W, R, S, stride (h, w), padding (top, bottom, left, right), dilation (h, w))
CASES = [
    (2, 16, 9, 9, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
    (1, 24, 7, 8, 5, 5, (2, 2), (2, 2, 2, 2), (1, 1)),
    (2, 8, 10, 10, 3, 3, (1, 1), (2, 2, 1, 1), (2, 1)),  # dilated rows
    (1, 16, 11, 6, 7, 7, (1, 1), (3, 3, 3, 3), (1, 1)),
    (1, 16, 6, 6, 1, 7, (1, 1), (0, 0, 3, 3), (1, 1)),
    (1, 16, 6, 9, 7, 1, (1, 1), (3, 3, 0, 0), (1, 1)),
    (1, 17, 1, 1, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)),  # one pixel, odd channels
    (3, 5, 13, 4, 3, 3, (3, 3), (0, 0, 1, 1), (1, 1)),  # stride 3, more kept columns than none
    (2, 12, 9, 11, 3, 3, (2, 1), (0, 2, 1, 0), (1, 1)),  # uneven padding, strides differ
    (2, 8, 8, 8, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)),  # one tap: nothing kept
    (1, 8, 9, 17, 2, 2, (4, 4), (0, 0, 0, 0), (1, 1)),  # stride past the filter: columns skipped
    (1, 40, 5, 7, 3, 5, (1, 2), (1, 1, 2, 2), (1, 1)),
]


def _layer(case, device="cpu", dtype=torch.float32):
    N, C, H, W, R, S, st, pad, dil = case
    gen = torch.Generator().manual_seed(sum(map(hash, map(str, case))) % 2**31)
    x = torch.randn(N, C, H, W, generator=gen).to(device, dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C, 1, R, S, generator=gen)
    g = geometry_of(x.shape, w.shape, list(st), list(pad), list(dil), C)
    dy = torch.randn(N, C, g.P, g.Q, generator=gen).to(device, dtype).contiguous(memory_format=torch.channels_last)
    # (in fp64 where the tensors are: the CPU's depthwise fp64 backward of a batch-32 layer takes minutes)
    xp = torch.nn.functional.pad(x.double(), (pad[2], pad[3], pad[0], pad[1]))
    ref = torch.ops.aten.convolution_backward(dy.double(), xp, w.double().to(device), None, list(st), [0, 0],
                                              list(dil), False, [0, 0], C, [False, True, False])[1].cpu()
    return x, dy, g, ref


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [None, 1, 3])
def test_walk_matches_reference(case, split, device):
    x, dy, g, ref = _layer(case, device)
    cfg = depthwise_wgrad_walk_config(g, torch.float32)
    if split:
        cfg["SPLIT"] = split
    out = depthwise.wgrad(dy, x, g, torch.float32, cfg).cpu()
    assert out.shape == ref.shape and not out.isnan().any()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 3, "all"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3], CASES[5], CASES[8]])
def test_walk_in_groups_of_filter_rows(case, rows, device):
    # ROWS filter rows a program: the last group of 7 in 2s or 3s is part empty (its taps masked off the output)
    x, dy, g, ref = _layer(case, device)
    rows = g.R if rows == "all" else min(rows, g.R)
    out = depthwise.wgrad(dy, x, g, torch.float32,
                          dict(depthwise_wgrad_walk_config(g, torch.float32, rows), SPLIT=2)).cpu()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("cols", [2, 3, 5, 64])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3], CASES[7], CASES[10], CASES[11]])
def test_walk_in_runs_of_output_columns(case, cols, device):
    # COLS runs of the output columns, each its own program summed with the row slices' partial sums: each run
    # starts its kept columns at its own first column (strides 2-4, 7-wide filters, runs past Q left out)
    x, dy, g, ref = _layer(case, device)
    for split in (None, 2):
        cfg = dict(depthwise_wgrad_walk_config(g, torch.float32), COLS=cols)
        if split:
            cfg["SPLIT"] = split
        out = depthwise.wgrad(dy, x, g, torch.float32, cfg).cpu()
        assert not out.isnan().any() and (out.double() - ref).norm() / ref.norm() < 1e-5, split


@pytest.mark.parametrize("cols", [0, 1.5])
def test_walk_refuses_a_run_count_that_is_no_positive_int(cols, device):
    x, dy, g, _ = _layer(CASES[0], device)
    with pytest.raises(ValueError, match="COLS .* must be an int >= 1"):
        depthwise.wgrad(dy, x, g, torch.float32, dict(depthwise_wgrad_walk_config(g, torch.float32), COLS=cols))


@pytest.mark.parametrize("rows", [0, 4])
def test_walk_refuses_more_filter_rows_than_the_filter_has(rows, device):
    x, dy, g, _ = _layer(CASES[0], device)
    with pytest.raises(ValueError, match="ROWS .* must be 1 to R=3, got " + str(rows)):
        depthwise.wgrad(dy, x, g, torch.float32, depthwise_wgrad_walk_config(g, torch.float32, rows))


def test_a_stride_one_filter_row_a_program_takes_two_channels_a_thread_and_twice_the_programs(monkeypatch):
    # the GPU's rule (not the interpreter's small tile): at stride 1 a 5x5 or 7x7 layer walking a filter row a
    # program takes 2 channels a thread and 8 programs an SM; at stride 2, and where all rows walk, 4 and 4
    from tilegemm.ops.conv2d import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)

    def rule(R, stride, rows=None):
        g = geometry_of((32, 336, 48, 48), (336, 1, R, R), [stride] * 2, [R // 2] * 4, [1, 1], 336)
        cfg = depthwise_wgrad_walk_config(g, torch.float16, rows)
        return cfg["ROWS"], cfg["BLOCK_P"] * cfg["BLOCK_N"] // 128, cfg["PER_SM"]

    assert rule(5, 1) == (1, 2, 8) and rule(7, 1) == (1, 2, 8)
    assert rule(5, 2) == (1, 4, 4) and rule(3, 1) == (3, 4, 4)
    assert rule(3, 1, rows=1) == (1, 2, 8)


@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3], CASES[6], CASES[7]])
def test_walk_with_the_gpu_tiles(case, ahead, monkeypatch, device):
    # the tiles the GPU takes (VEC channels a thread, BLOCK_P rows of up to 128), not the interpreter's small one
    from tilegemm.ops.conv2d import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    x, dy, g, ref = _layer(case, device)
    cfg = depthwise_wgrad_walk_config(g, torch.float16)
    assert cfg["BLOCK_P"] * cfg["BLOCK_N"] >= 128
    cfg.update(PER_SM=1, AHEAD=ahead)  # (loads issued that many columns ahead: past Q, masked)
    out = depthwise.wgrad(dy, x, g, torch.float32, cfg).cpu()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
    if g.R > 1:  # a filter row a program: VEC from one row's taps
        cfg = dict(depthwise_wgrad_walk_config(g, torch.float16, 1), PER_SM=1, AHEAD=ahead)
        out = depthwise.wgrad(dy, x, g, torch.float32, cfg).cpu()
        assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_walk_of_an_empty_batch_is_zero(device):
    x = torch.randn(0, 8, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    g = geometry_of(x.shape, (8, 1, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 8)
    dy = torch.randn(0, 8, 5, 5, device=device).contiguous(memory_format=torch.channels_last)
    out = depthwise.wgrad(dy, x, g, torch.float32, depthwise_wgrad_walk_config(g, torch.float32))
    assert out.shape == (8, 1, 3, 3) and not out.any()


def test_walk_reads_views_of_its_inputs(device):
    # x a channel slice of a wider tensor and dy a crop: strides that are not the tensors' own sizes
    N, C, H, W = 2, 16, 9, 10
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(N, C + 8, H, W, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    x = big[:, 4:4 + C]
    w = torch.randn(C, 1, 3, 3, generator=gen)
    g = geometry_of(x.shape, w.shape, [1, 1], [1, 1, 1, 1], [1, 1], C)
    dy_big = torch.randn(N, C, H + 3, W + 2, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    dy = dy_big[:, :, 1:1 + H, 2:2 + W]
    ref = torch.ops.aten.convolution_backward(dy.double(), x.double(), w.double().to(device), None, [1, 1], [1, 1],
                                              [1, 1], False, [0, 0], C, [False, True, False])[1]
    out = depthwise.wgrad(dy, x, g, torch.float32, depthwise_wgrad_walk_config(g, torch.float32))
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("what", ["dilated columns", "channel multiplier", "stride 5"])
def test_walk_refuses_what_it_does_not_take(what):
    x = torch.randn(1, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    K, st, dil = 8, [1, 1], [1, 1]
    if what == "dilated columns":
        dil = [1, 2]
    elif what == "channel multiplier":
        K = 16
    else:
        st = [1, 5]
    w = torch.randn(K, 1, 3, 3)
    g = geometry_of(x.shape, w.shape, st, [1, 1, 1, 1], dil, 8)
    dy = torch.randn(1, K, g.P, g.Q).contiguous(memory_format=torch.channels_last)
    assert not walk_takes(g)
    with pytest.raises(NotApplicable, match="walking depthwise weight gradient"):
        depthwise.wgrad(dy, x, g, torch.float32, depthwise_wgrad_walk_config(g, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(32, 96, 56, 56, 7, 7, (1, 1), (3, 3, 3, 3), (1, 1)),
                                          (32, 144, 28, 28, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1)),
                                          (32, 240, 28, 28, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_walk_gpu(case, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, dy, g, ref = _layer(case, "cuda", dtype)  # ref: fp64 of the rounded inputs
    out = depthwise.wgrad(dy, x, g, torch.float32, depthwise_wgrad_walk_config(g, dtype))
    assert not out.isnan().any()
    assert (out.double().cpu() - ref).norm() / ref.norm() < 1e-4


def test_walk_compiles_to_one_fma_a_tap_and_channel_with_no_shared_memory_in_its_loop(tmp_path):
    # compiled offline for sm_90: the loop over output columns holds R*S*VEC fp32 FMAs (no taps padded to a power
    # of two), loads the channels VEC at a time, touches no shared memory (the accumulators and kept columns stay in
    # registers: a layout change in the loop would go through shared memory), and nothing spills
    from pathlib import Path

    from conftest import SM90, compile_offline

    script = SM90 + (Path(__file__).parent / "_depthwise_wgrad_walk_regs.py").read_text()
    got = compile_offline(tmp_path, script, [[144, 56, 3, 3, 1], [144, 56, 3, 3, 2], [240, 28, 5, 5, 1],
                                             [96, 56, 7, 7, 1], [64, 32, 1, 7, 1], [96, 56, 7, 7, 1, 7],
                                             [240, 28, 5, 5, 1, 2], [240, 28, 5, 5, 2],
                                             # runs of output columns (walk_column_runs' programs)
                                             [144, 56, 3, 3, 1, None, 4], [240, 28, 5, 5, 1, None, 2]])
    assert len(got) == 10
    for name, info in got.items():
        R, S = map(int, name.split("-")[2].split("x"))
        rows = int(name.split("-r")[1].split("-")[0]) if "-r" in name else \
            1 if R * S > DEPTHWISE_WGRAD_WALK_ROW_TAPS else R
        assert info["spill"] == 0, (name, info)
        assert info["fma"] == rows * S * info["vec"], (name, info)
        assert info["shared"] == 0, (name, info)
        width = {4: "v2.b32", 2: "b32", 1: "b16"}[info["vec"]]
        assert info["loads"] and all(op.endswith(width) for op in info["loads"]), (name, info)
    # a row a program (at stride 1 two channels a thread, at stride 2 four), or all rows in one (one channel)
    assert got["96-56x56-7x7-s1"]["vec"] == 2 and got["96-56x56-7x7-s1-r7"]["vec"] == 1
    assert got["240-28x28-5x5-s2"]["vec"] == 4


def test_the_column_runs_rule():
    # runs of output columns only where the row slices leave SMs without programs, at least 14 columns a run, at
    # most 8 runs
    from tilegemm.ops.conv2d.configs import walk_column_runs

    def g(Q):
        return geometry_of((32, 16, 4, Q), (16, 1, 1, 1), [1, 1], [0] * 4, [1, 1], 16)

    assert walk_column_runs(g(144), 144, 4 * 132) == 4  # 16 channels at 144x144: one channel block, 144 slices
    assert walk_column_runs(g(28), 44, 528) == 2 and walk_column_runs(g(27), 44, 528) == 1
    assert walk_column_runs(g(7), 10, 528) == 1 and walk_column_runs(g(300), 1, 528) == 8
    assert walk_column_runs(g(144), 600, 528) == 1 and walk_column_runs(g(144), 0, 528) == 8


@pytest.mark.skipif(not interpreting(), reason="the interpreter's tiles and its 4 SMs decide the runs (CPU tensors)")
@pytest.mark.parametrize("case, runs", [
    ((1, 16, 4, 30, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)), 2),  # one block, one row slice: Q // 14 = 2 bounds it
    # the interpreter's 4 row tiles of 4 rows: 4 programs of 16 wanted (4 SMs), 4 runs within Q // 14 = 8
    ((1, 16, 16, 120, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)), 4),
])
def test_the_walk_takes_its_column_runs_by_the_rule(case, runs, monkeypatch):
    # the rule's runs (no COLS in the config), checked against the reference like the runs a config names; a
    # config that gives SPLIT keeps one run
    x, dy, g, ref = _layer(case)
    cfg = depthwise_wgrad_walk_config(g, torch.float32)
    assert "COLS" not in cfg
    launched, launch = [], depthwise.launch
    monkeypatch.setattr(depthwise, "launch", lambda kernel, grid, args, flags, **kw: (
        launched.append(flags["COLS"]), launch(kernel, grid, args, flags, **kw))[1])
    out = depthwise.wgrad(dy, x, g, torch.float32, cfg)
    assert launched == [runs]
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
    out = depthwise.wgrad(dy, x, g, torch.float32, dict(cfg, SPLIT=2))
    assert launched == [runs, 1]
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
