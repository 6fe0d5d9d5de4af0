"""The record of one grouped product: its operands, layout and sizes, built once by the checks and passed down
whole (to the dispatch and the kernel's launcher), never as positional tuples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The four layouts of torch.nn.functional.grouped_mm, by the dimensions of a and b:
#   "2d3d": a [M, K], b [G, K, N], offs splits a's rows     -> out [M, N]      (the MoE forward)
#   "3d3d": a [G, M, K], b [G, K, N], no offs               -> out [G, M, N]   (a batched product)
#   "2d2d": a [M, K], b [K, N], offs splits K               -> out [G, M, N]   (the MoE weight gradient)
#   "3d2d": a [G, M, K], b [K, N], offs splits b's columns  -> out [M, N]
LAYOUTS = ("2d3d", "3d3d", "2d2d", "3d2d")


def layout_of(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{a.dim()}d{b.dim()}d"


def out_shape(layout: str, a_shape, b_shape, groups: int) -> tuple[int, ...]:
    """The output's shape from the operands' shapes alone (the fake of the op uses it: no values of offs)."""
    if layout == "2d3d":
        return (a_shape[0], b_shape[2])
    if layout == "3d3d":
        return (a_shape[0], a_shape[1], b_shape[2])
    if layout == "2d2d":
        return (groups, a_shape[0], b_shape[1])
    return (a_shape[1], b_shape[1])  # 3d2d


@dataclass(frozen=True)
class GroupedProblem:
    """One call of a grouped product, checked.

    ``groups`` is G (b's first dimension, a's, or offs' length); ``M``, ``N``, ``K`` are the sizes of the whole
    product as :data:`LAYOUTS` names them (the jagged one is a total). ``precision`` is ``ieee`` or ``tf32``
    (fp32 operands only). ``activation`` and ``gated`` are for the MoE integration's fused gate/up product
    (:func:`tilegemm.ops.grouped.api.moe_gate_up`): with ``gated``, b holds 2N columns, the gate's ``[0, N)``
    and the up projection's ``[N, 2N)`` (``up_offset`` elements of b apart), and the output is
    ``activation(gate) * up``.
    """

    layout: str
    a: torch.Tensor
    b: torch.Tensor
    offs: torch.Tensor | None
    bias: torch.Tensor | None
    out: torch.Tensor
    groups: int
    M: int
    N: int
    K: int
    precision: str = "ieee"
    activation: str = "none"
    gated: bool = False
    up_offset: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype


def sizes(layout: str, a_shape, b_shape) -> tuple[int, int, int]:
    """(M, N, K) of a layout, as :class:`GroupedProblem` holds them."""
    if layout == "2d3d":
        return a_shape[0], b_shape[2], a_shape[1]
    if layout == "3d3d":
        return a_shape[1], b_shape[2], a_shape[2]
    if layout == "2d2d":
        return a_shape[0], b_shape[1], a_shape[1]
    return a_shape[1], b_shape[1], a_shape[2]  # 3d2d


def make_problem(layout: str, groups: int, a, b, offs, bias, out, precision: str = "ieee",
                 activation: str = "none", gated: bool = False) -> GroupedProblem:
    M, N, K = sizes(layout, a.shape, b.shape)
    up = 0
    if gated:  # b holds the gate's N columns, then the up projection's
        N //= 2
        up = N * b.stride(-1)
    return GroupedProblem(layout, a, b, offs, bias, out, groups, M, N, K, precision, activation, gated, up)


@dataclass(frozen=True)
class GroupedInt4Problem:
    """One call of 4-bit experts: rows ``offs[g-1]:offs[g]`` of x ``[M, K]`` times expert g's weight, held as an
    ``Int4Weight`` stacked over experts (qweight ``[E, K/8, N]``, scales and zeros ``[E, G_k, N]``). ``N`` is the
    output's width; with ``gated`` the weight holds 2N rows (gate, then up) and the output is
    ``activation(gate) * up``. bias ``[E, N]`` or ``[N]`` (2N wide when gated). ``fweight``, ``fzs``: the weight's
    fragment layout, stacked (gated: of the rows in the gated product's order), or None."""

    x: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    offs: torch.Tensor
    bias: torch.Tensor | None
    out: torch.Tensor
    groups: int
    M: int
    N: int
    K: int
    group_k: int
    activation: str = "none"
    gated: bool = False
    # the stacked experts' fragment layout (``Int4Weight.fragments(gated)``), where kernel ``frag`` may run
    fweight: torch.Tensor | None = None
    fzs: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype
