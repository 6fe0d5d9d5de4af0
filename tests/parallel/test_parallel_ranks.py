"""Tensor parallelism across processes: 2 and 4 gloo ranks on the CPU (127.0.0.1), kernels under the interpreter.

Each test spawns its ranks once and runs several checks in them (a process importing torch and triton costs
seconds): a sharded model's output against the unsharded one, the collectives it ran, the errors of splits
that do not fit, and a sharded load from safetensors.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tilegemm.core.runtime import interpreting

pytest.importorskip("safetensors")
# The ranks hold CPU tensors, which tilegemm's kernels take under the interpreter only; on a GPU machine
# tests/parallel/test_parallel_local.py runs the same shards on the GPU.
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU ranks: kernels under Triton's interpreter")

FP16_TOL = 4e-3  # fp16 outputs: the ranks' partial sums are rounded to fp16 before the all-reduce adds them
FP32_TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, name: str, args: tuple) -> None:
    from tilegemm.core.runtime import interpreting, set_poisoning

    torch.set_num_threads(1)
    interpreting()  # settles the backend before anything imports triton
    set_poisoning(True)  # every kernel output starts as NaN: an unwritten element fails
    torch.manual_seed(0)  # the same inputs on every rank (replicated activations)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        fn = name if callable(name) else globals()[name]  # a function of another test module (fork: not pickled)
        fn(rank, world, init_device_mesh("cpu", (world,)), *args)
    finally:
        dist.destroy_process_group()


def spawn(name, world: int, *args) -> None:
    """Run ``name(rank, world, mesh, *args)`` (a function of this module by name, or any function) on ``world``
    gloo ranks; an exception in any rank fails the test."""
    import tilegemm.parallel  # noqa: F401 (imported once here, before the fork, rather than in every rank)

    # fork: the ranks start with torch, triton and tilegemm imported already (spawned ones import them again,
    # seconds each on a busy 2-core runner); one intra-op thread each, as libgomp's pool does not survive a fork.
    mp.start_processes(_entry, args=(world, _free_port(), name, args), nprocs=world, join=True,
                       start_method="fork")


# --- what the ranks run -------------------------------------------------------------------------------------


def _rel(out, ref) -> float:
    from tilegemm.core.checks import relative_error

    return relative_error(out, ref)


def _close(out, ref, tol, what) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = _rel(out, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _mlp(k: int, hidden: int, n: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(k, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n))


def _comms(fn):
    """``fn()`` and the collectives it ran, counted by name (all_reduce, all_gather_into_tensor, ...).

    CommDebugMode counts the same ops, but its module tracker breaks on one module object called twice in a
    forward (it pops its parent stack once per call ever made): transformers 5.25 runs one function module,
    made by the ``kernels`` package, from every decoder layer."""
    from collections import Counter

    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    functional = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                  "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"}
    # the process-group ops the functional ones stand for
    native = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor", "allgather_": "all_gather",
              "_reduce_scatter_base_": "reduce_scatter_tensor", "reduce_scatter_": "reduce_scatter",
              "alltoall_base_": "all_to_all_single", "broadcast_": "broadcast"}

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor turns the op into local ops and collectives, seen next
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.OpOverload):
                name = func._schema.name.partition("::")[2]
                if func.namespace in ("_c10d_functional", "c10d_functional") and name in functional:
                    self.counts[name] += 1
                elif func.namespace == "c10d" and name in native:
                    self.counts[native[name]] += 1
                elif func.namespace == "c10d" and name.endswith("_") and "barrier" not in name:
                    raise AssertionError(f"a collective the count does not know: c10d::{name}")
            return func(*args, **kwargs)

    with Collectives() as mode:
        out = fn()
    return out, dict(mode.counts)


def _act_order_linear(N: int, K: int, gs: int) -> "torch.nn.Module":
    """An Int4Linear imported from a GPTQ act-order checkpoint (g_idx a permutation of the groups)."""
    from tilegemm.nn import Int4Linear
    from tilegemm.ops.w4a16.format import pack_cols, pack_rows

    torch.manual_seed(1)
    q = torch.randint(0, 16, (K, N))
    zeros = torch.randint(0, 15, (K // gs, N))
    scales = (torch.rand(K // gs, N) * 0.05 + 0.01).half()
    g_idx = (torch.arange(K) // gs)[torch.randperm(K)].to(torch.int32)
    return Int4Linear.from_gptq(pack_rows(q), pack_cols(zeros), scales, g_idx, bias=torch.randn(N).half())


def two_ranks(rank, world, mesh, tmp):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm
    import tilegemm.nn as tnn

    x = torch.randn(3, 5, 32)

    # convert_ model with torch's own styles (tilegemm.nn.Linear is an nn.Linear): one all-reduce, no gather
    ref = _mlp(32, 64, 16)
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref)), mesh, {"0": TorchColwise(), "2": TorchRowwise()})
    assert isinstance(model[0], tnn.Linear) and model[0].weight.to_local().shape == (32, 32)
    out, comms = _comms(lambda: model(x))
    _close(out, ref(x), FP32_TOL, "convert_ MLP, torch's styles")
    assert comms == {"all_reduce": 1}, comms

    ref9 = _mlp(32, 9, 16)  # N = 9 does not split over 2 ranks

    # quantize_ model with tilegemm's styles: local Int4Weights, the same output
    ref = _mlp(64, 64, 16).half()
    q = tnn.quantize_(copy.deepcopy(ref), group_size=32)
    xh = torch.randn(4, 64).half()
    want = q(xh)
    parallelize_module(q, mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    assert q[0].weight.shape == (32, 64) and q[0].qweight.shape == (8, 32) and q[0].scales.shape == (2, 32)
    assert q[2].weight.shape == (16, 32) and q[2].qweight.shape == (4, 16) and q[2].scales.shape == (1, 16)
    assert (q[2].bias is not None) == (rank == 0)  # row-parallel bias added once
    out, comms = _comms(lambda: q(xh))
    _close(out, want, FP16_TOL, "quantize_ MLP")
    assert comms == {"all_reduce": 1}, comms

    # GPTQ act-order: column-parallel as is; row-parallel gathers its input and picks the sorted rows' inputs
    lin = _act_order_linear(16, 128, 32)
    xa = torch.randn(4, 128).half()
    want = lin(xa)
    col = parallelize_module(torch.nn.Sequential(copy.deepcopy(lin)), mesh,
                             {"0": tnn.ColwiseParallel(output_layouts=Replicate())})
    _close(col(xa), want, FP16_TOL, "act-order column-parallel")
    row = parallelize_module(torch.nn.Sequential(copy.deepcopy(lin)), mesh, {"0": tnn.RowwiseParallel()})
    out, comms = _comms(lambda: row(xa.chunk(world, -1)[rank]))
    _close(out, want, FP16_TOL, "act-order row-parallel")
    assert comms == {"all_gather_into_tensor": 1, "all_reduce": 1}, comms

    # convolutions: output channels, then input channels (one all-reduce); and a batch-split input
    torch.manual_seed(2)
    conv = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 6, 1))
    xc = torch.randn(2, 4, 6, 6)
    model = parallelize_module(tnn.convert_(copy.deepcopy(conv)), mesh,
                               {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, comms = _comms(lambda: model(xc))
    _close(out, conv(xc), FP32_TOL, "Conv2d column then row")
    assert comms == {"all_reduce": 1}, comms
    c0 = tnn.Conv2d.from_conv(copy.deepcopy(conv[0]))
    w = distribute_tensor(c0.weight.detach(), mesh, [Replicate()])
    b = distribute_tensor(c0.bias.detach(), mesh, [Replicate()])
    xb = distribute_tensor(torch.randn(4, 4, 5, 5), mesh, [Shard(0)])
    out, comms = _comms(lambda: tilegemm.conv2d(xb, w, b, padding=1))
    assert out.placements == (Shard(0),) and comms == {}, (out.placements, comms)
    _close(out.full_tensor(), torch.nn.functional.conv2d(xb.full_tensor(), c0.weight, c0.bias, padding=1), FP32_TOL,
           "batch-split conv2d")

    # the op's rules key on the activation: a row-parallel call without one, then with relu (which no partial
    # sum may take), both right
    a = distribute_tensor(torch.randn(6, 32), mesh, [Shard(1)])
    bm = distribute_tensor(torch.randn(32, 8), mesh, [Shard(0)])
    plain = tilegemm.matmul(a, bm)
    assert isinstance(plain, DTensor) and plain.placements[0].is_partial()
    _close(plain.full_tensor(), a.full_tensor() @ bm.full_tensor(), FP32_TOL, "row-parallel matmul")
    relu = tilegemm.matmul(a, bm, activation="relu")
    _close(relu.full_tensor(), torch.relu(a.full_tensor() @ bm.full_tensor()), FP32_TOL, "matmul + relu")

    # the W4A16 op on DTensor operands: its weight split along N
    from tilegemm.ops.w4a16.format import quantize

    w4 = quantize(torch.randn(16, 64).half(), 32)
    xd = distribute_tensor(torch.randn(3, 64).half(), mesh, [Replicate()])
    parts = {k: distribute_tensor(getattr(w4, k), mesh, [Shard(1)]) for k in ("qweight", "scales", "zeros")}
    out, comms = _comms(lambda: torch.ops.tilegemm.w4a16_matmul(xd, parts["qweight"], parts["scales"], parts["zeros"],
                                                                 None, None, None, 32, "none", "auto"))
    assert out.placements == (Shard(1),) and comms == {}, (out.placements, comms)
    _close(out.full_tensor(), tilegemm.w4a16.matmul(xd.full_tensor(), w4), 1e-3, "w4a16 op on DTensors")

    # splits that do not fit are refused, naming the problem
    with pytest.raises(ValueError, match=r"in_features K = 9 does not split evenly over 2 ranks"):
        parallelize_module(tnn.convert_(copy.deepcopy(ref9)), mesh, {"2": tnn.RowwiseParallel()})
    with pytest.raises(ValueError, match=r"out_features N = 9 does not split evenly over 2 ranks"):
        parallelize_module(tnn.quantize_(copy.deepcopy(ref9).half(), group_size=32), mesh,
                           {"0": tnn.ColwiseParallel()})
    cut = torch.nn.Sequential(tnn.Int4Linear.from_linear(torch.nn.Linear(64, 8).half(), group_size=64))
    with pytest.raises(ValueError, match=r"cut quantization groups of group_size = 64"):
        parallelize_module(cut, mesh, {"0": tnn.RowwiseParallel()})
    with pytest.raises(NotImplementedError, match="ColwiseParallel currently only support"):
        parallelize_module(tnn.quantize_(copy.deepcopy(ref), group_size=32), mesh, {"0": TorchColwise()})

    # the worked example of docs/parallel.md, on these ranks (its torchrun command runs the same main)
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tensor_parallel.py")
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main([]) == 0

    # a sharded load: each rank reads its slices of the files the unsharded models wrote (the parent's)
    from tilegemm.parallel import load_sharded_

    for fname, make, tol, styles in (
        ("fp16.safetensors", lambda: tnn.convert_(_mlp(64, 64, 16).half()), FP16_TOL, (TorchColwise, TorchRowwise)),
        ("int4.safetensors", lambda: tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32), FP16_TOL,
         (tnn.ColwiseParallel, tnn.RowwiseParallel)),
        ("actorder.safetensors", lambda: torch.nn.Sequential(_act_order_linear(16, 128, 32)), FP16_TOL,
         (tnn.RowwiseParallel, None)),
    ):
        full = torch.load(f"{tmp}/{fname}.pt", weights_only=False)
        with torch.no_grad():  # the skeleton's values differ from the files': they must all be overwritten
            skeleton = make()
            for name, t in skeleton.state_dict().items():
                if t.is_floating_point():
                    t.fill_(7.0)
                elif name.endswith("qweight"):
                    t.zero_()
        plan = {"0": styles[0]()} if styles[1] is None else {"0": styles[0](), "2": styles[1]()}
        model = load_sharded_(parallelize_module(skeleton, mesh, plan), f"{tmp}/{fname}", mesh)
        xs = torch.randn(3, model[0].in_features * (world if styles[1] is None else 1)).half()
        inp = xs.chunk(world, -1)[rank] if styles[1] is None else xs
        _close(model(inp), full(xs), tol, f"sharded load {fname}")

    # files that do not hold the model's 4-bit layers: named on every rank (none left waiting), never stale values
    from safetensors.torch import load_file, save_file

    stored = load_file(f"{tmp}/int4.safetensors")
    int4 = (tnn.ColwiseParallel, tnn.RowwiseParallel)
    for drop, error in ((("0.bias", "2.bias"), r"in the model but not in the files: \['0.bias'"),
                        (("2.zeros",), r"the files hold 2.qweight but not 2.zeros")):
        save_file({k: v for k, v in stored.items() if k not in drop}, f"{tmp}/drop-{rank}.safetensors")
        skeleton = parallelize_module(tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32), mesh,
                                      {"0": int4[0](), "2": int4[1]()})
        with pytest.raises(ValueError, match=error):
            load_sharded_(skeleton, f"{tmp}/drop-{rank}.safetensors", mesh)
    wide = tnn.quantize_(_mlp(64, 128, 16).half(), group_size=32)  # another hidden width than the skeleton's
    save_file({k: v.contiguous() for k, v in wide.state_dict().items()}, f"{tmp}/wide-{rank}.safetensors")
    skeleton = parallelize_module(tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32), mesh,
                                  {"0": int4[0](), "2": int4[1]()})
    with pytest.raises(ValueError, match=r"load_sharded_: 0 \(Int4Linear, local \[out, in\] = \[32, 64\], group_size "
                                         r"32\): this rank's slice of the files' tensors does not fit"):
        load_sharded_(skeleton, f"{tmp}/wide-{rank}.safetensors", mesh)


def four_ranks(rank, world, mesh, tmp):
    from torch.distributed.tensor.parallel import parallelize_module

    import tilegemm.nn as tnn

    ref = _mlp(32, 128, 16)
    x = torch.randn(2, 32)
    model = parallelize_module(tnn.convert_(copy.deepcopy(ref)), mesh,
                               {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    out, comms = _comms(lambda: model(x))
    _close(out, ref(x), FP32_TOL, "convert_ MLP over 4 ranks")
    assert comms == {"all_reduce": 1}, comms

    q = tnn.quantize_(copy.deepcopy(ref).half(), group_size=32)
    want = q(x.half())
    parallelize_module(q, mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
    assert q[0].qweight.shape == (4, 32) and q[2].qweight.shape == (4, 16) and q[2].scales.shape == (1, 16)
    _close(q(x.half()), want, FP16_TOL, "quantize_ MLP over 4 ranks")

    # K = 64 over 4 ranks is 16 inputs each: a group of 32 would be cut
    cut = tnn.quantize_(_mlp(32, 64, 16).half(), group_size=32)
    with pytest.raises(ValueError, match=r"K = 64 over 4 ranks \(16 each\) would cut quantization groups of "
                                         r"group_size = 32"):
        parallelize_module(cut, mesh, {"2": tnn.RowwiseParallel()})


# --- the tests ----------------------------------------------------------------------------------------------


def test_parallel_two_ranks(tmp_path):
    from safetensors.torch import save_file

    import tilegemm.nn as tnn

    # The unsharded models the ranks load from: written once here, with the module each rank compares against.
    for fname, model in (
        ("fp16.safetensors", tnn.convert_(_mlp(64, 64, 16).half())),
        ("int4.safetensors", tnn.quantize_(_mlp(64, 64, 16).half(), group_size=32)),
        ("actorder.safetensors", torch.nn.Sequential(_act_order_linear(16, 128, 32))),
    ):
        torch.manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))  # other values than the skeleton's seed gives
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / fname))
        torch.save(model, tmp_path / f"{fname}.pt")
    spawn("two_ranks", 2, str(tmp_path))


def test_parallel_four_ranks(tmp_path):
    spawn("four_ranks", 4, str(tmp_path))


# --- from_pretrained on a mesh ------------------------------------------------------------------------------


PRETRAINED_IDS = [[3, 17, 200, 5]]


def pretrained_ranks(rank, world, mesh, tmp, wants):
    from tilegemm.models import from_pretrained, pretrained
    from tilegemm.nn import Int4Linear

    whole = []  # tensors read whole by the sharded loads
    get = pretrained._Tensors.get

    def recording_get(self, name):
        whole.append(name)
        return get(self, name)

    ids = torch.tensor(PRETRAINED_IDS)
    for name, want in wants.items():  # (each checkpoint's unsharded logits: the parent's, the same on every rank)
        path = f"{tmp}/{name}"
        whole.clear()
        pretrained._Tensors.get = recording_get
        try:
            model = from_pretrained(path, device="cpu", device_mesh=mesh)
        finally:
            pretrained._Tensors.get = get
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert isinstance(mlp.down_proj, Int4Linear) and mlp.down_proj.in_features == 256 // world
        assert attn.q_proj.out_features == 128 // world and attn.o_proj.in_features == 128 // world
        packed = [n for n in whole if n.endswith((".qweight", ".qzeros", ".scales", ".zeros", ".weight_packed",
                                                  ".weight_zero_point", ".weight_scale"))]
        if "actorder" in name:  # a row-parallel act-order layer reads its packed tensors whole (one at a time)
            assert packed and all(n.endswith(("o_proj." + n.rpartition(".")[2], "down_proj." + n.rpartition(".")[2]))
                                  for n in packed), packed
        else:
            assert packed == [], packed  # every packed tensor read as this rank's slice
        _close(model(input_ids=ids).logits, want, FP16_TOL, f"from_pretrained on {world} ranks: {name}")
    import os  # (the last model: its save_pretrained would write this rank's shards as the whole model)

    with pytest.raises(RuntimeError, match=r"loaded tensor-parallel over 2 ranks: .*Save from a load without "
                                           r"device_mesh"):
        model.save_pretrained(f"{tmp}/resaved-{rank}")
    assert not os.path.exists(f"{tmp}/resaved-{rank}")


def test_parallel_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import ckpt_writer as cw

    config = cw.tiny_config("llama", hidden=128, layers=1)
    names = {"gptq-actorder-g32": dict(method="gptq", group_size=32, act_order=True),
             "awq-g64": dict(method="awq", group_size=64),
             # GPTQModel's symmetric AWQ (zero_point false), its qzeros of 8 not stored: each zero 8
             "awq-sym-no-qzeros-g64": dict(method="awq", group_size=64, sym=True, drop=[
                 f"{n}.qzeros" for n in cw.linear_names(cw.random_model(config))]),
             "ct-asym-g32": dict(method="compressed-tensors", group_size=32, sym=False),
             "ct-actorder-g64": dict(method="compressed-tensors", group_size=64, act_order=True),
             # AutoRound's GPTQ packing, one layer in a group size of its own (extra_config)
             "autoround-gptq-g32": dict(method="gptq", group_size=32, autoround=True, quant_extra=dict(
                 block_name_to_quantize="model.layers", extra_config={"model.layers.0.mlp.down_proj": {
                     "group_size": 64}}))}
    for name, kw in names.items():
        cw.write_model(tmp_path / name, cw.random_model(config), **kw)
    # models tilegemm saved (its own buffers): quantized here, and loaded from the act-order GPTQ checkpoint
    import warnings

    from tilegemm.models import from_pretrained
    from tilegemm.nn import quantize_

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cw.random_model(config).half()
        quantize_(model, group_size=64, filter=lambda n, m: "lm_head" not in n)
        model.save_pretrained(tmp_path / "saved-g64")
        from_pretrained(tmp_path / "gptq-actorder-g32", device="cpu").save_pretrained(tmp_path / "saved-actorder")
    # Qwen3: its plan also names q/k norms ('replicated_with_grad_allreduce'), which stay whole
    import transformers

    qwen3 = transformers.AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=128, intermediate_size=256,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
    cw.write_model(tmp_path / "qwen3-gptq-g32", cw.random_model(qwen3), "gptq", 32)
    # each model's unsharded logits computed once here, not once a rank
    ids = torch.tensor(PRETRAINED_IDS)
    with torch.no_grad():
        wants = {name: from_pretrained(tmp_path / name, device="cpu")(input_ids=ids).logits
                 for name in [*names, "saved-g64", "saved-actorder", "qwen3-gptq-g32"]}
    spawn("pretrained_ranks", 2, str(tmp_path), wants)
