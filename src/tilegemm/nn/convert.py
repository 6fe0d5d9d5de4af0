"""``tilegemm.nn.convert_``: swap a model's ``nn.Conv2d`` and ``nn.Linear`` modules for tilegemm's, in place."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.nn.utils import parametrize

from tilegemm.core.dtypes import dtype_name

from tilegemm.nn.conv import Conv2d
from tilegemm.nn.hooks import carry_over
from tilegemm.nn.linear import LINEAR_EQUIVALENT, Linear
from tilegemm.nn.notes import ConversionNote  # noqa: F401 (named here too: tilegemm.nn.convert.ConversionNote)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def subclass_reason(module: torch.nn.Module, base: type, verb: str = "convert") -> str:
    """Why a module of a subclass of ``base`` (``torch.nn.Conv2d`` / ``Linear``) is kept, its class named in full
    (a bare class name reads "Conv2d subclasses Conv2d" for QAT's Conv2d). A parametrized ``base`` (torch gives it
    a subclass of its own) is named as such."""
    cls = parametrize.type_before_parametrizations(module)
    name, base_name = f"{cls.__module__}.{cls.__qualname__}", f"torch.nn.{base.__name__}"
    if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return f"{name} has not made its parameters yet (a lazy module): run the model once on an input, then {verb}"
    if cls is base:
        return (f"a {base_name} parametrized with torch.nn.utils.parametrize ({', '.join(module.parametrizations)}), "
                f"which the tilegemm layer does not carry: {verb} before parametrizing, or remove the "
                f"parametrizations first")
    return f"{name} is a subclass of {base_name}, not {base_name} itself: its forward may differ from {base_name}'s"


def is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's layers): ``x @ weight + bias`` with weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers") \
        and hasattr(module, "nf")


# convert_'s note for transformers' Conv1D, a Linear in all but its weight's layout
CONV1D_KEPT = ("transformers' Conv1D (GPT-2's layers, weight [in, out]): tilegemm.nn.Linear holds [out, in], and "
               "a transposed copy would change the parameters and state dict; it stays a Conv1D (quantize_ takes it)")


# convert_'s and quantize_'s note for nn.MultiheadAttention's out_proj (ViT's): kept whatever its class
MHA_OUT_PROJ_KEPT = ("the output projection of a torch.nn.MultiheadAttention, which passes its weight and bias to "
                     "F.multi_head_attention_forward and never calls it: it stays as it is (the attention's input and "
                     "output projections run on torch)")


def attention_out_projections(model: torch.nn.Module) -> set[int]:
    """ids of the ``out_proj`` modules of ``model``'s ``torch.nn.MultiheadAttention`` layers: the attention reads
    their tensors, so a swapped module would never run (and one without a float weight would break it)."""
    return {id(m.out_proj) for m in model.modules()
            if isinstance(m, torch.nn.MultiheadAttention) and isinstance(getattr(m, "out_proj", None), torch.nn.Module)}


def is_plain_linear(module: torch.nn.Module) -> bool:
    """``torch.nn.Linear`` itself, or a subclass in :data:`LINEAR_EQUIVALENT`."""
    cls = type(module)
    return cls is torch.nn.Linear or (isinstance(module, torch.nn.Linear)
                                      and f"{cls.__module__}.{cls.__qualname__}" in LINEAR_EQUIVALENT)


def is_plain_conv(module: torch.nn.Module) -> bool:
    """``torch.nn.Conv2d`` itself, parametrized or not (``tilegemm.nn.Conv2d.from_conv`` keeps the
    parametrizations: weight_norm, spectral_norm)."""
    return parametrize.type_before_parametrizations(module) is torch.nn.Conv2d


def _stored_weight(module: torch.nn.Module) -> torch.Tensor:
    """The tensor ``module.weight`` is computed from where it is parametrized (weight_norm's ``original0``,
    spectral_norm's ``original``), else ``module.weight``."""
    if not parametrize.is_parametrized(module, "weight"):
        return module.weight
    stored = module.parametrizations.weight
    return stored.original if hasattr(stored, "original") else stored.original0


def _why_not(module: torch.nn.Module) -> str | None:
    """None when ``module`` can be swapped, else the reason it is kept."""
    # a parametrized nn.Linear too: Linear.from_linear keeps the parametrizations, as from_conv does
    plain_linear = is_plain_linear(module) or parametrize.type_before_parametrizations(module) is torch.nn.Linear
    if not is_plain_conv(module) and not plain_linear:
        return subclass_reason(module, torch.nn.Conv2d if isinstance(module, torch.nn.Conv2d) else torch.nn.Linear)
    if "forward" in vars(module):  # a copy would keep running it rather than tilegemm's forward
        return ("its forward was replaced on the instance (a tensor-parallel plan, accelerate's device_map hooks): "
                "convert before applying those")
    if "_conv_forward" in vars(module):  # torch's forward calls it; tilegemm's runs its own product instead
        return "its _conv_forward was replaced on the instance: tilegemm's Conv2d would not run it"
    # the stored tensor's dtype, not module.weight's: a parametrized weight (spectral_norm in training) would run
    # its parametrization, one power iteration changing the module's state
    dtype = _stored_weight(module).dtype
    if dtype not in _DTYPES:
        return f"weight dtype {dtype_name(dtype)} (tilegemm takes fp16, bf16, fp32)"
    if isinstance(module, torch.nn.Conv2d) and isinstance(module.padding, str) and module.padding == "same" \
            and tuple(module.stride) != (1, 1):
        return "padding='same' with stride > 1"
    return None


def convert_(
    model: torch.nn.Module,
    *,
    conv: bool = True,
    linear: bool = True,
    moe: bool = True,
    filter: Callable[[str, torch.nn.Module], bool] | None = None,  # noqa: A002 (as quantize_ names it)
    warn: bool = True,
    fold_batchnorm: bool = False,
) -> torch.nn.Module:
    """Replace ``model``'s ``torch.nn.Conv2d`` (``conv=True``) and ``torch.nn.Linear`` (``linear=True``) modules
    by :class:`tilegemm.nn.Conv2d` / :class:`tilegemm.nn.Linear` sharing their parameters; return ``model``.

    ``moe=True``: the sparse MoE blocks of a transformers 4.x model (its experts a ModuleList of MLPs: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE) become :class:`tilegemm.nn.moe.SparseMoeBlock`, their experts stacked and run by
    tilegemm's grouped kernels; a transformers 5 model whose experts run through transformers' experts interface
    on another implementation is switched to ``"tilegemm"`` (one setting for the whole model: where ``filter``
    declines one of its blocks, or its experts are float64, it is left, and the note names the blocks); and the
    blocks whose experts run code of their own, not transformers' experts interface (Llama-4, DBRX, JetMoE:
    :data:`tilegemm.nn.moe.OWN_FORWARD_BLOCKS`), get experts run by those kernels. Blocks whose
    experts are a ModuleDict of per-expert MLPs (SwitchTransformers, NLLB-MoE: :func:`tilegemm.nn.moe.per_expert_mlps`)
    are kept: ``linear=True`` converts each expert's Linears one by one, with no grouped product. A block
    replaced passes its forward and backward hooks and its training mode to its replacement.

    ``filter(qualified_name, module)`` may veto a swap (False keeps the module). Modules that cannot be
    swapped (subclasses with their own forward, float64 weights,
    ``torch.nn.MultiheadAttention``'s ``out_proj``, which the attention never calls, ...) are kept (transformers'
    ``FalconLinear``, whose forward is Linear's, is swapped: :data:`LINEAR_EQUIVALENT`; so are a parametrized
    Conv2d and Linear, through :meth:`tilegemm.nn.Conv2d.from_conv` and ``Linear.from_linear``), and one
    :class:`ConversionNote` warning names them with the reason (``warn=False`` silences it); so are transformers' ``Conv1D`` layers (GPT-2's; their weight is
    ``[in, out]``), which :func:`tilegemm.nn.quantize_` does take. The list is also left in
    ``model.tilegemm_skipped`` as ``[(name, reason)]``. A module held under several names (or by several parents)
    gets one replacement under all of them (``filter`` is asked with its first name).

    ``fold_batchnorm=True``: then :func:`tilegemm.nn.fold_batchnorm_`, for inference: in eval mode each
    convolution applies the ``BatchNorm2d`` after it and the activation after that in its own launch.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_ takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (torch.nn.Conv2d, torch.nn.Linear)):
        raise ValueError("convert_ swaps the children of a model; to convert one layer, use "
                         "tilegemm.nn.Conv2d.from_conv / tilegemm.nn.Linear.from_linear")
    if filter is not None and not callable(filter):  # (it raised "'int' object is not callable" mid-walk)
        raise TypeError(f"convert_: filter must be a callable (name, module) -> bool or None, got "
                        f"{type(filter).__name__}")
    for flag, value in (("conv", conv), ("linear", linear), ("moe", moe), ("warn", warn),
                        ("fold_batchnorm", fold_batchnorm)):
        if not isinstance(value, bool):  # (a truthy string such as "no" would convert unnoticed)
            raise TypeError(f"convert_: {flag} must be True or False, got {value!r}")
    skipped: list[tuple[str, str]] = []
    if moe:
        from tilegemm.nn.moe import convert_moe_blocks_, use_tilegemm_experts_

        skipped += convert_moe_blocks_(model, filter)[1]
        skipped += use_tilegemm_experts_(model, filter)
    attention_outs = attention_out_projections(model)
    swapped: dict[int, torch.nn.Module] = {}  # id of a module swapped -> its replacement
    seen: set[int] = set()  # modules decided on (under their first name)
    for parent_name, parent in list(model.named_modules()):
        # every attribute holding a module, not named_children (which gives a module held twice once): a module
        # held under two names, or by two parents, gets one replacement under all of them, so ties stay ties
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) in swapped:
                setattr(parent, child_name, swapped[id(child)])
                continue
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, (Conv2d, Linear)):
                continue  # converted already
            if linear and is_conv1d(child) and (filter is None or filter(name, child)):
                skipped.append((name, CONV1D_KEPT))  # named, not passed over: GPT-2 would run almost all on torch
                continue
            want = (conv and isinstance(child, torch.nn.Conv2d)) or (linear and isinstance(child, torch.nn.Linear))
            if not want or (filter is not None and not filter(name, child)):
                continue
            reason = MHA_OUT_PROJ_KEPT if id(child) in attention_outs else _why_not(child)
            if reason is not None:
                skipped.append((name, reason))
                continue
            new = Conv2d.from_conv(child) if isinstance(child, torch.nn.Conv2d) else Linear.from_linear(child)
            carry_over(child, new)  # its hook dicts themselves, as quantize_: a handle the caller holds removes them
            swapped[id(child)] = new
            setattr(parent, child_name, new)
    model.tilegemm_skipped = skipped
    if fold_batchnorm:
        from tilegemm.nn.fold import fold_batchnorm_

        fold_batchnorm_(model)
    if skipped and warn:
        listing = "; ".join(f"{n}: {r}" for n, r in skipped)
        warnings.warn(f"tilegemm.nn.convert_ kept {len(skipped)} module(s) as they were: {listing}", ConversionNote,
                      stacklevel=2)
    return model
