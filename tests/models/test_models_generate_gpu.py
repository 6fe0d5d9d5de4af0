"""What a user runs after loading: ``model.generate`` with a static cache, which transformers compiles on its own
(``torch.compile``, CUDA graphs through ``reduce-overhead``) on a CUDA model. A 4-bit checkpoint from the tests'
writer (dense Llama with act-order and zero points; Qwen3-MoE with 4-bit experts) loaded by ``from_pretrained``;
every generated step's logits checked against a plain-torch model holding the dequantized weights, fed the
generated sequence (teacher forcing: a near-tie that flips a token does not fail the check)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402


def _generate_and_check(path, config, reference, device, new_tokens: int = 8, bound: float = 2e-2):
    from tilegemm.models import from_pretrained

    model = from_pretrained(path, dtype=torch.float16, device=device)
    ref = cw.reference_model(config, reference, dtype=torch.float16).to(device)
    prompt = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        seq = out.sequences
        assert seq.shape == (2, 12 + new_tokens)
        expected = ref(seq).logits[:, 11:-1].float()
    got = torch.stack(out.logits, dim=1).float()
    assert torch.isfinite(got).all()
    err = float((got - expected).norm() / expected.norm())
    assert err < bound, err
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("arch, kw", [
    ("llama", dict(method="gptq", act_order=True, sym=False, group_size=32)),
    ("qwen2", dict(method="awq", group_size=64)),
    ("qwen3_moe", dict(method="gptq", group_size=32, sym=True)),
], ids=["llama-gptq-actorder", "qwen2-awq", "qwen3moe-gptq"])
def test_generate_with_a_static_cache(tmp_path, arch, kw):
    config = cw.tiny_moe_config(arch) if arch == "qwen3_moe" else cw.tiny_config(arch)
    model = cw.random_model(config)
    reference = cw.write_model(tmp_path / "ckpt", model, **kw)
    _generate_and_check(tmp_path / "ckpt", config, reference, "cuda")
