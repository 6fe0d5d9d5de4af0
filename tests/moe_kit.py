"""What the tests of transformers' MoE models share: transformers (and safetensors) or a skip, the mark that skips
where transformers has no experts interface, and tiny configs of the MoE models whose blocks run code of their own
(Llama-4, DBRX, JetMoE; SwitchTransformers and NLLB-MoE, whose experts are a ModuleDict of per-expert MLPs)."""

from __future__ import annotations

import pytest

from conftest import hide_broken_torchvision

NO_INTERFACE = "this transformers has no experts interface (ALL_EXPERTS_FUNCTIONS, transformers >= 5)"


def transformers_or_skip(safetensors: bool = True):
    """transformers (and, with ``safetensors``, safetensors) imported, or the calling module skipped."""
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is optional (pip install 'tilegemm[models]')")
    if safetensors:
        pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")
    hide_broken_torchvision()
    return transformers


def experts_interface():
    """transformers' table of experts implementations, or None where it has none (transformers 4.x)."""
    return getattr(pytest.importorskip("transformers.integrations.moe"), "ALL_EXPERTS_FUNCTIONS", None)


def needs_experts_interface():
    """A mark skipping a test (or, as ``pytestmark``, a module) where transformers has no experts interface."""
    return pytest.mark.skipif(experts_interface() is None, reason=NO_INTERFACE)


def llama4(vocab_size: int = 64):
    import transformers

    return transformers.Llama4TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=32,
                                         intermediate_size_mlp=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                         num_experts_per_tok=2, interleave_moe_layer_step=1,
                                         max_position_embeddings=64)


def dbrx(vocab_size: int = 64):
    import transformers

    return transformers.DbrxConfig(vocab_size=vocab_size, d_model=64, n_heads=4, n_layers=1, max_seq_len=64,
                                   attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                   ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))


def jetmoe(vocab_size: int = 64):
    import transformers

    return transformers.JetMoeConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, kv_channels=16,
                                     intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=64)


def switch_transformers(vocab_size: int = 64):
    """A tiny SwitchTransformers: one encoder and one decoder block, each with a sparse MLP of four experts."""
    import transformers

    return transformers.SwitchTransformersConfig(vocab_size=vocab_size, d_model=32, d_kv=16, d_ff=32, num_layers=1,
                                                 num_decoder_layers=1, num_heads=2, num_experts=4,
                                                 encoder_sparse_step=1, decoder_sparse_step=1,
                                                 decoder_start_token_id=0, pad_token_id=0)


def nllb_moe(vocab_size: int = 64):
    """A tiny NLLB-MoE: one encoder and one decoder layer, each with a sparse MLP of four experts (top-2)."""
    import transformers

    return transformers.NllbMoeConfig(vocab_size=vocab_size, d_model=32, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                      decoder_ffn_dim=32, num_experts=4, encoder_sparse_step=1,
                                      decoder_sparse_step=1, max_position_embeddings=64)
