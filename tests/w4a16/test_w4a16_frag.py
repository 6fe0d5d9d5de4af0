"""The ``frag`` kernel: the fragment layout on the CPU (every nibble where the kernel's docstring says), its
routing under ``auto``, an offline sm_90 compile (the dequantized tile needs no layout conversion), and on
the GPU against ``x @ dequantize(w).T`` over odd shapes, group sizes, dtypes, splits and epilogues."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close
from w4a16_kit import check_fragment_kernel, check_launch_twice, compile_report, reference
from hypothesis import given, settings, strategies as st

from tilegemm import w4a16
from tilegemm.core import registry
from tilegemm.core.runtime import interpreting
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16 import configs
from tilegemm.ops.w4a16.format import pack_fragments, unpack_rows


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


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), k8=st.integers(1, 40), group=st.sampled_from([64, 128, -1]))
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


def test_int4linear_keeps_fragments_as_unsaved_buffers():
    lin = torch.nn.Linear(256, 48).half()
    mod = Int4Linear.from_linear(lin, group_size=64)
    assert mod.fweight.numel() and "fweight" not in mod.state_dict()
    assert mod.weight._frag is not None
    fresh = Int4Linear(256, 48, group_size=64)
    fresh.load_state_dict(mod.state_dict())
    assert torch.equal(fresh.fweight, mod.fweight) and torch.equal(fresh.fzs, mod.fzs)
    small = Int4Linear.from_linear(torch.nn.Linear(64, 8).half(), group_size=32)  # no K step of 64 fits
    assert small.fweight.numel() == 0 and small.weight._frag is None


def test_frag_configs_and_unavailability():
    cfg = configs.frag_config(1, 8192, 8192, "cpu")
    assert cfg["RH"] == 4 and cfg["BM"] == 8 and cfg["SPLIT_K"] >= 1
    assert configs.frag_config(16, 4096, 4096, "cpu")["BM"] == 16
    if interpreting():
        w = w4a16.quantize(torch.randn(16, 128, dtype=torch.float16), 64)
        with pytest.raises(registry.NotApplicable, match="frag"):
            w4a16.matmul(torch.randn(1, 128, dtype=torch.float16), w, kernel="frag")


# --- offline compile for sm_90 ------------------------------------------------------------------------------

_VARIANTS = {
    "m1-fp16-split": dict(dtype="float16", mnk=[1, 8192, 8192], bias=False, act="none",
                          cfg=dict(RH=4, BM=8, SPLIT_K=16)),
    "m16-bf16-bias-silu": dict(dtype="bfloat16", mnk=[16, 4096, 4096], bias=True, act="silu",
                               cfg=dict(RH=2, BM=16, SPLIT_K=1)),
    "odd-k-deep": dict(dtype="float16", mnk=[5, 1000, 4160], bias=False, act="none",
                       cfg=dict(RH=1, BM=8, SPLIT_K=3, KH=2, DEPTH=2)),
}


def test_compiles_for_sm90_without_layout_conversions_or_spills(tmp_path):
    # The dequantized tile is converted to the MMA operand layout with assert_trivial: a compile that got
    # here moved no data between threads for it.
    report = compile_report(tmp_path, "frag", _VARIANTS)
    for name, r in report.items():
        assert r["mma_sync"] >= 4, name
        assert r["lop3"] >= 4, name  # the dequantization's nibble pairs
        assert r["wide_loads"] >= 1, name  # 16-byte loads of the packed words
        assert r["shared"] <= 16, f"{name}: shared memory {r['shared']} (a layout conversion?)"  # the atomic's 4 B
        assert r["spills"] in ([], [0]), name


# --- on the GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,group", [(72, 256, 64), (1000, 4160, 64), (4096, 4096, 128), (257, 1024, 256),
                                       (8192, 1024, -1), (300, 200, -1)])
@pytest.mark.parametrize("M", [1, 7, 16, 33])
def test_frag_matches_the_reference(dtype, N, K, group, M):
    check_fragment_kernel("frag", dtype, N, K, group, M)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(RH=1, BM=8, SPLIT_K=1), dict(RH=2, BM=16, SPLIT_K=7),
                                 dict(RH=4, BM=8, SPLIT_K=16, DEPTH=2), dict(RH=2, BM=8, SPLIT_K=3, KH=2)])
def test_frag_configs_and_uneven_splits(cfg):
    from tilegemm.ops.w4a16 import frag

    check_launch_twice(frag, cfg, 11)


@pytest.mark.gpu
def test_frag_replays():
    from tilegemm.ops.w4a16 import op as replay

    replay.REPLAYS.clear()
    lin = Int4Linear.from_linear(torch.nn.Linear(4096, 1024).half().cuda(), group_size=128)
    w = lin.weight
    for M in (1, 9):
        for _ in range(3):
            x = torch.randn(M, 4096, dtype=torch.float16, device="cuda")
            assert_rel_close(w4a16.matmul(x, w, lin.bias, kernel="frag"), reference(x, w, lin.bias), 2e-3)
    assert replay.REPLAYS.count() == 2
    assert registry.get("w4a16", "frag").unavailable_reason() is None
