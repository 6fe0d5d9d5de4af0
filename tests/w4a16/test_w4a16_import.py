"""GPTQ v1 and AWQ (GEMM) importers, each against that format's own dequantization formula, on random
checkpoints packed here by the format's spec (docs: /work/shared/formats.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close

from tilegemm import w4a16

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_along(q: torch.Tensor, dim: int, order=range(8)) -> torch.Tensor:
    """Pack 4-bit ``q`` 8 per int32 along ``dim``: nibble i of word c holds element 8c + order[i]."""
    q = q.movedim(dim, -1).to(torch.int64)
    q = q.reshape(*q.shape[:-1], -1, 8)[..., list(order)]
    word = sum(q[..., i] << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def nibble(word: torch.Tensor, i) -> torch.Tensor:
    return (word.to(torch.int64) >> (4 * i)) & 15


def gptq_dequant(qweight, qzeros, scales, g_idx):
    """The v1 formula, element by element in index form: W.T[k, n] = s[g, n] * (q[k, n] - (z[g, n] + 1))."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    k = torch.arange(K)[:, None]
    n = torch.arange(N)[None, :]
    q = nibble(qweight[k // 8, n], k % 8)
    g = g_idx.long()[:, None]
    z = nibble(qzeros[g, n // 8], n % 8) + 1
    return (scales.double()[g, n] * (q - z)).T  # [N, K]


def awq_dequant(qweight, qzeros, scales, group_size):
    K, N = qweight.shape[0], qweight.shape[1] * 8
    k = torch.arange(K)[:, None]
    n = torch.arange(N)[None, :]
    reverse = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # column 8c + j is nibble REVERSE[j]
    q = nibble(qweight[k, n // 8], reverse[n % 8])
    g = k // group_size
    z = nibble(qzeros[g, n // 8], reverse[n % 8])
    return (scales.double()[g, n] * (q - z)).T


def random_gptq(N, K, group_size, act_order, dtype=torch.float16):
    G = K // group_size
    q = torch.randint(0, 16, (K, N))
    zeros_stored = torch.randint(0, 15, (G, N))  # v1 stores zero - 1
    scales = (torch.rand(G, N) * 0.1 + 0.01).to(dtype)
    g_idx = torch.arange(K) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(K)]
    return pack_along(q, 0), pack_along(zeros_stored, 1), scales, g_idx.to(torch.int32)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_from_gptq(device, act_order, group_size):
    N, K = 48, 256
    qweight, qzeros, scales, g_idx = random_gptq(N, K, group_size, act_order)
    expected = gptq_dequant(qweight, qzeros, scales, g_idx)
    w = w4a16.from_gptq(qweight, qzeros, scales, g_idx if act_order or group_size == 32 else None)
    assert (w.perm is not None) == act_order
    assert torch.equal(w4a16.dequantize(w).double(), expected.to(torch.float16).double())
    w = w.to(device)
    x = torch.randn(3, K, dtype=torch.float16, device=device)
    ref = x.double() @ expected.to(device).T
    for kernel in ("gemv", "mma"):
        assert_rel_close(w4a16.matmul(x, w, kernel=kernel), ref, 2e-3)


def test_from_gptq_zero_of_sixteen():
    # a stored zero of 15 means 16: held exactly in the float zeros
    qweight, qzeros, scales, g_idx = random_gptq(8, 64, 32, False)
    qzeros = pack_along(torch.full((2, 8), 15), 1)
    w = w4a16.from_gptq(qweight, qzeros, scales)
    assert float(w.zeros.max()) == 16.0
    assert torch.equal(w4a16.dequantize(w).double(),
                       gptq_dequant(qweight, qzeros, scales, g_idx).to(torch.float16).double())


@pytest.mark.parametrize("group_size", [64, 128])
def test_from_awq(device, group_size):
    N, K = 40, 256
    G = K // group_size
    q = torch.randint(0, 16, (K, N))
    z = torch.randint(0, 16, (G, N))
    scales = (torch.rand(G, N) * 0.1 + 0.01).half()
    qweight, qzeros = pack_along(q, 1, AWQ_ORDER), pack_along(z, 1, AWQ_ORDER)
    expected = awq_dequant(qweight, qzeros, scales, group_size)
    # the spec's own unpacking agrees with the values packed
    assert torch.equal(expected, (scales.double()[torch.arange(K) // group_size] * (q - z[torch.arange(K) // group_size])).T)
    w = w4a16.from_awq(qweight, qzeros, scales)
    assert torch.equal(w4a16.dequantize(w).double(), expected.to(torch.float16).double())
    w = w.to(device)
    x = torch.randn(2, K, dtype=torch.float16, device=device)
    assert_rel_close(w4a16.matmul(x, w), x.double() @ expected.to(device).T, 2e-3)


def test_importer_errors():
    qweight, qzeros, scales, g_idx = random_gptq(16, 128, 64, False)
    with pytest.raises(TypeError, match="int32"):
        w4a16.from_gptq(qweight.long(), qzeros, scales)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16.from_gptq(qweight, qzeros, scales[:, :8])
    with pytest.raises(ValueError, match="non-finite"):
        w4a16.from_gptq(qweight, qzeros, scales.masked_fill(scales > 0.05, float("inf")))
    with pytest.raises(ValueError, match="qzeros"):
        w4a16.from_gptq(qweight[:, :12], qzeros, scales[:, :12])
    with pytest.raises(ValueError, match="g_idx"):
        w4a16.from_gptq(qweight, qzeros, scales, torch.zeros(128, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not divide K"):
        w4a16.from_gptq(qweight, qzeros.repeat(3, 1)[:3], scales.repeat(3, 1)[:3])
    with pytest.raises(ValueError, match="group size K / G"):  # 128 / 8 = 16 is no supported group size
        w4a16.from_gptq(qweight, qzeros.repeat(4, 1), scales.repeat(4, 1))
    with pytest.raises(ValueError, match="qzeros"):
        w4a16.from_awq(qweight.T.contiguous()[:, :2], qzeros[:, :1], scales)
