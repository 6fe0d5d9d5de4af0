"""``experts_implementation="tilegemm"`` on models whose MoE blocks transformers runs with code of their own (Llama-4,
DBRX, JetMoE; SwitchTransformers and NLLB-MoE, whose experts are a ModuleDict of per-expert MLPs): transformers takes
the name and never calls the implementation, so tilegemm names those blocks, and what ``tilegemm.nn.convert_`` does
with them, where it builds or loads the model (``tilegemm.models.from_pretrained(..., experts_implementation=...)``,
``load_quantized_``)."""

from __future__ import annotations

import os
import re
import warnings
import sys

import pytest
import torch

import moe_kit
from moe_kit import jetmoe, llama4, needs_experts_interface, nllb_moe, switch_transformers, transformers_or_skip

transformers = transformers_or_skip()
pytestmark = needs_experts_interface()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

import tilegemm.nn  # noqa: E402
import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.nn import load_quantized_  # noqa: E402
from tilegemm.nn.convert import ConversionNote  # noqa: E402

NOTE = r"experts_implementation='tilegemm' does not reach 1 MoE block"


def dbrx():
    return moe_kit.dbrx(vocab_size=256)


BLOCKS = [  # (config, its class in transformers, the block named, its class)
    pytest.param(llama4, "Llama4TextConfig", "model.layers.0.feed_forward", "Llama4TextMoe", id="llama4"),
    pytest.param(dbrx, "DbrxConfig", "transformer.blocks.0.ffn.experts", "DbrxExperts", id="dbrx"),
    pytest.param(jetmoe, "JetMoeConfig", "model.layers.0.mlp", "JetMoeMoE", id="jetmoe"),
]


@pytest.mark.parametrize("make,config_class,block,cls", BLOCKS)
def test_blocks_the_interface_does_not_reach_are_named(make, config_class, block, cls):
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    model = transformers.AutoModelForCausalLM.from_config(make(), experts_implementation="tilegemm")
    assert model.config._experts_implementation == "tilegemm"  # transformers took the name ...
    assert _blocks(moe.experts_off_interface(model)) == [(block, f"{cls}, whose experts run in a forward of its "
                                                                 f"own: tilegemm.nn.convert_ replaces it")]
    note = moe.experts_off_interface_note(model)  # ... which these blocks never call
    assert re.match(rf"{NOTE[:-len('1 MoE block')]}\d MoE block\(s\) of {type(model).__name__}", note)
    assert f"{block} ({cls}" in note
    assert "tilegemm.nn.convert_(model)" in note
    tilegemm.nn.convert_(model, conv=False, linear=False)
    assert _blocks(moe.experts_off_interface(model)) == []
    # a model that asks for another implementation is told nothing
    other = transformers.AutoModelForCausalLM.from_config(make(), experts_implementation="eager")
    assert moe.experts_off_interface(other) and moe.experts_off_interface_note(other) is None


@pytest.mark.parametrize("make,config_class,block,cls", BLOCKS)
def test_quantize_experts_alone_names_the_blocks_it_cannot_take(make, config_class, block, cls):
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    model = transformers.AutoModelForCausalLM.from_config(make())
    with pytest.warns(ConversionNote, match=r"quantize_experts_ kept \d MoE block\(s\) 16-bit") as got:
        assert tilegemm.nn.quantize_experts_(model, group_size=32) == []
    assert f"{block} ({cls}" in str(got[0].message) and "tilegemm.nn.quantize_" in str(got[0].message)
    # through quantize_, which converts the block first, quantize_experts_ takes it and says nothing of its own
    model = transformers.AutoModelForCausalLM.from_config(make())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tilegemm.nn.quantize_(model, group_size=32)
    assert not any("quantize_experts_ kept" in str(w.message) and "JetMoeMoE" in str(w.message) for w in seen)
    assert _blocks(moe.experts_off_interface(model)) == []


def _blocks(off):
    """experts_off_interface's entries but JetMoE's attention experts (named, and kept, on their own: below)."""
    return [(n, why) for n, why in off if not why.startswith("JetMoeMoA")]


def test_jetmoes_attention_experts_are_named_and_kept():
    # JetMoE's mixture of attention heads holds 3-D experts (its heads' query and output projections) that its own
    # forward runs: convert_ and quantize_ leave them 16-bit, and said nothing of it
    if not hasattr(transformers, "JetMoeConfig"):
        pytest.skip("this transformers has no JetMoeConfig")
    model = transformers.AutoModelForCausalLM.from_config(jetmoe(), experts_implementation="tilegemm").half()
    attention = "model.layers.0.self_attention.experts"
    assert any(n == attention and why.startswith("JetMoeMoA") for n, why in moe.experts_off_interface(model))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tilegemm.nn.quantize_(model, group_size=32)
    assert any(issubclass(w.category, ConversionNote) and attention in str(w.message) for w in seen)
    assert model.get_submodule(attention).input_linear.weight.dtype == torch.float16  # kept as it was
    assert [n for n, _ in moe.experts_off_interface(model)] == [attention]


def test_models_on_the_interface_are_not_named():
    model = transformers.AutoModelForCausalLM.from_config(cw.tiny_moe_config(layers=1),
                                                          experts_implementation="tilegemm")
    assert moe.experts_off_interface(model) == [] and moe.experts_off_interface_note(model) is None


PER_EXPERT = [  # (config, its class in transformers, the blocks named, their class, each expert's Linears)
    pytest.param(switch_transformers, "SwitchTransformersConfig",
                 ["encoder.block.0.layer.1.mlp", "decoder.block.0.layer.2.mlp"], "SwitchTransformersSparseMLP",
                 ("wi", "wo"), id="switch_transformers"),
    pytest.param(nllb_moe, "NllbMoeConfig", ["model.encoder.layers.0.ffn", "model.decoder.layers.0.ffn"],
                 "NllbMoeSparseMLP", ("fc1", "fc2"), id="nllb_moe"),
]


def _seq2seq(make, config_class, implementation):
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(make(), experts_implementation=implementation).eval()


@pytest.mark.parametrize("make,config_class,blocks,cls,linears", PER_EXPERT)
def test_blocks_with_a_module_dict_of_experts_are_named_and_convert_is_not_promised(make, config_class, blocks, cls,
                                                                                     linears):
    model = _seq2seq(make, config_class, "tilegemm")
    assert model.config._experts_implementation == "tilegemm"  # taken, and never called by these blocks
    assert all(isinstance(model.get_submodule(b).experts, torch.nn.ModuleDict) for b in blocks)
    off = moe.experts_off_interface(model)
    assert [n for n, _ in off] == blocks  # the blocks, not their experts nor the experts' Linears
    for _, why in off:
        assert why.startswith(f"{cls}, its experts an nn.ModuleDict of 4 per-expert MLPs run one by one")
        assert "tilegemm.nn.convert_ keeps it" in why and "no grouped product" in why
    note = moe.experts_off_interface_note(model)
    assert note.startswith(f"experts_implementation='tilegemm' does not reach 2 MoE block(s) of {type(model).__name__}")
    assert all(f"{b} ({cls}" in note for b in blocks)
    # nothing here is replaced: the note must not promise the grouped kernels
    assert "puts those it replaces on the grouped kernels" not in note and "replaces none of them" in note
    other = _seq2seq(make, config_class, "eager")  # a model that asks for another implementation is told nothing
    assert moe.experts_off_interface(other) == off and moe.experts_off_interface_note(other) is None


@pytest.mark.parametrize("make,config_class,blocks,cls,linears", PER_EXPERT)
def test_convert_does_what_the_note_says_with_a_module_dict_of_experts(make, config_class, blocks, cls, linears,
                                                                      device):
    model = _seq2seq(make, config_class, "tilegemm").to(device)
    ids = torch.tensor([[3, 17, 40, 5]], device=device)
    with torch.no_grad():
        want = model(input_ids=ids, decoder_input_ids=ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionNote)  # nothing kept in silence, nothing kept with a note either
        tilegemm.nn.convert_(model, conv=False)
    for b in blocks:  # the block kept, each expert's Linears dense tilegemm Linears
        block = model.get_submodule(b)
        assert type(block).__name__ == cls
        experts = [m for m in block.experts.values() if hasattr(m, linears[0])]
        assert len(experts) == 4
        assert all(type(getattr(e, n)) is tilegemm.nn.Linear for e in experts for n in linears)
    assert not any(isinstance(m, moe.StackedExperts) for m in model.modules())  # no grouped product
    assert [n for n, _ in moe.experts_off_interface(model)] == blocks  # still off the interface, still named
    with torch.no_grad():
        got = model(input_ids=ids, decoder_input_ids=ids).logits
    assert (got - want).norm() <= 1e-4 * want.norm()  # the same model, one Linear at a time


@pytest.mark.parametrize("make,config_class,blocks,cls,linears", PER_EXPERT)
def test_quantize_experts_alone_names_a_module_dict_of_experts(make, config_class, blocks, cls, linears):
    model = _seq2seq(make, config_class, "eager")
    with pytest.warns(ConversionNote, match=r"quantize_experts_ kept 2 MoE block\(s\) 16-bit") as got:
        assert tilegemm.nn.quantize_experts_(model, group_size=32) == []
    assert all(f"{b} ({cls}" in str(got[0].message) for b in blocks)


@pytest.mark.parametrize("make,config_class,blocks,cls,linears", PER_EXPERT)
def test_quantize_experts_alone_says_4_bit_experts_are_left_as_they_are(make, config_class, blocks, cls, linears):
    # experts 4-bit already (quantize_ made them; a quantized checkpoint loads them so): the note said "kept 2 MoE
    # block(s) 16-bit" and pointed to quantize_
    model = _seq2seq(make, config_class, "eager")
    tilegemm.nn.quantize_(model, group_size=32, warn=False)
    with pytest.warns(ConversionNote, match=r"quantize_experts_ left 2 MoE block\(s\) as they are, whose experts are "
                                            r"4-bit already") as got:
        assert tilegemm.nn.quantize_experts_(model, group_size=32) == []
    message = str(got[0].message)
    assert "16-bit" not in message and "tilegemm.nn.quantize_" not in message and "convert_" not in message
    assert all(f"{b} ({cls})" in message for b in blocks)
    # one expert Linear 16-bit again: that block is kept 16-bit in part, and says how many are 4-bit
    expert = next(m for m in model.get_submodule(blocks[0]).experts.values() if hasattr(m, linears[0]))
    setattr(expert, linears[0], torch.nn.Linear(*reversed(getattr(expert, linears[0]).weight.shape)))
    with pytest.warns(ConversionNote) as got:
        tilegemm.nn.quantize_experts_(model, group_size=32)
    message = str(got[0].message)
    assert message.startswith("quantize_experts_ kept 1 MoE block(s) 16-bit") and \
        "7 of its 8 expert weights are 4-bit already" in message
    assert "left 1 MoE block(s) as they are, whose experts are 4-bit already" in message and \
        f"{blocks[1]} ({cls})" in message


@pytest.mark.parametrize("make,config_class,blocks,cls,linears", PER_EXPERT)
def test_quantize_takes_each_expert_linear_and_keeps_the_router_16_bit(make, config_class, blocks, cls, linears):
    model = _seq2seq(make, config_class, "eager")
    tilegemm.nn.quantize_(model, group_size=32, warn=False)
    for b in blocks:
        block = model.get_submodule(b)
        assert type(block).__name__ == cls
        experts = [m for m in block.experts.values() if hasattr(m, linears[0])]
        assert all(isinstance(getattr(e, n), tilegemm.nn.Int4Linear) for e in experts for n in linears)
        # the router (router.classifier) stays 16-bit, as quantized checkpoints keep routers
        assert type(block.router.classifier) is torch.nn.Linear


def test_a_module_list_of_expert_mlps_is_named():
    """A block of one's own (as remote-code MoE models build them: a router that is no Linear named ``gate``, so
    not a 4.x sparse block) whose experts are a ModuleList of MLPs."""

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, 3, bias=False)
            self.experts = torch.nn.ModuleList([Mlp() for _ in range(3)])

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Block())
    off = moe.experts_off_interface(model)
    assert [n for n, _ in off] == ["1"]
    assert off[0][1].startswith("Block, its experts an nn.ModuleList of 3 per-expert MLPs")
    model[1].experts = torch.nn.ModuleList([torch.nn.Dropout()])  # a list of no Linears holds no experts
    assert moe.experts_off_interface(model) == []


def _dbrx_checkpoint(path):
    """A tiny DBRX as GPTQ (group 32): its attention quantized, its router and experts (no Linears) 16-bit."""
    if not hasattr(transformers, "DbrxConfig"):
        pytest.skip("this transformers has no DbrxConfig")
    config = dbrx()
    cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, not_convert=["router.layer"])
    try:  # (transformers 5.17's DbrxConfig refused the ffn_config it writes: "Found unknown kwargs")
        transformers.AutoConfig.from_pretrained(path)
    except ValueError as err:
        pytest.skip(f"this transformers' DbrxConfig does not load the config it saves ({err})")
    return config


def _notes(record) -> list[str]:
    return [str(w.message) for w in record if "does not reach" in str(w.message)]


def test_from_pretrained_names_the_blocks_and_convert_puts_them_on_tilegemm(tmp_path, device):
    _dbrx_checkpoint(tmp_path / "c")
    with pytest.warns(UserWarning, match=rf"load_quantized_: {NOTE}\(s\) of DbrxForCausalLM.*"
                                         rf"transformer\.blocks\.0\.ffn\.experts \(DbrxExperts.*"
                                         rf"tilegemm\.nn\.convert_\(model\)"):
        model = from_pretrained(tmp_path / "c", device=device, experts_implementation="tilegemm")
    assert model.config._experts_implementation == "tilegemm"
    ids = torch.tensor([[3, 17, 200, 5]], device=device)
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        tilegemm.nn.convert_(model, conv=False, linear=False)
        assert isinstance(model.transformer.blocks[0].ffn.experts, moe.StackedExperts)
        got = model(input_ids=ids).logits.float()
    assert (got - want).norm() <= 2e-3 * want.norm()  # the same model, its experts on the grouped kernels
    assert moe.experts_off_interface(model) == []


def test_no_note_unless_tilegemm_is_asked(tmp_path, device, recwarn):
    _dbrx_checkpoint(tmp_path / "c")
    from_pretrained(tmp_path / "c", device=device)
    from_pretrained(tmp_path / "c", device=device, experts_implementation="eager")
    assert _notes(recwarn) == []


def test_load_quantized_names_them_in_a_model_the_caller_built(tmp_path, device):
    config = _dbrx_checkpoint(tmp_path / "c")
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm").half()
    with pytest.warns(UserWarning, match=rf"load_quantized_: {NOTE}.*transformer\.blocks\.0\.ffn\.experts"):
        load_quantized_(model, tmp_path / "c", device=device)


def test_experts_implementation_is_checked(tmp_path):
    _dbrx_checkpoint(tmp_path / "c")
    with pytest.raises(TypeError, match=r"experts_implementation must be a str naming one .* got int"):
        from_pretrained(tmp_path / "c", device="cpu", experts_implementation=5)
    with pytest.raises(ValueError, match=r"experts_implementation=\"nonesuch\"` is not supported"):  # transformers'
        from_pretrained(tmp_path / "c", device="cpu", experts_implementation="nonesuch")


def test_four_bit_experts_say_they_run_tilegemm_whatever_is_asked(tmp_path, device):
    """Per-expert 4-bit experts run on tilegemm's implementation only: a load asked for another says so."""
    config = cw.tiny_moe_config(layers=1)
    cw.write_model(tmp_path / "c", cw.random_model(config), "gptq", 32, sym=True)
    with pytest.warns(UserWarning, match=r"experts_implementation='eager': the checkpoint's experts load 4-bit, "
                                         r"which only the 'tilegemm' implementation runs"):
        model = from_pretrained(tmp_path / "c", device=device, experts_implementation="eager")
    assert model.config._experts_implementation == "tilegemm"
