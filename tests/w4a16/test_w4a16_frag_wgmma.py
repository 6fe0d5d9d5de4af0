"""The ``frag_wgmma`` kernel: its config rule and routing under ``auto`` on the CPU (every group length, act-order),
its argument checks, an offline sm_90 compile (wgmma from registers without serialization, cp.async, no spills;
group 32's form too), and on the GPU against ``x @ dequantize(w).T`` over odd shapes, group sizes (32: two groups a
K step), dtypes, tiles, splits, epilogues and strided x, and bit for bit against ``dequantize`` (one-hot rows)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close
from w4a16_kit import check_fragment_kernel, check_launch_twice, compile_report
from hypothesis import given, settings, strategies as st

from tilegemm import w4a16
from tilegemm.core import registry
from tilegemm.core.runtime import interpreting
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16 import configs, dispatch
from tilegemm.ops.w4a16.reference import reference

SMEM = 227 * 1024  # shared memory a block may use on Hopper


def test_auto_routes_up_to_512_rows_to_frag_wgmma_where_it_runs_and_narrow_weights_from_129():
    for M in (1, 16, 17, 128, 256, 512):
        assert dispatch.choose(M, frag=True) == "frag_wgmma"
        assert dispatch.choose(M, frag=True, N=dispatch.FRAG_WGMMA_NARROW_N) == "frag_wgmma"
    for M in (1, 64, 128):  # narrow weights too, up to 128 rows
        assert dispatch.choose(M, frag=True, N=1024) == "frag_wgmma"
    for M in (129, 256, 512):
        assert dispatch.choose(M, frag=True, N=dispatch.FRAG_WGMMA_NARROW_N - 128) == "dequant_cublas"
    assert dispatch.choose(513, frag=True) == "dequant_cublas" and dispatch.choose(1024, frag=True, N=8192) == \
        "dequant_cublas"
    assert dispatch.choose(1) == "gemv" and dispatch.choose(64) == "mma" and dispatch.choose(1025) == "dequant_cublas"
    if interpreting():
        w = w4a16.quantize(torch.randn(16, 128, dtype=torch.float16), 64)
        with pytest.raises(registry.NotApplicable, match="frag_wgmma"):
            w4a16.matmul(torch.randn(1, 128, dtype=torch.float16), w, kernel="frag_wgmma")


class _Rows:
    """What dispatch reads of 2-D activations (rows, device): a CUDA tensor's stand-in on a machine without one."""

    def __init__(self, M: int, K: int):
        self.shape, self.device = (M, K), torch.device("cuda")


@pytest.mark.parametrize("group, K", [(32, 5120), (32, 4128), (64, 4096), (128, 4096), (256, 11008), (-1, 5120),
                                      (-1, 200), (32, 32)])
def test_auto_takes_frag_wgmma_on_hopper_for_every_group_length(monkeypatch, group, K):
    # on an sm_90 GPU (the registry's answer for it pretended): every format goes to the fragment kernel up to
    # 128 rows (512 for wide weights), group 32 (two groups a K step) and one group over a K that is no multiple
    # of 64 included
    monkeypatch.setitem(dispatch._FRAG_REASON, torch.device("cuda"), "")
    w = w4a16.quantize(torch.randn(8, K, dtype=torch.float16), group)
    assert dispatch.frag_usable(w.group_k, torch.device("cuda"), K)
    for M in (1, 3, 48, 128):
        assert dispatch.wants_frag("auto", _Rows(M, K), w)
    assert not dispatch.wants_frag("auto", _Rows(129, K), w)  # a narrow weight (8 rows): dequant_cublas
    assert dispatch.choose(3, frag=dispatch.frag_usable(w.group_k, torch.device("cuda"), K)) == "frag_wgmma"
    assert not dispatch.frag_usable(w.group_k, torch.device("cpu"), K)


def test_auto_takes_frag_wgmma_for_act_order_weights(monkeypatch):
    monkeypatch.setitem(dispatch._FRAG_REASON, torch.device("cuda"), "")
    K, N = 256, 16
    g_idx = (torch.arange(K) // 32)[torch.randperm(K, generator=torch.Generator().manual_seed(0))]
    q = torch.randint(0, 16, (K // 8, N), dtype=torch.int32)
    w = w4a16.from_gptq(q, torch.zeros(8, N // 8, dtype=torch.int32), torch.rand(8, N).half(), g_idx.to(torch.int32))
    assert w.perm is not None and w.group_k == 32
    assert dispatch.wants_frag("auto", _Rows(16, K), w)


@settings(max_examples=200, deadline=None)
@given(M=st.integers(1, 4096), N=st.integers(1, 40000), K64=st.integers(1, 600), sms=st.sampled_from([78, 114, 132]))
def test_config_rule_gives_launchable_configs(M, N, K64, sms):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(configs, "sm_count", lambda device: sms)
        cfg = configs.frag_wgmma_config(M, N, 64 * K64, "cuda")
    bm, rh, warps = cfg["BM"], cfg["RH"], cfg["num_warps"]
    assert bm in (8, 16, 32, 64, 128, 256) and (bm >= M or bm >= 64)
    assert rh * bm <= 256  # the accumulator: at most 128 fp32 registers a thread
    assert warps == 4 or (warps == 8 and bm >= 128)
    assert rh == 1 or 32 <= bm <= 64  # small M: one row tile a warp, the K split makes the programs
    assert cfg["STAGES"] * (bm * 64 * 2 + 16 * rh * warps * 32) <= SMEM
    assert cfg["SPLIT_K"] == 1 or K64 // cfg["SPLIT_K"] >= (4 if bm == 8 else 8)  # slices of 8 steps (M <= 8: 4)
    assert cfg["OVERLAP"] == cfg["PIPE"] == (M >= configs.FRAG_WGMMA_OVERLAP_M)
    if M > 128:  # 128 weight rows a program, the split filling at most one wave
        assert (bm, warps, rh) in ((128, 8, 1), (256, 8, 1))
        tiles = -(-N // 128) * -(-M // bm)
        assert cfg["SPLIT_K"] in (1, 2, 4) and (cfg["SPLIT_K"] == 1 or tiles * cfg["SPLIT_K"] <= sms)


def test_config_rule_splits_small_weights_finer_at_up_to_8_rows(monkeypatch):
    # 1280 x 1152: 20 tiles of 64 weight rows, 18 K steps; slices of 8 steps made 40 programs for 132 SMs
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    assert [configs.frag_wgmma_config(M, 1280, 1152, "cuda")["SPLIT_K"] for M in (1, 8, 9, 16)] == [4, 4, 2, 2]
    # a weight whose 8-step slices fill the SMs already keeps its split
    assert configs.frag_wgmma_config(1, 8192, 8192, "cuda")["SPLIT_K"] == 8


def test_config_rule_takes_wide_tiles_where_they_fill_most_of_a_wave(monkeypatch):
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    wide = configs.frag_wgmma_config(256, 14336, 4096, "cuda")  # 112 tiles of 256 rows: 0.85 of a wave
    assert (wide["BM"], wide["num_warps"], wide["SPLIT_K"], wide["PIPE"]) == (256, 8, 1, True)
    narrow = configs.frag_wgmma_config(256, 8192, 8192, "cuda")  # 64 tiles of 256 rows, 128 of 128
    assert (narrow["BM"], narrow["SPLIT_K"]) == (128, 1)
    split = configs.frag_wgmma_config(256, 4096, 14336, "cuda")  # 64 tiles of 128 rows: split in two
    assert (split["BM"], split["SPLIT_K"]) == (128, 2)
    few = configs.frag_wgmma_config(128, 4096, 4096, "cuda")  # 32 row tiles: the 4-warp rule
    assert (few["BM"], few["num_warps"]) == (64, 4) and few["PIPE"]
    assert not configs.frag_wgmma_config(32, 4096, 4096, "cuda")["PIPE"]


def test_launch_args_name_what_they_cannot_take():
    from tilegemm.ops.w4a16 import frag_wgmma

    x = torch.empty(4, 256, dtype=torch.float16)
    fw = torch.empty(16, 2, 32, 4, dtype=torch.int32)
    fzs = torch.empty(8, 16, 8, 4, dtype=torch.float16)
    out = torch.empty(4, 200, dtype=torch.float16)
    cfg = dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1)
    with pytest.raises(ValueError, match="group length 96"):
        frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 96, "none", cfg)
    # group 32: the kernel's two-groups-a-step form (named only then); one group of all K: as long as the steps
    _, _, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 32, "none", cfg)
    assert kwargs["GROUP32"] is True and args[14] == 32
    _, _, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 128, "none", cfg)
    assert "GROUP32" not in kwargs and args[14] == 128
    x200 = torch.empty(4, 200, dtype=torch.float16)
    _, _, args, kwargs = frag_wgmma.launch_args(x200, fw, fzs, None, out, 200, 200, 200, "none", cfg)
    assert "GROUP32" not in kwargs and args[14] == 256 and not kwargs["EVEN_K"]
    with pytest.raises(ValueError, match="row stride 260"):
        frag_wgmma.launch_args(torch.empty(4, 260, dtype=torch.float16)[:, :256], fw, fzs, None, out, 200, 256, 128,
                               "none", cfg)
    with pytest.raises(ValueError, match="STAGES >= 3"):
        frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 128, "none", dict(cfg, STAGES=2, OVERLAP=True))
    shifted = torch.empty(4 * 256 + 1, dtype=torch.float16)[1:].view(4, 256)  # rows 16-byte apart, start not
    with pytest.raises(ValueError, match="16-byte aligned"):
        frag_wgmma.launch_args(shifted, fw, fzs, None, out, 200, 256, 128, "none", cfg)


# --- offline compile for sm_90 ------------------------------------------------------------------------------

_VARIANTS = {
    "m1-fp16-split": dict(dtype="float16", mnk=[1, 8192, 8192], bias=False, act="none",
                          cfg=dict(BM=8, RH=2, num_warps=4, STAGES=4, SPLIT_K=8, OVERLAP=False)),
    "m1-fp16-pairs": dict(dtype="float16", mnk=[1, 8192, 8192], bias=False, act="none",
                          cfg=dict(BM=8, RH=1, num_warps=4, STAGES=6, SPLIT_K=8, OVERLAP=False, PAIRS=True)),
    "m16-bf16-g32-pairs": dict(dtype="bfloat16", mnk=[16, 4096, 4128], bias=True, act="silu", group=32,
                               cfg=dict(BM=16, RH=1, num_warps=4, STAGES=8, SPLIT_K=3, OVERLAP=False, PAIRS=True)),
    # the shipped rule at 17 .. 32 rows: PAIRS on a ring of 6, both row tiles a warp
    "m32-fp16-pairs": dict(dtype="float16", mnk=[32, 8192, 8192], bias=False, act="none",
                           cfg=dict(BM=32, RH=1, num_warps=4, STAGES=6, SPLIT_K=2, OVERLAP=False, PAIRS=True)),
    "m24-bf16-pairs-rh2": dict(dtype="bfloat16", mnk=[24, 14336, 4096], bias=True, act="silu",
                               cfg=dict(BM=32, RH=2, num_warps=4, STAGES=6, SPLIT_K=1, OVERLAP=False, PAIRS=True)),
    "m64-bf16-bias-silu": dict(dtype="bfloat16", mnk=[64, 4096, 4096], bias=True, act="silu",
                               cfg=dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=2, OVERLAP=True)),
    "m256-odd-k": dict(dtype="float16", mnk=[300, 1000, 4160], bias=False, act="none",
                       cfg=dict(BM=256, RH=1, num_warps=8, STAGES=4, SPLIT_K=1, OVERLAP=True)),
    "m256-pipe": dict(dtype="float16", mnk=[256, 8192, 8192], bias=True, act="none",
                      cfg=dict(BM=256, RH=1, num_warps=8, STAGES=4, SPLIT_K=1, OVERLAP=True, PIPE=True)),
    "m64-bf16-pipe-split": dict(dtype="bfloat16", mnk=[64, 4096, 4160], bias=False, act="silu",
                                cfg=dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=True, PIPE=True)),
    # group 32 (two groups a K step) in each loop form, K an odd number of groups
    "g32-m1-fp16-split": dict(dtype="float16", mnk=[1, 5120, 5120], bias=False, act="none", group=32,
                              cfg=dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=8, OVERLAP=False)),
    "g32-m48-bf16-overlap": dict(dtype="bfloat16", mnk=[48, 4096, 4128], bias=True, act="silu", group=32,
                                 cfg=dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=2, OVERLAP=True)),
    "g32-m256-pipe": dict(dtype="float16", mnk=[300, 1000, 4128], bias=False, act="none", group=32,
                          cfg=dict(BM=256, RH=1, num_warps=8, STAGES=4, SPLIT_K=1, OVERLAP=True, PIPE=True)),
    "g32-m64-bf16-pipe-split": dict(dtype="bfloat16", mnk=[64, 4096, 4096], bias=False, act="none", group=32,
                                    cfg=dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=True, PIPE=True)),
}


def test_compiles_for_sm90_with_async_mma_and_copies(tmp_path):
    # wgmma reads the dequantized tile from registers (assert_trivial: no layout conversion); ptxas would
    # serialize the MMAs if the loop wrote registers an MMA in flight still reads.
    report = compile_report(tmp_path, "frag_wgmma", _VARIANTS)
    for name, r in report.items():
        assert r["wgmma"] >= 4, name
        assert r["cp_async"] >= 2, name  # 16-byte copies of x and of the packed words
        assert r["lop3"] >= 16, name  # the dequantization's nibble pairs
        assert not r["serialized"], name
        assert r["spills"] in ([], [0]), name
        assert r["shared"] <= SMEM, name
        assert r["group32"] == (_VARIANTS[name].get("group") == 32), name
        if _VARIANTS[name]["cfg"].get("PIPE"):
            # four call sites of four k16 wgmmas (the first step, two alternating, one left over); one group
            # left in flight by the waits between steps
            assert r["wgmma"] >= 16 and "1" in r["waits"], name


# --- on the GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,group", [(72, 256, 64), (1000, 4160, 64), (4096, 4096, 128), (257, 1024, 256),
                                       (8192, 1024, -1), (300, 200, -1), (72, 96, 32), (1000, 4128, 32),
                                       (257, 1056, 32), (5120, 5120, 32), (24, 32, 32)])
@pytest.mark.parametrize("M", [1, 9, 33, 64, 130, 300])
def test_frag_wgmma_matches_the_reference(dtype, N, K, group, M):
    check_fragment_kernel("frag_wgmma", dtype, N, K, group, M)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(31, 96), (257, 1056), (1001, 4128), (5119, 1376)])  # odd numbers of 32-groups
@pytest.mark.parametrize("M", [1, 3, 7, 31, 65, 129, 299])
def test_frag_wgmma_group32_odd_shapes(dtype, N, K, M):
    # NaN-poisoned outputs (conftest): an element left unwritten fails
    check_fragment_kernel("frag_wgmma", dtype, N, K, 32, M)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("M", [1, 3, 17, 75, 129, 299])
def test_frag_wgmma_dequantizes_bit_for_bit(dtype, group, M):
    # x's rows one-hot: each output is one weight times 1, so the kernel's dequantized weights come out as they
    # are; they must equal dequantize's bits (exact (q - z) * s rounded once). K = 352: 11 groups of 32, the
    # last K step half padding; N = 200 a partial row tile.
    N, K = 200, 352 if group in (32, -1) else 384
    w = w4a16.quantize(torch.randn(N, K, dtype=dtype, device="cuda"), group, symmetric=M % 2 == 0)
    cols = torch.arange(M, device="cuda") * 7 % K
    x = torch.zeros(M, K, dtype=dtype, device="cuda")
    x[torch.arange(M, device="cuda"), cols] = 1
    out = w4a16.matmul(x, w, kernel="frag_wgmma")
    assert torch.equal(out, w4a16.dequantize(w).T[cols])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1, OVERLAP=False),
                                 dict(BM=16, RH=2, num_warps=4, STAGES=3, SPLIT_K=7, OVERLAP=True),
                                 dict(BM=32, RH=1, num_warps=8, STAGES=6, SPLIT_K=3, OVERLAP=False),
                                 dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=5, OVERLAP=True),
                                 dict(BM=128, RH=1, num_warps=8, STAGES=3, SPLIT_K=2, OVERLAP=True),
                                 dict(BM=256, RH=1, num_warps=8, STAGES=2, SPLIT_K=1, OVERLAP=False),
                                 dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=True, PIPE=True),
                                 dict(BM=128, RH=1, num_warps=8, STAGES=3, SPLIT_K=2, OVERLAP=True, PIPE=True),
                                 dict(BM=256, RH=1, num_warps=8, STAGES=5, SPLIT_K=1, OVERLAP=True, PIPE=True)])
def test_frag_wgmma_configs_and_uneven_splits(cfg):
    from tilegemm.ops.w4a16 import frag_wgmma

    check_launch_twice(frag_wgmma, cfg, 150)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128, 192, 320])  # PIPE over 1, 2, 3, 5 steps: the first only, the leftover
@pytest.mark.parametrize("stages", [3, 5])           # site alone, one pair, two pairs
@pytest.mark.parametrize("bm, warps, rh", [(64, 4, 2), (256, 8, 1)])
def test_frag_wgmma_pipe_over_few_steps(K, stages, bm, warps, rh):
    from tilegemm.ops.w4a16 import frag_wgmma

    cfg = dict(BM=bm, RH=rh, num_warps=warps, STAGES=stages, SPLIT_K=1, OVERLAP=True, PIPE=True)
    check_launch_twice(frag_wgmma, cfg, 150, K=K, group=64)
    check_launch_twice(frag_wgmma, cfg, 151, K=K - 32, group=32)  # and group 32, the last step half padding


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128, 192, 320, 2048])  # PAIRS over 1, 2, 3, 5, 32 steps: a lone step, pairs,
@pytest.mark.parametrize("stages", [4, 6, 8])               # pairs and a lone last step
@pytest.mark.parametrize("bm, split, rh", [(8, 1, 1), (16, 3, 1), (32, 2, 1), (32, 1, 2)])  # 32: the rule's
def test_frag_wgmma_pairs_over_few_steps(K, stages, bm, split, rh):
    from tilegemm.ops.w4a16 import frag_wgmma

    cfg = dict(BM=bm, RH=rh, num_warps=4, STAGES=stages, SPLIT_K=split, OVERLAP=False, PAIRS=True)
    check_launch_twice(frag_wgmma, cfg, bm - 1, K=K, group=64)
    check_launch_twice(frag_wgmma, cfg, 3, K=K - 32, group=32)  # and group 32, the last step half padding


def test_frag_wgmma_pairs_refuses_the_overlapped_loops_and_short_rings():
    from tilegemm.ops.w4a16 import frag_wgmma

    x, out = torch.randn(4, 256, dtype=torch.float16), torch.empty(4, 64, dtype=torch.float16)
    fw, fzs = torch.zeros(4, 4, 32, 4, dtype=torch.int32), torch.zeros(4, 4, 8, 4, dtype=torch.float16)
    for cfg in (dict(BM=8, RH=1, num_warps=4, STAGES=6, SPLIT_K=1, OVERLAP=True, PAIRS=True),
                dict(BM=8, RH=1, num_warps=4, STAGES=3, SPLIT_K=1, OVERLAP=False, PAIRS=True)):
        with pytest.raises(ValueError, match="PAIRS"):
            frag_wgmma.launch_args(x, fw, fzs, None, out, 64, 256, 64, "none", cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=5, OVERLAP=False),
                                 dict(BM=8, RH=1, num_warps=4, STAGES=6, SPLIT_K=5, OVERLAP=False, PAIRS=True),
                                 dict(BM=16, RH=2, num_warps=4, STAGES=3, SPLIT_K=7, OVERLAP=True),
                                 dict(BM=64, RH=2, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=True, PIPE=True),
                                 dict(BM=256, RH=1, num_warps=8, STAGES=4, SPLIT_K=2, OVERLAP=True, PIPE=True)])
@pytest.mark.parametrize("M, K", [(3, 2048), (77, 2080), (257, 1312)])
def test_frag_wgmma_group32_configs_and_splits(cfg, M, K):
    from tilegemm.ops.w4a16 import frag_wgmma

    check_launch_twice(frag_wgmma, cfg, M, K=K, group=32)  # K = 2080, 1312: odd numbers of groups


@pytest.mark.gpu
def test_frag_wgmma_takes_strided_x():
    w = w4a16.quantize(torch.randn(384, 1024, dtype=torch.float16, device="cuda"), 128)
    wide = torch.randn(70, 1030, dtype=torch.float16, device="cuda")
    x = wide[:, 3:1027]  # rows 2060 bytes apart, not 16-byte aligned: copied
    assert_rel_close(w4a16.matmul(x, w, kernel="frag_wgmma"), reference(x, w), 2e-3)
    y = torch.randn(2, 40, 1024, dtype=torch.float16, device="cuda")[:, ::2]  # rows 4096 bytes apart
    assert_rel_close(w4a16.matmul(y, w, kernel="frag_wgmma").reshape(-1, 384), reference(y.reshape(-1, 1024), w),
                     2e-3)
    z = torch.randn(70 * 1024 + 1, dtype=torch.float16, device="cuda")[1:].view(70, 1024)  # starts 2 bytes off
    assert_rel_close(w4a16.matmul(z, w, kernel="frag_wgmma"), reference(z, w), 2e-3)
    assert_rel_close(w4a16.matmul(z, w), reference(z, w), 2e-3)  # and auto (frag_wgmma here), twice: the launch
    assert_rel_close(w4a16.matmul(z, w), reference(z, w), 2e-3)  # on the copy is not recorded, so never replayed


@pytest.mark.gpu
def test_auto_uses_frag_wgmma_and_replays_it():
    from tilegemm.ops.w4a16 import op as replay

    replay.REPLAYS.clear()
    replay.DEQUANTS.clear()
    lin = Int4Linear.from_linear(torch.nn.Linear(4096, 1024).half().cuda(), group_size=128)
    for M in (1, 9, 100, 700):
        for _ in range(3):
            x = torch.randn(M, 4096, dtype=torch.float16, device="cuda")
            assert_rel_close(lin(x), reference(x, lin.weight, lin.bias), 2e-3)
    # 700 rows on this 1024-row weight run dequant_cublas (auto's rule), kept apart with its dequantization
    assert replay.REPLAYS.count() == 3 and replay.DEQUANTS.count() == 1
    assert registry.get("w4a16", "frag_wgmma").unavailable_reason() is None


@pytest.mark.parametrize("M, pairs", [(1, False), (16, False), (17, True), (32, True), (33, False), (64, False)])
def test_config_rule_pairs_the_steps_at_17_to_32_rows(monkeypatch, M, pairs):
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cfg = configs.frag_wgmma_config(M, 8192, 8192, "cuda")
    assert cfg.get("PAIRS", False) == pairs and cfg["STAGES"] == (6 if pairs else 4)
    assert not (pairs and (cfg["OVERLAP"] or cfg["PIPE"]))  # the plain loop only (launch_args refuses others)
