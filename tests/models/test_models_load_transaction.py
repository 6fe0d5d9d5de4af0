"""A load that raises leaves the caller's model exactly as given: ``load_quantized_`` refused after its up-front
checks pass (an importer refusing a later layer's stored values, an expert's gate and up in two orders, a failure
at any step of the changes, an interrupt) puts back every module, parameter, buffer and config setting it changed;
refusals of the checks themselves (a missing tensor of a later layer, a shape that does not fit in a later shard)
change nothing either. Checkpoints from the tests' own writer (``ckpt_writer.py``)."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

from conftest import hide_broken_torchvision  # noqa: E402

hide_broken_torchvision()

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from safetensors.torch import load_file, save_file  # noqa: E402

import tilegemm.models.pretrained as pretrained  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_  # noqa: E402

IDS = torch.tensor([[3, 17, 200, 5, 96]])
LAST = "model.layers.1.mlp.down_proj"  # the last Linear the loader converts (lm_head is stored 16-bit)


def _config_state(c) -> dict:
    """What loading may change of a config: its settings and the private ones to_dict leaves out."""
    return {"dict": c.to_dict(), "attrs": sorted(vars(c)),
            **{k: repr(getattr(c, k, None)) for k in ("_is_quantized", "_experts_implementation",
                                                       "quantization_config", "compression_config",
                                                       "tie_word_embeddings")}}


def state(model) -> dict:
    """Everything a caller can see of ``model``: module types and attribute names under every name, the
    state dict's keys, each parameter and buffer (the same object, device, dtype and values), the config."""
    def tensors(named):
        return [(n, t, t.device, t.dtype, None if t.is_meta else t.detach().clone()) for n, t in named]

    return dict(modules=[(n, type(m), m, sorted(vars(m))) for n, m in model.named_modules()],
                keys=list(model.state_dict(keep_vars=True)),
                params=tensors(model.named_parameters(remove_duplicate=False)),
                buffers=tensors(model.named_buffers(remove_duplicate=False)),
                config=_config_state(model.config))


def assert_same(before: dict, after: dict) -> None:
    assert [(n, t, a) for n, t, _, a in after["modules"]] == [(n, t, a) for n, t, _, a in before["modules"]]
    assert all(m2 is m for (_, _, m, _), (_, _, m2, _) in zip(before["modules"], after["modules"]))
    assert after["keys"] == before["keys"]
    assert after["config"] == before["config"]
    for kind in ("params", "buffers"):
        assert [n for n, *_ in after[kind]] == [n for n, *_ in before[kind]]
        for (n, t, dev, dt, value), (_, t2, dev2, dt2, _) in zip(before[kind], after[kind]):
            assert t2 is t and dev2 == dev and dt2 == dt, n  # the same tensor object, where it was
            assert value is None or torch.equal(t2, value), n


def assert_same_values(want: dict, got: dict) -> None:
    """``got`` (a :func:`state`) holds what ``want`` holds: module types and attributes, keys, config, and each
    parameter and buffer's device, dtype and values (other objects)."""
    assert [(n, t, a) for n, t, _, a in got["modules"]] == [(n, t, a) for n, t, _, a in want["modules"]]
    assert got["keys"] == want["keys"] and got["config"] == want["config"]
    for kind in ("params", "buffers"):
        assert [n for n, *_ in got[kind]] == [n for n, *_ in want[kind]]
        for (n, _, dev, dt, value), (_, _, dev2, dt2, value2) in zip(want[kind], got[kind]):
            assert dev2 == dev and dt2 == dt and torch.equal(value2, value), n


def _rewrite(path, name: str, fn) -> None:
    """Replace stored tensor ``name`` of a checkpoint directory by ``fn(tensor)`` (in whichever file holds it)."""
    index = os.path.join(path, "model.safetensors.index.json")
    file = json.load(open(index))["weight_map"][name] if os.path.isfile(index) else "model.safetensors"
    tensors = load_file(os.path.join(path, file))
    tensors[name] = fn(tensors[name]).contiguous()
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})


def _logits(model):
    return model(input_ids=IDS.to(next(model.parameters()).device)).logits.float().cpu()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny Llama (tied embeddings: the load unties nothing, ties again) written as GPTQ act-order, sharded."""
    config = cw.tiny_config(hidden=64, layers=2, tie=True)
    path = tmp_path_factory.mktemp("tx") / "good"
    reference = cw.write_model(path, cw.random_model(config), "gptq", 32, act_order=True, shard_bytes=20_000)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))  # several shards
    return config, path, reference


def _copy_ckpt(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case", ["qweight_dtype", "g_idx_range"])
def test_an_importer_refusing_a_later_layer_leaves_the_model(tmp_path, device, dense, case):
    """The stored shapes fit, so the checks pass and the Linears before it are converted; the importer then refuses
    the last layer's values (a qweight stored int64; a g_idx naming a group that is not there)."""
    config, good, reference = dense
    path = _copy_ckpt(good, tmp_path / "bad")
    if case == "qweight_dtype":
        _rewrite(path, f"{LAST}.qweight", lambda t: t.to(torch.int64))
        match, err = r"model\.layers\.1\.mlp\.down_proj .*qweight must be int32", TypeError
    else:
        _rewrite(path, f"{LAST}.g_idx", lambda t: torch.full_like(t, 1000))
        match, err = r"model\.layers\.1\.mlp\.down_proj .*g_idx holds groups outside", ValueError
    model = cw.random_model(config).half()
    before = state(model)
    with pytest.raises(err, match=match):
        load_quantized_(model, path, device=device)
    assert_same(before, state(model))
    # and the model takes a good load afterwards
    load_quantized_(model, good, device=device)
    assert isinstance(model.get_submodule(LAST), Int4Linear)
    want = _logits(cw.reference_model(config, reference).to(device))
    assert (_logits(model) - want).abs().max() <= 3e-3 * want.abs().max()


@pytest.mark.parametrize("case", ["missing", "shape"])
def test_a_refused_later_shard_leaves_the_model(tmp_path, device, dense, case):
    """A missing tensor of the last layer, or the final norm stored in a shape that does not fit (the last shard):
    refused by the checks, naming it, before anything of the model changes."""
    config, good, _ = dense
    path = _copy_ckpt(good, tmp_path / "bad")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    if case == "missing":
        name = f"{LAST}.scales"
        _rewrite_drop(path, index[name], name)
        match = rf"lacks tensor.*{name}"
    else:
        name = "model.norm.weight"
        assert index[name] == sorted(set(index.values()))[-1]  # in the last shard
        _rewrite(path, name, lambda t: t[:-8])
        match = rf"{name}: the checkpoint's shape \[56\] does not match the model's \[64\]"
    model = cw.random_model(config).half()
    before = state(model)
    with pytest.raises(ValueError, match=match):
        load_quantized_(model, path, device=device)
    assert_same(before, state(model))


def _rewrite_drop(path, file: str, name: str) -> None:
    tensors = load_file(os.path.join(path, file))
    del tensors[name]
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    index_file = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_file))
    del index["weight_map"][name]
    json.dump(index, open(index_file, "w"))


# Each step of the changes, made to raise part-way: (the module or class patched, the function, how many calls
# succeed, whether the failing call makes its change before raising, the exception).
_STEPS = {
    "importer": (pretrained, "from_gptq", 3, False, RuntimeError("importer failed")),  # the fourth Linear's import
    "int4_linear": (Int4Linear, "from_weight", 5, False, RuntimeError("from_weight failed")),
    "plain_tensor": (pretrained, "_set_tensor", 4, False, KeyboardInterrupt()),  # an interrupt among the plain ones
    "tie": (pretrained, "_tie", 0, True, RuntimeError("tie failed")),  # the embeddings tied again, then a failure
    "saved_format": (pretrained, "mark_saved_format_", 0, True, RuntimeError("marking failed")),  # the config marked
}


@pytest.mark.parametrize("step", sorted(_STEPS))
@pytest.mark.parametrize("built", ["plain", "meta"])
def test_a_failure_at_any_step_leaves_the_model(tmp_path, device, dense, monkeypatch, step, built):
    """Whatever raises during the changes, after some of them are made (Linears converted, tensors loaded, meta
    buffers computed, the embeddings tied, the config marked), the same exception propagates and the model is as
    it was given: a model with random weights, and one built under torch.device("meta") whose rotary tables the
    load computes. The model then takes the checkpoint as if nothing had happened."""
    config, path, _ = dense
    owner, what, after, post, error = _STEPS[step]
    real = getattr(owner, what)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) <= after:
            return real(*args, **kwargs)
        if post:
            real(*args, **kwargs)
        raise error

    monkeypatch.setattr(owner, what, staticmethod(failing) if isinstance(owner, type) else failing)
    if built == "meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert any(b.is_meta for b in model.buffers())
    else:
        model = cw.random_model(config).half()
    before = state(model)
    with pytest.raises(type(error)) as raised:
        load_quantized_(model, path, device=device)
    assert raised.value is error and len(calls) > after  # (the step was reached)
    assert_same(before, state(model))
    monkeypatch.undo()
    load_quantized_(model, path, device=device)
    # exactly what a model built alike that took only the good load holds (whose logits
    # test_an_importer_refusing_a_later_layer_leaves_the_model checks against the reference's)
    own = copy.deepcopy(config)  # (a config of its own: the load marks it)
    if built == "meta":
        with torch.device("meta"):
            fresh = transformers.AutoModelForCausalLM.from_config(own)
    else:
        fresh = cw.random_model(own).half()
    load_quantized_(fresh, path, device=device)
    assert_same_values(state(fresh), state(model))


def test_a_model_quantized_already_keeps_its_layers(tmp_path, device, dense, monkeypatch):
    """Loading into a model holding Int4Linears rebuilds them: a failure half-way leaves the model's own."""
    config, path, _ = dense
    model = pretrained.from_pretrained(path, device=device)
    before = state(model)
    real, calls = pretrained._int4_weight, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:
            raise ValueError("late")
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrained, "_int4_weight", failing)
    with pytest.raises(ValueError, match="late"):
        load_quantized_(model, path, device=device)
    assert_same(before, state(model))


def test_experts_in_two_orders_leave_the_model(tmp_path, device):
    """A MoE checkpoint whose experts' gate and up come in two input orders is refused when the experts are
    stacked, after the attention's Linears were converted: the model, its experts' 16-bit weights and its experts
    implementation are as given."""
    config = cw.tiny_moe_config(layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, act_order=True, shared_gate_up_order=False)
    model = cw.random_model(config).half()
    before = state(model)
    implementation = model.config._experts_implementation
    with pytest.raises(ValueError, match=r"experts\.0 .*act-order input permutation differs"):
        load_quantized_(model, path, device=device)
    assert_same(before, state(model))
    assert model.config._experts_implementation == implementation
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
