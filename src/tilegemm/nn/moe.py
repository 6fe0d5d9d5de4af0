"""Mixture-of-experts blocks of transformers on tilegemm's grouped kernels.

transformers (v5) keeps a MoE block's experts as 3-D tensors (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
``[E, H, I]``) and picks their forward by name from ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``
(``experts_implementation=`` when a model is built). :func:`register_experts` adds ``"tilegemm"`` there:

1. the token-expert pairs are ordered by expert, ``offs`` counted and the rows gathered on the device
   (:func:`tilegemm.ops.grouped.routing.moe_route`): no host sync, so a CUDA graph captures the block;
2. the gate/up product is one grouped GEMM whose epilogue applies the activation and the gate product
   (``tilegemm::grouped_mm_gated``) where the block uses transformers' default gate and a known activation, else a
   grouped GEMM and the block's own ``_apply_gate``;
3. the down product is a second grouped GEMM; the routing weights scale its rows, which go back to their tokens
   and are summed over the top-k in fp32 (:func:`tilegemm.ops.grouped.routing.moe_combine`).

:func:`quantize_experts_` turns every such block's experts into 4-bit ones (:func:`tilegemm.w4a16.quantize` of the
stacked weights), run by ``tilegemm.w4a16.grouped_matmul``'s kernel; ``tilegemm.nn.quantize_`` calls it.

transformers is imported only by :func:`register_experts` and :func:`quantize_experts_` (importing tilegemm must
not import it); ``import tilegemm`` registers at once when transformers is imported already, and otherwise when
``transformers.integrations.moe`` is first imported (a one-shot import hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings

import torch

from tilegemm.ops.w4a16 import fragment_records as fragments
from tilegemm.ops.w4a16.fragment_records import part_state
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.launch import plain_call
from tilegemm.nn.hooks import carry_over, tilegemm_hook
from tilegemm.nn.linear import NotScriptable
from tilegemm.nn.notes import ConversionNote
from tilegemm.ops.grouped.api import grouped_matmul, grouped_mm, moe_gate_up, moe_gate_up_int4
from tilegemm.ops.grouped.routing import moe_combine, moe_route
from tilegemm.ops.w4a16.format import (Int4Weight, check_group_size_value, concat_outputs, dequantized_overflow,
                                       quantize, stack_experts)

NAME = "tilegemm"
_MOE_MODULE = "transformers.integrations.moe"
_default_gate = None  # transformers' _default_apply_gate, taken when registering

# transformers' hidden_act names whose ACT2FN module is the same function as a tilegemm epilogue activation.
_FUSABLE = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu_pytorch_tanh": "gelu_tanh"}
_INT4 = ("qweight", "scales", "zeros")


def register_experts() -> bool:
    """Register the ``"tilegemm"`` experts implementation with transformers; True when transformers has the
    interface (``ALL_EXPERTS_FUNCTIONS``), False when the installed version lacks it. Idempotent."""
    global _default_gate
    try:
        moe = importlib.import_module(_MOE_MODULE)
    except ImportError:
        return False
    interface = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    if interface is None:
        return False
    _default_gate = getattr(moe, "_default_apply_gate", None)
    if NAME not in interface:
        type(interface).register(NAME, experts_forward)
    return True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the experts implementation right after ``transformers.integrations.moe`` is first imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MOE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _remove_hook()
            try:
                sys.modules[fullname] = module
                register_experts()
            except Exception:  # noqa: BLE001 - a failed registration must not break importing transformers
                pass

        loader.exec_module = exec_module
        return spec


_hook = _RegisterOnImport()


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def install() -> None:
    """Called when tilegemm.nn is imported: register now if transformers' MoE module is loaded, else on its import."""
    if _MOE_MODULE in sys.modules:
        register_experts()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)  # ahead of the path finder that would otherwise find the module first


# --- the experts forward ---------------------------------------------------------------------------------------


def expert_group_size(module, name: str) -> int:
    """The group size of the block's 4-bit experts ``name`` (``"gate_up_proj"``, ``"up_proj"``, ``"down_proj"``):
    each weight has its own (a down projection whose K, the expert width, is below the group size is one group
    over all of K, -1), recorded by :func:`install_int4_experts_`; a block without that record has one for all."""
    return module.__dict__.get("tilegemm_group_sizes", {}).get(name, module.tilegemm_group_size)


def weight_group_size(K: int, group_size: int) -> int:
    """The group size a 4-bit weight of ``K`` inputs gets when ``group_size`` is asked: -1 (one group over all of
    K) where K is below it, as GPTQ quantizers store such a layer (``ceil(K / group_size)`` = 1 group)."""
    return -1 if group_size == -1 or K < group_size else group_size


def _int4(module, name: str) -> Int4Weight | None:
    """The module's 4-bit experts ``name`` as an Int4Weight over its buffers, the same object while the buffers
    are (same storage, not written since: ``_version``), so the fragment layout the decode kernel reads
    (``Int4Weight.fragments()``) is made once, not every forward."""
    parts = [getattr(module, f"tilegemm_{name}_{p}", None) for p in _INT4]
    if parts[0] is None:
        return None
    perm = getattr(module, f"tilegemm_{name}_perm", None)  # act-order experts' input orders, [E, K]
    E, R, N = parts[0].shape
    gs = expert_group_size(module, name)  # each weight's own: gate_up and down may differ
    # a traced graph takes the tensors, the kept fragments among them; inference tensors have no version to key on
    if torch.compiler.is_compiling() or any(t.is_inference() for t in parts):
        return _with_fragments(module, name, Int4Weight(*parts, gs, (E, N, R * 8), perm))
    key = (gs, *((*part_state(t), t.dtype, t.device, tuple(t.shape))
                 for t in parts + ([perm] if perm is not None else [])))
    cache = module.__dict__.setdefault("_tilegemm_int4_weights", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key and _storages_unswapped(module, name):
        return hit[1]
    if hit is not None and all(a[0] == b[0] for a, b in zip(hit[0][1:], key[1:])):
        # the same storage written in place since: the fragments kept of it are stale (a call remakes them)
        for gated in (False, True):
            for n in _fragment_names(name, gated):
                module._buffers.pop(n, None)
    w = _with_fragments(module, name, Int4Weight(*parts, gs, (E, N, R * 8), perm))
    cache[name] = (key, w)
    return w


def _storages_unswapped(module, name: str) -> bool:
    """Whether the storages the kept layouts' record was made of are alive. The cache's key tells storages apart
    by address only while they live: a ``.data =`` swap frees one, whose address the next may take (as a second
    swap's does); the cached weight holds the tensors, so the record's storages have expired exactly then."""
    recs = module.__dict__.get("_tilegemm_fragments_of")
    rec = None if recs is None else recs.get(name)
    return rec is None or not any([s.expired() for s in rec[3]])


def _fragment_names(name: str, gated: bool) -> tuple[str, str]:
    tag = "gfrag" if gated else "frag"
    return f"tilegemm_{name}_{tag}_w", f"tilegemm_{name}_{tag}_zs"


def _kept_layouts(module, name: str) -> tuple:
    """The fragment layouts the block keeps for ``name`` (plain, then gated; those it has)."""
    out = []
    for gated in (False, True):
        for n in _fragment_names(name, gated):
            t = module._buffers.get(n)
            if t is not None:
                out.append(t)
    return tuple(out)


def _int4_parts(module, name: str) -> tuple:
    return tuple([module._buffers.get(f"tilegemm_{name}_{p}") for p in ("qweight", "scales", "zeros")])


class _Records(dict):
    """Weight name -> the record (:mod:`tilegemm.ops.w4a16.fragment_records`) of what its kept layouts were made
    of. Copied and pickled with the tensors of the records that stand (the copies of the block's parts and
    layouts, by the copy's memo), recorded again of those: weak references are neither copied nor pickled."""

    def __reduce__(self):
        return _Records, (), {n: (t, rec[0]) for n, rec in self.items()
                              if (t := fragments.standing_tensors(rec)) is not None}

    def __setstate__(self, state):
        for name, ((parts, layout), extra) in state.items():
            self[name] = fragments.record(parts, layout, extra)


def _records(module) -> _Records:
    recs = module.__dict__.get("_tilegemm_fragments_of")
    if recs is None:
        recs = module.__dict__["_tilegemm_fragments_of"] = _Records()
    return recs


def _note_fragments(module, name: str) -> None:
    """Record that the layouts the block keeps for ``name`` stand for its parts now."""
    parts, layouts = _int4_parts(module, name), _kept_layouts(module, name)
    recs = _records(module)
    if layouts and all(type(t) is torch.Tensor for t in (*parts, *layouts)):
        recs[name] = fragments.record(parts, layouts, expert_group_size(module, name))
    else:
        recs.pop(name, None)


def _fragments_current(module, name: str) -> bool:
    """Whether the layouts the block keeps for ``name`` stand for its parts (not while torch.compile traces)."""
    recs = module.__dict__.get("_tilegemm_fragments_of")
    return recs is not None and fragments.stands_for(recs.get(name), _int4_parts(module, name),
                                                     _kept_layouts(module, name), expert_group_size(module, name))


def _with_fragments(module, name: str, w: Int4Weight) -> Int4Weight:
    """``w`` given the fragment layouts the block keeps as buffers (:func:`keep_fragments_`) while they stand for
    its parts: not after the parts were written in place, swapped (``.data =``) or replaced (assignment,
    ``torch.func.functional_call``), when a call remakes them (or, where it cannot, runs without them)."""
    if torch.compiler.is_compiling():
        # a graph reads no version: the very tensors the layouts were made of, unwritten when traced; the op checks
        # them again when the graph runs (fragment_records.layout_for), as for Int4Linear
        current = fragments.traced_stands_for(_int4_parts(module, name), _kept_layouts(module, name),
                                              expert_group_size(module, name))
    else:
        current = _fragments_current(module, name)
        if not current:
            for gated in (False, True):  # stale: dropped, so that a call's new ones are kept (keep_fragments_)
                for n in _fragment_names(name, gated):
                    module._buffers.pop(n, None)
    if not current:
        return w
    for gated in (False, True):
        fw, fzs = (getattr(module, n, None) for n in _fragment_names(name, gated))
        if fw is not None and fzs is not None:
            if gated:
                w._frag_gated = (fw, fzs)
            else:
                w._frag = (fw, fzs)
    return w


def keep_fragments_(module, name: str, w: Int4Weight) -> None:
    """Keep the fragment layouts ``w`` has made (the decode kernel ``frag``'s) as the block's buffers, so that a
    model compiled later (``torch.compile`` traces no packing) or moved keeps them, as ``Int4Linear`` does."""
    changed = False
    for gated, made in ((False, w._frag), (True, w._frag_gated)):
        if made is None:
            continue
        for n, t in zip(_fragment_names(name, gated), made):
            if getattr(module, n, None) is not t:
                module.register_buffer(n, t, persistent=False)  # derived from the saved parts: not saved
                changed = True
    if changed:  # made of w's parts, which are the block's (w is _int4's of them)
        _note_fragments(module, name)


def _fused_activation(module) -> str | None:
    """The epilogue activation of a gated block whose gate can be fused, else None."""
    if isinstance(module, (SparseMoeBlock, StackedExperts)):
        return module.fused_activation
    if not getattr(module, "is_concatenated", True):
        return None
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and _default_gate is not None and gate is not _default_gate:
        return None
    act_fn = getattr(module, "act_fn", None)
    # the block's own activation, a module (Aria's experts: SiLU whatever the config) or a function (LFM2-MoE's
    # F.silu, whatever the config's hidden_act says): it, or unfused
    if act_fn is not None:
        return _fusable(act_fn)
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return _FUSABLE.get(act) if isinstance(act, str) else None


def _bias(module, name: str):
    return getattr(module, f"{name}_bias", None) if getattr(module, "has_bias", False) else None


def _project(module, name: str, x, offs, gated_activation: str | None):
    """One grouped product of the experts' ``name`` weight (``[E, out, in]``, or ``[E, in, out]`` when
    ``is_transposed``); with ``gated_activation``, the gate/up product with the activation and gate fused."""
    bias = _bias(module, name)
    w4 = _int4(module, name)
    if w4 is not None:
        xq = x.to(w4.dtype)
        b4 = None if bias is None else bias.to(w4.dtype)
        if gated_activation is not None:
            y = moe_gate_up_int4(xq, w4, offs, bias=b4, activation=gated_activation)
        else:
            y = grouped_matmul(xq, w4, offs, bias=b4)
        if not torch.compiler.is_compiling():
            keep_fragments_(module, name, w4)  # those a call made: a later compile reads them
        return y
    weight = getattr(module, name)
    b = weight if getattr(module, "is_transposed", False) else weight.transpose(1, 2)  # [E, in, out], read in place
    x = x.to(b.dtype)
    if gated_activation is not None:
        return moe_gate_up(x, b, offs, bias=bias, activation=gated_activation)
    return grouped_mm(x, b, offs=offs, bias=bias)


_EXPERT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"tilegemm"`` experts implementation: ``hidden_states`` ``[T, H]``, ``top_k_index`` and
    ``top_k_weights`` ``[T, k]`` -> ``[T, H]``."""
    # One launch each for the permutation and its weighted inverse (tilegemm.ops.grouped.routing): the torch ops
    # they replace were about ten small kernels a layer, the bulk of a decode step's experts (docs/grouped.md).
    has_gate = getattr(self, "has_gate", True)
    up_name = "gate_up_proj" if has_gate else "up_proj"
    weight = getattr(self, up_name, None)
    if isinstance(weight, torch.Tensor) and weight.dtype not in _EXPERT_DTYPES and _int4(self, up_name) is None:
        # (after model.double(), say: 4-bit experts take any input, their kernels' dtype set by their scales)
        raise TypeError(
            f"tilegemm experts ({type(self).__name__}): the experts' weights are {weight.dtype}, and tilegemm's "
            "grouped kernels take fp16, bf16 or fp32: cast the model to one of those, or run these experts on torch "
            "(transformers' model.set_experts_implementation('eager'); a block convert_ replaced: leave it out)")
    x, offs, pos = moe_route(hidden_states, top_k_index, self.num_experts)
    fused = _fused_activation(self) if has_gate else None
    h = _project(self, up_name, x, offs, fused)
    if fused is None:
        h = self._apply_gate(h) if has_gate else self.act_fn(h)
    y = _project(self, "down_proj", h, offs, None)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return moe_combine(y, pos, top_k_weights).to(hidden_states.dtype)


# --- 4-bit experts -----------------------------------------------------------------------------------------------


def _stacked_experts(model: torch.nn.Module):
    """(name, module, takes) of every module holding stacked experts (3-D ``down_proj`` and ``gate_up_proj`` /
    ``up_proj``); ``takes``: whether its forward dispatches through transformers' experts interface (its class
    decorated with ``use_experts_implementation``, which sets the layout flags read here) or is tilegemm's own
    block. Others (a class running a forward of its own) never run tilegemm's experts; Llama-4's, DBRX's and JetMoE's
    are replaced by :func:`convert_moe_blocks_` first (:data:`OWN_FORWARD_BLOCKS`)."""
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        up = getattr(module, "gate_up_proj", getattr(module, "up_proj", None))
        if isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor) and down.dim() == 3 and up.dim() == 3:
            takes = isinstance(module, SparseMoeBlock) or all(
                hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated"))
            yield name, module, takes


def _experts_modules(model: torch.nn.Module):
    """(name, module) of every experts block that runs tilegemm's experts (:func:`_stacked_experts`)."""
    for name, module, takes in _stacked_experts(model):
        if takes:
            yield name, module


def refuse_split_experts(model: torch.nn.Module, filter=None, caller: str = "quantize_experts_") -> None:  # noqa: A002
    """Refuse (TypeError) experts blocks that ``ExpertsTensorParallel`` split already (and ``filter`` takes): their
    local weights are plain tensors, so nothing else shows it, and each rank's slice would be quantized in groups of
    its own, not the model's."""
    for name, module in model.named_modules():
        if getattr(module, "tp_split", None) == "experts" and (filter is None or filter(name, module)):
            raise TypeError(f"{caller}: {name or 'the model'}'s experts are split already (parallelized with "
                            f"ExpertsTensorParallel): quantize before parallelizing (tilegemm.nn.quantize_, then "
                            f"parallelize_module with tilegemm.nn.ExpertsTensorParallel, docs/parallel.md)")


# why quantize_ keeps a layer that is 4-bit already: its weight is not requantized, whatever group size is asked
ALREADY_4BIT = ("already 4-bit{}: kept as it is, not rounded twice (to quantize afresh, start from 16-bit weights: "
                "tilegemm.models.pretrained.dequantized_copy of a transformers model, Int4Linear.dequantize() of a "
                "layer)")


def quantize_experts_(model: torch.nn.Module, group_size: int = 128, filter=None,  # noqa: A002
                      symmetric: bool = False, skipped: list | None = None) -> list[str]:
    """Quantize, in place, the experts of every MoE block of ``model`` (that ``filter(name, module)`` accepts) to
    4 bits, and switch the model to the ``"tilegemm"`` experts implementation. Returns the blocks' names. A weight
    whose input width K is below the group size is one group over all of K (group size -1, as GPTQ checkpoints
    store it: a down projection of an expert width below the group size); blocks with a weight whose K is larger
    but not a multiple of the group size (or of 8) are kept, appended to ``skipped`` as ``(name, reason)`` where
    given. The 16-bit expert weights are dropped; the 4-bit parts are buffers (``tilegemm_<weight>_qweight``,
    ``_scales``, ``_zeros``). Blocks that run code of their own (Llama-4's, DBRX's, JetMoE's, transformers 4.x
    ones: :func:`experts_off_interface`) are not taken; called without ``skipped``, a ``ConversionNote`` names
    them (``tilegemm.nn.quantize_`` converts them first): kept 16-bit, or, where their experts are 4-bit already
    (``Int4Linear``s, as a quantized checkpoint loads them), left as they are."""
    if not isinstance(model, torch.nn.Module):  # (it raised AttributeError on named_modules)
        raise TypeError(f"quantize_experts_ takes a torch.nn.Module, got {type(model).__name__}")
    check_group_size_value(group_size, "quantize_experts_")
    if filter is not None and not callable(filter):
        raise TypeError(f"quantize_experts_: filter must be a callable (name, module) -> bool or None, got "
                        f"{type(filter).__name__}")
    refuse_split_experts(model, filter)
    done = []
    for name, module in model.named_modules():  # 4-bit already (their 16-bit weights gone): kept, named
        four_bit = [n for n in ("gate_up_proj", "up_proj", "down_proj")
                    if getattr(module, f"tilegemm_{n}_qweight", None) is not None]
        if four_bit and skipped is not None and (filter is None or filter(name, module)):
            skipped.append((name, ALREADY_4BIT.format(f" ({', '.join(four_bit)})")))
    for name, module in list(_experts_modules(model)):
        if filter is not None and not filter(name, module):
            continue
        names = ["gate_up_proj" if hasattr(module, "gate_up_proj") else "up_proj", "down_proj"]
        weights = [getattr(module, n) for n in names]
        if any(w.dtype not in (torch.float16, torch.bfloat16, torch.float32) for w in weights):
            continue
        if getattr(module, "is_transposed", False):
            weights = [w.transpose(1, 2) for w in weights]
        sizes = [weight_group_size(w.shape[2], group_size) for w in weights]
        bad = [(n, w.shape[2], gs) for n, w, gs in zip(names, weights, sizes) if w.shape[2] % 8 or
               (gs != -1 and w.shape[2] % gs)]
        if bad:
            if skipped is not None:
                why = "; ".join(f"{n}'s K = {k} is not a multiple of "
                                + ("8 (eight 4-bit weights per int32)" if k % 8 else f"group_size = {gs}")
                                for n, k, gs in bad)
                skipped.append((name, f"{why}: its experts stay 16-bit"))
            continue
        install_int4_experts_(module, {n: quantize(w.detach(), gs, symmetric)
                                       for n, w, gs in zip(names, weights, sizes)})
        done.append(name)
    if done:
        use_int4_experts_(model)
    if skipped is None:  # called alone (quantize_ names these itself): blocks it cannot take are named, not passed over
        off, four = [], []
        for n, why, replaced in _off_interface(model):
            block = model.get_submodule(n)
            if filter is not None and not filter(n, block):
                continue
            k, total = _four_bit_experts(block)
            if total and k == total:  # (a quantized checkpoint's, or quantize_'s): not "kept 16-bit"
                four.append((n, type(block).__name__, replaced))
            else:
                off.append((n, why if not k else f"{why}; {k} of its {total} expert weights are 4-bit already"))
        notes = []
        if off:
            notes.append(f"quantize_experts_ kept {len(off)} MoE block(s) 16-bit, which run code of their own, not "
                         f"transformers' experts interface: {_listing(off)}. tilegemm.nn.quantize_ converts and "
                         f"quantizes those it can")
        if four:
            then = [n for n, _, replaced in four if replaced]
            notes.append(f"quantize_experts_ left {len(four)} MoE block(s) as they are, whose experts are 4-bit "
                         f"already (as a quantized checkpoint loads them, or quantize_ made them) and run in code of "
                         f"their own, not transformers' experts interface: "
                         f"{_listing([(n, cls) for n, cls, _ in four])}" + (
                             f". tilegemm.nn.convert_ puts {', '.join(then[:8])}{' ...' if len(then) > 8 else ''} "
                             f"on the grouped kernels, 4-bit as they are" if then else ""))
        if notes:
            warnings.warn(". ".join(notes), ConversionNote, stacklevel=2)
    return done


def make_fragments_(module) -> None:
    """Make and keep, where the decode kernel ``frag`` runs (a Hopper GPU), the fragment layouts the block's 4-bit
    experts are read through at decode sizes: gate/up in the fused gate's row order where the block fuses it,
    down as is. Made here, not at a first call: ``torch.compile`` traces no packing, and a model's first call may
    be a prefill, which does not make them."""
    from tilegemm.ops.grouped import dispatch

    up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    for name, gated in ((up, _fused_activation(module) is not None and up == "gate_up_proj"), ("down_proj", False)):
        w = _int4(module, name)
        if w is None or not dispatch.keeps_fragments(w.group_k, w.shape[-1], w.device) or (gated and w.shape[-2] % 2):
            continue
        w.fragments(gated)
        keep_fragments_(module, name, w)


def _drop_fragments(module) -> None:
    """Forget the block's kept fragment layouts (and its Int4Weights holding them): its 4-bit parts changed."""
    for n in [n for n in module._buffers if n.startswith("tilegemm_") and n.endswith(("frag_w", "frag_zs"))]:
        del module._buffers[n]
    module.__dict__.pop("_tilegemm_int4_weights", None)
    module.__dict__.pop("_tilegemm_fragments_of", None)


def _remake_fragments(module, incompatible_keys=None) -> None:
    """After ``load_state_dict`` wrote the block's 4-bit parts: the fragments kept from the old ones are stale (they
    are not saved, so nothing loads them), made again from the loaded parts."""
    _drop_fragments(module)
    make_fragments_(module)


def _adopt_perms(module, state_dict, prefix, *args) -> None:
    """Before ``load_state_dict``: a 4-bit weight's act-order perm buffer follows the state dict that holds the
    weight (made where it brings one, dropped where it has none), so no input order is left over or ignored."""
    for key in [k for k in module._buffers if k.startswith("tilegemm_") and k.endswith("_qweight")]:
        name = key[:-len("_qweight")]
        if prefix + key not in state_dict:
            continue  # (a state dict without this weight: a missing key, as for any buffer)
        incoming, perm = state_dict.get(f"{prefix}{name}_perm"), f"{name}_perm"
        if incoming is None:
            module._buffers.pop(perm, None)
        elif getattr(module, perm, None) is None or module._buffers[perm].shape != incoming.shape:
            module._buffers[perm] = torch.empty(incoming.shape, dtype=torch.int64, device=module._buffers[key].device)


def apply_keeping_4bit_parts(module: torch.nn.Module, apply, fn, names) -> torch.nn.Module:
    """Run ``apply(fn)`` (``module``'s own ``_apply``) with ``fn`` taking its 4-bit buffers ``names`` to its device
    but keeping what the kernels read: their dtypes (the packed integer parts stay integers, though
    ``Module.type(dtype)`` casts every buffer; the scales take a new dtype only if it is fp16 or bf16, and are
    otherwise the values they were, never rounded through float8) and their dense layout (a memory format,
    ``.to(memory_format=torch.channels_last)``, is for activations: the fragment layouts are 4-D and 5-D, read
    as dense by the kernels). bf16 scales past fp16's range, or that make weights past it (inf once converted, as
    ``Int4Weight.half()`` refuses them), are a ValueError, the parts and the module's other tensors (a bias) left as
    they were."""
    before = {n: module._buffers[n] for n in names if module._buffers.get(n) is not None}
    parts = {id(t) for t in before.values()}
    # the module's other tensors as they were (a bias): put back too when the conversion is refused
    others = {n: t for n, t in module._buffers.items() if t is not None and n not in before}
    params = {n: p.data for n, p in module._parameters.items() if p is not None}
    overflowed = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in parts or type(t) is not torch.Tensor:  # (a subclass, a DTensor's: fn as it is)
            return fn(t)
        flat = t.reshape(-1)  # (1-D: no memory format applies to it)
        out = fn(flat)
        if out.dtype != t.dtype and (not t.is_floating_point() or out.dtype not in (torch.float16, torch.bfloat16)):
            out = flat.to(device=out.device)
        elif t.dtype == torch.bfloat16 and out.dtype == torch.float16 and not t.is_meta \
                and not torch.isfinite(out).all() and torch.isfinite(flat).all():
            overflowed.append(t)
        if out.data_ptr() == t.data_ptr() and out.dtype == t.dtype and out.device == t.device:
            return t  # (unchanged: the same tensor, as fn gives it back)
        return out.view(t.shape)

    apply(keep)
    for n, old in before.items():  # finite fp16 scales may still make weights past fp16's range, inf as well
        new = module._buffers.get(n)
        if overflowed or not n.endswith("scales") or old.dtype != torch.bfloat16 or type(new) is not torch.Tensor \
                or new.dtype != torch.float16 or new.is_meta:
            continue
        stem = n[: -len("scales")]  # "" (Int4Linear) or "tilegemm_<weight>_" (a block's experts)
        qweight, zeros = module._buffers.get(stem + "qweight"), module._buffers.get(stem + "zeros")
        if qweight is not None and zeros is not None and dequantized_overflow(qweight, new, zeros, torch.float16):
            overflowed.append(old)
    if overflowed:
        for n, old in {**before, **others}.items():
            if module._buffers.get(n) is not None:
                module._buffers[n] = old.to(device=module._buffers[n].device)
        for n, old in params.items():
            p = module._parameters.get(n)
            if p is not None:
                p.data = old.to(device=p.device)
        what = f"{type(module).__name__}({module.extra_repr()})" if module.extra_repr() else type(module).__name__
        raise ValueError(f"{what}: its bf16 4-bit scales hold values past fp16's range, or make weights past it, "
                         f"which become inf in fp16 (NaN outputs): keep the module bf16; its 4-bit parts were left "
                         f"as they were")
    return module


class _KeepScales16:
    """A block's ``_apply`` once it holds 4-bit experts, as ``Int4Linear._apply``: ``.float()`` /
    ``.to(torch.float32)`` make an fp32 block (its activations and any 16-bit parameters) and keep the experts'
    scales and zeros 16-bit, which the kernels read (``.half()`` / ``.bfloat16()`` convert them), the packed
    parts integers and every part dense (:func:`apply_keeping_4bit_parts`). A callable object kept in the
    instance's ``__dict__`` (not a bound method) so that deepcopy and pickling follow the block."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, fn, recurse: bool = True):
        m = self.module
        current = [n for n in list(_records(m)) if _fragments_current(m, n)]
        # (to_empty: parts that were meta hold no values yet, nothing to pack; load_state_dict makes the layouts)
        from_meta = any(t.is_meta for n, t in m._buffers.items() if n.startswith("tilegemm_") and t is not None)
        out = apply_keeping_4bit_parts(m, lambda f: type(m)._apply(m, f, recurse), fn,
                                       [n for n in m._buffers if n.startswith("tilegemm_")])
        m.__dict__.pop("_tilegemm_int4_weights", None)  # (weights of the parts before: not kept alive)
        for n in current:  # moved or cast with the parts, the layouts still stand for them
            _note_fragments(m, n)
        _fragments_follow_device_(m, make=not from_meta)
        return out


def _fragments_follow_device_(module, make: bool = True) -> None:
    """After a block's move or cast: its experts' layouts kept where the decode kernel ``frag`` runs on their
    device, made now where missing (a model compiled next traces no packing: a block quantized on the CPU, then
    moved), and dropped where it does not run (no call reads them there; they would double the 4-bit memory)."""
    from tilegemm.ops.grouped import dispatch

    names = [n[len("tilegemm_"):-len("_qweight")] for n in module._buffers
             if n.startswith("tilegemm_") and n.endswith("_qweight")]
    parts = {n: _int4_parts(module, n) for n in names}
    if any(t is None or type(t) is not torch.Tensor or t.is_meta for p in parts.values() for t in p) \
            or (parts and next(iter(parts.values()))[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return  # (a meta block, a subclass of tensor, a capture: left as they are, as Int4Linear's)
    for n in names:
        w = _int4(module, n)
        if w is not None and not dispatch.keeps_fragments(w.group_k, w.shape[-1], w.device) \
                and _kept_layouts(module, n):
            for gated in (False, True):
                for b in _fragment_names(n, gated):
                    module._buffers.pop(b, None)
            _records(module).pop(n, None)
            module.__dict__.pop("_tilegemm_int4_weights", None)
    if make and plain_call(*(t for p in parts.values() for t in p)):
        make_fragments_(module)


def install_int4_experts_(module: torch.nn.Module, weights: dict) -> None:
    """Put stacked 4-bit experts on a transformers experts block: ``weights`` maps its 3-D weight's name
    (``"gate_up_proj"``/``"up_proj"``, ``"down_proj"``) to an :class:`Int4Weight` of logical shape ``[E, out, in]``
    (even when the block stores its 16-bit weights transposed), each with its own group size (kept in
    ``module.tilegemm_group_sizes``; ``module.tilegemm_group_size`` is the up side's, read by
    :func:`expert_group_size` for weights without one). The 16-bit parameter is dropped; the parts become buffers
    ``tilegemm_<name>_qweight``, ``_scales``, ``_zeros`` (and ``_perm`` for act-order experts: each expert's
    input order, ``[E, in]``)."""
    if not weights:
        raise ValueError("install_int4_experts_ needs at least one 4-bit weight")
    # the grouped kernels read each weight's group size from its own Int4Weight, so gate_up and down may differ
    sizes = dict(module.__dict__.get("tilegemm_group_sizes", {}))
    sizes.update({n: q.group_size for n, q in weights.items()})
    for n, q in weights.items():
        if n in module._parameters:
            delattr(module, n)
        for part in _INT4:
            module.register_buffer(f"tilegemm_{n}_{part}", getattr(q, part))
        if q.perm is not None:  # act-order experts
            module.register_buffer(f"tilegemm_{n}_perm", q.perm)
        else:
            module._buffers.pop(f"tilegemm_{n}_perm", None)
    module.tilegemm_group_sizes = sizes
    module.tilegemm_group_size = sizes[next((n for n in ("gate_up_proj", "up_proj") if n in sizes), next(iter(sizes)))]
    if not isinstance(module.__dict__.get("_apply"), _KeepScales16):
        # the block may be transformers' class, which tilegemm cannot subclass: its _apply is replaced on the instance
        module.__dict__["_apply"] = _KeepScales16(module)
    _drop_fragments(module)  # those of experts installed before
    make_fragments_(module)
    if not getattr(module, "_tilegemm_remakes_fragments", False):
        module.register_load_state_dict_pre_hook(_adopt_perms)
        module.register_load_state_dict_post_hook(_remake_fragments)
        module.register_forward_pre_hook(_runs_on_tilegemm_experts)
        module._tilegemm_remakes_fragments = True


@tilegemm_hook
def _runs_on_tilegemm_experts(module: torch.nn.Module, args) -> None:
    """A forward pre-hook of a block holding 4-bit experts: only the ``"tilegemm"`` experts implementation reads
    them (another, ``"eager"`` say, would fail inside transformers on the 16-bit weight that is gone)."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if implementation is not None and implementation != NAME:
        raise RuntimeError(f"{type(module).__name__} holds 4-bit experts, which only the {NAME!r} experts "
                           f"implementation runs; the model is set to {implementation!r} (call "
                           f"set_experts_implementation({NAME!r}), or run {implementation!r} on the 16-bit model)")


def use_int4_experts_(model: torch.nn.Module) -> None:
    """Switch ``model`` to the ``"tilegemm"`` experts implementation (what runs blocks holding 4-bit experts)."""
    register_experts()
    _set_experts_implementation(model, [m for _, m in _experts_modules_all(model)])


def _set_experts_implementation(model: torch.nn.Module, blocks: list) -> None:
    """``"tilegemm"`` as ``model``'s experts implementation: transformers' setter where the model has one, else
    each of ``blocks``' configs (a bare block, or a model transformers did not build)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    else:
        for module in blocks:
            module.config._experts_implementation = NAME


_EXPERTS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the "tilegemm" experts take


def use_tilegemm_experts_(model: torch.nn.Module, filter=None) -> list[tuple[str, str]]:  # noqa: A002
    """``convert_``'s step for transformers 5: switch ``model`` to the ``"tilegemm"`` experts implementation where
    its stacked experts run through transformers' experts interface on another one. The setting is one for the
    whole model: where ``filter`` declines a block, or a block's experts are of a dtype the grouped kernels do not
    take, nothing is switched, and the blocks left are returned as ``[(name, why)]``."""
    blocks = [(n, m) for n, m, takes in _stacked_experts(model) if takes and not isinstance(m, SparseMoeBlock)]
    if not blocks or asks_tilegemm(model) or not register_experts():
        return []
    declined = [n for n, m in blocks if filter is not None and not filter(n, m)]
    odd = {n: m.down_proj.dtype for n, m in blocks if m.down_proj.dtype not in _EXPERTS_DTYPES}
    if declined or odd:
        why = (f"the filter declined {', '.join(declined[:4])}" if declined else
               f"{', '.join(f'{n} holds {dtype_name(d)} experts' for n, d in list(odd.items())[:4])} (the grouped "
               f"kernels take fp16, bf16, fp32)")
        return [(n, f"its experts stay on transformers' own implementation: experts_implementation is one setting "
                    f"for the whole model, and {why}") for n, _ in blocks if n not in declined]
    _set_experts_implementation(model, [m for _, m in blocks])
    return []


def _experts_modules_all(model):
    for name, module in model.named_modules():
        if hasattr(module, "tilegemm_group_size") and hasattr(module, "config"):
            yield name, module


# --- transformers 4.x: a block's experts as a ModuleList of MLPs -------------------------------------------------

# The expert MLPs' Linears: (gate, up, down) as Qwen-MoE / OLMoE name them, and as Mixtral does (w1, w3, w2).
_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# transformers 4.x blocks of that shape whose routing SparseMoeBlock's (softmax, top k) would silently change
OTHER_ROUTING_BLOCKS = {
    "PhimoeSparseMoeBlock": "PhiMoE's block routes by sparsemixer, not softmax and top k: it stays as it is",
    "Ernie4_5_MoeSparseMoeBlock": "Ernie 4.5's block picks experts with a correction bias (moe_statics) and adds "
                                  "shared_experts: it stays as it is",
}
# Activation modules (by class name, as transformers' ACT2FN makes them) that a tilegemm epilogue computes.
_FUSABLE_MODULES = {"SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu", "PytorchGELUTanh": "gelu_tanh",
                    "GELUTanh": "gelu_tanh"}
_FUSABLE_FUNCTIONS = ((torch.nn.functional.silu, "silu"), (torch.nn.functional.relu, "relu"), (torch.relu, "relu"))


def _fusable(act_fn) -> str | None:
    """The epilogue activation that computes ``act_fn`` (a module of :data:`_FUSABLE_MODULES`' classes, or a
    function of :data:`_FUSABLE_FUNCTIONS`), else None (applied by torch)."""
    if isinstance(act_fn, torch.nn.Module):
        return _FUSABLE_MODULES.get(type(act_fn).__name__)
    return next((name for fn, name in _FUSABLE_FUNCTIONS if act_fn is fn), None)


def _linear_kind(module) -> str | None:
    """``"16-bit"`` for a ``torch.nn.Linear``, ``"int4"`` for a 4-bit one (``tilegemm.nn.Int4Linear``: an
    :class:`Int4Weight` weight, as a 4.x checkpoint of per-expert Linears loads), else None."""
    if isinstance(module, torch.nn.Linear):
        return "16-bit"
    return "int4" if isinstance(getattr(module, "weight", None), Int4Weight) else None


def legacy_block_parts(block: torch.nn.Module) -> tuple[tuple[str, str, str] | None, str | None]:
    """``(names, None)`` where ``block`` is a sparse MoE block as transformers 4.x builds them (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE: a router ``gate`` Linear, ``top_k``, and ``experts`` a ModuleList of gated MLPs whose Linears
    are ``names``), ``(None, reason)`` where it looks like one that cannot be taken, ``(None, None)`` otherwise."""
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    if not isinstance(experts, torch.nn.ModuleList) or not len(experts) or not isinstance(router, torch.nn.Linear) \
            or not isinstance(getattr(block, "top_k", None), int):
        return None, None
    if type(block).__name__ in OTHER_ROUTING_BLOCKS:
        return None, OTHER_ROUTING_BLOCKS[type(block).__name__]
    names = next((n for n in _MLP_NAMES if all(_linear_kind(getattr(e, m, None)) for e in experts for m in n)), None)
    if names is None:
        return None, "experts that are not gated MLPs of three Linears"
    linears = [getattr(e, m) for e in experts for m in names]
    kinds = {_linear_kind(lin) for lin in linears}
    if len(kinds) != 1:
        return None, "experts mixing 4-bit and 16-bit Linears"
    if any(lin.bias is not None for lin in linears):
        return None, "experts' Linears with biases"
    if len({(lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
        return None, "experts of several dtypes or devices"
    if kinds == {"int4"}:
        # stacked weights take one group size each (stack_experts, concat_outputs): down may differ from gate/up
        sizes = [{getattr(e, m).weight.group_size for e in experts} for m in names]
        if len(sizes[0] | sizes[1]) != 1 or len(sizes[2]) != 1:
            return None, "4-bit experts of several group sizes (each projection needs one, and gate and up the same)"
        for e in experts:  # stacked gate/up rows read one input order an expert (concat_outputs)
            p_gate, p_up = (getattr(e, m).weight.perm for m in names[:2])
            if (p_gate is None) != (p_up is None) or p_gate is not None and not torch.equal(p_gate, p_up):
                return None, "act-order experts whose gate and up read their inputs in two orders"
    shapes = {tuple(getattr(e, m).weight.shape for m in names) for e in experts}
    if len(shapes) != 1:
        return None, "experts of several sizes"
    if not callable(getattr(experts[0], "act_fn", None)):
        return None, "experts without act_fn"
    if hasattr(block, "shared_expert") != hasattr(block, "shared_expert_gate"):
        return None, "a shared expert without its gate (or a gate without it)"
    return names, None


class SparseMoeBlock(NotScriptable, torch.nn.Module):
    """tilegemm's stand-in for a transformers 4.x sparse MoE block (:func:`legacy_block_parts`), where the
    installed transformers has no experts interface (v5 has: ``experts_implementation="tilegemm"``). It routes as
    those blocks do (softmax in fp32 over the router's logits, the top k, renormalised unless
    ``norm_topk_prob`` is False, in the input's dtype), runs the experts as :func:`experts_forward` does (two
    grouped GEMMs, the gate fused in the first's epilogue for SiLU, ReLU and tanh-GELU), adds a shared expert
    gated by a sigmoid where the block has one (Qwen2-MoE), and returns ``(hidden states, router logits)`` like
    them. The experts' weights are stacked into ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``
    (new parameters: the per-expert Linears are dropped, so convert before making an optimizer, and load a 4.x
    state dict before converting); ``tilegemm.nn.quantize_`` then makes them 4-bit. Experts already 4-bit
    (``Int4Linear``s, as ``tilegemm.models.from_pretrained`` loads a 4.x checkpoint of per-expert Linears) are
    stacked as 4-bit experts (:func:`install_int4_experts_`; an expert's gate and up joined by
    ``concat_outputs``)."""

    def __init__(self, block: torch.nn.Module, names: tuple[str, str, str]):
        super().__init__()
        g, u, d = names
        experts = block.experts
        self.gate = block.gate
        self.act_fn = experts[0].act_fn
        self.fused_activation = _fusable(self.act_fn)
        self.num_experts, self.top_k = len(experts), block.top_k
        self.norm_topk_prob = bool(getattr(block, "norm_topk_prob", True))  # Mixtral always renormalises
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        if _linear_kind(getattr(experts[0], g)) == "int4":
            gate_up = stack_experts([concat_outputs([getattr(e, g).weight, getattr(e, u).weight]) for e in experts])
            install_int4_experts_(self, {"gate_up_proj": gate_up,
                                         "down_proj": stack_experts([getattr(e, d).weight for e in experts])})
            return
        with torch.no_grad():
            gate_up = torch.stack([torch.cat([getattr(e, g).weight, getattr(e, u).weight]) for e in experts])
            down = torch.stack([getattr(e, d).weight for e in experts])
        grad = getattr(experts[0], g).weight.requires_grad
        self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=grad)
        self.down_proj = torch.nn.Parameter(down, requires_grad=grad)

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor:  # where the activation is not fused
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor):
        B, S, H = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x = hidden_states.view(-1, H)
        router_logits = self.gate(x)
        weights = torch.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = experts_forward(self, x, chosen, weights.to(x.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(B, S, H), router_logits


# --- transformers' blocks whose experts run a forward of their own (no experts interface) -----------------------


class StackedExperts(NotScriptable, torch.nn.Module):
    """Gated experts held as transformers' experts interface holds them and run by :func:`experts_forward`:
    ``gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj`` ``[E, H, I]``, or,
    ``is_transposed``, ``[E, H, 2I]`` and ``[E, I, H]``; ``act_fn`` the gate's activation (fused in the first
    product's epilogue for SiLU, ReLU and tanh-GELU). :func:`convert_moe_blocks_` puts it in place of the experts
    of the transformers blocks that run their own loop or batched product (:data:`OWN_FORWARD_BLOCKS`), so that
    they run on the grouped kernels and ``tilegemm.nn.quantize_`` makes them 4-bit as it does the interface's.
    Called as those experts are: ``(hidden_states [..., H], top_k_index [T, k], top_k_weights [T, k])``."""

    has_gate = is_concatenated = True
    has_bias = False

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn, is_transposed: bool):
        super().__init__()
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"stacked experts need 3-D weights of one expert count, got {tuple(gate_up.shape)} "
                             f"and {tuple(down.shape)}")
        for n, t in (("gate_up_proj", gate_up), ("down_proj", down)):  # the same Parameter where given one
            setattr(self, n, t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, t.requires_grad))
        self.act_fn = act_fn
        self.is_transposed = is_transposed
        self.num_experts = gate_up.shape[0]
        self.fused_activation = _fusable(act_fn)

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor:  # where the activation is not fused
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        y = experts_forward(self, x, top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1))
        return y.view(hidden_states.shape)


class Llama4MoeBlock(NotScriptable, torch.nn.Module):
    """Llama-4's MoE block (``Llama4TextMoe``) on the grouped kernels. Its own forward multiplies every expert by
    every token (a batched product over all experts, the inputs scaled by sigmoid scores that are zero off the
    top k); here each token goes to its top-k experts only, its input scaled by that expert's score as there,
    and the shared expert is added. The router, experts and shared expert are the block's own modules under
    their own names (the experts as :class:`StackedExperts` over the same parameters), so state dicts load
    unchanged; returns ``(hidden states [T, H], router logits)`` as the block does."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        experts = block.experts
        self.router, self.shared_expert = block.router, block.shared_expert
        self.top_k, self.hidden_dim = block.top_k, block.hidden_dim
        self.num_experts = block.num_experts
        self.experts = StackedExperts(experts.gate_up_proj, experts.down_proj, experts.act_fn, is_transposed=True)

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(x)  # scores: the top k's sigmoids, zeros elsewhere
        chosen = torch.topk(logits, self.top_k, dim=1).indices  # the router's own choice (the same topk)
        xk = (x.unsqueeze(1) * scores.gather(1, chosen).unsqueeze(2)).reshape(-1, self.hidden_dim)
        ones = torch.ones(xk.shape[0], 1, dtype=x.dtype, device=x.device)  # scaled already: summed as they are
        routed = self.experts(xk, chosen.reshape(-1, 1), ones)
        return self.shared_expert(x) + routed.view(x.shape[0], self.top_k, -1).sum(dim=1), logits


class JetMoeBlock(NotScriptable, torch.nn.Module):
    """JetMoE's MoE block (``JetMoeMoE``: softmax over the top k router logits, experts as ``input_linear`` /
    ``output_linear`` stacks looped over on the host, a bias added after) on the grouped kernels; its experts are a
    :class:`StackedExperts` over the same parameters (state dict names ``experts.gate_up_proj`` and
    ``experts.down_proj`` where the block had ``input_linear.weight`` and ``output_linear.weight``)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.router, self.bias = block.router, block.bias
        self.top_k = block.router.top_k
        self.experts = StackedExperts(block.input_linear.weight, block.output_linear.weight, block.activation,
                                      is_transposed=False)

    def forward(self, layer_input: torch.Tensor) -> torch.Tensor:
        x = layer_input.reshape(-1, layer_input.shape[-1])
        logits = self.router.layer(x).float()
        if self.router._forward_hooks:
            _router_hooks(self.router, x, logits)
        top, chosen = logits.topk(self.top_k, dim=1)
        y = self.experts(x, chosen, torch.softmax(top, dim=1).type_as(x))
        return y.view(layer_input.shape) + self.bias


def _router_hooks(router: torch.nn.Module, x: torch.Tensor, logits: torch.Tensor) -> None:
    """The forward hooks of JetMoE's router, whose forward the block does not call (it sorts tokens on the host):
    called with the output that forward gives, the logits fifth (transformers records ``router_logits`` so, for
    the auxiliary loss)."""
    output = (None, None, None, None, logits)
    for key, hook in list(router._forward_hooks.items()):
        if key in router._forward_hooks_with_kwargs:
            hook(router, (x,), {}, output)
        else:
            hook(router, (x,), output)


def _dbrx_experts(experts: torch.nn.Module) -> StackedExperts:
    """DBRX's experts (``DbrxExperts``: ``mlp.w1``/``v1``/``w2`` of ``[E * I, H]`` each, looped over by expert) as
    :class:`StackedExperts` (new parameters, the gate and up rows joined: state dict names change)."""
    mlp, E = experts.mlp, experts.num_experts
    view = (E, experts.ffn_hidden_size, experts.hidden_size)
    with torch.no_grad():
        gate_up = torch.cat([mlp.w1.view(view), mlp.v1.view(view)], dim=1)
        down = mlp.w2.view(view).transpose(1, 2).contiguous()
    grad = mlp.w1.requires_grad
    return StackedExperts(gate_up.requires_grad_(grad), down.requires_grad_(grad), mlp.activation_fn,
                          is_transposed=False)


def _own_weights(module: torch.nn.Module) -> list:
    """The experts' weights of one of :data:`OWN_FORWARD_BLOCKS`."""
    if type(module).__name__ == "DbrxExperts":
        return [getattr(module.mlp, n) for n in ("w1", "v1", "w2")]
    if type(module).__name__ == "JetMoeMoE":
        return [module.input_linear.weight, module.output_linear.weight]
    return [module.experts.gate_up_proj, module.experts.down_proj]


def _why_not_own(module: torch.nn.Module) -> str | None:
    """Why one of :data:`OWN_FORWARD_BLOCKS` cannot be taken (None: it can)."""
    ws = _own_weights(module)
    if any(isinstance(w, Int4Weight) or not isinstance(w, torch.Tensor) for w in ws):
        return "experts that are not 16-bit or fp32 tensors"
    if len({(w.dtype, w.device) for w in ws}) != 1:
        return "experts of several dtypes or devices"
    return None


# transformers' MoE blocks (by class name) whose experts run their own forward, not the experts interface, and what
# replaces them: the block, or (DBRX) its experts alone, whose caller routes as the interface's callers do
OWN_FORWARD_BLOCKS = {"Llama4TextMoe": Llama4MoeBlock, "JetMoeMoE": JetMoeBlock, "DbrxExperts": _dbrx_experts}

# transformers' MoE blocks (by class name) whose experts are no weights a grouped product takes, and why: convert_ and
# quantize_ name them (a ConversionNote) rather than pass over them in silence
NOT_GROUPED_BLOCKS = {
    "DogeCDMoE": "its routed experts are rows of two embedding tables (Doge's retrieval experts, picked by product "
                 "keys), not weights of a grouped product: they stay as they are",
    "JetMoeMoA": "JetMoE's mixture of attention heads: its experts' query and output projections "
                 "(JetMoeParallelExperts input_linear and output_linear) run in the attention's own forward: they "
                 "stay 16-bit",
}


def per_expert_mlps(block: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The experts of ``block`` where they are an ``nn.ModuleDict`` or ``nn.ModuleList`` of per-expert MLPs
    (modules holding Linears, which the block's own forward runs one by one: SwitchTransformers' and NLLB-MoE's
    ``experts``, a 4.x-style block's), else None."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, (torch.nn.ModuleDict, torch.nn.ModuleList)):
        return None
    # (NLLB-MoE's dict also holds its token dropout: only the members holding Linears are experts)
    mlps = [m for m in experts.children() if any(_linear_kind(s) for s in m.modules())]
    return mlps or None


def _four_bit_experts(block: torch.nn.Module) -> tuple[int, int]:
    """(how many are 4-bit, how many there are) of the expert weights of a block off the experts interface
    (:func:`_off_interface`): per-expert MLPs' Linears (``Int4Linear`` ones 4-bit, as a quantized checkpoint loads
    them or ``quantize_`` makes them), or the weights of one of :data:`OWN_FORWARD_BLOCKS`; (0, 0) for others."""
    mlps = per_expert_mlps(block)
    if mlps is not None:
        kinds = [k for m in mlps for k in map(_linear_kind, m.modules()) if k is not None]
    elif type(block).__name__ in OWN_FORWARD_BLOCKS:
        kinds = ["int4" if isinstance(w, Int4Weight) else "16-bit" for w in _own_weights(block)]
    else:
        kinds = []
    return kinds.count("int4"), len(kinds)


def _off_interface(model: torch.nn.Module) -> list[tuple[str, str, bool]]:
    """:func:`experts_off_interface`'s ``(name, why)``, each with whether :func:`convert_moe_blocks_` replaces the
    block (its experts then on the grouped kernels)."""
    found: list[tuple[str, str, bool]] = []

    def inside(name: str) -> bool:  # (a block's own experts module is the block's, named once)
        return any(name.startswith(f"{n}.") for n, _, _ in found)

    for name, module in model.named_modules():
        cls = type(module).__name__
        if not name or inside(name) or isinstance(module, (SparseMoeBlock, StackedExperts, Llama4MoeBlock,
                                                           JetMoeBlock)):
            continue
        if cls in NOT_GROUPED_BLOCKS:
            found.append((name, f"{cls}: {NOT_GROUPED_BLOCKS[cls]}", False))
            continue
        if cls in OWN_FORWARD_BLOCKS:
            why = _why_not_own(module)
            found.append((name, f"{cls}, whose experts run in a forward of its own: " + (
                "tilegemm.nn.convert_ replaces it" if why is None else f"tilegemm.nn.convert_ keeps it ({why})"),
                why is None))
            continue
        names, why = legacy_block_parts(module)
        if names is not None or why is not None:
            found.append((name, f"{cls}, a 4.x-style block looping over its experts: " + (
                "tilegemm.nn.convert_ replaces it" if why is None else f"tilegemm.nn.convert_ keeps it ({why})"),
                why is None))
            continue
        mlps = per_expert_mlps(module)
        if mlps is not None:
            # no grouped product takes these: convert_ and quantize_ reach only the Linears inside, one at a time
            held = "ModuleDict" if isinstance(module.experts, torch.nn.ModuleDict) else "ModuleList"
            found.append((name, f"{cls}, its experts an nn.{held} of {len(mlps)} per-expert MLPs run one by one in "
                                f"its own forward: tilegemm.nn.convert_ keeps it, converting each expert's Linears "
                                f"one by one into dense tilegemm.nn.Linear layers (tilegemm.nn.quantize_: into "
                                f"Int4Linears), with no grouped product", False))
    for name, module, takes in _stacked_experts(model):
        if not takes and not inside(name) and all(name != n for n, _, _ in found):
            found.append((name, f"{type(module).__name__}, stacked experts with a forward of their own: they stay "
                                f"as they are", False))
    return found


def experts_off_interface(model: torch.nn.Module) -> list[tuple[str, str]]:
    """The MoE blocks of ``model`` whose experts transformers' experts interface never runs, so that
    ``experts_implementation="tilegemm"`` (like any implementation but ``grouped_mm``, which transformers checks)
    leaves them on their own code, silently: ``[(name, what they are and what takes them)]``. Those are the blocks of
    :data:`OWN_FORWARD_BLOCKS` (Llama-4, DBRX, JetMoE) and transformers 4.x-style sparse blocks, which
    :func:`convert_moe_blocks_` (``tilegemm.nn.convert_``) replaces unless it says why not, the blocks of
    :data:`NOT_GROUPED_BLOCKS`, blocks whose experts are a ModuleDict or ModuleList of per-expert MLPs
    (:func:`per_expert_mlps`: SwitchTransformers, NLLB-MoE), which it keeps, converting their Linears one by one,
    and any other module holding 3-D experts with a forward of its own."""
    return [(name, why) for name, why, _ in _off_interface(model)]


def _listing(blocks: list[tuple[str, str]]) -> str:
    """``[(name, why)]`` for a message: the first eight, each with its reason."""
    return "; ".join(f"{n} ({why})" for n, why in blocks[:8]) + (" ..." if len(blocks) > 8 else "")


def asks_tilegemm(model: torch.nn.Module) -> bool:
    """Whether a config of ``model`` (its own or a submodel's) names the ``"tilegemm"`` experts implementation."""
    return any(getattr(getattr(m, "config", None), "_experts_implementation", None) == NAME for m in model.modules())


def experts_off_interface_note(model: torch.nn.Module) -> str | None:
    """What to tell the user where ``model`` asks for ``experts_implementation="tilegemm"`` but has blocks that it
    does not reach (:func:`experts_off_interface`); None where there are none or it asks for another."""
    off = _off_interface(model) if asks_tilegemm(model) else []
    if not off:
        return None
    # promise the grouped kernels only where convert_ replaces a block listed: it leaves the others' experts as they are
    then = ("tilegemm.nn.convert_(model) puts those it replaces on the grouped kernels (tilegemm.nn.quantize_ "
            "converts first)" if any(replaced for _, _, replaced in off) else
            "tilegemm.nn.convert_(model) replaces none of them: their experts stay off the grouped kernels")
    return (f"experts_implementation='tilegemm' does not reach {len(off)} MoE block(s) of "
            f"{type(model).__name__}, which transformers runs with code of their own, not on tilegemm's grouped "
            f"kernels: {_listing([(n, why) for n, why, _ in off])}. {then}")


def convert_moe_blocks_(model: torch.nn.Module, filter=None) -> tuple[list[str], list[tuple[str, str]]]:  # noqa: A002
    """Replace, in place, every transformers 4.x sparse MoE block of ``model`` (that ``filter(name, module)``
    accepts) by a :class:`SparseMoeBlock`, and the blocks of :data:`OWN_FORWARD_BLOCKS` (Llama-4, DBRX, JetMoE) by
    theirs; returns (the names replaced, [(name, why kept)]), the blocks of :data:`NOT_GROUPED_BLOCKS` (Doge's)
    among the kept."""
    done, kept = [], []
    for name, module in list(model.named_modules()):
        if not name or isinstance(module, (SparseMoeBlock, StackedExperts, Llama4MoeBlock, JetMoeBlock)):
            continue  # (the model itself is never swapped: convert the model that holds the block)
        make = OWN_FORWARD_BLOCKS.get(type(module).__name__)
        if type(module).__name__ in NOT_GROUPED_BLOCKS:
            if filter is None or filter(name, module):
                kept.append((name, f"{type(module).__name__}: {NOT_GROUPED_BLOCKS[type(module).__name__]}"))
            continue
        if make is not None:
            names, reason = None, _why_not_own(module)
        else:
            names, reason = legacy_block_parts(module)
            if names is None and reason is None:
                continue
        if filter is not None and not filter(name, module):
            continue
        if reason is not None:
            kept.append((name, reason))
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = make(module) if make is not None else SparseMoeBlock(module, names)
        setattr(parent, child, carry_over(module, new))  # (its hooks and eval mode: Mixtral's jitter is training's)
        done.append(name)
    return done, kept
