"""Load a 4-bit GPTQ, AWQ, AutoRound or compressed-tensors checkpoint directory: ``from_pretrained(path)`` builds its
``transformers`` model with every quantized Linear a :class:`tilegemm.nn.Int4Linear`; ``load_quantized_(model,
path)`` loads one into a model the caller built.

A checkpoint directory (the Hugging Face layout, ``docs/w4a16.md`` "Loading checkpoints"): ``config.json`` with a
``quantization_config``, tensors in ``model.safetensors`` or in shards listed by ``model.safetensors.index.json``.
A quantized Linear ``P`` stores ``P.qweight``, ``P.qzeros``, ``P.scales`` (GPTQ: ``P.g_idx``; maybe ``P.bias``), or
compressed-tensors' ``P.weight_packed``, ``P.weight_scale`` (``P.weight_zero_point``, ``P.weight_g_idx``,
``P.weight_shape``), instead of ``P.weight``; the rest is stored as plain tensors and loaded as stored. A MoE
block's experts, stored one quantized Linear per expert, are stacked into the block's 4-bit experts
(``tilegemm.nn.moe``).

Memory: the model is built with its parameters on the meta device (no storage), then filled tensor by tensor,
each read straight onto the target device with ``safetensors``; a quantized Linear is built from its packed
tensors (never as a 16-bit weight), so loading peaks at the int4 model plus one layer's conversion.

``transformers`` and ``safetensors`` are imported inside the functions that use them: importing this module (as
``tilegemm.models`` and ``tilegemm.nn.load_quantized_`` do) must not need the ``models`` extra.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import re
import threading
import warnings

import torch
from torch import nn

from tilegemm.core.dtypes import dtype_name
from tilegemm.nn.convert import is_plain_linear, subclass_reason
from tilegemm.nn.int4 import SAVED_METHOD, Int4Linear, guard_quantized_output_resize_, is_conv1d, mark_saved_format_, \
    untie_quantized_outputs_
from tilegemm.nn.fuse import FusedProjections, ProjectionPart
from tilegemm.nn.hooks import carry_over
from tilegemm.nn.transaction import unchanged_on_error
from tilegemm.nn.moe import NAME as MOE_NAME
from tilegemm.nn.moe import (OWN_FORWARD_BLOCKS, _experts_modules, _int4, _stacked_experts, asks_tilegemm,
                             convert_moe_blocks_, experts_off_interface_note, install_int4_experts_, register_experts,
                             use_int4_experts_)
from tilegemm.ops.w4a16 import Int4Weight, dequantize, from_awq, from_compressed_tensors, from_gptq
from tilegemm.ops.w4a16 import dispatch as w4a16_dispatch
from tilegemm.ops.w4a16.format import GROUP_SIZES, _group_size_of, concat_outputs, ct_g_idx, \
    dequantized_overflow, one_group_size, regroup, stack_experts

INSTALL = "pip install 'tilegemm[models]'"
METHODS = ("gptq", "awq", "compressed-tensors", "auto-round", SAVED_METHOD)  # the quant_method values taken
# Intel's AutoRound: its packing formats taken -> the method whose layout they store (its early checkpoints name the
# method "intel/auto-round")
AUTOROUND_PACKINGS = {"auto_round:auto_gptq": "gptq", "auto_round:auto_awq": "awq"}
# AutoRound's own packing (its triton and exllamav2 layers, which its early releases wrote for asymmetric weights and
# named only by the "backend" key; its torch layer, packing_format "auto_round" (asymmetric weights whose layers mix
# bit widths) or "auto_round:gptqmodel" (the same with a g_idx): auto_round_extension/torch/qlinear_torch.py):
# GPTQ's layout with each zero stored as it is, not v1's zero - 1
AUTOROUND_NATIVE = ("auto_round:exllamav2", "auto_round:triton", "auto_round", "auto_round:gptqmodel")
# Settings saying the weights were rotated (the model then transforms activations online): GPTQModel's rotation
# ("hadamard", "random": an online Hadamard on mlp.down_proj's inputs), AutoRound's Hadamard and SpinQuant configs
ROTATION_KEYS = ("rotation", "rotation_config", "spinquant_config")
GPTQ_FORMATS = ("gptq", "gptq_v2")  # GPTQ checkpoint formats: v1 (zero - 1 stored) and v2 (the zero itself)
CT_FORMAT = "pack-quantized"  # the compressed-tensors format taken: 4-bit values eight to an int32
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# The tensors a quantized Linear P stores, by role, for each method: P.<leaf>. "qweight" marks P as stored
# quantized; "g_idx" (act-order) and compressed-tensors' "shape" ([N, K]) are optional.
_LEAVES = {
    "gptq": dict(qweight="qweight", qzeros="qzeros", scales="scales", g_idx="g_idx"),
    "awq": dict(qweight="qweight", qzeros="qzeros", scales="scales"),
    "compressed-tensors": dict(qweight="weight_packed", qzeros="weight_zero_point", scales="weight_scale",
                               g_idx="weight_g_idx", shape="weight_shape"),
    # what save_pretrained writes of a model holding tilegemm's 4-bit layers: Int4Linear's buffers
    SAVED_METHOD: dict(qweight="qweight", qzeros="zeros", scales="scales", g_idx="perm"),
}
# Stored by some checkpoints but recomputed by the model (rotary tables): not an unexpected tensor.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint's ``quantization_config`` says about how its Linears are stored."""

    method: str  # "gptq", "awq", "compressed-tensors" or "tilegemm" (a model tilegemm saved)
    group_size: int  # 32 .. 256, or -1 for all of K
    desc_act: bool = False  # act-order (g_idx a permutation of the groups)
    sym: bool = True
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1) or "gptq_v2"
    modules_to_not_convert: tuple[str, ...] = ()
    # per-module overrides (GPTQModel's "dynamic"; AutoRound's extra_config and block_name_to_quantize):
    # (skip, compiled pattern, overrides, source) in the order they apply; source names the rule for messages
    dynamic: tuple = ()
    bits: int = 4
    # compressed-tensors: (targets, overrides) of each config group, and the ignore list (names, "re:" patterns or
    # class names, matched as compressed-tensors matches them: _ct_match)
    groups: tuple = ()
    ignore: tuple[str, ...] = ()
    # tilegemm: the group sizes its saved config lists (a one-group layer's shapes do not say -1 or its K)
    saved_sizes: tuple[int, ...] = ()
    # tilegemm: the names of each parameter the saved model held under several (ties its config may not restore)
    tied: tuple[tuple[str, ...], ...] = ()
    # where the checkpoint keeps these settings, for messages: config.json's key (an early compressed-tensors
    # checkpoint's "compression_config"), or "" for the top level of an older quantizer's own settings file
    key: str = "quantization_config"
    # the rule that gave one module's settings (for_module's result), for messages; no part of the settings
    rule: str = dataclasses.field(default="", compare=False)

    def for_module(self, name: str, classes: tuple[str, ...] = ("Linear",), alias: str | None = None
                   ) -> "QuantConfig | None":
        """How module ``name`` (whose classes, its MRO's names, are ``classes``) is stored: GPTQ, the first
        ``dynamic`` pattern that matches its name (``re.match``, as GPTQModel matches) overrides group_size, sym,
        desc_act and bits, or (a ``-:`` pattern) leaves it unquantized (None); compressed-tensors, the config
        group of the target that compressed-tensors picks for it (:func:`_ct_scheme`), and None where ``ignore``
        names it or no group targets it; otherwise this config. ``alias``: the module's name in the model where
        it differs from the checkpoint's ``name``; a ``dynamic`` rule matching either applies (a quantizer names
        modules as the model it ran on did, which may be the names transformers gives them now)."""
        if self.method == "compressed-tensors":
            if any(_ct_match(name, classes, t) for t in self.ignore):
                return None
            overrides = _ct_scheme(self.groups, name, classes)
            return None if overrides is None else dataclasses.replace(self, groups=(), ignore=(), **overrides)
        for skip, pattern, overrides, source in self.dynamic:
            if pattern.match(name) or (alias is not None and pattern.match(alias)):
                return None if skip else dataclasses.replace(self, dynamic=(), rule=source, **overrides)
        return self

    def leaf(self, role: str) -> str | None:
        """The name under ``P.`` of a quantized Linear's tensor of ``role`` (qweight, qzeros, scales, g_idx, shape)
        in this method's checkpoints, None if it stores none."""
        return _LEAVES[self.method].get(role)

    @property
    def leaves(self) -> tuple[str, ...]:
        return tuple(_LEAVES[self.method].values())

    def describe(self) -> str:
        if self.method == SAVED_METHOD:
            return "tilegemm's own 4-bit layers, as save_pretrained wrote them"
        if self.method == "awq":
            what = "AWQ (gemm" + (", symmetric)" if self.sym else ")")
        elif self.method == "compressed-tensors":
            what = f"compressed-tensors ({CT_FORMAT}, {'symmetric' if self.sym else 'asymmetric'}" + \
                (", act-order)" if self.desc_act else ")")
        else:
            what = f"GPTQ {'v2' if self.checkpoint_format == 'gptq_v2' else 'v1'}" + (", act-order" if self.desc_act
                                                                                    else "")
        return f"{what}, {self.bits}-bit, group {self.group_size}"


def _ct_match(name: str, classes: tuple[str, ...], target: str) -> bool:
    """Whether a compressed-tensors target or ignore entry names a module: ``"re:<regex>"`` matched at the start
    of its name (``re.match``), else its name exactly or one of its classes' names."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in classes


def _ct_scheme(groups: tuple, name: str, classes: tuple[str, ...]) -> dict | None:
    """The settings of the config group that compressed-tensors applies to module ``name``, None where no group
    targets it. Its precedence, not the config's order: a target naming the module exactly, else a ``re:`` pattern
    matching its name (the first in sorted order), else one of its classes (sorted); a target that several groups
    list is the last one's."""
    by_target = {}
    for targets, overrides in groups:
        for t in targets:
            by_target[t] = overrides  # (a later group takes over a target an earlier one listed)
    ordered = sorted(by_target, key=lambda t: ("re:" in t, t))
    by_name = [t for t in ordered if (re.match(t[3:], name) is not None if t.startswith("re:") else t == name)]
    hit = by_name[0] if by_name else next((t for t in ordered if t in classes), None)
    return None if hit is None else by_target[hit]


# --- the directory --------------------------------------------------------------------------------------


def _flag(settings: dict, name: str, default: bool, at: str) -> bool:
    """The boolean ``settings[name]`` (``default`` where absent or null): JSON's true/false, the integers 0 / 1 or
    the strings "true" / "false" in any case (some exporters write them so: AutoGPTQ's config dataclass saves
    ``desc_act=0`` as given); anything else a ValueError naming ``at`` (the file and key), since Python's truth of
    "false" is True."""
    value = settings.get(name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{at} must be true or false, got {value!r}")


def _check_dir(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming a checkpoint directory, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r}")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory: from_pretrained takes a checkpoint directory (config.json "
                         f"and {SINGLE_FILE} or shards with {INDEX_FILE})")
    return path


# Where quantizers wrote their settings before transformers read them from config.json: AutoGPTQ's and GPTQModel's
# quantize_config.json, AutoAWQ's quant_config.json (file -> the method when the file does not name one).
# AWQ versions whose checkpoints hold GEMM's layout (the name says which kernel AutoAWQ loads them into)
AWQ_GEMM_LAYOUT = ("gemm", "exllama", "exllamav2", "ipex")
SIDECARS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
# AutoAWQ's own keys: a settings file holding them is AWQ's whatever its name (some AWQ checkpoints name it
# quantize_config.json, which vLLM's AWQ reads too: abhinavkulkarni/mosaicml-mpt-7b-instruct-w4-g128-awq)
AWQ_SIDECAR_KEYS = ("w_bit", "q_group_size", "zero_point")


def _json_object(file: str) -> dict:
    try:
        with open(file) as f:
            obj = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _compression_config(c: dict) -> dict:
    """The ``quantization_config`` that compressed-tensors' releases before it adopted that key (2024) wrote under
    ``compression_config``: its quantization settings either nested under ``quantization_config`` (with
    ``sparsity_config`` beside them) or at the top level, as compressed-tensors itself reads that key; their
    ``quant_method`` was then ``"sparseml"`` (or absent), the same settings ``"compressed-tensors"`` names now."""
    inner = c.get("quantization_config")
    q = dict(inner) if isinstance(inner, dict) else {k: v for k, v in c.items() if k != "sparsity_config"}
    if "sparsity_config" in c:  # kept beside the settings: a sparse checkpoint is refused, named, as now
        q["sparsity_config"] = c["sparsity_config"]
    if str(q.get("quant_method") or "sparseml").lower() == "sparseml":
        q["quant_method"] = "compressed-tensors"
    return q


# The entry of read_config's dict saying where settings read from elsewhere than quantization_config are: their
# file and key, which messages name (a user reading "quantization_config" would not find it in config.json).
SETTINGS_AT = "_tilegemm_settings_at"


def _whole(value):
    """``value`` as an int where it is a whole number written as a float (``128.0``: JSON writers that keep every
    number a float), else unchanged, so checks of ints take both spellings of the same number."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _at(key: str, entry: str) -> str:
    """``entry`` of the settings kept under ``key`` (``""``: a settings file's top level), as messages name it."""
    return f"{key}.{entry}" if key else entry


def read_config(path) -> dict:
    """``config.json`` of the checkpoint directory ``path`` as a dict (FileNotFoundError / ValueError naming the
    problem). Without a ``quantization_config`` there, an early compressed-tensors ``compression_config``
    (:func:`_compression_config`) or one of :data:`SIDECARS` (an older quantizer's own settings file) gives it;
    then ``config[SETTINGS_AT]`` is ``(file, key)``, which messages name: the key ``compression_config`` (or
    ``compression_config.quantization_config``, nested), or a sidecar file with key ``""`` (its top level)."""
    path = _check_dir(path)
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no config.json (the model's transformers config)")
    config = _json_object(file)
    if "quantization_config" not in config and isinstance(config.get("compression_config"), dict):
        early = config["compression_config"]
        config["quantization_config"] = _compression_config(early)
        config[SETTINGS_AT] = ("config.json", "compression_config.quantization_config" if isinstance(
            early.get("quantization_config"), dict) else "compression_config")
    if "quantization_config" not in config:
        for name, method in SIDECARS.items():
            sidecar = os.path.join(path, name)
            if os.path.isfile(sidecar):
                q = _json_object(sidecar)
                if any(k in q for k in AWQ_SIDECAR_KEYS):
                    method = "awq"
                config["quantization_config"] = {"quant_method": method, **q}
                config[SETTINGS_AT] = (name, "")
                break
    return config


def quant_config(config: dict, where: str = "config.json") -> QuantConfig:
    """The :class:`QuantConfig` of a config dict's ``quantization_config``; ValueError naming what is not taken."""
    q = config.get("quantization_config")
    if q is None:
        raise ValueError(f"{where} has no quantization_config: not a quantized checkpoint (tilegemm loads 4-bit "
                         f"GPTQ, AWQ, AutoRound and compressed-tensors checkpoints)")
    where, key = config.get(SETTINGS_AT, (where, "quantization_config"))
    if not isinstance(q, dict):
        raise ValueError(f"{where}: quantization_config must be a JSON object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "intel/auto-round":  # AutoRound's early checkpoints
        method = "auto-round"
    if method not in METHODS:
        raise ValueError(f"{where}: quant_method {q.get('quant_method')!r} is not supported; supported: "
                         f"{', '.join(repr(m) for m in METHODS)}")
    if method == "compressed-tensors":
        return _ct_config(q, where, key)
    # Rotations fused into the weights whose inverse the model must apply to activations as it runs (an online
    # Hadamard transform of down_proj's inputs ...): the stored weights alone compute something else
    # (a placeholder such as "none" or {} says no rotation)
    rotation = next((k for k in ROTATION_KEYS if q.get(k) and str(q.get(k)).strip().lower() not in ("none", "null",
                                                                                                     "false")), None)
    if rotation is not None:
        raise ValueError(f"{where}: {_at(key, rotation)} {q[rotation]!r}: the weights were rotated, and the model "
                         f"needs the matching transforms of its activations as it runs, which tilegemm does not "
                         f"apply; checkpoints without rotations load")
    if method == "auto-round":
        return _autoround_config(q, where, key)
    if method == SAVED_METHOD:  # each layer's group length is read from its stored shapes
        if _whole(q.get("bits", 4)) != 4:
            raise ValueError(f"{where}: bits = {q.get('bits')!r}; tilegemm's saved layers are 4-bit")
        listed = q.get("group_size")
        listed = listed if isinstance(listed, list) else [listed]
        tied = q.get("tied_parameters", [])
        if not (isinstance(tied, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                               for g in tied)):
            raise ValueError(f"{where}: tied_parameters must be a list of lists of parameter names, got {tied!r}")
        return QuantConfig(SAVED_METHOD, -1, sym=False, saved_sizes=tuple(
            _whole(s) for s in listed if isinstance(_whole(s), int) and not isinstance(s, bool)),
            tied=tuple(tuple(g) for g in tied), key=key)
    bits = _whole(q.get("bits", q.get("w_bit")))
    if bits != 4:
        raise ValueError(f"{where}: bits = {bits!r}; tilegemm loads 4-bit checkpoints only (bits = 4)")
    # GPTQModel's word width for packed values: other widths than int32 change every packed tensor's shape
    pack_dtype = str(q.get("pack_dtype") or "int32").lower().replace("torch.", "")
    if pack_dtype != "int32":
        raise ValueError(f"{where}: pack_dtype {q.get('pack_dtype')!r} is not supported; tilegemm reads 4-bit values "
                         f"packed eight to an int32 (pack_dtype 'int32')")
    group_size = _whole(q.get("group_size", q.get("q_group_size")))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{where}: group_size must be a positive integer or -1 (all of K), got {group_size!r}")
    not_convert = q.get("modules_to_not_convert") or ()
    if isinstance(not_convert, str) or not all(isinstance(m, str) for m in not_convert):
        raise ValueError(f"{where}: modules_to_not_convert must be a list of module names, got {not_convert!r}")
    if method == "awq":
        # the packing: "version" (AutoAWQ's key), else "format" (transformers v5 and GPTQModel write both); llm-awq's
        # own packing is named by backend "llm-awq", as transformers reads it
        named = "version" if q.get("version") is not None else "format"
        version = str(q.get(named) or "gemm").lower()
        if str(q.get("backend") or "").lower() == "llm-awq":
            named, version = "backend", "llm-awq"
        # AutoAWQ's exllama / exllamav2 / ipex layers read GEMM's stored layout (awq/modules/linear: "only for
        # compatibility with the state_dict of WQLinear_GEMM") and repack it when loaded: named so, the file is gemm
        if version not in AWQ_GEMM_LAYOUT:
            raise ValueError(f"{where}: AWQ {_at(key, named)} {q.get(named)!r} is not supported; only 'gemm' (qweight "
                             f"packed along N, as the 'exllama', 'exllamav2' and 'ipex' versions store it): 'gemv' / "
                             f"'gemv_fast' / 'llm-awq' pack along K")
        # zero_point false (GPTQModel's symmetric AWQ): its stored qzeros (8 each), or 8 where none are stored
        sym = not _flag(q, "zero_point", True, f"{where}: {_at(key, 'zero_point')}")
        return QuantConfig("awq", group_size, sym=sym, modules_to_not_convert=tuple(not_convert), key=key)
    fmt = str(q.get("checkpoint_format", q.get("format", "gptq")) or "gptq").lower()
    # AutoGPTQ's flag for its Marlin repacking (before checkpoint_format existed)
    if _flag(q, "is_marlin_format", False, f"{where}: {_at(key, 'is_marlin_format')}"):
        fmt = "marlin"
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; supported: "
                         f"{', '.join(repr(f) for f in GPTQ_FORMATS)}")
    desc_act = _flag(q, "desc_act", False, f"{where}: {_at(key, 'desc_act')}")
    return QuantConfig("gptq", group_size, desc_act=desc_act, sym=_flag(q, "sym", True, f"{where}: {_at(key, 'sym')}"),
                       checkpoint_format=fmt, modules_to_not_convert=tuple(not_convert),
                       dynamic=_dynamic(q.get("dynamic"), where, key), key=key)


def _autoround_config(q: dict, where: str, key: str = "quantization_config") -> QuantConfig:
    """Intel AutoRound's ``quantization_config`` (``quant_method`` ``"auto-round"``): 4-bit ``int`` weights packed
    as GPTQ v1 (``packing_format`` ``"auto_round:auto_gptq"``, the default; no act-order) or AWQ gemm
    (``"auto_round:auto_awq"``; ``sym`` true stores zeros of 8, as AWQ's ``zero_point`` false), or GPTQ's layout
    with each zero stored as it is (:data:`AUTOROUND_NATIVE`). Its per-layer settings become rules as GPTQModel's
    ``dynamic`` (:class:`QuantConfig`), in the order vLLM applies them: an ``extra_config`` entry naming a layer
    exactly (``bits`` 16 or more: left 16-bit; ``group_size``, ``sym``, ``bits`` of its own), then the first
    ``extra_config`` key holding a regular expression's characters that a layer's name contains a match of
    (``re.search``; outside the blocks only one giving ``bits`` below 16 quantizes a layer), then
    ``block_name_to_quantize`` (alias ``to_quant_block_names``, a comma-separated string or a list of name
    prefixes) leaving every layer outside those blocks 16-bit. Other keys (the tuning's iters, lr, ...) say
    nothing about the tensors and are ignored."""
    at = functools.partial(_at, key)
    packing, named_by = q.get("packing_format"), "packing_format"
    if not packing and q.get("backend"):  # early releases: the layers' packer named by "backend" only
        backend, named_by = str(q["backend"]).lower().replace("autoround", "auto_round"), "backend"
        packing = "auto_round:auto_awq" if "awq" in backend else "auto_round:auto_gptq" if "gptq" in backend else \
            next((p for p in AUTOROUND_NATIVE if ":" in p and backend.startswith(p)), backend)
    packing = packing or "auto_round:auto_gptq"
    if packing not in AUTOROUND_PACKINGS and packing not in AUTOROUND_NATIVE:
        raise ValueError(f"{where}: {at(named_by)} {q.get(named_by)!r} is not supported; supported: "
                         f"{', '.join(repr(p) for p in (*AUTOROUND_PACKINGS, *AUTOROUND_NATIVE))} (AutoRound's GPTQ "
                         f"and AWQ layouts, and its own GPTQ layout with the zeros stored as they are)")
    method = AUTOROUND_PACKINGS.get(packing, "gptq")
    act_bits = q.get("act_bits", 16)
    if packing == "auto_round" and isinstance(act_bits, int) and act_bits < 16:  # (another layer packs those)
        raise ValueError(f"{where}: {at('packing_format')} 'auto_round' with {at('act_bits')} = {act_bits} is not "
                         f"supported: quantized activations; tilegemm runs 16-bit activations")
    data_type = str(q.get("data_type") or "int").lower()
    if data_type != "int":
        raise ValueError(f"{where}: {at('data_type')} {q.get('data_type')!r} is not supported; tilegemm loads "
                         f"AutoRound's integer weights (data_type 'int')")
    bits = _whole(q.get("bits"))
    if bits != 4:
        raise ValueError(f"{where}: {at('bits')} = {bits!r}; tilegemm loads 4-bit checkpoints only (bits = 4)")
    group_size = _whole(q.get("group_size"))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{where}: {at('group_size')} must be a positive integer or -1 (all of K), got "
                         f"{group_size!r}")
    sym = _flag(q, "sym", True, f"{where}: {at('sym')}")
    not_convert = q.get("modules_to_not_convert") or ()
    if isinstance(not_convert, str) or not all(isinstance(m, str) for m in not_convert):
        raise ValueError(f"{where}: {at('modules_to_not_convert')} must be a list of module names, got "
                         f"{not_convert!r}")
    exact, searched = [], []  # extra_config's rules: for layer names, then for regular expressions
    extra = q.get("extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where}: {at('extra_config')} must be a JSON object of layer name -> settings, got "
                         f"{type(extra).__name__}")
    blocks_key = "block_name_to_quantize" if q.get("block_name_to_quantize") is not None else "to_quant_block_names"
    blocks = q.get(blocks_key)
    if isinstance(blocks, str):
        blocks = [b.strip() for b in blocks.split(",")]
    if blocks is not None and (not isinstance(blocks, (list, tuple)) or not all(isinstance(b, str) for b in blocks)):
        raise ValueError(f"{where}: {at(blocks_key)} must be a comma-separated string or a list of module name "
                         f"prefixes, got {q.get(blocks_key)!r}")
    blocks = [b for b in blocks or () if b]
    for name, own in extra.items():
        entry = f"{at('extra_config')}[{name!r}]"
        if not isinstance(own, dict):
            raise ValueError(f"{where}: {entry} must be a JSON object, got {type(own).__name__}")
        layer_bits = _whole(own.get("bits", bits))
        if isinstance(layer_bits, bool) or not isinstance(layer_bits, int):
            raise ValueError(f"{where}: {entry}.bits must be an integer, got {layer_bits!r}")
        if _AUTOROUND_REGEX_CHARS.intersection(name):
            # a regular expression (newer AutoRound writes its layer_config's patterns so: ".*mlp\\.gate.*"), searched
            # anywhere in the name, as vLLM reads it; outside the blocks it quantizes a layer only by bits of its own
            try:
                regex = re.compile(name)
            except re.error as err:
                raise ValueError(f"{where}: {entry}: the key is not a regular expression: {err}") from None
            if not blocks:
                searched.append((_Search(regex), own, layer_bits, entry))
                continue
            searched.append((_Search(regex, blocks, inside=True), own, layer_bits, entry))
            if "bits" in own and layer_bits < 16:
                searched.append((_Search(regex, blocks, inside=False), own, layer_bits, entry))
            continue
        exact.append((re.compile(re.escape(name) + r"\Z"), own, layer_bits, entry))  # the layer's exact name
    rules = []
    for pattern, own, layer_bits, entry in exact + searched:
        if layer_bits >= 16:  # stored unquantized
            rules.append((True, pattern, {}, f"{entry} (bits {layer_bits})"))
            continue
        taken = dict(bits=layer_bits)
        if "group_size" in own:
            gs = _whole(own["group_size"])
            if isinstance(gs, bool) or not isinstance(gs, int) or not (gs == -1 or gs > 0):
                raise ValueError(f"{where}: {entry}.group_size must be a positive integer or -1, got {gs!r}")
            taken["group_size"] = gs
        if own.get("sym") is not None:
            taken["sym"] = _flag(own, "sym", True, f"{where}: {entry}.sym")
        if str(own.get("data_type") or "int").lower() != "int":
            raise ValueError(f"{where}: {entry}.data_type {own.get('data_type')!r} is not supported for a "
                             f"{layer_bits}-bit layer; tilegemm loads integer weights (data_type 'int')")
        rules.append((False, pattern, taken, entry))
    if blocks:  # a layer whose name starts with one of the prefixes (a plain prefix of the string, as vLLM tests)
        # keeps the settings, any other is 16-bit: two rules, so that a layer named by either of its names (the
        # checkpoint's, the model's: for_module) is inside
        rules.append((False, re.compile("|".join(re.escape(b) for b in blocks)), {}, ""))
        rules.append((True, re.compile(""), {}, f"{at(blocks_key)} (its name starts with none of "
                                                f"{', '.join(repr(b) for b in blocks)})"))
    # (AWQ's packing with sym = true stores its zeros, each the values' offset 8, as AWQ's zero_point = false)
    return QuantConfig(method, group_size, sym=sym,
                       checkpoint_format="gptq_v2" if packing in AUTOROUND_NATIVE else "gptq",
                       modules_to_not_convert=tuple(not_convert), dynamic=tuple(rules), key=key)


# The characters that make an AutoRound extra_config key a regular expression rather than a layer's name (vLLM's test)
_AUTOROUND_REGEX_CHARS = frozenset("*+?^$()[]{}|\\")


class _Search:
    """An AutoRound ``extra_config`` regular expression as a rule's pattern: ``match(name)`` searches the name
    (anywhere in it), for the layers inside the name prefixes ``blocks`` (``inside`` True), outside them (False),
    or all (None)."""

    def __init__(self, regex: re.Pattern, blocks=(), inside: bool | None = None):
        self.regex, self.blocks, self.inside = regex, tuple(blocks), inside

    def match(self, name: str) -> bool:
        if self.inside is not None and name.startswith(self.blocks) != self.inside:
            return False
        return self.regex.search(name) is not None


# compressed-tensors' preset schemes that a config group may name instead of spelling out its weights
_CT_PRESETS = {"W4A16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
               "W4A16_ASYM": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)}


def _ct_config(q: dict, where: str, key: str = "quantization_config") -> QuantConfig:
    """A compressed-tensors ``quantization_config`` (llm-compressor's checkpoints): ``config_groups`` of
    weight-only 4-bit integer schemes (``group`` or ``channel`` strategy, symmetric or not, act-order or not)
    stored ``pack-quantized``; ``ignore``. Anything else is refused here, naming the group and the setting (under
    ``key``, the config.json key the settings were read from)."""
    root = key.partition(".")[0]  # (an early checkpoint's sparsity_config sits beside its nested settings)
    top_format = q.get("format")
    sparsity = q.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"{where}: compressed-tensors {_at(root, 'sparsity_config')} format "
                         f"{sparsity.get('format')!r}: sparse weights are not supported (tilegemm loads dense "
                         f"{CT_FORMAT} weights)")
    if q.get("transform_config"):
        raise ValueError(f"{where}: compressed-tensors {_at(key, 'transform_config')} (rotations applied to "
                         f"weights and activations) is not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: compressed-tensors {key or 'settings'} needs config_groups (a JSON object of "
                         f"named schemes), got {groups!r}")
    ignore = q.get("ignore") or ()
    if isinstance(ignore, str) or not all(isinstance(i, str) for i in ignore):
        raise ValueError(f"{where}: {_at(key, 'ignore')} must be a list of module names or patterns, got "
                         f"{ignore!r}")
    _check_ct_patterns(ignore, f"{where}: {_at(key, 'ignore')}")
    rules = []
    for gname, scheme in groups.items():
        at = f"{where}: {_at(key, 'config_groups')}[{gname!r}]"
        if isinstance(scheme, list):  # {"W4A16": ["Linear"]}: a preset named by the group, applied to targets
            if gname.upper() not in _CT_PRESETS:
                raise ValueError(f"{at}: the preset scheme {gname!r} is not supported; supported: "
                                 f"{', '.join(_CT_PRESETS)}")
            scheme = dict(targets=scheme, weights=_CT_PRESETS[gname.upper()])
        if not isinstance(scheme, dict):
            raise ValueError(f"{at} must be a JSON object (a scheme), got {type(scheme).__name__}")
        targets = scheme.get("targets") or []
        if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{at}.targets must be a list of module names, patterns or class names, got "
                             f"{targets!r}")
        _check_ct_patterns(targets, f"{at}.targets")
        for side in ("input_activations", "output_activations"):
            if scheme.get(side) is not None:
                raise ValueError(f"{at} quantizes activations ({side}); tilegemm runs 16-bit activations: "
                                 f"weight-only schemes (W4A16) only")
        fmt = scheme.get("format") or top_format
        if fmt != CT_FORMAT:
            raise ValueError(f"{at}: format {fmt!r} is not supported; supported: {CT_FORMAT!r} (4-bit integers "
                             f"packed eight to an int32)")
        w = scheme.get("weights")
        if not isinstance(w, dict):
            raise ValueError(f"{at} quantizes no weights (weights = {w!r})")
        bits, kind = _whole(w.get("num_bits", 8)), str(w.get("type", "int")).lower()
        if bits != 4 or kind != "int":
            raise ValueError(f"{at}: weights of {bits}-bit {kind} are not supported; tilegemm loads 4-bit int "
                             f"weights")
        if w.get("dynamic"):
            raise ValueError(f"{at}: dynamic weight quantization ({w.get('dynamic')!r}) is not supported")
        gs = _whole(w.get("group_size"))
        strategy = str(w.get("strategy") or ("tensor" if gs is None else "channel" if gs == -1 else "group")).lower()
        if strategy == "channel":
            gs = -1  # one scale a row: all of K
        elif strategy != "group":
            raise ValueError(f"{at}: weights strategy {strategy!r} is not supported; supported: 'group', 'channel'")
        elif isinstance(gs, bool) or not isinstance(gs, int) or gs <= 0:
            raise ValueError(f"{at}: strategy 'group' needs a positive group_size, got {gs!r}")
        actorder = w.get("actorder")
        actorder = ("group" if actorder else None) if isinstance(actorder, bool) or actorder is None else \
            str(actorder).lower()
        if actorder not in (None, "group", "dynamic", "weight", "static"):
            raise ValueError(f"{at}: actorder {actorder!r} is not one of 'group', 'weight' (or null)")
        # "group" (alias "dynamic") stores each input's group (weight_g_idx); "weight" ("static") quantized in
        # activation order but kept its groups in the natural order, so it loads as a plain layer
        sym = _flag(w, "symmetric", True, f"{at}.weights.symmetric")
        rules.append((tuple(targets), dict(group_size=gs, sym=sym, desc_act=actorder in ("group", "dynamic"))))
    first = rules[0][1]
    return QuantConfig("compressed-tensors", first["group_size"], desc_act=first["desc_act"], sym=first["sym"],
                       groups=tuple(rules), ignore=tuple(ignore), key=key)


def _check_ct_patterns(entries, at: str) -> None:
    """Refuse a ``re:`` entry of a target or ignore list that is no regular expression, here, naming it: matching
    modules against it later would raise re.error from the middle of a load."""
    for entry in entries:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as err:
                raise ValueError(f"{at}: {entry!r} is not a regular expression: {err}") from None


def _dynamic(dynamic, where: str, settings: str = "quantization_config") -> tuple:
    """GPTQModel's ``dynamic``: ``{pattern: overrides}``, a pattern ``"-:regex"`` leaving the modules it matches
    unquantized, ``"+:regex"`` or ``"regex"`` giving them other ``bits``/``group_size``/``sym``/``desc_act``
    (``settings``: the key the checkpoint keeps them under, as messages name it)."""
    at = f"{where}: {_at(settings, 'dynamic')}"
    if not dynamic:
        return ()
    if not isinstance(dynamic, dict):
        raise ValueError(f"{at} must be a JSON object of pattern -> overrides, got "
                         f"{type(dynamic).__name__}")
    rules = []
    for key, overrides in dynamic.items():
        skip = key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"{at} pattern {key!r} is not a regular expression: "
                             f"{err}") from None
        if not isinstance(overrides, dict):
            raise ValueError(f"{at}[{key!r}] must be a JSON object, got "
                             f"{type(overrides).__name__}")
        taken = {}
        if not skip:
            if "group_size" in overrides:
                gs = _whole(overrides["group_size"])
                if isinstance(gs, bool) or not isinstance(gs, int) or not (gs == -1 or gs > 0):
                    raise ValueError(f"{at}[{key!r}]: group_size must be a positive "
                                     f"integer or -1, got {gs!r}")
                taken["group_size"] = gs
            for name in ("sym", "desc_act"):
                if overrides.get(name) is not None:
                    taken[name] = _flag(overrides, name, False, f"{at}[{key!r}].{name}")
            if "bits" in overrides:
                taken["bits"] = _whole(overrides["bits"])
        # (skip: the phrase "left 16-bit by ..." ends with; else the entry a layer's bits message names)
        rules.append((skip, compiled, taken, f"the pattern '{key}' of {_at(settings, 'dynamic')}" if skip else
                      _at(settings, "dynamic")))
    return tuple(rules)


def _weight_file_names(path: str) -> tuple[str, str]:
    """(the whole weight file's name, its shards' index's name) in a checkpoint directory:
    ``model.safetensors`` and its index; else those of the ``model_file_base_name`` that AutoGPTQ's and GPTQModel's
    quantize_config.json name (``gptq_model-4bit-128g``: ``.safetensors``, sharded ``.safetensors.index.json``);
    else, without a ``model.safetensors``, the one ``*.safetensors.index.json`` the directory holds."""
    if os.path.isfile(os.path.join(path, SINGLE_FILE)) or os.path.isfile(os.path.join(path, INDEX_FILE)):
        return SINGLE_FILE, INDEX_FILE
    for sidecar in SIDECARS:
        file = os.path.join(path, sidecar)
        try:  # (a settings file left beside a config that holds the settings may be anything: only a name is read)
            base = _json_object(file).get("model_file_base_name") if os.path.isfile(file) else None
        except ValueError:
            base = None
        if isinstance(base, str) and base and os.path.basename(base) == base:
            if os.path.isfile(os.path.join(path, base + ".safetensors")) or \
                    os.path.isfile(os.path.join(path, base + ".safetensors.index.json")):
                return base + ".safetensors", base + ".safetensors.index.json"
    files = os.listdir(path)
    whole = [f for f in files if f.endswith(".safetensors")]
    if len(whole) == 1:  # one file of another name (older quantizers'): before any index
        return whole[0], INDEX_FILE
    indexes = sorted(f for f in files if f.endswith(".safetensors.index.json"))
    return SINGLE_FILE, indexes[0] if len(indexes) == 1 else INDEX_FILE


class _Tensors:
    """The checkpoint's tensors by name, read one at a time from ``model.safetensors`` or the shards that
    ``model.safetensors.index.json`` lists (each shard opened once, lazily). Given the ``model`` they load into, by
    the names the model gives them: transformers' renamings of older checkpoints' names applied
    (:func:`_model_names`)."""

    def __init__(self, path: str, device: torch.device, model: nn.Module | None = None):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ImportError(f"loading a checkpoint needs safetensors: {INSTALL}") from None
        self._open, self.device, self.path = safe_open, device, path
        _load_notes.said = set()  # (a load opens its files once: its warnings said once from here)
        single, self._index = _weight_file_names(path)
        single, index = os.path.join(path, single), os.path.join(path, self._index)
        # a whole file before an index, as transformers reads them (an index left beside it may be stale)
        if not os.path.isfile(single) and os.path.isfile(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    weight_map = None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise ValueError(f"{index} must be JSON with a 'weight_map' of tensor name -> file")
            # the shards lie in the checkpoint's directory (a name reaching out of it is no shard of it)
            outside = sorted({v for v in weight_map.values() if os.path.isabs(v) or
                              os.path.normpath(v).split(os.sep)[0] == os.pardir})
            if outside:
                raise ValueError(f"{index} names files outside the checkpoint's directory: {', '.join(outside)}")
            missing = sorted({file for file in weight_map.values() if not os.path.isfile(os.path.join(path, file))})
            if missing:
                raise FileNotFoundError(f"{os.path.basename(index)} lists shard(s) missing from {path!r}: "
                                        f"{', '.join(missing)}")
            self.files = dict(weight_map)
        else:
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            # one file of another name: older quantizers named it (AutoGPTQ's gptq_model-4bit-128g.safetensors)
            one = os.path.basename(single) if os.path.isfile(single) else found[0] if len(found) == 1 else None
            if one is None:
                others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
                raise FileNotFoundError(
                    f"{path!r} has neither {SINGLE_FILE} nor {INDEX_FILE}" + (
                        f" but {len(found)} safetensors files ({', '.join(found[:4])}): which tensor is where needs "
                        f"the index" if found else f" (it holds {', '.join(others[:4])}: tilegemm reads safetensors "
                        f"checkpoints only; convert the weights to {SINGLE_FILE})" if others else ""))
            with self._open_file(one) as f:
                self.files = {name: one for name in f.keys()}
        self._handles: dict[str, object] = {}
        self._keys: dict[str, set] = {}  # the tensor names each opened file holds
        self._stored: dict[str, str] = {}  # a renamed tensor's name in the model -> its name in the files
        rename = _model_names(model) if model is not None else None
        if rename is not None:
            own = _own_name(model)
            files = {}
            for name, file in self.files.items():
                new = rename(name)
                if new != name and own(name) and not own(new):
                    # stored under the model's own name already (a quantizer that saved the model's state dict):
                    # a renaming meant for the original checkpoints would move it off the model (AXK1's
                    # mlp.post_mlp_layernorm became mlp.mlp.post_mlp_layernorm, DeepSeek-V4's model.norm model.kv_norm)
                    new = name
                if new != name:
                    self._stored[new] = name
                files[new] = file
            if len(files) == len(self.files):  # (two stored names onto one: keep the files' names)
                self.files = files
            else:
                self._stored = {}
        if model is not None:
            self._prefixed(model)

    def _prefixed(self, model: nn.Module) -> None:
        """Names under the model's ``base_model_prefix`` (``model.``) taken as transformers' load takes them: a base
        model (``AutoModel``) loads a checkpoint of its model with a head (its tensors under the prefix; the head's
        are strays), and a model with a head loads one of the base model (stored without the prefix)."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        if not prefix:
            return
        dotted = f"{prefix}."
        under = [n for n in self.files if n.startswith(dotted)]
        base = getattr(model, prefix, None)
        if under and not isinstance(base, nn.Module) and not any(
                n.startswith(dotted) for n, _ in model.named_parameters(remove_duplicate=False)):
            moved = {n[len(dotted):]: n for n in under}
            head = sorted(n for n in self.files if not n.startswith(dotted))
            if head:  # a head the base model has not: not loaded, as transformers leaves it
                warnings.warn(f"load_quantized_: {type(model).__name__} is the base model of the checkpoint's; its "
                              f"{len(head)} tensor(s) outside '{dotted}' (the head: {', '.join(head[:4])}"
                              f"{' ...' if len(head) > 4 else ''}) are not loaded", stacklevel=4)
                self.files = {n: f for n, f in self.files.items() if n.startswith(dotted)}
        elif not under and isinstance(base, nn.Module):
            heads = {n for n, _ in model.named_parameters(remove_duplicate=False) if not n.startswith(dotted)}
            moved = {f"{dotted}{n}": n for n in self.files if n not in heads}
        else:
            return
        if any(n in self.files and n not in moved.values() for n in moved):  # (a name both ways: as stored)
            return
        files = {n: f for n, f in self.files.items() if n not in moved.values()}
        for new, old in moved.items():
            files[new] = self.files[old]
            self._stored[new] = self._stored.pop(old, old)
        self.files = files

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            device = "cpu" if self.device.type == "cpu" else str(self.device)  # "cuda:0": safetensors' spelling
            self._handles[file] = self._open_file(file, device=device)
        return self._handles[file]

    def _open_file(self, file: str, **kwargs):
        """``safe_open`` of ``file`` in the checkpoint; a file that is no safetensors file (truncated, another
        format, a directory) is a ValueError naming it, not safetensors' header error that names none."""
        try:
            return self._open(os.path.join(self.path, file), framework="pt", **kwargs)
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors' SafetensorError (a plain Exception subclass), or an OSError
            if isinstance(e, (ImportError, MemoryError)):
                raise
            raise ValueError(f"{os.path.join(self.path, file)!r} is not a readable safetensors file "
                             f"({type(e).__name__}: {e})") from None

    def _holding(self, name: str):
        """The open file that holds ``name``; a FileNotFoundError naming the index's wrong entry otherwise."""
        handle, stored, file = self._handle(name), self._stored.get(name, name), self.files[name]
        if file not in self._keys:
            self._keys[file] = set(handle.keys())
        if stored not in self._keys[file]:
            raise FileNotFoundError(f"{self._index} in {self.path!r} maps {stored} to {self.files[name]}, which does "
                                    f"not hold it")
        return handle

    def shape(self, name: str) -> list[int]:
        return list(self._holding(name).get_slice(self._stored.get(name, name)).get_shape())

    def stored_module(self, module: str, leaves: tuple[str, ...]) -> str:
        """The name module ``module`` of the model has in the files (what the quantizer called it, where
        transformers renames it since), read from the first of its ``leaves`` stored; ``module`` otherwise."""
        for leaf in leaves:
            stored = self._stored.get(f"{module}.{leaf}")
            if stored is not None:
                return stored.rpartition(".")[0]
        return module

    def get(self, name: str) -> torch.Tensor:
        return self._checked(name, self._holding(name).get_tensor(self._stored.get(name, name)))

    def get_slice(self, name: str, index: tuple) -> torch.Tensor:
        """``tensor[index]`` read without reading the rest (a tensor-parallel rank's shard)."""
        return self._checked(name, self._holding(name).get_slice(self._stored.get(name, name))[index])

    def _checked(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t``, refused where its name says it holds real numbers (a weight, bias or scale) but it is stored as
        integers or booleans: cast to 16 bits they would load without error as values 1000x off."""
        if not t.is_floating_point() and _REAL_VALUED.search(name):
            raise TypeError(f"the checkpoint at {self.path!r} stores {self._stored.get(name, name)} as "
                            f"{dtype_name(t.dtype)}; a weight, bias or scale must be a floating-point tensor")
        if t.dtype == torch.uint32:  # packed words some writers store unsigned: the same 32 bits as int32
            return t.view(torch.int32)
        return t


# Tensors the checkpoint must store as floating point: plain weights and biases, and the quantized formats' scales
# (GPTQ/AWQ "scales", compressed-tensors' "weight_scale", tilegemm's saved experts' "<proj>_scales").
_REAL_VALUED = re.compile(r"(\.weight|\.bias|scales|_scale)$")


_QUANT_LEAVES = frozenset(leaf for leaves in _LEAVES.values() for leaf in leaves.values())  # every method's


def _own_name(model: nn.Module):
    """A function telling whether a stored tensor name is one of ``model``'s own: a state dict key, a packed part
    (``.qweight`` ...) of one of its modules, or a tensor of one expert's Linear ``<block>.<e>.<proj>.<leaf>`` of
    one of its stacked experts blocks (as quantizers store them)."""
    keys = set(model.state_dict(keep_vars=True))
    modules = {n for n, _ in model.named_modules()}
    blocks = {n for n, _, _ in _stacked_experts(model)}

    def own(name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        parts = module.split(".")
        return name in keys or (leaf in _QUANT_LEAVES and module in modules) or (
            len(parts) > 2 and parts[-2].isdigit() and ".".join(parts[:-2]) in blocks)

    return own


def _model_names(model: nn.Module):
    """A function from a checkpoint's tensor name to the model's, by the renamings transformers applies when it
    loads an older checkpoint into ``model`` (Gemma-3's ``language_model.model.`` -> ``model.language_model.``,
    PhiMoE's ``block_sparse_moe.gate.weight`` -> ``mlp.router.weight``, ...); None where transformers has none.
    Packed parts (``.qweight``, ``.weight_packed`` ...) are renamed as their module's ``.weight`` is (a name the
    model has already stays: :class:`_Tensors`). Transformers' converters (its
    experts merges) are not applied: per-expert checkpoints are stacked here (:func:`_stored_experts`)."""
    try:  # transformers >= 5's loading internals; without them the names stay as stored
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        if not renamings:
            return None
        for t in renamings:  # (the form this function reads: a (new name, matched pattern) pair)
            probe = t.rename_source_key("probe.weight")
            if not (isinstance(probe, tuple) and isinstance(probe[0], str)):
                return None
    except Exception:  # noqa: BLE001 (any failure of internals that change between releases: names as stored)
        return None

    def renamed(key: str) -> str:
        for t in renamings:
            key = t.rename_source_key(key)[0]
        return key

    def rename(name: str) -> str:
        module, _, leaf = name.rpartition(".")
        new = renamed(name)
        if module and leaf in _QUANT_LEAVES:
            weight = renamed(f"{module}.weight")
            if weight.endswith(".weight"):
                new = f"{weight[:-len('.weight')]}.{leaf}"
        return new

    return rename


# --- building the model -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no storage) and their buffers as usual:
    the rotary tables a model computes in ``__init__`` keep their values, and the weights are loaded later."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _check_dtype(dtype) -> None:
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or 'auto' (or a name of one: 'float16', "
                        f"'bfloat16', 'fp16', 'bf16', 'half'; the 4-bit kernels' activations), "
                        f"got {dtype_name(dtype) if isinstance(dtype, torch.dtype) else repr(dtype)}")


# names a dtype may be given by, as torch and transformers spell them ("torch.float16" too)
_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype, path) -> torch.dtype:
    """``dtype``, or for ``"auto"`` the one the checkpoint's config names (``dtype`` / ``torch_dtype``): bf16 where
    it says bfloat16, else fp16 (the kernels' activations are 16-bit, whatever an fp32 config says)."""
    named = _DTYPE_NAMES.get(dtype.strip().lower().replace("torch.", "")) if isinstance(dtype, str) else None
    if named is not None:
        return named
    if isinstance(dtype, str) and dtype == "auto":
        config = read_config(path)
        text = config.get("text_config") or {}  # (a composite model's language part)
        named = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
        return torch.bfloat16 if str(named).replace("torch.", "") == "bfloat16" else torch.float16
    return dtype


def _default_device(device) -> torch.device:
    """``device``, or CUDA where there is one, else the CPU; a CUDA device with its index (what tensors report).
    Refuses, naming it, a device the checkpoint's tensors cannot be read onto, before anything is read."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device, a str such as 'cuda:0' or a CUDA index, got "
                        f"{type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as e:  # torch's parse error of a malformed string, or an index with no accelerator
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    if device.type == "meta":  # safetensors reads onto real devices only; empty_model builds on meta already
        raise ValueError("device 'meta' cannot hold the checkpoint's tensors: name the device to load them onto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA GPU is available here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def from_pretrained(path, dtype: torch.dtype = torch.float16, device=None, model_class=None,
                    experts_implementation: str | None = None) -> nn.Module:
    """The ``transformers`` causal-LM of the quantized checkpoint directory ``path``, in eval mode on ``device``
    (default: CUDA when there is one, else the CPU): every Linear stored quantized is an
    :class:`~tilegemm.nn.Int4Linear`, every other tensor loaded as stored (floats in ``dtype``, fp16 or bf16, or
    their names as strings; None: fp16; ``"auto"``: bf16 where the checkpoint's config says bfloat16, else fp16).
    Parameters that are not 4-bit require grad as transformers' own load leaves them.

    Any architecture ``transformers.AutoModelForCausalLM`` knows; ``quantization_config``: GPTQ (``checkpoint_format``
    ``"gptq"`` (v1) or ``"gptq_v2"``; act-order ``desc_act``; symmetric or not), AWQ (``version: "gemm"``), Intel
    AutoRound (``packing_format`` ``"auto_round:auto_gptq"`` or ``"auto_round:auto_awq"``) or compressed-tensors
    (llm-compressor's W4A16 schemes stored ``"pack-quantized"``: 4-bit int weights, group or channel strategy,
    symmetric or not, act-order), 4 bits, any group size (32, 64, 128, 256 and -1 = all of K as stored; others
    exactly as groups of the largest of those dividing them, 512 as 256). Raises FileNotFoundError, ValueError or
    TypeError naming the problem (no directory, no config.json, no quantization_config, another method or bit width,
    missing tensors, shapes that do not match the config).

    Mixture-of-experts checkpoints storing each expert as its own quantized Linear (``<block>.<e>.gate_proj`` ...,
    Mixtral's ``block_sparse_moe.experts.<e>.w1`` ...) load into the blocks' stacked 4-bit experts, run by the
    ``"tilegemm"`` experts implementation (``docs/w4a16.md`` "Loading checkpoints"; act-order experts keep each
    expert's input order).

    ``model_class``: the class that builds the model from its config, a transformers auto class
    (``AutoModelForSequenceClassification``, ``AutoModelForImageTextToText``, ...) or a model class; default
    ``AutoModelForCausalLM``.

    ``experts_implementation``: what the model is built with (transformers' ``experts_implementation=``, checked
    by transformers); ``"tilegemm"`` runs 16-bit experts blocks on tilegemm's grouped kernels too. Blocks holding
    4-bit experts run ``"tilegemm"`` whatever is asked (a warning says so where another was). Where the model asks
    for ``"tilegemm"`` but has MoE blocks that transformers runs with code of their own (Llama-4's stored 16-bit,
    DBRX, JetMoE), a warning names them and ``tilegemm.nn.convert_``, which puts them on the grouped kernels.
    """
    dtype = resolve_dtype(torch.float16 if dtype is None else dtype, path)
    model, device = empty_model(path, dtype, device, model_class, experts_implementation)
    load_quantized_(model, path, dtype=dtype, device=device)
    _check_asked_experts(model, experts_implementation)
    load_generation_config_(model, path)
    return model.eval()


GENERATION_FILE = "generation_config.json"


def load_generation_config_(model: nn.Module, path) -> None:
    """The checkpoint's ``generation_config.json`` (its end-of-sequence ids, sampling defaults) as the model's
    ``generation_config``, as transformers' own ``from_pretrained`` loads it; a model built from its config alone
    has only the defaults derived from ``config.json`` (a chat model's extra EOS ids missing). Nothing where the
    file is absent or the model does not generate."""
    file = os.path.join(os.fspath(path), GENERATION_FILE)
    can_generate = getattr(model, "can_generate", None)
    if not os.path.isfile(file) or not hasattr(model, "generation_config") or not (can_generate and can_generate()):
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(os.fspath(path))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{file} is not a generation config transformers reads: {e}") from None


def _check_asked_experts(model: nn.Module, asked: str | None) -> None:
    """Warn where the load switched a model built with another ``experts_implementation`` to ``"tilegemm"`` (its
    4-bit experts run on nothing else)."""
    if asked is not None and asked != MOE_NAME and asks_tilegemm(model):
        warnings.warn(f"experts_implementation={asked!r}: the checkpoint's experts load 4-bit, which only the "
                      f"'{MOE_NAME}' implementation runs; the model uses '{MOE_NAME}'", stacklevel=3)


def empty_model(path, dtype: torch.dtype = torch.float16, device=None, model_class=None,
                experts_implementation: str | None = None) -> tuple[nn.Module, torch.device]:
    """The checkpoint's ``transformers`` model built from its config (by ``model_class``, default
    ``AutoModelForCausalLM``) with its parameters on the meta device (the checkpoint's tensors fill them), and the
    device they go to; what :func:`from_pretrained` and the sharded load
    (:func:`tilegemm.parallel.from_pretrained_sharded`) start from. ``experts_implementation``: passed to the
    build, as transformers' ``from_config`` takes it (None: transformers' default)."""
    _check_dtype(dtype)
    if model_class is not None and not (isinstance(model_class, type) and (
            hasattr(model_class, "from_config") or hasattr(model_class, "_from_config"))):
        raise TypeError(f"model_class must be a transformers auto class or model class (one with from_config), got "
                        f"{model_class!r}")
    device = _default_device(device)
    config_dict = read_config(path)
    quant_config(config_dict)  # refuse what cannot load before building anything
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ImportError(f"from_pretrained needs transformers: {INSTALL}") from None
    config = AutoConfig.from_pretrained(os.fspath(path))
    if model_class is None:
        model_class = AutoModelForCausalLM
        mapping = getattr(AutoModelForCausalLM, "_model_mapping", None)
        if mapping is not None and type(config) not in mapping:  # (an encoder, a seq2seq model, a classifier)
            model_class = _named_causal_lm(config)
            if model_class is None:
                raise ValueError(f"AutoModelForCausalLM has no model for {type(config).__name__} ({path!r}): pass "
                                 f"model_class, e.g. transformers.AutoModelForSeq2SeqLM or "
                                 f"AutoModelForSequenceClassification")
    wants = getattr(model_class, "config_class", None)  # (a model class; auto classes name theirs by mapping)
    if isinstance(wants, type) and not isinstance(config, wants):  # (it failed inside transformers' __init__)
        raise TypeError(f"model_class {model_class.__name__} is built from a {wants.__name__}, and the checkpoint's "
                        f"config ({path!r}) is a {type(config).__name__}: pass a class of that config's models "
                        f"(e.g. {type(config).__name__.removesuffix('Config')}ForCausalLM), or leave model_class out")
    # Built from the config alone: transformers' own quantizers (which from_config does not run) stay out of it;
    # load_quantized_ replaces its quantization_config by tilegemm's (what the loaded model holds and saves).
    if experts_implementation is not None and not isinstance(experts_implementation, str):
        raise TypeError(f"experts_implementation must be a str naming one (e.g. 'tilegemm', 'grouped_mm', 'eager') "
                        f"or None, got {type(experts_implementation).__name__}")
    return _meta_model(model_class, config, dtype, experts_implementation), device


def _named_causal_lm(config):
    """The causal-LM class the config's ``architectures`` names, where the auto mapping lists no model for the
    config (Emu3's text model: ``Emu3ForCausalLM`` saves an ``Emu3TextConfig``, which only the composite
    ``Emu3Config`` maps to): a transformers ``*ForCausalLM`` class built from exactly this config class; else None."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) and name.endswith("ForCausalLM") else None
        if isinstance(cls, type) and getattr(cls, "config_class", None) is type(config):
            return cls
    return None


def _meta_model(auto_class, config, dtype: torch.dtype, experts_implementation: str | None = None) -> nn.Module:
    """``auto_class.from_config(config)`` with floats in ``dtype`` and its parameters on the meta device (filled
    from a checkpoint or another model afterwards: nothing the size of the model is allocated here).
    ``auto_class`` may also be a model class itself (``BertModel``), built by its ``_from_config``."""
    # auto classes have from_config; a PreTrainedModel subclass has only _from_config (what from_config calls)
    build = getattr(auto_class, "from_config", None) or auto_class._from_config
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _parameters_on_meta():
            return build(config, **({} if experts_implementation is None else
                                     {"experts_implementation": experts_implementation}))
    finally:
        torch.set_default_dtype(old)


# --- loading into a model ----------------------------------------------------------------------------------


def _not_converted(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one ``modules_to_not_convert`` names: an entry that is the module's name, or the
    end of it at a dot, or either for a module around it (``"mlp.experts"`` names the experts block of every layer,
    and so each expert Linear in it), or a regular expression matching the name from its start up to a dot
    (``"model.layers.*.mlp"``), as transformers reads the list."""
    if not patterns:
        return False
    plain, regexes = _entries(patterns)
    parts = name.split(".")
    # a plain entry names a module or one around it by the end of its name at a dot: a run of the name's parts
    return any(".".join(parts[i:j]) in plain for j in range(1, len(parts) + 1) for i in range(j)) or \
        any(_pattern_names(p, name) for p in regexes)


def _named_16_bit(q: QuantConfig, stored: str, name: str) -> bool:
    """Whether ``q.modules_to_not_convert`` names a module under the name the checkpoint stores it by or the model's
    (transformers renames some since their quantizers ran)."""
    return _not_converted(stored, q.modules_to_not_convert) or _not_converted(name, q.modules_to_not_convert)


@functools.lru_cache(maxsize=64)
def _entries(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The plain entries as a set (a lookup a run of a name's parts, however many entries a config lists) and
    the regular expressions."""
    return frozenset(patterns), tuple(p for p in patterns if _REGEX_CHARS.intersection(p))


# transformers' should_convert_module also takes an entry as a regular expression matched from the start of the name
# up to a dot ("model.layers.*.mlp"); an entry that does not compile is only a name.
_REGEX_CHARS = frozenset("*+?[](){}|^$\\")


def _pattern_names(pattern: str, name: str) -> bool:
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:
        return False


def _linear_shape(m: nn.Module) -> tuple[int, int] | None:
    """``(out, in)`` of a Linear a checkpoint may store quantized: ``nn.Linear``, or transformers' ``Conv1D``
    (GPT-2's layers: ``x @ weight + bias`` with weight ``[in, out]``, which GPTQ stores as the Linear of the
    transposed weight); None for other modules."""
    if isinstance(m, (nn.Linear, Int4Linear)):  # (an Int4Linear: a model quantized already, rebuilt from it)
        return m.out_features, m.in_features
    if is_conv1d(m):
        return int(m.nf), int(m.weight.shape[0])
    return None


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.dtype in (torch.float16, torch.bfloat16):
            return p.dtype
    return torch.float16


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating-point parameters (an fp32 model's Int4Linears hold fp32 biases and fp16
    scales: the parameters say which), else of its 4-bit scales."""
    for p in model.parameters():
        if p.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return p.dtype
    for name, b in model.named_buffers():
        if name.endswith("scales") and b.is_floating_point():
            return b.dtype
    return torch.float16


def _plain_dtypes(model: nn.Module, dtype: torch.dtype):
    """The dtype each plain (not quantized) float tensor of ``model`` loads in, by name: fp32 for the modules the
    model keeps in fp32 at any 16-bit dtype (``_keep_in_fp32_modules_strict``: routers such as DeepSeek-V3's
    ``gate.weight``, which transformers loads in fp32), a parameter's own dtype where the model declares it apart
    from the rest (Inkling-2's fp32 router weight, which its forward multiplies by fp32 activations), else
    ``dtype``. (The non-strict ``_keep_in_fp32_modules``, which transformers applies at fp16 only, is not: a model
    written for bf16 can feed such a module fp16 activations, as DeepSeek-V4's indexer does.)"""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (
        torch.float16, torch.bfloat16) else set()
    # transformers' match: each entry a glob ("*" any text) searched anywhere in the name
    pattern = re.compile("|".join(f"(?:{k.replace('*', '.*')})" for k in sorted(keep))) if keep else None
    sizes: dict[torch.dtype, int] = {}
    for t in model.parameters():  # (asked before the quantized layers are built: their 16-bit scales would count)
        if t.is_floating_point():
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    main = max(sizes, key=sizes.get) if sizes else dtype  # the dtype the model was built in
    declared = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}

    def of(name: str) -> torch.dtype:
        if pattern is not None and pattern.search(name):
            return torch.float32
        own = declared.get(name)
        return own if own is not None and own != main else dtype

    return of


def _model_device(model: nn.Module) -> torch.device | None:
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            return t.device
    return None


def _one_group(group_size: int, K: int) -> bool:
    """Whether a layer of ``K`` inputs is stored as one group: group_size -1, or K below it (the quantizers store
    ``ceil(K / group_size)`` = 1 group then, all of K)."""
    return group_size == -1 or K < group_size


def _partial_group(group_size: int, K: int) -> bool:
    """Whether ``K`` inputs end in a partial group of ``group_size``: the quantizers then store ``ceil(K /
    group_size)`` groups, the last one short."""
    return not _one_group(group_size, K) and K % group_size != 0


def _regroups(group_size: int, K: int) -> bool:
    """Whether a layer of ``K`` inputs stored in groups of ``group_size`` loads in other groups: its last group is
    partial, or its group length is one the kernels do not take (512, 1024, 96, ...)."""
    return not _one_group(group_size, K) and (K % group_size != 0 or
                                              group_size not in GROUP_SIZES and K != group_size)


def _kernel_group(group_size: int, K: int) -> int | None:
    """The group length such a layer loads as, exactly: the largest the kernels take that divides
    ``gcd(K, group_size)`` (every run of it lies inside one stored group), or None where none does."""
    g = math.gcd(K, group_size)
    return next((x for x in sorted(GROUP_SIZES, reverse=True) if x > 0 and g % x == 0), None)


def _groups_fit(group_size: int, K: int) -> bool:
    """Whether a layer of ``K`` inputs stored in groups of ``group_size`` loads: in its own groups, or in groups of
    :func:`_kernel_group` (:func:`_whole_groups`)."""
    return not _regroups(group_size, K) or _kernel_group(group_size, K) is not None


def _partial_group_problem(group_size: int, K: int) -> str:
    """Why a layer of ``K`` inputs in groups of ``group_size`` does not load (for messages)."""
    why = (f"in_features {K} is not divisible by group_size {group_size}: its last group is partial" if K % group_size
           else f"group_size {group_size} is not a group length the kernels take")
    return (f"{why}, and no group length the kernels take ({', '.join(str(g) for g in GROUP_SIZES if g > 0)}) "
            f"divides gcd({K}, {group_size}) = {math.gcd(K, group_size)}, which would load it exactly")


def _whole_groups(parts: dict, g_idx, q: QuantConfig, K: int) -> tuple[dict, torch.Tensor | None]:
    """A stored layer whose last group is partial (``K`` not a multiple of ``q.group_size``) or whose group length
    the kernels do not take, as the same weight in groups of ``g`` (:func:`_kernel_group`, a divisor of
    ``gcd(K, group_size)``): every g inputs lie inside one stored group, so each new group takes that group's scale
    and zero (exact). Act-order: the inputs sorted by stored group (each of group_size but the last) are cut into
    groups of g in that order. ``parts`` and ``g_idx`` as :func:`_stored_parts` reads them."""
    gs = q.group_size
    g = _kernel_group(gs, K)
    if g is None:
        raise ValueError(_partial_group_problem(gs, K))
    # compressed-tensors holds groups in columns ([N, G], zeros [ceil(N/8), G] or [N, G]); GPTQ / AWQ in rows
    dim = 1 if q.method == "compressed-tensors" else 0
    for role in ("scales", "qzeros"):
        t = parts[role]
        if t is not None:
            parts[role] = t.index_select(dim, torch.arange(K // g, device=t.device) * g // gs).contiguous()
    if q.method == "compressed-tensors":
        g_idx = ct_g_idx(g_idx)  # (all -1: the natural order)
    if g_idx is None:
        return parts, None
    if not isinstance(g_idx, torch.Tensor) or g_idx.dtype.is_floating_point or tuple(g_idx.shape) != (K,):
        raise ValueError(f"g_idx must be an integer tensor [K] = [{K}]")
    g_idx = g_idx.to(torch.int64)
    order = torch.sort(g_idx, stable=True).indices
    natural = torch.arange(K, device=g_idx.device)
    if not torch.equal(g_idx[order], natural // gs):
        raise ValueError(f"g_idx must put group_size = {gs} inputs in each group but the last, which holds the "
                         f"other {K % gs} (K = {K})")
    rank = torch.empty_like(order)
    rank[order] = natural  # each input's place in the order sorted by group
    return parts, rank // g


def _packing_problem(q: QuantConfig, N: int, K: int) -> str | None:
    """Why a Linear ``[N, K]`` cannot be stored quantized under ``q``'s format, or None. Every format packs the
    weight along K eight to an int32; GPTQ and AWQ also pack along N (their ``[G, N/8]`` zeros, AWQ's weight), with
    no room for a partial word, while compressed-tensors pads its zeros to ``ceil(N/8)`` rows and tilegemm's own
    buffers pack along K only, so those take any N."""
    if K % 8:
        return f"in_features {K} is not a multiple of 8 (eight 4-bit weights per int32, packed along the inputs)"
    if N % 8 and q.method == "gptq":
        return (f"out_features {N} is not a multiple of 8, which GPTQ's format needs: it packs the zero points along "
                f"the outputs, eight to an int32 (qzeros [G, N/8])")
    if N % 8 and q.method == "awq":
        return (f"out_features {N} is not a multiple of 8, which AWQ's format needs: it packs the weight and zero "
                f"points along the outputs, eight to an int32 (qweight [K, N/8], qzeros [G, N/8])")
    return None


def _expected_quant_shapes(q: QuantConfig, N: int, K: int) -> dict[str, tuple[list, bool]]:
    """The tensors a quantized Linear ``[N, K]`` stores under ``q``: leaf -> (the shapes it may have, required)."""
    if q.method == SAVED_METHOD:  # Int4Linear's buffers, in any group length the kernels take (the layer's own)
        groups = [[G, N] for G in _group_counts(K)]
        return dict(qweight=([[K // 8, N]], True), scales=(groups, True), zeros=(groups, True),
                    perm=([[K], [0]], False))
    G = 1 if _one_group(q.group_size, K) else -(-K // q.group_size)  # (a partial last group: _groups_fit said it loads)
    if q.method == "gptq":
        return dict(qweight=([[K // 8, N]], True), qzeros=([[G, N // 8]], True), scales=([[G, N]], True),
                    g_idx=([[K]], q.desc_act))
    if q.method == "awq":
        return dict(qweight=([[K, N // 8]], True), qzeros=([[G, N // 8]], not q.sym), scales=([[G, N]], True))
    # compressed-tensors: zero points only when asymmetric, packed along N in ceil(N/8) rows (or, from releases
    # before that packing, the [N, G] zeros themselves); the group of each input when quantized in activation order
    return dict(weight_packed=([[N, K // 8]], True), weight_scale=([[N, G]], True),
                weight_zero_point=([[-(-N // 8), G], [N, G]], not q.sym), weight_g_idx=([[K]], q.desc_act),
                weight_shape=([[2]], False))


def _group_counts(K: int) -> list[int]:
    """The numbers of groups a layer of ``K`` inputs may hold in tilegemm's format: one, or K over a group size."""
    return [1] + [K // gs for gs in GROUP_SIZES if 0 < gs < K and K % gs == 0]


def _saved_weight(qweight, scales, zeros, perm, shape, sizes: tuple[int, ...] = ()) -> Int4Weight:
    """The :class:`Int4Weight` of tilegemm's stored buffers (``perm`` empty: no act-order; a stacked experts
    weight: every part with a leading E), its group length read from the scales' shape; one group is K where the
    saved config's group sizes ``sizes`` list K, else -1 where they list -1."""
    K, G = shape[-1], scales.shape[-2]
    perm = perm.to(torch.int64) if perm is not None and perm.numel() else None
    gs = one_group_size(K, sizes) if G == 1 else _group_size_of(G, K)  # (Int4Linear's state dict load: alike)
    return Int4Weight(qweight, scales, zeros.to(scales.dtype), gs, shape, perm)


def _check_quant_shapes(tensors: "_Tensors", prefix: str, q: QuantConfig, N: int, K: int, what: str,
                        problems: list, missing: list) -> set:
    """Check the stored tensors of the quantized Linear ``prefix`` (``[N, K]``, ``what`` names it in messages)
    against ``q``, appending to ``problems`` / ``missing``; the names found."""
    expected = {f"{prefix}.{part}": spec for part, spec in _expected_quant_shapes(q, N, K).items()}
    found = _check_stored(tensors, expected, f"what {what} with {q.describe()} stores", problems, missing)
    key = f"{prefix}.weight_shape"
    if key in found and tensors.shape(key) == [2] and [int(v) for v in tensors.get(key).tolist()] != [N, K]:
        problems.append(f"{key}: the checkpoint says the weight is {tensors.get(key).tolist()}, the model's is "
                        f"[{N}, {K}]")
    return found


def _check_stored(tensors: "_Tensors", expected: dict, what: str, problems: list, missing: list) -> set:
    """Check stored tensors against ``expected`` (name -> (the shapes it may have, required)), appending to
    ``problems`` (a shape none of those, followed by ``what``) and ``missing``; the names found."""
    found = set()
    for key, (shapes, required) in expected.items():
        if key not in tensors:
            if required:
                missing.append(key)
            continue
        found.add(key)
        if tensors.shape(key) not in shapes:
            problems.append(f"{key}: the checkpoint's shape {tensors.shape(key)} does not match "
                            f"{' or '.join(map(str, shapes))}, {what}")
    return found


# Output columns converted at a time, as a count of weights: the importers and the fragment layout make int64
# temporaries of about 16-25 bytes a weight, so a whole Llama-sized Linear at once would cost more memory than the
# int4 model's margin allows; column slices that are multiples of 256 convert independently (the fragment layout
# packs whole blocks of 256 output rows).
CHUNK_WEIGHTS = 1 << 23


def awq_eights(groups: int, words: int, device) -> torch.Tensor:
    """AWQ ``qzeros`` ``[groups, words]`` whose every zero is 8: what an AWQ checkpoint with ``zero_point`` false
    (symmetric, its values signed and stored plus 8) means where it stores none."""
    return torch.full((groups, words), 0x88888888 - (1 << 32), dtype=torch.int32, device=device)


def _import_columns(parts: dict, g_idx, q: QuantConfig, a: int, b: int) -> Int4Weight:
    """The :class:`Int4Weight` of output columns ``a:b`` of a stored quantized Linear, through the importers;
    ``parts`` by role (qweight, qzeros, scales; qzeros None where the checkpoint stores none)."""
    cols = slice(a, b)
    packed = slice(a // 8, b // 8)  # columns packed eight to an int32
    if q.method == SAVED_METHOD:
        return _saved_weight(parts["qweight"][:, cols].contiguous(), parts["scales"][:, cols].contiguous(),
                             parts["qzeros"][:, cols].contiguous(), g_idx,
                             (b - a, parts["qweight"].shape[0] * 8), q.saved_sizes)
    if q.method == "compressed-tensors":  # [N, ...]: output rows first
        zp = parts.get("qzeros")
        if zp is not None:
            zp = zp[cols] if zp.shape[0] == parts["qweight"].shape[0] else zp[a // 8:-(-b // 8)]
            zp = zp.contiguous()
        return from_compressed_tensors(parts["qweight"][cols].contiguous(), parts["scales"][cols].contiguous(), zp,
                                       g_idx)
    scales = parts["scales"][:, cols].contiguous()
    if q.method == "awq":
        qzeros = parts["qzeros"]
        if qzeros is None:
            qzeros = awq_eights(scales.shape[0], parts["qweight"].shape[1], scales.device)
        return from_awq(parts["qweight"][:, packed].contiguous(), qzeros[:, packed].contiguous(), scales)
    w = from_gptq(parts["qweight"][:, cols].contiguous(), parts["qzeros"][:, packed].contiguous(), scales, g_idx)
    if q.checkpoint_format == "gptq_v2":
        # from_gptq reads v1 (stored zero - 1, so it adds 1); v2 stores the zero itself. Zeros are small integers
        # held as floats: subtracting 1 is exact.
        w = Int4Weight(w.qweight, w.scales, w.zeros - 1, w.group_size, w.shape, w.perm)
    return _symmetric_zeros(w, q)


class _LoadNotes(threading.local):
    said: set | None = None  # what a load has warned of (reset as each load opens its files), else None


_load_notes = _LoadNotes()


def _symmetric_zeros(w: Int4Weight, q: QuantConfig) -> Int4Weight:
    """A symmetric 4-bit GPTQ layer's zeros, which are all 8. Some quantizers store the zero itself (8) under
    ``checkpoint_format: "gptq"``, whose convention stores zero - 1 (7): GPTQModel from v5 (Qwen3.5-27B-GPTQ-Int4,
    as vLLM's loader found); read as labelled, every zero would be 9 and every weight one step off. Zeros all one
    step off 8 that way (9 read under "gptq", 7 under "gptq_v2") are read in the other convention, warned once a
    load; other zeros as stored."""
    z = w.zeros
    if not (q.sym and q.method == "gptq") or z.device.type == "meta" or not z.numel():
        return w
    off, stored = (1, 8) if q.checkpoint_format == "gptq" else (-1, 7)
    if not bool((z == 8 + off).all()):
        return w
    said = _load_notes.said
    if said is None or q.checkpoint_format not in said:
        warnings.warn(f"a symmetric GPTQ checkpoint labelled checkpoint_format {q.checkpoint_format!r} stores zeros "
                      f"of {stored}, the other format's convention for the symmetric zero 8: read as 8, which "
                      f"symmetric means (as labelled every weight would be one step off)", stacklevel=2)
        if said is not None:
            said.add(q.checkpoint_format)
    return Int4Weight(w.qweight, w.scales, z - off, w.group_size, w.shape, w.perm)


def _stored_parts(tensors: "_Tensors", prefix: str, q: QuantConfig, dtype,
                  K: int) -> tuple[dict, torch.Tensor | None]:
    """A stored quantized Linear's tensors by role (scales in ``dtype``; qzeros None where not stored), and its
    g_idx (None where not stored); a partial last group of its ``K`` inputs as whole groups (:func:`_whole_groups`)."""
    parts = {}
    for role in ("qweight", "qzeros", "scales"):
        key = f"{prefix}.{q.leaf(role)}"
        parts[role] = tensors.get(key) if key in tensors else None
    parts["scales"] = _scales_in(parts["scales"], dtype, prefix)
    g_key = f"{prefix}.{q.leaf('g_idx')}" if q.leaf("g_idx") else None
    g_idx = tensors.get(g_key) if g_key is not None and g_key in tensors else None
    if q.method != SAVED_METHOD and _regroups(q.group_size, K):
        return _whole_groups(parts, g_idx, q, K)
    return parts, g_idx


def _scales_in(scales: torch.Tensor, dtype, prefix: str) -> torch.Tensor:
    """A stored layer's scales in the model's ``dtype``, refused where a finite stored scale passes that dtype's
    range (bf16 scales above fp16's 65504 loaded with ``dtype=torch.float16``): the conversion, not the
    checkpoint, would make them inf."""
    out = scales.to(dtype)
    if out.dtype != scales.dtype and out.is_floating_point() and scales.is_floating_point() \
            and out.device.type != "meta" and bool((torch.isinf(out) & torch.isfinite(scales)).any()):
        raise ValueError(f"{prefix}: its {dtype_name(scales.dtype)} scales (up to "
                         f"{scales.float().abs().max().item():.4g}) pass {dtype_name(dtype)}'s range once converted "
                         f"to it; load the checkpoint with dtype=torch.bfloat16")
    return out


def _check_weight_range(w: Int4Weight, prefix: str) -> Int4Weight:
    """``w``, refused where its dequantized weights pass its scales' dtype's range (fp16 scales of a few thousand
    times a 4-bit step of 15): the kernels would compute with inf, as :meth:`Int4Weight.to` refuses such parts."""
    if w.scales.dtype == torch.float16 and w.device.type != "meta" \
            and dequantized_overflow(w.qweight, w.scales, w.zeros, torch.float16):
        raise ValueError(f"{prefix}: its weights dequantized in fp16 pass fp16's range (scales up to "
                         f"{w.scales.float().abs().max().item():.4g}); load the checkpoint with dtype=torch.bfloat16")
    return w


def _int4_weight(tensors: _Tensors, prefix: str, q: QuantConfig, N: int, K: int, dtype,
                 chunk_weights: int | None = None) -> Int4Weight:
    """The :class:`Int4Weight` of the quantized Linear ``prefix`` (out ``N``, in ``K``) with its fragment layout
    made, converted a slice of output columns at a time (:data:`CHUNK_WEIGHTS`)."""
    parts, g_idx = _stored_parts(tensors, prefix, q, dtype, K)
    step = max(256, (chunk_weights or CHUNK_WEIGHTS) // K // 256 * 256)
    pieces, frags = [], []
    for a in range(0, N, step):
        w = _check_weight_range(_import_columns(parts, g_idx, q, a, min(N, a + step)), prefix)
        frags.append(w.fragments() if w4a16_dispatch.keeps_fragments(w.group_k, w.device, K) else None)
        pieces.append(w)
    del parts
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    frag = None if frags[0] is None else (torch.cat([f[0] for f in frags], 0), torch.cat([f[1] for f in frags], 1))
    return Int4Weight(torch.cat([w.qweight for w in pieces], 1), torch.cat([w.scales for w in pieces], 1),
                      torch.cat([w.zeros for w in pieces], 1), first.group_size, (N, K), first.perm, frag)


# --- mixture-of-experts blocks stored one Linear per expert -------------------------------------------------

# A checkpoint stores expert e of a block as Linears "<block>.<e>.<gate>", "<up>", "<down>": Qwen-MoE / OLMoE /
# DeepSeek names, then Mixtral's (w1 = gate, w3 = up, w2 = down).
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# GPTQModel's gpt-oss experts: "<block>.gate_up.<e>" (the gate/up rows joined as the block holds them, with a bias)
# and "<block>.down.<e>", the expert's index after the projection's name.
_JOINED_EXPERT_NAMES = ("gate_up", "down")
# Module paths of checkpoints made before transformers v5 renamed them (Mixtral's block_sparse_moe is now mlp).
_RENAMED = ((".mlp.", ".block_sparse_moe."),)


def _aliases(name: str) -> list[str]:
    """``name`` and the names an older checkpoint may store it under."""
    return [name] + [name.replace(new, old) for new, old in _RENAMED if new in name]


@dataclasses.dataclass
class _StoredExperts:
    """A transformers experts block (3-D ``gate_up_proj``/``up_proj`` and ``down_proj``) whose checkpoint holds
    each expert's projections as quantized Linears ``{prefix}.{e}.{proj}`` (``dense``: as 16-bit Linears, a block
    the quantizer left unquantized; ``stacked``: as tilegemm's own stacked 4-bit buffers,
    ``{prefix}.tilegemm_<weight>_qweight`` ..., a model tilegemm saved)."""

    name: str
    module: nn.Module
    prefix: str
    num_experts: int
    joined: dict  # the block's weight name -> (the per-expert projections its rows join, (N of each, K))
    dense: bool = False
    stacked: bool = False
    index_last: bool = False  # "<prefix>.<proj>.<e>" (GPTQModel's gpt-oss) rather than "<prefix>.<e>.<proj>"

    def key(self, e: int, proj: str) -> str:
        """The stored name of expert ``e``'s Linear ``proj``."""
        return f"{self.prefix}.{proj}.{e}" if self.index_last else f"{self.prefix}.{e}.{proj}"

    def expert(self, e: int, projs) -> str:
        """Expert ``e``'s stored name for messages (its one Linear of ``projs`` where the index comes last)."""
        return self.key(e, projs[0]) if self.index_last else f"{self.prefix}.{e}"

    def keys(self):
        """(projection prefix, N, K) of every stored expert Linear."""
        for _, (projs, (N, K)) in self.joined.items():
            for e in range(self.num_experts):
                for p in projs:
                    yield self.key(e, p), N, K

    def per_expert_biases(self, tensors) -> list[str]:
        """The block's bias parameters the checkpoint stores an expert each (``<key>.bias``), not stacked under
        the block's name or an older one (``<block>.gate_up_proj_bias``, loaded as any plain tensor, by the same
        names: :func:`_aliases`)."""
        if self.stacked or not getattr(self.module, "has_bias", False):
            return []
        return [f"{w}_bias" for w in self.joined if not any(f"{a}_bias" in tensors for a in
                                                            _aliases(f"{self.name}.{w}"))]


def _int4_experts_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts blocks of ``model`` holding 4-bit experts already (``quantize_``, or a load before): their
    16-bit weights are gone, so :func:`_experts_modules` does not list them."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "tilegemm_group_size")
            and _int4(m, "down_proj") is not None and not isinstance(getattr(m, "down_proj", None), torch.Tensor)]


def _stored_experts(model: nn.Module, tensors: _Tensors, problems: list | None = None,
                    loaded: tuple[str, ...] = (), marker: str = "qweight") -> list[_StoredExperts]:
    """The experts blocks of ``model`` that the checkpoint stores per expert (quantized), with their names there.
    A block holding 4-bit experts already is rebuilt from a checkpoint storing its experts quantized; stored
    otherwise (16-bit) it is a problem (appended to ``problems``), as its 4-bit parts would be left as they were.
    ``marker``: the leaf a quantized Linear stores its packed weight under (``QuantConfig.leaf("qweight")``)."""
    found = []
    four_bit = [(n, m) for n, m in _int4_experts_blocks(model) if n not in loaded]  # (filled already: not checked)
    for name, module in [*_experts_modules(model), *four_bit]:
        has_gate = getattr(module, "has_gate", True)
        up_name = "gate_up_proj" if has_gate else "up_proj"
        if (name, module) in four_bit:  # the 4-bit weights' logical shapes, [E, out, in] whatever the layout
            (E, n_up, h), (h_out, i) = _int4(module, up_name).shape, _int4(module, "down_proj").shape[1:]
        else:
            up, down = getattr(module, up_name), module.down_proj
            E = down.shape[0]
            # [E, out, in], or [E, in, out] when the block stores its weights transposed
            (n_up, h), (h_out, i) = ((up.shape[2], up.shape[1]), (down.shape[2], down.shape[1])) if getattr(
                module, "is_transposed", False) else ((up.shape[1], up.shape[2]), (down.shape[1], down.shape[2]))
        if f"{name}.tilegemm_{up_name}_qweight" in tensors:  # a model tilegemm saved: its 4-bit experts as they were
            found.append(_StoredExperts(name, module, name, E, {up_name: ((), (n_up, h)),
                                                                "down_proj": ((), (h_out, i))}, stacked=True))
            continue
        if f"{name}.{up_name}" in tensors:  # stored stacked, as the block holds them: loaded as plain tensors
            if (name, module) in four_bit and problems is not None:
                problems.append(f"{name} holds 4-bit experts (the model was quantized already) but the checkpoint "
                                f"stores them 16-bit ({name}.{up_name}): load into a model that is not quantized")
            continue
        for prefix in _aliases(name):
            for leaf in (marker, "weight"):
                names = next((n for n in _EXPERT_NAMES if any(f"{prefix}.{e}.{p}.{leaf}" in tensors
                                                              for e in range(E) for p in n)), None)
                joined_names = names is None and has_gate and any(
                    f"{prefix}.{p}.{e}.{leaf}" in tensors for e in range(E) for p in _JOINED_EXPERT_NAMES)
                if names is not None or joined_names:
                    break
            if names is None and not joined_names:
                continue
            if joined_names:  # one Linear an expert holds the gate and up rows, as the block joins them
                gate_up, down_p = _JOINED_EXPERT_NAMES
                joined = {up_name: ((gate_up,), (n_up, h)), "down_proj": ((down_p,), (h_out, i))}
            else:
                gate, up_p, down_p = names
                joined = {up_name: ((gate, up_p), (n_up // 2, h)) if has_gate else ((up_p,), (n_up, h)),
                          "down_proj": ((down_p,), (h_out, i))}
            s = _StoredExperts(name, module, prefix, E, joined, dense=leaf == "weight", index_last=joined_names)
            if leaf == "weight" and (name, module) in four_bit and problems is not None:
                problems.append(f"{name} holds 4-bit experts (the model was quantized already) but the checkpoint "
                                f"stores them 16-bit ({s.key(0, down_p)}.weight ...): load into a model that is "
                                f"not quantized")
            found.append(s)
            break
    return found


def _check_experts(s: _StoredExperts, q: QuantConfig, tensors: _Tensors, problems: list, missing: list) -> set:
    """Check a per-expert block's stored tensors (appending to ``problems`` / ``missing``); the names used."""
    used = set()
    if s.stacked:  # tilegemm's buffers [E, K/8, N], [E, G, N] twice, [E, K] (act-order)
        E = s.num_experts
        for wname, (_, (N, K)) in s.joined.items():
            groups = [[E, G, N] for G in _group_counts(K)]
            expected = dict(qweight=([[E, K // 8, N]], True), scales=(groups, True), zeros=(groups, True),
                            perm=([[E, K]], False))
            used |= _check_stored(tensors, {f"{s.name}.tilegemm_{wname}_{p}": v for p, v in expected.items()},
                                  f"what experts block {s.name} holds", problems, missing)
        return used
    biased = s.per_expert_biases(tensors)
    for wname, (projs, (N, K)) in s.joined.items():  # biases stored an expert each: [N] a projection
        if f"{wname}_bias" not in biased:
            continue
        for e in range(s.num_experts):
            for p in projs:
                name = f"{s.key(e, p)}.bias"
                if name not in tensors:
                    missing.append(name)
                    continue
                used.add(name)
                if tensors.shape(name) != [N]:
                    problems.append(f"{name}: the checkpoint's shape {tensors.shape(name)} does not match [{N}], "
                                    f"what expert {s.name}'s {wname}_bias holds an expert")
    if s.dense:  # 16-bit experts: each expert's projection [N, K]
        for key, N, K in s.keys():
            name = f"{key}.weight"
            if name not in tensors:
                missing.append(name)
                continue
            used.add(name)
            if tensors.shape(name) != [N, K]:
                problems.append(f"{name}: the checkpoint's shape {tensors.shape(name)} does not match [{N}, {K}], "
                                f"what expert {s.name} stores")
        return used
    marker = q.leaf("qweight")
    conflicts: dict[str, list[str]] = {}  # why the config leaves them 16-bit -> experts it stores quantized
    stored_16_bit: list[str] = []  # experts the config quantizes that the checkpoint stores 16-bit
    total = 0
    for key, N, K in s.keys():
        total += 1
        # per-module rules name an expert as the checkpoint does (Mixtral's block_sparse_moe.experts.<e>.w1, where
        # the model has mlp.experts); modules_to_not_convert is taken under either name
        stored, as_model = tensors.stored_module(key, (marker, "weight")), s.name + key[len(s.prefix):]
        qk = q.for_module(stored, alias=as_model)
        if qk is None or _named_16_bit(q, stored, as_model):
            why = _left_16_bit_by(q, stored, as_model, qk)
            if f"{key}.{marker}" in tensors:
                conflicts.setdefault(why, []).append(stored)
                used |= {f"{key}.{leaf}" for leaf in (*q.leaves, "bias") if f"{key}.{leaf}" in tensors}  # no strays
            elif f"{key}.weight" in tensors:
                used.add(f"{key}.weight")
                problems.append(f"{stored}: stored 16-bit ({stored}.weight), {why}, but others of the block are "
                                f"stored quantized; a block's experts load when all are 4-bit or all are 16-bit")
            else:
                problems.append(f"{stored}: {why}, but the checkpoint stores neither {stored}.weight nor "
                                f"{stored}.{marker}")
            continue
        if qk.bits != 4:
            problems.append(f"{key}: stored with bits = {qk.bits!r} ({qk.rule or _settings_of(q)}); a block's "
                            f"experts load when all are 4-bit")
            continue
        packing = _packing_problem(qk, N, K)
        if packing is not None:
            problems.append(f"{key}: [out, in] = [{N}, {K}]: {packing}")
            continue
        if not _groups_fit(qk.group_size, K):
            problems.append(f"{key}: [out, in] = [{N}, {K}]: {_partial_group_problem(qk.group_size, K)}")
            continue
        if f"{key}.{marker}" not in tensors and f"{key}.weight" in tensors:
            used.add(f"{key}.weight")
            stored_16_bit.append(stored)
            continue
        used |= _check_quant_shapes(tensors, key, qk, N, K, f"expert {s.name}", problems, missing)
        if f"{key}.bias" in tensors and not biased:
            used.add(f"{key}.bias")
            if bool(tensors.get(f"{key}.bias").any()):  # dropped, as a dense layer's bias its module lacks
                warnings.warn(f"load_quantized_: the checkpoint stores a nonzero {key}.bias, which the experts of "
                              f"{s.name} do not have: ignored", stacklevel=3)
    if stored_16_bit:
        # (AutoAWQ left out every module whose name holds an entry of modules_to_not_convert: "gate" left the
        # experts' gate_proj 16-bit, where transformers' reading of the list names only the router)
        entries = [e for e in q.modules_to_not_convert if any(e in k for k in stored_16_bit)]
        listed = f" ({_at(q.key, 'modules_to_not_convert')} {entries} names modules by their names' parts, as " \
                 f"transformers reads it, not by substrings, as AutoAWQ did)" if entries else ""
        n = len(stored_16_bit)
        problems.append(f"{s.name}: {n} of its {total} expert Linears {'is' if n == 1 else 'are'} stored 16-bit "
                        f"({stored_16_bit[0]}.weight{' ...' if n > 1 else ''}) where the config quantizes "
                        f"{'it' if n == 1 else 'them'}{listed}: {', '.join(stored_16_bit[:4])}"
                        f"{' ...' if n > 4 else ''}; and others of the block are stored quantized; a block's experts "
                        f"load when all are 4-bit or all are 16-bit")
    # the config says 16-bit, the tensors say 4-bit: refused as a dense Linear is (whichever is wrong, the checkpoint
    # is inconsistent), one line a block and cause, as a block may hold hundreds of expert Linears
    for why, keys in conflicts.items():
        fix = "a config group targeting them" if why.startswith("targeted by no") else "that entry dropped from it"
        problems.append(f"{s.name}: {len(keys)} of its {total} expert Linears "
                        f"{'is' if len(keys) == 1 else 'are'} {why} but the checkpoint stores "
                        f"{'it' if len(keys) == 1 else 'them'} quantized ({keys[0]}.{marker}"
                        f"{' ...' if len(keys) > 1 else ''}): {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}; "
                        f"where the stored tensors are meant, the config needs {fix} (they then load 4-bit)")
    return used


def _left_16_bit_by(q: QuantConfig, stored: str, name: str, qm: QuantConfig | None,
                    classes: tuple[str, ...] = ("Linear",)) -> str:
    """What in the config leaves module ``stored`` (the checkpoint's name; ``name`` the model's; ``classes`` its
    classes' names, which compressed-tensors' entries may name) 16-bit, where its settings ``qm`` are None or
    ``modules_to_not_convert`` names it: the rule and the entry, for messages."""
    if qm is not None:
        entries = ", ".join(f"'{p}'" for p in q.modules_to_not_convert
                            if _not_converted(stored, (p,)) or _not_converted(name, (p,)))
        return f"in {_at(q.key, 'modules_to_not_convert')} ({entries})"
    if q.method == "compressed-tensors":
        entry = next((t for t in q.ignore if _ct_match(stored, classes, t)), None)
        return f"in {_at(q.key, 'ignore')} ('{entry}')" if entry is not None else \
            f"targeted by no config group of {q.key or 'its settings file'}"
    # the first match (of either name) decides: a skipping one here
    source = next(s for _, p, _, s in q.dynamic if p.match(stored) or p.match(name))
    return f"left 16-bit by {source}"


def _settings_of(q: QuantConfig) -> str:
    """Where a checkpoint's config gives one module settings of its own (for messages)."""
    return f"{q.key or 'its settings file'}: its ignore list, or no config group targets it" if \
        q.method == "compressed-tensors" else _at(q.key, "dynamic")


def _expert_weight(tensors: _Tensors, key: str, q: QuantConfig, N: int, K: int, dtype) -> Int4Weight:
    """One stored expert Linear as an :class:`Int4Weight` (no fragment layout: the grouped kernels read the
    stacked parts), with the checkpoint's group size (-1 stays -1 for every projection); act-order (a g_idx that
    reorders the inputs) keeps its input permutation, which the stacked experts carry an expert each."""
    parts, g_idx = _stored_parts(tensors, key, q, dtype, K)
    w = _check_weight_range(_import_columns(parts, g_idx, q, 0, N), key)
    if _one_group(q.group_size, K) and w.group_size != -1:  # one group: -1 for every expert and projection
        w = Int4Weight(w.qweight, w.scales, w.zeros, -1, w.shape, w.perm)
    return w


def _load_dense_experts(s: _StoredExperts, tensors: _Tensors, dtype) -> None:
    """Stack a block's per-expert 16-bit Linears into its 3-D weights (gate rows, then up rows; interleaved for a
    block whose ``is_concatenated`` is False; ``[E, in, out]`` for a block whose ``is_transposed`` is True)."""
    interleave = not getattr(s.module, "is_concatenated", True)
    for wname, (projs, (N, K)) in s.joined.items():
        experts = []
        for e in range(s.num_experts):
            ws = [tensors.get(f"{s.key(e, p)}.weight").to(dtype) for p in projs]
            experts.append(ws[0] if len(ws) == 1 else
                           torch.stack(ws, 1).reshape(len(ws) * N, K) if interleave else torch.cat(ws, 0))
            del ws
        t = torch.stack(experts)
        if getattr(s.module, "is_transposed", False):
            t = t.transpose(1, 2).contiguous()
        _set_tensor(s.module, wname, nn.Parameter(t, requires_grad=_wants_grad(s.module, wname)))
    _load_expert_biases(s, tensors, dtype)


def _wants_grad(module: nn.Module, name: str) -> bool:
    """Whether the 16-bit parameter ``name`` loaded into ``module`` requires grad: as the one it replaces did
    (transformers' load leaves them requiring grad), True where there was none."""
    old = module._parameters.get(name)
    return True if old is None else old.requires_grad


def _load_expert_biases(s: _StoredExperts, tensors: _Tensors, dtype, frozen: bool = False) -> None:
    """Stack the biases a checkpoint stores an expert each into the block's ``<weight>_bias`` ``[E, N]``, their
    gate and up parts joined as the weights' rows are (after each other, or in turn for a block whose
    ``is_concatenated`` is False). ``frozen``: the biases of 4-bit experts, which require no grad, as a 4-bit
    Linear's bias does not."""
    interleave = not getattr(s.module, "is_concatenated", True)
    biased = s.per_expert_biases(tensors)
    for wname, (projs, _) in s.joined.items():
        if f"{wname}_bias" not in biased:
            continue
        rows = []
        for e in range(s.num_experts):
            bs = [tensors.get(f"{s.key(e, p)}.bias").to(dtype) for p in projs]
            rows.append(bs[0] if len(bs) == 1 else torch.stack(bs, 1).reshape(-1) if interleave else torch.cat(bs))
        wants = not frozen and _wants_grad(s.module, f"{wname}_bias")
        _set_tensor(s.module, f"{wname}_bias", nn.Parameter(torch.stack(rows), requires_grad=wants))


def _load_experts(s: _StoredExperts, tensors: _Tensors, q: QuantConfig, dtype) -> None:
    """Stack a block's per-expert Linears into its 4-bit experts (gate rows, then up rows, as ``gate_up_proj``;
    interleaved for a block whose ``is_concatenated`` is False) and install them on the block."""
    interleave = not getattr(s.module, "is_concatenated", True)
    stacked = {}
    if s.stacked:
        for wname, (_, (N, K)) in s.joined.items():
            key = f"{s.name}.tilegemm_{wname}"
            perm = tensors.get(f"{key}_perm") if f"{key}_perm" in tensors else None
            scales = _scales_in(tensors.get(f"{key}_scales"), dtype, key)
            try:
                stacked[wname] = _saved_weight(tensors.get(f"{key}_qweight"), scales, tensors.get(f"{key}_zeros"),
                                               perm, (s.num_experts, N, K), q.saved_sizes)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{key}: {err}") from None
            _check_weight_range(stacked[wname], key)
        install_int4_experts_(s.module, stacked)
        return
    leaves = (q.leaf("qweight"), "weight")  # (rules match the names stored, as _check_experts matched them)
    for wname, (projs, (N, K)) in s.joined.items():
        per_expert = []
        for e in range(s.num_experts):
            try:
                per_expert.append([_expert_weight(tensors, k, q.for_module(tensors.stored_module(k, leaves),
                                                                           alias=s.name + k[len(s.prefix):]),
                                                  N, K, dtype) for k in (s.key(e, p) for p in projs)])
            except (TypeError, ValueError) as err:
                raise type(err)(f"{s.expert(e, projs)} ({q.describe()}, {' and '.join(projs)}): {err}") from None
        # one group size a stacked weight and one input order an expert: where per-module settings (GPTQModel's
        # dynamic, compressed-tensors' config groups) stored an expert's gate and up, or experts, in several group
        # sizes, the finest holds them all exactly, in the order of the expert's finest act-order projection
        sizes = {w.group_k for ws in per_expert for w in ws}
        finest = min(sizes)
        # (one group of all K is -1 where every part says so, else K: a group size of K and -1 alike join)
        label = -1 if all(w.group_size == -1 for ws in per_expert for w in ws) else finest
        experts = []
        for e, ws in enumerate(per_expert):
            try:
                order = next((w.perm for w in sorted(ws, key=lambda w: w.group_k) if w.perm is not None), None)
                ws = [regroup(w, label, order) for w in ws]  # (as they are where they agree)
                experts.append(ws[0] if len(ws) == 1 else concat_outputs(ws, interleave=interleave))
            except (TypeError, ValueError) as err:
                raise type(err)(f"{s.expert(e, projs)} ({q.describe()}, {' and '.join(projs)}): {err}") from None
        del per_expert
        stacked[wname] = stack_experts(experts)
    install_int4_experts_(s.module, stacked)
    _load_expert_biases(s, tensors, dtype, frozen=True)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(value, nn.Parameter):
        module._parameters[pname] = value
    else:
        module._buffers[pname] = value


def load_quantized_(model: nn.Module, path, dtype: torch.dtype | None = None, device=None, *,
                    loaded: tuple[str, ...] = ()) -> nn.Module:
    """Load the quantized checkpoint directory ``path`` into ``model`` (a ``transformers`` model of the same
    config, or any module whose names match the checkpoint's), in place; returns ``model``.

    Each ``nn.Linear`` the checkpoint stores quantized (``P.qweight``, ...) becomes a
    :class:`~tilegemm.nn.Int4Linear` built from the packed tensors; every other parameter and stored buffer takes
    the checkpoint's tensor (floats in ``dtype``). ``dtype`` defaults to the model's 16-bit dtype (fp16 if it has
    none; ``"auto"``: the checkpoint config's, as :func:`from_pretrained` reads it), ``device`` to where the model
    is (CUDA or the CPU if it is on the meta device). Tied weights are tied again afterwards
    (``model.tie_weights()``). Linears that ``modules_to_not_convert`` names are loaded as plain Linears. Errors
    as :func:`from_pretrained`'s, and ValueError when a parameter is still missing; a load
    that raises (whatever raised, and however far it got) leaves ``model`` exactly as it was given.
    ``loaded``: modules filled already (tensor-parallel shards), whose tensors are neither loaded nor strays.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_quantized_ takes a torch.nn.Module, got {type(model).__name__}")
    path = _check_dir(path)
    q = quant_config(read_config(path))
    # a joined product is no layer a checkpoint stores, and its parts would keep the joined copy's values
    joined = [(n.rpartition(".")[0] or "the model", m.names) for n, m in model.named_modules()
              if isinstance(m, FusedProjections)]
    if joined:
        where = "; ".join(f"{parent}: {', '.join(names)}" for parent, names in joined[:4])
        raise ValueError(f"the model's projections are joined ({where}{' ...' if len(joined) > 4 else ''}) by "
                         f"tilegemm.nn.fuse_projections_: load the checkpoint before joining them "
                         f"(tilegemm.models.from_pretrained(path, fuse_projections=True) loads, then joins)")
    dtype = _model_dtype(model) if dtype is None else resolve_dtype(dtype, path)
    _check_dtype(dtype)
    device = _default_device(device if device is not None else _model_device(model))
    tensors = _Tensors(path, device, model)
    # Every change below (converted blocks, computed buffers, replaced Linears, loaded tensors, the config) is
    # undone if the load raises at any point, from a check or from an importer half-way: the model is left as
    # it was given.
    with unchanged_on_error(model):
        return _load_into(model, path, q, tensors, dtype, device, loaded)


def _load_into(model: nn.Module, path: str, q: QuantConfig, tensors: _Tensors, dtype: torch.dtype,
               device: torch.device, loaded: tuple[str, ...]) -> nn.Module:
    """:func:`load_quantized_` once its arguments are checked: every stored tensor checked against the model,
    then the model changed (which :func:`unchanged_on_error` undoes if anything raises)."""
    _compute_meta_buffers_(model, tensors, device)
    _own_forward_blocks_(model, tensors, q.leaf("qweight"))
    _retie_(model, q.tied)

    # Which Linears are stored quantized (each with its own config where "dynamic" says so), and the shapes the
    # model asks of each stored tensor.
    linears = {name: m for name, m in model.named_modules() if _linear_shape(m) is not None and name not in loaded}
    quantized, problems, missing = [], [], []
    configs: dict[str, QuantConfig] = {}
    refused = set()  # stored quantized, refused above: their tensors are no strays
    rescaled = _rescaled_in_place(model)
    marker = q.leaf("qweight")  # the packed weight's leaf: a Linear storing it is stored quantized
    for name, m in linears.items():
        stored = f"{name}.{marker}" in tensors
        # per-module rules (dynamic, config groups, ignore) name modules as the quantizer's model did (the names the
        # checkpoint holds, where transformers renames them since); modules_to_not_convert is taken under either
        # name, as for the experts (_check_experts)
        as_stored, classes = tensors.stored_module(name, (marker, "weight")), \
            tuple(c.__name__ for c in type(m).__mro__) + ("Linear",)
        qm = q.for_module(as_stored, classes, alias=name)
        if stored:
            refused.add(name)
        if isinstance(m, Int4Linear) and not stored:
            # its 4-bit buffers would keep what they hold: a model quantized already takes a quantized layer only
            problems.append(f"{name} is an Int4Linear (the model was quantized already) but the checkpoint "
                            f"stores it 16-bit ({name}.weight): load into a model that is not quantized")
            continue
        if qm is None or _named_16_bit(q, as_stored, name):
            if stored:  # the rule and its entry named, as for experts
                seen = f" (stored as {as_stored})" if as_stored != name else ""
                problems.append(f"{name}{seen} is {_left_16_bit_by(q, as_stored, name, qm, classes)} but the "
                                f"checkpoint stores it quantized ({as_stored}.{marker})")
            continue
        if not stored:
            continue
        if not (isinstance(m, Int4Linear) or is_plain_linear(m) or is_conv1d(m)):
            # a router returning scores, a grouped product, a scaled head: an Int4Linear computes x @ W.T + b only
            problems.append(f"{name} is stored quantized ({name}.{marker}), but "
                            f"{subclass_reason(m, nn.Linear, 'load')}; an Int4Linear computes x @ W.T + b only, "
                            f"so {type(model).__name__} loads with this layer stored 16-bit")
            continue
        if name in rescaled:
            problems.append(f"{name} is stored quantized ({name}.{marker}), but {type(model).__name__} divides "
                            f"this layer's weight in place when it runs (RWKV's rescale_every = "
                            f"{rescaled[name]}), which a 4-bit weight cannot take: set rescale_every to 0 in "
                            f"config.json (the same model, without its fp16 overflow guard) or store the layer "
                            f"16-bit")
            continue
        if qm.bits != 4:
            problems.append(f"{name}: stored with bits = {qm.bits!r} ({qm.rule or _settings_of(q)}); tilegemm "
                            f"loads 4-bit layers only")
            continue
        N, K = _linear_shape(m)
        packing = _packing_problem(qm, N, K)
        if packing is not None:
            problems.append(f"{name}: [out, in] = [{N}, {K}]: {packing}")
            continue
        if qm.method != SAVED_METHOD and not _groups_fit(qm.group_size, K):  # (saved: its own, from its shapes)
            problems.append(f"{name}: {_partial_group_problem(qm.group_size, K)}")
            continue
        _check_quant_shapes(tensors, name, qm, N, K, f"{type(m).__name__}(in_features={K}, out_features={N})",
                            problems, missing)
        if m.bias is not None and f"{name}.bias" not in tensors:
            missing.append(f"{name}.bias")
        elif f"{name}.bias" in tensors and tensors.shape(f"{name}.bias") != [N]:  # (plain ones: checked below)
            problems.append(f"{name}.bias: the checkpoint's shape {tensors.shape(f'{name}.bias')} does not match "
                            f"[{N}], what {type(m).__name__}(out_features={N}) has")
        quantized.append(name)
        configs[name] = qm
    quantized_set = set(quantized)
    # MoE blocks whose experts the checkpoint stores one quantized Linear per expert: stacked when loading.
    experts = _stored_experts(model, tensors, problems, loaded, marker)
    expert_keys = {f"{key}.{p}" for s in experts if s.name in loaded for key, _, _ in s.keys()
                   for p in (*q.leaves, "bias", "weight")}  # filled already: not strays
    experts = [s for s in experts if s.name not in loaded]
    expert_params = {f"{s.name}.{w}" for s in experts for w in s.joined} | {
        f"{s.name}.{b}" for s in experts for b in s.per_expert_biases(tensors)}
    for s in experts:
        expert_keys |= _check_experts(s, q, tensors, problems, missing)

    # Every other parameter (and stored buffer) by name; a tied parameter is loaded under any of its names.
    plain: dict[str, list[str]] = {}  # the first name of each parameter -> all its names
    by_id: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owner = pname.rpartition(".")[0]
        if owner in quantized_set or owner in loaded or pname in expert_params:
            continue
        first = by_id.setdefault(id(p), pname)
        plain.setdefault(first, []).append(pname)
    # (a block's stacked 4-bit buffers are the experts load's, in the checkpoint's group size, not plain tensors)
    stacked_blocks = {s.name for s in experts if s.stacked}
    persistent = [n for n, _ in model.named_buffers() if n.rpartition(".")[0] not in quantized_set and n in
                  model.state_dict(keep_vars=True) and n.rpartition(".")[0] not in loaded
                  and not (n.rpartition(".")[0] in stacked_blocks and n.rpartition(".")[2].startswith("tilegemm_"))]
    wants_grad = {first: model.get_parameter(first).requires_grad for first in plain}
    tied = _tied_names(model)
    sources: dict[str, str] = {}
    for first, names in plain.items():
        found = next((k for n in names for k in _aliases(n) if k in tensors), None)
        if found is not None:
            sources[first] = found
        elif not all(n in tied for n in names):  # tie_weights fills a tied output layer (its own Parameter)
            missing.append(names[0])
    for b in persistent:
        if b in tensors:
            sources[b] = b
    expected_plain = {}
    for first, key in sources.items():
        want = list((model.get_parameter(first) if first in plain else model.get_buffer(first)).shape)
        if tensors.shape(key) != want:
            problems.append(f"{key}: the checkpoint's shape {tensors.shape(key)} does not match the model's {want}")
        expected_plain[key] = first
    used = set(sources.values()) | {f"{n}.{p}" for n in quantized for p in (*q.leaves, "bias")} | expert_keys
    # a tied output layer's stored copy (AutoGPTQ saves every state_dict key): tie_weights fills that layer
    used |= {k for n in tied for k in _aliases(n) if k in tensors}
    strays = [k for k in tensors.files if k not in used and not k.endswith(_IGNORED_SUFFIXES)
              and k.rpartition(".")[0] not in loaded]
    stray_quant = [k for k in strays if k.endswith(f".{marker}") and k.rpartition(".")[0] not in refused]
    if stray_quant:
        problems.append(f"quantized tensor(s) for modules the model has no Linear of: {', '.join(stray_quant[:8])}"
                        + (" ..." if len(stray_quant) > 8 else ""))
    if problems:
        raise ValueError(f"the checkpoint at {path!r} does not fit the model{_architecture_hint(model)}:\n  "
                         + "\n  ".join(problems))
    if missing:
        # a Linear's weight missing in both forms (an index that leaves out the shard of its quantized tensors):
        # say so, not only the 16-bit name
        modules = dict(model.named_modules())
        missing = [f"{n} (nor {n.rpartition('.')[0]}.{marker})" if n.endswith(".weight")
                   and isinstance(modules.get(n.rpartition(".")[0]), nn.Linear) else n for n in missing]
        raise ValueError(f"the checkpoint at {path!r} lacks tensor(s) the model needs{_architecture_hint(model)}: "
                         f"{', '.join(missing)}")
    if not quantized and all(s.dense for s in experts) and not loaded:
        # a dense model under a quantization_config would load 16-bit, keep claiming the method, and be saved so
        raise ValueError(f"the checkpoint at {path!r} says it is quantized ({q.describe()}) but stores no layer of "
                         f"the model quantized (no {marker!r} tensor of any Linear or experts block): a 16-bit "
                         f"checkpoint loads with transformers' own from_pretrained")
    if strays:
        warnings.warn(f"load_quantized_: {len(strays)} tensor(s) of the checkpoint match nothing in the model and "
                      f"were skipped: {', '.join(strays[:8])}{' ...' if len(strays) > 8 else ''}", stacklevel=3)

    # Load: one quantized Linear, or one plain tensor, at a time.
    plain_dtype = _plain_dtypes(model, dtype)
    with torch.no_grad():
        for name in quantized:
            N, K = _linear_shape(linears[name])
            try:
                w = _int4_weight(tensors, name, configs[name], N, K, dtype)
            except (TypeError, ValueError) as err:  # the importers' checks, named by the layer
                raise type(err)(f"{name} ({configs[name].describe()}): {err}") from None
            bias = tensors.get(f"{name}.bias") if f"{name}.bias" in tensors else None
            if bias is not None and linears[name].bias is None:  # the model's layer has none: dropped, as
                if bool(bias.any()):                             # transformers drops an unexpected tensor
                    warnings.warn(f"load_quantized_: the checkpoint stores a nonzero {name}.bias, which the model's "
                                  f"layer does not have: ignored", stacklevel=3)
                bias = None
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            # the replaced layer's hooks and training flag carried over, as quantize_ carries them
            setattr(parent, child, carry_over(linears[name], Int4Linear.from_weight(w, None if bias is None else
                                                                                  bias.to(dtype))))
            del w, bias
        for s in experts:
            if s.dense:
                _load_dense_experts(s, tensors, dtype)
            else:
                _load_experts(s, tensors, q, dtype)
        overflowed = []  # plain tensors a conversion to fp16 made inf where they were finite
        for key, first in expected_plain.items():
            stored = tensors.get(key)
            t = stored.to(plain_dtype(first)) if stored.is_floating_point() else stored
            if t.dtype == torch.float16 != stored.dtype and t.device.type != "meta" \
                    and bool((torch.isinf(t) & torch.isfinite(stored)).any()):
                overflowed.append(key)
            del stored
            if first in plain:  # one Parameter under each of its names (tied ones), requiring grad as it did
                t = nn.Parameter(t, requires_grad=wants_grad[first] and (t.is_floating_point() or t.is_complex()))
            for n in plain.get(first, [first]):
                _set_tensor(model, n, t)
            del t
        if overflowed:  # (transformers' own load converts them as silently; the 4-bit layers' scales are refused)
            warnings.warn(f"load_quantized_: {len(overflowed)} tensor(s) of the checkpoint hold values past fp16's "
                          f"range, now inf: {', '.join(overflowed[:8])}{' ...' if len(overflowed) > 8 else ''}; load "
                          f"with dtype=torch.bfloat16", stacklevel=3)
    # What the checkpoint does not hold: buffers the model computed itself (rotary tables), moved to the device.
    for module in model.modules():
        for bname, b in module._buffers.items():
            if b is not None and b.device != device and b.device.type != "meta":
                module._buffers[bname] = b.to(device)
    if any(not s.dense for s in experts):
        use_int4_experts_(model)  # the "tilegemm" experts implementation runs blocks holding 4-bit experts
    elif not register_experts():
        # transformers 4.x (no experts interface): MoE blocks loop over experts held as Linears, here loaded as
        # Int4Linears; stacked into tilegemm's blocks, whose experts run as two grouped products (blocks it cannot
        # take stay as they are)
        convert_moe_blocks_(model)
    _tie(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"the checkpoint at {path!r} left parameter(s) of the model unloaded: {', '.join(left[:8])}")
    note = experts_off_interface_note(model)  # blocks that transformers runs on their own code, asked "tilegemm"
    if note is not None:
        warnings.warn(f"load_quantized_: {note}", stacklevel=3)
    guard_quantized_output_resize_(model)  # a 4-bit lm_head: resize_token_embeddings refused before any change
    # its tensors are tilegemm's now: a save must not claim to be GPTQ/AWQ (a saved model keeps what it says)
    mark_saved_format_(model, None if q.method == SAVED_METHOD else q.method)
    return model


def _rescaled_in_place(model: nn.Module) -> dict[str, int]:
    """RWKV's output layers (``blocks.<i>.attention.output``, ``blocks.<i>.feed_forward.value``), whose weights its
    model divides in place at inference (``_rescale_layers``, by 2 every ``rescale_every`` blocks): name ->
    ``rescale_every``, where it is on."""
    found = {}
    for name, m in model.named_modules():
        every = getattr(getattr(m, "config", None), "rescale_every", 0)
        if callable(getattr(m, "_rescale_layers", None)) and isinstance(every, int) and every > 0 \
                and isinstance(getattr(m, "blocks", None), nn.ModuleList):
            prefix = f"{name}." if name else ""
            for i in range(len(m.blocks)):
                for leaf in ("attention.output", "feed_forward.value"):
                    found[f"{prefix}blocks.{i}.{leaf}"] = every
    return found


def _architecture_hint(model: nn.Module) -> str:
    """Where the model's config names another architecture than the model's class (a classifier's checkpoint built
    as a causal LM): which ``model_class`` builds that one."""
    names = getattr(getattr(model, "config", None), "architectures", None) or []
    if names and type(model).__name__ not in names:
        import transformers

        where = f"transformers.{names[0]}" if hasattr(transformers, names[0]) else f"the class {names[0]}"
        return f" (a {type(model).__name__}; the checkpoint's config names {names[0]}: model_class={where})"
    return ""


def _own_forward_blocks_(model: nn.Module, tensors: _Tensors, marker: str) -> None:
    """Llama-4's, DBRX's and JetMoE's MoE blocks run their experts in their own forward; quantizers store Llama-4's
    experts one Linear an expert (``<block>.experts.<e>.gate_proj`` ...), and a model tilegemm saved stores such a
    block's stacked 4-bit buffers (``<block>.experts.tilegemm_gate_up_proj_qweight`` ...). Such a block becomes
    tilegemm's block for it (its experts a ``StackedExperts`` under the same names), which the experts loader fills
    (tilegemm's block wraps its modules and parameters, changing none: a refused load puts the block back)."""
    # (DBRX's and JetMoE's blocks, which tilegemm's convert_ makes its own too, come back from a model it saved)
    saved = {k.rpartition(".")[0] for k in tensors.files if k.rpartition(".")[2].startswith("tilegemm_")}
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind not in OWN_FORWARD_BLOCKS:
            continue
        per_expert = kind == "Llama4TextMoe" and any(f"{name}.experts.0.{p}.{leaf}" in tensors
                                                     for p in _EXPERT_NAMES[0] for leaf in (marker, "weight"))
        if per_expert or any(s == name or s.startswith(f"{name}.") for s in saved):
            convert_moe_blocks_(model, filter=lambda n, m, name=name: n == name)


def _compute_meta_buffers_(model: nn.Module, tensors: _Tensors, device: torch.device) -> None:
    """Buffers on the meta device that the checkpoint does not hold (a model built under ``torch.device("meta")``:
    its rotary tables, which models compute in ``__init__``): made on ``device`` and computed by transformers'
    own initialisation of their module (``PreTrainedModel._init_weights``), for modules with no parameters of
    their own; any left unset is a ValueError (and the meta buffers are put back, as any change of a refused
    load: :func:`unchanged_on_error`)."""
    names = {id(b): n for n, b in model.named_buffers()}
    wanted = [(n, m) for n, m in model.named_modules()
              if any(b is not None and b.is_meta and names.get(id(b)) not in tensors for b in m._buffers.values())]
    if not wanted:
        return
    owners = [(n, m) for n, m in model.named_modules() if hasattr(m, "_init_weights") and hasattr(m, "config")]
    left = []
    for name, module in wanted:
        owner = max((o for o in owners if name == o[0] or name.startswith(o[0] + ".") or not o[0]),
                    key=lambda o: len(o[0]), default=None)
        metas = {k: b for k, b in module._buffers.items() if b is not None and b.is_meta}
        if owner is None or any(True for _ in module.parameters(recurse=False)):
            left += [f"{name}.{k}" for k in metas]
            continue
        for k, b in module._buffers.items():  # (the initialisation writes the others in place: a refused load
            if b is not None and not b.is_meta:  # puts back the tensors as given, so it writes into copies)
                module._buffers[k] = b.clone()
        for k, b in metas.items():  # NaN first: what the initialisation leaves unset shows
            module._buffers[k] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=device) \
                if b.is_floating_point() else torch.zeros(b.shape, dtype=b.dtype, device=device)
        try:
            with torch.no_grad():
                owner[1]._init_weights(module)
        except Exception:  # noqa: BLE001 (named below with the rest)
            pass
        left += [f"{name}.{k}" for k in metas if module._buffers[k].is_floating_point()
                 and bool(module._buffers[k].isnan().any())]
    if left:
        raise ValueError(f"buffer(s) of the model are on the meta device and the checkpoint does not hold them: "
                         f"{', '.join(left[:8])}; build the model with only its parameters on the meta device "
                         f"(tilegemm.models.pretrained.empty_model(path), or accelerate's init_empty_weights())")


def _retie_(model: nn.Module, groups) -> None:
    """Hold each group of names the saved model tied (``tied_parameters`` of tilegemm's saved config) as one
    parameter again, the first name's, where the model has them all as parameters of one shape: the checkpoint
    stores one name of each, and a model built from a config whose ties were turned off (``tie_word_embeddings``
    False, set when a 4-bit output layer was untied) would miss the others (BART's encoder and decoder embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in groups:
        if len(names) < 2 or not all(n in params for n in names) \
                or len({tuple(params[n].shape) for n in names}) != 1:
            continue
        keep = params[names[0]]
        for n in names[1:]:
            owner, _, leaf = n.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._parameters[leaf] = keep  # (recorded by the load's transaction: put back on an error)


def _tied_names(model: nn.Module) -> set[str]:
    """Names of parameters that ``model.tie_weights()`` fills from another (a transformers model's output
    embedding when ``tie_word_embeddings``)."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if get_out is not None else None
    if out is None:
        return set()
    for name, m in model.named_modules():
        if m is out:
            return {f"{name}.weight"}
    return set()


def _tie(model: nn.Module) -> None:
    """Tie the output embedding to the input one again (loading replaced the parameters), as transformers
    does; not when the output layer was stored quantized: the config then says it is untied
    (``tie_word_embeddings`` False), so that ``tie_weights()`` and ``save_pretrained`` leave it as it is."""
    if not _tied_names(model):
        return
    if isinstance(model.get_output_embeddings(), Int4Linear):
        untie_quantized_outputs_(model)
        return
    model.tie_weights()


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The same ``transformers`` model with each :class:`~tilegemm.nn.Int4Linear` an ``nn.Linear`` holding its
    dequantized weight (in the model's dtype), every other parameter shared with ``model`` (no copy): the dense
    model that computes what the 4-bit one should, as the bench's baseline and reference. 4-bit stacked experts
    become the block's 16-bit 3-D weights (dequantized). The copy is of the model's own class (a ``BertModel``,
    ``T5ForConditionalGeneration`` or ``LlamaForSequenceClassification`` as well as a causal LM), its dtype is
    that of the model's parameters (an fp32 model gives an fp32 copy) and it has a config of its own."""
    # a config of its own: from_config keeps the object it is given, and a setting changed on the copy
    # (set_experts_implementation, attention) must not change the 4-bit model
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the copy holds no 4-bit layer
        del config.quantization_config
    dtype = _float_dtype(model)
    dense = _meta_model(type(model), config, dtype)  # the model's own class: not every model is a causal LM
    for m in dense.modules():  # nor is it quantized: its Linears' weights are tensors again (mark_saved_format_)
        c = getattr(m, "config", None)
        if c is not None and "_is_quantized" in vars(c):
            del c._is_quantized
    int4 = {name: m for name, m in model.named_modules() if isinstance(m, (Int4Linear, ProjectionPart))}
    experts = {name: m for name, m in model.named_modules() if hasattr(m, "tilegemm_group_size")}
    source = dict(model.named_parameters(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}  # one shared Parameter per source tensor (tied names stay tied)
    with torch.no_grad():
        for name, p in list(dense.named_parameters(remove_duplicate=False)):
            module_name, _, leaf = name.rpartition(".")
            if module_name in int4 and leaf == "weight":
                w = int4[module_name].dequantize().to(dtype)
                if isinstance(dense.get_submodule(module_name), nn.Linear):
                    value = nn.Parameter(w, requires_grad=False)
                else:  # a Conv1D (GPT-2) holds [in, out]
                    value = nn.Parameter(w.T.contiguous(), requires_grad=False)
            elif module_name in int4 and leaf == "bias" and isinstance(int4[module_name], ProjectionPart):
                value = nn.Parameter(int4[module_name].bias.detach().clone(), requires_grad=False)  # (no Parameter)
            elif name not in source and module_name in experts:  # 4-bit stacked experts: [E, out, in]
                w = dequantize(_int4(experts[module_name], leaf)).to(dtype)
                w = w.transpose(1, 2).contiguous() if getattr(experts[module_name], "is_transposed", False) else w
                value = nn.Parameter(w, requires_grad=False)
            else:
                src = source[name]
                value = made.setdefault(id(src), src if isinstance(src, nn.Parameter) else nn.Parameter(src))
            _set_tensor(dense, name, value)
    device = _model_device(model) or torch.device("cpu")
    for module in dense.modules():
        for bname, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[bname] = b.to(device)
    return dense.eval()
