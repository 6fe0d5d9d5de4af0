"""Puzzles 10-12: exact signatures, harness-style launches, every size, no out-of-bounds access."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tilegemm.learn import puzzles
from tilegemm.cli import main
from tilegemm.learn.debug import OutOfBoundsError, bounds_checked
from tilegemm.core.runtime import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the puzzles' harness runs under the interpreter")


@pytest.mark.parametrize("puzzle", puzzles.PUZZLES)
@pytest.mark.parametrize("seed", range(6))
def test_random_sizes(puzzle, seed):
    ok, detail = puzzles.check_puzzle(puzzle, seed=seed)
    assert ok, detail


@pytest.mark.parametrize("seed", range(3))
def test_quant_dot_with_int32_tensors(seed):
    ok, detail = puzzles.check_puzzle("quant_dot", seed=seed, int_dtype=torch.int32)
    assert ok, detail


def _launch(kernel, tensors, z, B, nelem, grid):
    with bounds_checked(*tensors, z):
        kernel[grid](*tensors, z, **B, **nelem)


@pytest.mark.parametrize("KH,KW", [(4, 4), (3, 5), (1, 1), (7, 2)])
@pytest.mark.parametrize("B0", [1, 2, 8])
def test_conv2d_original_and_odd_kernels(KH, KW, B0):
    N0, H, W = 4, 8, 8  # the course's sizes
    x, k = torch.randn(N0, H, W), torch.randn(KH, KW)
    z = torch.full((N0, H, W), float("nan"))
    _launch(puzzles.conv2d_kernel, [x, k], z, dict(B0=B0), dict(N0=N0, H=H, W=W, KH=KH, KW=KW),
            (triton.cdiv(N0, B0), 1, 1))
    torch.testing.assert_close(z, puzzles.conv2d_spec(x, k), rtol=1e-5, atol=1e-5)


def test_conv2d_spec_by_hand():
    x = torch.arange(9.0).reshape(1, 3, 3)
    k = torch.tensor([[1.0, 10.0]])
    # z[0, i, j] = x[i, j] + 10 * x[i, j + 1], with x[i, 3] = 0
    want = torch.tensor([[[10.0, 21.0, 2.0], [43.0, 54.0, 5.0], [76.0, 87.0, 8.0]]])
    torch.testing.assert_close(puzzles.conv2d_spec(x, k), want)


@pytest.mark.parametrize(
    "blocks,sizes",
    [((16, 16, 1, 16), (19, 23, 5, 37)), ((4, 8, 2, 2), (9, 13, 3, 7)), ((32, 1, 4, 64), (19, 5, 5, 37)),
     ((1, 1, 1, 1), (3, 2, 2, 5))],
)
def test_dot_any_blocks(blocks, sizes):
    B0, B1, B2, BM = blocks
    N0, N1, N2, MID = sizes
    x, y = torch.randn(N2, N0, MID), torch.randn(N2, MID, N1)
    z = torch.full((N2, N0, N1), float("nan"))
    grid = (triton.cdiv(N0, B0), triton.cdiv(N1, B1), triton.cdiv(N2, B2))
    _launch(puzzles.dot_kernel, [x, y], z, dict(B0=B0, B1=B1, B2=B2, B_MID=BM), dict(N0=N0, N1=N1, N2=N2, MID=MID), grid)
    torch.testing.assert_close(z, x @ y, rtol=1e-4, atol=1e-4)


def test_quant_dot_spec_by_hand():
    # One row, one group: weight nibbles 0..7, zero point 3 for group 0, scale 2.
    weight = torch.tensor([[0x76543210]], dtype=torch.int64)
    offset = torch.tensor([0x3], dtype=torch.int64)
    scale = torch.tensor([[2.0]])
    act = torch.eye(8)
    want = 2.0 * (torch.arange(8.0) - 3.0)
    torch.testing.assert_close(puzzles.quant_dot_spec(scale, offset, weight, act)[0], want)


@pytest.mark.parametrize("B_MID", [8, 16, 64])
def test_quant_dot_original_sizes(B_MID):
    N0, N1, MID = 32, 32, 64  # the course's sizes
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(N0, MID // 8, generator=gen)
    offset = torch.randint(-(2**31), 2**31 - 1, (N0,), generator=gen)
    weight = torch.randint(-(2**31), 2**31 - 1, (N0, MID // 8), generator=gen)
    act = torch.randn(MID, N1, generator=gen)
    z = torch.full((N0, N1), float("nan"))
    grid = (triton.cdiv(N0, 16), triton.cdiv(N1, 16), 1)
    _launch(puzzles.quant_dot_kernel, [scale, offset, weight, act], z, dict(B0=16, B1=16, B_MID=B_MID),
            dict(N0=N0, N1=N1, MID=MID), grid)
    torch.testing.assert_close(z, puzzles.quant_dot_spec(scale, offset, weight, act), rtol=1e-4, atol=1e-3)


@triton.jit
def _unmasked_copy(x_ptr, z_ptr, N0, B0: tl.constexpr):
    offs = tl.program_id(0) * B0 + tl.arange(0, B0)
    tl.store(z_ptr + offs, tl.load(x_ptr + offs))  # forgot the mask


def test_bounds_checker_catches_an_unmasked_kernel():
    x, z = torch.randn(10), torch.zeros(10)
    with pytest.raises(OutOfBoundsError, match="load of 6 element"):
        with bounds_checked(x, z):
            _unmasked_copy[(1,)](x, z, 10, B0=16)
    assert torch.equal(z, torch.zeros(10)), "nothing may be stored once an access is out of bounds"


def test_puzzles_command(capsys):
    assert main(["puzzles", "--trials", "1"]) == 0
    assert "3 passed, 0 failed" in capsys.readouterr().out


@triton.jit
def _dot_writing_x(x_ptr, y_ptr, z_ptr, N0, N1, N2, MID, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                   B_MID: tl.constexpr):
    # a wrong kernel: zeroes x (inside its bounds) and writes z = 0, which x @ y then equals
    for n in range(N2):
        for i in range(N0):
            offs = tl.arange(0, 64)
            tl.store(x_ptr + (n * N0 + i) * MID + offs, tl.zeros((64,), tl.float32), mask=offs < MID)
    rows = tl.program_id(0) * B0 + tl.arange(0, B0)
    cols = tl.program_id(1) * B1 + tl.arange(0, B1)
    b = tl.program_id(2)
    tl.store(z_ptr + b * N0 * N1 + rows[:, None] * N1 + cols[None, :], tl.zeros((B0, B1), tl.float32),
             mask=(rows[:, None] < N0) & (cols[None, :] < N1))


def test_a_kernel_that_writes_its_inputs_fails(monkeypatch):
    monkeypatch.setattr(puzzles, "dot_kernel", _dot_writing_x)
    ok, detail = puzzles.check_puzzle("dot", seed=0)
    assert not ok and "wrote its input x" in detail, detail


@triton.jit
def _z_tile(z_ptr, N0, N1, B0: tl.constexpr, B1: tl.constexpr):
    """This program's [B0, B1] tile of the dot puzzle's z: its pointers and mask."""
    rows = tl.program_id(0) * B0 + tl.arange(0, B0)
    cols = tl.program_id(1) * B1 + tl.arange(0, B1)
    return z_ptr + tl.program_id(2) * N0 * N1 + rows[:, None] * N1 + cols[None, :], \
        (rows[:, None] < N0) & (cols[None, :] < N1)


@triton.jit
def _dot_writing_nan(x_ptr, y_ptr, z_ptr, N0, N1, N2, MID, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                     B_MID: tl.constexpr):
    # a wrong kernel that writes every element, as 0 / 0
    zp, ok = _z_tile(z_ptr, N0, N1, B0, B1)
    zero = tl.zeros((B0, B1), tl.float32)
    tl.store(zp, zero / zero, mask=ok)


@triton.jit
def _dot_writing_none(x_ptr, y_ptr, z_ptr, N0, N1, N2, MID, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                      B_MID: tl.constexpr):
    pass


@triton.jit
def _dot_adding_to_z(x_ptr, y_ptr, z_ptr, N0, N1, N2, MID, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                     B_MID: tl.constexpr):
    # a wrong kernel: right products, added to what z held (the poison) rather than to zero
    zp, ok = _z_tile(z_ptr, N0, N1, B0, B1)
    rows = tl.program_id(0) * B0 + tl.arange(0, B0)
    cols = tl.program_id(1) * B1 + tl.arange(0, B1)
    b = tl.program_id(2)
    acc = tl.load(zp, mask=ok)
    for k0 in range(0, MID, B_MID):
        ks = k0 + tl.arange(0, B_MID)
        xv = tl.load(x_ptr + b * N0 * MID + rows[:, None] * MID + ks[None, :],
                     mask=(rows[:, None] < N0) & (ks[None, :] < MID), other=0.0)
        yv = tl.load(y_ptr + b * MID * N1 + ks[:, None] * N1 + cols[None, :],
                     mask=(ks[:, None] < MID) & (cols[None, :] < N1), other=0.0)
        acc += tl.sum(xv[:, :, None] * yv[None, :, :], axis=1)
    tl.store(zp, acc, mask=ok)


def test_nans_written_are_told_from_elements_never_written(monkeypatch):
    # NaN is the poison: a kernel that writes NaN is not said to have written nothing
    monkeypatch.setattr(puzzles, "dot_kernel", _dot_writing_nan)
    ok, detail = puzzles.check_puzzle("dot", seed=0)
    assert not ok and "the kernel wrote NaN into" in detail and "never written" not in detail, detail
    monkeypatch.setattr(puzzles, "dot_kernel", _dot_writing_none)
    ok, detail = puzzles.check_puzzle("dot", seed=0)
    assert not ok and "output element(s) never written" in detail, detail
    monkeypatch.setattr(puzzles, "dot_kernel", _dot_adding_to_z)
    ok, detail = puzzles.check_puzzle("dot", seed=0)
    assert not ok and "the kernel reads z before writing it" in detail, detail


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="int_dtype must be torch.int32 or torch.int64 .*, got 'int32'"):
        puzzles.check_puzzle("quant_dot", int_dtype="int32")
    with pytest.raises(TypeError, match="int_dtype must be"):
        puzzles.check_puzzle("quant_dot", int_dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown puzzle 'nope'"):
        puzzles.grid_for("nope", {}, {})
    for trials in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="trials must be a whole number"):
            puzzles.run_all(trials=trials)
    with pytest.raises(ValueError, match=r"x of \[N0, H, W\] and k of \[KH, KW\], got x \[4, 4\]"):
        puzzles.conv2d_spec(torch.zeros(4, 4), torch.zeros(3, 3))


def test_ctrl_c_prints_the_trials_done(monkeypatch, capsys):
    calls = []

    def check(puzzle, seed=0):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(puzzle)
        return True, "sizes"

    monkeypatch.setattr(puzzles, "check_puzzle", check)
    assert puzzles.run_all(trials=3) == 130
    assert "interrupted after 2 of 9 trials: 2 passed, 0 failed" in capsys.readouterr().out
