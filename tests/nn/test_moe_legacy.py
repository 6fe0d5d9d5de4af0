"""transformers 4.x's sparse MoE blocks (experts a ModuleList of MLPs, no experts interface) converted by
``tilegemm.nn.convert_`` / ``quantize_`` into ``tilegemm.nn.moe.SparseMoeBlock``: the same outputs, router logits and
gradients as the block they replace, 4-bit experts, and the blocks that cannot be taken kept with a reason.

The blocks here follow transformers 4.x's (softmax over the router's logits in fp32, the top k, renormalised unless
``norm_topk_prob`` is False, every expert's rows added back; Qwen2-MoE's sigmoid-gated shared expert); against
transformers 4.57's own Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE classes the last test runs where that version is
installed. Models and inputs go to the ``device`` fixture's device: the CPU under the interpreter, the GPU otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tilegemm
import tilegemm.nn
from tilegemm.nn.convert import ConversionNote
from tilegemm.nn.moe import SparseMoeBlock


@pytest.fixture(autouse=True)
def ieee_fp32():
    """fp32 products in full precision on both sides (torch's and tilegemm's read torch's setting): on the GPU, tf32
    would leave about 1e-3 between the blocks, past the 1e-5 the fp32 tests allow."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


class MLP(nn.Module):
    def __init__(self, H, I, names=("gate_proj", "up_proj", "down_proj"), bias=False):
        super().__init__()
        self.names = names
        g, u, d = names
        setattr(self, g, nn.Linear(H, I, bias=bias))
        setattr(self, u, nn.Linear(H, I, bias=bias))
        setattr(self, d, nn.Linear(I, H, bias=bias))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        g, u, d = self.names
        return getattr(self, d)(self.act_fn(getattr(self, g)(x)) * getattr(self, u)(x))


class Block(nn.Module):
    """A 4.x-style sparse MoE block, its forward the per-expert loop."""

    def __init__(self, H=32, I=64, E=8, k=2, norm=True, shared=False, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, k, norm
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP(H, I, names) for _ in range(E)])
        if shared:
            self.shared_expert = MLP(H, 96)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, h):
        B, S, H = h.shape
        x = h.view(-1, H)
        logits = self.gate(x)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, chosen = torch.topk(w, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(chosen == e)
            if len(tok):
                out.index_add_(0, tok, (self.experts[e](x[tok]) * w[tok, slot, None]).to(x.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(B, S, H), logits


class Model(nn.Module):
    def __init__(self, layers=2, **kw):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList([Block(**kw) for _ in range(layers)])

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)[0]
        return h


# Each case a way the blocks differ, two at a time where they are independent (routing, shared expert, names)
@pytest.mark.parametrize("kw", [dict(E=4), dict(E=4, norm=False, shared=True),
                                dict(k=1, E=4, names=("w1", "w3", "w2")), dict(k=4, E=4)],
                         ids=["qwen3", "no-norm-shared", "mixtral-top1", "all-experts"])
def test_converted_block_gives_the_blocks_outputs_and_gradients(kw, device):
    # one layer of experts 32 wide (the interpreter runs each grouped product for about a second): the input's
    # Linear, whose gradient is checked, takes the block's gradient of its input, as a layer before it would
    torch.manual_seed(0)
    ref = Model(layers=1, I=32, **kw).to(device)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref), linear=False)
    assert all(isinstance(layer, SparseMoeBlock) for layer in ours.layers)
    seen = []
    ours.layers[0].register_forward_hook(lambda m, args, out: seen.append(out))
    x = torch.randn(3, 5, 16, device=device)
    want, got = ref(x), ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (out, logits), = seen  # the block's tuple: outputs and router logits
    assert out.shape == (3, 5, 32) and logits.shape == (15, ref.layers[0].num_experts)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(ours.inp.weight.grad, ref.inp.weight.grad, rtol=1e-4, atol=1e-5)
    g, u, d = ref.layers[0].experts[0].names
    e3 = ref.layers[0].experts[3]
    block = ours.layers[0]
    I = block.down_proj.shape[2]
    torch.testing.assert_close(block.gate_up_proj.grad[3, :I], getattr(e3, g).weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(block.gate_up_proj.grad[3, I:], getattr(e3, u).weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(block.down_proj.grad[3], getattr(e3, d).weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(block.gate.weight.grad, ref.layers[0].gate.weight.grad, rtol=1e-4, atol=1e-5)


def test_converted_block_keeps_the_blocks_eval_mode_and_hooks(device):
    # the stand-in was made in training mode (Mixtral's router jitter is applied then: random outputs from a model
    # in eval mode) and without the block's hooks
    torch.manual_seed(0)
    ref = Model(E=4).eval().to(device)
    for layer in ref.layers:
        layer.jitter_noise = 0.5
    ref.layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 2,))  # one that changes what the block gets
    ref.layers[1].gate.train()  # a submodule in another mode than its block keeps its own
    ours = copy.deepcopy(ref)
    seen = []
    handle = ours.layers[0].register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    tilegemm.nn.convert_(ours, linear=False)
    assert [type(layer) for layer in ours.layers] == [SparseMoeBlock] * 2
    assert {n: m.training for n, m in ours.named_modules() if m.training} == {"layers.1.gate": True}
    x = torch.randn(2, 3, 16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    assert seen == ["SparseMoeBlock"]
    handle.remove()  # the handle held removes it from the stand-in (the same dict)
    ours(x)
    assert seen == ["SparseMoeBlock"]


def test_quantize_makes_the_stacked_experts_4_bit_and_keeps_the_router(device):
    torch.manual_seed(0)
    ref = Model(layers=1, E=4, shared=True).half().to(device)
    q = tilegemm.nn.quantize_(copy.deepcopy(ref), group_size=32)
    block = q.layers[0]
    assert isinstance(block, SparseMoeBlock) and block.tilegemm_down_proj_qweight.dtype == torch.int32
    assert not hasattr(block, "down_proj") and not hasattr(block, "gate_up_proj")  # the 16-bit experts dropped
    assert type(block.gate) is nn.Linear  # the router stays 16-bit
    assert isinstance(block.shared_expert.gate_proj, tilegemm.nn.Int4Linear)
    # the reference: the same model holding the 4-bit weights dequantized (experts stacked back per expert)
    deq = tilegemm.nn.convert_(copy.deepcopy(ref), linear=False)
    with torch.no_grad():
        for a, b in zip(deq.layers, q.layers):
            for name in ("gate_up_proj", "down_proj"):
                getattr(a, name).copy_(tilegemm.w4a16.dequantize(tilegemm.nn.moe._int4(b, name)))
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(a.shared_expert, name).weight.copy_(getattr(b.shared_expert, name).dequantize())
    x = torch.randn(2, 4, 16, device=device).half()
    with torch.no_grad():
        want, got = deq(x).float(), q(x).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_blocks_that_cannot_be_taken_are_kept_with_the_reason():
    torch.manual_seed(0)
    m = Model()
    m.layers[1].experts[2].down_proj = nn.Linear(64, 32, bias=True)  # a bias on one expert
    with pytest.warns(ConversionNote, match="layers.1: experts' Linears with biases"):
        tilegemm.nn.convert_(m, linear=False)
    assert isinstance(m.layers[0], SparseMoeBlock) and isinstance(m.layers[1], Block)
    m2 = Model()
    m2.layers[0].experts[1].up_proj = nn.Linear(32, 48, bias=False)
    tilegemm.nn.convert_(m2, linear=False, warn=False)
    assert ("layers.0", "experts of several sizes") in m2.tilegemm_skipped
    # a filter keeps a block; the model itself is never swapped
    m3 = Model()
    tilegemm.nn.convert_(m3, linear=False, filter=lambda name, mod: name != "layers.1")
    assert isinstance(m3.layers[0], SparseMoeBlock) and isinstance(m3.layers[1], Block)
    block = Block()
    tilegemm.nn.convert_(block, linear=False)
    assert isinstance(block, Block) and isinstance(block.experts, nn.ModuleList)
    # moe=False leaves them
    m4 = tilegemm.nn.convert_(Model(), linear=False, moe=False)
    assert isinstance(m4.layers[0], Block)


@pytest.mark.parametrize("cls_name", ["PhimoeSparseMoeBlock", "Ernie4_5_MoeSparseMoeBlock"])
def test_4x_blocks_that_route_otherwise_are_kept(cls_name):
    # transformers 4.x's PhiMoE (sparsemixer) and Ernie 4.5 (a correction bias, shared_experts) blocks have the
    # Mixtral shape (gate, top_k, experts of w1/w3/w2 or gate/up/down) but not its routing: a SparseMoeBlock would
    # change their outputs without a word
    other = type(cls_name, (Block,), {})
    m = Model(layers=1, E=4)
    m.layers[0].__class__ = other
    tilegemm.nn.convert_(m, linear=False, warn=False)
    assert type(m.layers[0]) is other
    assert "stays as it is" in dict(m.tilegemm_skipped)["layers.0"]


def _transformers_4():
    try:
        import transformers
    except ImportError:
        return None
    return transformers if int(transformers.__version__.split(".")[0]) < 5 else None


@pytest.mark.skipif(_transformers_4() is None, reason="transformers 4.x's own MoE classes (this suite installs 5.x; "
                                                      "the blocks above follow them)")
@pytest.mark.parametrize("arch", ["Mixtral", "Qwen3Moe", "Qwen2Moe", "Olmoe"])
def test_transformers_4_models(arch, device):
    transformers = _transformers_4()
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64)
    extra = {"Mixtral": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
             "Qwen3Moe": dict(intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              decoder_sparse_step=1, head_dim=8),
             "Qwen2Moe": dict(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                              num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1),
             "Olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)}[arch]
    cfg = getattr(transformers, f"{arch}Config")(**base, **extra)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(device)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref), warn=False)
    assert sum(isinstance(m, SparseMoeBlock) for m in ours.modules()) == 2
    ids = torch.randint(0, 64, (2, 5), device=device)
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def _int4_experts_block(act_order: bool = False, shared_order: bool = True):
    """A 4.x-style block whose experts' Linears are Int4Linears (as tilegemm.models.from_pretrained loads a 4.x
    checkpoint of per-expert quantized Linears), fp16."""
    from tilegemm.nn import Int4Linear
    from tilegemm.ops.w4a16 import Int4Weight

    torch.manual_seed(0)
    block = Block(H=64, I=64, E=4).half()
    for e in block.experts:
        order = torch.randperm(64) if act_order else None
        for m in e.names:
            w = Int4Linear.from_linear(getattr(e, m), group_size=32).weight
            perm = (order if shared_order or m != "up_proj" else torch.randperm(64)) if act_order else None
            w = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, perm)
            setattr(e, m, Int4Linear.from_weight(w))
    return block.eval()


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_expert_linears_stack_into_4_bit_experts(act_order, device):
    from tilegemm.nn.moe import _int4, convert_moe_blocks_
    from tilegemm.ops.w4a16 import dequantize

    block = _int4_experts_block(act_order).to(device)
    model = nn.Module()
    model.moe = block
    x = torch.randn(1, 6, 64, dtype=torch.float16, device=device)
    with torch.no_grad():
        want, want_logits = block(x)
    done, kept = convert_moe_blocks_(model)
    assert done == ["moe"] and not kept
    new = model.moe
    assert isinstance(new, SparseMoeBlock) and "gate_up_proj" not in new._parameters
    w = _int4(new, "gate_up_proj")
    assert w.shape == (4, 128, 64) and (w.perm is not None) == act_order
    for e, mlp in enumerate(block.experts):  # gate rows, then up rows, exactly the experts' own weights
        assert torch.equal(dequantize(w)[e], torch.cat([mlp.gate_proj.dequantize(), mlp.up_proj.dequantize()]))
    with torch.no_grad():
        got, logits = new(x)
    assert torch.equal(logits, want_logits)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 3e-3


def test_quantize_experts_alone_says_int4_expert_linears_are_left_as_they_are():
    # a 4.x-style block whose experts are 4-bit already (a 4.x checkpoint of per-expert quantized Linears): the note
    # said it was kept 16-bit and pointed to quantize_; convert_ stacks them, 4-bit as they are
    model = nn.Module()
    model.moe = _int4_experts_block()
    with pytest.warns(ConversionNote) as got:
        assert tilegemm.nn.quantize_experts_(model, group_size=32) == []
    message = str(got[0].message)
    assert message.startswith("quantize_experts_ left 1 MoE block(s) as they are, whose experts are 4-bit already")
    assert "moe (Block)" in message and "16-bit" not in message and "quantize_ converts" not in message
    assert message.endswith("tilegemm.nn.convert_ puts moe on the grouped kernels, 4-bit as they are")


def test_int4_expert_linears_of_two_group_sizes_stack(device):
    # expert width 16 below group_size 32: down (K = 16) loads as one group (-1), gate/up (K = 64) in groups of 32
    from tilegemm.nn import Int4Linear
    from tilegemm.nn.moe import _int4, convert_moe_blocks_

    torch.manual_seed(0)
    block = Block(H=64, I=16, E=4).half()
    for e in block.experts:
        for m in e.names:
            setattr(e, m, Int4Linear.from_linear(getattr(e, m), group_size=32 if m != "down_proj" else -1))
    block = block.eval().to(device)
    model = nn.Module()
    model.moe = block
    x = torch.randn(1, 6, 64, dtype=torch.float16, device=device)
    with torch.no_grad():
        want, _ = block(x)
    done, kept = convert_moe_blocks_(model)
    assert done == ["moe"] and not kept
    assert model.moe.tilegemm_group_sizes == {"gate_up_proj": 32, "down_proj": -1}
    assert _int4(model.moe, "down_proj").group_size == -1
    with torch.no_grad():
        got, _ = model.moe(x)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 3e-3


def test_int4_experts_whose_gate_and_up_group_sizes_differ_kept_with_a_reason():
    from tilegemm.nn import Int4Linear
    from tilegemm.nn.moe import convert_moe_blocks_

    block = Block(H=64, I=64, E=2).half()
    for e in block.experts:
        for m in e.names:
            setattr(e, m, Int4Linear.from_linear(getattr(e, m), group_size=64 if m == "up_proj" else 32))
    model = nn.Module()
    model.moe = block
    done, kept = convert_moe_blocks_(model)
    assert not done and kept == [("moe", "4-bit experts of several group sizes (each projection needs one, and gate "
                                         "and up the same)")]


def test_int4_experts_in_two_orders_kept_with_a_reason():
    from tilegemm.nn.moe import convert_moe_blocks_

    model = nn.Module()
    model.moe = _int4_experts_block(act_order=True, shared_order=False)
    done, kept = convert_moe_blocks_(model)
    assert not done and kept == [("moe", "act-order experts whose gate and up read their inputs in two orders")]


@pytest.mark.skipif(_transformers_4() is None, reason="transformers 4.x's own MoE classes (this suite installs 5.x, "
                                                      "whose checkpoint path tests/models/test_models_moe_checkpoint.py "
                                                      "checks)")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_transformers_4_checkpoint_experts_stacked(arch, tmp_path, device):
    """A GPTQ checkpoint of per-expert Linears loaded under transformers 4.x: its experts load as Int4Linears and
    each block is then stacked into a SparseMoeBlock of 4-bit experts; the logits are the writer's model's."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
    import ckpt_writer as cw
    from tilegemm.models import from_pretrained

    config = cw.tiny_moe_config(arch, layers=2)
    reference = cw.write_model(tmp_path / "c", cw.random_model(config), "gptq", 32, sym=True, not_convert=("gate",))
    model = from_pretrained(tmp_path / "c", device=device)
    assert sum(isinstance(m, SparseMoeBlock) for m in model.modules()) == 2
    ids = torch.tensor([[3, 17, 200, 5, 96]])
    with torch.no_grad():
        got = model(input_ids=ids.to(device)).logits.float().cpu()
        want = cw.reference_model(config, reference)(input_ids=ids).logits.float()  # (plain torch: on the CPU)
    assert ((got - want).norm() / want.norm()).item() < 3e-3


def test_float64_experts_are_refused_naming_the_experts():
    # after model.double() the grouped kernels' own dtype error named grouped_mm, not the experts
    model = Model(E=4)
    tilegemm.nn.convert_(model, linear=False)
    model.double()
    with pytest.raises(TypeError, match=r"tilegemm experts \(SparseMoeBlock\): the experts' weights are "
                                        r"torch.float64.*cast the model"):
        model(torch.randn(1, 3, 16, dtype=torch.float64))
