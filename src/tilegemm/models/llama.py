"""A Llama-architecture model (or Qwen2's: ``ARCHS``) with random weights, 4-bit through ``tilegemm.nn.quantize_``, and greedy decoding
with a static KV cache: eager, replayed from a CUDA graph, or compiled by ``torch.compile`` and replayed.

``examples/llama_decode.py`` decodes with it; ``tilegemm bench --op w4a16 --model llama``
(:class:`tilegemm.models.bench.LlamaDecodeBench`) times one decode step. ``transformers`` is imported inside
the functions that need it (``pip install 'tilegemm[models]'``).
"""

from __future__ import annotations

import copy
import inspect
import time

import torch

# Llama-3-8B's shapes; a model is built with any number of its 32 decoder layers.
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA3_8B_LAYERS = 32
LLAMA3_8B_GROUP = 128
# Qwen2-7B's shapes: a second architecture (q, k and v projections with biases, a 152k vocabulary, 28 layers).
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False)
QWEN2_7B_LAYERS = 28
# Small enough for Triton's interpreter; a group of 32 divides every Linear's in_features (64, 128).
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=256)
TINY_LAYERS = 2
TINY_GROUP = 32
# The architectures build() makes: (transformers config class, full-size shapes, their decoder layers, the name
# the descriptions use). Both run through the same static-cache decoder.
ARCHS = {
    "llama": ("LlamaConfig", LLAMA3_8B, LLAMA3_8B_LAYERS, "Llama-3-8B"),
    "qwen2": ("Qwen2Config", QWEN2_7B, QWEN2_7B_LAYERS, "Qwen2-7B"),
}

INSTALL = "pip install 'tilegemm[models]'"


def require_transformers() -> None:
    """Raise ImportError naming the extra to install when transformers is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError(f"the Llama model needs transformers: {INSTALL}") from None


def arch_of(arch: str):
    """(config class name, full shapes, full layers, display name) of ``arch``; ValueError naming the choices."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHS)}")
    return ARCHS[arch]


def build(tiny: bool = False, layers: int | None = None, device="cpu", arch: str = "llama"):
    """The ``arch`` causal LM (``llama``: ``LlamaForCausalLM``; ``qwen2``: ``Qwen2ForCausalLM``) in fp16 with random
    weights (normal, std = initializer_range), in eval mode on ``device``: the full model's shapes
    (Llama-3-8B, Qwen2-7B) with ``layers`` decoder layers (default all), or the tiny config (default 2 layers).
    The weights come from torch's random generator: seed it first for a fixed model."""
    require_transformers()
    import transformers

    cls, full, full_layers, _ = arch_of(arch)
    shapes, default = (TINY, TINY_LAYERS) if tiny else (full, full_layers)
    cfg = getattr(transformers, cls)(**shapes, num_hidden_layers=layers or default)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def quantized_copy(model, group_size: int):
    """A copy of ``model`` whose Linears, all but lm_head, are :class:`tilegemm.nn.Int4Linear` (``quantize_``).
    The logits' Linear stays fp16: it is what argmax reads, and Llama-3's vocabulary makes it the largest one."""
    import tilegemm.nn

    return tilegemm.nn.quantize_(copy.deepcopy(model), group_size=group_size,
                                 filter=lambda name, m: "lm_head" not in name)


def _layer_gib(shapes: dict) -> float:
    """One decoder layer's fp16 weights in GiB (attention with grouped KV heads, the gated MLP)."""
    h, i = shapes["hidden_size"], shapes["intermediate_size"]
    kv = h // shapes["num_attention_heads"] * shapes["num_key_value_heads"]
    return 2 * (2 * h * h + 2 * h * kv + 3 * h * i) / 2**30


def layers_that_fit(requested: int | None = None, arch: str = "llama") -> int:
    """The full-size ``arch``'s layers that fit (``requested`` if given): an fp16 layer (Llama-3-8B's 436 MB)
    twice while the copy is made (then its int4 form, about a quarter), the embedding and lm_head in fp16 twice
    and room for the KV cache and activations."""
    if requested:
        return requested
    _, shapes, full_layers, _ = arch_of(arch)
    embed_gib = 2 * 2 * shapes["vocab_size"] * shapes["hidden_size"] * 2 / 2**30  # both models' embed + lm_head
    free, _ = torch.cuda.mem_get_info()
    per_layer = 2 * _layer_gib(shapes) + 0.05  # deepcopy: two fp16 layers at once; the int4 copy's quarter
    return max(1, min(full_layers, int((free / 2**30 - embed_gib - 8.0) / per_layer)))


def forward(model, ids, past=None, position=None):
    """(logits of the last position [B, V], the cache); only the last position's logits are computed."""
    params = inspect.signature(model.forward).parameters
    # transformers 5.2x names the cache argument and output field `cache`; earlier versions `past_key_values`
    kwargs = dict(input_ids=ids, use_cache=True, **{"cache" if "cache" in params else "past_key_values": past})
    if position is not None:
        kwargs["cache_position"] = position
    if "logits_to_keep" in params:  # transformers >= 4.50
        kwargs["logits_to_keep"] = 1
    elif "num_logits_to_keep" in params:
        kwargs["num_logits_to_keep"] = 1
    out = model(**kwargs)
    return out.logits[:, -1], getattr(out, "cache", None) if "cache" in params else out.past_key_values


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def static_cache(model, batch: int, max_len: int, device):
    """A ``transformers.StaticCache`` of ``max_len`` positions, allocated now (fixed addresses: a CUDA graph of
    the decode step reads and writes the same tensors at every replay)."""
    from transformers import StaticCache

    cfg = model.config
    dtype = getattr(model, "dtype", torch.float16)  # the keys and values the model's attention makes
    params = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in params:  # transformers 4.x
        return StaticCache(config=cfg, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype)
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(batch, cfg.num_key_value_heads, head_dim, dtype, torch.device(device))
    return cache


class Decoder:
    """Greedy decoding with a static KV cache. ``graph=True`` replays the one-token step from a CUDA graph
    (captured once per batch size), so the host's Python (transformers, tilegemm's wrappers) costs nothing
    per token; ``graph=False`` runs it eagerly. ``compiled=True`` (with ``graph``) runs the step through
    ``torch.compile`` first (fixed shapes): Inductor fuses the norms, rotary embedding and elementwise work
    around the Linears, which stay calls of their ops (cuBLAS, or ``tilegemm::w4a16_matmul``); the prompt's
    prefill stays eager.

    ``repeat=True`` makes a step repeatable, for timing one step many times: transformers >= 5 writes the
    step's key and value at the cache's own counter (a device tensor per layer that each write advances), not
    at ``cache_position``, so the step first sets those counters to ``pos`` (one multi-tensor copy, inside
    the graph) and every repetition writes the same slot."""

    def __init__(self, model, batch: int, max_len: int, device, graph: bool, compiled: bool = False,
                 repeat: bool = False):
        self.model, self.device, self.graph = model, device, graph or compiled
        self.cache = static_cache(model, batch, max_len, device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.counters = [layer.cumulative_length for layer in getattr(self.cache, "layers", ())
                         if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)] if repeat else []
        self.logits = None
        self.cuda_graph = None
        self.step_fn = self._step
        if compiled:
            self.step_fn = torch.compile(self._step, dynamic=False)

    def _step(self, ids, pos):
        if self.counters:
            torch._foreach_copy_(self.counters, [pos[0]] * len(self.counters))
        return forward(self.model, ids, self.cache, pos)[0]

    def step(self):
        return self.step_fn(self.ids, self.pos)

    @torch.no_grad()
    def capture(self):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs asks
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.cuda_graph):
            self.logits = self.step()

    @torch.no_grad()
    def prefill(self, prompt):
        """Fill the cache with ``prompt`` [B, P] (positions 0..P-1) and set up the next step: its token (the
        last position's argmax) and position (P). Returns the last position's logits [B, V]."""
        P = prompt.shape[1]
        logits, _ = forward(self.model, prompt, self.cache, torch.arange(P, device=self.device))
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.pos.fill_(P)
        return logits

    @torch.no_grad()
    def next_logits(self):
        """Logits [B, V] of one step from ``ids`` at ``pos``: a replay of the captured graph, else the step."""
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
            return self.logits
        return self.step()

    @torch.no_grad()
    def run(self, prompt, new_tokens):
        """(prefill seconds, decode seconds, generated tokens [B, new_tokens])."""
        P = prompt.shape[1]
        if self.graph and self.cuda_graph is None:
            self.prefill(prompt)
            self.capture()
        self.cache.reset()
        sync(self.device)
        t0 = time.perf_counter()
        logits, _ = forward(self.model, prompt, self.cache, torch.arange(P, device=self.device))
        tok = logits.argmax(-1, keepdim=True)
        sync(self.device)
        t1 = time.perf_counter()
        out = [tok]
        for i in range(new_tokens - 1):
            self.ids.copy_(tok)
            self.pos.fill_(P + i)
            if self.graph:
                self.cuda_graph.replay()
                logits = self.logits
            else:
                logits = self.step()
            tok = logits.argmax(-1, keepdim=True)
            out.append(tok)
        sync(self.device)
        return t1 - t0, time.perf_counter() - t1, torch.cat(out, 1)


@torch.no_grad()
def greedy(model, prompt, new_tokens, device, graph=False):
    """(prefill seconds, decode seconds, generated tokens [B, new_tokens]) of one greedy run."""
    return Decoder(model, prompt.shape[0], prompt.shape[1] + new_tokens, device, graph).run(prompt, new_tokens)


@torch.no_grad()
def dequantized_copy_into(fp16_model, int4_model) -> None:
    """Overwrite ``fp16_model``'s quantized Linears with the int4 model's weights, dequantized (in place: no third
    copy of the model)."""
    from tilegemm.nn import Int4Linear
    from tilegemm.nn.fuse import ProjectionPart

    int4 = dict(int4_model.named_modules())
    for name, module in fp16_model.named_modules():
        if isinstance(int4.get(name), (Int4Linear, ProjectionPart)):  # (a part of joined projections too)
            module.weight.copy_(int4[name].dequantize().to(module.weight.dtype))


@torch.no_grad()
def agreement(int4_model, ref_model, prompt) -> dict:
    """Logits of every prompt position from both models: relative error (last position), argmax agreement."""
    a = int4_model(input_ids=prompt).logits.float()
    b = ref_model(input_ids=prompt).logits.float()
    last = float((a[:, -1] - b[:, -1]).norm() / b[:, -1].norm())
    same = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return dict(rel_err_last=last, argmax_agree=same)
