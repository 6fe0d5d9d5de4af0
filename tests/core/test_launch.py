"""What a recorded launch keeps: every parameter, named ones defaulted from the kernel's signature."""

from __future__ import annotations

import triton
import triton.language as tl

from tilegemm.core.launch import _all_params


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
