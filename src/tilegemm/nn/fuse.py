"""Sibling 4-bit projections of one input as one product: :func:`fuse_projections_`.

A decoder layer multiplies its attention input by three weights (``q_proj``, ``k_proj``, ``v_proj``) and its MLP
input by two (``gate_proj``, ``up_proj``). At decode sizes each product is a short kernel whose launch, ramp and
tail cost about as much as reading a small weight (the key and value projections of a grouped-query model are a
quarter of the query's or less), so one product over the weights joined along their outputs reads the same
bytes in fewer, longer kernels. The modules keep their names and state dict; the model's own forward still calls
each one.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from tilegemm.nn.hooks import has_hooks
from tilegemm.nn.int4 import Int4Linear, _is_dtensor
from tilegemm.nn.linear import NotScriptable, traced_call
from tilegemm.ops.w4a16.format import Int4Weight, concat_outputs

__all__ = ["FusedProjections", "ProjectionPart", "fuse_projections_", "GROUPS"]

# Sibling names that read one input in the models this targets (Llama, Mistral, Qwen, Gemma, Phi's unfused ones,
# DeepSeek's dense layers; BERT-style attention; Mixtral-style w1/w3).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"), ("w1", "w3"))


def _drop_kept(owner, rest) -> None:
    """A backward hook: ``owner``'s kept outputs ``rest`` are dropped if they are still the ones kept."""
    module = owner()
    if module is not None and module._pending is not None and module._pending[2] is rest:
        module._pending = None


class FusedProjections(Int4Linear):
    """One :class:`Int4Linear` whose weight is its parts' joined along the outputs (parts' order). Its tensors are
    not in the state dict: each :class:`ProjectionPart` saves and loads its own columns."""

    def __init__(self):  # made by _fuse only
        raise TypeError("FusedProjections is made by tilegemm.nn.fuse_projections_")

    @classmethod
    def join(cls, parts: list[Int4Linear], names: tuple[str, ...]) -> "FusedProjections":
        w = concat_outputs([p.weight for p in parts])
        bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
        fused = cls.from_weight(w, None)
        if bias is not None:  # a buffer, out of the state dict (the parts save theirs), of the parts' dtype
            del fused.bias
            fused.register_buffer("bias", bias.detach().clone(), persistent=False)
        for name in list(fused._buffers):
            fused._non_persistent_buffers_set.add(name)
        fused.names = names
        fused.sizes = [p.out_features for p in parts]
        fused._pending = None  # (x, its version, {part: output}, grad and autocast modes) of the last product
        return fused

    def _load_from_state_dict(self, *args, **kwargs):  # nothing of its own to load (the parts load theirs)
        pass

    def __getstate__(self):  # copied and pickled without the kept outputs (tensors of a graph, a stale input)
        state = super().__getstate__()
        state["_pending"] = None
        return state

    def split(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index``'s output for ``x``: from the product just made for another part on this very ``x``
        (unchanged since), else from a new product, whose other parts' outputs are kept for their calls."""
        pending = self._pending
        # an inference tensor has no version counter: the same tensor is taken as unchanged, as when compiling
        unversioned = torch.compiler.is_compiling() or x.is_inference()
        # what else a product depends on: grad mode and x's requires_grad (a kept output made without either has no
        # graph to x) and autocast
        context = (torch.is_grad_enabled(), x.requires_grad, x.device.type in ("cuda", "cpu")
                   and torch.is_autocast_enabled(x.device.type))
        if pending is not None and pending[0] is x and (unversioned or pending[1] == x._version) \
                and pending[3] == context and index in pending[2]:
            out = pending[2].pop(index)
            if not pending[2]:
                self._pending = None
            return out
        y = self(x)  # (called, not its forward: hooks on the joined layer, an activation collector's, see the call)
        # a view each (narrow), not split's views made together, which autograd forbids changing in place
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        outs = [y.narrow(-1, a, n) for a, n in zip(starts, self.sizes)]
        # recorded by autograd, the views would share one version counter: a part changed in place would fail the
        # backward of another part's output saved before, so the parts kept for later calls are copies
        rest = {i: o.clone() if y.requires_grad else o for i, o in enumerate(outs) if i != index}
        self._pending = (x, 0 if unversioned else x._version, rest, context) if rest else None
        if rest and y.requires_grad and not torch.compiler.is_compiling():
            # a backward through this part frees the product's graph, which the kept outputs share: they are
            # dropped then, and a later part's call makes its own product (as unjoined layers would)
            owner = weakref.ref(self)
            y.register_hook(lambda grad: _drop_kept(owner, rest))
        return outs[index]

    def _apply(self, fn, recurse=True):  # moved or converted: outputs kept from before are not its outputs now
        self._pending = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{'+'.join(self.names)}: " + super().extra_repr()


class ProjectionPart(NotScriptable, nn.Module):
    """One projection of a :class:`FusedProjections`: ``forward(x)`` is its columns of the joined product (a view;
    the product runs once for the parts called in turn on one input), and its state dict is the
    :class:`Int4Linear`'s it replaced (same keys, shapes and values)."""

    def __init__(self, fused: FusedProjections, index: int, in_features: int, out_features: int, group_size: int):
        super().__init__()
        self.__dict__["fused"] = fused  # not a submodule: the parent holds it once
        self.index, self.in_features, self.out_features, self.group_size = index, in_features, out_features, \
            group_size
        self.start = sum(fused.sizes[:index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy):  # (the kept outputs are keyed by a tensor, which a Proxy is not)
            return traced_call(self, x)
        return self.fused.split(self.index, x)

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.fused.bias
        return None if b is None else b[self.start:self.start + self.out_features]

    @property
    def weight(self) -> Int4Weight:
        """This projection's 4-bit weight (a copy of its columns)."""
        return self._own().weight

    def dequantize(self) -> torch.Tensor:
        """This projection's weight ``[out_features, in_features]`` in 16 bits, as :meth:`Int4Linear.dequantize`."""
        return self._own().dequantize()

    def _own(self) -> Int4Linear:
        """An :class:`Int4Linear` of this projection's columns (copies)."""
        f, cols = self.fused, slice(self.start, self.start + self.out_features)
        perm = f.perm if f.perm.numel() else None
        w = Int4Weight(f.qweight[:, cols].contiguous(), f.scales[:, cols].contiguous(),
                       f.zeros[:, cols].contiguous(), f.group_size, (self.out_features, self.in_features),
                       None if perm is None else perm.clone())
        own = Int4Linear.from_weight(w)
        if self.bias is not None:  # in its own dtype: from_weight gives it the scales', an fp32 module's is fp32
            own.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return own

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        own = self._own()
        own._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        f = self.fused
        own = self._own()
        before = len(error_msgs)
        own._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs)
        if len(error_msgs) != before:
            return
        if f.qweight.is_meta and not own.qweight.is_meta and local_metadata.get("assign_to_params_buffers"):
            # a model built on the meta device, loaded with assign=True: the joined tensors are made where the
            # loaded part is (writing its columns into meta tensors would keep nothing)
            for name, t in list(f._buffers.items()):
                if t is not None and name not in ("fweight", "fzs"):
                    f._buffers[name] = torch.zeros_like(t, device=own.qweight.device)
            if own.perm.numel():
                f._buffers["perm"] = own.perm.clone()
        same_perm = torch.equal(own.perm, f.perm) if own.perm.numel() and f.perm.numel() \
            else own.perm.numel() == f.perm.numel()
        if own.group_size != f.group_size or not same_perm:
            error_msgs.append(f"{prefix[:-1]} is one part of fused projections ({'+'.join(f.names)}) of group size "
                              f"{f.group_size}{' with an act-order perm' if f.perm.numel() else ''}; the state dict "
                              f"holds group size {own.group_size}{' with another perm' if not same_perm else ''}: "
                              f"load it into the model before tilegemm.nn.fuse_projections_")
            return
        cols = slice(self.start, self.start + self.out_features)
        with torch.no_grad():
            for name in ("qweight", "scales", "zeros"):
                f._buffers[name][:, cols] = own._buffers[name]
            if f.bias is not None and own.bias is not None:
                f.bias[cols] = own.bias
        f._set_fragments(f._weight())
        for name in ("fweight", "fzs"):
            f._non_persistent_buffers_set.add(name)
        f._pending = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.fused.bias is not None}, "
                f"columns {self.start}..{self.start + self.out_features} of {'+'.join(self.fused.names)}")


def _joinable(mods: list[nn.Module]) -> bool:
    first = mods[0]
    if any(type(m) is not Int4Linear for m in mods):
        return False
    if any(_is_dtensor(t) for m in mods for t in m._buffers.values()):
        return False
    if any(has_hooks(m) for m in mods):
        return False
    if any(m.bias is not None and m.bias.requires_grad for m in mods):  # (the joined bias is a buffer: no training)
        return False
    same = lambda f: len({f(m) for m in mods}) == 1  # noqa: E731
    if not (same(lambda m: m.in_features) and same(lambda m: m.group_size) and same(lambda m: m.scales.dtype)
            and same(lambda m: m.qweight.device) and same(lambda m: m.bias is None)
            and same(lambda m: None if m.bias is None else m.bias.dtype) and same(lambda m: m.training)):
        return False
    perms = [m.perm for m in mods]
    if any(p.numel() for p in perms) and not all(p.numel() and torch.equal(p, perms[0]) for p in perms):
        return False
    return first.in_features > 0


def fuse_projections_(model: nn.Module, groups=GROUPS) -> nn.Module:
    """Join sibling :class:`Int4Linear` projections of one input into one product each; return ``model``.

    ``groups``: tuples of attribute names a module's children may have (default :data:`GROUPS`: ``q_proj``,
    ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``; ...). Where a module holds all of one tuple as
    ``Int4Linear``\\ s with one input width, group size, scales dtype, device, bias or none, and act-order
    permutation, each becomes a :class:`ProjectionPart` of one :class:`FusedProjections` (a child of that module
    named ``tilegemm_`` plus the names joined): the first part called on an input runs one product over all the
    weights, and the others, called on the same input (the same tensor, unchanged), take their columns of it.
    A part called on another input runs the product again, so any call order computes the same as before.
    Outputs are column views of the joined product (row stride the joined width), as
    ``torch.split`` gives; where autograd records the product, the parts taken after the first are copies of their
    columns (so that one changed in place does not change another saved for backward).

    Left as they are: projections held under several names or with hooks, DTensors, subclasses of Int4Linear,
    biases that require grad (trained).
    The state dict keeps every projection's keys, shapes and values (saved from the joined tensors; a state dict
    of the same group size and permutation loads into them). Memory: the weights once (the joined copy replaces
    the parts'). ``model.tilegemm_fused`` lists ``(parent name, names)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_projections_ takes a torch.nn.Module, got {type(model).__name__}")
    groups = tuple(tuple(g) for g in groups)
    if not groups or any(len(g) < 2 or not all(isinstance(n, str) and n for n in g) for g in groups):
        raise ValueError(f"groups must be tuples of two or more attribute names, got {groups!r}")
    held: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        held[id(m)] = held.get(id(m), 0) + 1
    fused_list = getattr(model, "tilegemm_fused", [])
    for parent_name, parent in list(model.named_modules()):
        for names in groups:
            mods = [parent._modules.get(n) for n in names]
            if any(m is None for m in mods) or any(held[id(m)] != 1 for m in mods) or not _joinable(mods):
                continue
            fused = FusedProjections.join(mods, names)
            fused.train(mods[0].training)
            parent.add_module("tilegemm_" + "_".join(names), fused)
            for i, (name, m) in enumerate(zip(names, mods)):
                part = ProjectionPart(fused, i, m.in_features, m.out_features, m.group_size)
                part.train(m.training)
                setattr(parent, name, part)
            fused_list.append((parent_name, names))
    model.tilegemm_fused = fused_list
    return model
