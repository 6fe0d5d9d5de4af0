"""The grouped family on the GPU (`pytest -m gpu`): bf16/fp16 against the float64 oracle and torch's own
grouped_mm, no host sync on the call (CUDA-graph capture, offs changing between replays), torch.compile with
inductor, and a bf16 MoE model against its eager experts."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped.api import moe_gate_up
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_layouts import check_backward, operands

pytestmark = pytest.mark.gpu

LAYOUTS = ["2d3d", "3d3d", "2d2d", "3d2d"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("b_transposed", [False, True])
def test_16bit_layouts(dtype, layout, b_transposed):
    a, b, offs = operands(layout, [130, 0, 1, 257, 17, 0, 64], 200, 136, dtype, "cuda", tail=5,
                          b_transposed=b_transposed, M=129)
    bias = torch.randn(b.shape[-1], device="cuda", dtype=dtype)
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=bias), tolerance(dtype))


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_fp32_and_tf32(precision):
    a, b, offs = operands("2d3d", [100, 0, 33, 300], 256, 128, torch.float32, "cuda")
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        out = tilegemm.grouped_mm(a, b, offs=offs)
    finally:
        torch.set_float32_matmul_precision(old)
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float32, "tf32" if precision == "high"
                                                                        else "ieee"))


def test_matches_torch_grouped_mm_bf16():
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    a, b, offs = operands("2d3d", [64, 0, 128, 1, 63], 256, 512, torch.bfloat16, "cuda")
    b = torch.randn(5, 512, 256, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # torch's preferred layout
    want = torch.nn.functional.grouped_mm(a, b, offs=offs)
    assert_rel_close(tilegemm.grouped_mm(a, b, offs=offs), want.double(), tolerance(torch.bfloat16))


def test_no_host_sync_on_the_call():
    a, b, offs = operands("2d3d", [5, 0, 70], 64, 64, torch.bfloat16, "cuda")
    w4 = tilegemm.w4a16.quantize(torch.randn(3, 64, 64, device="cuda", dtype=torch.bfloat16), group_size=64)
    tilegemm.grouped_mm(a, b, offs=offs)  # compiled once, outside the check
    tilegemm.w4a16.grouped_matmul(a, w4, offs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tilegemm.grouped_mm(a, b, offs=offs)
        tilegemm.w4a16.grouped_matmul(a, w4, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_with_new_group_sizes():
    E, K, N, M = 6, 128, 96, 200
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    w4 = tilegemm.w4a16.quantize(torch.randn(E, 2 * N, K, device="cuda", dtype=torch.bfloat16), group_size=64)
    offs = torch.tensor([10, 10, 50, 120, 190, 200], dtype=torch.int32, device="cuda")
    run = lambda: (tilegemm.grouped_mm(a, b, offs=offs), tilegemm.w4a16.grouped_matmul(a, w4, offs),  # noqa: E731
                   moe_gate_up(a, torch.cat([b, b], 2), offs))
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    deq = tilegemm.w4a16.dequantize(w4).transpose(1, 2)
    for ends in ([10, 10, 50, 120, 190, 200], [0, 0, 0, 0, 0, 200], [200] * 6, [1, 2, 3, 4, 5, 6],
                 [0, 90, 90, 91, 91, 150]):
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(outs[0], grouped_mm_reference(a, b, offs), tolerance(torch.bfloat16))
        assert_rel_close(outs[1], grouped_mm_reference(a, deq, offs), tolerance(torch.bfloat16))
        full = grouped_mm_reference(a, b, offs)
        assert_rel_close(outs[2], torch.nn.functional.silu(full) * full, tolerance(torch.bfloat16))


def test_torch_compile_inductor():
    a, b, offs = operands("2d3d", [7, 0, 90], 64, 64, torch.float16, "cuda")
    f = torch.compile(lambda x, w, o: tilegemm.grouped_mm(x, w, offs=o).relu(), fullgraph=True)
    assert_rel_close(f(a, b, offs), grouped_mm_reference(a, b, offs).relu(), tolerance(torch.float16))


def test_backward_bf16():
    check_backward(*operands("2d3d", [70, 0, 1, 130], 96, 64, torch.bfloat16, "cuda"), torch.bfloat16)


def test_moe_model_bf16_matches_eager():
    transformers = pytest.importorskip("transformers")
    import copy

    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation="tilegemm")
    ours.load_state_dict(eager.state_dict())
    eager, ours = (m.to("cuda", torch.bfloat16).eval() for m in (eager, ours))
    ids = torch.randint(0, 256, (2, 33), device="cuda")
    with torch.no_grad():
        want, got = eager(ids).logits.float(), ours(ids).logits.float()
    assert (got - want).norm() / want.norm() < 2e-2
