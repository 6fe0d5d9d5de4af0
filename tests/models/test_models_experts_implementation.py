"""``experts_implementation="tilegemm"`` on models whose MoE blocks transformers runs with code of their own (Llama-4,
DBRX, JetMoE): transformers takes the name and never calls the implementation, so tilegemm names those blocks, and
``tilegemm.nn.convert_``, where it builds or loads the model (``tilegemm.models.from_pretrained(...,
experts_implementation=...)``, ``load_quantized_``)."""

from __future__ import annotations

import os
import warnings
import sys

import pytest
import torch

import moe_kit
from moe_kit import jetmoe, llama4, needs_experts_interface, transformers_or_skip

transformers = transformers_or_skip()
pytestmark = needs_experts_interface()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402

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
    assert moe.experts_off_interface(model) == [(block, f"{cls}, whose experts run in a forward of its own: "
                                                        f"tilegemm.nn.convert_ replaces it")]
    note = moe.experts_off_interface_note(model)  # ... which these blocks never call
    assert note.startswith(f"{NOTE}(s) of {type(model).__name__}") and f"{block} ({cls}" in note
    assert "tilegemm.nn.convert_(model)" in note
    tilegemm.nn.convert_(model, conv=False, linear=False)
    assert moe.experts_off_interface(model) == [] and moe.experts_off_interface_note(model) is None
    # a model that asks for another implementation is told nothing
    other = transformers.AutoModelForCausalLM.from_config(make(), experts_implementation="eager")
    assert moe.experts_off_interface(other) and moe.experts_off_interface_note(other) is None


@pytest.mark.parametrize("make,config_class,block,cls", BLOCKS)
def test_quantize_experts_alone_names_the_blocks_it_cannot_take(make, config_class, block, cls):
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    model = transformers.AutoModelForCausalLM.from_config(make())
    with pytest.warns(ConversionNote, match=r"quantize_experts_ kept 1 MoE block\(s\) 16-bit") as got:
        assert tilegemm.nn.quantize_experts_(model, group_size=32) == []
    assert f"{block} ({cls}" in str(got[0].message) and "tilegemm.nn.quantize_" in str(got[0].message)
    # through quantize_, which converts the block first, quantize_experts_ takes it and says nothing of its own
    model = transformers.AutoModelForCausalLM.from_config(make())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tilegemm.nn.quantize_(model, group_size=32)
    assert not any("quantize_experts_ kept" in str(w.message) for w in seen)
    assert moe.experts_off_interface(model) == []


def test_models_on_the_interface_are_not_named():
    model = transformers.AutoModelForCausalLM.from_config(cw.tiny_moe_config(layers=1),
                                                          experts_implementation="tilegemm")
    assert moe.experts_off_interface(model) == [] and moe.experts_off_interface_note(model) is None


def _dbrx_checkpoint(path):
    """A tiny DBRX as GPTQ (group 32): its attention quantized, its router and experts (no Linears) 16-bit."""
    if not hasattr(transformers, "DbrxConfig"):
        pytest.skip("this transformers has no DbrxConfig")
    config = dbrx()
    cw.write_model(path, cw.random_model(config), "gptq", 32, sym=True, not_convert=["router.layer"])
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
