"""What a recorded launch keeps: every parameter, named ones defaulted from the kernel's signature."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

import tilegemm
from tilegemm.core.launch import _all_params
from tilegemm.core.runtime import interpreting


@triton.jit
def _kernel(x_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr = "plain", FLAG: tl.constexpr = False):
    pass


def test_named_parameters_left_out_take_the_kernels_defaults():
    assert _all_params(_kernel, ("x", 7), dict(BLOCK=64)) == ["x", 7, 64, "plain", False]
    assert _all_params(_kernel, ("x", 7), dict(BLOCK=64, FLAG=True)) == ["x", 7, 64, "plain", True]


def test_a_parameter_with_neither_value_nor_default_cannot_be_recorded():
    assert _all_params(_kernel, ("x", 7), {}) is None


def test_parameters_are_plain_tensors_outside_autograd():
    """A module's weights are nn.Parameters: outside autograd their calls take the fast paths like tensors."""
    import torch

    from tilegemm.core.launch import plain_call, plain_tensor

    w = torch.nn.Parameter(torch.randn(3, 3))
    t = torch.randn(3)

    class Sub(torch.Tensor):
        pass

    assert plain_tensor(w) and plain_tensor(t) and not plain_tensor(None)
    assert not plain_tensor(t.as_subclass(Sub))
    with torch.no_grad():
        assert plain_call(t, w, None)
    assert not plain_call(t, w)  # grad enabled and w requires it: autograd must see the op
    assert plain_call(t, w.detach())


def test_spoil_and_keeping_act_only_inside_their_contexts():
    """spoil() marks the active recording (and the one around it) unusable and does nothing outside one;
    keeping's tensors are the launches' own only inside it, and are dropped on the way out."""
    from tilegemm.core import launch as L

    L.spoil()  # no recording: nothing to mark
    with L.recording() as outer:
        with L.recording() as inner:
            L.spoil()
        assert inner.launches is None
    assert outer.launches is None, "a spoiled inner recording spoils the outer one"
    with L.recording() as clean:
        pass
    assert clean.launches == []
    marker = object()
    with L.keeping(marker):
        with L.keeping("second"):
            assert L._state.keeping == (marker, "second")
        assert L._state.keeping == (marker,)
    assert L._state.keeping == ()


class _FakeCompiled:
    run = function = packed_metadata = None

    def __getitem__(self, grid):
        return lambda *args, **kw: None


def test_a_view_inside_a_call_tensor_is_recorded_as_an_offset_from_its_start():
    from tilegemm.core.launch import Launch, Replay

    x, out = torch.randn(8, 6), torch.empty(4, 10, 6)
    assert x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    phase = out[:, 1::2, :]  # a strided view starting 24 bytes in, as a convolution's stride phase
    with pytest.raises(LookupError):  # a launch made outside into_views
        Replay(Launch(_FakeCompiled(), (1, 1, 1), [x, phase, 3]), (x, out))
    replay = Replay(Launch(_FakeCompiled(), (1, 1, 1), [x, phase, 3], views=True), (x, out))
    assert replay.slots == [(0, 0, None)]
    assert replay.offsets == [(1, 1, 6 * 4)]
    assert replay.params == [None, None, 3], "the recording call's tensors are not kept alive"
    last = out[3, 9]  # the last element still lies inside
    last_view = Replay(Launch(_FakeCompiled(), (1, 1, 1), [last], views=True), (out,))
    assert last_view.offsets == [(0, 0, (3 * 60 + 54) * 4)]


def test_addresses_outside_the_call_tensors_or_past_an_unaligned_start_are_not_recorded():
    from tilegemm.core.launch import Launch, Replay

    out = torch.empty(64)
    with pytest.raises(LookupError):
        Replay(Launch(_FakeCompiled(), (1, 1, 1), [torch.empty(4)], views=True), (out,))
    unaligned = out[1:]  # a call tensor starting 4 bytes past 16: the key holds no finer alignment
    with pytest.raises(LookupError):
        Replay(Launch(_FakeCompiled(), (1, 1, 1), [unaligned[2:]], views=True), (unaligned,))
    assert Replay(Launch(_FakeCompiled(), (1, 1, 1), [unaligned], views=True), (unaligned,)).slots == [(0, 0, None)]


def test_into_views_marks_the_launches_made_inside_it():
    from tilegemm.core import launch as launch_mod

    assert not launch_mod._state.views
    with launch_mod.into_views():
        assert launch_mod._state.views
        with launch_mod.into_views():
            pass
        assert launch_mod._state.views
    assert not launch_mod._state.views


@pytest.mark.skipif(not interpreting(), reason="Triton's interpreter: not thread-safe by itself")
def test_threads_launching_under_the_interpreter_take_turns():
    # the interpreter patches triton.language during a launch: threads launching at once failed ("Did you forget
    # to add @triton.jit ?"); launches hold one lock under it
    import threading

    results, errors = {}, []

    def work(i):
        gen = torch.Generator().manual_seed(i)
        try:
            for _ in range(4):
                a, b = torch.randn(12, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
                offs = torch.tensor([2, 7, 12], dtype=torch.int32)
                y = tilegemm.grouped_mm(a, b, offs=offs)
                want = torch.cat([a[:2] @ b[0], a[2:7] @ b[1], a[7:] @ b[2]])
                results[i] = max(results.get(i, 0.0), float((y - want).abs().max()))
        except Exception as err:  # noqa: BLE001 (collected: a thread's exception would be lost)
            errors.append(repr(err))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 4 and max(results.values()) < 1e-4, (errors, results)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
def test_a_child_forked_while_another_thread_holds_a_lock_can_take_it():
    # a thread inside a launch (the interpreter's lock, a call's sequence lock, the tuning tables' lock) when another
    # forked: the child, which has only the forking thread, hung at its first call
    import threading

    from tilegemm.core import launch as launch_module, runtime, tuning

    for lock in (runtime._INTERPRETER_LOCK, launch_module.sequence_lock, tuning._lock):
        held, done = threading.Event(), threading.Event()

        def hold():
            with lock:
                held.set()
                done.wait(30)

        t = threading.Thread(target=hold)
        t.start()
        held.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 if the lock can be taken
            os._exit(0 if lock.acquire(timeout=10) else 1)
        _, status = os.waitpid(pid, 0)
        done.set()
        t.join()
        assert os.waitstatus_to_exitcode(status) == 0, lock
