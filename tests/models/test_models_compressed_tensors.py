"""compressed-tensors checkpoints (llm-compressor's W4A16 schemes stored ``pack-quantized``): the importer
``w4a16.from_compressed_tensors`` against the tests' writer (ckpt_writer.py, which packs and dequantizes by the
format's own description), and ``from_pretrained`` / ``load_quantized_`` of such directories, with every setting the
loader refuses named."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from tilegemm import w4a16  # noqa: E402
from tilegemm.models import pretrained  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_  # noqa: E402

IDS = torch.tensor([[3, 17, 200]])
TOL = 3e-3  # as test_models_pretrained: fp16 activations through two layers against the fp32 model


def _weight(N=48, K=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * 0.05


# --- the importer -------------------------------------------------------------------------------------------


IMPORTS = {  # name: (group_size, writer options)
    "sym-g32": (32, dict(sym=True)),
    "asym-g64-packed-zero": (64, dict(sym=False)),
    "asym-g32-unpacked-zero": (32, dict(sym=False, unpacked_zero=True)),
    "sym-act-order-g32": (32, dict(sym=True, act_order=True)),
    "asym-act-order-g64": (64, dict(sym=False, act_order=True)),
    "channel-asym": (-1, dict(sym=False)),
}


@pytest.mark.parametrize("name", list(IMPORTS))
def test_from_compressed_tensors_matches_the_format(name):
    gs, kw = IMPORTS[name]
    t, want = cw.quantize_linear(_weight(), "compressed-tensors", gs, generator=torch.Generator().manual_seed(1),
                                 **kw)
    assert ("weight_zero_point" in t) == (not kw["sym"]) and ("weight_g_idx" in t) == kw.get("act_order", False)
    w = w4a16.from_compressed_tensors(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                      t.get("weight_g_idx"))
    assert w.shape == (48, 128) and w.scales.shape[0] == (1 if gs == -1 else 128 // gs)
    assert (w.perm is not None) == kw.get("act_order", False)
    assert torch.equal(w4a16.dequantize(w), want)
    if not kw["sym"]:  # the zero points matter: read as symmetric, the weight is another one
        other = w4a16.from_compressed_tensors(t["weight_packed"], t["weight_scale"], None, t.get("weight_g_idx"))
        assert not torch.equal(w4a16.dequantize(other), want)


@pytest.mark.parametrize("N", [17, 259])
def test_output_width_not_a_multiple_of_8(N):
    # pack-quantized packs the weight along K only and the zero points along N in ceil(N/8) rows, the nibbles past
    # N left 0 (compressed-tensors pads them and cuts them on reading): any N is a checkpoint
    t, want = cw.quantize_linear(_weight(N=N), "compressed-tensors", 32, sym=False)
    rows = -(-N // 8)
    zp = t["weight_zero_point"]
    assert list(t["weight_packed"].shape) == [N, 16] and list(zp.shape) == [rows, 4]
    assert all(int(cw.nibble(zp[rows - 1], i).max()) == 0 for i in range(N - 8 * (rows - 1), 8))
    w = w4a16.from_compressed_tensors(t["weight_packed"], t["weight_scale"], zp)
    assert w.shape == (N, 128) and torch.equal(w4a16.dequantize(w), want)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3)).half()
    ref = x.float() @ want.float().T
    assert float((w4a16.matmul(x, w).float() - ref).norm() / ref.norm()) < 2e-3


def test_from_compressed_tensors_bf16_scales_and_module():
    t, want = cw.quantize_linear(_weight(seed=2), "compressed-tensors", 32, sym=False, scale_dtype=torch.bfloat16)
    w = w4a16.from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_zero_point"])
    assert w.scales.dtype == torch.bfloat16
    ref = cw.dequantize_stored(t, "compressed-tensors", 32).float()
    assert torch.equal(w4a16.dequantize(w).float(), (ref.to(torch.bfloat16)).float())
    lin = Int4Linear.from_compressed_tensors(t["weight_packed"], t["weight_scale"].half(), t["weight_zero_point"],
                                             bias=torch.ones(48).half())
    assert torch.equal(lin.dequantize(), want) and torch.equal(lin.bias, torch.ones(48).half())


def test_from_compressed_tensors_refusals():
    t, _ = cw.quantize_linear(_weight(), "compressed-tensors", 32, sym=False)
    packed, scale, zp = t["weight_packed"], t["weight_scale"], t["weight_zero_point"]
    with pytest.raises(TypeError, match="weight_packed must be int32"):
        w4a16.from_compressed_tensors(packed.to(torch.int64), scale, zp)
    with pytest.raises(ValueError, match=r"weight_scale must be \[N, G\] with N = 48"):
        w4a16.from_compressed_tensors(packed, scale[:40], zp)
    with pytest.raises(TypeError, match="scales must be fp16 or bf16"):
        w4a16.from_compressed_tensors(packed, scale.float(), zp)
    with pytest.raises(ValueError, match=r"weight_zero_point must be int32 \[ceil\(N/8\), G\] = \[6, 4\]"):
        w4a16.from_compressed_tensors(packed, scale, zp[:, :2])
    with pytest.raises(TypeError, match="weight_zero_point must be an integer tensor"):
        w4a16.from_compressed_tensors(packed, scale, zp.float())
    with pytest.raises(ValueError, match="signed 4-bit zeros, -8..7"):
        w4a16.from_compressed_tensors(packed, scale, torch.full((48, 4), 9, dtype=torch.int8))
    with pytest.raises(ValueError, match="3 groups do not divide K = 128 evenly"):
        w4a16.from_compressed_tensors(packed, scale[:, :3], None)
    with pytest.raises(ValueError, match="group size K / G = 128 / 8 = 16 is not one of"):
        w4a16.from_compressed_tensors(packed, torch.ones(48, 8).half(), None)
    with pytest.raises(ValueError, match=r"g_idx must be an integer tensor \[K\] = \[128\]"):
        w4a16.from_compressed_tensors(packed, scale, zp, torch.zeros(64, dtype=torch.int32))


# --- checkpoint directories ----------------------------------------------------------------------------------


pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

from tilegemm.models import from_pretrained  # noqa: E402


def _logits(model, device):
    with torch.no_grad():
        return model(input_ids=IDS.to(device)).logits.float().cpu()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _write(tmp_path, arch="llama", tie=False, group_size=32, **kw):
    # one decoder layer: each layer's Linears load alike, and every layer of a forward under the interpreter costs
    # as much as the first
    config = cw.tiny_config(arch, hidden=128, layers=1, tie=tie)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", group_size, **kw)
    return path, config, reference


CASES = {  # name: (arch, tie, writer options)
    "sym-g32": ("llama", False, dict(group_size=32, sym=True)),
    "asym-act-order-g64-sharded": ("llama", False, dict(group_size=64, sym=False, act_order=True,
                                                          shard_bytes=60_000)),
    "channel-sym": ("llama", False, dict(group_size=-1, sym=True)),
    "asym-unpacked-zero-bf16-scales": ("llama", False, dict(group_size=32, sym=False, ct_options=dict(
        unpacked_zero=True, scale_dtype=torch.bfloat16))),
    "qwen2-tied-bias-sym-g64": ("qwen2", True, dict(group_size=64, sym=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compressed_tensors_checkpoint_loads(tmp_path, device, name):
    arch, tie, kw = CASES[name]
    path, config, reference = _write(tmp_path, arch, tie, **kw)
    if kw.get("shard_bytes"):
        assert (path / "model.safetensors.index.json").is_file()
    model = from_pretrained(path, device=device)
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 7 * config.num_hidden_layers  # lm_head in the ignore list stays 16-bit
    assert type(model.lm_head) is torch.nn.Linear
    q = model.model.layers[0].self_attn.q_proj
    assert q.scales.shape[0] == (1 if kw["group_size"] == -1 else 128 // kw["group_size"])
    assert (q.perm.numel() == 128) == kw.get("act_order", False)
    for n, m in int4.items():
        assert torch.equal(m.dequantize().cpu(), reference[f"{n}.weight"]), n
    assert model.config.quantization_config["converted_from"] == "compressed-tensors"
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"{name}: logits rel. error {err:.2e}"


@pytest.mark.parametrize("layout", ["flat", "nested-sparseml"])
def test_early_compression_config_key_loads(tmp_path, device, layout):
    """compressed-tensors' releases before mid-2024 wrote their settings under config.json's ``compression_config``:
    at its top level, or (earlier, ``quant_method`` "sparseml") nested under ``quantization_config`` beside
    ``sparsity_config``. Read as a ``quantization_config``; the loaded model's config names tilegemm's format
    only."""
    config = cw.tiny_config("llama", hidden=128, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=False,
                               config_key="compression_config")
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg
    if layout == "nested-sparseml":
        qc = cfg["compression_config"]
        sparsity = qc.pop("sparsity_config")
        cfg["compression_config"] = dict(quantization_config=dict(qc, quant_method="sparseml"),
                                         sparsity_config=sparsity or None)
        (path / "config.json").write_text(json.dumps(cfg))
    assert pretrained.quant_config(pretrained.read_config(path)).describe() == \
        "compressed-tensors (pack-quantized, asymmetric), 4-bit, group 32"
    model = from_pretrained(path, device=device)
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 7 and type(model.lm_head) is torch.nn.Linear
    for n, m in int4.items():
        assert torch.equal(m.dequantize().cpu(), reference[f"{n}.weight"]), n
    assert model.config.quantization_config["converted_from"] == "compressed-tensors"
    assert not hasattr(model.config, "compression_config")  # a save writes tilegemm's settings only
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_early_compression_config_refusals_are_named(tmp_path):
    """What an early ``compression_config`` holds is checked as a ``quantization_config`` is: its nested
    ``sparsity_config`` beside the settings, and its settings themselves."""
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True, config_key="compression_config")
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["compression_config"]
    cfg["compression_config"] = dict(quantization_config=qc, sparsity_config=dict(format="sparse-bitmask"))
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"sparsity_config format 'sparse-bitmask': sparse weights are not"):
        from_pretrained(path, device="cpu")
    cfg["compression_config"] = dict(qc, format="int-quantized")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"format 'int-quantized' is not supported"):
        from_pretrained(path, device="cpu")
    # the current key wins where a config holds both (a checkpoint re-saved by a later release)
    cfg["quantization_config"] = dict(qc)
    (path / "config.json").write_text(json.dumps(cfg))
    assert from_pretrained(path, device="cpu").config.quantization_config["converted_from"] == "compressed-tensors"



@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_early_compression_config_messages_name_its_key(tmp_path, layout):
    """Refusals of an early checkpoint's settings name the key config.json holds them under
    (``compression_config``, or ``compression_config.quantization_config`` nested): no ``quantization_config`` the
    user would look for in vain. Read as the loader reads it, and at load time (a layer ignored but stored packed)."""
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True, config_key="compression_config")
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("compression_config")
    key = "compression_config" if layout == "flat" else "compression_config.quantization_config"

    def write(settings: dict, sparsity=None) -> None:
        early = dict(settings) if layout == "flat" else dict(quantization_config=dict(settings))
        if sparsity is not None:
            early["sparsity_config"] = sparsity
        (path / "config.json").write_text(json.dumps(dict(cfg, compression_config=early)))

    def refused(settings: dict, sparsity=None) -> str:
        write(settings, sparsity)
        with pytest.raises(ValueError) as err:
            pretrained.quant_config(pretrained.read_config(path))
        assert "quantization_config" not in str(err.value).replace(key, "")
        return str(err.value)

    group = qc["config_groups"]["group_0"]
    eight = dict(qc, config_groups=dict(group_0=dict(group, weights=dict(group["weights"], num_bits=8))))
    assert refused(eight).startswith(f"config.json: {key}.config_groups['group_0']: weights of 8-bit int")
    assert refused(dict(qc, ignore=["re:[mlp"])).startswith(f"config.json: {key}.ignore: 're:[mlp' is not a")
    assert refused(dict(qc, ignore="lm_head")).startswith(f"config.json: {key}.ignore must be a list")
    assert f"compressed-tensors {key} needs config_groups" in refused(dict(qc, config_groups={}))
    assert f"{key}.transform_config" in refused(dict(qc, transform_config=dict(config_groups={"u": {}})))
    # the sparsity settings sit under compression_config in both layouts
    assert "compressed-tensors compression_config.sparsity_config format 'sparse-bitmask'" in refused(
        {k: v for k, v in qc.items() if k != "sparsity_config"}, dict(format="sparse-bitmask"))
    # at load time: a layer the ignore list names but the checkpoint stores packed
    write(dict(qc, ignore=["lm_head", "re:.*self_attn[.]o_proj$"]))
    with pytest.raises(ValueError, match=rf"o_proj is in {key}\.ignore \('re:\.\*self_attn\[\.\]o_proj\$'\) but "
                                         rf"the checkpoint stores it quantized"):
        from_pretrained(path, device="cpu")
    # (config.json's current key is named as before)
    (path / "config.json").write_text(json.dumps(dict(cfg, quantization_config=dict(qc, ignore="lm_head"))))
    with pytest.raises(ValueError, match=r"^config\.json: quantization_config\.ignore must be a list"):
        pretrained.quant_config(pretrained.read_config(path))


def test_older_settings_file_messages_name_the_file(tmp_path):
    """Settings read from an older quantizer's own file (AutoGPTQ's quantize_config.json): its refusals name that
    file and its own keys, not config.json's quantization_config."""
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="llama")))
    (tmp_path / "quantize_config.json").write_text(json.dumps(dict(bits=8, group_size=32)))
    with pytest.raises(ValueError, match=r"^quantize_config\.json: bits = 8"):
        pretrained.quant_config(pretrained.read_config(tmp_path))
    (tmp_path / "quantize_config.json").write_text(json.dumps(dict(bits=4, group_size=32, dynamic=[1])))
    with pytest.raises(ValueError, match=r"^quantize_config\.json: dynamic must be a JSON object"):
        pretrained.quant_config(pretrained.read_config(tmp_path))

def test_preset_group_and_ignore_patterns(tmp_path, device):
    """A config group given as a preset name (``{"W4A16": ["Linear"]}``) and an ignore list of ``re:`` patterns:
    the layers it names load as plain Linears."""
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 128, sym=True,
                               not_convert=["mlp.down_proj"])
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:.*mlp[.]down_proj$"]
    qc["config_groups"] = {"W4A16": ["Linear"]}  # group 128 > K = 64: one group, as the writer stored
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device=device)
    for layer in model.model.layers:
        assert type(layer.mlp.down_proj) is torch.nn.Linear and isinstance(layer.mlp.up_proj, Int4Linear)
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_load_quantized_into_a_built_model(tmp_path, device):
    path, config, reference = _write(tmp_path, group_size=64, sym=False)
    model = cw.random_model(config).half().to(device)
    load_quantized_(model, path)
    assert isinstance(model.model.layers[-1].mlp.down_proj, Int4Linear)
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    for key, value in changes.items():
        if key.startswith("w_"):
            qc["config_groups"]["group_0"]["weights"][key[2:]] = value
        elif key.startswith("g_"):
            qc["config_groups"]["group_0"][key[2:]] = value
        else:
            qc[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


REFUSED = {  # config change: message
    "w_num_bits=8": (dict(w_num_bits=8), r"weights of 8-bit int are not supported"),
    "w_type=float": (dict(w_type="float"), r"weights of 4-bit float are not supported"),
    "activations": (dict(g_input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True)),
                    r"quantizes activations \(input_activations\)"),
    "format": (dict(format="naive-quantized"), r"format 'naive-quantized' is not supported; supported: "
                                               r"'pack-quantized'"),
    "group format": (dict(g_format="float-quantized"), r"format 'float-quantized' is not supported"),
    "tensor strategy": (dict(w_strategy="tensor", w_group_size=None), r"strategy 'tensor' is not supported"),
    "dynamic": (dict(w_dynamic=True), r"dynamic weight quantization"),
    "actorder": (dict(w_actorder="sideways"), r"actorder 'sideways' is not one of"),
    "group size": (dict(w_group_size=0), r"strategy 'group' needs a positive group_size"),
    "sparsity": (dict(sparsity_config=dict(format="sparse-24-bitmask")), r"sparse weights are not supported"),
    "transform": (dict(transform_config=dict(config_groups={"u": {}})), r"transform_config"),
    "no groups": (dict(config_groups={}), r"needs config_groups"),
    "preset": (dict(config_groups={"W8A8": ["Linear"]}), r"the preset scheme 'W8A8' is not supported"),
    "ignore": (dict(ignore="lm_head"), r"ignore must be a list"),
    "targets": (dict(g_targets="Linear"), r"targets must be a list"),
    "target pattern": (dict(g_targets=["re:.*(q_proj"]), r"config_groups\['group_0'\].targets: 're:.\*\(q_proj' is "
                                                         r"not a regular expression"),
    "ignore pattern": (dict(ignore=["lm_head", "re:[mlp"]), r"quantization_config.ignore: 're:\[mlp' is not a "
                                                           r"regular expression"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_settings_are_named(tmp_path, name):
    changes, message = REFUSED[name]
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True)
    _edit(path, **changes)
    with pytest.raises(ValueError, match=message):
        from_pretrained(path, device="cpu")


def test_stored_tensors_checked(tmp_path):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    model = cw.random_model(config)
    # an asymmetric checkpoint missing one layer's zero points, and one whose scales are dropped
    path = tmp_path / "a"
    cw.write_model(path, model, "compressed-tensors", 32, sym=False,
                   drop=["model.layers.0.mlp.up_proj.weight_zero_point",
                         "model.layers.0.self_attn.k_proj.weight_scale"])
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) the model needs: model.layers.0.self_attn.k_proj."
                                         r"weight_scale, model.layers.0.mlp.up_proj.weight_zero_point$"):
        from_pretrained(path, device="cpu")
    # act-order ("group") without the group of each input
    path = tmp_path / "b"
    cw.write_model(path, model, "compressed-tensors", 32, sym=True, act_order=True,
                   drop=["model.layers.0.mlp.down_proj.weight_g_idx"])
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) the model needs: "
                                         r"model.layers.0.mlp.down_proj.weight_g_idx"):
        from_pretrained(path, device="cpu")
    # weight_shape that does not match the model, and a group size the config does not say
    path = tmp_path / "c"
    cw.write_model(path, model, "compressed-tensors", 32, sym=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([64, 128])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.weight_shape: the checkpoint says the weight is \[64, 128\], the "
                                         r"model's is \[128, 64\]"):
        from_pretrained(path, device="cpu")
    _edit(path, w_group_size=64)
    tensors["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([128, 64])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_scale: the checkpoint's shape \[128, 2\] does not match \[128, 1\]"):
        from_pretrained(path, device="cpu")


def test_ignored_layer_stored_packed_is_named(tmp_path):
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True)
    _edit(path, ignore=["lm_head", "re:.*self_attn[.]o_proj$"])
    with pytest.raises(ValueError, match=r"o_proj is in quantization_config\.ignore \('re:\.\*self_attn\[\.\]o_proj\$'"
                                         r"\) but the checkpoint stores it quantized \(model\.layers\.0\.self_attn\."
                                         r"o_proj\.weight_packed\)"):
        from_pretrained(path, device="cpu")
    # a layer no config group targets is said so, with the settings' key (not guessed as in the ignore list)
    _edit(path, ignore=["lm_head"], g_targets=[r"re:.*mlp\..*", r"re:.*[qkv]_proj$"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj is targeted by no config group of "
                                         r"quantization_config but the checkpoint stores it quantized") as info:
        from_pretrained(path, device="cpu")
    assert "quantization_config.ignore" not in str(info.value)


def test_groups_by_target(tmp_path, device):
    """Two config groups, each targeting layers by pattern, with their own group sizes: each layer loads with
    its group's; a layer that no group targets, stored 16-bit, loads as a plain Linear."""
    config = cw.tiny_config("llama", hidden=128, layers=1)
    path = tmp_path / "c"
    sizes = {"mlp": 64, "self_attn": 32}
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True,
                               not_convert=["self_attn.o_proj"],
                               group_size_of=lambda name: sizes[name.split(".")[3]])
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    group = qc["config_groups"]["group_0"]
    qc["config_groups"] = {
        "attention": dict(group, targets=["re:.*self_attn[.][qkv]_proj$"]),
        "mlp": dict(group, targets=["re:.*mlp[.].*"], weights=dict(group["weights"], group_size=64)),
    }
    qc["ignore"] = ["lm_head"]
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device=device)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.group_size == 32 and layer.mlp.down_proj.group_size == 64
    assert type(layer.self_attn.o_proj) is torch.nn.Linear
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_quant_config_describes_compressed_tensors():
    q = pretrained.quant_config({"quantization_config": cw.quantization_config("compressed-tensors", 128, sym=False,
                                                                               act_order=True)})
    assert q.method == "compressed-tensors" and q.group_size == 128 and not q.sym and q.desc_act
    assert q.describe() == "compressed-tensors (pack-quantized, asymmetric, act-order), 4-bit, group 128"
    assert q.for_module("lm_head") is None  # the writer's ignore list
    assert q.for_module("model.layers.0.mlp.up_proj") == q.for_module("anything", ("Linear",))
    assert q.for_module("model.embed_tokens", ("Embedding", "Module")) is None  # no group targets it
    # "weight" act-order kept the natural group order: no g_idx needed
    qc = cw.quantization_config("compressed-tensors", 32)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "weight"
    assert not pretrained.quant_config({"quantization_config": qc}).desc_act


def test_group_precedence_follows_compressed_tensors():
    """A module that several config groups target takes the scheme compressed-tensors gives it: the target naming
    it exactly, else its first matching ``re:`` pattern (in sorted order), else its class; a target that several
    groups list belongs to the last of them. Not the first group in the config's order."""
    qc = cw.quantization_config("compressed-tensors", 128)
    w = qc["config_groups"]["group_0"]["weights"]
    qc["config_groups"] = {
        "all": dict(targets=["Linear"], weights=dict(w, group_size=128)),
        "mlp": dict(targets=["re:.*mlp[.].*"], weights=dict(w, group_size=64)),
        "up": dict(targets=["re:.*up_proj$"], weights=dict(w, group_size=32)),
        "one": dict(targets=["model.layers.0.mlp.down_proj"], weights=dict(w, group_size=256)),
        "again": dict(targets=["re:.*up_proj$"], weights=dict(w, group_size=32, symmetric=False)),
    }
    q = pretrained.quant_config({"quantization_config": qc})
    assert q.for_module("model.layers.0.self_attn.q_proj").group_size == 128  # only its class is targeted
    assert q.for_module("model.layers.1.mlp.down_proj").group_size == 64  # a pattern before the class
    assert q.for_module("model.layers.0.mlp.down_proj").group_size == 256  # its name before any pattern
    # two patterns match: "re:.*mlp[.].*" sorts before "re:.*up_proj$"
    assert q.for_module("model.layers.1.mlp.gate_proj").group_size == 64
    assert q.for_module("model.layers.1.mlp.up_proj").group_size == 64
    # a target listed twice: the later group's
    qc["config_groups"] = {"a": dict(targets=["re:.*up_proj$"], weights=dict(w, group_size=32)),
                           "b": dict(targets=["re:.*up_proj$"], weights=dict(w, group_size=64, symmetric=False))}
    um = pretrained.quant_config({"quantization_config": qc}).for_module("model.layers.1.mlp.up_proj")
    assert um.group_size == 64 and not um.sym


def test_pattern_group_after_a_class_group_loads(tmp_path, device):
    """llm-compressor's mixed recipes: one group for every Linear, a later one for some layers by pattern. The
    pattern's layers are stored with its settings, as compressed-tensors applies them."""
    config = cw.tiny_config("llama", hidden=128, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True,
                               group_size_of=lambda name: 64 if name.endswith("down_proj") else 32)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    group = qc["config_groups"]["group_0"]
    qc["config_groups"]["group_1"] = dict(group, targets=["re:.*down_proj$"],
                                          weights=dict(group["weights"], group_size=64))
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device=device)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.group_size == 64 and layer.mlp.up_proj.group_size == 32
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_unset_g_idx_reads_as_the_natural_order(tmp_path, device):
    """An act-order ("group") layer that was never reordered keeps compressed-tensors' initial weight_g_idx, every
    entry -1, which compressed-tensors reads as the natural order of the groups: so does the loader."""
    t, want = cw.quantize_linear(_weight(), "compressed-tensors", 32, sym=False)
    unset = torch.full((128,), -1, dtype=torch.int32)
    w = w4a16.from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_zero_point"], unset)
    assert w.perm is None and torch.equal(w4a16.dequantize(w), want)
    with pytest.raises(ValueError, match=r"g_idx holds groups outside 0..3"):  # other negatives: no such group
        w4a16.from_compressed_tensors(t["weight_packed"], t["weight_scale"], None, torch.full((128,), -2))
    config = cw.tiny_config("llama", hidden=64, layers=1)
    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        tensors[key.replace("weight_packed", "weight_g_idx")] = torch.full((tensors[key].shape[1] * 8,), -1,
                                                                           dtype=torch.int32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _edit(path, w_actorder="group")
    model = from_pretrained(path, device=device)
    assert model.model.layers[0].mlp.down_proj.perm.numel() == 0
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_rules_name_modules_as_the_quantizer_did(tmp_path, device):
    """A checkpoint of a model transformers renames since (Gemma-3 with a vision tower: the quantizer's
    ``language_model.model.layers.*`` is ``model.language_model.layers.*`` now): config groups match the names the
    checkpoint holds, so the MLP's group of its own (group 64 by pattern) is read as written."""
    import transformers

    text = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=64, sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=255)
    renames = [("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head.")]

    def stored_name(name):
        return next((name.replace(new, old, 1) for new, old in renames if name.startswith(new)), name)

    path = tmp_path / "c"
    reference = cw.write_model(path, cw.random_model(config), "compressed-tensors", 32, sym=True,
                               not_convert=["model.vision_tower", "model.multi_modal_projector", "lm_head"],
                               stored_name=stored_name, group_size_of=lambda n: 64 if ".mlp." in n else 32)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    group = qc["config_groups"]["group_0"]
    qc["config_groups"]["mlp"] = dict(group, targets=[r"re:language_model\.model\.layers\.\d+\.mlp\..*"],
                                      weights=dict(group["weights"], group_size=64))
    qc["ignore"] = ["language_model.lm_head", "re:vision_tower.*", "re:multi_modal_projector.*"]
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device=device)
    layer = model.model.language_model.layers[0]
    assert layer.mlp.up_proj.group_size == 64 and layer.self_attn.q_proj.group_size == 32
    ids = torch.tensor([[3, 17, 200]])
    with torch.no_grad():
        got = model(input_ids=ids.to(device)).logits.float().cpu()
        want = cw.reference_model(config, reference)(input_ids=ids).logits.float()
    assert float((got - want).norm() / want.norm()) < TOL
