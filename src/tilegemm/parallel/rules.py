"""DTensor sharding rules of tilegemm's ops (``torch.ops.tilegemm.matmul``, ``w4a16_matmul``, ``conv2d`` and its
gradients ``conv2d_dgrad`` and ``conv2d_wgrad``, ``grouped_mm``, ``grouped_w4a16``, ``grouped_mm_gated``,
``group_columns``).

Apart from the rest of :mod:`tilegemm.parallel` so that the layers (``tilegemm.nn.Linear``, ``Conv2d``) can register
the rules when they meet a DTensor weight without importing the styles and the loaders, which import the layers
back. Importing this module registers the rules.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import tilegemm.ops.conv2d.op  # noqa: F401 (defines torch.ops.tilegemm.conv2d, whose rules are registered here)
import tilegemm.ops.grouped.op  # noqa: F401 (tilegemm.grouped_mm, grouped_w4a16, grouped_mm_gated)
import tilegemm.ops.grouped.routing  # noqa: F401 (torch.ops.tilegemm.group_columns)
import tilegemm.ops.matmul.op  # noqa: F401 (torch.ops.tilegemm.matmul)
import tilegemm.ops.w4a16.op  # noqa: F401 (torch.ops.tilegemm.w4a16_matmul)

__all__ = ["register"]


# --- sharding rules of the ops ------------------------------------------------------------------------------


def _is_spec(x) -> bool:
    """A DTensor argument, as a sharding rule sees it (a ``DTensorSpec``)."""
    return hasattr(x, "placements") and hasattr(x, "tensor_meta")


def _place(args, placements) -> list:
    """One strategy's input placements: ``placements[i]`` for each DTensor argument, None for the rest."""
    return [p if _is_spec(a) else None for a, p in zip(args, placements)]


def _mesh_size(*args) -> int:
    for a in args:
        if _is_spec(a):
            return a.mesh.size()
    return 1


def _matmul_rule(a, b, bias, c, alpha, beta, activation, out_dtype, precision, kernel, scale_a=None, scale_b=None,
                 fast_accum=False):
    """``activation(alpha * scale_a * scale_b * (a @ b) + beta * c + bias)``, a ``[..., M, K]``, b ``[..., K, N]``."""
    args = (a, b, bias, c, alpha, beta, activation, out_dtype, precision, kernel, scale_a, scale_b, fast_accum)
    R = Replicate()
    nd = max(a.ndim, b.ndim)
    M, N = a.shape[-2], b.shape[-1]

    def per(t, dim_from_end, size):
        # c and the fp8 scales broadcast: split the ones that hold the split dim, replicate the others
        if not _is_spec(t) or t.ndim < dim_from_end or t.shape[-dim_from_end] != size or size == 1:
            return R
        return Shard(t.ndim - dim_from_end)

    def strategy(out, pa, pb, pbias, pc, psa, psb):
        return [out], _place(args, [pa, pb, pbias, pc, None, None, None, None, None, None, psa, psb, None])

    rules = [strategy(R, R, R, R, R, R, R)]
    # column-parallel: b split along N (a Linear's weight split along out_features)
    rules.append(strategy(Shard(nd - 1), R, Shard(b.ndim - 1), Shard(0), per(c, 1, N), R,
                          per(scale_b, 1, N)))
    # rows of a split (sequence or token parallel)
    rules.append(strategy(Shard(nd - 2), Shard(a.ndim - 2), R, R, per(c, 2, M),
                          Shard(0) if _is_spec(scale_a) and scale_a.ndim >= 1 and scale_a.shape[0] == M and M > 1
                          else R, R))
    # row-parallel: a and b split along K, each rank's product a partial sum. Linear in the epilogue only: an
    # activation of a partial sum is not the partial of the activation.
    if activation == "none":
        P = Partial()
        rules.append(strategy(P, Shard(a.ndim - 1), Shard(b.ndim - 2), P, P, R, R))
    # batched products: the leading batch dim split where both operands hold it
    if nd > 2:
        B = max(a.shape[0] if a.ndim == nd else 1, b.shape[0] if b.ndim == nd else 1)
        pa = Shard(0) if a.ndim == nd and a.shape[0] == B else R
        pb = Shard(0) if b.ndim == nd and b.shape[0] == B else R
        pc = Shard(0) if _is_spec(c) and c.ndim == nd and c.shape[0] == B else R
        if B > 1:
            rules.append(strategy(Shard(0), pa, pb, R, pc, R, R))
    return rules


def _w4a16_rule(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm=None):
    """``activation(x @ W.T + bias)``: x ``[M, K]``; qweight ``[K/8, N]``, scales and zeros ``[G, N]`` (K in
    groups of ``group_k``); fweight/fzs the fragment layout of the whole weight (only replicated); perm
    (act-order, x read through it) replicated, and K then not split (it mixes all of K)."""
    args = (x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm)
    R = Replicate()
    K = x.shape[1]

    def strategy(out, px, pw, pbias, pfrag=R):
        return [out], _place(args, [px, pw, pw, pw, pfrag, pfrag, pbias, None, None, None, R])

    rules = [strategy(R, R, R, R), strategy(Shard(0), Shard(0), R, R)]
    if not _is_spec(fweight):  # the fragment layout interleaves all of N and K: it is not split
        rules.append(strategy(Shard(1), R, Shard(1), Shard(0)))
        # K split in whole groups only, evenly (a shard of qweight's K/8 rows must match x's K columns)
        world = _mesh_size(*args)
        if activation == "none" and group_k < K and K % (world * group_k) == 0 and perm is None:
            rules.append(strategy(Partial(), Shard(1), Shard(0), Partial()))
    return rules


def _conv2d_rule(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel, out_dtype=None):
    """x ``[N, C, H, W]``, weight ``[K, C/groups, R, S]``: split the batch, the output channels or (groups = 1,
    no activation) the input channels, whose partial sums the next redistribution adds."""
    args = (x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel, out_dtype)
    R = Replicate()

    def strategy(out, px, pw, pbias):
        return [out], _place(args, [px, pw, pbias] + [None] * 8)

    rules = [strategy(R, R, R, R), strategy(Shard(0), Shard(0), R, R)]
    if groups == 1:  # the op takes the global group count: with channels split, only groups = 1 means the same
        rules.append(strategy(Shard(1), R, Shard(0), Shard(0)))
        if activation == "none":
            rules.append(strategy(Partial(), Shard(1), Shard(1), Partial()))
    return rules


# The gradients' ops take the global shape of what they return (x_shape, w_shape) and the local op makes a tensor
# of that shape: so each rule's output is whole on every rank, replicated or a partial sum, never a shard. A
# gradient a rank would hold a shard of (the batch-split data gradient, the channel splits' weight gradient) is
# computed whole from gathered operands, then cut by the redistribution to the parameter's or input's placement.


def _conv2d_dgrad_rule(dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision):
    """``tilegemm::conv2d_dgrad``, grad of x ``x_shape`` from dy ``[N, K, P, Q]``: replicated, or (groups = 1) the
    output channels K split in dy and the weight, each rank's product a partial sum (column-parallel's backward)."""
    args = (dy, weight, x_shape, x_channels_last, stride, padding, dilation, groups, precision)
    R = Replicate()

    def strategy(out, pdy, pw):
        return [out], _place(args, [pdy, pw] + [None] * 7)

    rules = [strategy(R, R, R)]
    if groups == 1:
        rules.append(strategy(Partial(), Shard(1), Shard(0)))
    return rules


def _conv2d_wgrad_rule(dy, x, w_shape, stride, padding, dilation, groups, precision, w_channels_last=False):
    """``tilegemm::conv2d_wgrad``, grad of a weight ``w_shape`` from dy and x: replicated, or the batch split in
    both, each rank's sum over its images a partial sum."""
    args = (dy, x, w_shape, stride, padding, dilation, groups, precision, w_channels_last)
    R = Replicate()

    def strategy(out, pdy, px):
        return [out], _place(args, [pdy, px] + [None] * 7)

    return [strategy(R, R, R), strategy(Partial(), Shard(0), Shard(0))]


# The grouped family: offs holds data-dependent group ends along the rows (2-D a) or K (2-D a and b), so the
# grouped dimension itself is never split; the other ones split as the dense product's do.


def _grouped_bias(bias, out, place_n, groups_split: bool = False):
    """The bias's placement (``[N]`` or ``[G, N]``) for an output placed ``out``: split along N with it
    (``place_n``), split along G where the groups are (``groups_split``), partial with a partial output."""
    R = Replicate()
    if not _is_spec(bias):
        return R
    if isinstance(out, Partial):
        return Partial()
    if place_n:
        return Shard(bias.ndim - 1)
    if groups_split and bias.ndim == 2:
        return Shard(0)
    return R


def _grouped_mm_rule(a, b, offs, bias, out_dtype, precision, kernel):
    """``tilegemm::grouped_mm`` (2-D x 3-D: the MoE forward; 3-D x 3-D batched; 2-D x 2-D and 3-D x 2-D, the
    gradients' layouts): column-parallel (b split along N), row-parallel (a and b split along K: a partial
    output; not for 2-D x 2-D, whose offs splits K) and the splits of the batch or the rows offs does not group."""
    args = (a, b, offs, bias, out_dtype, precision, kernel)
    R, P = Replicate(), Partial()
    layout = f"{a.ndim}d{b.ndim}d"

    def strategy(out, pa, pb, pbias):
        return [out], _place(args, [pa, pb, R, pbias, None, None, None])

    rules = [strategy(R, R, R, R)]
    nd_out = 3 if layout in ("3d3d", "2d2d") else 2
    # column-parallel: b split along N; the output's last dim (N) with it
    if layout != "3d2d":  # 3-D x 2-D: offs groups b's columns
        rules.append(strategy(Shard(nd_out - 1), R, Shard(b.ndim - 1), _grouped_bias(bias, Shard(0), True)))
    # row-parallel: K split in both; each rank's product a partial sum (the bias added once, as a partial)
    if layout != "2d2d":
        rules.append(strategy(P, Shard(a.ndim - 1), Shard(b.ndim - 2), _grouped_bias(bias, P, False)))
    if layout == "3d3d":  # batched: the batch (groups), or a's rows
        rules.append(strategy(Shard(0), Shard(0), Shard(0), _grouped_bias(bias, Shard(0), False, True)))
        rules.append(strategy(Shard(1), Shard(1), R, _grouped_bias(bias, Shard(1), False)))
    elif layout == "2d2d":  # out [G, M, N]: a's rows
        rules.append(strategy(Shard(1), Shard(0), R, R))
    elif layout == "3d2d":  # out [M, N]: a's rows
        rules.append(strategy(Shard(0), Shard(1), R, R))
    return rules


def _grouped_w4a16_rule(x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel):
    """``tilegemm::grouped_w4a16``: x ``[M, K]`` (rows grouped by offs), qweight ``[E, K/8, N]``, scales and zeros
    ``[E, G, N]`` (stacked experts, K in groups of ``group_k``); gated: N holds the gate, then the up columns."""
    args = (x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel)
    R = Replicate()

    def strategy(out, px, pw, pbias):
        return [out], _place(args, [px, pw, pw, pw, R, pbias, None, None, None, None])

    rules = [strategy(R, R, R, R)]
    if gated:  # a split of N would part gate columns from their up columns: replicated only
        _refuse_gate_split("grouped_w4a16 (gated)", qweight, 2)
        return rules
    rules.append(strategy(Shard(1), R, Shard(2), _grouped_bias(bias, Shard(1), True)))
    K, world = x.shape[1], _mesh_size(*args)
    # K split in whole groups only, evenly (a shard of qweight's K/8 rows must match x's K columns)
    if activation == "none" and group_k < K and K % (world * group_k) == 0 and (K // world) % 8 == 0:
        rules.append(strategy(Partial(), Shard(1), Shard(1), _grouped_bias(bias, Partial(), False)))
    return rules


def _refuse_gate_split(op: str, b, dim: int) -> None:
    if _is_spec(b) and any(isinstance(p, Shard) and p.dim % b.ndim == dim for p in b.placements):
        raise ValueError(f"{op}: b is split along its gate/up columns (dim {dim}); a shard of [gate | up] is not "
                         f"[gate shard | up shard], so the product is not sharded this way. Shard MoE experts "
                         f"with tilegemm.nn.ExpertsTensorParallel (it pairs the halves), or pass b replicated")


def _grouped_mm_gated_rule(a, b, offs, bias, activation, precision):
    """``tilegemm::grouped_mm_gated``: ``activation(gate) * up`` of b's two halves of columns. Replicated only:
    a split of b's columns would part each gate column from its up column (refused), and the activation takes
    no partial sums (a split of K is gathered)."""
    args = (a, b, offs, bias, activation, precision)
    _refuse_gate_split("grouped_mm_gated", b, 2)
    return [([Replicate()], _place(args, [Replicate()] * 4 + [None, None]))]


def _group_columns_rule(x, offs, perm):
    """``tilegemm::group_columns``: each row of x read through its group's column order. Replicated only: offs
    groups the rows by their global index, and an output column may come from any column of x."""
    return [([Replicate()], _place((x, offs, perm), [Replicate()] * 3))]


_registered = False


def _register(op, rule, static_argnum: int) -> None:
    register_sharding(op)(rule)
    # register_sharding keys its cache of decisions on the arguments from the schema's first int on; the rules
    # here read the activation and the group length, which come earlier or are not ints: key on those too.
    try:  # torch internals, imported under the guard that names what is missing
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

        DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[op] = RuntimeSchemaInfo(
            static_argnum, needs_pytree=True)
    except (ImportError, AttributeError) as err:  # a torch without these internals: refuse rather than misroute
        raise RuntimeError(f"tilegemm.parallel needs DTensor's op_to_schema_info (torch >= 2.5): {err}") from err


def register() -> None:
    """Register tilegemm's sharding rules with DTensor (once; importing this module does it)."""
    global _registered
    if _registered:
        return
    ops = torch.ops.tilegemm
    _register(ops.matmul.default, _matmul_rule, 4)  # alpha onwards: activation among them
    _register(ops.w4a16_matmul.default, _w4a16_rule, 7)  # group_k, activation, kernel
    _register(ops.conv2d.default, _conv2d_rule, 3)  # stride onwards
    _register(ops.conv2d_dgrad.default, _conv2d_dgrad_rule, 2)  # x_shape onwards (groups among them)
    _register(ops.conv2d_wgrad.default, _conv2d_wgrad_rule, 2)  # w_shape onwards
    _register(ops.grouped_mm.default, _grouped_mm_rule, 4)  # out_dtype, precision, kernel
    _register(ops.grouped_w4a16.default, _grouped_w4a16_rule, 6)  # group_k, activation, gated, kernel
    _register(ops.grouped_mm_gated.default, _grouped_mm_gated_rule, 4)  # activation, precision
    register_sharding(ops.group_columns.default)(_group_columns_rule)  # (no static arguments)
    _registered = True


register()
