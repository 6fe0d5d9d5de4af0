"""Mixture-of-experts causal LMs of transformers (Qwen3-MoE, Mixtral) with random weights, for the grouped family's
model entries (``tilegemm bench --op grouped --model qwen3_moe``, :class:`tilegemm.models.bench.MoEBench`): the same
model run on each experts implementation, transformers' built-in ones and tilegemm's.

``transformers`` is imported inside the functions that need it (``pip install 'tilegemm[models]'``).
"""

from __future__ import annotations

import copy
import math

import torch

from tilegemm.models import llama

# Qwen3-30B-A3B's shapes (every layer a MoE block: 128 experts of 768, top 8).
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)
QWEN3_30B_A3B_LAYERS = 48
# Mixtral-8x7B's shapes (8 experts of 14336, top 2).
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=32768, rope_theta=1000000.0)
MIXTRAL_8X7B_LAYERS = 32
# Small enough for Triton's interpreter: widths that a group of 32 divides, a few experts, top 2.
TINY_QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  decoder_sparse_step=1, max_position_embeddings=256)
TINY_MIXTRAL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=256)
TINY_LAYERS = 2
TINY_GROUP = 32
GROUP = 128
# The architectures: (transformers config class, full-size shapes, their layers, display name, tiny shapes).
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS, "Qwen3-30B-A3B", TINY_QWEN3),
    "mixtral": ("MixtralConfig", MIXTRAL_8X7B, MIXTRAL_8X7B_LAYERS, "Mixtral-8x7B", TINY_MIXTRAL),
}
# transformers' own experts implementations the models are measured against (eager, a loop over experts, is
# slower than both at every size measured).
BUILT_IN = ("grouped_mm", "batched_mm")


def arch_of(arch: str):
    """(config class name, full shapes, full layers, display name, tiny shapes); ValueError naming the choices."""
    if arch not in ARCHS:
        raise ValueError(f"unknown MoE architecture {arch!r}: choose one of {', '.join(ARCHS)}")
    return ARCHS[arch]


def experts_count(shapes: dict) -> int:
    return shapes.get("num_experts") or shapes["num_local_experts"]


def expert_width(shapes: dict) -> int:
    return shapes.get("moe_intermediate_size") or shapes["intermediate_size"]


def build(arch: str, tiny: bool = False, layers: int | None = None, device="cpu", dtype=torch.bfloat16):
    """The ``arch`` MoE causal LM in ``dtype`` with random weights (transformers' initialisation), in eval mode on
    ``device``, its experts on tilegemm's implementation (:func:`set_experts`): the full model's shapes with
    ``layers`` decoder layers (default all), or the tiny config (default 2 layers). Seed torch's generator first
    for a fixed model."""
    llama.require_transformers()
    import transformers

    import tilegemm.nn.moe as moe

    if not moe.register_experts():
        raise RuntimeError(f"transformers {transformers.__version__} has no experts interface (v5 has): the MoE "
                           "models need it")
    cls, full, full_layers, _, tiny_shapes = arch_of(arch)
    shapes, default = (tiny_shapes, TINY_LAYERS) if tiny else (full, full_layers)
    cfg = getattr(transformers, cls)(**shapes, num_hidden_layers=layers or default)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=moe.NAME)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


@torch.no_grad()
def experts_share(model, ids) -> float:
    """How much the experts move the logits of ``ids``: the relative difference between the model's logits and
    those with every experts block's output replaced by zeros. A check of the logits sees errors of the experts
    only well below this."""
    full = model(input_ids=ids, use_cache=False).logits.float()
    hooks = [m.register_forward_hook(lambda mod, args, out: torch.zeros_like(out)) for m in experts_blocks(model)]
    try:
        bare = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return float((full - bare).norm() / full.norm())


@torch.no_grad()
def experts_agreement(ref_model, model, ids, use) -> float:
    """The largest relative error, over the layers, of ``model``'s experts against ``ref_model``'s on the same
    inputs: each experts block of ``ref_model`` is recorded (its hidden states, routing and output) on ``ids``,
    then the same block of ``model`` runs those inputs. ``use(model, "ref"|"model")`` sets each model's experts
    implementation first; inf where a layer's error is NaN. Unlike the logits, this is no chaotic function of the
    routing: a token whose top-k choice flips between two implementations (a near-tie) changes every later layer's
    input."""
    ref_blocks, blocks = experts_blocks(ref_model), experts_blocks(model)
    if len(ref_blocks) != len(blocks):
        raise ValueError(f"the models hold {len(ref_blocks)} and {len(blocks)} experts blocks")
    seen = []
    hooks = [b.register_forward_hook(lambda mod, args, kwargs, out: seen.append((args, kwargs, out)),
                                     with_kwargs=True) for b in ref_blocks]
    try:
        use(ref_model, "ref")
        ref_model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    use(model, "model")
    worst = 0.0
    for block, (args, kwargs, out) in zip(blocks, seen):
        got = block(*args, **kwargs).float()
        err = float((got - out.float()).norm() / out.float().norm())
        worst = math.inf if math.isnan(err) else max(worst, err)  # (max() would drop a NaN: a layer of NaN)
    return worst


def experts_blocks(model):
    """transformers' experts blocks (``...Experts`` modules), in order, whatever their weights are (16-bit or
    4-bit buffers)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def set_experts(model, impl: str) -> None:
    """Run every MoE block of ``model`` on the experts implementation ``impl`` (``"tilegemm"`` or one of
    transformers' own)."""
    model.set_experts_implementation(impl)


@torch.no_grad()
def int4_twin(model, group_size: int):
    """A 4-bit copy of ``model`` as ``tilegemm.nn.quantize_`` makes it (every Linear but lm_head an
    ``Int4Linear``, the experts 4-bit stacked ones on ``"tilegemm"``), with ``model``'s own weights overwritten by
    those 4-bit weights dequantized, so that the two compute the same product (the 16-bit model is then the int4
    one's reference and baseline). The copy is made while the experts' 16-bit weights are taken out of ``model``:
    they are never held twice."""
    import tilegemm.nn
    from tilegemm.nn.moe import _int4, install_int4_experts_, use_int4_experts_, weight_group_size
    from tilegemm.ops.w4a16.format import dequantize, quantize

    blocks = experts_blocks(model)
    saved = []
    for m in blocks:
        names = ["gate_up_proj" if hasattr(m, "gate_up_proj") else "up_proj", "down_proj"]
        saved.append({n: m._parameters.pop(n) for n in names})
    try:
        twin = copy.deepcopy(model)
    finally:
        for m, params in zip(blocks, saved):
            m._parameters.update(params)
    tilegemm.nn.quantize_(twin, group_size=group_size, filter=lambda name, m: "lm_head" not in name)
    llama.dequantized_copy_into(model, twin)
    for m16, m4, params in zip(blocks, experts_blocks(twin), saved):
        transposed = getattr(m16, "is_transposed", False)
        weights = {}
        for n, p in params.items():  # each weight's group size as quantize_ gives it (one group where K is below)
            w = (p.transpose(1, 2) if transposed else p).detach()
            weights[n] = quantize(w, weight_group_size(w.shape[2], group_size))
        install_int4_experts_(m4, weights)
        for n, p in params.items():
            w = _int4(m4, n)
            for e in range(w.shape[0]):  # an expert at a time: its fp32 dequantization is small
                d = dequantize(w.expert(e)).to(p.dtype)
                p[e].copy_(d.T if transposed else d)
    use_int4_experts_(twin)
    return twin


def layer_gib(shapes: dict, dtype=torch.bfloat16) -> float:
    """One decoder layer's 16-bit weights in GiB: its experts (gate, up, down) and attention."""
    h, i, e = shapes["hidden_size"], expert_width(shapes), experts_count(shapes)
    heads, kv, d = shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["head_dim"]
    size = torch.tensor([], dtype=dtype).element_size()
    return size * (3 * e * h * i + 2 * h * heads * d + 2 * h * kv * d) / 2**30


def layers_that_fit(arch: str, requested: int | None = None, int4: bool = False) -> int:
    """The full-size ``arch``'s layers that fit (``requested`` if given): the 16-bit model, with ``int4`` its 4-bit
    twin too (4-bit weights, a 16-bit scale and zero a group, and the decode kernel's fragment layout of them, as
    large again, kept where that kernel runs), the embeddings, and room for caches, activations and compiled
    graphs."""
    if requested:
        return requested
    _, shapes, full_layers, _, _ = arch_of(arch)
    embed_gib = 2 * 2 * shapes["vocab_size"] * shapes["hidden_size"] / 2**30 * (2 if int4 else 1)
    free, _ = torch.cuda.mem_get_info()
    int4_bytes = 2 * (0.5 + 2 * 2 / GROUP)  # a weight's bytes in the twin: packed parts, then fragments again
    per_layer = layer_gib(shapes) * (1 + int4_bytes / 2 if int4 else 1.0)
    return max(1, min(full_layers, int((free / 2**30 - embed_gib - 16.0) / per_layer)))
