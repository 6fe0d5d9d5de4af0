"""``--checkpoint DIR`` of ``tilegemm bench --op w4a16 --model llama`` and ``examples/llama_decode.py``: the int4
model loaded with from_pretrained, against the same model in fp16 holding its dequantized weights; and the
Llama-3-8B checkpoint tool at a tiny size."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from conftest import HERE  # noqa: E402
from tilegemm.cli import main  # noqa: E402
from tilegemm.core.runtime import interpreting  # noqa: E402
from tilegemm.models.pretrained import dequantized_copy, from_pretrained  # noqa: E402
from tilegemm.nn import Int4Linear  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """The tool's tiny Llama of one decoder layer (each layer of a forward under the interpreter costs as much as
    the first): GPTQ v2, act-order, asymmetric, g32 (random 4-bit values, no float weights)."""
    path = tmp_path_factory.mktemp("tool") / "tiny"
    tool = _load("tools/write_w4_checkpoint.py", "write_w4_checkpoint")
    assert tool.main(["--out", str(path), "--tiny", "--layers", "1", "--act-order", "--v2", "--asym"]) == 0
    return path


def test_the_tool_writes_a_loadable_checkpoint(tiny_ckpt, tmp_path):
    tool = _load("tools/write_w4_checkpoint.py", "write_w4_checkpoint")
    assert tool.main(["--out", str(tmp_path / "tiny"), "--tiny", "--act-order", "--v2", "--asym"]) == 0
    cfg = json.loads((tmp_path / "tiny" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["desc_act"], q["sym"], q["checkpoint_format"]) == \
        ("gptq", 4, 32, True, False, "gptq_v2")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2  # --tiny's default
    assert json.loads((tiny_ckpt / "config.json").read_text())["num_hidden_layers"] == 1  # --layers
    model = from_pretrained(tmp_path / "tiny", device="cpu")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 14 and all(m.perm.numel() == m.in_features for m in layers)  # act-order kept
    zeros = torch.cat([m.zeros.flatten() for m in layers])
    assert zeros.min() >= 5 and zeros.max() <= 10  # the tool's zeros (5..10), read as v2 (no + 1)


def test_the_tool_writes_qwen2_with_biases(tmp_path):
    tool = _load("tools/write_w4_checkpoint.py", "write_w4_checkpoint")
    assert tool.main(["--out", str(tmp_path / "q"), "--tiny", "--arch", "qwen2", "--method", "awq"]) == 0
    model = from_pretrained(tmp_path / "q", device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Int4Linear) and q.bias is not None and q.bias.abs().sum() > 0
    assert tool.main(["--out", str(tmp_path / "q"), "--tiny"]) == 2  # refuses to write over a checkpoint


def test_the_tool_writes_compressed_tensors(tmp_path):
    tool = _load("tools/write_w4_checkpoint.py", "write_w4_checkpoint")
    assert tool.main(["--out", str(tmp_path / "c"), "--tiny", "--method", "compressed-tensors", "--asym",
                      "--act-order"]) == 0
    q = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    model = from_pretrained(tmp_path / "c", device="cpu")
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.perm.numel() == down.in_features
    assert down.zeros.min() >= 5 and down.zeros.max() <= 10  # the tool's unsigned zeros, 5..10


@pytest.mark.parametrize("method, sym, act_order, v2, group", [
    ("gptq", True, False, False, 128), ("gptq", False, True, False, 64), ("gptq", False, False, True, -1),
    ("awq", False, False, False, 128), ("compressed-tensors", True, True, False, 64),
    ("compressed-tensors", False, False, False, 128)])
def test_random_linears_have_mean_zero_and_the_asked_spread(method, sym, act_order, v2, group):
    # a mean of half a step had made a Llama-3-8B-shaped checkpoint's fp16 logits overflow
    gen = torch.Generator().manual_seed(1)
    t = cw.random_linear(512, 1024, method, group, sym, act_order, v2, gen, std=0.02)
    w = cw.dequantize_stored(t, method, group, v2).float()
    assert abs(float(w.mean())) < 2e-4 and 0.017 < float(w.std()) < 0.023
    assert float(w.mean(1).abs().mean()) < 1.2e-3  # no row biased either (half a step: about 2.2e-3)


def test_dequantized_copy_shares_all_but_the_int4_weights(tiny_ckpt):
    int4 = from_pretrained(tiny_ckpt, device=HERE)
    dense = dequantized_copy(int4)
    assert not any(isinstance(m, Int4Linear) for m in dense.modules())
    assert dense.model.embed_tokens.weight is int4.model.embed_tokens.weight  # shared, not copied
    assert dense.lm_head.weight is int4.lm_head.weight
    q, d = int4.model.layers[0].mlp.down_proj, dense.model.layers[0].mlp.down_proj
    assert torch.equal(d.weight, q.dequantize())
    ids = torch.tensor([[1, 2, 3]], device=HERE)
    with torch.no_grad():
        a, b = int4(input_ids=ids).logits.float(), dense(input_ids=ids).logits.float()
    assert float((a - b).norm() / b.norm()) < 3e-3


@pytest.mark.skipif(not interpreting(), reason="the interpreter's tiny sweep")
@pytest.mark.parametrize("file_name", ["model.safetensors", "gptq_model-4bit-32g.safetensors"])
def test_bench_model_llama_from_a_checkpoint(tiny_ckpt, tmp_path, file_name):
    # (the weights in a file of an older quantizer's name: found as from_pretrained finds them)
    if file_name != "model.safetensors":
        import shutil

        tiny_ckpt = shutil.copytree(tiny_ckpt, tmp_path / "tiny")
        os.rename(tiny_ckpt / "model.safetensors", tiny_ckpt / file_name)
    out = tmp_path / "r.json"
    # (a batch of 3: the interpreter runs 1 or 2 rows through its slower one-row kernel)
    assert main(["bench", "--op", "w4a16", "--model", "llama", "--checkpoint", str(tiny_ckpt), "--shape", "3",
                 "--quiet", "--no-save", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "the checkpoint tiny (LlamaForCausalLM" in data["meta"]["model_description"]
    assert "GPTQ v2, act-order, 4-bit, group 32" in data["meta"]["model_description"]
    rows = data["rows"]
    assert [r["kernel"] for r in rows] == ["baseline", "auto"] and rows[0]["dims"]["config"] == "checkpoint"
    for r in rows:
        assert r["status"] == "ok" and r["rel_err"] <= r["tolerance"], r


@pytest.mark.parametrize("argv, needle", [
    (["--op", "w4a16", "--checkpoint", "x"], "--checkpoint names the model to load: give it with --model"),
    (["--op", "conv2d", "--model", "resnet50", "--checkpoint", "x"], "--checkpoint does not apply to --model resnet50"),
    (["--op", "w4a16", "--model", "llama", "--checkpoint", "/nonexistent/dir"],
     "--checkpoint: no checkpoint directory at '/nonexistent/dir'"),
])
def test_bench_checkpoint_errors(argv, needle, capsys):
    assert main(["bench", *argv, "--quiet", "--no-save"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "incomplete"])
def test_bench_refuses_a_damaged_checkpoint_in_one_line(tiny_ckpt, tmp_path, damage, capsys):
    # read at the first case, not before: a damaged file or a missing tensor is a usage error (exit 2), no traceback
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "damaged"
    shutil.copytree(tiny_ckpt, path)
    weights = path / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:6])
        needle = "is not a readable safetensors file"
    else:
        tensors = load_file(weights)
        save_file({k: v for k, v in tensors.items() if "q_proj" not in k}, weights, metadata={"format": "pt"})
        needle = "lacks tensor(s) the model needs"
    assert main(["bench", "--op", "w4a16", "--model", "llama", "--checkpoint", str(path), "--shape", "3",
                 "--quiet", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert "tilegemm: error: --checkpoint: " in err and needle in err and "Traceback" not in err


def test_example_decodes_a_checkpoint(tiny_ckpt, capsys):
    example = _load("examples/llama_decode.py", "llama_decode")
    # (a batch of 3: the interpreter runs 1 or 2 rows through its slower one-row kernel)
    assert example.main(["--tiny", "--checkpoint", str(tiny_ckpt), "--batches", "3", "--prompt", "4",
                         "--new", "2"]) == 0
    out = capsys.readouterr().out
    assert f"LlamaForCausalLM from {tiny_ckpt} (gptq)" in out and "7 Linears" in out
    line = next(l for l in out.splitlines() if l.startswith("int4 vs fp16-dequantized"))
    assert float(line.split("rel. error ")[1].split(",")[0]) < 1e-2, line
    assert example.main(["--tiny", "--checkpoint", "/nonexistent/dir"]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err
