"""The tests' own writer of 4-bit GPTQ / AWQ / compressed-tensors checkpoint directories, written from the formats'
notes (/work/shared's for GPTQ and AWQ, compressed-tensors' description of ``pack-quantized``; docs/w4a16.md
"Loading checkpoints" restates them) and independent of tilegemm's packers: plain torch quantizes,
packs nibbles and computes the dequantized weights that a checkpoint means.

- :func:`quantize_linear`: a float weight ``[N, K]`` -> the stored tensors of one quantized Linear and the weight
  they stand for (dequantized from the stored tensors by the format's own formula).
- :func:`random_linear`: stored tensors of random 4-bit values, scales and zeros (no float weight: fast at
  Llama-3-8B's shapes).
- :class:`Writer`: tensors streamed into ``model.safetensors``, or into shards plus ``model.safetensors.index.json``
  once they pass ``shard_bytes``; ``config.json`` with the ``quantization_config``.
- :func:`write_model`: a transformers model's weights (random init from a config) as a checkpoint, returning the
  reference weights (every quantized Linear's dequantized weight, the rest as stored). A MoE block's 3-D experts
  (transformers v5: ``gate_up_proj [E, 2I, H]``, gate rows then up rows (one of each in turn where the block's
  ``is_concatenated`` is False), or ``up_proj [E, I, H]`` for experts without a gate, and ``down_proj [E, H, I]``;
  ``[E, in, out]`` where ``is_transposed``) are written as quantizers store them, one Linear per expert:
  ``<block>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, or
  with ``mixtral_names`` Mixtral's ``block_sparse_moe.experts.<e>.w1`` (gate) / ``w3`` (up) / ``w2`` (down)
  (and the router under ``block_sparse_moe.gate``).

Packing (``W.T[k, n]`` is ``q[k, n]``; nibble ``i`` of an int32 is bits ``4i .. 4i+3``):
GPTQ ``qweight [K/8, N]``: nibble i of row r is ``q[8r + i]``; ``qzeros [G, N/8]``: nibble i of word c is the zero of
column ``8c + i``, v1 storing ``zero - 1`` (4 bits, wrapping), v2 the zero; ``g_idx [K]`` the group of each input.
AWQ ``qweight [K, N/8]`` and ``qzeros [G, N/8]``: nibble i of word c is column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``.
compressed-tensors (``pack-quantized``): signed values -8..7 stored plus 8; ``weight_packed [N, K/8]``: nibble i of
word j of row n is ``q[n, 8j + i] + 8``; ``weight_scale [N, G]``; asymmetric ``weight_zero_point [ceil(N/8), G]``:
nibble i of row r is the zero of output ``8r + i`` plus 8, the nibbles past N of the last row 0 (compressed-tensors
pads N up to whole words and cuts the padding on reading, so any N is stored; or, as older releases stored it, the
signed zeros ``[N, G]``); ``weight_g_idx [K]`` with act-order; ``weight_shape`` ``[N, K]``.
``W[n, k] = scale[n, g] * (q[n, k] - zero[n, g])``.

Output widths N that are not a multiple of 8: compressed-tensors stores them as above. GPTQ's ``qzeros`` and AWQ's
``qweight`` / ``qzeros`` have no such padding in their formats; the writer pads them to ``ceil(N/8)`` words the same
way only so that tests can show such a checkpoint refused (no quantizer writes one).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re

import torch

AWQ_NIBBLE_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column 8c + this
SMALL = 2**24  # elements up to which a CPU writes on one thread


@contextlib.contextmanager
def _one_thread(numel: int):
    """Torch on one CPU thread while writing up to :data:`SMALL` elements: on the tests' tiny tensors the thread
    pool's hand-offs cost more than they give (a tiny model's checkpoint written 20x slower on two busy cores)."""
    threads = torch.get_num_threads()
    if numel > SMALL or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --- nibbles ---------------------------------------------------------------------------------------------------


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values 0 .. 2^32-1 -> int32 with the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_k(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[K, N]`` (0..15) -> int32 ``[ceil(K/8), N]``, nibble i of row r = ``q[8r + i]``; the nibbles past
    the last row of ``q`` are 0 (compressed-tensors' zero points: N outputs padded to whole words)."""
    words = torch.zeros(-(-q.shape[0] // 8), q.shape[1], dtype=torch.int64, device=q.device)
    for i in range(8):
        part = q[i::8].to(torch.int64) & 15
        words[:part.shape[0]] |= part << (4 * i)
    return _as_int32(words)


def pack_along_n(v: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """``v`` ``[R, N]`` (0..15) -> int32 ``[R, ceil(N/8)]``: nibble i of word c = ``v[:, 8c + i]`` (GPTQ) or
    ``v[:, 8c + AWQ_NIBBLE_COLUMN[i]]`` (AWQ); nibbles past column N are 0 (no real GPTQ/AWQ checkpoint has them:
    a refused layer's tensors)."""
    words = torch.zeros(v.shape[0], -(-v.shape[1] // 8), dtype=torch.int64, device=v.device)
    for i in range(8):
        col = AWQ_NIBBLE_COLUMN[i] if awq else i
        part = v[:, col::8].to(torch.int64) & 15
        words[:, :part.shape[1]] |= part << (4 * i)
    return _as_int32(words)


def nibble(words: torch.Tensor, i: int) -> torch.Tensor:
    return (words.to(torch.int64) >> (4 * i)) & 15


def unpack_along_k(qweight: torch.Tensor) -> torch.Tensor:
    R, N = qweight.shape
    q = torch.empty(8 * R, N, dtype=torch.int64)
    for i in range(8):
        q[i::8] = nibble(qweight, i)
    return q


def unpack_along_n(words: torch.Tensor, awq: bool = False) -> torch.Tensor:
    R, C = words.shape
    v = torch.empty(R, 8 * C, dtype=torch.int64)
    for i in range(8):
        v[:, (AWQ_NIBBLE_COLUMN[i] if awq else i)::8] = nibble(words, i)
    return v


# --- one Linear ------------------------------------------------------------------------------------------------


def dequantize_stored(t: dict, method: str, group_size: int, v2: bool = False) -> torch.Tensor:
    """The weight ``[N, K]`` (fp16) a Linear's stored tensors stand for, by the format's formula."""
    with _one_thread(8 * (t["weight_packed"] if method == "compressed-tensors" else t["qweight"]).numel()):
        return _dequantize_stored(t, method, group_size, v2)


def _dequantize_stored(t: dict, method: str, group_size: int, v2: bool) -> torch.Tensor:
    if method == "compressed-tensors":
        q = unpack_along_k(t["weight_packed"].T.contiguous()) - 8  # [K, N], signed
        if "weight_shape" in t:  # K padded to whole words too (compressed-tensors cuts it on reading)
            q = q[:int(t["weight_shape"][1])]
        K, N = q.shape
        scales = t["weight_scale"].float().T  # [G, N]
        zp = t.get("weight_zero_point")
        if zp is None:
            zeros = torch.zeros_like(scales)
        elif zp.dtype != torch.int32:  # unpacked, signed int8 (by dtype: for N = 1 the two forms' shapes agree)
            zeros = zp.T.float()
        else:
            zeros = (unpack_along_k(zp)[:N] - 8).T.float()
        step = group_size if 0 < group_size < K else K // scales.shape[0]
        g = t["weight_g_idx"].to(torch.int64) if "weight_g_idx" in t else torch.arange(K) // step
        wt = (q.float() - zeros[g]) * scales[g]
        return wt.T.contiguous().to(torch.float16)
    scales = t["scales"].float()
    N = scales.shape[1]  # (words packed along N: padded past it)
    if method == "gptq":
        q = unpack_along_k(t["qweight"])  # [K, N]
        K = q.shape[0]
        zeros = unpack_along_n(t["qzeros"])[:, :N] + (0 if v2 else 1)  # v1 stored zero - 1
        g = t["g_idx"].to(torch.int64) if "g_idx" in t else torch.arange(K) // (K if group_size == -1 else group_size)
    else:
        q = unpack_along_n(t["qweight"], awq=True)[:, :N]  # [K, N]
        K = q.shape[0]
        zeros = unpack_along_n(t["qzeros"], awq=True)[:, :N]
        g = torch.arange(K) // (K if group_size == -1 else group_size)
    wt = (q.float() - zeros.float()[g]) * scales[g]
    return wt.T.contiguous().to(torch.float16)


def quantize_linear(w: torch.Tensor, method: str = "gptq", group_size: int = 128, sym: bool = False,
                    act_order: bool = False, v2: bool = False, generator: torch.Generator | None = None,
                    order: torch.Tensor | None = None, unpacked_zero: bool = False,
                    scale_dtype: torch.dtype = torch.float16):
    """Round-to-nearest 4-bit quantization of ``w`` ``[N, K]`` as a checkpoint stores it: (stored tensors, the
    fp16 weight they stand for). GPTQ asymmetric: the group's range widened to hold 0, ``scale = range / 15``,
    ``zero = round(-min / scale)``; symmetric: ``scale = 2 max|w| / 15``, zero 8. AWQ: the group's own min and
    max, ``zero = round(-min / scale)`` clamped to 0..15; symmetric (GPTQModel's AWQ, ``zero_point`` false) as
    GPTQ's, its zeros of 8 stored. ``act_order``: groups are a random permutation of the
    inputs (``g_idx``), as GPTQ's ``desc_act`` makes them; ``order`` gives that permutation (else drawn). A layer
    whose K is below the group size is one group over all of K (``ceil(K / group_size)`` groups, as GPTQ stores).
    compressed-tensors: signed values; symmetric ``scale = max|w| / 7.5``, zero 0; asymmetric ``scale = range /
    15`` (the range widened to hold 0), ``zero = clamp(-8 - round(min / scale), -8, 7)``; scales in
    ``scale_dtype``, zeros packed unless ``unpacked_zero``."""
    with _one_thread(w.numel()):
        return _quantize_linear(w, method, group_size, sym, act_order, v2, generator, order, unpacked_zero,
                                scale_dtype)


def _quantize_linear(w, method, group_size, sym, act_order, v2, generator, order, unpacked_zero, scale_dtype):
    N, K = w.shape
    gs = K if group_size == -1 or K < group_size else group_size
    G = -(-K // gs)  # a K the group size does not divide: a partial last group, as GPTQ stores it
    wt = w.detach().float().T.contiguous()  # [K, N]
    if act_order:
        if order is None:
            order = torch.randperm(K, generator=generator)  # inputs of group g: order[g*gs : (g+1)*gs]
    else:
        order = torch.arange(K)
    # the partial last group padded with copies of its last row (so its min and max are its own inputs', as the
    # quantizers take them) and cut again
    pad = G * gs - K
    grouped = torch.cat([wt[order], wt[order[-1:]].expand(pad, N)]).reshape(G, gs, N)
    lo, hi = grouped.amin(1), grouped.amax(1)  # [G, N]
    if method == "compressed-tensors":
        return _quantize_ct(grouped, order, lo, hi, gs, sym, act_order, unpacked_zero, scale_dtype)
    if method in ("gptq", "awq") and sym:
        scale = 2 * torch.maximum(lo.abs(), hi.abs()) / 15
    elif method == "gptq":
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = (hi - lo) / 15
    else:
        scale = (hi - lo).clamp(min=1e-5) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half()
    s = scale.float()
    zero = torch.full_like(s, 8.0) if (method in ("gptq", "awq") and sym) else torch.round(-lo / s).clamp(0, 15)
    q_grouped = torch.clamp(torch.round(grouped / s[:, None]) + zero[:, None], 0, 15)
    q = torch.empty(K, N)
    q[order] = q_grouped.reshape(G * gs, N)[:K]
    zero = zero.to(torch.int64)
    if method == "gptq":
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // gs).to(torch.int32)
        stored_zero = zero if v2 else (zero - 1) & 15
        t = dict(qweight=pack_along_k(q), qzeros=pack_along_n(stored_zero), scales=scale, g_idx=g_idx)
    else:
        t = dict(qweight=pack_along_n(q, awq=True), qzeros=pack_along_n(zero, awq=True), scales=scale)
    return t, dequantize_stored(t, method, group_size, v2)


def _quantize_ct(grouped, order, lo, hi, gs: int, sym: bool, act_order: bool, unpacked_zero: bool, scale_dtype):
    G, _, N = grouped.shape
    K = order.numel()
    if sym:
        scale = torch.maximum(lo.abs(), hi.abs()) / 7.5
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    s = scale.float()
    zero = torch.zeros_like(s) if sym else torch.clamp(-8 - torch.round(lo / s), -8, 7)
    q_grouped = torch.clamp(torch.round(grouped / s[:, None]) + zero[:, None], -8, 7)
    q = torch.empty(K, N)
    q[order] = q_grouped.reshape(G * gs, N)[:K]
    t = dict(weight_packed=pack_along_k(q.to(torch.int64) + 8).T.contiguous(), weight_scale=scale.T.contiguous(),
             weight_shape=torch.tensor([N, K]))
    if not sym:
        zero_nk = zero.T.to(torch.int64)  # [N, G] signed
        t["weight_zero_point"] = zero_nk.to(torch.int8) if unpacked_zero else pack_along_k(zero_nk + 8)
    if act_order:
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // gs).to(torch.int32)
        t["weight_g_idx"] = g_idx
    return t, dequantize_stored(t, "compressed-tensors", gs)


def random_linear(N: int, K: int, method: str = "gptq", group_size: int = 128, sym: bool = True,
                  act_order: bool = False, v2: bool = False, generator: torch.Generator | None = None,
                  std: float = 0.02, order: torch.Tensor | None = None) -> dict:
    """Stored tensors of a Linear with random 4-bit values (no float weight made): zeros 8 (``sym``) or random in
    5..10, each value its group's zero plus an offset drawn evenly from -7..7 (``sym``) or -5..5, so the weight
    has mean zero (values drawn from all of 0..15 about a zero of 8 have mean -0.5 steps: 32 Llama-3-8B layers of
    such weights overflowed fp16), and scales so its spread is about ``std``. ``act_order``: the inputs of group g
    are ``order[g*gs : (g+1)*gs]``, ``order`` given (Linears of one input share GPTQ's order: it follows that
    input's statistics) or drawn. Made on the generator's device (a GPU draws and packs Llama-sized ones faster)."""
    with _one_thread(N * K):
        return _random_linear(N, K, method, group_size, sym, act_order, v2, generator, std, order)


def _random_linear(N, K, method, group_size, sym, act_order, v2, generator, std, order=None) -> dict:
    gs = K if group_size == -1 else group_size
    G = K // gs
    dev = generator.device if generator is not None else torch.device("cpu")
    zero = torch.full((G, N), 8, dtype=torch.int64, device=dev) if sym else \
        torch.randint(5, 11, (G, N), generator=generator, device=dev)
    half = 7 if sym else 5
    offset = torch.randint(-half, half + 1, (K, N), generator=generator, dtype=torch.int64, device=dev)
    spread = (((2 * half + 1) ** 2 - 1) / 12) ** 0.5  # the offsets' standard deviation
    scale = (torch.rand(G, N, generator=generator, device=dev) * 0.5 + 0.75) * (std / spread)
    if method in ("gptq", "compressed-tensors"):
        if not act_order:
            order = torch.arange(K, device=dev)
        elif order is None:
            order = torch.randperm(K, generator=generator, device=dev)
        else:
            order = order.to(dev)
        g_idx = torch.empty(K, dtype=torch.int32, device=dev)
        g_idx[order] = (torch.arange(K, device=dev) // gs).to(torch.int32)
        q = zero[g_idx.long()] + offset
        if method == "compressed-tensors":  # the unsigned values and zeros are the signed ones plus 8
            t = dict(weight_packed=pack_along_k(q).T.contiguous(), weight_scale=scale.T.half().contiguous(),
                     weight_shape=torch.tensor([N, K]))
            if not sym:
                t["weight_zero_point"] = pack_along_k(zero.T.contiguous())
            if act_order:
                t["weight_g_idx"] = g_idx
            return t
        return dict(qweight=pack_along_k(q), qzeros=pack_along_n(zero if v2 else (zero - 1) & 15),
                    scales=scale.half(), g_idx=g_idx)
    q = zero[torch.arange(K, device=dev) // gs] + offset
    return dict(qweight=pack_along_n(q, awq=True), qzeros=pack_along_n(zero, awq=True), scales=scale.half())


# --- the directory -----------------------------------------------------------------------------------------------


def quantization_config(method: str = "gptq", group_size: int = 128, sym: bool = False, act_order: bool = False,
                        v2: bool = False, not_convert=None, **extra) -> dict:
    """The ``quantization_config`` of a checkpoint, with the keys the quantizers write."""
    if method == "gptq":
        q = dict(quant_method="gptq", bits=4, group_size=group_size, desc_act=act_order, sym=sym,
                 damp_percent=0.01, true_sequential=True, static_groups=False)
        if v2:
            q["checkpoint_format"] = "gptq_v2"
        elif extra.pop("format_key", True):
            q["checkpoint_format"] = "gptq"
    elif method == "compressed-tensors":  # llm-compressor's W4A16 / W4A16_ASYM, as it writes them
        weights = dict(num_bits=4, type="int", symmetric=sym, strategy="channel" if group_size == -1 else "group",
                       group_size=None if group_size == -1 else group_size,
                       actorder="group" if act_order else None, dynamic=False, observer="minmax",
                       observer_kwargs={}, block_structure=None)
        q = dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
                 config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=None,
                                                output_activations=None, format=None)},
                 ignore=["lm_head"] + [f"re:.*{p.replace('.', '[.]')}$" for p in not_convert or ()],
                 kv_cache_scheme=None, sparsity_config={}, transform_config={}, global_compression_ratio=None,
                 version="0.12.2")
        q.update(extra)
        return q
    else:
        q = dict(quant_method="awq", bits=4, group_size=group_size, zero_point=not sym, version="gemm")
    q["modules_to_not_convert"] = list(not_convert) if not_convert else None
    q.update(extra)
    return q


def autoround_config(method: str = "gptq", group_size: int = 128, sym: bool = False, **extra) -> dict:
    """Intel AutoRound's ``quantization_config`` for weights packed as ``method`` (``"gptq"``: GPTQ v1,
    ``packing_format`` ``"auto_round:auto_gptq"``; ``"awq"``: AWQ gemm, ``"auto_round:auto_awq"``), with the tuning
    keys it writes beside them; ``extra`` adds or replaces keys (``block_name_to_quantize``, ``extra_config``, ...),
    a value of None leaving the key out (a checkpoint without ``packing_format``)."""
    q = dict(quant_method="auto-round", bits=4, group_size=group_size, sym=sym, data_type="int",
             packing_format=f"auto_round:auto_{method}", iters=200, lr=0.005, minmax_lr=0.005, nsamples=128,
             seqlen=2048, batch_size=8, amp=True, low_gpu_mem_usage=False, enable_minmax_tuning=True,
             enable_quanted_input=True, scale_dtype="torch.float16", autoround_version="0.5.1")
    q.update(extra)
    return {k: v for k, v in q.items() if v is not None}


def autoround_layer(q: dict, name: str) -> dict | None:
    """The settings that AutoRound's config ``q`` gives the Linear ``name`` (``group_size``, ``sym``), None where it
    is stored 16-bit, as vLLM reads them: an ``extra_config`` entry naming the layer exactly (``bits`` >= 16:
    16-bit), else the first key with a regular expression's characters found in the name (``re.search``; for a layer
    outside the blocks its ``bits`` defaulting to 16), else 16-bit unless the name starts with one of
    ``block_name_to_quantize``'s prefixes (a comma-separated string or a list; absent: every layer)."""
    extra = q.get("extra_config") or {}
    blocks = q.get("block_name_to_quantize", q.get("to_quant_block_names"))
    blocks = blocks.split(",") if isinstance(blocks, str) else blocks
    inside = not blocks or any(name.startswith(b) for b in blocks)
    own = extra.get(name)
    if own is None:
        own = next((cfg for key, cfg in extra.items() if set("*+?^$()[]{}|\\") & set(key)
                    and re.search(key, name)), None)
        if own is not None and not inside:
            own = dict(own, bits=own.get("bits", 16))
    if own is not None:
        if own.get("bits", q["bits"]) >= 16:
            return None
        return dict(group_size=own.get("group_size", q["group_size"]), sym=own.get("sym", q["sym"]))
    if not inside:
        return None
    return dict(group_size=q["group_size"], sym=q["sym"])


class Writer:
    """Tensors streamed into a checkpoint directory: one ``model.safetensors`` if they stay under ``shard_bytes``,
    else shards ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``."""

    def __init__(self, path, shard_bytes: int = 2 * 2**30):
        self.path, self.shard_bytes = os.fspath(path), shard_bytes
        os.makedirs(self.path, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.parts: list[list[str]] = []  # the tensor names of each written part
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, os.path.join(self.path, f"part-{len(self.parts)}.tmp"), metadata={"format": "pt"})
        self.parts.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self, config: dict) -> None:
        """Write the last part, name the files, and write ``config.json``."""
        if self.pending or not self.parts:
            self._flush()
        n = len(self.parts)
        if n == 1:
            os.replace(os.path.join(self.path, "part-0.tmp"), os.path.join(self.path, "model.safetensors"))
        else:
            weight_map = {}
            for i, names in enumerate(self.parts):
                file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(os.path.join(self.path, f"part-{i}.tmp"), os.path.join(self.path, file))
                weight_map.update({name: file for name in names})
            with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(self.path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


def linear_names(model, quantize_lm_head: bool = False, not_convert=()) -> list[str]:
    """The Linears of a transformers model that a quantizer would quantize: all but the output layer and those
    ``not_convert`` names."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, m in model.named_modules():
        if (isinstance(m, torch.nn.Linear) or _conv1d(m)) and (quantize_lm_head or m is not out):
            if not any(name == p or name.endswith("." + p) or name.startswith(p + ".") for p in not_convert):
                names.append(name)
    return names


def _conv1d(m) -> bool:
    """GPT-2's Conv1D: ``x @ weight + bias`` with weight ``[in, out]``; quantizers store it as the Linear of the
    transposed weight."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


def _expert_linears(name: str, tensor: torch.Tensor, mixtral_names: bool, interleaved: bool = False):
    """A 3-D experts weight ``<block>.gate_up_proj`` / ``<block>.up_proj`` (experts without a gate) /
    ``<block>.down_proj`` -> (its stored block prefix, [(projection name, [E, N, K] rows of it)]); ``interleaved``:
    the gate/up rows alternate (a block whose ``is_concatenated`` is False, gpt-oss)."""
    block, _, leaf = name.rpartition(".")
    stored = block.replace(".mlp.", ".block_sparse_moe.") if mixtral_names else block
    gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    if leaf == "gate_up_proj":
        if interleaved:
            return stored, [(gate, tensor[:, 0::2]), (up, tensor[:, 1::2])]
        half = tensor.shape[1] // 2
        return stored, [(gate, tensor[:, :half]), (up, tensor[:, half:])]
    if leaf == "up_proj":
        return stored, [(up, tensor)]
    return stored, [(down, tensor)]


def write_model(path, model, method: str = "gptq", group_size: int = 128, sym: bool = False,
                act_order: bool = False, v2: bool = False, shard_bytes: int = 2**30, not_convert=(),
                seed: int = 0, drop=(), config_extra: dict | None = None, quant_extra: dict | None = None,
                mixtral_names: bool = False, shared_gate_up_order: bool = True, stored_name=None,
                group_size_of=None, dense_experts=(), ct_options: dict | None = None, store_tied: bool = False,
                config_key: str = "quantization_config", quantize_lm_head: bool = False,
                autoround: bool = False, expert_layout: str = "split", stacked_expert_bias: bool = False) -> dict:
    """Write ``model`` (a transformers model with float weights) as a 4-bit checkpoint at ``path``; return the
    reference state dict: each quantized Linear's dequantized weight (fp16) under ``P.weight`` (a MoE block's
    experts: the 3-D weights of the dequantized experts), every other tensor as stored (fp16). ``drop``: tensor
    names left out (to test missing tensors). With ``act_order``, an expert's gate and up projections share one
    input order (GPTQ orders a layer's inputs by its Hessian, the same for two projections of one input) unless
    ``shared_gate_up_order`` is False. ``stored_name``: a function of each written tensor's name giving the name
    stored (an older checkpoint's names; the reference keeps the model's). ``group_size_of``: a function of a
    Linear's name giving its own group size (GPTQModel's per-module ``dynamic`` overrides), else ``group_size``.
    ``dense_experts``: experts blocks stored one 16-bit Linear an expert (a block the quantizer left alone).
    ``ct_options``: :func:`quantize_linear`'s compressed-tensors options (``unpacked_zero``, ``scale_dtype``).
    ``group_size_of`` may also give a dict of that Linear's own ``group_size``, ``sym`` and ``act_order``.
    ``store_tied``: a tied output layer's copy stored too, as AutoGPTQ saves (every ``state_dict`` key, cloned).
    ``quantize_lm_head``: the output layer stored quantized too (GPTQModel's ``lm_head=True``), a tied one as a
    quantized copy of the embeddings (then the reference's model must be untied).
    ``config_key``: the config.json key of the settings (``"compression_config"``: compressed-tensors' releases
    before mid-2024). ``autoround``: an Intel AutoRound checkpoint (:func:`autoround_config` with ``quant_extra``,
    ``method`` its packing), each Linear stored as that config says (:func:`autoround_layer`: 16-bit, or with its
    own group size and sym).
    ``expert_layout``: ``"split"`` stores expert e's projections as ``<block>.<e>.gate_proj`` / ``up_proj`` /
    ``down_proj``; ``"joined"`` as GPTQModel stores gpt-oss's, ``<block>.gate_up.<e>`` (the gate/up rows as the
    block holds them) and ``<block>.down.<e>``. Experts with biases (gpt-oss) store them an expert each beside
    their Linears, or, ``stacked_expert_bias``, as the block holds them (``<block>.gate_up_proj_bias``)."""
    with _one_thread(sum(p.numel() for p in model.parameters())):
        return _write_model(path, model, method, group_size, sym, act_order, v2, shard_bytes, not_convert, seed, drop,
                            config_extra, quant_extra, mixtral_names, shared_gate_up_order, stored_name,
                            group_size_of, dense_experts, ct_options, store_tied, config_key, quantize_lm_head,
                            autoround, expert_layout, stacked_expert_bias)


def _write_model(path, model, method, group_size, sym, act_order, v2, shard_bytes, not_convert, seed, drop,
                 config_extra, quant_extra, mixtral_names, shared_gate_up_order, stored_name, group_size_of,
                 dense_experts, ct_options, store_tied, config_key, quantize_lm_head, autoround, expert_layout,
                 stacked_expert_bias) -> dict:
    ct = ct_options or {}
    if autoround:
        ar = autoround_config(method, group_size, sym, **(quant_extra or {}))
        group_size_of = functools.partial(autoround_layer, ar)
    gen = torch.Generator().manual_seed(seed)
    quantized = set(linear_names(model, quantize_lm_head, not_convert=not_convert))
    if autoround:  # the Linears its config leaves 16-bit are written as plain ones
        quantized = {n for n in quantized if autoround_layer(ar, n) is not None}
    writer = Writer(path, shard_bytes)
    if stored_name is not None:
        add = writer.add
        writer.add = lambda name, tensor: add(stored_name(name), tensor)
    reference = {}
    state = model.state_dict()

    def settings(linear: str) -> dict:  # a Linear's own group size, sym and act_order (group_size_of's dict)
        own = dict(group_size=group_size if group_size_of is None else group_size_of(linear), sym=sym,
                   act_order=act_order)
        if isinstance(own["group_size"], dict):
            own.update(own.pop("group_size"))
            own.setdefault("group_size", group_size)
        return own

    tied = set()
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        tied = {n for n, p in model.named_parameters(remove_duplicate=False)
                if p is model.get_output_embeddings().weight} - {next(
                    n for n, p in model.named_parameters() if p is model.get_output_embeddings().weight)}
        tied -= {f"{n}.weight" for n in quantized}  # a quantized output layer is stored, as its own layer
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if name in tied and not store_tied:
            continue  # transformers does not store the tied copy
        if module in quantized and leaf == "weight":
            transposed = _conv1d(model.get_submodule(module))
            own = settings(module)
            stored, deq = quantize_linear(tensor.T if transposed else tensor, method, own["group_size"], own["sym"],
                                          own["act_order"], v2, gen, **ct)
            for part, t in stored.items():
                if f"{module}.{part}" not in drop:
                    writer.add(f"{module}.{part}", t)
            reference[name] = deq.T.contiguous() if transposed else deq
            continue
        if leaf in ("gate_up_proj", "up_proj", "down_proj") and module.endswith(".experts") and tensor.dim() == 3:
            block = model.get_submodule(module)
            # [E, in, out]: Llama-4's experts (no layout flag) and blocks that say is_transposed
            transposed = getattr(block, "is_transposed", type(block).__name__ == "Llama4TextExperts")
            interleaved = not getattr(block, "is_concatenated", True)
            stored_block, projs = _expert_linears(name, tensor.detach().transpose(1, 2) if transposed
                                                  else tensor.detach(), mixtral_names, interleaved)
            if expert_layout == "joined":  # one Linear an expert: gate/up rows as the block holds them
                projs = [({"gate_up_proj": "gate_up", "down_proj": "down"}[leaf],
                          tensor.detach().transpose(1, 2) if transposed else tensor.detach())]
            key_of = (lambda e, proj: f"{stored_block}.{proj}.{e}") if expert_layout == "joined" else \
                (lambda e, proj: f"{stored_block}.{e}.{proj}")
            deqs = []
            orders = [torch.randperm(projs[0][1].shape[2], generator=gen) if act_order and shared_gate_up_order
                      else None for _ in range(tensor.shape[0])]
            if module in dense_experts:
                for proj, w in projs:
                    for e in range(w.shape[0]):
                        writer.add(f"{key_of(e, proj)}.weight", w[e].half())
                reference[name] = tensor.detach().half()
                continue
            for proj, w in projs:
                per_expert = []
                for e in range(w.shape[0]):
                    own = settings(key_of(e, proj))
                    stored, deq = quantize_linear(w[e], method, own["group_size"], own["sym"], own["act_order"], v2,
                                                  gen, orders[e] if own["act_order"] else None, **ct)
                    for part, t in stored.items():
                        key = f"{key_of(e, proj)}.{part}"
                        if key not in drop:
                            writer.add(key, t)
                    per_expert.append(deq)
                deqs.append(torch.stack(per_expert))
            # gate rows, then up rows (or one of each in turn)
            reference[name] = torch.stack(deqs, 2).flatten(1, 2) if len(deqs) == 2 and interleaved else \
                torch.cat(deqs, dim=1)
            if transposed:
                reference[name] = reference[name].transpose(1, 2).contiguous()
            continue
        if leaf in ("gate_up_proj_bias", "down_proj_bias") and module.endswith(".experts") and tensor.dim() == 2 \
                and not stacked_expert_bias:  # [E, N]: an expert's bias beside its Linears, split as they are
            block = model.get_submodule(module)
            weight = leaf[:-len("_bias")]
            stored_block, projs = _expert_linears(f"{module}.{weight}", tensor.detach()[..., None], mixtral_names,
                                                  not getattr(block, "is_concatenated", True))
            if expert_layout == "joined":
                projs = [({"gate_up_proj": "gate_up", "down_proj": "down"}[weight], tensor.detach()[..., None])]
            for proj, b in projs:
                for e in range(b.shape[0]):
                    key = f"{stored_block}.{proj}.{e}.bias" if expert_layout == "joined" else \
                        f"{stored_block}.{e}.{proj}.bias"
                    if key not in drop:
                        writer.add(key, b[e, :, 0].half())
            reference[name] = tensor.detach().half()
            continue
        t = tensor.detach().half() if tensor.is_floating_point() else tensor.detach()
        if name not in drop:
            writer.add(name.replace(".mlp.gate.", ".block_sparse_moe.gate.") if mixtral_names else name, t)
        reference[name] = t
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # as save_pretrained writes it
    config[config_key] = ar if autoround else quantization_config(method, group_size, sym, act_order, v2,
                                                                   not_convert, **(quant_extra or {}))
    config.update(config_extra or {})
    writer.close(config)
    return reference


# --- tiny models ----------------------------------------------------------------------------------------------


def tiny_config(arch: str = "llama", hidden: int = 128, layers: int = 2, tie: bool = False, vocab: int = 256):
    """A small transformers config: ``llama`` or ``qwen2`` (q/k/v with biases), vocab ``vocab``."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    return cls(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=64, tie_word_embeddings=tie)


def tiny_gemma3_multimodal_config():
    """Gemma-3 4B+'s config, tiny: AutoModelForCausalLM builds Gemma3ForConditionalGeneration (a vision tower),
    whose language model transformers names model.language_model.* while checkpoints store language_model.model.*."""
    import transformers

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=255)


def tiny_moe_config(arch: str = "qwen3_moe", hidden: int = 64, layers: int = 2, width: int = 32, experts: int = 4):
    """A small transformers MoE config: ``qwen3_moe`` (``experts`` experts, top 2, expert width ``width``) or
    ``mixtral`` (the same sizes), vocab 256. Tests take 3 experts where the count is not what they check: under
    the interpreter each expert adds programs to every grouped launch, and 3 still leave top 2 a choice."""
    import transformers

    common = dict(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=width, num_local_experts=experts, **common)
    return transformers.Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=width, num_experts=experts,
                                       decoder_sparse_step=1, **common)


def num_experts(config) -> int:
    """The routed experts of a MoE config (``num_experts`` or Mixtral's ``num_local_experts``)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


def random_model(config, seed: int = 0):
    """The transformers causal LM of ``config`` in fp32 with random weights (seeded), eval mode."""
    import transformers

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def reference_model(config, reference: dict, dtype=torch.float32):
    """A plain-torch transformers model of ``config`` holding the reference weights (``write_model``'s result)."""
    model = random_model(config).to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in reference.items()}, strict=False)
    assert not unexpected, unexpected
    assert all(k in _tied(model) for k in missing), missing
    model.tie_weights()
    return model.eval()


def _tied(model) -> set:
    out = model.get_output_embeddings()
    return {n for n, p in model.named_parameters(remove_duplicate=False) if out is not None and p is out.weight}
