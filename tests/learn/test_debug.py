"""tilegemm.learn.debug: pid conditions, conditional print/breakpoint, readiness checks, jit helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tilegemm.core import runtime
from tilegemm.learn import debug
from tilegemm.core.runtime import interpreting

interp_only = pytest.mark.skipif(not interpreting(), reason="runs Python inside a kernel: interpreter only")


def test_cdiv():
    assert [debug.cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="positive divisor"):
        debug.cdiv(3, 0)


@pytest.mark.parametrize(
    "conds,pids,want",
    [
        ("", (5, 5, 5), True),
        ("=0", (0, 9, 9), True),
        ("=0", (1, 0, 0), False),
        ("==2", (2, 0, 0), True),
        (",>1", (0, 2, 0), True),
        (",>1", (0, 1, 0), False),
        (">1,=0", (2, 0, 0), True),
        (">1,=0", (2, 1, 0), False),
        ("<=3", (3, 0, 0), True),
        ("<=3", (4, 0, 0), False),
        (">=3", (3, 0, 0), True),
        ("!=3", (3, 0, 0), False),
        ("!=3", (2, 0, 0), True),
        ("<1", (0, 0, 0), True),
        (",,>=7", (0, 0, 7), True),
        (" > 1 , = 0 ", (2, 0, 0), True),
    ],
)
def test_pid_conditions(conds, pids, want):
    assert debug.test_pid_conds(conds, [pids[0]], [pids[1]], [pids[2]]) is want


def test_pid_forms_accepted():
    for form in (3, [3], (3,), np.array([3]), torch.tensor([3])):
        assert debug.test_pid_conds("=3", pid_0=form)


@pytest.mark.parametrize("bad", ["~1", "=>1", "<x", "1", ">", "=1,=1,=1,=1"])
def test_bad_conditions_raise(bad):
    with pytest.raises(ValueError):
        debug.test_pid_conds(bad)


def test_print_if_and_breakpoint_if_outside_kernels(capsys, monkeypatch):
    debug.print_if("hello", ">0", pid_0=[1])
    debug.print_if("silent", ">0", pid_0=[0])
    assert capsys.readouterr().out == "hello\n"
    stops = []
    monkeypatch.setattr(debug.pdb.Pdb, "set_trace", lambda self, frame=None: stops.append(frame.f_code.co_name))
    debug.breakpoint_if("=1", pid_0=[1])
    debug.breakpoint_if("=1", pid_0=[0])
    assert stops == ["test_print_if_and_breakpoint_if_outside_kernels"]


@triton.jit
def _add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = debug.offsets_1d(pid, BLOCK)
    mask = debug.mask_1d(offs, n)
    debug.print_if(f"pid {pid} sees {tl.sum(mask.to(tl.int32), axis=0)} elements", ">=2", pid_0=[pid])
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


@interp_only
def test_print_if_inside_a_kernel(capsys):
    x = torch.arange(10.0)
    out = torch.empty(10)
    _add_one[(triton.cdiv(10, 4),)](x, out, 10, BLOCK=4)
    assert torch.equal(out, x + 1)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines  # only program 2 meets ">=2"
    assert lines[0].startswith("pid ") and lines[0].replace("[", "").replace("]", "") == "pid 2 sees 2 elements"


@triton.jit
def _transpose(x_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = debug.offsets_1d(tl.program_id(0), BR)
    cols = debug.offsets_1d(tl.program_id(1), BC)
    mask = debug.mask_2d(rows, cols, R, C)
    tile = tl.load(x_ptr + debug.offsets_2d(rows, cols, C, 1), mask=mask)
    tl.store(out_ptr + debug.offsets_2d(rows, cols, 1, R), tile, mask=mask)


def test_jit_offset_and_mask_helpers(device):
    x = torch.randn(37, 21, device=device)
    out = torch.full((21, 37), float("nan"), device=device)
    _transpose[(triton.cdiv(37, 16), triton.cdiv(21, 8))](x, out, 37, 21, BR=16, BC=8)
    assert torch.equal(out, x.t())


def test_check_tensors_gpu_ready(monkeypatch, device):
    debug.check_tensors_gpu_ready(torch.zeros(3, 4, device=device), torch.zeros(5, device=device))
    with pytest.raises(ValueError, match=r"tensor 1 \(shape \[4, 3\], strides \[1, 4\]\) is not contiguous"):
        debug.check_tensors_gpu_ready(torch.zeros(3, device=device), torch.zeros(3, 4, device=device).t())
    with pytest.raises(TypeError, match="argument 0 is a list"):
        debug.check_tensors_gpu_ready([1.0])
    monkeypatch.setattr(runtime, "_interpret", False)
    with pytest.raises(ValueError, match="tensor 0 is on cpu, not on a CUDA device"):
        debug.check_tensors_gpu_ready(torch.zeros(3))


def test_poison_outputs(device):
    import tilegemm

    old = runtime.set_poisoning(False)
    try:
        assert not runtime.poisoning()
        with debug.poison_outputs():
            assert torch.isnan(runtime.new_output((4,), torch.float32, device)).all()
            assert (runtime.new_output((4,), torch.int32, device) == 2**31 - 1).all()
            x = torch.randn(8, device=device)
            assert torch.equal(tilegemm.copy(x), x)
        assert not runtime.poisoning()
    finally:
        runtime.set_poisoning(old)


def test_bounds_checked_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(runtime, "_interpret", False)
    with pytest.raises(RuntimeError, match="interpreter only"):
        with debug.bounds_checked(torch.zeros(2)):
            pass


@interp_only
def test_bounds_checked_passes_masked_kernels_and_catches_stores():
    x, out = torch.arange(10.0), torch.empty(10)
    with debug.bounds_checked(x, out):
        _add_one[(3,)](x, out, 10, BLOCK=4)
    small = torch.empty(6)
    with pytest.raises(debug.OutOfBoundsError, match="store of 2 element"):
        with debug.bounds_checked(x, small):
            _add_one[(3,)](x, small, 10, BLOCK=4)


@triton.jit
def _count_all(out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr + offs, 1.0)  # no mask


@triton.jit
def _swap_first(out_ptr, BLOCK: tl.constexpr):
    tl.atomic_cas(out_ptr + tl.program_id(0) * BLOCK, 0.0, 1.0)


@interp_only
def test_bounds_checked_catches_atomics():
    out = torch.zeros(10)
    with debug.bounds_checked(out):
        _count_all[(2,)](out, BLOCK=4)
    with pytest.raises(debug.OutOfBoundsError, match="atomic of 6 element"):
        with debug.bounds_checked(out):
            _count_all[(2,)](out, BLOCK=8)
    # program 0 added its 8 in bounds; program 1's lanes were refused before any was written (8, 9 among them)
    assert torch.equal(out, torch.tensor([2.0] * 8 + [0.0] * 2))
    with pytest.raises(debug.OutOfBoundsError, match="atomic_cas of 1 element"):
        with debug.bounds_checked(out):
            _swap_first[(3,)](out, BLOCK=8)


@interp_only
@pytest.mark.parametrize("args, message", [((), "needs the tensors"), ((torch.zeros(2), 5), "argument 1 is int"),
                                           ((np.zeros(2),), "argument 0 is ndarray")])
def test_bounds_checked_names_wrong_arguments(args, message):
    with pytest.raises(TypeError, match=message):
        with debug.bounds_checked(*args):
            pass
