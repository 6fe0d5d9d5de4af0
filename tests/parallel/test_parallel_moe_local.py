"""MoE experts split along their intermediate size, in one process: each rank's shard of a transformers experts
block (tilegemm.parallel.shard_experts_) run in turn, the ranks' partial outputs added, against the unsharded
block; 16-bit and 4-bit experts, the "tilegemm" and "eager" implementations; and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import hide_broken_torchvision  # noqa: E402

hide_broken_torchvision()

import tilegemm.nn as tnn  # noqa: E402
from tilegemm.core.runtime import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(
    getattr(pytest.importorskip("transformers.integrations.moe"), "ALL_EXPERTS_FUNCTIONS", None) is None,
    reason="this transformers has no experts interface (ALL_EXPERTS_FUNCTIONS, transformers >= 5)")


def moe_config(**kw):
    """A tiny Qwen3-MoE: H = 32, I = 64 (gate_up_proj [4, 128, 32], down_proj [4, 32, 64]; 4 experts: fewer programs
    under the interpreter than 8)."""
    args = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                decoder_sparse_step=1, max_position_embeddings=64)
    args.update(kw)
    return transformers.Qwen3MoeConfig(**args)


def experts_block(impl: str = "tilegemm", dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(**kw), experts_implementation=impl)
    return model.model.layers[0].mlp.experts.to(dtype).eval()


def _sharded_sum(block, world, x, idx, weights):
    from tilegemm.parallel import shard_experts_

    outs = []
    for rank in range(world):
        local = shard_experts_(copy.deepcopy(block), rank, world)
        outs.append(local(x, idx, weights).float())
    return torch.stack(outs).sum(0)


cpu_kernels = pytest.mark.skipif(not interpreting(), reason="CPU tensors: tilegemm's kernels under the interpreter "
                                                            "(test_parallel_moe_experts_shards_gpu on the GPU)")


@pytest.mark.parametrize("impl", [pytest.param("tilegemm", marks=cpu_kernels), "eager"])
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_moe_experts_shards_sum(impl, world):
    block = experts_block(impl)
    x, idx, weights = torch.randn(5, 32), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    with torch.no_grad():
        want = block(x, idx, weights)
        got = _sharded_sum(block, world, x, idx, weights)
    local = __import__("tilegemm.parallel", fromlist=["x"]).shard_experts_(copy.deepcopy(block), 1, world)
    assert local.gate_up_proj.shape == (4, 128 // world, 32) and local.down_proj.shape == (4, 32, 64 // world)
    # rank 1's gate rows are gate rows 64/world.., its up rows the matching up rows (the halves stay paired)
    i = 64 // world
    torch.testing.assert_close(local.gate_up_proj[:, :i], block.gate_up_proj[:, i:2 * i])
    torch.testing.assert_close(local.gate_up_proj[:, i:], block.gate_up_proj[:, 64 + i:64 + 2 * i])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@cpu_kernels
def test_parallel_moe_int4_experts_shards_sum():
    block = experts_block(dtype=torch.float16)
    model = torch.nn.Module()
    model.experts = block
    tnn.quantize_experts_(model, group_size=32)
    x, idx, weights = torch.randn(6, 32).half(), torch.randint(0, 4, (6, 2)), torch.rand(6, 2).half()
    with torch.no_grad():
        want = block(x, idx, weights).float()
        got = _sharded_sum(block, 2, x, idx, weights)
    assert (got - want).norm() / want.norm() < 4e-3


def test_parallel_moe_experts_refusals():
    from tilegemm.parallel import shard_experts_

    block = experts_block()
    with pytest.raises(ValueError, match=r"intermediate size I = 64 does not split evenly over 3 ranks"):
        shard_experts_(copy.deepcopy(block), 0, 3)
    with pytest.raises(ValueError, match="split already"):
        shard_experts_(shard_experts_(copy.deepcopy(block), 0, 2), 0, 2)
    with pytest.raises(NotImplementedError, match="MoE experts block"):
        shard_experts_(torch.nn.Linear(4, 4), 0, 2)
    model = torch.nn.Module()
    model.experts = experts_block(hidden_size=64)  # (a group of 64 fits H = 64 and I = 64, not I / 2)
    assert tnn.quantize_experts_(model, group_size=64) == ["experts"]
    with pytest.raises(ValueError, match=r"I = 64 over 2 ranks \(32 each\) would cut quantization groups of "
                                         r"group_size = 64"):
        shard_experts_(model.experts, 0, 2)
    model.experts = copy.deepcopy(block)
    assert tnn.quantize_experts_(model, group_size=-1) == ["experts"]
    with pytest.raises(ValueError, match=r"group_size = -1"):
        shard_experts_(model.experts, 0, 2)


@cpu_kernels
def test_parallel_moe_act_order_experts():
    """Act-order 4-bit experts (an input order an expert): the up side's orders span all of H, which every rank
    holds, so a gate/up order alone shards; a down projection's order spans every rank's slice of I: refused."""
    from tilegemm.nn.moe import _int4, install_int4_experts_
    from tilegemm.ops.w4a16 import Int4Weight
    from tilegemm.parallel import shard_experts_

    block = experts_block(dtype=torch.float16)
    model = torch.nn.Module()
    model.experts = block
    tnn.quantize_experts_(model, group_size=32)
    up, down = _int4(block, "gate_up_proj"), _int4(block, "down_proj")
    perm = torch.stack([torch.randperm(up.shape[-1]) for _ in range(up.shape[0])])
    install_int4_experts_(block, {"gate_up_proj": Int4Weight(up.qweight, up.scales, up.zeros, 32, up.shape, perm),
                                  "down_proj": down})
    x, idx, weights = torch.randn(6, 32).half(), torch.randint(0, 4, (6, 2)), torch.rand(6, 2).half()
    with torch.no_grad():
        want = block(x, idx, weights).float()
        got = _sharded_sum(block, 2, x, idx, weights)
    assert (got - want).norm() / want.norm() < 4e-3
    dperm = torch.stack([torch.randperm(down.shape[-1]) for _ in range(down.shape[0])])
    install_int4_experts_(block, {"gate_up_proj": _int4(block, "gate_up_proj"), "down_proj": Int4Weight(
        down.qweight, down.scales, down.zeros, 32, down.shape, dperm)})
    with pytest.raises(NotImplementedError, match="act-order 4-bit experts"):
        shard_experts_(copy.deepcopy(block), 0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_moe_experts_shards_gpu(world):
    """On the GPU, fp16 experts of a wider block (H = 1024, I = 768, 16 experts, 256 tokens), 16-bit then 4-bit
    (groups of 64): each rank's shard through the kernels a GPU picks, the partial outputs added, against the
    unsharded block."""
    block = experts_block(hidden_size=1024, moe_intermediate_size=768, num_experts=16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.03)
    block = block.half().cuda()
    x = torch.randn(256, 1024, dtype=torch.float16, device="cuda")
    idx = torch.randint(0, 16, (256, 2), device="cuda")
    weights = torch.rand(256, 2, dtype=torch.float16, device="cuda")
    for quantized in (False, True):
        if quantized:
            holder = torch.nn.Module()
            holder.experts = block
            assert tnn.quantize_experts_(holder, group_size=64) == ["experts"]
        with torch.no_grad():
            want = block(x, idx, weights).float()
            got = _sharded_sum(block, world, x, idx, weights)
        assert torch.isfinite(got).all()
        assert (got - want).norm() / want.norm() < 4e-3, quantized


def test_parallel_moe_int4_shard_remakes_kept_fragments(monkeypatch):
    # Where the decode kernel runs (faked: the packing is plain torch) the 4-bit experts keep their fragment
    # layouts as buffers; a shard must read its own slice's fragments, not the unsharded block's.
    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.nn.moe import _int4
    from tilegemm.ops.w4a16.format import Int4Weight
    from tilegemm.parallel import shard_experts_

    monkeypatch.setattr(dispatch, "frag_usable", lambda group_k, K, device: True)
    block = experts_block(dtype=torch.float16)
    model = torch.nn.Module()
    model.experts = block
    tnn.quantize_experts_(model, group_size=32)
    local = shard_experts_(copy.deepcopy(block), 1, 2)
    for name, gated in (("gate_up_proj", True), ("down_proj", False)):
        w = _int4(local, name)
        fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments(gated)
        got = w.fragments(gated)
        assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, fresh)), name


@pytest.mark.parametrize("root", [False, True], ids=["in-a-model", "the-block-itself"])
def test_parallel_moe_int4_sharded_load_remakes_kept_fragments(monkeypatch, tmp_path, root):
    # load_sharded_ puts new 4-bit parts in place of a parallelized block's: the fragment layouts it kept of the
    # skeleton's values must not come back with them (frag faked as runnable: the packing is plain torch).
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    import tilegemm.ops.grouped.dispatch as dispatch
    from tilegemm.nn.moe import _int4
    from tilegemm.ops.w4a16.format import Int4Weight
    from tilegemm.parallel import load_sharded_, shard_experts_

    monkeypatch.setattr(dispatch, "frag_usable", lambda group_k, K, device: True)
    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(moe_config(num_hidden_layers=1)).half().eval()
    tnn.quantize_experts_(full, group_size=32)
    if root:  # the experts block loaded as the model (its names carry no prefix)
        full = full.model.layers[0].mlp.experts
    path = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    skeleton = copy.deepcopy(full)
    with torch.no_grad():
        for key, t in skeleton.state_dict().items():
            t.zero_() if key.endswith("qweight") else t.fill_(7.0)
    block = skeleton if root else skeleton.model.layers[0].mlp.experts
    shard_experts_(block, 1, 2)
    load_sharded_(skeleton, str(path), RankOf2(1))
    for name, gated in (("gate_up_proj", True), ("down_proj", False)):
        w = _int4(block, name)
        fresh = Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments(gated)
        assert all(torch.equal(a, b) for a, b in zip(w.fragments(gated), fresh)), name


class RankOf2:
    """The mesh as load_sharded_ reads it: rank ``rank`` of two."""
    ndim = 1

    def __init__(self, rank):
        self.rank = rank

    def get_local_rank(self):
        return self.rank

    def size(self):
        return 2


def _act_order_model():
    """(a one-layer MoE model with 4-bit experts, fp16; an input order an expert for its gate/up side; the experts'
    weights with those orders, for install_int4_experts_), seeded."""
    from tilegemm.nn.moe import _int4
    from tilegemm.ops.w4a16 import Int4Weight

    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(moe_config(num_hidden_layers=1)).half().eval()
    tnn.quantize_experts_(full, group_size=32)
    block = full.model.layers[0].mlp.experts
    up, down = _int4(block, "gate_up_proj"), _int4(block, "down_proj")
    perm = torch.stack([torch.randperm(up.shape[-1]) for _ in range(up.shape[0])])
    return full, perm, {"gate_up_proj": Int4Weight(up.qweight, up.scales, up.zeros, 32, up.shape, perm),
                        "down_proj": down}


@cpu_kernels
def test_parallel_moe_act_order_sharded_load(tmp_path):
    # load_sharded_ into a split act-order block: the up side's orders read whole, the product as unsplit
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.nn.moe import install_int4_experts_
    from tilegemm.parallel import load_sharded_, shard_experts_

    full, perm, with_perm = _act_order_model()
    block = full.model.layers[0].mlp.experts
    install_int4_experts_(block, with_perm)
    path = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    x, idx, weights = torch.randn(6, 32).half(), torch.randint(0, 4, (6, 2)), torch.rand(6, 2).half()
    with torch.no_grad():
        want = block(x, idx, weights).float()
    got = 0
    for rank in range(2):
        skeleton = copy.deepcopy(full)
        with torch.no_grad():
            for key, t in skeleton.state_dict().items():
                t.zero_() if key.endswith(("qweight", "perm")) else t.fill_(7.0)
        local = skeleton.model.layers[0].mlp.experts
        shard_experts_(local, rank, 2)
        load_sharded_(skeleton, str(path), RankOf2(rank))
        assert torch.equal(local.tilegemm_gate_up_proj_perm, perm)
        with torch.no_grad():
            got = got + local(x, idx, weights).float()
    assert (got - want).norm() / want.norm() < 4e-3


@pytest.mark.parametrize("files_perm", [True, False], ids=["files-act-order", "files-natural"])
def test_parallel_moe_sharded_load_adopts_the_files_perm(tmp_path, files_perm):
    # load_sharded_ into a split block whose experts hold no input order (files act-order) or one (files in natural
    # order): the perm buffer follows the files, as load_state_dict's pre-hook makes it do
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.nn.moe import install_int4_experts_
    from tilegemm.parallel import load_sharded_, shard_experts_

    full, perm, with_perm = _act_order_model()
    block = full.model.layers[0].mlp.experts
    skeleton = copy.deepcopy(full)
    install_int4_experts_(block if files_perm else skeleton.model.layers[0].mlp.experts, with_perm)
    path = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    local = skeleton.model.layers[0].mlp.experts
    shard_experts_(local, 0, 2)
    load_sharded_(skeleton, str(path), RankOf2(0))  # strict: every name of the files placed, none left over
    if files_perm:
        assert torch.equal(local.tilegemm_gate_up_proj_perm, perm)
    else:
        assert getattr(local, "tilegemm_gate_up_proj_perm", None) is None


def test_load_sharded_remakes_a_replicated_int4_layers_fragments(tmp_path, keep_fragments):
    # A layer outside the plan (replicated) takes the files' parts as new buffers: its fragment layout is made of
    # them there, not left for a first eager call (a model compiled next traces no packing).
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from tilegemm.nn import Int4Linear
    from tilegemm.ops.w4a16.format import Int4Weight
    from tilegemm.parallel import load_sharded_

    torch.manual_seed(0)
    full = torch.nn.Sequential(Int4Linear.from_linear(torch.nn.Linear(64, 32, dtype=torch.float16), group_size=32))
    path = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    skeleton = copy.deepcopy(full)
    with torch.no_grad():
        skeleton[0].scales.fill_(7.0)
    load_sharded_(skeleton, str(path), RankOf2(1))
    layer = skeleton[0]
    assert torch.equal(layer.scales, full[0].scales)
    fresh = Int4Weight(layer.qweight, layer.scales, layer.zeros, 32, (32, 64)).fragments()
    assert layer._fragments_current() and all(torch.equal(a, b) for a, b in zip((layer.fweight, layer.fzs), fresh))
