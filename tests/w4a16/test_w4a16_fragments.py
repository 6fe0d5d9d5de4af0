"""The fragment layout of ``frag_wgmma`` on the CPU: every nibble where the kernel's docstring says, every group's
zero and scale where it reads them (group 32: one a half K step), made once per weight, kept by ``Int4Linear`` as
unsaved buffers. (The kernel itself: ``test_w4a16_frag_wgmma.py``.)"""

from __future__ import annotations

import pytest
import torch

import tilegemm
from hypothesis import given, settings, strategies as st

from tilegemm import w4a16
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16.format import fits_fragments, pack_fragments, unpack_rows


def decode(words: torch.Tensor) -> torch.Tensor:
    """The kernel's reading of a fragment layout, written out: ``[K64 * 64, N16 * 16]`` values 0..15."""
    n16, k64 = words.shape[:2]
    w = words.to(torch.int64) & 0xFFFFFFFF
    t, c, lane, l, i = torch.meshgrid(*(torch.arange(n) for n in (n16, k64, 32, 4, 8)), indexing="ij")
    rl, km, h, j1, j0 = lane // 4, lane % 4, i // 4, (i // 2) % 2, i % 2
    row = 16 * t + 8 * j0 + rl
    k = 64 * c + 16 * l + 8 * j1 + 2 * km + h
    out = torch.full((k64 * 64, n16 * 16), -1, dtype=torch.int64)
    out[k, row] = (w[t, c, lane, l] >> (4 * i)) & 15
    return out


def dequantize_fragments(words: torch.Tensor, zs: torch.Tensor, group_k: int, N: int, K: int) -> torch.Tensor:
    """The weight ``[N, K]`` (stored order) as the kernel makes it from its layouts: input ``k`` of row ``r`` takes
    the zero and scale of group ``k // group_k`` at ``zs[g, r // 16, r % 8, (r % 16) // 8]`` (zero) and ``+ 2``
    (scale); group 32's two groups a K step are its two halves. Exact in fp32, rounded once."""
    q = decode(words)[:K, :N].double()  # [K, N]
    r = torch.arange(N)
    g = torch.arange(K) // group_k
    z = zs[g][:, r // 16, r % 8, (r % 16) // 8].double()
    s = zs[g][:, r // 16, r % 8, 2 + (r % 16) // 8].double()
    return ((q - z) * s).to(zs.dtype).T


@pytest.mark.parametrize("group, K", [(32, 96), (32, 352), (32, 32), (64, 192), (128, 384), (-1, 200), (-1, 96)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fragments_dequantize_to_the_plain_weight_bit_for_bit(group, K, dtype, symmetric):
    # K = 96, 352: an odd number of 32-groups (the last K step half padding); 200, 96 in one group: no K step
    # multiple; N = 37: a padded row tile
    w = w4a16.quantize(torch.randn(37, K, dtype=dtype), group, symmetric=symmetric)
    words, zs = w.fragments()
    assert zs.shape[0] * w.group_k >= words.shape[1] * 64  # every padded step has its groups (zero scales)
    assert torch.equal(dequantize_fragments(words, zs, w.group_k, 37, K), w4a16.dequantize(w))
    assert fits_fragments(w.group_k, K)


def test_act_order_fragments_hold_the_stored_order():
    K, N, G = 128, 24, 4  # GPTQ act-order in groups of 32: g_idx shuffled
    g_idx = torch.arange(K) // 32
    g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(3))].to(torch.int32)
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    qweight = (q.reshape(K // 8, 8, N) << (4 * torch.arange(8)[None, :, None])).sum(1).to(torch.int32)
    qzeros = torch.zeros(G, N // 8, dtype=torch.int32) + 0x77777777
    w = w4a16.from_gptq(qweight, qzeros, torch.rand(G, N).half() + 0.01, g_idx)
    assert w.perm is not None and w.group_k == 32
    words, zs = w.fragments()
    stored = dequantize_fragments(words, zs, 32, N, K)  # [N, K] in stored (group-sorted) order
    assert torch.equal(stored, w4a16.dequantize(w)[:, w.perm])


def test_the_fragment_kernel_takes_every_group_length_the_format_has():
    for K in (32, 96, 200, 4096, 4128):
        for group in w4a16.GROUP_SIZES:
            if (group == -1 and K % 8) or (group != -1 and K % group):
                continue
            assert fits_fragments(K if group == -1 else group, K), (group, K)
    assert not fits_fragments(0, 0)  # no inputs: nothing to lay out
    assert not fits_fragments(96) and not fits_fragments(200)  # no K given: only 32 and multiples of 64


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), k8=st.integers(1, 40), group=st.sampled_from([32, 64, 128, -1]))
def test_fragment_layout_holds_every_weight_where_the_kernel_reads_it(n, k8, group):
    K = 8 * k8 if group == -1 else group * max(1, (8 * k8) // group)
    gk = K if group == -1 else group
    q = torch.randint(0, 16, (K, n))
    G = K // gk
    scales = torch.randn(G, n).half()
    zeros = torch.randint(0, 17, (G, n)).half()
    words, zs = pack_fragments(q, scales, zeros, gk)
    assert words.dtype == torch.int32 and words.shape[2:] == (32, 4)
    assert words.shape[0] % 16 == 0 and words.shape[0] * 16 >= n and words.shape[1] * 64 >= K
    got = decode(words)
    assert torch.equal(got[:K, :n], q.to(torch.int64))
    assert (got[K:] == 0).all() and (got[:, n:] == 0).all()  # padding is zero weights
    # scales and zeros: (z[r], z[r + 8], s[r], s[r + 8]) for r = 16 t + rl, zero past N and past the groups
    r = torch.arange(n)
    t, rl, j0 = r // 16, r % 8, (r % 16) // 8
    assert torch.equal(zs[:G, t, rl, j0], zeros) and torch.equal(zs[:G, t, rl, 2 + j0], scales)
    assert zs.shape[0] * gk >= words.shape[1] * 64 and (zs[G:] == 0).all()


def test_fragments_are_made_once_counted_and_follow_the_weight():
    w = w4a16.quantize(torch.randn(40, 256, dtype=torch.float16), 128)
    before = w.nbytes
    fw, fzs = w.fragments()
    assert w.fragments()[0] is fw  # kept
    assert w.nbytes == before + fw.numel() * 4 + fzs.numel() * 2
    assert torch.equal(decode(fw)[:256, :40], unpack_rows(w.qweight).to(torch.int64))
    moved = w.to(torch.bfloat16)
    assert moved.fragments()[1].dtype == torch.bfloat16  # made again for the new scales
    assert "fweight" not in w.state_dict()


def test_int4linear_keeps_fragments_as_unsaved_buffers(keep_fragments):
    lin = torch.nn.Linear(256, 48).half()
    mod = Int4Linear.from_linear(lin, group_size=64)
    assert mod.fweight.numel() and "fweight" not in mod.state_dict()
    assert mod.weight._frag is not None
    fresh = Int4Linear(256, 48, group_size=64)
    fresh.load_state_dict(mod.state_dict())
    assert torch.equal(fresh.fweight, mod.fweight) and torch.equal(fresh.fzs, mod.fzs)
    small = Int4Linear.from_linear(torch.nn.Linear(96, 8).half(), group_size=32)  # two groups a K step
    assert small.weight._frag is not None
    assert torch.equal(dequantize_fragments(small.fweight, small.fzs, 32, 8, 96), w4a16.dequantize(small.weight))


def test_only_the_shipped_kernels_are_offered():
    assert set(tilegemm.kernels("w4a16")) >= {"gemv", "frag_wgmma", "mma", "dequant_cublas"}
    w = w4a16.quantize(torch.randn(16, 128, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match="frag_wgmma"):  # an unknown name: the error lists the kernels there are
        w4a16.matmul(torch.randn(1, 128, dtype=torch.float16), w, kernel="frag")
