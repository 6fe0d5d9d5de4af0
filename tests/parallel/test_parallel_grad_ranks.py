"""Gradients through tensor-parallel layers, on 2 gloo ranks on the CPU (kernels under Triton's interpreter).

Each rank's output and input gradient are compared with a single-process fp64 reference: a column-parallel
layer reads all of a replicated input, so the input's gradient is the sum over the ranks of their partial ones;
a row-parallel act-order layer gathers its input and reads only its own inputs of it, alike.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tilegemm.core.runtime import interpreting

pytest.importorskip("safetensors")  # (test_parallel_ranks imports it)
from test_parallel_ranks import _act_order_linear, _close, _mlp, spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU ranks: kernels under Triton's interpreter")

FP16_TOL = 4e-3  # fp16 activations and gradients against fp64
FP32_TOL = 1e-5


def _int4_reference(lin, x, go):
    """(output, x's gradient) of the Int4Linear ``lin`` in fp64 on its dequantized weight."""
    from tilegemm.ops.w4a16.format import dequantize

    w = dequantize(lin.weight).double()
    xr = x.double().requires_grad_()
    out = xr @ w.T + (0 if lin.bias is None else lin.bias.double())
    out.backward(go.double())
    return out.detach(), xr.grad


def _run(model, x, go):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(go)
    return out.detach(), x.grad


def int4_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    torch.manual_seed(0)
    plain = tnn.Int4Linear.from_linear(torch.nn.Linear(64, 32).half(), group_size=32)
    for kind, lin in (("plain", plain), ("act-order", _act_order_linear(16, 128, 32))):
        N, K = lin.out_features, lin.in_features
        x, go = torch.randn(3, K).half(), torch.randn(3, N).half()
        want, want_grad = _int4_reference(lin, x, go)
        mine = slice(rank * K // world, (rank + 1) * K // world)
        for name, style, inp, grad_want in (
            ("column-parallel", tnn.ColwiseParallel(output_layouts=Replicate()), x, want_grad),
            ("row-parallel", tnn.RowwiseParallel(), x[:, mine], want_grad[:, mine]),
            ("row-parallel, replicated input", tnn.RowwiseParallel(input_layouts=Replicate()), x, want_grad),
        ):
            model = parallelize_module(torch.nn.Sequential(copy.deepcopy(lin)), mesh, {"0": style})
            out, grad = _run(model, inp, go)
            _close(out, want, FP16_TOL, f"{kind} {name}: output")
            _close(grad, grad_want, FP16_TOL, f"{kind} {name}: x.grad")
            with torch.no_grad():  # no gradient wanted: the same output (the decode path, no DTensor)
                _close(model(inp), want, FP16_TOL, f"{kind} {name}: output under no_grad")

    # a 4-bit MLP, column- then row-parallel: x's gradient through both
    ref = tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32)
    x, go = torch.randn(4, 64).half(), torch.randn(4, 16).half()
    want, want_grad = _run(ref, x, go)
    model = parallelize_module(copy.deepcopy(ref), mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, grad = _run(model, x, go)
    _close(out, want, FP16_TOL, "int4 MLP: output")
    _close(grad, want_grad, FP16_TOL, "int4 MLP: x.grad")


def dense_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    ref = _mlp(32, 64, 16).double()
    x, go = torch.randn(3, 32), torch.randn(3, 16)
    want, want_grad = _run(ref, x.double(), go.double())
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref).float()), mesh,
                               {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, grad = _run(model, x, go)
    _close(out, want, FP32_TOL, "tilegemm.nn.Linear MLP: output")
    _close(grad, want_grad, FP32_TOL, "tilegemm.nn.Linear MLP: x.grad")
    for i in (0, 2):
        for p in ("weight", "bias"):
            got = getattr(model[i], p).grad.full_tensor()
            _close(got, getattr(ref[i], p).grad, FP32_TOL, f"tilegemm.nn.Linear MLP: [{i}].{p}.grad")


def test_parallel_int4_input_grad():
    spawn(int4_grad_ranks, 2)


def test_parallel_linear_grad():
    spawn(dense_grad_ranks, 2)


def conv_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm
    import tilegemm.nn as tnn

    # output channels, then input channels: the backward runs tilegemm::conv2d_dgrad / conv2d_wgrad on DTensors
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 6, 1)).double()
    x, go = torch.randn(2, 4, 6, 6), torch.randn(2, 6, 6, 6)
    want, want_grad = _run(ref, x.double(), go.double())
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref).float()), mesh,
                               {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, grad = _run(model, x, go)
    _close(out, want, FP32_TOL, "Conv2d column then row: output")
    _close(grad, want_grad, FP32_TOL, "Conv2d column then row: x.grad")
    for i in (0, 2):
        for p in ("weight", "bias"):
            param = getattr(model[i], p)
            assert param.grad.placements == param.placements, (i, p, param.grad.placements, param.placements)
            _close(param.grad.full_tensor(), getattr(ref[i], p).grad, FP32_TOL, f"Conv2d [{i}].{p}.grad")

    # the batch split (a replicated weight), with a fused activation: the weight's gradient a partial sum
    xb = torch.randn(4, 4, 5, 5)
    xr, wr = xb.double().requires_grad_(), ref[0].weight.detach().clone().requires_grad_()
    torch.relu(torch.nn.functional.conv2d(xr, wr, None, padding=1)).sum().backward()
    xd = distribute_tensor(xb, mesh, [Shard(0)]).requires_grad_()
    wd = distribute_tensor(wr.detach().float(), mesh, [Replicate()]).requires_grad_()
    tilegemm.conv2d(xd, wd, None, padding=1, activation="relu").sum().backward()
    _close(xd.grad.full_tensor(), xr.grad, FP32_TOL, "batch-split conv2d: x.grad")
    _close(wd.grad.full_tensor(), wr.grad, FP32_TOL, "batch-split conv2d: weight.grad")


def w4a16_op_grad_ranks(rank, world, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tilegemm.ops.w4a16.format import dequantize, quantize

    torch.manual_seed(0)
    R = Replicate()
    for kind, w4 in (("plain", quantize(torch.randn(16, 128).half(), 32)),
                     ("act-order", _act_order_linear(16, 128, 32).weight)):
        w = dequantize(w4).double()  # [N, K] in x's input order
        x, go = torch.randn(3, 128).half(), torch.randn(3, 16).half()
        # replicated; rows of x split; N split (column-parallel); K split in whole groups (row-parallel)
        for name, px, pw in (("replicated", R, R), ("rows", Shard(0), R), ("N split", R, Shard(1)),
                             ("K split", Shard(1), Shard(0))):
            for activation in ("none", "relu"):
                xr = x.double().requires_grad_()
                want = xr @ w.T
                want = torch.relu(want) if activation == "relu" else want
                want.backward(go.double())
                xd = distribute_tensor(x, mesh, [px]).requires_grad_()
                parts = [distribute_tensor(getattr(w4, k), mesh, [pw]) for k in ("qweight", "scales", "zeros")]
                perm = None if w4.perm is None else distribute_tensor(w4.perm, mesh, [R])
                out = torch.ops.tilegemm.w4a16_matmul(xd, *parts, None, None, None, 32, activation, "auto", perm)
                out.backward(distribute_tensor(go, mesh, [R]))
                what = f"w4a16 op on DTensors, {kind}, {name}, {activation}"
                _close(out.full_tensor(), want, FP16_TOL, f"{what}: output")
                _close(xd.grad.full_tensor(), xr.grad, FP16_TOL, f"{what}: x.grad")


def test_parallel_conv2d_grad():
    spawn(conv_grad_ranks, 2)


def test_parallel_w4a16_op_grad():
    spawn(w4a16_op_grad_ranks, 2)


def experts_grad_ranks(rank, world, mesh):
    # ExpertsTensorParallel: each rank's output is a partial sum over its slice of the intermediate size, so its
    # gradients of the hidden states and of the routing weights are partial too (each rank had kept its own part)
    from torch.distributed.tensor.parallel import parallelize_module

    transformers = pytest.importorskip("transformers")
    import tilegemm.nn as tnn

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=3, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="tilegemm")
    experts = model.model.layers[0].mlp.experts
    x, idx, w = torch.randn(6, 32), torch.randint(0, 3, (6, 2)), torch.rand(6, 2)
    sharded = parallelize_module(copy.deepcopy(experts), mesh, tnn.ExpertsTensorParallel())
    for call in ("args", "kwargs"):
        grads = []
        for block in (experts, sharded):
            xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = block(xa, idx, wa) if call == "args" else block(hidden_states=xa, top_k_index=idx,
                                                                   top_k_weights=wa)
            out.sum().backward()
            grads.append((out.detach(), xa.grad, wa.grad))
        (want, want_x, want_w), (got, got_x, got_w) = grads
        _close(got, want, FP32_TOL, f"experts output ({call})")
        _close(got_x, want_x, FP32_TOL, f"experts' hidden states gradient ({call})")
        _close(got_w, want_w, FP32_TOL, f"experts' routing weights gradient ({call})")
    # quantizing split experts (plain local tensors: each rank's slice in groups of its own) is refused, as DTensor
    # weights are: quantize first, then parallelize
    whole = copy.deepcopy(model)
    parallelize_module(whole, mesh, {"model.layers.*.mlp.experts": tnn.ExpertsTensorParallel()})
    for quantize in (tnn.quantize_, tnn.quantize_experts_):
        with pytest.raises(TypeError, match=r"model\.layers\.0\.mlp\.experts's experts are split already .* "
                                            r"quantize before parallelizing"):
            quantize(whole, group_size=32)
    assert whole.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # nothing changed


def test_parallel_experts_input_grad():
    spawn(experts_grad_ranks, 2)


def int4_state_ranks(rank, world, mesh, tmp):
    from safetensors.torch import save_file
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn
    from tilegemm.parallel import load_sharded_

    # a row-parallel act-order shard's input index is saved with it: a state dict loaded into another such shard
    # (of another checkpoint) computes what the saved one did (the index was left out: 0.87 off)
    a = torch.nn.Sequential(_act_order_linear(16, 128, 32))
    torch.manual_seed(5)
    b = torch.nn.Sequential(_act_order_linear(16, 128, 32))
    with torch.no_grad():  # another weight and input order than a's
        b[0].load_state_dict({**b[0].state_dict(), "perm": torch.randperm(128)})
    x = torch.randn(3, 128).half()
    with torch.no_grad():
        want = a(x)
    for m in (a, b):
        parallelize_module(m, mesh, {"0": tnn.RowwiseParallel(input_layouts=Replicate())})
    assert "0.tp_input_index" in a.state_dict()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        _close(b(x), want, FP16_TOL, "a row-parallel act-order shard loaded from another's state dict")

    # an fp32 4-bit layer stays fp32 when split (its bias was made fp16, its scales' dtype)
    q = tnn.quantize_(_mlp(64, 64, 16), group_size=32)
    parallelize_module(q, mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    assert q[0].bias.dtype == torch.float32 and (rank or q[2].bias.dtype == torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        q(torch.randn(3, 64).half())

    # load_sharded_ refuses, on every rank, a row-parallel 4-bit layer's bias the files lack (or hold and the layer
    # lacks): the ranks past the first, which hold no such bias, had returned (their next collective then waits)
    full = tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32)
    no_bias = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16, bias=False))
    for files, model, key in ((full, no_bias, "files but not in the model"), (no_bias, full, "not in the files")):
        state = {k: v.contiguous() for k, v in tnn.quantize_(copy.deepcopy(files).half(), group_size=32)
                 .state_dict().items()} if files is no_bias else {k: v.contiguous() for k, v in files.state_dict()
                                                                  .items()}
        path = f"{tmp}/files-{key[:5]}.safetensors"
        if rank == 0:
            save_file(state, path)
        torch.distributed.barrier()
        skeleton = parallelize_module(tnn.quantize_(copy.deepcopy(model).half(), group_size=32), mesh,
                                      {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
        with pytest.raises(ValueError, match=rf"{key}.*2\.bias"):
            load_sharded_(skeleton, path, mesh)


def test_parallel_int4_state_and_dtype(tmp_path):
    spawn(int4_state_ranks, 2, str(tmp_path))
