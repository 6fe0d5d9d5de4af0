"""``auto`` for the grouped family: the kernel a problem runs on, and its launch."""

from __future__ import annotations

from tilegemm.core import registry
from tilegemm.core.runtime import interpreting, on_device
from tilegemm.ops.grouped.problem import GroupedProblem

# (Rule) every layout goes to ``tiled``, the family's kernel of every layout and dtype, but for:
AUTO = "tiled"
# the 16-bit MoE forward (2-D x 3-D) on Hopper with at least this many rows an expert on average (M / G, from the
# shapes): two full 128-row tiles a group and more, where tiled's pointer loads limit the K loop and TMA's
# pipelined tiles pay for the padding of 128-row tiles (docs/grouped.md, "Kernels")
TMA_MIN_ROWS_PER_GROUP = 256


def takes_tma(p: GroupedProblem) -> bool:
    """Whether kernel ``tma`` takes ``p`` (:func:`tilegemm.ops.grouped.tma.why_not`; its module, which imports
    triton, only for a 16-bit 2-D x 3-D problem). Never under the interpreter, whose descriptors are emulated."""
    if p.layout != "2d3d" or p.dtype.itemsize != 2 or interpreting():
        return False
    from tilegemm.ops.grouped import tma

    return tma.why_not(p) is None


def choose(p: GroupedProblem) -> str:
    if p.layout == "2d3d" and p.M >= TMA_MIN_ROWS_PER_GROUP * max(p.groups, 1) and takes_tma(p):
        return "tma"
    return AUTO


def launch(p: GroupedProblem, kernel: str = "auto") -> None:
    """Run ``p`` on ``kernel`` (``auto``: :func:`choose`) on the operands' device."""
    name = choose(p) if kernel == "auto" else kernel
    with on_device(p.a.device):
        registry.launcher("grouped", name)(p)
