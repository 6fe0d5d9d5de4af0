"""On the GPU (`pytest -m gpu`): the 4-bit experts kernel's dequantization bit for bit ``format.dequantize``'s in
every config of the table (fp16 and bf16: the 16-bit arithmetic the interpreter does not run), and the K split of
decode steps: right, deterministic, and replayed from a CUDA graph with the group sizes changing."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped import configs, int4
from tilegemm.ops.grouped.api import moe_gate_up
from tilegemm.ops.grouped.op import forward_int4
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_int4_unpack import one_hot_rows, random_experts

pytestmark = pytest.mark.gpu


def table_config(bm, group_k, K, split):
    bn, bk, warps, stages, swap, _, _ = configs.INT4[bm]
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=configs.int4_block_k(bk, group_k, K), GROUP_M=8, SPLIT_K=split,
                SWAP=swap, num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bm", sorted(configs.INT4))
@pytest.mark.parametrize("group_size, split", [(128, 1), (32, 2), (-1, 3)])
def test_int4_dequantization_bit_for_bit(bm, group_size, split, dtype):
    K, N = 512, 200
    w = random_experts(3, N, K, group_size, dtype).cuda()
    x, offs = one_hot_rows(K, [1, 0, 1], tail=5, dtype=dtype)
    x, offs = x.cuda(), offs.cuda()
    out = torch.full((x.shape[0], N), float("nan"), dtype=dtype, device="cuda")
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, None, out, 3, x.shape[0], N, K, w.group_k)
    int4.run(p, table_config(bm, w.group_k, K, split))
    deq = tilegemm.w4a16.dequantize(w)
    assert torch.equal(out[:K], deq[0].T) and torch.equal(out[K:2 * K], deq[2].T)
    assert torch.equal(out[2 * K:], torch.zeros_like(out[2 * K:]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_split_k_deterministic_and_right(dtype):
    # one token to 2 of 8 experts, Mixtral's down projection narrowed: the auto config splits K
    E, K, N = 8, 14336, 512
    a = torch.randn(2, K, device="cuda", dtype=dtype)
    b = torch.randn(E, N, K, device="cuda", dtype=dtype).transpose(1, 2)
    w4 = tilegemm.w4a16.quantize(b.transpose(1, 2).contiguous(), group_size=128)
    offs = torch.tensor([0, 1, 1, 1, 1, 2, 2, 2], dtype=torch.int32, device="cuda")
    first = tilegemm.grouped_mm(a, b, offs=offs)
    assert torch.equal(first, tilegemm.grouped_mm(a, b, offs=offs)), "the K split is not deterministic"
    assert_rel_close(first, grouped_mm_reference(a, b, offs), tolerance(dtype))
    q = tilegemm.w4a16.grouped_matmul(a, w4, offs)
    assert torch.equal(q, tilegemm.w4a16.grouped_matmul(a, w4, offs))
    deq = tilegemm.w4a16.dequantize(w4).transpose(1, 2)
    assert_rel_close(q, grouped_mm_reference(a, deq, offs), tolerance(dtype))


def test_decode_split_k_in_a_cuda_graph():
    # 8 rows over 16 experts: every product below splits K; the slices' workspace and counters live in the graph
    E, K, N, M = 16, 4096, 256, 8
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    w4 = tilegemm.w4a16.quantize(torch.randn(E, 2 * N, K, device="cuda", dtype=torch.bfloat16), group_size=128)
    offs = torch.tensor([1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 7, 8, 8, 8, 8, 8], dtype=torch.int32, device="cuda")
    run = lambda: (tilegemm.grouped_mm(a, b, offs=offs), tilegemm.w4a16.grouped_matmul(a, w4, offs),  # noqa: E731
                   moe_gate_up(a, torch.cat([b, b], 2), offs),
                   forward_int4(a, w4.qweight, w4.scales, w4.zeros, offs, None, w4.group_k, "silu", True, "auto"))
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    deq = tilegemm.w4a16.dequantize(w4).transpose(1, 2)
    tol = tolerance(torch.bfloat16)
    for ends in ([1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 7, 8, 8, 8, 8, 8], [0] * 15 + [8], [8] * 16, [0] * 16,
                 [0, 1, 2, 3, 4, 5, 6, 7] + [7] * 8):
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        full = grouped_mm_reference(a, b, offs)
        assert_rel_close(outs[0], full, tol)
        assert_rel_close(outs[1], grouped_mm_reference(a, deq, offs), tol)
        assert_rel_close(outs[2], torch.nn.functional.silu(full) * full, tol)
        gu = grouped_mm_reference(a, deq, offs)
        assert_rel_close(outs[3], torch.nn.functional.silu(gu[:, :N]) * gu[:, N:], tol)
