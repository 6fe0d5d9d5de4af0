"""``Int4Linear``: a drop-in ``nn.Linear`` with a 4-bit weight, and ``quantize_`` to swap a model's layers."""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Callable

import torch
from torch import nn

from tilegemm.nn.moe import (ALREADY_4BIT, SparseMoeBlock, _stacked_experts, apply_keeping_4bit_parts,
                             convert_moe_blocks_, expert_group_size, per_expert_mlps, quantize_experts_,
                             refuse_split_experts)
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.launch import dispatch_stack_depth, function_mode_on, functorch_level, jit_tracing
from tilegemm.core.runtime import check_dense
from tilegemm.ops.w4a16 import fragment_records as fragments
from tilegemm.nn.convert import (MHA_OUT_PROJ_KEPT, ConversionNote, attention_out_projections, is_conv1d,
                                 is_plain_linear, subclass_reason)
from tilegemm.nn.hooks import carry_over
from tilegemm.nn.transaction import unchanged_on_error
from tilegemm.nn.linear import Linear, NotScriptable, traced_call
from tilegemm.ops.w4a16 import api as w4a16_api
from tilegemm.ops.w4a16 import dispatch as w4a16_dispatch
from tilegemm.ops.w4a16.format import FLOAT_DTYPES, GROUP_SIZES, Int4Weight, check_group_size_value, \
    dequantize, dequantized_overflow, from_awq, from_compressed_tensors, from_gptq, one_group_size, quantize

_BUFFERS = ("qweight", "scales", "zeros", "perm")
_WEIGHT_BUFFERS = (*_BUFFERS, "fweight", "fzs")  # the weight's parts: their dtypes are the kernels', not the module's
_MODULE_DTYPES = (*FLOAT_DTYPES, torch.float32)
_AUTOCAST_DEVICES = ("cuda", "cpu")  # where the kernels run; torch.is_autocast_enabled raises for others (meta)




class Int4Linear(NotScriptable, nn.Module):
    """``y = x @ W.T + bias`` with ``W`` held as an :class:`~tilegemm.ops.w4a16.format.Int4Weight`.

    The weight's parts are buffers (``qweight``, ``scales``, ``zeros``, ``perm``; ``perm`` is empty unless the
    weight came from an act-order GPTQ checkpoint), so ``.to()``, ``state_dict`` and ``load_state_dict`` work as
    for any module; ``bias`` is a parameter. Make one with :meth:`from_linear`, :meth:`from_gptq`,
    :meth:`from_awq`, :meth:`from_compressed_tensors`, or construct an empty one and load a state dict into it.
    The fragment layout the decode kernel reads (``fweight``, ``fzs``: not saved) follows the parts: written in
    place or replaced, they get it remade at the next call (docs/w4a16.md, "The fragment layout and the former
    `frag` kernel").

    The module's dtype is that of its activations and bias: fp16, bf16 or fp32. The kernels take 16-bit
    activations, so (unlike ``torch.nn.Linear``, which computes in fp32) an fp32 module rounds its input, each row
    scaled by a power of two into the 16-bit range, to the scales' dtype and returns the result in fp32; ``.float()`` makes such a module and keeps the scales
    16-bit (``.half()``/``.bfloat16()`` convert them). A float64 input (after ``.double()``) runs torch's product of
    the dequantized weight, in float64.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = 128,
                 dtype: torch.dtype = torch.float16, device=None):
        if dtype not in _MODULE_DTYPES:
            raise TypeError(f"Int4Linear's dtype must be fp16, bf16 or fp32, got "
                            f"{dtype_name(dtype) if isinstance(dtype, torch.dtype) else repr(dtype)}")
        for name, v in (("in_features", in_features), ("out_features", out_features)):  # (torch.zeros named neither)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"Int4Linear's {name} must be an int, got {type(v).__name__} {v!r}")
            if v < 0:
                raise ValueError(f"Int4Linear's {name} must be >= 0, got {v}")
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        w = quantize(torch.zeros(out_features, in_features, dtype=dtype, device=device), group_size)
        self._set_weight(w)
        # Frozen like the weight (an inference layer), as from_weight makes it: a trainable bias would keep every
        # call off the replay fast path under grad mode.
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def _set_weight(self, w: Int4Weight) -> None:
        for name, t in w.tensors().items():
            if t is None:
                t = torch.empty(0, dtype=torch.int64, device=w.device)
            self.register_buffer(name, t)
        self.group_size = w.group_size
        self._set_fragments(w)

    def _set_fragments(self, w: Int4Weight) -> None:
        # The fragment kernel's layout of the weight (Int4Weight.fragments()), made once, kept as buffers that move
        # with the module and are not saved (they follow from the others); empty where that kernel cannot run
        # (a device without it, a group length it does not take: no call reads it there, and it would double the
        # 4-bit memory). Used while it stands for the parts (_fragments_standing), remade where they change.
        if w4a16_dispatch.keeps_fragments(w.group_k, w.device, w.shape[-1]):
            fw, fzs = w.fragments()
        else:  # two tensors, not one under two names (which torch.jit.trace refuses)
            fw, fzs = (torch.empty(0, dtype=torch.int32, device=w.device) for _ in range(2))
        self.register_buffer("fweight", fw, persistent=False)
        self.register_buffer("fzs", fzs, persistent=False)
        self._note_fragments()

    # The record of what the kept layout was made of (tilegemm.ops.w4a16.fragment_records): None until it is made.
    _fragments_of = None

    def _fragment_tensors(self) -> tuple[tuple, tuple]:
        """``((qweight, scales, zeros), (fweight, fzs))``: the parts the layout is made of (with the group size;
        not perm, by which x is reordered apart) and the layout."""
        b = self._buffers
        return (b["qweight"], b["scales"], b["zeros"]), (b["fweight"], b["fzs"])

    def _note_fragments(self) -> None:
        """Record that the kept layout stands for the parts the layer holds now."""
        parts, layout = self._fragment_tensors()
        self._fragments_of = fragments.record(parts, layout, self.group_size) \
            if all(type(t) is torch.Tensor for t in (*parts, *layout)) else None

    def _fragments_current(self) -> bool:
        return fragments.stands_for(self._fragments_of, *self._fragment_tensors(), self.group_size)

    def _fragments_standing(self):
        """``(layout, current)``: the kept layout ``(fweight, fzs)`` where it stands for the current qweight, scales
        and zeros, otherwise remade of them, or None for this call where it cannot be remade (the kernels then take
        the parts); and whether the record stands for the parts."""
        parts, layout = self._fragment_tensors()
        if torch.compiler.is_compiling():
            # a graph cannot repack, and reads no version (data-dependent): the kept layout only for the very
            # tensors it was made of, unwritten when traced; the op checks it again when the graph runs (a part
            # written since, other parts: fragment_records.layout_for)
            current = fragments.traced_stands_for(parts, layout, self.group_size)
        else:
            current = fragments.stands_for(self._fragments_of, parts, layout, self.group_size)
            if not current and self._remakes_fragments(parts):
                self._set_fragments(self._weight())
                parts, layout = self._fragment_tensors()
                current = True
        return (layout if current and layout[0].numel() else None), current

    def _remakes_fragments(self, parts) -> bool:
        """Whether this call may remake the layout: plain tensors and a plain call (no capture, whose replays would
        not repack; no tracer, torch.func transform or mode, which would record or batch the packing)."""
        return all(type(t) is torch.Tensor for t in parts) and not (
            dispatch_stack_depth() or function_mode_on() or jit_tracing() or functorch_level() is not None
            or (parts[0].is_cuda and torch.cuda.is_current_stream_capturing()))

    @property
    def weight(self) -> Int4Weight:
        """The 4-bit weight, a view on the buffers (no copy), with the fragment layout of these parts."""
        frag, current = self._fragments_standing()
        if not current or torch.compiler.is_compiling():
            return self._weight(frag)
        # The parts the record stands for are the very tensors of the last weight checked, unwritten: that weight
        # again without its checks (a decode step's host time: docs/w4a16.md, "The fragment layout ...").
        b = self._buffers
        perm, qweight, scales, zeros = b["perm"], b["qweight"], b["scales"], b["zeros"]
        key = (self.group_size, self.out_features, self.in_features)
        shapes = (qweight.shape, scales.shape, zeros.shape, perm.shape)
        seen = self.__dict__.get("_checked_weight")  # (the record's kept part and perm, weakly: no id is reused)
        if seen is not None and seen[0] == key and seen[1]() is self._fragments_of[4] and seen[2]() is perm \
                and seen[3] == shapes:
            return Int4Weight._checked_before(qweight, scales, zeros, self.group_size,
                                              (self.out_features, self.in_features), perm if perm.numel() else None,
                                              frag)
        w = self._weight(frag)
        self.__dict__["_checked_weight"] = (key, weakref.ref(self._fragments_of[4]), weakref.ref(perm), shapes)
        return w

    def _weight(self, frag=None) -> Int4Weight:
        perm = self.perm if self.perm.numel() else None
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size,
                          (self.out_features, self.in_features), perm, frag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = w4a16_api.matmul
        if type(x) is torch.Tensor:  # the common call (the module's own dtype, no autocast) first: host time
            device = "cuda" if x.is_cuda else x.device.type
            dtype, bias = x.dtype, self.bias
            if device in _AUTOCAST_DEVICES and not torch.is_autocast_enabled(device) \
                    and dtype is self._buffers["scales"].dtype and (bias is None or bias.dtype is dtype):
                return matmul(x, self.weight, bias=bias)
        if isinstance(x, torch.fx.Proxy):
            return traced_call(self, x)
        dtype = getattr(x, "dtype", None)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and dtype is not torch.float64 \
                and x.device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(x.device.type):
            # (float64 is left as autocast leaves it, as torch.nn.Linear's under autocast: torch's product below)
            cast = torch.get_autocast_dtype(x.device.type)
            if cast in FLOAT_DTYPES:  # autocast: the product in its dtype, as torch.nn.Linear's under autocast
                w = self.weight if self.scales.dtype == cast else self._weight().to(cast)
                return matmul(x.to(cast), w, bias=None if self.bias is None else self.bias.to(cast))
        if dtype is torch.float64:  # (.double()): no kernel takes it; torch's product of the weight it stands for,
            # as tilegemm.nn.Linear runs torch's linear (the kernel's 16-bit activations would undo gradcheck)
            bias = None if self.bias is None else self.bias.to(dtype)
            return nn.functional.linear(x, self.dequantize().to(dtype), bias)
        if dtype is torch.float32:  # an fp32 module: 16-bit activations in, fp32 out
            return _fp32_through_16bit(x, self.weight, self.bias)
        if dtype in FLOAT_DTYPES:
            # the layer's dtypes named here: the product's own check would name its internal weight
            module = self.scales.dtype if self.bias is None or self.bias.dtype in FLOAT_DTYPES else self.bias.dtype
            if dtype != self.scales.dtype or module != self.scales.dtype:
                give = f"give it {dtype_name(module)} input, " if module in FLOAT_DTYPES else ""
                raise TypeError(f"Int4Linear(in_features={self.in_features}, out_features={self.out_features}) is "
                                f"a module of dtype {dtype_name(module)} (scales {dtype_name(self.scales.dtype)}) and "
                                f"got input of dtype {dtype_name(dtype)}: {give}convert the module (.to({dtype})), or "
                                f"run it under torch.autocast")
        return matmul(x, self.weight, bias=self.bias)

    def _apply(self, fn, recurse=True):
        # .float() / .to(torch.float32) make an fp32 module (bias, activations); the scales stay 16-bit, the
        # packed parts int (.type(torch.float16) casts every buffer) and dense (a memory format is not theirs)
        current = self._fragments_current()
        from_meta = self._buffers["qweight"].is_meta  # (to_empty: the parts hold no values yet, nothing to pack)
        out = apply_keeping_4bit_parts(self, lambda f: super(Int4Linear, self)._apply(f, recurse), fn,
                                       _WEIGHT_BUFFERS)
        if current:  # moved or cast with the parts (value by value, as the layout copies them)
            self._follow_device(may_make=not from_meta)
        return out

    def _follow_device(self, may_make: bool) -> None:
        """After a move, a cast or unpickling, the layout standing for the parts: kept where their device keeps one
        (``dispatch.keeps_fragments``: a model compiled next traces no packing) and none elsewhere (no call reads
        it), made or dropped now where this call may, else left to the next plain call (the record cleared: never
        standing against the device's rule)."""
        parts, (fw, _) = self._fragment_tensors()
        if parts[0].is_meta or not all(type(t) is torch.Tensor for t in parts):
            self._note_fragments()
            return
        w = self._weight()
        if bool(fw.numel()) == w4a16_dispatch.keeps_fragments(w.group_k, w.device, w.shape[-1]):
            self._note_fragments()
        elif may_make and self._remakes_fragments(parts):
            self._set_fragments(w)
        else:
            self._fragments_of = None

    def __getstate__(self):  # copied and pickled with whether the layout stands for the parts, not the record
        state = super().__getstate__()
        state["_fragments_of"] = self._fragments_current()
        state.pop("_checked_weight", None)  # (a weak reference)
        return state

    def __setstate__(self, state):
        current = state.pop("_fragments_of", False)
        super().__setstate__(state)
        if current is True:  # (torch.load's map_location may have put the parts on another kind of device)
            self._follow_device(may_make=True)

    def dequantize(self) -> torch.Tensor:
        from tilegemm.ops.w4a16.format import dequantize

        return dequantize(self._weight())

    @classmethod
    def from_weight(cls, w: Int4Weight, bias: torch.Tensor | None = None) -> "Int4Linear":
        if not isinstance(w, Int4Weight):
            raise TypeError(f"from_weight takes an Int4Weight (tilegemm.w4a16.quantize / from_gptq / from_awq), got "
                            f"{type(w).__name__}")
        if len(w.shape) != 2:  # stacked experts are a MoE block's (quantize_experts_), not one layer's
            raise ValueError(f"from_weight takes a weight [out_features, in_features], got stacked experts "
                             f"{list(w.shape)}")
        N, K = w.shape
        if bias is not None:  # (checked here, not at the first forward)
            if not isinstance(bias, torch.Tensor):
                raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (N,):
                raise ValueError(f"bias must have shape [out_features] = [{N}], got {list(bias.shape)}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = K, N
        mod._set_weight(w)
        mod.bias = nn.Parameter(bias.detach().to(w.dtype).clone(), requires_grad=False) if bias is not None else None
        return mod

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = False) -> "Int4Linear":
        """Quantize an ``nn.Linear`` (round-to-nearest, per group), or transformers' ``Conv1D`` (GPT-2's layers,
        weight ``[in, out]``: the Linear of its transpose); fp32 layers get fp16 scales."""
        conv1d = is_conv1d(linear)
        if not (isinstance(linear, nn.Linear) or conv1d):
            raise TypeError(f"from_linear takes an nn.Linear (or transformers' Conv1D), got {type(linear).__name__}")
        if _is_dtensor(linear.weight):
            raise TypeError(_DTENSOR_ADVICE.format(what=f"this {type(linear).__name__}'s weight"))
        w = quantize(linear.weight.detach().T if conv1d else linear.weight.detach(), group_size, symmetric)
        mod = cls.from_weight(w, linear.bias)
        if mod.bias is not None and linear.bias.dtype == torch.float32:  # an fp32 layer stays an fp32 module
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return mod

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None) -> "Int4Linear":
        return cls.from_weight(from_gptq(qweight, qzeros, scales, g_idx), bias)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None) -> "Int4Linear":
        return cls.from_weight(from_awq(qweight, qzeros, scales), bias)

    @classmethod
    def from_compressed_tensors(cls, weight_packed, weight_scale, weight_zero_point=None, g_idx=None,
                                bias=None) -> "Int4Linear":
        return cls.from_weight(from_compressed_tensors(weight_packed, weight_scale, weight_zero_point, g_idx), bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # a one-group layer's shapes do not say -1 or K: the state dict's metadata (kept by torch.save) records it
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:
            metadata.setdefault(prefix[:-1], {})["group_size"] = self.group_size

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint may hold another layout than this module was built with (act-order perm, another group
        # size): its shapes are taken where they make a 4-bit weight of this module's [out, in]; otherwise the
        # buffers keep theirs and nn.Module reports each size mismatch, so a failed load leaves a layer that runs.
        own_dtype, own_perm = self.scales.dtype, self._buffers["perm"].dtype
        own_bias = None if self.bias is None else self.bias.dtype
        shapes, problem = self._incoming_shapes(state_dict, prefix)
        if shapes is not None:
            problem = self._incoming_overflow(state_dict, prefix, own_dtype)
            if problem is not None:
                shapes = None
        if problem is not None:
            # a refused weight keeps the layer's own parts and bias: those of its shapes torch's load would still
            # copy in (converting: a cast qweight as garbage words), so its own are copied; those of other shapes
            # torch names
            own = {n: self._buffers[n] for n in _BUFFERS} | ({} if self.bias is None else {"bias": self.bias})
            state_dict = {**state_dict, **{prefix + n: t for n, t in own.items()
                                           if isinstance(state_dict.get(prefix + n), torch.Tensor)
                                           and tuple(state_dict[prefix + n].shape) == tuple(t.shape)}}
            error_msgs.append(problem)
        for name, shape in (shapes or {}).items():
            t = self._buffers[name]
            if tuple(t.shape) != shape:  # the module's own dtypes: the load copies into them (converting)
                self._buffers[name] = torch.empty(shape, dtype=t.dtype, device=t.device)
        before = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name in ("scales", "zeros"):  # (load_state_dict(assign=True) puts the incoming tensors in place)
            if self._buffers[name].dtype != own_dtype:
                self._buffers[name] = self._buffers[name].to(own_dtype)
        # (assign=True too: the kernels read contiguous int32 words and an int64 order, as a copying load makes them)
        qweight = self._buffers["qweight"]
        if qweight.dtype != torch.int32:  # (the same low 32 bits: uint32 viewed, int64 truncated as a copy does)
            self._buffers["qweight"] = qweight.view(torch.int32) if qweight.dtype == torch.uint32 else \
                qweight.to(torch.int32)
        if self._buffers["perm"].dtype != own_perm:
            self._buffers["perm"] = self._buffers["perm"].to(own_perm)
        for name in _BUFFERS:
            if not self._buffers[name].is_contiguous():
                self._buffers[name] = self._buffers[name].contiguous()
        if own_bias is not None and self.bias is not None and self.bias.dtype != own_bias:  # (assign=True too)
            self.bias = nn.Parameter(self.bias.detach().to(own_bias), requires_grad=self.bias.requires_grad)
        loaded = len(error_msgs) == before and problem is None
        K, G = self.in_features, self.scales.shape[0]
        if G == 1:  # -1 or K, as the saved-format loader decides: the record (metadata), else the layer as built
            recorded = local_metadata.get("group_size") if loaded else None
            self.group_size = one_group_size(K, (recorded,) if recorded in (-1, K) and type(recorded) is int
                                             else (self.group_size,) if self.group_size in (-1, K) else ())
        elif G:  # (no groups: in_features is 0, the group size stays as built)
            self.group_size = K // G
        if loaded:
            self._set_fragments(self._weight())

    def _incoming_shapes(self, state_dict, prefix) -> tuple[dict | None, str | None]:
        """The buffer shapes a state dict brings, when they make a 4-bit weight of this module's
        ``[out_features, in_features]`` (None where it does not hold all of qweight, scales, zeros), and a message
        naming the keys and shapes when they do not."""
        got = {name: state_dict.get(prefix + name) for name in _BUFFERS}
        if any(got[n] is None for n in ("qweight", "scales", "zeros")):
            return None, None  # (a key it lacks is a missing key, as for any module)
        if any(t is not None and not isinstance(t, torch.Tensor) for t in got.values()):
            return None, None  # (a value that is not a tensor: nn.Module's load names it)
        K, N = self.in_features, self.out_features
        shape = {n: tuple(t.shape) for n, t in got.items() if t is not None}
        G = shape["scales"][0] if len(shape["scales"]) == 2 else -1
        why = None
        if shape["qweight"] != (K // 8, N):
            why = f"qweight must be [in_features / 8, out_features] = [{K // 8}, {N}]"
        elif len(shape["scales"]) != 2 or shape["scales"][1] != N or shape["zeros"] != shape["scales"]:
            why = f"scales and zeros must both be [groups, out_features] = [G, {N}]"
        elif K and (G < 1 or K % G or G > 1 and K // G not in GROUP_SIZES):
            why = f"{G} groups do not split in_features = {K} into a group size tilegemm takes " \
                  f"({', '.join(map(str, GROUP_SIZES))})"
        elif "perm" in shape and shape["perm"] not in ((0,), (K,)):
            why = f"perm must be empty or [in_features] = [{K}]"
        elif got["qweight"].dtype not in (torch.int32, torch.uint32, torch.int64):  # (a dict cast: .half())
            why = f"qweight must be int32 (eight 4-bit values a word), got {dtype_name(got['qweight'].dtype)}"
        elif not (got["scales"].is_floating_point() and got["zeros"].is_floating_point()):
            why = f"scales and zeros must be floating point, got {dtype_name(got['scales'].dtype)} and " \
                  f"{dtype_name(got['zeros'].dtype)}"
        elif got["perm"] is not None and (got["perm"].is_floating_point() or got["perm"].dtype == torch.bool):
            why = f"perm must hold integers, got {dtype_name(got['perm'].dtype)}"
        if why is None:
            return shape, None
        listing = ", ".join(f"{prefix}{n} {list(s)}" for n, s in shape.items())
        where = prefix[:-1] or "the module"
        return None, (f"the 4-bit weight in the state dict ({listing}) does not fit {where}, an "
                      f"Int4Linear(in_features={K}, out_features={N}, group_size={self.group_size}): {why}")

    def _incoming_overflow(self, state_dict, prefix, dtype: torch.dtype) -> str | None:
        """A message when the state dict's 4-bit weight, its scales converted to this layer's ``dtype`` (bf16 into
        fp16), holds scales or weights past that dtype's range (inf: NaN outputs), else None."""
        qweight, scales, zeros = (state_dict[prefix + n] for n in ("qweight", "scales", "zeros"))
        if scales.dtype == dtype or not scales.is_floating_point() or qweight.dtype != torch.int32 \
                or any(t.is_meta for t in (qweight, scales, zeros)):
            return None
        converted = scales.to(dtype)
        if bool(torch.isfinite(converted).all()) and not dequantized_overflow(
                qweight.to(scales.device), converted, zeros.to(scales.device, dtype), dtype):
            return None
        return (f"the 4-bit weight in the state dict ({prefix}scales {dtype_name(scales.dtype)}) holds values past "
                f"{dtype_name(dtype)}'s range, which become inf in {prefix[:-1] or 'the module'}, an "
                f"Int4Linear(in_features={self.in_features}, out_features={self.out_features}) of "
                f"{dtype_name(dtype)} scales: convert the layer first (.to({scales.dtype})); it kept its own weight")

    def extra_repr(self) -> str:
        # the module's dtype is its bias' (its activations'); the scales' is named too where it differs (fp32)
        scales = self.scales.dtype
        dtype = scales if self.bias is None else self.bias.dtype
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, dtype={dtype}" + (f", scales={scales}" if dtype != scales else ""))


def _fp32_through_16bit(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 ``x`` on the 16-bit kernels: each row divided by the power of two at or above
    its largest magnitude first and the product multiplied back (exact, the product being linear), so that fp32
    activations past the 16-bit range and products past it stay finite as in torch's fp32 Linear; rows holding an
    inf or a NaN, or only zeros, go as they are. The bias is added in fp32. Where a gradient is asked for, torch's
    fp32 product of the dequantized weight instead: the kernels' backward would pass the scaled rows' gradients
    through 16-bit tensors, where they overflow."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return nn.functional.linear(x, dequantize(weight).float(), None if bias is None else bias.float())
    check_dense("x", x)  # (the row scaling below reads x's sizes, which a nested tensor has not)
    if x.device != weight.device:  # (before the weight's bound meets x's rows: torch's error there names neither)
        raise ValueError(f"tensors are on different devices: x on {x.device}, w on {weight.device}")
    amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros((*x.shape[:-1], 1))
    # rows at most 1 give outputs at most the largest sum of a weight row's magnitudes: past 2^15 the rows go down
    # by the power of two that keeps the outputs in 16 bits too (a tensor, so no host sync; 0 for usual weights)
    exponent = torch.ceil(torch.log2(amax)) + _row_sum_exponent(weight)
    exponent = exponent.clamp(max=127)  # (2^128 is inf in fp32; |x| / 2^127 < 2 fits)
    scale = torch.where(torch.isfinite(amax) & (amax > 0), torch.exp2(exponent), 1.0)
    y = w4a16_api.matmul((x / scale).to(weight.dtype), weight).float() * scale
    return y if bias is None else y + bias.float()


_ROW_SUM_EXPONENTS: dict = {}  # id(scales) -> (scales, zeros (weakly), their state and group, exponent)


def _row_sum_exponent(weight: Int4Weight) -> torch.Tensor:
    """``max(0, ceil(log2(B)) - 15)`` for ``B`` a bound on any weight row's sum of magnitudes, from the scales and
    zeros alone (``|q - zero| <= max(|zero|, |15 - zero|)``), as an fp32 scalar tensor on the weight's device. A row
    whose bound is not finite (an inf or NaN scale) is left out: its outputs are inf or NaN anyway, and the others'
    scaling stays theirs. Kept per scales tensor in eager calls (a few small ops a call otherwise); not from a call
    under CUDA graph capture, whose tensor holds its value only once the graph replays."""
    scales, zeros = weight.scales, weight.zeros
    eager = not torch.compiler.is_compiling() and not (scales.is_cuda and torch.cuda.is_current_stream_capturing())
    # what a write changes: the storages' addresses (a `.data =` swap keeps the tensor and its version) and the
    # versions; none for inference tensors, which keep no version (their exponent is computed every call)
    state = None if not eager or scales.is_inference() or zeros.is_inference() else \
        (scales.data_ptr(), scales._version, zeros.data_ptr(), zeros._version, weight.group_k)
    if state is not None:
        kept = _ROW_SUM_EXPONENTS.get(id(scales))
        if kept is not None and kept[0]() is scales and kept[1]() is zeros and kept[2] == state:
            return kept[3]
    s, z = scales.float(), zeros.float()
    if s.numel():
        rows = (torch.maximum(z.abs(), (15 - z).abs()) * s.abs()).sum(-2)  # [..., N]: each row's, over its groups
        bound = torch.where(torch.isfinite(rows), rows, 0.0).amax() * weight.group_k
    else:
        bound = s.new_zeros(())
    exponent = (torch.ceil(torch.log2(bound)) - 15).clamp(min=0)
    if state is not None:  # (an entry leaves with its scales tensor)
        key = id(scales)
        _ROW_SUM_EXPONENTS[key] = (weakref.ref(scales, lambda _, key=key: _ROW_SUM_EXPONENTS.pop(key, None)),
                                   weakref.ref(zeros), state, exponent)
    return exponent


_DTENSOR_ADVICE = ("{what} is a DTensor (the model was parallelized, e.g. by parallelize_module): quantize "
                   "before parallelizing (tilegemm.nn.quantize_, then parallelize_module with "
                   "tilegemm.nn.ColwiseParallel / RowwiseParallel / ExpertsTensorParallel, docs/parallel.md)")


def _is_dtensor(t) -> bool:
    # torch.distributed.tensor is looked up, not imported: a DTensor exists only once it was imported
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _places(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (parent, attribute name) each module sits at, by the module's id: a module held under two names or by
    two parents has two (named_modules gives it once)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for child_name, child in parent._modules.items():
            if child is not None:
                places.setdefault(id(child), []).append((parent, child_name))
    return places


def untie_quantized_outputs_(model: nn.Module) -> list[str]:
    """Set ``tie_word_embeddings`` to False in the config of every transformers model in ``model`` whose output
    embedding is an :class:`Int4Linear` (a 4-bit layer cannot share the 16-bit embedding's weight): so
    ``tie_weights()``, ``save_pretrained`` and loading treat the two as the separate layers they are. Returns the
    names of the models changed."""
    done = []
    for name, m in model.named_modules():
        config, get_out = getattr(m, "config", None), getattr(m, "get_output_embeddings", None)
        if config is None or not callable(get_out) or not getattr(config, "tie_word_embeddings", False):
            continue
        try:
            out = get_out()
        except Exception:  # noqa: BLE001 (a model without an output layer of this form: nothing tied here)
            continue
        if isinstance(out, Int4Linear):
            configs = [config]
            text = config.get_text_config() if hasattr(config, "get_text_config") else None
            if text is not None and text is not config:
                configs.append(text)
            for c in configs:
                if getattr(c, "tie_word_embeddings", False):
                    c.tie_word_embeddings = False
            done.append(name)
    if done:  # transformers >= 5 keeps the tied names it found at construction: those of tensors gone are dropped
        for m in model.modules():
            tied = getattr(m, "all_tied_weights_keys", None)
            if isinstance(tied, dict) and tied:
                names = {n for n, _ in m.named_parameters(remove_duplicate=False)} | \
                        {n for n, _ in m.named_buffers(remove_duplicate=False)}
                m.all_tied_weights_keys = {k: v for k, v in tied.items() if k in names and v in names}
    return done


class _ResizeGuard:
    """A transformers model's ``resize_token_embeddings`` once its output layer is an :class:`Int4Linear`:
    transformers would resize the input embedding, then fail on the 4-bit output layer (it reads
    ``lm_head.weight.size()``), leaving the two of different sizes; refused here, before anything changes, with a
    ValueError that says what to do. Calls that change nothing return the input embedding; a model whose output
    layer is 16-bit again resizes as transformers does. A callable object in the instance's ``__dict__`` (as
    ``_KeepScales16``) so that deepcopy and pickling follow the model."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, *args, **kwargs):
        m = self.model
        out = m.get_output_embeddings()
        if not isinstance(out, Int4Linear):
            return type(m).resize_token_embeddings(m, new_num_tokens, pad_to_multiple_of, *args, **kwargs)
        embed = m.get_input_embeddings()
        target = new_num_tokens if new_num_tokens is not None else embed.weight.shape[0]
        if pad_to_multiple_of:  # as transformers rounds it
            target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
        if (new_num_tokens is None and pad_to_multiple_of is None) or target == out.out_features == \
                embed.weight.shape[0]:
            return embed  # nothing to resize (transformers would still read the 4-bit layer's weight and fail)
        raise ValueError(f"resize_token_embeddings({target}): the output layer of this {type(m).__name__} is a "
                         f"tilegemm.nn.Int4Linear (4-bit, out_features={out.out_features}), which transformers "
                         f"cannot resize; resize the token embeddings before quantizing (tilegemm.nn.quantize_), "
                         f"or keep the output layer 16-bit (quantize_'s filter). Nothing was changed")


def guard_quantized_output_resize_(model: nn.Module) -> list[str]:
    """Give every transformers model in ``model`` whose output layer is an :class:`Int4Linear` a
    ``resize_token_embeddings`` that refuses to resize it with a clear ValueError before changing anything
    (:class:`_ResizeGuard`), instead of transformers' failure half-way. Returns the names of the models guarded."""
    done = []
    for name, m in model.named_modules():
        if not callable(getattr(m, "resize_token_embeddings", None)) or not callable(
                getattr(m, "get_output_embeddings", None)):
            continue
        try:
            out = m.get_output_embeddings()
        except Exception:  # noqa: BLE001 (as in untie_quantized_outputs_: no output layer of this form)
            continue
        if isinstance(out, Int4Linear):
            if not isinstance(m.__dict__.get("resize_token_embeddings"), _ResizeGuard):
                # transformers' class is not tilegemm's to subclass: the method is replaced on the instance
                m.__dict__["resize_token_embeddings"] = _ResizeGuard(m)
            done.append(name)
    return done


SAVED_METHOD = "tilegemm"  # quant_method of the quantization_config a model holding 4-bit layers saves


def mark_saved_format_(model: nn.Module, converted_from: str | None = None) -> None:
    """Make a transformers model's config describe the 4-bit tensors it holds (and ``save_pretrained`` writes):
    ``quantization_config`` becomes ``{"quant_method": "tilegemm", "bits": 4, "group_size": ..., ...}``, which no
    loader takes for a GPTQ, AWQ or compressed-tensors checkpoint (``tilegemm.models.from_pretrained`` loads it as
    tilegemm's own), and every config of the model gets ``_is_quantized`` (transformers' flag, not saved). Models
    holding no 4-bit layer, or without such a config, are left as they are."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    sizes = sorted({m.group_size for m in model.modules() if isinstance(m, Int4Linear)}
                   | {expert_group_size(m, n) for m in model.modules() if hasattr(m, "tilegemm_group_size")
                      for n in ("gate_up_proj", "up_proj", "down_proj") if hasattr(m, f"tilegemm_{n}_qweight")})
    if not sizes:
        return
    # transformers' own mark of a model whose Linears hold no float weight (what its quantizers set): models that
    # read a Linear's weight directly (Jamba's and FalconMamba's dt_proj) call the module instead
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "to_dict"):
            c._is_quantized = True
    old = getattr(config, "quantization_config", None)
    old = old if isinstance(old, dict) else old.to_dict() if hasattr(old, "to_dict") else {}
    entry = {"quant_method": SAVED_METHOD, "bits": 4, "group_size": sizes[0] if len(sizes) == 1 else sizes,
             "format": "tilegemm.nn.Int4Linear buffers: qweight [K/8, N] int32, scales and zeros [G, N], perm; "
                       "4-bit experts as tilegemm_<weight>_qweight/_scales/_zeros"}
    source = old.get("converted_from") or (old.get("quant_method") if old.get("quant_method") != SAVED_METHOD
                                           else None) or converted_from
    if source:
        entry["converted_from"] = source
    # parameters one tensor holds under several names, recorded because the config may no longer say so: untying a
    # 4-bit output layer sets tie_word_embeddings False, which in transformers >= 5 unties every tie of the model
    # (BART's encoder and decoder embeddings from the shared one), and save_pretrained writes one name of each
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    groups = [names for names in tied.values() if len(names) > 1]
    if groups:
        entry["tied_parameters"] = groups
    config.quantization_config = entry
    if hasattr(config, "compression_config"):  # early compressed-tensors' key: it describes the tensors no more
        del config.compression_config


def _why_kept(module: nn.Module, group_size: int) -> str | None:
    """None when ``quantize_`` can swap ``module``, else the reason it keeps it."""
    if type(module) is Linear and module.activation not in (None, "none"):
        return f"tilegemm.nn.Linear with activation={module.activation!r} (Int4Linear fuses no activation)"
    if not (type(module) is Linear or is_plain_linear(module) or is_conv1d(module)):
        return subclass_reason(module, nn.Linear, "quantize")
    if "forward" in vars(module):  # the Int4Linear would run its own forward and silently drop this one
        return ("its forward was replaced on the instance (a tensor-parallel plan, accelerate's device_map hooks): "
                "quantize before applying those")
    if module.weight.dtype not in _MODULE_DTYPES:
        return f"weight dtype {dtype_name(module.weight.dtype)} (quantize takes fp16, bf16, fp32)"
    K = module.weight.shape[0] if is_conv1d(module) else module.in_features
    if K % 8:
        return f"in_features = {K} is not a multiple of 8 (eight 4-bit weights per int32)"
    if group_size != -1 and K % group_size:
        return f"in_features = {K} is not a multiple of group_size = {group_size}"
    return None


def _reads_tie_flag(cls: type) -> bool:
    """Whether ``cls.forward`` reads ``config.tie_word_embeddings`` (Udop and SwitchTransformers scale the decoder
    output by it), so that untying the output layer would change what the model computes."""
    import inspect

    try:
        return "tie_word_embeddings" in inspect.getsource(cls.forward)
    except (OSError, TypeError):  # (no source: a forward made at run time, a builtin)
        return False


def _tied_heads_kept(model: nn.Module) -> dict[int, str]:
    """The tied output layers ``quantize_`` keeps 16-bit, by id, with the reason: those of transformers models whose
    forward reads ``tie_word_embeddings`` (untying them, which a 4-bit head needs, would change the forward)."""
    kept = {}
    for m in model.modules():
        config, get_out = getattr(m, "config", None), getattr(m, "get_output_embeddings", None)
        if config is None or not callable(get_out) or not getattr(config, "tie_word_embeddings", False) \
                or not _reads_tie_flag(type(m)):
            continue
        try:
            out = get_out()
        except Exception:  # noqa: BLE001 (as in untie_quantized_outputs_: no output layer of this form)
            continue
        if isinstance(out, nn.Linear):
            kept[id(out)] = (f"the output layer tied to the input embedding of {type(m).__name__}, whose forward "
                             f"reads config.tie_word_embeddings (it scales the decoder output by it): a 4-bit layer "
                             f"would untie it and change that; kept 16-bit and tied")
    return kept


# The names transformers' MoE blocks give the Linear that scores the experts (LongCat's router.classifier).
# (Qwen-MoE's shared_expert_gate, one output: quantizers keep it 16-bit, and GPTQ's packing along N cannot hold it)
_ROUTER_NAMES = {"gate", "router", "classifier", "gating", "shared_expert_gate"}


def _router_ids(model: nn.Module) -> set[int]:
    """The routers of transformers' MoE blocks: Linears inside the module holding an experts block (stacked experts,
    or a ModuleDict / ModuleList of per-expert MLPs: SwitchTransformers, NLLB-MoE), outside the experts, under a
    router's name. Kept 16-bit as quantized checkpoints keep them (a model may read a router's weight itself:
    LongCat casts it to fp32)."""
    holders = []  # (the module holding the experts, the experts)
    for name, _, _ in _stacked_experts(model):
        parent_name = name.rpartition(".")[0]
        holders.append((model.get_submodule(parent_name) if parent_name else model, model.get_submodule(name)))
    holders += [(m, m.experts) for m in model.modules() if per_expert_mlps(m) is not None]
    ids = set()
    for parent, experts in holders:
        inner = {id(m) for m in experts.modules()}
        for sub, m in parent.named_modules():
            if isinstance(m, nn.Linear) and id(m) not in inner and _ROUTER_NAMES & set(sub.split(".")):
                ids.add(id(m))
    return ids


def quantize_(model: nn.Module, group_size: int = 128, filter: Callable[[str, nn.Module], bool] | None = None,
              symmetric: bool = False, *, warn: bool = True) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` (and transformers' ``Conv1D``, GPT-2's layers) that
    ``filter(name, module)`` accepts by an :class:`Int4Linear`, and the experts of transformers' MoE blocks by
    4-bit stacked ones (:func:`tilegemm.nn.moe.quantize_experts_`); returns ``model``.

    ``group_size`` is one of 32, 64, 128, 256 or -1 (all of K); anything else is a ValueError before any layer
    changes. Layers it cannot take (in_features not a multiple of 8 or of the group size, subclasses of Linear
    other than those in :data:`~tilegemm.nn.convert.LINEAR_EQUIVALENT` (Falcon's),
    float64 weights; MoE blocks with an experts weight whose K the group size does not divide, though K is not
    below it) are kept, and one :class:`~tilegemm.nn.convert.ConversionNote` warning names them with the reason
    (``warn=False`` silences it), as ``convert_`` does; the list is left in ``model.tilegemm_skipped`` as
    ``[(name, reason)]``.

    A Linear held under several names (shared by two blocks, or tied) becomes one Int4Linear under all of them
    (``filter`` is asked with its first name). The Int4Linear keeps the Linear's training flag and its forward and
    backward hooks (the handles still remove them); state-dict hooks, made for the Linear's weight, are not kept.
    A transformers model's output layer tied to its input embedding becomes a 4-bit layer of its own (the
    embedding stays 16-bit) and the config says so: ``tie_word_embeddings`` is set to False (``filter`` may keep
    ``lm_head`` 16-bit and tied instead); where the model's forward reads that flag (Udop and SwitchTransformers
    scale the decoder output by it), the tied output layer is kept 16-bit and tied, with a note. Its config's
    ``quantization_config`` then names tilegemm's format (``{"quant_method": "tilegemm", ...}``), which
    ``save_pretrained`` writes: docs/w4a16.md "Saving".
    Any other layer whose weight another module shares (a plain model's output layer tied to its embedding by
    assignment) is untied the same way, with a note; ``model.tilegemm_untied`` lists them as ``[(name, other)]``.
    A model whose weights are DTensors (parallelized already) is refused with a TypeError: quantize first, then
    parallelize with tilegemm's styles. :func:`tilegemm.nn.fuse_projections_` afterwards joins q/k/v and gate/up
    into one product each (docs/w4a16.md "Joined projections").
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise ValueError("quantize_ swaps the layers inside a model; to quantize one layer, use "
                         "tilegemm.nn.Int4Linear.from_linear")
    check_group_size_value(group_size, "quantize_")
    for flag, value in (("symmetric", symmetric), ("warn", warn)):
        if not isinstance(value, bool):  # (refused before anything changes; "no" would have been taken as True)
            raise TypeError(f"quantize_: {flag} must be True or False, got {value!r}")
    if filter is not None and not callable(filter):  # (it raised "'int' object is not callable" mid-walk)
        raise TypeError(f"quantize_: filter must be a callable (name, module) -> bool or None, got "
                        f"{type(filter).__name__}")
    for name, module in model.named_modules():  # refused before anything changes
        weights = [getattr(module, n, None) for n in ("weight", "gate_up_proj", "up_proj", "down_proj")]
        if (isinstance(module, nn.Linear) or is_conv1d(module) or any(isinstance(w, torch.Tensor) and w.dim() == 3
                                                                       for w in weights)) \
                and any(_is_dtensor(w) for w in weights) and (filter is None or filter(name, module)):
            raise TypeError(_DTENSOR_ADVICE.format(what=f"{name or 'the model'}'s weight"))
    refuse_split_experts(model, filter, "quantize_")
    # every change below (blocks converted, layers swapped, the config marked) undone if a layer is refused half-way
    # (a weight holding NaN or values whose scales pass fp16's range): the model is left as it was given
    with unchanged_on_error(model):
        _quantize_into(model, group_size, symmetric, warn, filter)
    return model


def _quantize_into(model: nn.Module, group_size: int, symmetric: bool, warn: bool, filter) -> None:
    """:func:`quantize_` once its arguments are checked."""
    # transformers 4.x's MoE blocks first: their experts stacked (then made 4-bit below), not one Int4Linear each;
    # their routers stay 16-bit (as quantized checkpoints keep them)
    _, skipped = convert_moe_blocks_(model, filter)
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)} | _router_ids(model)
    tied_kept = _tied_heads_kept(model)
    tied_kept.update(dict.fromkeys(attention_out_projections(model), MHA_OUT_PROJ_KEPT))
    targets = []
    for name, module in model.named_modules():  # (each module once, under its first name)
        if isinstance(module, Int4Linear) and (filter is None or filter(name, module)):
            skipped.append((name, ALREADY_4BIT.format(f" (group_size {module.group_size})")))
        if (isinstance(module, nn.Linear) or is_conv1d(module)) and id(module) not in routers \
                and (filter is None or filter(name, module)):
            reason = tied_kept.get(id(module)) or _why_kept(module, group_size)
            if reason is None:
                targets.append(module)
            else:
                skipped.append((name, reason))
    untied = _weights_held_elsewhere(model, targets, _transformers_tied_outputs(model))
    places = _places(model)
    names = {id(m): n for n, m in model.named_modules()}  # (each under its first name)
    while targets:  # one layer at a time, the 16-bit one dropped as its 4-bit one goes in (peak: one layer more)
        module = targets.pop(0)
        try:
            new = carry_over(module, Int4Linear.from_linear(module, group_size, symmetric))
        except (TypeError, ValueError) as err:  # (the weight's own values: non-finite, scales past fp16's range)
            raise type(err)(f"quantize_: {names[id(module)]}: {err}") from None
        for parent, child_name in places[id(module)]:  # every name it has: what was shared stays shared
            setattr(parent, child_name, new)
        del module, new
    quantize_experts_(model, group_size, filter, symmetric, skipped)  # transformers' MoE blocks: their 3-D experts
    skipped += [(name, f"{type(m).__name__} holds stacked experts but runs a forward of its own, not transformers' "
                       f"experts interface: its experts stay 16-bit")
                for name, m, takes in _stacked_experts(model) if not takes and (filter is None or filter(name, m))]
    untie_quantized_outputs_(model)
    guard_quantized_output_resize_(model)
    mark_saved_format_(model)
    _encoder_fast_paths_off_(model)
    model.tilegemm_skipped = skipped
    model.tilegemm_untied = untied
    if skipped and warn:
        listing = "; ".join(f"{n}: {r}" for n, r in skipped)
        warnings.warn(f"tilegemm.nn.quantize_ kept {len(skipped)} layer(s) as they were: {listing}",
                      ConversionNote, stacklevel=3)
    if untied and warn:
        listing = "; ".join(f"{n} (shared with {o})" for n, o in untied)
        warnings.warn(f"tilegemm.nn.quantize_ untied {len(untied)} layer(s) whose weight another module shares: "
                      f"{listing}; each 4-bit layer holds its own copy, so the two no longer train, load or change "
                      f"together (a filter that declines the layer keeps it 16-bit and tied)",
                      ConversionNote, stacklevel=3)


def _encoder_fast_paths_off_(model: nn.Module) -> None:
    """``torch.nn.TransformerEncoderLayer``'s inference fast path (``torch._transformer_encoder_layer_fwd``, taken
    in eval mode without autograd) reads ``linear1``'s and ``linear2``'s weights as tensors, which a 4-bit layer's
    is not: where either is an :class:`Int4Linear`, the layer takes its module path (the one training takes), which
    calls them. ``activation_relu_or_gelu`` is the flag torch reads to allow the fast path and nothing else (the
    module path applies ``activation`` itself). A ``torch.nn.TransformerEncoder`` holding such a layer stops turning a
    padded batch into a nested tensor for its layers (``use_nested_tensor``, set when it was built), which a 4-bit
    layer cannot read."""
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoderLayer) \
                and any(isinstance(getattr(m, n, None), Int4Linear) for n in ("linear1", "linear2")):
            m.activation_relu_or_gelu = 0
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and any(isinstance(x, Int4Linear) for x in m.modules()):
            m.use_nested_tensor = False


def _transformers_tied_outputs(model: nn.Module) -> set[int]:
    """The ids of the output layers of transformers models tied to their input embedding by the config, whose
    untying :func:`untie_quantized_outputs_` records in the config (documented, so not noted again)."""
    ids = set()
    for m in model.modules():
        config, get_out = getattr(m, "config", None), getattr(m, "get_output_embeddings", None)
        if config is not None and callable(get_out) and getattr(config, "tie_word_embeddings", False):
            try:
                ids.add(id(get_out()))
            except Exception:  # noqa: BLE001 (as in untie_quantized_outputs_: no output layer of this form)
                pass
    return ids


def _weights_held_elsewhere(model: nn.Module, targets: list[nn.Module], known: set[int]) -> list[tuple[str, str]]:
    """(layer name, other holder's name) for each layer about to become 4-bit whose weight tensor is also a
    parameter of a module that stays (a plain model's output layer tied to its embedding by assignment): the
    4-bit layer cannot share it, so quantizing unties the two."""
    going = {id(m) for m in targets}
    holders: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if id(m) in going:
            continue
        for pname, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(m)], holders[id(m.weight)][0]) for m in targets
            if id(m) not in known and isinstance(getattr(m, "weight", None), torch.Tensor)
            and id(m.weight) in holders]
