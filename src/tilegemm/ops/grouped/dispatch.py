"""``auto`` for the grouped family: the kernel a problem runs on, and its launch."""

from __future__ import annotations

from tilegemm.core import registry
from tilegemm.core.runtime import on_device
from tilegemm.ops.grouped.problem import GroupedProblem

# (Rule) every layout goes to ``tiled``: it is the family's one kernel of 16-bit and fp32 operands.
AUTO = "tiled"


def choose(p: GroupedProblem) -> str:
    return AUTO


def launch(p: GroupedProblem, kernel: str = "auto") -> None:
    """Run ``p`` on ``kernel`` (``auto``: :func:`choose`) on the operands' device."""
    name = choose(p) if kernel == "auto" else kernel
    with on_device(p.a.device):
        registry.launcher("grouped", name)(p)
