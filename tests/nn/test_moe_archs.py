"""transformers' experts classes whose layout or gate is not the default one, run on experts_implementation="tilegemm":
the eager forward's output and gradients (fp32), and quantize_experts_ against the eager forward over the dequantized
weights (fp16). Covers interleaved gate/up with biases and a clamped gate (gpt-oss), a clamp of the class's own
(DeepSeek-V4), transposed experts without a gate run through a subclass (Ergo), a post-expert norm (Muse Spark) and
an activation that is a function, not a module (LFM2-MoE)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.ops.w4a16.format import dequantize  # noqa: E402

from conftest import hide_broken_torchvision  # noqa: E402

hide_broken_torchvision()

_interface = getattr(pytest.importorskip("transformers.integrations.moe"), "ALL_EXPERTS_FUNCTIONS", None)
pytestmark = pytest.mark.skipif(_interface is None, reason="this transformers has no experts interface "
                                                           "(ALL_EXPERTS_FUNCTIONS, transformers >= 5)")

_SHAPES = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=32, num_experts=8, num_local_experts=8,
               num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
               vocab_size=64)

# (model type, experts class, extra config values): the limits are small so that the clamps bite.
CASES = [
    pytest.param("gpt_oss", "GptOssExperts", dict(swiglu_limit=0.5), id="gpt_oss"),
    pytest.param("deepseek_v4", "DeepseekV4Experts", dict(swiglu_limit=0.5), id="deepseek_v4"),
    pytest.param("ergo", "ErgoExperts", {}, id="ergo"),
    pytest.param("muse_spark", "MuseSparkExperts", {}, id="muse_spark"),
    pytest.param("lfm2_moe", "Lfm2MoeExperts", {}, id="lfm2_moe"),
]


def _experts(model_type: str, class_name: str, extra: dict):
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        cls = getattr(module, class_name)
    except (KeyError, ImportError, AttributeError):
        pytest.skip(f"this transformers has no {class_name}")
    text = getattr(config_class(), "text_config", None)
    if text is not None:  # a composite config: the experts read its text part
        config_class = type(text)
    known = config_class().to_dict()
    cfg = config_class(**{k: v for k, v in {**_SHAPES, **extra}.items() if k in known})
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = cls(cfg).float()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.5)
    return experts


def _routing(experts, T=12, k=2):
    E = experts.num_experts
    H = experts.down_proj.shape[2] if experts.is_transposed else experts.down_proj.shape[1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return x, index, weights


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type, class_name, extra", CASES)
def test_output_and_gradients_match_eager(model_type, class_name, extra):
    eager = _experts(model_type, class_name, extra)
    ours = copy.deepcopy(eager)
    ours.config = copy.deepcopy(eager.config)
    ours.config._experts_implementation = "tilegemm"
    x, index, weights = _routing(eager)
    xe, we = x.clone().requires_grad_(), weights.clone().requires_grad_()
    xo, wo = x.clone().requires_grad_(), weights.clone().requires_grad_()
    ye, yo = eager(xe, index, we), ours(xo, index, wo)
    assert _rel(yo, ye) < 1e-5
    g = torch.randn_like(ye)
    (ye * g).sum().backward()
    (yo * g).sum().backward()
    assert _rel(xo.grad, xe.grad) < 1e-5
    assert _rel(wo.grad, we.grad) < 1e-5
    ref = dict(eager.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, ref[name].grad) < 1e-5, name


@pytest.mark.parametrize("model_type, class_name, extra", CASES)
def test_quantized_experts_match_the_dequantized_weights(model_type, class_name, extra):
    eager = _experts(model_type, class_name, extra).half()
    holder = torch.nn.Module()
    holder.experts = copy.deepcopy(eager)
    assert moe.quantize_experts_(holder, group_size=32) == ["experts"]
    q = holder.experts
    assert q.config._experts_implementation == "tilegemm"
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        w4 = moe._int4(q, name)
        if w4 is not None:
            d = dequantize(w4)
            getattr(eager, name).data.copy_(d.transpose(1, 2) if eager.is_transposed else d)
    x, index, weights = _routing(eager)
    with torch.no_grad():
        a = q(x.half(), index, weights.half()).float()
        b = eager(x.half(), index, weights.half()).float()
    assert _rel(a, b) < 5e-3
