"""MoE experts and the grouped ops tensor-parallel on 2 gloo ranks (CPU, kernels under Triton's interpreter): a
tiny Qwen3-MoE on the "tilegemm" experts implementation, 16-bit and after tilegemm.nn.quantize_, sharded with
tilegemm.nn.ExpertsTensorParallel equals the unsharded one; the grouped ops on DTensor operands run each rank's
shard locally."""

from __future__ import annotations

import copy

import pytest
import torch

from tilegemm.core.runtime import interpreting

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")  # (the ranks' harness module needs it)
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU ranks: kernels under Triton's interpreter")

from test_parallel_moe_local import moe_config  # noqa: E402 (hides a broken torchvision from transformers too)
from test_parallel_ranks import FP16_TOL, FP32_TOL, _close, _comms, spawn  # noqa: E402


MODEL_IDS = [[5, 17, 40, 2]]  # tokens of the tiny model's vocabulary of 64


def moe_ranks(rank, world, mesh, models, refs, tmp):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm
    import tilegemm.nn as tnn
    from tilegemm.ops.w4a16.format import quantize

    R = [Replicate()]
    # grouped_mm on DTensors: b split along N (column) -> output split along N, no communication; a and b split
    # along K (row) -> a partial output; a [G, N] bias split with N / added once as a partial
    a = torch.randn(9, 32)
    b, bias = torch.randn(3, 32, 16), torch.randn(3, 16)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # an empty group, and rows past offs[-1]
    want = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    od = distribute_tensor(offs, mesh, R)
    ad, bd, biasd = (distribute_tensor(t, mesh, p) for t, p in ((a, R), (b, [Shard(2)]), (bias, [Shard(1)])))
    out, comms = _comms(lambda: tilegemm.grouped_mm(ad, bd, offs=od, bias=biasd))
    assert out.placements == (Shard(1),) and comms == {}, (out.placements, comms)
    assert out.to_local().shape == (9, 16 // world)
    _close(out.full_tensor(), want, FP32_TOL, "grouped_mm column-parallel")
    ad, bd, biasd = (distribute_tensor(t, mesh, p) for t, p in ((a, [Shard(1)]), (b, [Shard(1)]), (bias, R)))
    out, comms = _comms(lambda: tilegemm.grouped_mm(ad, bd, offs=od, bias=biasd))
    assert isinstance(out, DTensor) and out.placements[0].is_partial() and comms == {}, (out.placements, comms)
    _close(out.full_tensor(), want, FP32_TOL, "grouped_mm row-parallel")

    # 4-bit experts (the grouped_w4a16 op): N split; K split in whole groups (a partial output)
    w4 = quantize(torch.randn(3, 16, 64).half(), 32)
    xh = torch.randn(9, 64).half()
    want = tilegemm.w4a16.grouped_matmul(xh, w4, offs)
    for px, pw, placed in (([Replicate()], [Shard(2)], Shard(1)), ([Shard(1)], [Shard(1)], None)):
        parts = [distribute_tensor(getattr(w4, k), mesh, pw) for k in ("qweight", "scales", "zeros")]
        xd = distribute_tensor(xh, mesh, px)
        out, comms = _comms(lambda: torch.ops.tilegemm.grouped_w4a16(xd, *parts, od, None, 32, "none", False, "auto"))
        assert comms == {} and (out.placements == (placed,) if placed else out.placements[0].is_partial())
        _close(out.full_tensor(), want, FP16_TOL, f"grouped_w4a16 split {pw}")

    # the same call gated (gate and up columns in one weight): the rules key on `gated`, so the decision cached
    # for the plain call is not reused, and the column split is refused
    with pytest.raises(RuntimeError, match=r"grouped_w4a16 \(gated\): b is split along its gate/up columns"):
        torch.ops.tilegemm.grouped_w4a16(distribute_tensor(xh, mesh, R), *[distribute_tensor(getattr(w4, k), mesh,
                                         [Shard(2)]) for k in ("qweight", "scales", "zeros")], od, None, 32, "silu",
                                         True, "auto")

    # an act-order gather (group_columns): replicated; x split along its columns is gathered first
    x8 = torch.randn(9, 8)
    perm = torch.stack([torch.randperm(8) for _ in range(3)])
    want = tilegemm.ops.grouped.routing.group_columns(x8, offs, perm)
    permd = distribute_tensor(perm, mesh, R)
    for px, gathers in (([Replicate()], {}), ([Shard(1)], {"all_gather_into_tensor": 1})):
        xd = distribute_tensor(x8, mesh, px)
        out, comms = _comms(lambda: torch.ops.tilegemm.group_columns(xd, od, permd))
        assert out.placements == (Replicate(),) and comms == gathers, (out.placements, comms)
        assert torch.equal(out.to_local(), want), f"group_columns, x {px}"

    # batched (3-D x 3-D): the batch split, then b's columns; no communication
    a3, b3 = torch.randn(4, 5, 8), torch.randn(4, 8, 6)
    for pa, pb, placed in ((Shard(0), Shard(0), Shard(0)), (Replicate(), Shard(2), Shard(2))):
        ad, bd = distribute_tensor(a3, mesh, [pa]), distribute_tensor(b3, mesh, [pb])
        out, comms = _comms(lambda: tilegemm.grouped_mm(ad, bd))
        assert out.placements == (placed,) and comms == {}, (out.placements, comms)
        _close(out.full_tensor(), a3 @ b3, FP32_TOL, f"batched grouped_mm split {placed}")

    # the fused gate/up product refuses a split of its columns (it would part gate from up columns); DTensor
    # reraises the rule's ValueError as a RuntimeError holding its message
    with pytest.raises(RuntimeError, match=r"split along its gate/up columns"):
        torch.ops.tilegemm.grouped_mm_gated(distribute_tensor(a, mesh, R), distribute_tensor(b, mesh, [Shard(2)]),
                                            od, None, "silu", "default")

    # a Qwen3-MoE whose experts run on tilegemm: fp32, then int4 experts (fp16), sharded = unsharded (refs: the
    # unsharded models' logits on MODEL_IDS, the parent's)
    ids = torch.tensor(MODEL_IDS)
    for name, tol in (("fp32", FP32_TOL), ("int4", FP16_TOL)):
        model = copy.deepcopy(models[name])
        want = refs[name]
        parallelize_module(model, mesh, {"model.layers.*.mlp.experts": tnn.ExpertsTensorParallel()})
        experts = model.model.layers[0].mlp.experts
        if name == "fp32":
            assert experts.gate_up_proj.shape == (4, 128 // world, 32) and experts.down_proj.shape == (4, 32, 32)
        else:
            assert experts.tilegemm_down_proj_qweight.shape == (4, 64 // world // 8, 32)
        with torch.no_grad():
            out, comms = _comms(lambda: model(ids).logits)
        assert comms == {"all_reduce": 2}, comms  # one a MoE block
        _close(out, want, tol, f"Qwen3-MoE, {name} experts, tensor-parallel")

    # hidden states of the wrong width: named against the block's H and the style's input layout, before DTensor
    # infers another H from them (the grouped op would name the routed rows and that H)
    idx, weights = torch.randint(0, 4, (5, 2)), torch.rand(5, 2).half()
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts split along the experts' intermediate size over 2 ranks "
                                         r"\(hidden size H = 32\): hidden_states is \[5, 16\], but input_layouts="
                                         r"\(Replicate\(\),\) makes a plain hidden_states all of H = 32$"):
        experts(torch.randn(5, 16).half(), idx, weights)
    with pytest.raises(ValueError, match=r"hidden_states is \[5, 64\], .* all of H = 32"):
        experts(hidden_states=torch.randn(5, 64).half(), top_k_index=idx, top_k_weights=weights)
    sliced = parallelize_module(copy.deepcopy(models["fp32"].model.layers[0].mlp.experts), mesh,
                                tnn.ExpertsTensorParallel(input_layouts=Shard(-1)))
    with pytest.raises(ValueError, match=r"hidden_states is \[5, 32\], but input_layouts=\(Shard\(dim=-1\),\) "
                                         r"makes a plain hidden_states this rank's slice of H, 16 wide; pass each "
                                         r"rank its slice, or input_layouts=Replicate\(\) for the whole input"):
        sliced(torch.randn(5, 32), idx, weights.float())
    x = torch.randn(5, 32)  # (the same on every rank)
    with torch.no_grad():
        _close(sliced(x.chunk(world, -1)[rank], idx, weights.float()),
               models["fp32"].model.layers[0].mlp.experts(x, idx, weights.float()), FP32_TOL, "experts given H / 2")

    # a sharded load: each rank reads its slices of the experts (the gate and up ranges, I's rows, whole groups)
    from tilegemm.parallel import load_sharded_

    for name in ("load-fp32", "load-int4"):
        full = models[name]
        with torch.no_grad():  # the skeleton's values differ from the files': they must all be overwritten
            skeleton = copy.deepcopy(full)
            for key, t in skeleton.state_dict().items():
                t.zero_() if key.endswith("qweight") else t.fill_(7.0)
        parallelize_module(skeleton, mesh, {"model.layers.*.mlp.experts": tnn.ExpertsTensorParallel()})
        load_sharded_(skeleton, f"{tmp}/{name}.safetensors", mesh)
        with torch.no_grad():
            _close(skeleton(ids).logits, refs[name], FP32_TOL if name == "load-fp32" else FP16_TOL,
                   f"sharded load, {name}")

    # a split that would cut the down projection's quantization groups is refused, naming the group size
    cut = copy.deepcopy(models["int4-g64"])
    with pytest.raises(ValueError, match=r"would cut quantization groups of group_size = 64"):
        parallelize_module(cut, mesh, {"model.layers.*.mlp.experts": tnn.ExpertsTensorParallel()})


def test_parallel_moe_two_ranks(tmp_path):
    from safetensors.torch import save_file

    import tilegemm.nn as tnn

    def model(**kw):
        torch.manual_seed(0)
        cfg = moe_config(**kw)
        return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="tilegemm").eval()

    int4 = model().half()
    tnn.quantize_(int4, group_size=32)
    cut = model(hidden_size=64).half()
    assert tnn.quantize_experts_(cut, group_size=64)
    models = {"fp32": model(), "int4": int4, "int4-g64": cut}
    # the unsharded models the ranks load from: fp32, and 4-bit experts (the rest fp16); one layer (the loads
    # read each layer's experts alike)
    models["load-fp32"], models["load-int4"] = model(num_hidden_layers=1), model(num_hidden_layers=1).half()
    tnn.quantize_experts_(models["load-int4"], group_size=32)
    torch.manual_seed(5)
    for name in ("load-fp32", "load-int4"):
        with torch.no_grad():
            for p in models[name].parameters():
                p.copy_(torch.randn_like(p) * 0.5)
        save_file({k: v.contiguous() for k, v in models[name].state_dict().items()},
                  str(tmp_path / f"{name}.safetensors"))
    # built once here (transformers' model code imported before the fork), deep-copied in the ranks; their
    # unsharded logits computed once here too, not once a rank
    with torch.no_grad():
        refs = {name: models[name](torch.tensor(MODEL_IDS)).logits for name in ("fp32", "int4", "load-fp32",
                                                                                  "load-int4")}
    spawn(moe_ranks, 2, models, refs, str(tmp_path))
