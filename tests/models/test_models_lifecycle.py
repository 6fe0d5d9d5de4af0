"""A quantized transformers model through its life: dtype conversions of 4-bit experts, dequantized copies,
tied output layers, save_pretrained, and loading a checkpoint into a model quantized already; checked against
plain-torch models holding the weights (the tests' own writer, ckpt_writer.py)."""

from __future__ import annotations

import copy
import io
import os
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

from conftest import hide_broken_torchvision  # noqa: E402

hide_broken_torchvision()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402

from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.models.pretrained import dequantized_copy  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_, quantize_  # noqa: E402

IDS = torch.tensor([[3, 17, 200, 5, 96]])
TOL = 3e-3  # fp16 activations through the 4-bit layers against a model computing in fp32
_interface = getattr(pytest.importorskip("transformers.integrations.moe"), "ALL_EXPERTS_FUNCTIONS", None)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


# --- 4-bit experts under .float() / .half() -----------------------------------------------------------------


@pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface (transformers >= 5)")
def test_moe_experts_scales_stay_16_bit_under_float():
    config = cw.tiny_moe_config("qwen3_moe", hidden=64, layers=1, width=32)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm")
    model = model.eval().to(torch.bfloat16)
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    experts = model.model.layers[0].mlp.experts
    assert experts.tilegemm_gate_up_proj_scales.dtype == torch.bfloat16
    dense = dequantized_copy(model)  # what the 4-bit model computes, as plain torch
    dense.set_experts_implementation("eager")
    reference = _logits(dense.float())

    twin = copy.deepcopy(model)  # the guard follows the copy, not the original
    model.float()
    scale_dtypes = {n: b.dtype for n, b in experts.named_buffers() if n.endswith(("_scales", "_zeros"))}
    assert set(scale_dtypes.values()) == {torch.bfloat16}, scale_dtypes
    assert model.model.embed_tokens.weight.dtype == torch.float32
    out = _logits(model)
    assert out.dtype == torch.float32 and _rel(out, reference) < 2e-2  # (activations rounded to bf16)
    assert twin.model.layers[0].mlp.experts.tilegemm_gate_up_proj_scales.dtype == torch.bfloat16
    twin.half()  # 16-bit conversions do convert them
    assert twin.model.layers[0].mlp.experts.tilegemm_down_proj_scales.dtype == torch.float16
    assert _rel(_logits(twin), reference) < 2e-2  # (bf16 scales rounded to fp16)
    buf = io.BytesIO()  # the whole model pickles with its guard
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    again.half().float()
    assert again.model.layers[0].mlp.experts.tilegemm_gate_up_proj_scales.dtype == torch.float16
    assert _rel(_logits(again), reference) < 2e-2


# --- dequantized_copy ---------------------------------------------------------------------------------------


def test_dequantized_copy_of_an_fp32_model_is_fp32():
    model = cw.random_model(cw.tiny_config("llama", hidden=64, layers=1))  # fp32, as from_config builds it
    _quiet(quantize_, model, group_size=32, filter=lambda n, m: "lm_head" not in n)
    dense = dequantized_copy(model)
    assert {p.dtype for p in dense.parameters()} == {torch.float32}
    q = model.model.layers[0].self_attn.q_proj
    assert torch.equal(dense.model.layers[0].self_attn.q_proj.weight, q.dequantize().float())
    assert _rel(_logits(model), _logits(dense)) < TOL  # the 4-bit model rounds its activations to fp16
    assert dense.config is not model.config  # settings changed on the copy stay there
    dense.config.use_cache = not model.config.use_cache
    assert dense.config.use_cache != model.config.use_cache
