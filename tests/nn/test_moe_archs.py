"""transformers' experts classes whose layout or gate is not the default one, run on experts_implementation="tilegemm":
the eager forward's output and gradients (fp32), and quantize_experts_ against the eager forward over the dequantized
weights (fp16). Covers interleaved gate/up with biases and a clamped gate (gpt-oss), a clamp of the class's own
(DeepSeek-V4), transposed experts without a gate run through a subclass (Ergo), a post-expert norm (Muse Spark) and
an activation that is a function, not a module (LFM2-MoE). Models and inputs go to the ``device`` fixture's device: the
CPU under the interpreter, the GPU otherwise."""

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

@pytest.fixture(autouse=True)
def ieee_fp32():
    """fp32 products in full precision on both sides (the eager reference's and tilegemm's read torch's setting): on
    the GPU, tf32 would leave about 1e-3 between them, past the bounds below."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


# Every name a config gives these sizes under (Muse Spark's experts read moe_hidden_size, DeepSeek-V4's count is
# n_routed_experts): one left at its default builds a full-size layer, minutes under the interpreter.
_SHAPES = dict(hidden_size=64, moe_hidden_size=64, moe_intermediate_size=32, intermediate_size=32, num_experts=4,
               num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=64)

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


def _routing(experts, device, T=12, k=2):
    E = experts.num_experts
    H = experts.down_proj.shape[2] if experts.is_transposed else experts.down_proj.shape[1]
    g = torch.Generator().manual_seed(1)  # drawn on the CPU: the same draw on every device
    x = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return x.to(device), index.to(device), weights.to(device)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type, class_name, extra", CASES)
def test_output_and_gradients_match_eager(model_type, class_name, extra, device):
    eager = _experts(model_type, class_name, extra).to(device)
    ours = copy.deepcopy(eager)
    ours.config = copy.deepcopy(eager.config)
    ours.config._experts_implementation = "tilegemm"
    x, index, weights = _routing(eager, device)
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
def test_quantized_experts_match_the_dequantized_weights(model_type, class_name, extra, device):
    eager = _experts(model_type, class_name, extra).half().to(device)
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
    x, index, weights = _routing(eager, device)
    with torch.no_grad():
        a = q(x.half(), index, weights.half()).float()
        b = eager(x.half(), index, weights.half()).float()
    assert _rel(a, b) < 5e-3


def _narrow_moe(arch: str, width: int, device="cpu"):
    """A tiny Qwen3-MoE or Mixtral causal LM (hidden 64, 4 experts of width ``width``), fp32, eval, on ``device``."""
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)
    config = transformers.MixtralConfig(intermediate_size=width, num_local_experts=4, **common) if arch == "mixtral" \
        else transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=width, num_experts=4,
                                         decoder_sparse_step=1, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval().to(device)


def test_convert_switches_a_model_on_another_experts_implementation_to_tilegemm(device, arch="qwen3_moe"):
    # transformers 5 stores the experts stacked: convert_ (moe=True) runs them on tilegemm as quantize_ does,
    # unless the filter declines a block (the setting is one for the whole model) or they are float64
    import tilegemm.nn

    eager = _narrow_moe(arch, 32, device)
    eager.set_experts_implementation("eager")
    model = tilegemm.nn.convert_(copy.deepcopy(eager))
    assert model.config._experts_implementation == "tilegemm" and model.tilegemm_skipped == []
    ids = torch.tensor([[3, 17, 40, 5, 9, 60]], device=device)
    calls = []
    route = moe.moe_route
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "moe_route", lambda *a, **k: (calls.append(1), route(*a, **k))[1])
        got, want = model(ids).logits, eager(ids).logits
    assert calls and _rel(got, want) < 1e-5
    declined = tilegemm.nn.convert_(copy.deepcopy(eager), filter=lambda n, m: not n.endswith("experts"))
    assert declined.config._experts_implementation == "eager" and declined.tilegemm_skipped == []
    wide = tilegemm.nn.convert_(copy.deepcopy(eager).double(), warn=False)
    assert wide.config._experts_implementation == "eager"
    assert "holds float64 experts" in dict(wide.tilegemm_skipped)["model.layers.0.mlp.experts"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quantize_experts_narrower_than_the_group_size(arch, device):
    # expert width 16 below group_size 32: down_proj (K = 16) is one group over its K, gate_up (K = 64) groups of 32
    import tilegemm.nn
    from tilegemm.ops.w4a16.format import quantize

    model = _narrow_moe(arch, 16, device)
    ref = copy.deepcopy(model)
    tilegemm.nn.quantize_(model, group_size=32, filter=lambda n, m: n.endswith("experts"), warn=False)
    block = model.model.layers[0].mlp.experts
    assert model.tilegemm_skipped == []
    assert "down_proj" not in block._parameters and block.tilegemm_group_sizes == {"gate_up_proj": 32,
                                                                                    "down_proj": -1}
    assert moe._int4(block, "down_proj").group_size == -1 and block.tilegemm_down_proj_scales.shape[1] == 1
    assert model.config.quantization_config["group_size"] == [-1, 32]
    experts = ref.model.layers[0].mlp.experts  # the reference: the weights quantized by hand, each its group size
    with torch.no_grad():
        experts.gate_up_proj.copy_(dequantize(quantize(experts.gate_up_proj.half(), 32)))
        experts.down_proj.copy_(dequantize(quantize(experts.down_proj.half(), -1)))
    ids = torch.tensor([[3, 17, 40, 5, 9, 60]], device=device)
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert _rel(got, want) < 3e-3  # fp16 activations through the 4-bit experts against fp32


def test_quantize_again_keeps_4_bit_experts_and_names_them():
    import tilegemm.nn

    model = _narrow_moe("qwen3_moe", 32)
    tilegemm.nn.quantize_(model, group_size=32, filter=lambda n, m: n.endswith("experts"), warn=False)
    block = model.model.layers[0].mlp.experts
    before = block.tilegemm_down_proj_qweight.clone()
    tilegemm.nn.quantize_(model, group_size=-1, filter=lambda n, m: n.endswith("experts"), warn=False)
    assert dict(model.tilegemm_skipped) == {
        "model.layers.0.mlp.experts": moe.ALREADY_4BIT.format(" (gate_up_proj, down_proj)")}
    assert torch.equal(block.tilegemm_down_proj_qweight, before)


def test_quantize_keeps_experts_whose_width_the_group_size_does_not_divide_with_a_reason():
    import warnings

    import tilegemm.nn
    from tilegemm.nn.convert import ConversionNote

    model = _narrow_moe("qwen3_moe", 48)  # down's K = 48: above 32, not a multiple of it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tilegemm.nn.quantize_(model, group_size=32, filter=lambda n, m: n.endswith("experts"))
    block = model.model.layers[0].mlp.experts
    assert "down_proj" in block._parameters and not hasattr(block, "tilegemm_group_size")
    assert model.tilegemm_skipped == [("model.layers.0.mlp.experts", "down_proj's K = 48 is not a multiple of "
                                                                     "group_size = 32: its experts stay 16-bit")]
    assert any(issubclass(w.category, ConversionNote) and "model.layers.0.mlp.experts" in str(w.message)
               for w in caught)


# The absorption reads the layout only (its probe checks the forward): interleaved gate/up with biases, transposed
# (gpt-oss), transposed without a gate (Ergo), and the default layout that DeepSeek-V4, Muse Spark and LFM2-MoE share
# with Qwen3-MoE (their gates and norms act per feature, so a reordering of the features passes their probe alike).
ACT_ORDER_CASES = [p for p in CASES if p.id in ("gpt_oss", "ergo")] + [
    pytest.param("qwen3_moe", "Qwen3MoeExperts", {}, id="qwen3_moe")]


@pytest.mark.parametrize("model_type, class_name, extra", ACT_ORDER_CASES)
def test_act_order_down_experts_absorbed(model_type, class_name, extra, device):
    # tilegemm.nn.absorb_act_order_: each expert's down input order moved into its rows of the up side (gate and up
    # halves, or interleaved; biases too); the block's output as before (to rounding: the interpreter's BLAS sums a
    # column by its place in a block), and no order left on down
    from tilegemm.nn.act_order import absorb_act_order_
    from tilegemm.ops.w4a16.format import Int4Weight

    holder = torch.nn.Module()
    holder.experts = _experts(model_type, class_name, extra).half().to(device)
    x, index, weights = _routing(holder.experts, device)
    assert moe.quantize_experts_(holder, group_size=32) == ["experts"]
    q = holder.experts
    down = moe._int4(q, "down_proj")
    g = torch.Generator().manual_seed(2)
    perms = torch.stack([torch.randperm(down.shape[2], generator=g) for _ in range(down.shape[0])]).to(device)
    moe.install_int4_experts_(q, {"down_proj": Int4Weight(down.qweight, down.scales, down.zeros, down.group_size,
                                                          down.shape, perms)})
    ref = copy.deepcopy(holder)
    absorb_act_order_(holder)
    assert holder.tilegemm_act_order_absorbed == ["experts"] and moe._int4(q, "down_proj").perm is None
    with torch.no_grad():
        a, b = q(x.half(), index, weights.half()), ref.experts(x.half(), index, weights.half())
    assert torch.equal(a.isnan(), b.isnan()) and _rel(a.nan_to_num().float(), b.nan_to_num().float()) < 1e-3


def test_experts_quantized_and_run_under_inference_mode(device):
    # a model built and quantized inside torch.inference_mode holds inference tensors, which track no version: the
    # experts' 4-bit weight is not kept between calls then (it was keyed on the versions and raised)
    torch.manual_seed(0)
    ref = _narrow_moe("qwen3_moe", 32, device).half()
    import tilegemm.nn

    state = {k: v.clone() for k, v in ref.state_dict().items()}
    tilegemm.nn.quantize_(ref, group_size=32)
    ids = torch.randint(0, 64, (1, 5), device=device)
    with torch.inference_mode():
        model = _narrow_moe("qwen3_moe", 32, device).half()
        model.load_state_dict(state)
        tilegemm.nn.quantize_(model, group_size=32)
        out = model(ids).logits
    with torch.no_grad():
        assert torch.equal(out, ref(ids).logits)
