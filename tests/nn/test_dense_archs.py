"""convert_ and quantize_ on tiny transformers models of several architectures: logits and gradients against the
eager model, the 4-bit model against the same model holding the dequantized weights, greedy generation, and the
layers each keeps with a note (GPT-2's Conv1D, layers narrower than the group, tied heads a forward reads)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tilegemm.nn import Int4Linear, Linear, convert_, quantize_
from tilegemm.nn.convert import ConversionNote
from tilegemm.nn.int4 import is_conv1d

from conftest import assert_rel_close

transformers = pytest.importorskip("transformers")

V, S = 64, 5
_SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64)
# (model_type, config, auto class, input kind): one of each family of layout the conversions meet
ARCHS = {
    "llama": ("llama", dict(_SMALL, num_key_value_heads=1, head_dim=16), "AutoModelForCausalLM", "ids"),
    "gemma": ("gemma", dict(_SMALL, num_key_value_heads=1, head_dim=16), "AutoModelForCausalLM", "ids"),  # tied
    "gpt2": ("gpt2", dict(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64), "AutoModelForCausalLM",
             "ids"),  # Conv1D
    "opt": ("opt", dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
                        word_embed_proj_dim=32, max_position_embeddings=64), "AutoModelForCausalLM", "ids"),
    "bert": ("bert", _SMALL, "AutoModel", "ids"),
    "t5": ("t5", dict(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0), "AutoModelForSeq2SeqLM", "s2s"),
    "vit": ("vit", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        image_size=16, patch_size=8, num_labels=3), "AutoModelForImageClassification", "pixels"),
}


def _model(arch: str, dtype=torch.float32, device="cpu") -> torch.nn.Module:
    model_type, kw, auto, _ = ARCHS[arch]
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config, attn_implementation="eager").to(device, dtype).eval()
    with torch.no_grad():  # biases made nonzero, so a layer that dropped its bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def _inputs(arch: str, dtype=torch.float32, device="cpu") -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (1, S), generator=g).to(device)
    kind = ARCHS[arch][3]
    if kind == "s2s":
        return dict(input_ids=ids, decoder_input_ids=ids[:, :3])
    if kind == "pixels":
        return dict(pixel_values=torch.randn(1, 3, 16, 16, generator=g).to(device, dtype))
    return dict(input_ids=ids)


def _out(model, inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _dequantized(dense: torch.nn.Module, quantized: torch.nn.Module) -> torch.nn.Module:
    """``dense`` with each layer ``quantized`` made 4-bit holding that layer's dequantized weight (a tensor of its
    own: a tied head must not overwrite the embedding)."""
    ref = copy.deepcopy(dense)
    for name, m in quantized.named_modules():
        if isinstance(m, Int4Linear):
            layer = ref.get_submodule(name)
            w = m.dequantize().to(layer.weight.dtype)
            layer.weight = torch.nn.Parameter((w.T if is_conv1d(layer) else w).contiguous(), requires_grad=False)
    return ref


def _generate(model, inputs):
    # two tokens: the prompt's forward, then one step on the KV cache (each further step runs the same layers)
    return model.generate(**{k: v for k, v in inputs.items() if not k.startswith("decoder")}, max_new_tokens=2,
                          min_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_convert_matches_eager_logits_and_grads(arch, device):
    model = _model(arch, device=device)
    inputs = _inputs(arch, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionNote)
        conv = convert_(copy.deepcopy(model))
    assert any(isinstance(m, Linear) for m in conv.modules())
    want, got = _out(model, inputs), _out(conv, inputs)
    assert_rel_close(got, want, 1e-4)
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    ref = dict(model.named_parameters())
    for name, p in conv.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:  # a key bias's gradient is ~0 (softmax ignores it): measured against a floor
            err = float((p.grad - ref[name].grad).norm()) / max(float(ref[name].grad.norm()), 1e-4)
            assert err < 1e-4, (name, err)
    if ARCHS[arch][3] != "pixels" and arch != "bert":
        with torch.no_grad():
            assert torch.equal(_generate(conv, inputs), _generate(model, inputs))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantize_matches_dequantized_model(arch, device):
    dense = _model(arch, torch.float16, device)
    inputs = _inputs(arch, torch.float16, device)
    q = quantize_(copy.deepcopy(dense), group_size=32)
    assert any(isinstance(m, Int4Linear) for m in q.modules())
    assert q.tilegemm_untied == []  # a tied head's untying is in the config, not noted again
    ref = _dequantized(dense, q)
    with torch.no_grad():
        got, want = _out(q, inputs), _out(ref, inputs)
        assert torch.isfinite(got).all()
        assert_rel_close(got.float(), want.float(), 1e-2)
        if ARCHS[arch][3] != "pixels" and arch != "bert":
            assert torch.equal(_generate(q, inputs), _generate(ref, inputs))


def test_convert_names_gpt2_conv1d_layers(device):
    # GPT-2's layers are transformers' Conv1D (weight [in, out]): kept, and said so, not passed over in silence
    model = _model("gpt2", device=device)
    with pytest.warns(ConversionNote, match="Conv1D"):
        conv = convert_(copy.deepcopy(model))
    kept = dict(conv.tilegemm_skipped)
    assert {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj"} <= set(kept)
    assert all("quantize_ takes it" in why for why in kept.values())
    assert isinstance(conv.lm_head, Linear) and conv.lm_head.weight is conv.transformer.wte.weight  # still tied
    # a filter that vetoes the layer silences its note, as for any module
    quiet = convert_(copy.deepcopy(model), filter=lambda name, m: "c_attn" not in name, warn=False)
    assert "transformer.h.0.attn.c_attn" not in dict(quiet.tilegemm_skipped)


def test_quantize_keeps_narrow_layers_with_a_note(device):
    # in_features 40 (a multiple of 8, not of 32) and 36 (not of 8): kept with the reason, the rest 4-bit
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=40, intermediate_size=36, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device, torch.float16).eval()
    with pytest.warns(ConversionNote) as notes:
        q = quantize_(copy.deepcopy(dense), group_size=32)
    kept = dict(q.tilegemm_skipped)
    assert "not a multiple of 8" in kept["model.layers.0.mlp.down_proj"]
    assert "not a multiple of group_size = 32" in kept["model.layers.0.self_attn.q_proj"]
    assert isinstance(q.model.layers[0].self_attn.o_proj, Int4Linear)  # in_features 32
    assert len(notes) == 1
    inputs = _inputs("llama", device=device)
    with torch.no_grad():
        assert_rel_close(_out(q, inputs).float(), _out(_dequantized(dense, q), inputs).float(), 1e-2)


def test_quantize_keeps_tied_head_whose_flag_the_forward_reads(device):
    # SwitchTransformers scales the decoder output by d_model**-0.5 when config.tie_word_embeddings is set: a 4-bit
    # head (which unties) would make the logits sqrt(d_model) times too large; it stays 16-bit and tied
    config = transformers.AutoConfig.for_model(
        "switch_transformers", vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, num_experts=2, num_sparse_encoder_layers=0, num_sparse_decoder_layers=0,
        decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    dense = transformers.AutoModelForSeq2SeqLM.from_config(config).to(device, torch.float16).eval()
    with pytest.warns(ConversionNote, match="tie_word_embeddings"):
        q = quantize_(copy.deepcopy(dense), group_size=32)
    assert type(q.lm_head) is torch.nn.Linear and q.config.tie_word_embeddings
    assert q.lm_head.weight is q.get_input_embeddings().weight
    assert "lm_head" in dict(q.tilegemm_skipped)
    inputs = _inputs("t5", device=device)
    with torch.no_grad():
        assert_rel_close(_out(q, inputs).float(), _out(_dequantized(dense, q), inputs).float(), 1e-2)


def test_falcon_linears_are_converted_and_quantized(device):
    # FalconLinear (x @ W.T, then + bias) computes nn.Linear's function: swapped by both, not kept as a subclass
    config = transformers.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       bias=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    inputs = _inputs("llama", device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionNote)
        conv = convert_(copy.deepcopy(model))
        q = quantize_(copy.deepcopy(model).half(), group_size=32)
    assert conv.tilegemm_skipped == [] and q.tilegemm_skipped == []
    attn = conv.transformer.h[0].self_attention
    assert type(attn.query_key_value) is Linear and type(attn.dense) is Linear
    want, got = _out(model, inputs), _out(conv, inputs)
    assert_rel_close(got, want, 1e-4)
    assert sum(isinstance(m, Int4Linear) for m in q.modules()) == 5  # qkv, dense, both MLP layers, lm_head
    with torch.no_grad():
        assert_rel_close(_out(q, inputs).float(), _out(_dequantized(model.half(), q), inputs).float(), 1e-2)
