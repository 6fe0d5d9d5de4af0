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
