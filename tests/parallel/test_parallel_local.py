"""Tensor parallelism in one process: each rank's local shard run in turn (simulated ranks), on the device the
kernels use (the CPU under the interpreter, or the GPU), the slices a sharded load reads, and the errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tilegemm
from tilegemm.ops.w4a16.format import Int4Weight, dequantize, pack_cols, pack_rows, from_gptq, quantize

from conftest import assert_rel_close

FP16_TOL = 4e-3


def _weight(N: int, K: int, gs: int, act_order: bool, device) -> Int4Weight:
    if not act_order:
        return quantize(torch.randn(N, K, dtype=torch.float16, device=device) * 0.1, gs)
    q = torch.randint(0, 16, (K, N))
    zeros = torch.randint(0, 15, (K // gs, N))
    scales = (torch.rand(K // gs, N) * 0.02 + 0.005).half()
    g_idx = (torch.arange(K) // gs)[torch.randperm(K)].to(torch.int32)
    return from_gptq(pack_rows(q), pack_cols(zeros), scales, g_idx).to(device)


def _simulated(w: Int4Weight, x: torch.Tensor, world: int, dim: str) -> torch.Tensor:
    """The sharded product, rank by rank: column shards concatenated, row shards' partial sums added."""
    from tilegemm.parallel import shard_int4

    outs = []
    for rank in range(world):
        local, index = shard_int4(w, dim, rank, world)
        if dim == "out":
            xl = x
        elif index is not None:
            xl = x.index_select(-1, index)  # act-order: the inputs the sorted rows multiply
        else:
            xl = x.chunk(world, -1)[rank]
        assert local.shape == ((w.shape[0] // world, w.shape[1]) if dim == "out" else (w.shape[0], w.shape[1] // world))
        outs.append(tilegemm.w4a16.matmul(xl, local))
    return torch.cat(outs, -1) if dim == "out" else torch.stack([o.float() for o in outs]).sum(0).half()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", ["out", "in"])
@pytest.mark.parametrize("act_order", [False, True])
def test_parallel_int4_shards(device, world, dim, act_order):
    w = _weight(32, 256, 32, act_order, device)
    x = torch.randn(3, 256, dtype=torch.float16, device=device)
    ref = (x.double() @ dequantize(w).double().T)
    assert_rel_close(_simulated(w, x, world, dim), ref, FP16_TOL)


def test_parallel_int4_refusals():
    from tilegemm.parallel import shard_int4

    w = quantize(torch.randn(12, 128), 64)
    with pytest.raises(ValueError, match=r"cut quantization groups of group_size = 64"):
        shard_int4(w, "in", 0, 4)  # 32 inputs each
    with pytest.raises(ValueError, match=r"out_features N = 12 does not split evenly over 8 ranks"):
        shard_int4(w, "out", 0, 8)
    with pytest.raises(ValueError, match=r"in_features K = 128 does not split evenly over 3 ranks"):
        shard_int4(w, "in", 0, 3)
    with pytest.raises(ValueError, match=r"group_size = -1"):
        shard_int4(quantize(torch.randn(12, 128), -1), "in", 0, 2)
    with pytest.raises(ValueError, match=r"dim must be 'out'"):
        shard_int4(w, "rows", 0, 2)
    with pytest.raises(TypeError, match="Int4Weight"):
        shard_int4(torch.zeros(4, 4), "out", 0, 2)


def test_parallel_shard_slices():
    from tilegemm.parallel import shard_slices

    # house int4 [K/8, N] / [G, N]; GPTQ qzeros [G, N/8]; AWQ qweight [K, N/8]: rank 1 of 2, N = 64, K = 256, gs 64
    assert shard_slices("qweight", (32, 64), "out", 1, 2) == (slice(None), slice(32, 64))
    assert shard_slices("qweight", (32, 64), "in", 1, 2, 64) == (slice(16, 32),)
    assert shard_slices("scales", (4, 64), "in", 1, 2, 64) == (slice(2, 4),)
    assert shard_slices("gptq.qzeros", (4, 8), "out", 1, 2) == (slice(None), slice(4, 8))  # words of 8 columns
    assert shard_slices("awq.qweight", (256, 8), "in", 1, 2, 64) == (slice(128, 256),)
    assert shard_slices("awq.qweight", (256, 8), "out", 1, 2) == (slice(None), slice(4, 8))
    assert shard_slices("weight", (64, 256), "in", 1, 2) == (slice(None), slice(128, 256))
    assert shard_slices("bias", (64,), "in", 1, 2) is None and shard_slices("bias", (64,), "in", 0, 2) == ()
    assert shard_slices("perm", (256,), "in", 1, 2) == ()
    # the packed words are read whole: a split inside one (N / ranks not a multiple of 8) is refused
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_slices("gptq.qzeros", (4, 2), "out", 0, 4)
    with pytest.raises(ValueError, match="group_size = 128"):
        shard_slices("qweight", (32, 64), "in", 0, 4, 128)
    with pytest.raises(ValueError, match="unknown tensor kind"):
        shard_slices("qscales", (4, 64), "out", 0, 2)


def test_parallel_ct_unset_g_idx_reads_slices(tmp_path):
    """A compressed-tensors layer whose weight_g_idx was never set (every entry -1: the natural order, as
    compressed-tensors reads it) is split along K from its slices, each rank's inputs its own contiguous ones."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import _read_int4_shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    N, K = 64, 256
    t, want = cw.quantize_linear(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05,
                                 "compressed-tensors", 64, sym=False)
    t["weight_g_idx"] = torch.full((K,), -1, dtype=torch.int32)
    save_file({f"l.{k}": v.contiguous() for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    qc = cw.quantization_config("compressed-tensors", 64, sym=False, act_order=True)
    q = pretrained.quant_config({"quantization_config": qc}).for_module("l")
    tensors = pretrained._Tensors(str(tmp_path), torch.device("cpu"))
    for rank in range(2):
        local, index = _read_int4_shard(tensors, "l", q, N, K, "in", rank, 2, torch.float16)
        assert index is None and local.perm is None
        assert torch.equal(dequantize(local), want[:, rank * K // 2:(rank + 1) * K // 2])


@pytest.mark.parametrize("N", [12, 60, 108])
def test_parallel_ct_odd_out_features_split_along_n(tmp_path, N):
    """An asymmetric compressed-tensors Linear whose out_features is not a multiple of 8 (its zero points padded to
    ceil(N/8) words) split along N: each rank gets its own rows' zero points, though they need not start at a word
    (the words cut by ceil(N/8) / ranks gave a rank past the first another's rows)."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import _read_int4_shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    K = 128
    t, want = cw.quantize_linear(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05,
                                 "compressed-tensors", 64, sym=False)
    assert list(t["weight_zero_point"].shape) == [-(-N // 8), 2]
    save_file({f"l.{k}": v.contiguous() for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    q = pretrained.quant_config({"quantization_config": cw.quantization_config("compressed-tensors", 64,
                                                                               sym=False)}).for_module("l")
    tensors = pretrained._Tensors(str(tmp_path), torch.device("cpu"))
    for world in (2, 4):
        n = N // world
        for rank in range(world):
            local, index = _read_int4_shard(tensors, "l", q, N, K, "out", rank, world, torch.float16)
            assert index is None and local.shape == (n, K)
            assert torch.equal(dequantize(local), want[rank * n:(rank + 1) * n].to(torch.float16))


def test_parallel_ct_stored_tensors_checked(tmp_path):
    """A split layer's stored tensors are checked before its slices are read: an asymmetric compressed-tensors
    layer without its zero points is refused (read as symmetric, it would be another weight), as is one without
    its scales or with scales of another group size."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import _read_int4_shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    N, K = 64, 256
    t, _ = cw.quantize_linear(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05,
                              "compressed-tensors", 64, sym=False)
    q = pretrained.quant_config({"quantization_config": cw.quantization_config("compressed-tensors", 64,
                                                                               sym=False)}).for_module("l")
    cases = {"weight_zero_point": (r"lacks l.weight_zero_point", {}),
             "weight_scale": (r"lacks l.weight_scale", {}),
             "": (r"l.weight_scale: the checkpoint's shape \[64, 8\] does not match \[64, 4\]",
                  dict(weight_scale=torch.ones(N, 8, dtype=torch.float16)))}
    for drop, (message, replace) in cases.items():
        path = tmp_path / (drop or "shape")
        path.mkdir()
        stored = {**{k: v for k, v in t.items() if k != drop}, **replace}
        save_file({f"l.{k}": v.contiguous() for k, v in stored.items()}, str(path / "model.safetensors"))
        tensors = pretrained._Tensors(str(path), torch.device("cpu"))
        for split in ("out", "in"):
            with pytest.raises(ValueError, match=message):
                _read_int4_shard(tensors, "l", q, N, K, split, 0, 2, torch.float16)


def test_parallel_import_is_lazy():
    """``import tilegemm`` (and tilegemm.nn) leaves torch.distributed.tensor unimported."""
    code = ("import sys, tilegemm, tilegemm.nn; "
            "print(any(m.startswith('torch.distributed.tensor') for m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# --- on the GPU: Llama-3-8B's MLP shapes, the kernels a GPU picks (fragment layouts included) ------------------


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("M", [1, 16, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_parallel_int4_shards_gpu(world, M, act_order):
    torch.manual_seed(0)
    from tilegemm.nn import Int4Linear

    for N, K, dim in ((14336, 4096, "out"), (4096, 14336, "in")):
        w = _weight(N, K, 128, act_order, "cuda")
        x = torch.randn(M, K, dtype=torch.float16, device="cuda")
        ref = x.double() @ dequantize(w).double().T
        assert_rel_close(_simulated(w, x, world, dim), ref, FP16_TOL)
        # through the layer, as the styles leave it: a local Int4Linear with its own fragment layout
        from tilegemm.parallel import shard_int4

        local, _ = shard_int4(w, dim, 1, world)
        xl = x if dim == "out" else x.chunk(world, -1)[1]
        assert_rel_close(Int4Linear.from_weight(local)(xl), xl.double() @ dequantize(local).double().T, FP16_TOL)


@pytest.mark.gpu
def test_parallel_world_one_gpu():
    """A one-rank NCCL mesh on the GPU: a converted and a quantized MLP parallelized equal the unsharded ones."""
    import copy
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 256))
        ref = ref.half().cuda()
        x = torch.randn(16, 512, dtype=torch.float16, device="cuda")
        for make in (lambda m: tnn.convert_(m), lambda m: tnn.quantize_(m, group_size=128)):
            model = make(copy.deepcopy(ref))
            want = model(x)
            parallelize_module(model, mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
            assert_rel_close(model(x), want.double(), FP16_TOL)
    finally:
        dist.destroy_process_group()


def test_parallel_auto_plans_of_transformers_models():
    """'auto' reads the config's plan: Qwen3's q/k norms ('replicated_with_grad_allreduce') stay whole without a
    word; Llama-4's packed and experts entries stay replicated with a warning naming them; a dict that names a style
    tilegemm does not split is refused."""
    transformers = pytest.importorskip("transformers")
    import warnings

    from tilegemm.parallel import resolve_plan

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        qwen3 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("qwen3", **common))
        llama4 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            "llama4_text", num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128, **common))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        splits = resolve_plan(qwen3, "auto")
    assert splits["model.layers.0.self_attn.q_proj"] == "out" and splits["model.layers.0.mlp.down_proj"] == "in"
    assert not any("norm" in n for n in splits)
    with pytest.warns(UserWarning, match=r"stay replicated .*feed_forward\.experts\.gate_up_proj \(packed_rowwise\)"):
        splits = resolve_plan(llama4, "auto")
    assert splits["model.layers.0.feed_forward.shared_expert.down_proj"] == "in"
    with pytest.raises(ValueError, match=r"tp_plan\['model\.layers\.\*\.self_attn\.q_norm'\] = "
                                         r"'replicated_with_grad_allreduce': tilegemm splits Linears"):
        resolve_plan(qwen3, {"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"})
    # a misspelt entry beside others that match: named (its layers were left whole on every rank, in silence)
    with pytest.raises(ValueError, match=r"tp_plan\['model\.layers\.\*\.mlp\.dwn_proj'\] matches no module of the "
                                         r"model \(its Linears are named as 'model\.layers\.0\."):
        resolve_plan(qwen3, {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.dwn_proj": "rowwise"})
    # Phi-3's plan gathers every split output (its fused q/k/v): nothing tilegemm splits, said so by name
    with torch.device("meta"):
        phi3 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            "phi3", **{**common, "pad_token_id": 0}))
    with pytest.raises(ValueError, match=r"the config's plan splits no Linear 'colwise' or 'rowwise' as tilegemm "
                                         r"does; it names .*qkv_proj \(colwise_gather_output\)"):
        resolve_plan(phi3, "auto")


class FirstOfTwo:
    """The first rank of a mesh of two, for loads refused before any collective."""

    ndim = 1

    def get_local_rank(self):
        return 0

    def size(self):
        return 2


@pytest.mark.parametrize("rule,why", [
    # (the split load read it 4-bit without a word)
    ({"modules_to_not_convert": ["self_attn.o_proj"]},
     r"which is in quantization_config\.modules_to_not_convert \('self_attn\.o_proj'\) but the checkpoint stores "
     r"it quantized"),
    ({"dynamic": {r"-:.*self_attn\.o_proj": {}}},
     r"which is left 16-bit by the pattern '-:\.\*self_attn\\\.o_proj' of quantization_config\.dynamic, though the "
     r"checkpoint stores it packed"),
    ({"dynamic": {r".*self_attn\.o_proj": {"bits": 8}}},
     r"which the checkpoint's quantization_config\.dynamic stores with bits = 8, though the checkpoint stores it "
     r"packed"),
])
def test_parallel_split_layer_the_config_leaves_16_bit_or_other_bits_is_refused(tmp_path, rule, why):
    """A layer the plan splits that the config leaves 16-bit (modules_to_not_convert, a per-module rule) or gives
    other bits, but that the checkpoint stores quantized, is refused naming the rule, as the unsplit load refuses
    it; the model is left as it was given."""
    pytest.importorskip("transformers")
    import json

    from tilegemm.models import pretrained
    from tilegemm.parallel import load_quantized_sharded_

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    config = cw.tiny_config("llama", hidden=128, layers=1)
    cw.write_model(tmp_path / "c", cw.random_model(config), "gptq", 32)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["quantization_config"].update(rule)
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))

    model, _ = pretrained.empty_model(tmp_path / "c", torch.float16, device="cpu")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"tp_plan splits model\.layers\.0\.self_attn\.o_proj, " + why):
        load_quantized_sharded_(model, tmp_path / "c", FirstOfTwo(), device="cpu")
    assert {n: type(m) for n, m in model.named_modules()} == before  # left as it was given


def test_parallel_load_refuses_bf16_scales_past_fp16s_range(tmp_path):
    # the split load converted bf16 scales to fp16 with no range check: weights of 15 x 20000 loaded as inf, where
    # the whole load refuses them (as before the first collective: every rank refuses alike)
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import load_quantized_sharded_

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    config = cw.tiny_config("llama", hidden=64, layers=1)
    cw.write_model(tmp_path / "c", cw.random_model(config), "gptq", 32)
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.scales"
    tensors[key] = torch.full(tensors[key].shape, 20000.0, dtype=torch.bfloat16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "c" / "model.safetensors",
              metadata={"format": "pt"})

    model, _ = pretrained.empty_model(tmp_path / "c", torch.float16, device="cpu")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: its weights dequantized in fp16 pass "
                                         r"fp16's range .*dtype=torch\.bfloat16"):
        load_quantized_sharded_(model, tmp_path / "c", FirstOfTwo(), device="cpu")


@pytest.mark.parametrize("method, act_order", [("gptq", False), ("gptq", True), ("awq", False),
                                               ("compressed-tensors", True)])
def test_parallel_partial_last_group_is_read_whole_and_split_exactly(tmp_path, method, act_order):
    """A layer whose K the group size does not divide (K = 192, group 128: a stored last group of 64 inputs) is read
    whole, regrouped in groups of gcd(K, group_size) = 64, then split: each rank's shard is its slice of the
    checkpoint's weight, along N or along K; a K split that would cut those groups is refused."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import _read_int4_shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    N, K = 64, 192
    t, want = cw.quantize_linear(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05, method, 128,
                                 act_order=act_order, generator=torch.Generator().manual_seed(1))
    save_file({f"l.{k}": v.contiguous() for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    qc = cw.quantization_config(method, 128, act_order=act_order)
    q = pretrained.quant_config({"quantization_config": qc}).for_module("l")
    tensors = pretrained._Tensors(str(tmp_path), torch.device("cpu"))
    for rank in range(2):
        local, index = _read_int4_shard(tensors, "l", q, N, K, "out", rank, 2, torch.float16)
        assert index is None and local.group_size == 64
        assert torch.equal(dequantize(local), want[rank * 32:(rank + 1) * 32])  # (act-order: perm kept)
    for rank in range(3):
        local, index = _read_int4_shard(tensors, "l", q, N, K, "in", rank, 3, torch.float16)
        cols = index if act_order else torch.arange(rank * 64, (rank + 1) * 64)
        assert torch.equal(dequantize(local), want[:, cols])
    with pytest.raises(ValueError, match=r"a split of K = 192 over 2 ranks \(96 each\) would cut quantization groups "
                                         r"of group_size = 64"):
        _read_int4_shard(tensors, "l", q, N, K, "in", 0, 2, torch.float16)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_parallel_group_length_the_kernels_do_not_take_is_read_whole_and_split_exactly(tmp_path, method):
    """Groups of 512 (K = 1024: two stored groups) load exactly as groups of 256, read whole then split."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import _read_int4_shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    N, K = 64, 1024
    t, want = cw.quantize_linear(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05, method, 512,
                                 generator=torch.Generator().manual_seed(1))
    save_file({f"l.{k}": v.contiguous() for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    q = pretrained.quant_config({"quantization_config": cw.quantization_config(method, 512)}).for_module("l")
    tensors = pretrained._Tensors(str(tmp_path), torch.device("cpu"))
    for split, ranks in (("out", 2), ("in", 4)):
        for rank in range(ranks):
            local, _ = _read_int4_shard(tensors, "l", q, N, K, split, rank, ranks, torch.float16)
            assert local.group_size == 256
            rows, cols = (slice(rank * 32, (rank + 1) * 32), slice(None)) if split == "out" else \
                (slice(None), slice(rank * 256, (rank + 1) * 256))
            assert torch.equal(dequantize(local), want[rows, cols])


@pytest.mark.parametrize("split", ["out", "in"])
def test_parallel_symmetric_zeros_stored_as_v2_under_the_v1_label(tmp_path, split):
    """A symmetric GPTQ checkpoint labelled v1 ("gptq": zero - 1 stored) whose qzeros hold the zero itself (8), as
    GPTQModel from v5 writes: each rank's shard reads the zeros as 8, as from_pretrained does (warned)."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.models import pretrained
    from tilegemm.parallel import _read_int4_shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    N, K = 64, 256
    t, want = cw.quantize_linear(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05, "gptq", 128,
                                 sym=True, generator=torch.Generator().manual_seed(1))
    t["qzeros"] = torch.full_like(t["qzeros"], 0x88888888 - (1 << 32))
    save_file({f"l.{k}": v.contiguous() for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    q = pretrained.quant_config({"quantization_config": cw.quantization_config("gptq", 128, sym=True)}).for_module("l")
    tensors = pretrained._Tensors(str(tmp_path), torch.device("cpu"))
    with pytest.warns(UserWarning, match="labelled checkpoint_format 'gptq' stores zeros of 8"):  # (once a load)
        shards = [_read_int4_shard(tensors, "l", q, N, K, split, rank, 2, torch.float16)[0] for rank in range(2)]
    for rank, local in enumerate(shards):
        rows, cols = (slice(rank * 32, (rank + 1) * 32), slice(None)) if split == "out" else \
            (slice(None), slice(rank * 128, (rank + 1) * 128))
        assert torch.equal(dequantize(local), want[rows, cols])
