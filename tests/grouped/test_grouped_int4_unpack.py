"""The 4-bit experts kernel's unpacking, scales and K split, configs given by hand: each packed word loaded once and
split into its eight nibbles in registers, one row of scales a step where the step lies in one group (else one per
K row), the weight as the MMA's A operand (SWAP), K slices reduced by the last to arrive.

One-hot rows of x read the dequantized weight back exactly (each output is one weight times 1), so these tests
compare bit for bit with ``format.dequantize``; outputs start as NaN, so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped import int4
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.grouped.reference import grouped_mm_reference
from tilegemm.ops.w4a16.format import Int4Weight

from conftest import assert_rel_close, crossed

# (config name, config): BLOCK_K 32 (a step inside one group of 32 and more), 64 (groups of 32: the per-row
# gather), 16 with SWAP, and K split in 2 and 3 slices.
CONFIGS = {
    "bk32": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2),
    "bk64_rows": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2),
    "bk16_swap": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=1, SWAP=True),
    "split2": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=2),
    "split3_swap": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, SPLIT_K=3, SWAP=True),
}
# (group size, K): groups of 32, 64, 128 (two or three of them) and one group over a K of 9 packed words
GROUPS = [(32, 96), (64, 192), (128, 256), (-1, 72)]


def random_experts(E, N, K, group_size, dtype, device="cpu"):
    """Stacked experts with every nibble and zero point drawn at random (zeros 0..16: asymmetric, both ends), on
    ``device``."""
    G = 1 if group_size == -1 else K // group_size
    q = torch.randint(0, 16, (E, K, N), dtype=torch.int64)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (q.reshape(E, K // 8, 8, N) << shifts[None, None, :, None]).sum(2)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    zeros = torch.randint(0, 17, (E, G, N)).to(dtype)
    zeros[0, 0, 0], zeros[-1, -1, -1] = 0, 16
    scales = (torch.rand(E, G, N) * 0.1 + 1e-3).to(dtype)
    return Int4Weight(qweight, scales, zeros, group_size, (E, N, K)).to(device)


def one_hot_rows(K, sizes, tail, dtype, device="cpu"):
    """x: for each group of ``sizes``, K one-hot rows (``I_K``) or none; then ``tail`` rows of ones; on ``device``."""
    parts = [torch.eye(K, dtype=dtype) if n else torch.empty(0, K, dtype=dtype) for n in sizes]
    x = torch.cat(parts + [torch.ones(tail, K, dtype=dtype)])
    offs = torch.tensor([K if n else 0 for n in sizes], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x.to(device), offs.to(device)


def run(x, w, offs, config, bias=None, activation="none", gated=False):
    E, N, K = w.shape
    n_out = N // 2 if gated else N
    out = torch.full((x.shape[0], n_out), float("nan"), dtype=x.dtype, device=x.device)
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, bias, out, E, x.shape[0], n_out, K, w.group_k,
                           activation, gated)
    int4.run(p, dict(config, num_warps=4, num_stages=1))
    return out


# Every config, group and dtype (bf16: the interpreter runs it through fp32 copies, rounded by hand); under the
# interpreter each config and group meet in one dtype
@crossed("config, group, dtype", list(CONFIGS), GROUPS, [torch.float16, torch.bfloat16],
         ids=(None, lambda g: f"g{g[0]}", lambda d: str(d)[6:]))
def test_dequantized_weight_bit_for_bit(config, group, dtype, device):
    group_size, K = group
    N = 19  # odd: the last column tile is partly outside
    w = random_experts(3, N, K, group_size, dtype, device)
    # expert 0 reads back its even K rows, expert 2 its odd ones (every group and packed word of each, every nibble
    # of the format between them); expert 1 empty, 3 rows past offs[-1]
    eye, h = torch.eye(K, dtype=dtype), K // 2
    x = torch.cat([eye[0::2], eye[1::2], torch.ones(3, K, dtype=dtype)]).to(device)
    offs = torch.tensor([h, h, K], dtype=torch.int32, device=device)
    out = run(x, w, offs, CONFIGS[config])
    deq = tilegemm.w4a16.dequantize(w)  # [E, N, K]
    assert torch.equal(out[:h], deq[0].T[0::2]), "expert 0's weight is not dequantize's, bit for bit"
    assert torch.equal(out[h:K], deq[2].T[1::2]), "expert 2's weight is not dequantize's, bit for bit"
    assert torch.equal(out[K:], torch.zeros_like(out[K:])), "rows past offs[-1] are not zero"


@pytest.mark.parametrize("config", ["bk64_rows", "split3_swap"])
def test_gated_bias_and_random_rows(config, device):
    # gate/up product with per-expert bias, odd N and row counts, an empty expert first and last
    E, N, K = 4, 2 * 21, 96
    w = random_experts(E, N, K, 32, torch.float16, device)
    sizes = [0, 5, 17, 0]
    x = torch.randn(sum(sizes) + 2, K, dtype=torch.float16, device=device)
    offs = torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    bias = torch.randn(E, N, dtype=torch.float16, device=device)
    out = run(x, w, offs, CONFIGS[config], bias=bias, activation="silu", gated=True)
    full = grouped_mm_reference(x, tilegemm.w4a16.dequantize(w).transpose(1, 2), offs, bias=bias)
    want = torch.nn.functional.silu(full[:, :21]) * full[:, 21:]
    assert_rel_close(out, want, 4e-3)
    assert torch.equal(out[22:], torch.zeros_like(out[22:]))


def test_split_counters_are_left_at_zero(device):
    # the arrival counters are shared by the next launch on the stream: every launch leaves them at zero
    from tilegemm.core.workspace import split_workspace

    w = random_experts(2, 24, 64, 32, torch.float16, device)
    x, offs = one_hot_rows(64, [1, 1], tail=0, dtype=torch.float16, device=device)
    for _ in range(2):  # the second launch counts from zero again, or its tiles would never be stored
        out = run(x, w, offs, CONFIGS["split2"])
        assert torch.equal(out, torch.cat(list(tilegemm.w4a16.dequantize(w).transpose(1, 2))))
    _, count = split_workspace(out.device, 1, 1, tag="grouped")  # (the launches' own: this device and stream)
    assert not count.any()


def test_refuses_a_block_k_that_splits_packed_words(device):
    w = random_experts(2, 16, 64, 32, torch.float16, device)
    x, offs = one_hot_rows(64, [1, 1], tail=0, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="BLOCK_K=24"):
        run(x, w, offs, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=24, GROUP_M=1))
