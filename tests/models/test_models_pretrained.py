"""tilegemm.models.from_pretrained and tilegemm.nn.load_quantized_: 4-bit GPTQ / AWQ checkpoint directories written by
the tests' own writer (ckpt_writer.py), loaded and checked against a plain-torch model holding the weights they
stand for."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from loaded_checks import assert_loaded_exactly  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from tilegemm.core.runtime import interpreting  # noqa: E402
from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.models import pretrained  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_  # noqa: E402
from tilegemm.ops.w4a16.dispatch import keeps_fragments  # noqa: E402

IDS = torch.tensor([[3, 17, 200]])  # a forward of three tokens
TOL = 3e-3  # fp16 activations through two layers against the fp32 model of the same weights: 7e-4 seen
# The checkpoints of one decoder layer unless a test needs a second: each layer's Linears load alike, and every
# layer of a forward under the interpreter costs as much as the first.


def _logits(model, device):
    with torch.no_grad():
        return model(input_ids=IDS.to(device)).logits.float().cpu()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _write(tmp_path, arch="llama", tie=False, hidden=128, seed=0, layers=1, **kw):
    config = cw.tiny_config(arch, hidden=hidden, layers=layers, tie=tie)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, cw.random_model(config, seed), seed=seed, **kw)
    return path, config, reference


CASES = {  # name: (arch, tie, writer options)
    "gptq-v1-asym-g32": ("llama", False, dict(method="gptq", group_size=32, sym=False)),
    "gptq-v1-sym-g128-sharded": ("llama", False, dict(method="gptq", group_size=128, sym=True, shard_bytes=60_000)),
    "gptq-v2-asym-actorder-g64-sharded": ("llama", False, dict(method="gptq", group_size=64, sym=False,
                                                               act_order=True, v2=True, shard_bytes=60_000)),
    "gptq-v1-sym-actorder-wholeK": ("llama", False, dict(method="gptq", group_size=-1, sym=True, act_order=True)),
    "awq-g128": ("llama", False, dict(method="awq", group_size=128)),
    "awq-g32-sharded": ("llama", False, dict(method="awq", group_size=32, shard_bytes=60_000)),
    "qwen2-tied-bias-gptq-v2-g64": ("qwen2", True, dict(method="gptq", group_size=64, sym=True, v2=True)),
    "qwen2-tied-bias-awq-wholeK-sharded": ("qwen2", True, dict(method="awq", group_size=-1, shard_bytes=60_000)),
}
# Cases whose loaded layers differ from another case's in the stored format only (loaded, every format is one 4-bit
# layout, checked exactly against the writer's weights): the forward under the interpreter is that other case's.
RUN_BY = {"awq-g128": "gptq-v1-sym-g128-sharded", "awq-g32-sharded": "gptq-v1-asym-g32"}


@pytest.mark.parametrize("name", list(CASES))
def test_loaded_model_matches_its_dequantized_weights(tmp_path, device, name):
    arch, tie, kw = CASES[name]
    path, config, reference = _write(tmp_path, arch, tie, **kw)
    if kw.get("shard_bytes"):
        assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 2
    model = from_pretrained(path, device=device)
    assert not model.training
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 7 * config.num_hidden_layers  # q, k, v, o, gate, up, down per layer; lm_head stays
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float16
    assert all(m.qweight.device.type == device for m in int4.values())
    group = 128 if kw["group_size"] == -1 else kw["group_size"]  # whole K: 128 for q/k/v/o/gate/up (hidden 128)
    q = model.model.layers[0].self_attn.q_proj
    assert q.group_size == kw["group_size"] or (kw["group_size"] == -1 and q.scales.shape[0] == 1), q
    assert q.scales.shape[0] == 128 // group
    # act-order: the inputs sorted by group once (a single group, whole K, needs no order)
    assert (q.perm.numel() == 128) == (kw.get("act_order", False) and kw["group_size"] != -1)
    if arch == "qwen2":
        assert q.bias is not None and torch.equal(q.bias.cpu(), reference["model.layers.0.self_attn.q_proj.bias"])
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again after loading
    # Each Linear computes with exactly the writer's dequantized weight, and holds the fragment layout only where
    # the fragment kernel runs (a Hopper GPU; elsewhere it would double the 4-bit memory)
    for n, m in int4.items():
        assert torch.equal(m.dequantize().cpu(), reference[f"{n}.weight"]), n
        w = m.weight
        assert bool(m.fweight.numel()) == keeps_fragments(w.group_k, m.qweight.device, m.in_features), n
    if name in RUN_BY and interpreting():
        assert RUN_BY[name] in CASES and RUN_BY[name] not in RUN_BY
        assert_loaded_exactly(model, reference)
        return
    ref = cw.reference_model(config, reference)
    err = _rel(_logits(model, device), _logits(ref, "cpu"))
    assert err < TOL, f"{name}: logits rel. error {err:.2e}"


def test_v2_and_v1_zeros_differ_by_one(tmp_path, device):
    """A v2 checkpoint read as v1 (the zero offset of one) gives another model: the format key matters."""
    path, config, reference = _write(tmp_path, method="gptq", group_size=64, v2=True)
    good = from_pretrained(path, device=device)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq"
    (path / "config.json").write_text(json.dumps(cfg))
    wrong = from_pretrained(path, device=device)
    a, b = good.model.layers[0].mlp.up_proj, wrong.model.layers[0].mlp.up_proj
    assert torch.equal(a.zeros + 1, b.zeros)
    assert not torch.equal(a.dequantize(), b.dequantize())


def test_gptq_without_g_idx_and_format_key(tmp_path, device):
    """No g_idx (optional without act-order) and no checkpoint_format key (v1, as older checkpoints say)."""
    config = cw.tiny_config("llama", hidden=64)
    model = cw.random_model(config)
    drop = [f"{n}.g_idx" for n in cw.linear_names(model)]
    reference = cw.write_model(tmp_path / "c", model, "gptq", 32, drop=drop, quant_extra=dict(format_key=False))
    assert "checkpoint_format" not in json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    loaded = from_pretrained(tmp_path / "c", device=device)
    for n, m in loaded.named_modules():
        if isinstance(m, Int4Linear):
            assert torch.equal(m.dequantize().cpu(), reference[f"{n}.weight"]), n


def test_modules_to_not_convert(tmp_path, device):
    path, config, reference = _write(tmp_path, method="gptq", group_size=32, not_convert=["mlp.down_proj"])
    model = from_pretrained(path, device=device)
    for layer in model.model.layers:
        assert type(layer.mlp.down_proj) is torch.nn.Linear and isinstance(layer.mlp.up_proj, Int4Linear)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 6 * config.num_hidden_layers
    last = config.num_hidden_layers - 1
    assert torch.equal(model.model.layers[last].mlp.down_proj.weight.cpu(),
                       reference[f"model.layers.{last}.mlp.down_proj.weight"])
    assert_loaded_exactly(model, reference)


def test_a_not_converted_module_stored_quantized_is_refused(tmp_path):
    path, _, _ = _write(tmp_path, hidden=64, layers=2, method="gptq", group_size=32)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["o_proj"]
    (path / "config.json").write_text(json.dumps(cfg))
    # the rule and the entry named, as for expert Linears
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj is in quantization_config\."
                                         r"modules_to_not_convert \('o_proj'\) but the checkpoint stores it quantized "
                                         r"\(model\.layers\.0\.self_attn\.o_proj\.qweight\)"):
        from_pretrained(path, device="cpu")
    # an entry naming a module around the Linears by the end of its name (as transformers' own match takes it)
    cfg["quantization_config"]["modules_to_not_convert"] = ["layers.1.self_attn"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj is in quantization_config\."
                                         r"modules_to_not_convert \('layers\.1\.self_attn'\) but the checkpoint "
                                         r"stores it quantized") as info:
        from_pretrained(path, device="cpu")
    assert "layers.0" not in str(info.value)


def test_modules_to_not_convert_names_a_module_or_one_around_it():
    names = ("mlp.experts", "layers.1", "gate", "model.layers.2.moe.experts.0.down_proj", "lm_head")
    for name in ("model.layers.0.mlp.experts.3.up_proj", "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate",
                 "model.layers.2.moe.experts.0.down_proj", "lm_head", "model.layers.4.mlp.experts"):
        assert pretrained._not_converted(name, names), name
    # at dots only: mlp.gate is no gate_proj, layers.1 no layers.11, an expert's down_proj not another's
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.11.self_attn.o_proj",
                 "model.layers.2.moe.experts.1.down_proj", "model.layers.0.mlp.shared_experts.up_proj",
                 "model.lm_head_norm"):
        assert not pretrained._not_converted(name, names), name
    # regular expressions, as transformers reads the list: from the name's start up to a dot
    patterns = ("model.layers.[01].mlp", r"model\.layers\.\d+\.self_attn\.(q|k)_proj", "bad[regex")
    for name in ("model.layers.0.mlp.up_proj", "model.layers.1.mlp.experts.2.down_proj",
                 "model.layers.7.self_attn.k_proj"):
        assert pretrained._not_converted(name, patterns), name
    for name in ("model.layers.2.mlp.up_proj", "model.layers.0.mlp_norm", "model.layers.7.self_attn.v_proj",
                 "model.layers.10.mlp.up_proj", "bad"):
        assert not pretrained._not_converted(name, patterns), name


def test_load_quantized_into_a_user_built_model(tmp_path, device):
    path, config, reference = _write(tmp_path, "qwen2", True, method="awq", group_size=64)
    import transformers

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config).half().to(device).eval()  # other weights
    out = load_quantized_(model, path)
    assert out is model
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7 * config.num_hidden_layers
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.norm.weight.cpu(), reference["model.norm.weight"])
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_load_quantized_into_a_model_built_on_meta(tmp_path, device):
    # torch.device("meta") puts the rotary tables on meta too: computed by transformers' own initialisation
    path, config, reference = _write(tmp_path, method="gptq", group_size=32)
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    load_quantized_(model, path, device=device)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    err = _rel(_logits(model.eval(), device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL


def test_a_meta_buffer_nothing_computes_is_refused_first(tmp_path):
    path, config, _ = _write(tmp_path, method="gptq", group_size=32)
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.model.norm.register_buffer("extra", torch.empty(3, device="meta"))  # beside parameters: not initialised
    with pytest.raises(ValueError, match=r"on the meta device and the checkpoint does not hold them: "
                                         r"model\.norm\.extra; build the model with only its parameters"):
        load_quantized_(model, path, device="cpu")
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # nothing changed


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_loading_streams_packed_tensors_only(tmp_path, monkeypatch, method):
    """Loading reads each stored tensor once, one at a time, and makes no 16-bit weight of a quantized Linear:
    every float tensor made while loading is smaller than those weights, and the built layers hold packed parts
    (int32 nibbles, [G, N] scales and zeros) only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    config = cw.tiny_config("llama", hidden=128)
    config.vocab_size = 96  # no plain tensor as large as a quantized weight (128 x 128 and up)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), method, 64, act_order=True)
    with pretrained._parameters_on_meta():
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(config).half()
    reads = []
    get = pretrained._Tensors.get
    monkeypatch.setattr(pretrained._Tensors, "get", lambda self, name: reads.append(name) or get(self, name))
    smallest = 128 * 128

    class Floats(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                    Floats.largest = max(Floats.largest, t.numel())
            return out

    with Floats():
        load_quantized_(model, path, device="cpu")
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        stored = sorted(f.keys())
    assert sorted(reads) == stored  # each once
    assert Floats.largest < smallest, Floats.largest
    for m in model.modules():
        if isinstance(m, Int4Linear):
            N, K = m.out_features, m.in_features
            for name, t in [*m.named_buffers(), *m.named_parameters()]:
                assert not (t.is_floating_point() and t.numel() >= N * K), (name, t.shape)
            assert m.qweight.dtype == torch.int32 and m.qweight.numel() == N * K // 8


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A small valid GPTQ checkpoint, copied by the tests that break it."""
    path = tmp_path_factory.mktemp("good") / "ckpt"
    cw.write_model(path, cw.random_model(cw.tiny_config("llama", hidden=64)), "gptq", 32)
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_quant(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg["quantization_config"].pop(k, None)
        else:
            cfg["quantization_config"][k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_not_a_directory(tmp_path, good):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is not a directory"):
        from_pretrained(good / "config.json")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        from_pretrained(3)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "a directory"])
def test_a_damaged_safetensors_file_is_named(tmp_path, good, damage):
    # safetensors' own error ("Error while deserializing header: ...", or "No such device" for a directory)
    # names no file
    path = _copy(good, tmp_path / "c")
    st = path / "model.safetensors"
    if damage == "truncated":
        with open(st, "r+b") as f:
            f.truncate(1000)
    elif damage == "a directory":
        st.unlink()
        st.mkdir()
    else:
        st.write_text("garbage" if damage == "garbage" else "")
    with pytest.raises(ValueError, match=r"model.safetensors' is not a readable safetensors file"):
        from_pretrained(path, device="cpu")


def test_no_config_and_no_quantization_config(tmp_path, good):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        from_pretrained(empty)
    path = _copy(good, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no quantization_config: not a quantized checkpoint"):
        from_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        from_pretrained(path)


@pytest.mark.parametrize("changes, message", [
    (dict(bits=8), r"bits = 8; tilegemm loads 4-bit checkpoints only"),
    (dict(quant_method="bitsandbytes"), r"quant_method 'bitsandbytes' is not supported; supported: 'gptq', 'awq'"),
    (dict(quant_method="awq", version="gemv"), r"AWQ quantization_config\.version 'gemv' is not supported; only 'gemm'"),
    (dict(checkpoint_format="marlin"), r"GPTQ checkpoint_format 'marlin' is not supported; supported: 'gptq', "
                                       r"'gptq_v2'"),
    (dict(group_size=0), r"group_size must be a positive integer or -1"),
])
def test_unsupported_quantization_configs(tmp_path, good, changes, message):
    path = _copy(good, tmp_path / "c")
    _edit_quant(path, **changes)
    with pytest.raises(ValueError, match=message):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_whole_numbers_written_as_floats_are_read_as_integers(method):
    # JSON writers that keep every number a float write 4.0 and 128.0; a fraction stays refused
    from tilegemm.models import pretrained
    q = cw.quantization_config(method, 128)
    if method == "compressed-tensors":
        weights = q["config_groups"]["group_0"]["weights"]
        weights["group_size"], weights["num_bits"] = 128.0, 4.0
    else:
        q["group_size"], q["bits"] = 128.0, 4.0
    got = pretrained.quant_config({"quantization_config": q})
    assert got.group_size == 128 and type(got.group_size) is int
    if method == "compressed-tensors":
        weights["group_size"] = 127.5
    else:
        q["group_size"] = 127.5
    with pytest.raises(ValueError, match=r"group_size.*127\.5"):
        pretrained.quant_config({"quantization_config": q})


def test_a_group_size_the_kernels_do_not_take(tmp_path):
    config = cw.tiny_config("llama", hidden=64)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 16)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: group_size 16 is not a group length "
                                         r"the kernels take, and no group length the kernels take \(32, 64, 128, "
                                         r"256\) divides gcd\(64, 16\) = 16"):
        from_pretrained(path, device="cpu")


def test_missing_tensors_are_named(tmp_path):
    config = cw.tiny_config("llama", hidden=64)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, shard_bytes=20_000,
                   drop=("model.layers.1.mlp.up_proj.qzeros", "model.norm.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) the model needs: .*model\.layers\.1\.mlp\.up_proj\.qzeros"
                                         r".*model\.norm\.weight"):
        from_pretrained(path, device="cpu")
    # act-order needs g_idx
    path2 = tmp_path / "d"
    cw.write_model(path2, cw.random_model(config), "gptq", 32, act_order=True,
                   drop=("model.layers.0.self_attn.k_proj.g_idx",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.g_idx"):
        from_pretrained(path2, device="cpu")
    # a shard the index names is gone; no tensor files at all
    os.remove(next(path.glob("model-00001-of-*.safetensors")))
    with pytest.raises(FileNotFoundError, match=r"lists shard\(s\) missing from .*model-00001-of-"):
        from_pretrained(path, device="cpu")
    os.remove(path / "model.safetensors.index.json")
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json"):
        from_pretrained(path, device="cpu")


def test_shapes_that_do_not_match_are_named(tmp_path):
    config = cw.tiny_config("llama", hidden=64)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, config_extra=dict(intermediate_size=256))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.qweight: the checkpoint's shape \[8, 128\] "
                                         r"does not match \[8, 256\]"):
        from_pretrained(path, device="cpu")
    path2 = tmp_path / "d"
    cw.write_model(path2, cw.random_model(config), "awq", 32, config_extra=dict(vocab_size=320))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: the checkpoint's shape \[256, 64\] does not "
                                         r"match the model's \[320, 64\]"):
        from_pretrained(path2, device="cpu")


def test_tensors_for_modules_the_model_lacks(tmp_path):
    """A config of one layer over a two-layer checkpoint: quantized tensors without a Linear are an error; plain
    ones a warning naming them."""
    config = cw.tiny_config("llama", hidden=64)
    path = tmp_path / "c"
    cw.write_model(path, cw.random_model(config), "gptq", 32, config_extra=dict(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"quantized tensor\(s\) for modules the model has no Linear of: "
                                         r"model\.layers\.1\.mlp\.down_proj\.qweight"):
        from_pretrained(path, device="cpu")
    path2 = tmp_path / "d"
    cw.write_model(path2, cw.random_model(config), "gptq", 32,
                   not_convert=["model.layers.1"], config_extra=dict(num_hidden_layers=1))
    with pytest.warns(UserWarning, match=r"tensor\(s\) of the checkpoint match nothing in the model and were "
                                         r"skipped: model\.layers\.1\."):
        model = from_pretrained(path2, device="cpu")
    assert len(model.model.layers) == 1


def test_bad_arguments(good):
    with pytest.raises(TypeError, match="dtype must be torch.float16, torch.bfloat16 or 'auto'"):
        from_pretrained(good, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype must be torch.float16, torch.bfloat16 or 'auto'"):
        from_pretrained(good, dtype="float32")


@pytest.mark.parametrize("device, error, words", [
    ("bogus", ValueError, "device 'bogus' is not a device"),
    (["cpu"], TypeError, "device must be a torch.device, a str .* got list"),
    ("meta", ValueError, "device 'meta' cannot hold the checkpoint's tensors"),
    pytest.param("cuda", ValueError, "device 'cuda': no CUDA GPU is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")),
])
def test_bad_devices_are_named_before_loading(good, device, error, words, monkeypatch):
    # refused where the device is resolved, before a tensor is read (not torch's parse error, an assert from
    # torch.cuda, or safetensors' refusal of meta half-way through the load)
    monkeypatch.setattr(pretrained, "_Tensors", None)  # reading anything would fail otherwise
    with pytest.raises(error, match=words):
        from_pretrained(good, device=device)
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cw.tiny_config("llama", hidden=64))
    with pytest.raises(error, match=words):
        load_quantized_(model, good, device=device)


def test_load_quantized_takes_dtype_auto(tmp_path, good):
    # 'auto' is what the dtype error offers: load_quantized_ reads it from the config, as from_pretrained does
    path = _copy(good, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cw.tiny_config("llama", hidden=64))
    load_quantized_(model, path, dtype="auto", device="cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.up_proj.scales.dtype == torch.bfloat16


def test_fuse_projections_takes_only_a_boolean(good):
    with pytest.raises(TypeError, match="fuse_projections must be True or False, got 'no'"):
        from_pretrained(good, device="cpu", fuse_projections="no")


def test_device_mesh_that_is_no_mesh_is_named(good):
    with pytest.raises(TypeError, match="device_mesh must be a torch.distributed DeviceMesh .* got str"):
        from_pretrained(good, device="cpu", device_mesh="tp")


@pytest.mark.parametrize("named, want", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                         ("float32", torch.float16), (None, torch.float16)])
def test_dtype_auto_reads_the_config(tmp_path, good, named, want):
    path = _copy(good, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = named
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device="cpu", dtype="auto")
    assert model.model.embed_tokens.weight.dtype == want
    if named == "bfloat16":  # a composite config names it in its text part only
        cfg.pop("dtype")
        cfg["text_config"] = {"torch_dtype": named}
        (path / "config.json").write_text(json.dumps(cfg))
        assert pretrained.resolve_dtype("auto", path) == torch.bfloat16
    assert model.model.layers[0].mlp.up_proj.scales.dtype == want
    with pytest.raises(TypeError, match="load_quantized_ takes a torch.nn.Module"):
        load_quantized_("model", good)


class _Stored(dict):
    def get(self, name):  # noqa: D401 - the _Tensors interface the converter reads through
        return self[name]


@pytest.mark.parametrize("method, act_order, v2", [("gptq", True, True), ("gptq", False, False), ("awq", False, False),
                                                   ("compressed-tensors", True, False)])
def test_column_slices_convert_like_the_whole(method, act_order, v2):
    """A large Linear is converted 256-column blocks at a time: the same int4 weight and fragment layout as whole."""
    from tilegemm import w4a16
    from tilegemm.ops.w4a16.format import Int4Weight

    N, K, group = 600, 128, 64
    stored, deq = cw.quantize_linear(torch.randn(N, K) * 0.02, method, group, False, act_order, v2,
                                     torch.Generator().manual_seed(3))
    q = pretrained.QuantConfig(method, group, desc_act=act_order, checkpoint_format="gptq_v2" if v2 else "gptq",
                               sym=False)
    tensors = _Stored({f"p.{k}": v for k, v in stored.items()})
    whole = pretrained._int4_weight(tensors, "p", q, N, K, torch.float16, chunk_weights=10 * N * K)
    parts = pretrained._int4_weight(tensors, "p", q, N, K, torch.float16, chunk_weights=256 * K)  # 3 slices
    assert torch.equal(w4a16.dequantize(whole), deq)
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    assert (parts.perm is None) == (not act_order) and (parts.perm is None or torch.equal(parts.perm, whole.perm))
    fresh = Int4Weight(whole.qweight, whole.scales, whole.zeros, whole.group_size, whole.shape, whole.perm)
    for a, b in zip(parts.fragments(), fresh.fragments()):
        assert torch.equal(a, b)


# Other architectures than the Llama and Qwen2 ones above: the loader matches Linears by name, whatever the model
# (fused projections, biases, other norms; MoE blocks with a shared expert whose one-output gate stays 16-bit, as
# quantizers leave it). (arch, config overrides, modules the writer leaves unquantized) One decoder layer, or two
# where the second is of another kind (a dense layer, then one of experts; Mamba, then attention).
ARCHS = {
    "mistral": ({}, ()),
    "qwen3": ({}, ()),
    "gemma2": (dict(head_dim=32), ()),
    "phi3": (dict(pad_token_id=0), ()),  # fused qkv_proj and gate_up_proj
    "gpt_neox": ({}, ()),  # fused query_key_value with biases
    "olmo2": ({}, ()),
    "qwen2_moe": (dict(moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
                       num_experts_per_tok=2), ("shared_expert_gate",)),
    "olmoe": (dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2), ()),
    # multi-head latent attention, a dense first layer, then routed experts beside a shared one
    "deepseek_v2": (dict(num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=64,
                         qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1,
                         num_hidden_layers=2), ()),
    # experts run by the block's own forward over [E, in, out] weights: loaded into tilegemm's block for it
    "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=64, intermediate_size_mlp=256,
                         head_dim=32, attention_chunk_size=64), ("router",)),
    # its renamings (post_mlp_layernorm -> mlp.post_mlp_layernorm) must leave names in the model's form alone
    "axk1": (dict(num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                  kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                  n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"], num_hidden_layers=2), ()),
    # Mamba layers reading dt_proj's weight directly unless the config says it is quantized; experts every 2nd layer
    "jamba": (dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False,
                   mamba_dt_rank=8, num_hidden_layers=2),
              ("router",)),
    # experts without a gate (up_proj and down_proj, relu2), stored one Linear an expert
    "nemotron_h": (dict(layers_block_type=["full_attention", "moe"], n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, head_dim=32,
                        num_hidden_layers=2), ()),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_other_architectures(tmp_path, device, arch):
    transformers = pytest.importorskip("transformers")
    if arch not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {arch}")
    overrides, keep = ARCHS[arch]
    config = transformers.AutoConfig.for_model(arch, **{
        **dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False), **overrides})
    source = cw.random_model(config)
    not_convert = [n for n, m in source.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(keep)] \
        if keep else []
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, source, method="gptq", group_size=32, sym=False, not_convert=not_convert)
    model = from_pretrained(path, device=device)
    quantized = [n for n in cw.linear_names(source, not_convert=not_convert)]
    int4 = {n for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert int4 and int4 <= set(quantized)  # (a MoE block's experts are stacked, not Int4Linears)
    for n in not_convert:  # (Llama-4's router is a Linear subclass of its own)
        assert isinstance(model.get_submodule(n), torch.nn.Linear), n
    moe_layers = {"deepseek_v2": 1, "axk1": 1, "jamba": 1, "nemotron_h": 1}.get(
        arch, config.num_hidden_layers if "moe" in arch or arch == "llama4_text" else 0)
    stacked = [n for n, _ in model.named_buffers() if n.endswith("_qweight")]
    assert len(stacked) == 2 * moe_layers, stacked  # every block's experts stacked 4-bit: gate/up and down
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"{arch}: logits rel. error {err:.2e}"


def _prefixes(pairs):
    """A stored name from a model's name: the first of ``pairs`` (model prefix, stored prefix) that fits."""
    def stored(name):
        for new, old in pairs:
            if name.startswith(new) or (new.startswith(".") and new in name):
                return name.replace(new, old, 1)
        return name
    return stored


def _phimoe():
    import transformers

    return transformers.AutoConfig.for_model(
        "phimoe", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
        tie_word_embeddings=False)


def _axk1():
    transformers = pytest.importorskip("transformers")
    if "axk1" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no axk1")
    overrides, _ = ARCHS["axk1"]
    # one layer of experts: the norm renamed is theirs (a dense layer has none)
    return transformers.AutoConfig.for_model("axk1", **{
        **dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=64,
               tie_word_embeddings=False, num_attention_heads=4), **overrides,
        **dict(num_hidden_layers=1, mlp_layer_types=["sparse"])})


# Checkpoints whose tensor names transformers >= 5 renames when it loads them (the names on the hub, written before
# the renaming): (config, modules left 16-bit, writer options). Gemma-3's language model under
# "language_model.model." (now "model.language_model."), its vision tower and projector at the top; PhiMoE's
# experts under "block_sparse_moe" with Mixtral's w1/w3/w2 and its router stored as "block_sparse_moe.gate"; AXK1's
# "mlp.post_mlp_layernorm" stored as the layer's "post_mlp_layernorm" (as transformers' save_pretrained writes it).
HUB_NAMED = {
    "gemma3-multimodal": (cw.tiny_gemma3_multimodal_config,
                          ("model.vision_tower", "model.multi_modal_projector", "lm_head"),
                          dict(stored_name=_prefixes([("model.language_model.", "language_model.model."),
                                                      ("model.vision_tower.", "vision_tower."),
                                                      ("model.multi_modal_projector.", "multi_modal_projector."),
                                                      ("lm_head.", "language_model.lm_head.")]))),
    "phimoe": (_phimoe, ("router",), dict(mixtral_names=True,
                                           stored_name=_prefixes([(".mlp.router.", ".block_sparse_moe.gate.")]))),
    "axk1": (_axk1, (), dict(stored_name=_prefixes([(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.")]))),
}


@pytest.mark.parametrize("name", list(HUB_NAMED))
def test_checkpoint_names_transformers_renames(tmp_path, device, name):
    # the loader reads the files under the names transformers itself maps them to
    from safetensors import safe_open

    make, keep, kw = HUB_NAMED[name]
    config = make()
    source = cw.random_model(config)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, source, method="gptq", group_size=32, not_convert=keep, **kw)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert not any(k.startswith("model.language_model.") or ".mlp.router." in k or ".mlp.post_mlp_layernorm." in k
                   for k in stored)  # older names
    model = from_pretrained(path, device=device)
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"{name}: logits rel. error {err:.2e}"


def test_modules_to_not_convert_names_dense_linears_as_the_checkpoint_holds_them(tmp_path, device):
    # Gemma-3's language model stored under the quantizer's names (language_model.model.layers.*; the model says
    # model.language_model.layers.*): an entry naming a Linear, or a module around it, by its stored name is taken
    # as an entry by the model's name is (as the experts' are). It was checked against the model's names only, and
    # a Linear it named that the checkpoint stores quantized loaded 4-bit without a word.
    make, keep, kw = HUB_NAMED["gemma3-multimodal"]
    config = make()
    path = tmp_path / "ckpt"
    cw.write_model(path, cw.random_model(config), method="gptq", group_size=32, not_convert=keep, **kw)
    cfg = json.loads((path / "config.json").read_text())

    def refused(entries):
        cfg["quantization_config"]["modules_to_not_convert"] = entries
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError) as info:
            from_pretrained(path, device="cpu")
        return [line.strip() for line in str(info.value).splitlines()[1:]]

    assert refused(["language_model.model.layers.0.self_attn.o_proj"]) == [
        "model.language_model.layers.0.self_attn.o_proj (stored as language_model.model.layers.0.self_attn.o_proj) "
        "is in quantization_config.modules_to_not_convert ('language_model.model.layers.0.self_attn.o_proj') but "
        "the checkpoint stores it quantized (language_model.model.layers.0.self_attn.o_proj.qweight)"]
    # a regular expression, as transformers reads it, from the stored name's start
    lines = refused([r"language_model\.model\.layers\.1\.mlp", "vision_tower"])
    assert [line.split(" ")[0] for line in lines] == [f"model.language_model.layers.1.mlp.{p}"
                                                      for p in ("gate_proj", "up_proj", "down_proj")]
    assert all(r"modules_to_not_convert ('language_model\.model\.layers\.1\.mlp')" in line for line in lines)
    # named by its stored name and stored 16-bit, as the entry says: a plain Linear
    path = tmp_path / "dense"
    o_proj = "model.language_model.layers.0.self_attn.o_proj"
    reference = cw.write_model(path, cw.random_model(config), method="gptq", group_size=32,
                               not_convert=(*keep, o_proj), **kw)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["language_model.model.layers.0.self_attn.o_proj"]
    (path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(path, device=device)
    layer = model.model.language_model.layers[0]
    assert type(layer.self_attn.o_proj) is torch.nn.Linear and isinstance(layer.self_attn.q_proj, Int4Linear)
    assert torch.equal(layer.self_attn.o_proj.weight.cpu(), reference[f"{o_proj}.weight"])


def test_gpt2_conv1d_layers_load(tmp_path, device):
    # GPT-2's Conv1D layers (weight [in, out]) stored as GPTQ Linears become Int4Linears
    import transformers

    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, n_positions=64, vocab_size=256)
    source = cw.random_model(config)
    path = tmp_path / "ckpt"
    reference = cw.write_model(path, source, method="gptq", group_size=32)
    model = from_pretrained(path, device=device)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * config.n_layer  # c_attn, c_proj, c_fc, ..
    err = _rel(_logits(model, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"logits rel. error {err:.2e}"
    dense = pretrained.dequantized_copy(model)  # Conv1D again, with [in, out] weights
    err = _rel(_logits(dense, device), _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"dequantized copy: logits rel. error {err:.2e}"


def test_dynamic_per_module_overrides(tmp_path, device):
    # GPTQModel's "dynamic": the down projections in group 64 (the rest 32), the o projections left 16-bit by a
    # negative pattern
    config = cw.tiny_config("llama", layers=1)
    source = cw.random_model(config)
    path = tmp_path / "ckpt"
    dynamic = {r"+:.*down_proj": {"group_size": 64}, r"-:.*\.o_proj": {}}
    reference = cw.write_model(path, source, method="gptq", group_size=32, not_convert=["o_proj"],
                               group_size_of=lambda n: 64 if n.endswith("down_proj") else 32,
                               quant_extra=dict(dynamic=dynamic))
    model = from_pretrained(path, device=device)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.group_size == 64 and layer.mlp.up_proj.group_size == 32
    assert type(layer.self_attn.o_proj) is torch.nn.Linear
    assert_loaded_exactly(model, reference)


@pytest.mark.parametrize("dynamic, needle", [
    ({r".*down_proj": {"bits": 8}}, r"model.layers.0.mlp.down_proj: stored with bits = 8 \(quantization_config"),
    ({r"-:.*up_proj": {}}, r"model\.layers\.0\.mlp\.up_proj is left 16-bit by the pattern '-:\.\*up_proj' of "
                           r"quantization_config\.dynamic but the checkpoint stores it quantized"),
    ({r"+:(": {}}, r"dynamic pattern '\+:\(' is not a regular expression"),
    ({r".*": {"group_size": 0}}, r"dynamic\['.\*'\]: group_size must be a positive integer or -1, got 0"),
    ([".*"], "dynamic must be a JSON object"),
])
def test_dynamic_refusals(tmp_path, dynamic, needle):
    path, _, _ = _write(tmp_path, method="gptq", group_size=32, quant_extra=dict(dynamic=dynamic))
    with pytest.raises(ValueError, match=needle) as info:
        from_pretrained(path, device="cpu")
    assert "no Linear of" not in str(info.value)  # (a refused layer's tensors are not reported again as strays)


def test_marlin_flag_refused(tmp_path):
    path, _, _ = _write(tmp_path, method="gptq", group_size=32, quant_extra=dict(is_marlin_format=True))
    with pytest.raises(ValueError, match="checkpoint_format 'marlin' is not supported"):
        from_pretrained(path, device="cpu")


def _words16(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit ``values`` packed four to an int16 along ``dim``, value i in bits 4i..4i+3 (GPTQModel's packing with
    pack_dtype int16)."""
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], -1, 4)
    words = sum((v[..., i] & 15) << (4 * i) for i in range(4))
    return torch.where(words >= 2**15, words - 2**16, words).to(torch.int16).movedim(-1, dim).contiguous()


def test_gptqmodel_pack_dtype(tmp_path, device):
    # GPTQModel writes pack_dtype: "int32" (its default) loads; another word width packs qweight/qzeros in int16
    # (int8, int64) words, which is refused by name instead of as mismatched shapes
    from safetensors.torch import load_file, save_file

    path, config, reference = _write(tmp_path, method="gptq", group_size=32, quant_extra=dict(pack_dtype="int32"))
    assert_loaded_exactly(from_pretrained(path, device=device), reference)
    tensors = load_file(str(path / "model.safetensors"))
    for k in [k for k in tensors if k.endswith(".qweight")]:
        tensors[k] = _words16(cw.unpack_along_k(tensors[k]), 0)
    for k in [k for k in tensors if k.endswith(".qzeros")]:
        tensors[k] = _words16(cw.unpack_along_n(tensors[k]), 1)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _edit_quant(path, pack_dtype="int16")
    with pytest.raises(ValueError, match=r"pack_dtype 'int16' is not supported; tilegemm reads 4-bit values packed "
                                         r"eight to an int32 \(pack_dtype 'int32'\)"):
        from_pretrained(path, device="cpu")


def test_a_stored_bias_the_layer_lacks_is_dropped(tmp_path, device):
    # some exporters store a (zero) bias for every quantized Linear: a Llama layer has none, so it is dropped, as
    # transformers drops a tensor the model does not have; a nonzero one says so
    from safetensors.torch import load_file, save_file

    path, config, reference = _write(tmp_path, method="gptq", group_size=32)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128, dtype=torch.float16)
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.ones(64, dtype=torch.float16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"nonzero model\.layers\.0\.self_attn\.k_proj\.bias") as seen:
        model = from_pretrained(path, device=device)
    assert not any("q_proj" in str(w.message) for w in seen)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.bias is None and attention.k_proj.bias is None
    assert_loaded_exactly(model, reference)


JOINED = {  # name: writer options, hidden 64 (act-order: groups of 32 leave two on K = 64 for an order to remain)
    "gptq-v1-asym-g32": dict(method="gptq", group_size=32, sym=False),
    "gptq-v2-asym-actorder-g32-sharded": dict(method="gptq", group_size=32, sym=False, act_order=True, v2=True,
                                              shard_bytes=60_000),
}


@pytest.mark.parametrize("name", list(JOINED))
def test_from_pretrained_with_joined_projections(tmp_path, device, name):
    # fuse_projections=True: act-order down projections absorbed by gate/up, then q/k/v and gate/up joined where
    # they share an input order (the writer draws each dense Linear's order on its own, so act-order ones do not)
    import tilegemm.models
    from tilegemm.nn.fuse import ProjectionPart

    kw = JOINED[name]
    path, config, reference = _write(tmp_path, hidden=64, **kw)
    plain = tilegemm.models.from_pretrained(path, device=device)
    joined = tilegemm.models.from_pretrained(path, device=device, fuse_projections=True)
    layers = config.num_hidden_layers
    if kw.get("act_order"):
        assert len(joined.tilegemm_act_order_absorbed) == layers and joined.tilegemm_fused == []
        assert joined.model.layers[0].mlp.down_proj.perm.numel() == 0
    else:
        assert len(joined.tilegemm_fused) == 2 * layers
        assert isinstance(joined.model.layers[0].self_attn.k_proj, ProjectionPart)
    got = _logits(joined, device)
    assert _rel(got, _logits(plain, device)) < TOL / 4
    err = _rel(got, _logits(cw.reference_model(config, reference), "cpu"))
    assert err < TOL, f"{name}: logits rel. error {err:.2e}"
    with pytest.raises(ValueError, match="fuse_projections=True joins whole weights, device_mesh splits them"):
        tilegemm.models.from_pretrained(path, device=device, fuse_projections=True, device_mesh=object())


@pytest.mark.parametrize("named, want", [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                                         (None, torch.float16)])
def test_dtype_by_name_or_none(good, named, want):
    # torch's and transformers' names of the two dtypes, and None for the default (fp16)
    model = from_pretrained(good, dtype=named, device="cpu")
    assert model.lm_head.weight.dtype == want and model.model.layers[0].self_attn.q_proj.scales.dtype == want


def test_packed_words_stored_unsigned_load_as_their_bits(tmp_path, good):
    # some writers store qweight/qzeros as uint32: the same 32 bits as the int32 GPTQ reads
    from safetensors.torch import load_file, save_file
    path = _copy(good, tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    packed = [k for k in tensors if k.endswith((".qweight", ".qzeros"))]
    assert packed
    save_file({k: v.view(torch.uint32) if k in packed else v for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    got, want = from_pretrained(path, device="cpu"), from_pretrained(good, device="cpu")
    for n, m in want.named_modules():
        if isinstance(m, Int4Linear):
            mine = got.get_submodule(n)
            assert torch.equal(mine.qweight, m.qweight) and torch.equal(mine.zeros, m.zeros), n


def test_a_quantization_config_over_16_bit_tensors_is_refused(tmp_path, good):
    # config.json says GPTQ, every Linear stored as a plain weight: not loaded as a dense model that still claims
    # GPTQ (and would be saved so)
    import transformers
    from safetensors.torch import save_file
    path = _copy(good, tmp_path / "c")
    config = transformers.AutoConfig.from_pretrained(path)
    dense = transformers.AutoModelForCausalLM.from_config(config).half()
    os.remove(path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in dense.state_dict().items() if k != "lm_head.weight" or
               not config.tie_word_embeddings}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"says it is quantized \(GPTQ v1, 4-bit, group 32\) but stores no layer "
                                         r"of the model quantized \(no 'qweight' tensor"):
        from_pretrained(path, device="cpu")


def test_load_quantized_keeps_hooks_training_flags_and_requires_grad(good, device):
    # what quantize_ keeps of a replaced layer (hooks, the training flag) load_quantized_ keeps too, and the
    # 16-bit parameters require grad as they did (transformers' load leaves them so)
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(good)).half().eval()
    model.model.norm.weight.requires_grad_(False)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    load_quantized_(model, good, device=device)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Int4Linear) and not q.training
    assert all(not m.training for m in model.modules())
    assert model.model.embed_tokens.weight.requires_grad and model.model.layers[0].input_layernorm.weight.requires_grad
    assert not model.model.norm.weight.requires_grad
    _logits(model, device)
    assert len(seen) == 1
    loaded = from_pretrained(good, device=device)
    assert loaded.model.embed_tokens.weight.requires_grad and loaded.lm_head.weight.requires_grad
    assert not loaded.model.layers[0].self_attn.q_proj.training


def test_base_model_and_checkpoint_prefixes(tmp_path, good, device):
    # as transformers loads them: AutoModel takes a causal LM's checkpoint (its tensors under "model.", the head
    # left out with a warning), and a causal LM with tied embeddings takes a base model's (no "model." prefix)
    import transformers
    from safetensors.torch import load_file, save_file
    full = from_pretrained(good, device=device)
    with pytest.warns(UserWarning, match=r"LlamaModel is the base model of the checkpoint's; its 1 tensor\(s\) "
                                         r"outside 'model\.' \(the head: lm_head\.weight\) are not loaded"):
        base = from_pretrained(good, device=device, model_class=transformers.AutoModel)
    assert type(base).__name__ == "LlamaModel" and isinstance(base.layers[0].mlp.down_proj, Int4Linear)
    with torch.no_grad():
        ids = IDS.to(device)
        assert torch.equal(base(input_ids=ids).last_hidden_state, full.model(input_ids=ids).last_hidden_state)
    path = tmp_path / "tied"
    config = cw.tiny_config("llama", hidden=64, tie=True)
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    tensors = load_file(path / "model.safetensors")
    save_file({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")},
              path / "model.safetensors", metadata={"format": "pt"})
    stripped = from_pretrained(path, device=device)
    cw.write_model(path, cw.random_model(config), "gptq", 32)
    assert torch.equal(_logits(stripped, device), _logits(from_pretrained(path, device=device), device))
