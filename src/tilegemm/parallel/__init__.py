"""Tensor parallelism through ``torch.distributed.tensor`` (DTensor): tilegemm's ops and layers sharded over a mesh.

- :func:`register` teaches DTensor the sharding rules of the ops ``torch.ops.tilegemm.matmul``, ``w4a16_matmul``,
  ``conv2d`` (and its gradients' ops) and the grouped ops (``grouped_mm``, ``grouped_w4a16``,
  ``grouped_mm_gated``), so a call whose operands are DTensors runs each rank's shard locally: column-parallel
  (weight split along N: output split along its last dim), row-parallel (input and weight split along K: a
  partial output that the next redistribution all-reduces), rows or batch split, replicated.
- :class:`ColwiseParallel` / :class:`RowwiseParallel` are ``parallelize_module`` styles: torch's own for
  ``nn.Linear`` (``tilegemm.nn.Linear`` included: it is one), and for :class:`~tilegemm.nn.Int4Linear` and
  :class:`~tilegemm.nn.Conv2d` which torch's styles refuse. An ``Int4Linear`` keeps a plain local
  :class:`~tilegemm.ops.w4a16.format.Int4Weight` of its shard (its kernels, fragment layout included, run on
  it as on any weight), split in whole quantization groups; hooks convert its input and output as torch's
  styles do.
- :class:`ExpertsTensorParallel` splits a transformers MoE experts block (stacked ``gate_up_proj`` / ``down_proj``,
  16-bit or 4-bit after ``tilegemm.nn.quantize_``) along the experts' intermediate size: every rank runs every
  expert on its slice, gate and up halves kept paired, and one all-reduce joins the ranks.
- :func:`load_sharded_` fills a parallelized model from safetensors files, each rank reading only its slices;
  :func:`load_quantized_sharded_` is ``tilegemm.models.from_pretrained``'s path when given a ``device_mesh``.

One module for all of it, outside the op families and ``core/``: ``import tilegemm`` does not import it (it imports
``torch.distributed.tensor``, about a second), ``tilegemm.nn``'s styles and ``from_pretrained(device_mesh=)`` import
it when first used, and importing it registers the rules. docs/parallel.md is the guide.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import warnings
from functools import partial
from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise

from tilegemm.models.pretrained import _check_quant_shapes, _check_weight_range, _default_device, _import_columns, \
    _left_16_bit_by, _named_16_bit, _regroups, _saved_weight, _stored_parts, _symmetric_zeros, _Tensors, awq_eights, \
    empty_model, load_quantized_, load_generation_config_, quant_config, read_config, resolve_dtype
from tilegemm.nn.conv import Conv2d
from tilegemm.nn.int4 import SAVED_METHOD, Int4Linear
from tilegemm.nn.transaction import unchanged_on_error
from tilegemm.nn.moe import expert_group_size
from tilegemm.parallel.rules import register
from tilegemm.ops.w4a16.format import Int4Weight, ct_g_idx, from_awq, from_compressed_tensors, from_gptq, \
    unpack_rows

__all__ = ["ColwiseParallel", "ExpertsTensorParallel", "RowwiseParallel", "attach_int4", "from_pretrained_sharded",
           "load_quantized_sharded_", "load_sharded_", "register", "resolve_plan", "shard_experts_", "shard_int4",
           "shard_slices"]


# --- int4 weights split in whole groups -------------------------------------------------------------------


def _even(what: str, size: int, world: int) -> int:
    if size % world:
        raise ValueError(f"{what} = {size} does not split evenly over {world} ranks; tilegemm's parallel styles "
                         f"split evenly (a local uneven shard passed to the next layer loses its global shape)")
    return size // world


def shard_int4(w: Int4Weight, dim: str, rank: int, world: int) -> tuple[Int4Weight, torch.Tensor | None]:
    """Rank ``rank``'s shard of ``w`` out of ``world``: ``dim="out"`` splits N (column-parallel), ``"in"`` splits
    K (row-parallel) in whole groups. Returns ``(local weight, input index)``: the index is None, or, for an
    act-order weight split along K, the inputs (of all of K) that the local rows multiply, in order.

    Act-order weights hold their rows sorted by group (``perm``), so a K split cuts the sorted rows into whole
    groups; the shard's inputs are then ``x[..., perm[k0:k1]]``, scattered over K (docs/parallel.md#act-order).

    Raises ValueError naming the size that does not split evenly, or the group size a split would cut.
    """
    if not isinstance(w, Int4Weight):
        raise TypeError(f"shard_int4 takes an Int4Weight, got {type(w).__name__}")
    N, K = w.shape
    if dim == "out":
        n = _even("out_features N", N, world)
        cols = slice(rank * n, (rank + 1) * n)
        local = Int4Weight(w.qweight[:, cols].contiguous(), w.scales[:, cols].contiguous(),
                           w.zeros[:, cols].contiguous(), w.group_size, (n, K), w.perm)
        return local, None
    if dim != "in":
        raise ValueError(f"dim must be 'out' (split N) or 'in' (split K), got {dim!r}")
    k = _even("in_features K", K, world)
    if w.group_size == -1:
        raise ValueError(f"group_size = -1 (one quantization group over all of K = {K}): a split along K would cut "
                         f"the group; quantize with a group size that divides K / {world} = {k}")
    if k % w.group_size:
        raise ValueError(f"a split of K = {K} over {world} ranks ({k} each) would cut quantization groups of "
                         f"group_size = {w.group_size}: K / ranks must be a multiple of the group size")
    k0, k1 = rank * k, (rank + 1) * k
    g0, g1 = k0 // w.group_size, k1 // w.group_size
    local = Int4Weight(w.qweight[k0 // 8:k1 // 8].contiguous(), w.scales[g0:g1].contiguous(),
                       w.zeros[g0:g1].contiguous(), w.group_size, (N, k), None)
    return local, (None if w.perm is None else w.perm[k0:k1].contiguous())


# --- the styles -----------------------------------------------------------------------------------------


def _mesh_rank(mesh: DeviceMesh) -> tuple[int, int]:
    if not all(hasattr(mesh, a) for a in ("ndim", "get_local_rank", "size")):  # (duck-typed: what is read below)
        raise TypeError(f"device_mesh must be a torch.distributed DeviceMesh (1-D, the tensor-parallel dim), got "
                        f"{type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"tilegemm's parallel styles take a 1-D mesh (the tensor-parallel dim, mesh['tp']), "
                         f"got a {mesh.ndim}-D mesh")
    return mesh.get_local_rank(), mesh.size()


def _normal(placements, ndim: int) -> tuple:
    """Placements with negative shard dims made positive for a tensor of ``ndim`` dims (to compare them)."""
    return tuple(Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)


def _same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    """One mesh, or two 1-D meshes of the same ranks in the same order (``mesh2d["tp"]`` and a 1-D mesh of its
    ranks differ only by their dim names): a DTensor on either lies the same over the ranks."""
    return a == b or (a.ndim == b.ndim == 1 and a.device_type == b.device_type and torch.equal(a.mesh, b.mesh))


def _to_local_input(x, mesh, given, desired, grad_placements=None):
    """``x`` (a local tensor laid out as ``given``, or a DTensor) as the local tensor of layout ``desired``.

    ``grad_placements``: how the local tensor's gradient lies over the ranks (default: as ``desired``). A layer
    that uses a replicated input to compute only its own shard of the output passes ``(Partial(),)``: each rank's
    gradient of the input is then a partial sum, which the backward all-reduces (or reduce-scatters to
    ``given``)."""
    grad_placements = desired if grad_placements is None else grad_placements
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    if isinstance(x, DTensor) and not _same_mesh(x.device_mesh, mesh):
        # its placements would be read against the layer's mesh: a wrong slice, or an IndexError deep in DTensor
        raise ValueError(f"x is a DTensor on {x.device_mesh}, but the layer is split over {mesh}: pass x as a DTensor "
                         f"on the layer's mesh (for a 2-D mesh, its tensor-parallel dim mesh['tp']) or as this "
                         f"rank's plain local tensor")
    if not isinstance(x, DTensor):
        same = _normal(given, x.ndim) == _normal(desired, x.ndim)
        if same and (not needs_grad or _normal(grad_placements, x.ndim) == _normal(desired, x.ndim)):
            return x  # no conversion: skip DTensor on the decode path
        x = DTensor.from_local(x, mesh, given, run_check=False)
    if x.placements != _normal(desired, x.ndim):
        x = x.redistribute(placements=_normal(desired, x.ndim))
    return x.to_local(grad_placements=_normal(grad_placements, x.ndim))


def _from_local_output(out, mesh, produced, desired, use_local):
    """A local output laid out as ``produced`` made ``desired`` (a DTensor, or its local tensor)."""
    if use_local and _normal(produced, out.ndim) == _normal(desired, out.ndim):
        return out
    dt = DTensor.from_local(out, mesh, _normal(produced, out.ndim), run_check=False)
    if dt.placements != _normal(desired, out.ndim):
        dt = dt.redistribute(placements=_normal(desired, out.ndim))
    return dt.to_local() if use_local else dt


_SPLITS = {"out": "column-parallel", "in": "row-parallel", "experts": "along the experts' intermediate size"}


def _check_width(given, world: int, K: int, dim: str, mod, inputs, *, axis: int = -1,
                 size: str = "in_features K", arg: str = "x") -> None:
    """Refuse a plain input (named ``arg``) whose dim ``axis`` (the last: a Linear's inputs, an experts block's hidden
    size; -3: a convolution's channels) is not what ``given`` (the style's ``input_layouts``) makes of the layer's
    ``K`` (named ``size``) for a ``dim`` split: DTensor would infer another global K from it (``K / ranks`` given
    all of K, as a row-parallel layer given the whole input), and the product fail naming that K, or an act-order
    gather read the wrong inputs."""
    x = inputs[0] if inputs else None
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.ndim < -axis:
        return
    at = axis % x.ndim
    split = any(isinstance(p, Shard) and p.dim % x.ndim == at for p in given)
    letter = size.rpartition(" ")[2]
    want = _even(size, K, world) if split else K
    if x.shape[at] != want:
        holds = f"this rank's slice of {letter}, {want} wide" if split else f"all of {letter} = {want}"
        fix = ("; pass each rank its slice, or input_layouts=Replicate() for the whole input" if split else
               f"; pass input_layouts=Shard({axis}) for each rank's slice" if dim == "in" else "")
        where = "" if axis == -1 else f"'s dim {at}"
        raise ValueError(f"{type(mod).__name__} split {_SPLITS[dim]} over {world} ranks ({size} = {K}): {arg} is "
                         f"{list(x.shape)}, but input_layouts={tuple(given)} makes a plain {arg}{where} {holds}{fix}")


def _int4_input_hook(style, mesh, desired, grad_placements, mod, inputs):
    world = mesh.size()
    _check_width(style.input_layouts, world, mod.in_features * (world if mod.tp_split == "in" else 1), mod.tp_split,
                 mod, inputs)
    x = inputs[0]
    perm = getattr(mod, "tp_input_index", None)
    if perm is not None and perm.numel():
        # act-order, row-parallel: the local rows multiply inputs scattered over K; gather x, then pick them
        # (each rank reads only its inputs of the gathered x: its gradient is a partial sum over the ranks)
        full = _to_local_input(x, mesh, style.input_layouts, (Replicate(),), (Partial(),))
        return (full.index_select(-1, perm), *inputs[1:])
    return (_to_local_input(x, mesh, style.input_layouts, desired, grad_placements), *inputs[1:])


def _int4_output_hook(style, mesh, produced, mod, inputs, out):
    return _from_local_output(out, mesh, produced, style.output_layouts, style.use_local_output)


def _shard_int4_module(style, module: Int4Linear, mesh: DeviceMesh, dim: str) -> Int4Linear:
    rank, world = _mesh_rank(mesh)
    if getattr(module, "tp_split", None):  # a second split would cut its shard again and stack a second set of hooks
        raise ValueError(f"this Int4Linear is split already ({'column' if module.tp_split == 'out' else 'row'}-"
                         f"parallel, its local in_features = {module.in_features}, out_features = "
                         f"{module.out_features}): parallelize_module applies one style to a layer, once")
    local, index = shard_int4(module._weight(), dim, rank, world)
    bias = module.bias
    if bias is not None:
        bias = bias[rank * local.shape[0]:(rank + 1) * local.shape[0]] if dim == "out" else bias
    module._set_weight(local)
    module.out_features, module.in_features = local.shape
    return attach_int4(style, module, mesh, dim, index, bias)


def _set_input_index(module: Int4Linear, index: torch.Tensor | None, device) -> None:
    """A row-parallel act-order shard's input index (which of x's inputs its rows take, x's columns in the
    weight's sorted order), saved in its state dict: its perm is empty, and a state dict loaded into another shard
    without it would multiply the rows by other inputs. Empty (and not saved) elsewhere."""
    if index is None:
        module.register_buffer("tp_input_index", torch.empty(0, dtype=torch.int64, device=device), persistent=False)
    else:
        module.register_buffer("tp_input_index", index.to(device))


def attach_int4(style, module: Int4Linear, mesh: DeviceMesh, dim: str, index: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> Int4Linear:
    """Make ``module`` (an Int4Linear holding rank's shard already) one rank's part of a ``dim`` split (``"out"``:
    column-parallel, ``"in"``: row-parallel) under ``style``: the bias (this rank's part; a row-parallel one is
    kept by the first rank only), the act-order input index, and the hooks that convert its input and output."""
    rank, _ = _mesh_rank(mesh)
    module.tp_has_bias = bias is not None  # (every rank's answer: load_sharded_ checks the files against it)
    if bias is not None and dim == "in" and rank != 0:
        bias = None  # row-parallel: added once, by the first rank, before the all-reduce sums the ranks
    # (the bias keeps its dtype, the layer's: an fp32 layer of fp16 scales stays fp32)
    module.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
    _set_input_index(module, index, module.qweight.device)
    module.tp_split = dim  # read by load_sharded_
    if dim == "out":  # every rank reads all of the replicated x for its own outputs: x's gradient a partial sum
        desired, produced, grad = (Replicate(),), (Shard(-1),), (Partial(),)
    else:
        desired, produced, grad = (Shard(-1),), (Partial(),), None
    module.register_forward_pre_hook(partial(_int4_input_hook, style, mesh, desired, grad))
    module.register_forward_hook(partial(_int4_output_hook, style, mesh, produced))
    return module


def _check_even(module: nn.Module, mesh: DeviceMesh, dim: str) -> None:
    world = mesh.size()
    if isinstance(module, nn.Conv2d):
        _even("out_channels" if dim == "out" else "in_channels",
              module.out_channels if dim == "out" else module.in_channels, world)
    elif isinstance(module, nn.Linear):
        _even("out_features N" if dim == "out" else "in_features K",
              module.out_features if dim == "out" else module.in_features, world)


def _check_conv(module) -> None:
    if not isinstance(module, Conv2d):
        raise NotImplementedError(f"tilegemm's parallel styles split tilegemm.nn.Conv2d (convert_ the model), "
                                  f"not {type(module).__name__}")
    if module.groups != 1:
        raise ValueError(f"a Conv2d of groups = {module.groups} is not split by channels (groups = 1 only); "
                         f"split its batch instead (a Shard(0) input with a replicated weight)")


_CHANNELS = (Shard(-3),)  # a convolution's channels: dim 1 of [N, C, H, W], dim 0 of an unbatched [C, H, W]


def _check_conv_input(given, world: int, dim: str, mod, x) -> None:
    """Refuse a plain x that a channel-split convolution cannot take: not 3-D or 4-D (the op's own error would name
    the global shape DTensor infers from it), or channels other than ``given`` makes of ``in_channels``."""
    if isinstance(x, torch.Tensor) and x.ndim not in (3, 4):
        raise ValueError(f"{type(mod).__name__} split {_SPLITS[dim]} over {world} ranks: x must be a batched "
                         f"[N, C, H, W] (4 dims) or unbatched [C, H, W] (3 dims) input, got shape {list(x.shape)}")
    _check_width(given, world, mod.in_channels, dim, mod, (x,), axis=-3, size="in_channels C")


def _placed_as(placements, grad):
    """``grad`` (a DTensor) redistributed to ``placements``, its parameter's."""
    return grad if grad.placements == placements else grad.redistribute(placements=placements)


def _shard_conv(module, mesh, dim: str, given, wanted, use_local: bool):
    """Split a Conv2d's weight by output (``dim="out"``) or input channels as DTensor parameters; its input is
    ``given`` (placements of a local tensor), its output made ``wanted``."""
    _check_conv(module)

    def partition(name, mod, mesh):
        weight_place = [Shard(0)] if dim == "out" else [Shard(1)]
        bias_place = [Shard(0)] if dim == "out" else [Replicate()]
        for pname, place in (("weight", weight_place), ("bias", bias_place)):
            p = getattr(mod, pname, None)
            if p is not None and not isinstance(p, DTensor):
                param = nn.Parameter(distribute_tensor(p, mesh, place), requires_grad=p.requires_grad)
                if param.requires_grad:  # the weight gradient's op returns it whole (rules.py): placed as the weight
                    param.register_hook(partial(_placed_as, tuple(place)))
                mod.register_parameter(pname, param)

    def input_fn(mod, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            _check_conv_input(given, mesh.size(), dim, mod, x)
            x = DTensor.from_local(x, mesh, _normal(given, x.ndim), run_check=False)
        want = _normal((Replicate(),) if dim == "out" else _CHANNELS, x.ndim)
        if x.placements != want:
            x = x.redistribute(placements=want)
        return (x, *inputs[1:])

    def output_fn(mod, out, mesh):
        if out.placements != _normal(wanted, out.ndim):
            out = out.redistribute(placements=_normal(wanted, out.ndim))
        return out.to_local() if use_local else out

    module.tp_split = dim
    return distribute_module(module, mesh, partition, input_fn, output_fn)


class ColwiseParallel(_TorchColwise):
    """Column-parallel (weight split along its outputs N), like ``torch.distributed.tensor.parallel.ColwiseParallel``
    and with its arguments, for ``nn.Linear`` (torch's own style), :class:`~tilegemm.nn.Int4Linear` (a local 4-bit
    weight of N / ranks columns) and :class:`~tilegemm.nn.Conv2d` (output channels; the output is split along its
    channels, dim 1, or 0 unbatched, unless ``output_layouts`` says otherwise). Input replicated; output split
    along its last dim (Linear)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._default_output = output_layouts is None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        wanted = _CHANNELS if self._default_output else self.output_layouts
        return _apply_style(self, module, device_mesh, "out", self.input_layouts, wanted, super()._apply)


def _apply_style(style, module: nn.Module, mesh: DeviceMesh, dim: str, conv_given, conv_wanted,
                 torch_apply) -> nn.Module:
    """:class:`ColwiseParallel`'s and :class:`RowwiseParallel`'s ``_apply``, split along ``dim`` ("out" or "in"):
    an ``Int4Linear``'s weight in whole groups, a convolution's with its input and output placed as
    ``conv_given`` and ``conv_wanted``, anything else by torch's style (``torch_apply``)."""
    register()
    _refuse_joined(module)
    _mesh_rank(mesh)  # a 1-D mesh for every layer (torch's styles would fail later, naming placements' lengths)
    if isinstance(module, Int4Linear):
        return _shard_int4_module(style, module, mesh, dim)
    _check_even(module, mesh, dim)
    if isinstance(module, nn.Conv2d):
        return _shard_conv(module, mesh, dim, conv_given, conv_wanted, style.use_local_output)
    module = torch_apply(module, mesh)
    if isinstance(module, nn.Linear):  # checked before torch's hook makes x a DTensor
        module.register_forward_pre_hook(partial(_check_width, style.input_layouts, mesh.size(), module.in_features,
                                                 dim), prepend=True)
    module.tp_split = dim
    return module


def _refuse_joined(module: nn.Module) -> None:
    """A projection joined with its siblings (tilegemm.nn.fuse_projections_) shares one weight with them."""
    from tilegemm.nn.fuse import FusedProjections, ProjectionPart

    if isinstance(module, (ProjectionPart, FusedProjections)):
        raise TypeError(f"{type(module).__name__}: projections joined by tilegemm.nn.fuse_projections_ cannot be "
                        "parallelized; parallelize the model before joining (fuse_projections_ leaves DTensor "
                        "weights alone), or do not join them")


class RowwiseParallel(_TorchRowwise):
    """Row-parallel (weight split along its inputs K), like ``torch.distributed.tensor.parallel.RowwiseParallel``
    and with its arguments, for ``nn.Linear`` (torch's own style), :class:`~tilegemm.nn.Int4Linear` (a local 4-bit
    weight of K / ranks rows, whole quantization groups; act-order weights gather their input, docs/parallel.md)
    and :class:`~tilegemm.nn.Conv2d` (input channels). Input split along its last dim (a convolution's channels:
    dim 1, or 0 unbatched); each rank's partial output summed by an all-reduce (or reduce-scattered to
    ``output_layouts``). The bias is added once."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._default_input = input_layouts is None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        given = _CHANNELS if self._default_input else self.input_layouts
        return _apply_style(self, module, device_mesh, "in", given, self.output_layouts, super()._apply)


# --- MoE experts ----------------------------------------------------------------------------------------------

_INT4_EXPERT_PARTS = ("qweight", "scales", "zeros")  # (an up side's act-order perm, over all of H, stays whole)
_ACT_ORDER_DOWN = ("ExpertsTensorParallel: act-order 4-bit experts (GPTQ desc_act) cannot be split along the "
                   "intermediate size: each expert's down projection reads its inputs in its own order, from every "
                   "rank's slice")


def _experts_names(module: nn.Module) -> tuple[str, str]:
    """(the up-side weight's name, ``"down_proj"``) of a transformers experts block, 16-bit or 4-bit."""
    for up in ("gate_up_proj", "up_proj"):
        for name in (up, f"tilegemm_{up}_qweight"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and t.dim() == 3:
                down = getattr(module, "down_proj", getattr(module, "tilegemm_down_proj_qweight", None))
                if isinstance(down, torch.Tensor) and down.dim() == 3:
                    return up, "down_proj"
    raise NotImplementedError(f"ExpertsTensorParallel splits a transformers MoE experts block (3-D gate_up_proj or "
                              f"up_proj, and down_proj: Qwen3-MoE's, Mixtral's, ...), not {type(module).__name__}")


def _up_ranges(module: nn.Module, I2: int, gated: bool, rank: int, world: int) -> list[tuple[int, int]]:
    """The ranges of up-side output columns (of ``I2``) rank ``rank`` holds: a gated, concatenated block's gate
    columns and the matching up columns (``[gate | up]`` -> ``[gate shard | up shard]``); else one contiguous
    range (an interleaved block's pairs stay whole: the range is even)."""
    if gated and getattr(module, "is_concatenated", True):
        i = _even("the experts' intermediate size I", I2 // 2, world)
        return [(rank * i, (rank + 1) * i), (I2 // 2 + rank * i, I2 // 2 + (rank + 1) * i)]
    pairs = 2 if gated else 1
    i = _even("the experts' intermediate size I", I2 // pairs, world) * pairs
    return [(rank * i, (rank + 1) * i)]


def _columns(ranges) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def _expert_group_check(I: int, i: int, world: int, group_size: int) -> None:
    if group_size == -1:
        raise ValueError(f"the experts' down_proj is quantized with group_size = -1 (one group over all of I = "
                         f"{I}): a split of I over {world} ranks would cut it; quantize with a group size that "
                         f"divides I / {world} = {i}")
    if i % group_size or i % 8:
        raise ValueError(f"a split of the experts' intermediate size I = {I} over {world} ranks ({i} each) would "
                         f"cut quantization groups of group_size = {group_size}: I / ranks must be a multiple of "
                         f"the group size")


def shard_experts_(module: nn.Module, rank: int, world: int) -> nn.Module:
    """Replace, in place, the stacked weights of the experts block ``module`` by rank ``rank``'s slice along the
    intermediate size I (of ``world``): the up side (``gate_up_proj`` ``[E, 2I, H]``: this rank's gate rows and
    the matching up rows) column-parallel, ``down_proj`` ``[E, H, I]`` row-parallel; ``is_transposed`` blocks
    alike; 4-bit experts (``tilegemm_<name>_qweight`` ``[E, K/8, N]``, scales and zeros ``[E, G, N]``) split N
    anywhere and K in whole quantization groups. The down bias is kept by the first rank only (zeros elsewhere).

    Raises ValueError naming the size that does not split evenly or the group size a split would cut, and
    NotImplementedError for a block whose output is not linear in its partial sums (a post-expert norm)."""
    up, down = _experts_names(module)
    if getattr(module, "tp_split", None) == "experts":
        raise ValueError(f"this experts block ({type(module).__name__}) is split already")
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError("ExpertsTensorParallel: this experts block normalizes each expert's output "
                                  "(has_post_expert_norm), which a partial sum over ranks cannot take")
    gated = up == "gate_up_proj"
    transposed = getattr(module, "is_transposed", False)
    int4 = hasattr(module, f"tilegemm_{up}_qweight")
    if int4 and getattr(module, "tilegemm_down_proj_perm", None) is not None:
        raise NotImplementedError(_ACT_ORDER_DOWN)
    if int4:  # [E, K/8, N] / [E, G, N]: N on dim 2 for every part
        q_up = getattr(module, f"tilegemm_{up}_qweight")
        q_down = getattr(module, "tilegemm_down_proj_qweight")
        I2, I = q_up.shape[2], q_down.shape[1] * 8
    else:
        w_up, w_down = getattr(module, up), getattr(module, down)
        I2 = w_up.shape[2] if transposed else w_up.shape[1]
        I = w_down.shape[1] if transposed else w_down.shape[2]
    if I2 != (2 * I if gated else I):
        raise ValueError(f"the experts' {up} has {I2} outputs but down_proj {I} inputs (expected "
                         f"{'2 * ' if gated else ''}{I})")
    cols = _columns(_up_ranges(module, I2, gated, rank, world))
    i = I // world
    rows = slice(rank * i, (rank + 1) * i)
    with torch.no_grad():
        if int4:
            gs = expert_group_size(module, "down_proj")  # down's own: it may differ from gate_up's
            _expert_group_check(I, i, world, gs)
            for part in _INT4_EXPERT_PARTS:
                name = f"tilegemm_{up}_{part}"
                t = getattr(module, name)
                module.register_buffer(name, t.index_select(2, cols.to(t.device)).contiguous())
                name = f"tilegemm_down_proj_{part}"
                t = getattr(module, name)
                sl = slice(rows.start // 8, rows.stop // 8) if part == "qweight" else \
                    slice(rows.start // gs, rows.stop // gs)
                module.register_buffer(name, t[:, sl].contiguous())
            from tilegemm.nn.moe import _remake_fragments

            _remake_fragments(module)  # the kept fragment layouts were the unsharded experts'
        else:
            for name, local in ((up, w_up.index_select(2 if transposed else 1, cols.to(w_up.device))),
                                (down, w_down[:, rows] if transposed else w_down[:, :, rows])):
                old = getattr(module, name)
                setattr(module, name, nn.Parameter(local.contiguous(), requires_grad=old.requires_grad))
        if getattr(module, "has_bias", False):
            b_up, b_down = getattr(module, f"{up}_bias", None), getattr(module, f"{down}_bias", None)
            if b_up is not None:
                setattr(module, f"{up}_bias", nn.Parameter(b_up.index_select(-1, cols.to(b_up.device)).contiguous(),
                                                          requires_grad=b_up.requires_grad))
            if b_down is not None and rank != 0:  # added once, by the first rank, before the all-reduce sums
                setattr(module, f"{down}_bias", nn.Parameter(torch.zeros_like(b_down),
                                                            requires_grad=b_down.requires_grad))
    if isinstance(getattr(module, "intermediate_dim", None), int):
        module.intermediate_dim = i
    module.tp_split = "experts"
    return module


def _experts_part(module: nn.Module, leaf: str, sl, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of the experts block tensor ``leaf`` read from the safetensors slice ``sl`` (of the
    unsharded block), as :func:`shard_experts_` cuts it: the up side's columns (two ranges for a gated,
    concatenated block), the down side's rows along I (whole quantization groups), the down bias on rank 0."""
    shape = tuple(sl.get_shape())
    up = "gate_up_proj" if leaf.startswith(("gate_up_proj", "tilegemm_gate_up_proj")) else \
        "up_proj" if leaf.startswith(("up_proj", "tilegemm_up_proj")) else "down_proj"
    transposed = getattr(module, "is_transposed", False)
    part = leaf.rpartition("_")[2] if leaf.startswith("tilegemm_") else None
    if leaf == "down_proj_bias":
        t = sl[()] if shape else sl[:]
        return t if rank == 0 else torch.zeros_like(t)
    if part == "perm":  # act-order experts: the up side's input orders cover all of H, kept whole
        if up == "down_proj":
            raise NotImplementedError(_ACT_ORDER_DOWN)
        return sl[:]
    if up != "down_proj":  # the up side: columns
        dim = len(shape) - 1 if leaf.endswith("_bias") or part else (2 if transposed else 1)
        ranges = _up_ranges(module, shape[dim], up == "gate_up_proj", rank, world)
        pieces = []
        for a, b in ranges:
            index = [slice(None)] * len(shape)
            index[dim] = slice(a, b)
            pieces.append(sl[tuple(index)])
        return torch.cat(pieces, dim).contiguous()
    if part is None:  # 16-bit down_proj [E, H, I] (or [E, I, H]): rows of I
        dim = 1 if transposed else 2
        i = _even("the experts' intermediate size I", shape[dim], world)
        index = [slice(None)] * 3
        index[dim] = slice(rank * i, (rank + 1) * i)
        return sl[tuple(index)].contiguous()
    # 4-bit down: qweight [E, I/8, H], scales and zeros [E, I/gs, H] (a block sharded already: gs != -1)
    gs = expert_group_size(module, "down_proj")  # down's own: it may differ from gate_up's
    per = 8 if part == "qweight" else gs
    I = shape[1] * per
    i = _even("the experts' intermediate size I", I, world)
    _expert_group_check(I, i, world, gs)
    return sl[:, rank * i // per:(rank + 1) * i // per].contiguous()  # (the kernels read the parts contiguous)


def _experts_hidden(module: nn.Module) -> int:
    """The hidden size H an experts block takes: its up side's inputs (``gate_up_proj`` ``[E, 2I, H]``, ``[E, H,
    2I]`` transposed; 4-bit qweight ``[E, H/8, 2I]``)."""
    up, _ = _experts_names(module)
    q = getattr(module, f"tilegemm_{up}_qweight", None)
    if q is not None:
        return q.shape[1] * 8
    return getattr(module, up).shape[1 if getattr(module, "is_transposed", False) else 2]


_HIDDEN = {"size": "hidden size H", "arg": "hidden_states"}  # how _check_width names an experts block's input


def _experts_input_hook(style, mesh, H, mod, args, kwargs):
    # Each rank computes its slice of the intermediate size from all of the hidden states and of the routing
    # weights: its output, and so its gradients of both, are partial sums (Partial): the backward all-reduces them
    # (or reduce-scatters to the input's layout), as a column-parallel layer's input gradient.
    args = list(args)
    if args:
        _check_width(style.input_layouts, mesh.size(), H, "experts", mod, args[:1], **_HIDDEN)
        args[0] = _to_local_input(args[0], mesh, style.input_layouts, (Replicate(),), (Partial(),))
    elif "hidden_states" in kwargs:
        _check_width(style.input_layouts, mesh.size(), H, "experts", mod, (kwargs["hidden_states"],), **_HIDDEN)
        kwargs["hidden_states"] = _to_local_input(kwargs["hidden_states"], mesh, style.input_layouts,
                                                  (Replicate(),), (Partial(),))
    # the routing (top_k_index, top_k_weights): the same on every rank; the weights' gradient a partial sum
    if len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].is_floating_point():
        args[2] = _to_local_input(args[2], mesh, (Replicate(),), (Replicate(),), (Partial(),))
    w = kwargs.get("top_k_weights")
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        kwargs["top_k_weights"] = _to_local_input(w, mesh, (Replicate(),), (Replicate(),), (Partial(),))
    args = [a.full_tensor() if isinstance(a, DTensor) else a for a in args]
    kwargs = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    return tuple(args), kwargs


class ExpertsTensorParallel(ParallelStyle):
    """Tensor-parallel MoE experts: a transformers experts block (Qwen3-MoE's, Mixtral's: stacked ``gate_up_proj``
    ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``; 4-bit after ``tilegemm.nn.quantize_``) split along the
    intermediate size I, as an MLP's column- then row-parallel pair: each rank holds I / ranks of every expert
    (its gate rows with the matching up rows), runs every expert the router picks on its slice, and one
    all-reduce sums the ranks' outputs. No token is exchanged; the router stays replicated.

    The block keeps plain local weights (:func:`shard_experts_`), so any experts implementation (``"tilegemm"``,
    transformers' ``"eager"``, ...) runs on them unchanged. ``input_layouts`` (default replicated) is the layout of
    the hidden states given to the block, ``output_layouts`` (default replicated) of its output, a local tensor
    unless ``use_local_output=False``. docs/parallel.md#moe-experts.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        register()
        rank, world = _mesh_rank(device_mesh)
        shard_experts_(module, rank, world)
        module.register_forward_pre_hook(partial(_experts_input_hook, self, device_mesh, _experts_hidden(module)),
                                         with_kwargs=True)
        module.register_forward_hook(partial(_int4_output_hook, self, device_mesh, (Partial(),)))
        return module


# --- sharded loading ----------------------------------------------------------------------------------------


def shard_slices(kind: str, shape, split: str, rank: int, world: int, group_size: int | None = None):
    """The slice of a checkpoint tensor that rank ``rank`` of ``world`` reads, as a tuple of slices (all of the
    tensor: ``()``), or None where the rank reads none of it (a row-parallel bias past the first rank).

    ``kind`` is the tensor's role: ``"weight"`` (``[N, K]``), ``"bias"``; the house int4 parts ``"qweight"``
    (``[K/8, N]``), ``"scales"``, ``"zeros"`` (``[G, N]``), ``"perm"``; GPTQ's ``"gptq.qweight"``,
    ``"gptq.qzeros"`` (``[G, N/8]``), ``"gptq.scales"``, ``"gptq.g_idx"``; AWQ's ``"awq.qweight"`` (``[K, N/8]``),
    ``"awq.qzeros"``, ``"awq.scales"``; compressed-tensors' ``"ct.weight_packed"`` (``[N, K/8]``),
    ``"ct.weight_scale"`` (``[N, G]``; also its unpacked zero points), ``"ct.weight_zero_point"`` (``[N/8, G]``,
    N a multiple of 8: a column-parallel load reads a padded one's rows itself), ``"ct.weight_g_idx"``.
    ``split`` is ``"out"`` (column-parallel) or ``"in"`` (row-parallel).
    """
    shape = tuple(int(s) for s in shape)
    every = ()

    def part(size, what, unit=1):
        n = _even(what, size, world)
        if n % unit:
            raise ValueError(f"{what} = {size} over {world} ranks gives {n} each, not a multiple of {unit} "
                             f"(the packing of this tensor)")
        return slice(rank * n, (rank + 1) * n)

    if split not in ("out", "in"):
        raise ValueError(f"split must be 'out' or 'in', got {split!r}")
    if kind == "weight":
        return (part(shape[0], "out_features N"),) if split == "out" else (slice(None), part(shape[1], "in_features K"))
    if kind == "bias":
        if split == "out":
            return (part(shape[0], "out_features N"),)
        return every if rank == 0 else None
    if kind in ("perm", "gptq.g_idx", "ct.weight_g_idx"):
        return every  # all of K: act-order picks its inputs from it
    if kind.startswith("ct."):  # compressed-tensors: output rows first
        if split == "out":
            if kind == "ct.weight_zero_point":  # packed along N: 8 rows a word
                rows = part(shape[0] * 8, "out_features N", 8)
                return (slice(rows.start // 8, rows.stop // 8),)
            if kind in ("ct.weight_packed", "ct.weight_scale"):
                return (part(shape[0], "out_features N"),)
        elif kind == "ct.weight_packed":
            K = shape[1] * 8
            k = _even("in_features K", K, world)
            _check_group_cut(K, k, world, group_size)
            return (slice(None), slice(rank * k // 8, (rank + 1) * k // 8))
        elif kind in ("ct.weight_scale", "ct.weight_zero_point"):
            if shape[1] == 1:
                raise ValueError("one quantization group over all of K (group_size = -1): a split along K "
                                 "would cut it")
            return (slice(None), part(shape[1], "quantization groups G"))
        raise ValueError(f"unknown tensor kind {kind!r}")
    if split == "out":
        if kind in ("qweight", "scales", "zeros", "gptq.qweight", "gptq.scales", "awq.scales"):
            return (slice(None), part(shape[1], "out_features N"))
        if kind in ("gptq.qzeros", "awq.qzeros", "awq.qweight"):  # packed along N: 8 columns a word
            cols = part(shape[1] * 8, "out_features N", 8)
            return (slice(None), slice(cols.start // 8, cols.stop // 8))
    else:
        # K in whole groups: rows of qweight hold 8 inputs (house, GPTQ) or 1 (AWQ); G rows of scales
        if kind in ("qweight", "gptq.qweight", "awq.qweight"):
            K = shape[0] * (1 if kind == "awq.qweight" else 8)
            k = _even("in_features K", K, world)
            _check_group_cut(K, k, world, group_size)
            per = 1 if kind == "awq.qweight" else 8
            return (slice(rank * k // per, (rank + 1) * k // per),)
        if kind in ("scales", "zeros", "gptq.qzeros", "gptq.scales", "awq.qzeros", "awq.scales"):
            G = shape[0]
            if G == 1:
                raise ValueError("one quantization group over all of K (group_size = -1): a split along K "
                                 "would cut it")
            return (part(G, "quantization groups G"),)
    raise ValueError(f"unknown tensor kind {kind!r}")


def _check_group_cut(K: int, k: int, world: int, group_size: int | None) -> None:
    if group_size is not None and group_size != -1 and k % group_size:
        raise ValueError(f"a split of K = {K} over {world} ranks ({k} each) would cut quantization groups of "
                         f"group_size = {group_size}: K / ranks must be a multiple of the group size")
    if group_size == -1:
        raise ValueError(f"group_size = -1 (one quantization group over all of K = {K}): a split along K would "
                         f"cut it")


def _plan_split(name: str, plan: dict) -> str | None:
    """``"out"``/``"in"``/None for module ``name`` under ``plan`` (module names or fnmatch patterns -> styles or
    the strings ``"colwise"``/``"rowwise"``)."""
    for pattern, style in plan.items():
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            if isinstance(style, _TorchColwise) or style == "colwise":
                return "out"
            if isinstance(style, _TorchRowwise) or style == "rowwise":
                return "in"
    return None


_INT4_PARTS = ("qweight", "scales", "zeros", "perm")


def _dtensor_slices(target: DTensor, shape, rank: int, world: int) -> tuple:
    """The slice of a checkpoint tensor of ``shape`` that is this rank's local part of ``target``'s layout
    (DTensor's chunks: ceil(size / ranks) each, the last ones shorter)."""
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"a tensor of shape {list(shape)} in the files, {list(target.shape)} in the model")
    slices = [slice(None)] * len(shape)
    for p in target.placements:
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            chunk = -(-shape[d] // world)
            slices[d] = slice(min(rank * chunk, shape[d]), min((rank + 1) * chunk, shape[d]))
        elif not isinstance(p, Replicate):
            raise ValueError(f"a parameter placed {p} cannot be loaded from an unsharded file")
    return tuple(slices)


def load_sharded_(model: nn.Module, files: str | Iterable[str], device_mesh: DeviceMesh, strict: bool = True,
                  device=None) -> nn.Module:
    """Fill ``model`` (parallelized already with :class:`ColwiseParallel`/:class:`RowwiseParallel`/
    :class:`ExpertsTensorParallel`, each module holding its local shapes) from safetensors ``files`` holding the
    *unsharded* state dict, each rank reading only its slice of every split tensor
    (``safe_open(...).get_slice(name)[...]``); tensors of modules outside the plan are read whole. Int4Linear
    layers read the house format (``Int4Linear.state_dict()``'s names), whose act-order rows are stored sorted by
    group, so a row-parallel shard is a slice too. Returns ``model``.
    """
    from safetensors import safe_open  # an optional dependency (the models extra), needed here only

    rank, world = _mesh_rank(device_mesh)
    files = [files] if isinstance(files, str) else list(files)
    modules = dict(model.named_modules())
    state, loaded, int4_keys = {}, set(), set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                mod_name, _, leaf = key.rpartition(".")
                module = modules.get(mod_name)
                if isinstance(module, Int4Linear) and getattr(module, "tp_split", None):
                    sl = f.get_slice(key)
                    slices = shard_slices(leaf, sl.get_shape(), module.tp_split, rank, world, module.group_size)
                    int4_keys.add(key)
                    if slices is None:  # a row-parallel int4 bias past the first rank: not held there
                        if getattr(module, "tp_has_bias", True):
                            loaded.add(key)
                        else:  # the layer has none on any rank: left over, named by the strict check
                            state[key] = f.get_tensor(key)
                        continue
                    state[key] = sl[slices] if slices else f.get_tensor(key)
                    continue
                if getattr(module, "tp_split", None) == "experts":  # ExpertsTensorParallel's local weights
                    state[key] = _experts_part(module, leaf, f.get_slice(key), rank, world)
                    continue
                target = None if module is None else (module._parameters.get(leaf) if leaf in module._parameters
                                                       else module._buffers.get(leaf))
                if isinstance(target, DTensor):  # torch's styles, ours for Linear and Conv2d: its placements say
                    sl = f.get_slice(key)
                    state[key] = sl[_dtensor_slices(target, sl.get_shape(), rank, world)]
                else:
                    state[key] = f.get_tensor(key)  # replicated: read whole
    for mod_name, module in modules.items():
        prefix = mod_name + "." if mod_name else ""
        split = getattr(module, "tp_split", None) if isinstance(module, Int4Linear) else None
        if split is None or prefix + "qweight" not in state:
            continue
        parts = {p: state.pop(prefix + p) for p in _INT4_PARTS if prefix + p in state}
        lacking = [prefix + p for p in ("scales", "zeros") if p not in parts]
        if lacking:
            raise ValueError(f"load_sharded_: the files hold {prefix}qweight but not {', '.join(lacking)}: an "
                             f"Int4Linear loads from its qweight, scales and zeros ({', '.join(files)})")
        perm = parts.get("perm")
        perm = perm if perm is not None and perm.numel() else None
        k = module.in_features  # local already
        try:
            w = Int4Weight(parts["qweight"].contiguous(), parts["scales"].contiguous(), parts["zeros"].contiguous(),
                           module.group_size, (module.out_features, k), perm if split == "out" else None)
        except (TypeError, ValueError) as err:  # the files' layer is not the model's (other widths, group size)
            raise type(err)(f"load_sharded_: {mod_name} (Int4Linear, local [out, in] = [{module.out_features}, {k}], "
                            f"group_size {module.group_size}): this rank's slice of the files' tensors does not fit: "
                            f"{err}") from None
        index = perm[rank * k:(rank + 1) * k].contiguous() if split == "in" and perm is not None else None
        dev = device if device is not None else module.qweight.device
        w = w.to(dev)
        module._set_weight(w)
        _set_input_index(module, index, dev)
        loaded.add(prefix + "tp_input_index")  # (made from the files' perm, which the files name)
        if prefix + "bias" in state and module.bias is not None:  # (a bias the layer has not: left unexpected)
            module.bias = nn.Parameter(state.pop(prefix + "bias").to(dev, w.dtype), requires_grad=False)
            loaded.add(prefix + "bias")
        loaded.update(prefix + p for p in (*_INT4_PARTS, "bias") if p in parts)
    from tilegemm.nn.moe import _adopt_perms, _remake_fragments

    for mod_name, module in modules.items():  # 4-bit experts: an act-order perm buffer follows the files, made
        if hasattr(module, "tilegemm_group_size"):  # or dropped as load_state_dict's pre-hook does
            _adopt_perms(module, state, mod_name + "." if mod_name else "")
    # The rest: a DTensor parameter takes its slice as its local tensor; plain ones are copied.
    for key in list(state):
        mod_name, _, leaf = key.rpartition(".")
        module = modules.get(mod_name)
        is_param = module is not None and leaf in module._parameters
        target = None if module is None else module._parameters.get(leaf) if is_param else module._buffers.get(leaf)
        if target is None:
            continue  # not in the model: named by the strict check below
        value = state.pop(key)
        dev = device if device is not None else target.device
        if isinstance(target, DTensor):
            new = DTensor.from_local(value.to(dev, target.dtype), target.device_mesh, target.placements,
                                     run_check=False, shape=target.shape, stride=target.stride())
        else:
            if tuple(value.shape) != tuple(target.shape):  # a local shard the files' tensor does not fit
                raise ValueError(f"load_sharded_: {key} is {list(value.shape)} in the files but "
                                 f"{list(target.shape)} in the model")
            new = value.to(dev, target.dtype)
        if is_param:
            module._parameters[leaf] = nn.Parameter(new, requires_grad=target.requires_grad)
        else:
            module._buffers[leaf] = new
        loaded.add(key)
    for mod_name, module in modules.items():  # 4-bit experts given new parts: their kept fragments were the old ones'
        prefix = f"{mod_name}." if mod_name else ""  # (the block itself may be the model: no prefix)
        if hasattr(module, "tilegemm_group_size") and any(k.startswith(prefix + "tilegemm_") for k in loaded):
            _remake_fragments(module)
        elif isinstance(module, Int4Linear) and not getattr(module, "tp_split", None) \
                and any(prefix + p in loaded for p in ("qweight", "scales", "zeros")):
            module._set_fragments(module._weight())  # a replicated layer's: made now, for a model compiled next
    if strict:
        missing = [k for k in model.state_dict() if k not in loaded]
        # a row-parallel 4-bit layer's bias lives on the first rank only: the others name it missing as it does
        missing += [f"{n}.bias" for n, m in modules.items() if isinstance(m, Int4Linear) and m.bias is None
                    and getattr(m, "tp_split", None) == "in" and getattr(m, "tp_has_bias", False)
                    and f"{n}.bias" not in int4_keys]
        if state or missing:
            raise ValueError(f"load_sharded_: names in the files but not in the model: {sorted(state)[:8]}; in the "
                             f"model but not in the files: {missing[:8]}")
    return model


# --- from_pretrained, tensor-parallel ---------------------------------------------------------------------------

_STYLES = {"colwise": "out", "rowwise": "in"}
# transformers' plan styles that keep a weight whole on every rank (a norm's, whose gradient is all-reduced)
_REPLICATED_STYLES = ("replicated_with_grad_allreduce", "replicate")


def resolve_plan(model: nn.Module, tp_plan) -> dict[str, str]:
    """``{module name: "out" | "in"}`` for the Linears of ``model`` that ``tp_plan`` splits: ``"auto"`` reads the
    transformers config's ``base_model_tp_plan`` (under the model's ``base_model_prefix``); a dict maps module
    names or fnmatch patterns to ``"colwise"``/``"rowwise"`` or to :class:`ColwiseParallel`/:class:`RowwiseParallel`.
    An ``"auto"`` plan's other entries (norms kept whole, packed or experts weights) leave what they name
    replicated, with a warning naming them where the plan meant to split them; a dict's are refused.
    """
    auto = isinstance(tp_plan, str) and tp_plan == "auto"
    if auto:
        config = getattr(model, "config", None)
        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        if not plan:
            raise ValueError("tp_plan='auto' needs a transformers model whose config has a base_model_tp_plan; "
                             "pass tp_plan as a dict of module names -> 'colwise' / 'rowwise'")
        # the plan names modules under the base model: its prefix, or (Llama-4's causal LM names a prefix it does
        # not hold) the first of "model" and the root under which the plan names a module
        prefix = getattr(model, "base_model_prefix", "")
        names = [n for n, _ in model.named_modules()]
        for p in ([prefix] if prefix and hasattr(model, prefix) else []) + ["model", ""]:
            trial = {(f"{p}.{k}" if p else k): v for k, v in plan.items()}
            if any(n == k or fnmatch.fnmatchcase(n, k) for k in trial for n in names):
                plan = trial
                break
    elif isinstance(tp_plan, dict):
        plan = tp_plan
    else:
        raise TypeError(f"tp_plan must be 'auto' or a dict of module names -> styles, got {type(tp_plan).__name__}")
    splits, left = {}, []
    for pattern, style in plan.items():
        if isinstance(style, _TorchColwise):
            split = "out"
        elif isinstance(style, _TorchRowwise):
            split = "in"
        elif style in _STYLES:
            split = _STYLES[style]
        elif auto:  # transformers' own styles for what tilegemm does not split: every rank holds it whole
            if style not in _REPLICATED_STYLES:
                left.append(f"{pattern} ({style})")
            continue
        else:
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r}: tilegemm splits Linears 'colwise' or 'rowwise' "
                             f"(ColwiseParallel / RowwiseParallel)")
        matched = False
        for name, module in model.named_modules():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                matched = True
                if not isinstance(module, (nn.Linear, Int4Linear)):
                    if auto:
                        left.append(f"{name} ({type(module).__name__})")
                        continue
                    raise ValueError(f"tp_plan[{pattern!r}] names {name}, a {type(module).__name__}, not a Linear")
                splits[name] = split
        if not matched and not auto:  # (a misspelt entry left its layers whole on every rank, in silence)
            linear = next((n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Int4Linear))), "")
            raise ValueError(f"tp_plan[{pattern!r}] matches no module of the model (its Linears are named as "
                             f"{linear!r})")
    if auto and left and not splits:
        raise ValueError(f"tp_plan='auto': the config's plan splits no Linear 'colwise' or 'rowwise' as tilegemm "
                         f"does; it names {', '.join(left[:6])}{' ...' if len(left) > 6 else ''}: pass tp_plan as a "
                         f"dict of module names -> 'colwise' / 'rowwise'")
    if left:
        warnings.warn(f"tp_plan='auto': {len(left)} entr{'y' if len(left) == 1 else 'ies'} of the config's plan "
                      f"that tilegemm does not split stay replicated (every rank holds them whole): "
                      f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}", stacklevel=2)
    if not splits:
        raise ValueError(f"tp_plan matches no Linear of the model: {list(plan)[:4]}")
    return splits


def _check_heads(model: nn.Module, world: int) -> None:
    """Column-parallel attention projections give each rank whole heads: the head counts must split evenly."""
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % world:
            raise ValueError(f"{key} = {heads} does not split evenly over {world} ranks: each rank must hold whole "
                             f"attention heads")


def _read_int4_shard(tensors, prefix: str, q, N: int, K: int, split: str, rank: int, world: int, dtype):
    """Rank ``rank``'s shard of the quantized Linear ``prefix`` (``[N, K]``) as ``(Int4Weight, input index)``,
    reading only its slices of the packed tensors; an act-order GPTQ layer split along K reads its tensors whole
    (its sorted rows are scattered over the stored K) and is cut after import, one layer at a time."""
    # load_quantized_ leaves the split layers to this read: their stored tensors are checked here, or an
    # asymmetric layer whose zero points are missing would be read as symmetric
    problems, missing = [], []
    _check_quant_shapes(tensors, prefix, q, N, K, f"a Linear [out, in] = [{N}, {K}]", problems, missing)
    if missing:
        problems.append(f"the checkpoint lacks {', '.join(missing)}")
    if problems:
        raise ValueError("; ".join(problems))
    gs = q.group_size
    if q.method != SAVED_METHOD and _regroups(gs, K):
        # a partial last group or a group length the kernels do not take: read whole and regrouped exactly (in
        # groups of a divisor of gcd(K, group_size)), then cut
        parts, g_idx = _stored_parts(tensors, prefix, q, dtype, K)
        return shard_int4(_import_columns(parts, g_idx, q, 0, N), split, rank, world)
    if q.method == SAVED_METHOD:  # tilegemm's own buffers (a model it saved): the house kinds
        perm = tensors.get(f"{prefix}.perm") if f"{prefix}.perm" in tensors else None
        perm = perm if perm is not None and perm.numel() else None
        G = tensors.shape(f"{prefix}.scales")[0]
        gs = -1 if G == 1 else K // G
        if split == "in" and perm is not None:  # as GPTQ's act-order below: whole, then cut
            w = _saved_weight(tensors.get(f"{prefix}.qweight"), tensors.get(f"{prefix}.scales").to(dtype),
                              tensors.get(f"{prefix}.zeros"), perm, (N, K), q.saved_sizes)
            return shard_int4(w, "in", rank, world)
        parts = {p: tensors.get_slice(f"{prefix}.{p}", shard_slices(p, tensors.shape(f"{prefix}.{p}"), split, rank,
                                                                    world, gs)).contiguous()
                 for p in ("qweight", "scales", "zeros")}
        n, k = (N // world, K) if split == "out" else (N, K // world)
        return _saved_weight(parts["qweight"], parts["scales"].to(dtype), parts["zeros"], perm, (n, k),
                             q.saved_sizes), None
    if q.method == "compressed-tensors":
        g_idx = ct_g_idx(_act_order(tensors, f"{prefix}.weight_g_idx", f"{prefix}.weight_scale", K, 1))
        if split == "in" and g_idx is not None:  # as GPTQ's below: whole, then cut after the import
            parts, _ = _stored_parts(tensors, prefix, q, dtype, K)
            return shard_int4(_import_columns(parts, g_idx, q, 0, N), "in", rank, world)
        parts = {}
        for role in ("qweight", "qzeros", "scales"):
            key = f"{prefix}.{q.leaf(role)}"
            if key not in tensors:  # (zero points: symmetric weights store none)
                parts[role] = None
                continue
            shape = tensors.shape(key)
            if role == "qzeros" and split == "out" and shape[0] != N:
                parts[role] = _ct_zero_rows(tensors, key, N, rank, world)
                continue
            # zero points stored unpacked ([N, G], older releases) lie as the scales do
            kind = "ct.weight_scale" if role == "qzeros" and shape[0] == N else f"ct.{q.leaf(role)}"
            parts[role] = tensors.get_slice(key, shard_slices(kind, shape, split, rank, world, gs))
        return from_compressed_tensors(parts["qweight"], parts["scales"].to(dtype), parts["qzeros"], g_idx), None
    if q.method == "awq":
        parts = {p: tensors.get_slice(f"{prefix}.{p}", shard_slices(f"awq.{p}", tensors.shape(f"{prefix}.{p}"),
                                                                    split, rank, world, gs))
                 for p in ("qweight", "qzeros", "scales") if f"{prefix}.{p}" in tensors}
        qzeros = parts.get("qzeros")  # (none stored: zero_point false)
        if qzeros is None:
            qzeros = awq_eights(parts["scales"].shape[0], parts["qweight"].shape[1], parts["scales"].device)
        return from_awq(parts["qweight"], qzeros, parts["scales"].to(dtype)), None
    g_idx = _act_order(tensors, f"{prefix}.g_idx", f"{prefix}.scales", K, 0)
    if split == "in" and g_idx is not None:
        w = from_gptq(tensors.get(f"{prefix}.qweight"), tensors.get(f"{prefix}.qzeros"),
                      tensors.get(f"{prefix}.scales").to(dtype), g_idx)
        w, index = shard_int4(w, "in", rank, world)
    else:
        parts = {p: tensors.get_slice(f"{prefix}.{p}", shard_slices(f"gptq.{p}", tensors.shape(f"{prefix}.{p}"),
                                                                    split, rank, world, gs))
                 for p in ("qweight", "qzeros", "scales")}
        w, index = from_gptq(parts["qweight"], parts["qzeros"], parts["scales"].to(dtype), g_idx), None
    if q.checkpoint_format == "gptq_v2":  # v2 stores the zero itself; from_gptq read v1's zero - 1 (exact in floats)
        w = Int4Weight(w.qweight, w.scales, w.zeros - 1, w.group_size, w.shape, w.perm)
    return _symmetric_zeros(w, q), index


def _ct_zero_rows(tensors, key: str, N: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of compressed-tensors' packed zero points ``key`` (``[ceil(N/8), G]``) of a Linear
    split along N, as the signed zeros ``[N / world, G]``: a rank's rows need not start at a word (N not a multiple
    of 8 pads only the last word, so slicing the words by ``ceil(N/8) / world`` hands a rank another's rows)."""
    n = _even("out_features N", N, world)
    first, last = rank * n // 8, -(-(rank + 1) * n // 8)  # the words holding rows rank*n .. (rank+1)*n - 1
    rows = unpack_rows(tensors.get_slice(key, (slice(first, last),)).contiguous())
    start = rank * n - 8 * first
    return rows[start:start + n].to(torch.int8) - 8  # stored unsigned (zero + 8)


def _act_order(tensors, g_key: str, scales_key: str, K: int, g_dim: int) -> torch.Tensor | None:
    """A layer's stored group of each input (``g_key``), or None where it stores none or the natural order (no
    act-order); its scales' dim ``g_dim`` counts the groups."""
    if g_key not in tensors:
        return None
    g_idx = tensors.get(g_key)
    G = tensors.shape(scales_key)[g_dim]
    return None if torch.equal(g_idx.to(torch.int64).cpu(), torch.arange(K) // (K // G)) else g_idx


def load_quantized_sharded_(model: nn.Module, path, device_mesh: DeviceMesh, tp_plan="auto", dtype=None,
                            device=None) -> nn.Module:
    """:func:`tilegemm.models.from_pretrained`'s tensor-parallel load into ``model`` (built on the meta device):
    each Linear that ``tp_plan`` splits becomes this rank's :class:`~tilegemm.nn.Int4Linear` shard, read slice by
    slice from the checkpoint (:func:`shard_slices`), with the hooks of :class:`ColwiseParallel` /
    :class:`RowwiseParallel`; every other tensor is loaded whole (replicated) by ``load_quantized_``."""
    rank, world = _mesh_rank(device_mesh)
    q = quant_config(read_config(path))
    dtype = torch.float16 if dtype is None else dtype
    device = _default_device(device)
    splits = resolve_plan(model, tp_plan)
    _check_heads(model, world)
    tensors = _Tensors(os.fspath(path), torch.device("cpu"), model)
    styles = {"out": ColwiseParallel(), "in": RowwiseParallel()}
    with unchanged_on_error(model), torch.no_grad():  # a refusal at any layer leaves the model as it was given
        for name, split in splits.items():
            if f"{name}.{q.leaf('qweight')}" not in tensors:
                raise ValueError(f"tp_plan splits {name}, which the checkpoint does not store quantized: "
                                 f"from_pretrained splits 4-bit layers (load_sharded_ takes 16-bit ones)")
            m = model.get_submodule(name)
            N, K = m.out_features, m.in_features
            # (its own config where the checkpoint's rules give one, by the name the quantizer knew it by)
            stored = tensors.stored_module(name, (q.leaf("qweight"), "weight"))
            qm = q.for_module(stored, alias=name)
            if qm is None:  # (the rule named, as the unsplit load names it)
                raise ValueError(f"tp_plan splits {name}, which is {_left_16_bit_by(q, stored, name, qm)}, though "
                                 f"the checkpoint stores it packed")
            if qm.bits != 4:
                raise ValueError(f"tp_plan splits {name}, which the checkpoint's {qm.rule or q.key or 'settings file'} "
                                 f"stores with bits = {qm.bits!r}, though the checkpoint stores it packed")
            if _named_16_bit(q, stored, name):
                # (refused as load_quantized_ refuses it unsplit: the config and the tensors disagree)
                raise ValueError(f"tp_plan splits {name}, which is {_left_16_bit_by(q, stored, name, qm)} but the "
                                 f"checkpoint stores it quantized")
            try:
                w, index = _read_int4_shard(tensors, name, qm, N, K, split, rank, world, dtype)
            except ValueError as err:
                raise ValueError(f"{name} ({qm.describe()}), split {'N' if split == 'out' else 'K'} over {world} "
                                 f"ranks: {err}") from None
            _check_weight_range(w, name)  # (scales converted to fp16 whose weights pass its range: refused)
            bias = None
            if f"{name}.bias" in tensors:
                sl = shard_slices("bias", tensors.shape(f"{name}.bias"), split, rank, world)
                bias = None if sl is None else tensors.get_slice(f"{name}.bias", sl) if sl else \
                    tensors.get(f"{name}.bias")
            local = Int4Linear.from_weight(w.to(device), None)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    attach_int4(styles[split], local, device_mesh, split, index,
                                None if bias is None else bias.to(device, dtype)))
        load_quantized_(model, path, dtype=dtype, device=device, loaded=tuple(splits))
    if world > 1 and callable(getattr(model, "save_pretrained", None)):
        # transformers' save_pretrained would write this rank's shards under the whole model's config (a checkpoint
        # refused at reload): refused now, naming what does work
        model.save_pretrained = functools.partial(_sharded_save_refused, type(model).__name__, world)
    return model


def _sharded_save_refused(model_name: str, world: int, *args, **kwargs):
    raise RuntimeError(f"this {model_name} was loaded tensor-parallel over {world} ranks: each rank holds only its "
                       f"shards of the split layers, which save_pretrained would write as the whole model. Save from "
                       f"a load without device_mesh (tilegemm.models.from_pretrained(path)), or keep each rank's "
                       f"state_dict(): it loads into the same rank of a model loaded the same way")


def from_pretrained_sharded(path, device_mesh: DeviceMesh, tp_plan="auto", dtype: torch.dtype = torch.float16,
                            device=None, model_class=None, experts_implementation: str | None = None) -> nn.Module:
    """``tilegemm.models.from_pretrained(path, device_mesh=..., tp_plan=...)``: the checkpoint's model built on the
    meta device, then each rank's shards read and placed (:func:`load_quantized_sharded_`)."""
    dtype = resolve_dtype(dtype, path)
    model, device = empty_model(path, dtype, device, model_class, experts_implementation)
    load_quantized_sharded_(model, path, device_mesh, tp_plan, dtype=dtype, device=device)
    load_generation_config_(model, path)
    return model.eval()
