"""core.checked.check_once: an op body's argument checks run once per layout of GPU arguments, every time otherwise."""

from __future__ import annotations

import pytest
import torch

from tilegemm.core import checked


@pytest.fixture(autouse=True)
def fresh():
    checked.forget()
    yield
    checked.forget()


def counting():
    calls = []

    def check(*args):
        calls.append(args)
        if args and args[0] == "bad":
            raise ValueError("bad argument")

    return check, calls


def test_a_layout_that_passed_is_not_checked_again():
    check, calls = counting()
    checked.check_once(check, 3, "silu", None)
    checked.check_once(check, 3, "silu", None)
    assert len(calls) == 1
    checked.check_once(check, 4, "silu", None)  # another layout
    assert len(calls) == 2


def test_a_refused_layout_is_refused_every_time():
    check, calls = counting()
    for _ in range(2):
        with pytest.raises(ValueError, match="bad argument"):
            checked.check_once(check, "bad")
    assert len(calls) == 2


def test_cpu_tensors_and_unhashable_arguments_are_checked_every_time():
    check, calls = counting()
    t = torch.zeros(3)
    checked.check_once(check, t)
    checked.check_once(check, t)  # a CPU tensor's values may be checked (a permutation, offsets)
    checked.check_once(check, [1, 2])
    checked.check_once(check, [1, 2])
    assert len(calls) == 4


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(checked, "MAX_LAYOUTS", 3)
    check, _ = counting()
    for i in range(10):
        checked.check_once(check, i)
    assert len(checked._PASSED) <= 3


@pytest.mark.gpu
def test_gpu_layouts_are_remembered_by_shape_stride_dtype_and_device():
    check, calls = counting()
    a = torch.zeros(4, 8, device="cuda")
    checked.check_once(check, a)
    checked.check_once(check, torch.ones(4, 8, device="cuda"))  # same layout, other values
    assert len(calls) == 1
    checked.check_once(check, a.t())  # other strides
    checked.check_once(check, a.half())  # other dtype
    checked.check_once(check, torch.zeros(4, 9, device="cuda"))  # other shape
    assert len(calls) == 4
