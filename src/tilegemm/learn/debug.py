"""Helpers for developing kernels under Triton's interpreter.

Set ``TILEGEMM_INTERPRET=1`` (or ``TRITON_INTERPRET=1``) before anything imports triton; then a kernel
runs as plain Python on the CPU, one program at a time, and ordinary ``print`` and ``pdb`` work inside it.
These helpers make that practical:

- :func:`print_if` / :func:`breakpoint_if` act only in the programs you name (``test_pid_conds``);
- :func:`bounds_checked` catches any load or store outside the tensors you pass;
- :func:`poison_outputs` makes tilegemm's outputs start as NaN, so an unwritten element shows;
- :func:`check_tensors_gpu_ready`, :func:`cdiv`, and the ``@triton.jit`` offset/mask helpers that
  tilegemm's own kernels use (:func:`offsets_1d`, :func:`offsets_2d`, :func:`mask_1d`, :func:`mask_2d`).

See docs/debugging.md for a worked example.
"""

from __future__ import annotations

import contextlib
import operator
import pdb
import sys

import torch

from tilegemm.jit.helpers import mask_1d, mask_2d, offsets_1d, offsets_2d
from tilegemm.core.runtime import interpreting, set_poisoning

__all__ = [
    "OutOfBoundsError", "bounds_checked", "breakpoint_if", "cdiv", "check_tensors_gpu_ready", "mask_1d",
    "mask_2d", "offsets_1d", "offsets_2d", "poison_outputs", "print_if", "test_pid_conds",
]

# Two-character operators first, so "<=" is not read as "<" followed by "=1".
_OPS = {"<=": operator.le, ">=": operator.ge, "!=": operator.ne, "==": operator.eq,
        "<": operator.lt, ">": operator.gt, "=": operator.eq}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``: the number of blocks of size b covering a."""
    if b <= 0:
        raise ValueError(f"cdiv needs a positive divisor, got {b}")
    return (a + b - 1) // b


def check_tensors_gpu_ready(*tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is contiguous and (unless interpreting) on a CUDA device."""
    interp = interpreting()
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument {i} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} (shape {list(t.shape)}, strides {list(t.stride())}) is not contiguous")
        if not interp and not t.is_cuda:
            raise ValueError(f"tensor {i} is on {t.device}, not on a CUDA device")


def _pid_value(pid) -> int:
    """A program id as an int, from an int, a one-element list/tuple/array, or an interpreter tensor."""
    if isinstance(pid, (list, tuple)):
        if len(pid) != 1:
            raise ValueError(f"a program id list must hold one value, got {pid!r}")
        pid = pid[0]
    handle = getattr(pid, "handle", None)  # triton.language.tensor under the interpreter
    if handle is not None:
        pid = handle.data
    if hasattr(pid, "item"):
        return int(pid.item())
    return int(pid)


def test_pid_conds(conds: str, pid_0=(0,), pid_1=(0,), pid_2=(0,)) -> bool:
    """True when the program ids meet ``conds``: one condition per axis, comma-separated.

    Each condition is an operator (``<``, ``>``, ``<=``, ``>=``, ``=`` or ``==``, ``!=``) and an integer;
    an empty one matches anything. ``"=0"``: pid_0 is 0. ``",>1"``: pid_1 > 1. ``">1,=0"``: both.
    """
    if not isinstance(conds, str):
        raise TypeError(f"conds must be a string like '>1,=0', got {type(conds).__name__}")
    parts = conds.replace(" ", "").split(",")
    if len(parts) > 3:
        raise ValueError(f"at most 3 conditions (one per axis), got {len(parts)} in {conds!r}")
    pids = (_pid_value(pid_0), _pid_value(pid_1), _pid_value(pid_2))
    for cond, pid in zip(parts, pids):
        if not cond:
            continue
        for symbol, compare in _OPS.items():
            if cond.startswith(symbol):
                threshold = cond[len(symbol):]
                break
        else:
            raise ValueError(f"condition {cond!r} must start with one of {', '.join(_OPS)}")
        try:
            value = int(threshold)
        except ValueError:
            raise ValueError(f"condition {cond!r} must compare with an integer") from None
        if not compare(pid, value):
            return False
    return True


def print_if(txt, conds: str, pid_0=(0,), pid_1=(0,), pid_2=(0,)) -> None:
    """Print ``txt`` when the program ids meet ``conds`` (see :func:`test_pid_conds`)."""
    if test_pid_conds(conds, pid_0, pid_1, pid_2):
        print(txt)


def breakpoint_if(conds: str, pid_0=(0,), pid_1=(0,), pid_2=(0,)) -> None:
    """Stop in ``pdb`` at the caller's line when the program ids meet ``conds``."""
    if test_pid_conds(conds, pid_0, pid_1, pid_2):
        pdb.Pdb().set_trace(sys._getframe(1))


@contextlib.contextmanager
def poison_outputs():
    """Within the block, tilegemm's kernel outputs start as NaN (integers: their max) instead of garbage."""
    old = set_poisoning(True)
    try:
        yield
    finally:
        set_poisoning(old)


class OutOfBoundsError(IndexError):
    """A kernel under the interpreter loaded or stored outside every tensor it was given."""


@contextlib.contextmanager
def bounds_checked(*tensors: torch.Tensor):
    """Within the block, every unmasked lane of every interpreted load, store and atomic must address memory of
    one of ``tensors`` (CPU tensors; their whole storage counts). Otherwise OutOfBoundsError is raised,
    before the access happens, naming the operation and the first bad address.
    """
    if not interpreting():
        raise RuntimeError("bounds_checked works under Triton's interpreter only (TILEGEMM_INTERPRET=1)")
    if not tensors:
        raise TypeError("bounds_checked needs the tensors the kernel may touch: bounds_checked(x, y, out)")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bounds_checked takes torch tensors (the kernel's arguments); argument {i} is "
                            f"{type(t).__name__}")
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder

    ranges = []
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"bounds_checked needs CPU tensors, got one on {t.device}")
        storage = t.untyped_storage()
        ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    problems: list[str] = []

    def check(kind, ptrs, mask):
        elem = ptrs.get_element_ty()
        width = max(getattr(elem, "primitive_bitwidth", 8) // 8, 1)
        addrs = ptrs.data.astype(np.uint64)
        live = mask.data.astype(bool) if mask is not None else np.ones(addrs.shape, bool)
        live = np.broadcast_to(live, addrs.shape)
        ok = np.zeros(addrs.shape, bool)
        for lo, hi in ranges:
            ok |= (addrs >= lo) & (addrs + width <= hi)
        bad = live & ~ok
        if bad.any():
            first = int(addrs[bad].flat[0])
            near = min(ranges, key=lambda r: min(abs(first - r[0]), abs(first - r[1])))
            message = (f"{kind} of {int(bad.sum())} element(s) out of bounds: first at address {first:#x}, "
                       f"{first - near[0]:+d} bytes from the start of the nearest tensor "
                       f"({near[1] - near[0]} bytes long)")
            problems.append(message)
            raise OutOfBoundsError(message)

    # (unmasked loads and stores, and block pointers', go through the masked ones; atomics do not)
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    orig = {n: getattr(InterpreterBuilder, n) for n in names}

    def load(self, ptrs, mask, other, *args):
        check("load", ptrs, mask)
        return orig["create_masked_load"](self, ptrs, mask, other, *args)

    def store(self, ptrs, value, mask, *args):
        check("store", ptrs, mask)
        return orig["create_masked_store"](self, ptrs, value, mask, *args)

    def atomic_rmw(self, op, ptrs, value, mask, *args):
        check("atomic", ptrs, mask)
        return orig["create_atomic_rmw"](self, op, ptrs, value, mask, *args)

    def atomic_cas(self, ptrs, cmp, value, *args):
        check("atomic_cas", ptrs, None)
        return orig["create_atomic_cas"](self, ptrs, cmp, value, *args)

    for n, f in zip(names, (load, store, atomic_rmw, atomic_cas)):
        setattr(InterpreterBuilder, n, f)
    try:
        yield
    except Exception as err:
        if problems and not isinstance(err, OutOfBoundsError):
            raise OutOfBoundsError(problems[0]) from err
        raise
    finally:
        for n, f in orig.items():
            setattr(InterpreterBuilder, n, f)
test_pid_conds.__test__ = False  # a helper, not a pytest test
