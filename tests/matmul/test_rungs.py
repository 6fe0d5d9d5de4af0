"""The Hopper and skinny rungs: that their own paths run (not a fallback), and their bookkeeping."""

from __future__ import annotations

import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.ops.matmul import persistent_tma, split_k, split_reduce
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close, crossed


def _problem(a, b, out, **kw):
    args = dict(c=None, bias=None, alpha=1.0, beta=1.0, activation="none", precision="ieee", upcast=False)
    args.update(kw)
    return make_problems(a, b, out, args["c"], args["bias"], args["alpha"], args["beta"], args["activation"],
                         args["precision"], args["upcast"])[0]


def _epilogue_problem(layout, M, N, K, device):
    """(a, b, bias, c, out, problem): A and B in ``layout`` (T: a transposed view), a bias, C with beta 0.5 and
    GELU, the output NaN-poisoned: every part of the epilogue in play."""
    a = torch.randn(K, M, device=device).mT if layout[0] == "T" else torch.randn(M, K, device=device)
    b = torch.randn(N, K, device=device).mT if layout[1] == "T" else torch.randn(K, N, device=device)
    bias = torch.randn(N, device=device)
    c = torch.randn(M, N, device=device)
    out = torch.full((M, N), float("nan"), device=device)
    return a, b, bias, c, out, _problem(a, b, out, c=c, bias=bias, beta=0.5, activation="gelu")


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", [(64, 64, 64), (40, 72, 48), (104, 56, 72)], ids=lambda s: "x".join(map(str, s)))
def test_persistent_tma_path(layout, dtype, shape, device):
    M, N, K = shape
    a = torch.randn(K, M, dtype=dtype, device=device).mT if layout[0] == "T" else torch.randn(M, K, dtype=dtype, device=device)
    b = torch.randn(N, K, dtype=dtype, device=device).mT if layout[1] == "T" else torch.randn(K, N, dtype=dtype, device=device)
    bias = torch.randn(N, dtype=dtype, device=device)
    c = torch.randn(M, 1, dtype=dtype, device=device)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    assert persistent_tma.why_not(_problem(a, b, out)) is None, "this shape should take the TMA path"
    got = tilegemm.matmul(a, b, bias=bias, c=c, beta=0.5, activation="silu", kernel="persistent_tma", precision="ieee")
    assert_rel_close(got, matmul_reference(a, b, bias=bias, c=c, beta=0.5, activation="silu"), tolerance(dtype))


@pytest.mark.parametrize("group_m", [2, 3])
def test_persistent_tma_serpentine_order(group_m, device):
    """Every tile written once in serpentine bands (5 tile rows: the last band is shorter when GROUP_M is 2
    or 3), with more tiles than programs."""
    M, N, K = 5 * 32 - 7, 4 * 32, 48
    a = torch.randn(M, K, device=device)
    b = torch.randn(K, N, device=device)
    out = torch.full((M, N), float("nan"), device=device)
    p = _problem(a, b, out, beta=0.0)
    cfg = dict(persistent_tma.configs(4)[0], GROUP_M=group_m, SERPENTINE=True)  # 32x32 tiles in the interpreter
    assert persistent_tma.why_not(p) is None, "this shape should take the TMA path"
    persistent_tma.run(p, cfg)
    assert_rel_close(out, matmul_reference(a, b), 1e-5)


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("split,K,slices", [(2, 64, 2), (3, 112, 3), (4, 80, 3), (5, 80, 5)], ids=lambda v: str(v))
def test_persistent_tma_split_k(layout, split, K, slices, device, monkeypatch):
    """A K split of the persistent kernel: each slice's partial tile to its plane, the planes added by the
    reduction with the epilogue (bias, c, beta, activation applied once); slices of uneven length (7 steps of
    16 in slices of 3, 3 and 1), a split asked for with more slices than its slice length fills (5 steps in 4:
    3 slices of 2, 2 and 1, none left empty), and more work units than programs."""
    monkeypatch.setattr(persistent_tma, "sm_count", lambda device: 3)
    # rows 16-byte aligned in every layout: the TMA path, not a fallback (asserted below)
    a, b, bias, c, out, p = _epilogue_problem(layout, 72, 96, K, device)
    cfg = dict(persistent_tma.configs(4)[0], SPLIT_K=split, BLOCK_K=16)  # 16-wide K steps on the GPU too
    assert persistent_tma.why_not(p) is None and persistent_tma.split_of(p, cfg) == slices
    launches = []
    real = persistent_tma.launch
    monkeypatch.setattr(persistent_tma, "launch", lambda *a, **k: launches.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(split_reduce, "launch", lambda *a, **k: launches.append(a[0]) or real(*a, **k))
    persistent_tma.run(p, cfg)
    assert_rel_close(out, matmul_reference(a, b, bias=bias, c=c, beta=0.5, activation="gelu"), 1e-5)
    assert len(launches) == 2


@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_persistent_tma_split_k_fp8(fast_accum, device, monkeypatch):
    """fp8 (both operands K-major) in K slices: the partial sums stay unscaled in the planes, and the reduction
    applies the per-row and per-tensor scales with the epilogue once."""
    monkeypatch.setattr(persistent_tma, "sm_count", lambda device: 3)
    M, N, K = 70, 96, 7 * 32
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(M, K, device=device).to(e4m3)
    b = torch.randn(N, K, device=device).to(e4m3).T
    scale_a, scale_b = torch.rand(M, device=device) + 0.5, torch.tensor(0.25, device=device)
    bias = torch.randn(N, device=device).to(torch.bfloat16)
    out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
    (p,) = make_problems(a, b, out, None, bias, 1.0, 0.0, "relu", "ieee", False, (scale_a, 1, scale_b, 0), fast_accum)
    cfg = dict(persistent_tma.configs(1)[0], SPLIT_K=3, BLOCK_K=32)  # 32-deep K steps: fp8's smallest wgmma
    assert persistent_tma.why_not(p) is None and persistent_tma.split_of(p, cfg) == 3
    launches = []
    real = persistent_tma.launch
    monkeypatch.setattr(persistent_tma, "launch", lambda *a, **k: launches.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(split_reduce, "launch", lambda *a, **k: launches.append(a[0]) or real(*a, **k))
    persistent_tma.run(p, cfg)
    assert len(launches) == 2
    ref = matmul_reference(a.double() * scale_a.double()[:, None], b.double() * 0.25, bias=bias, activation="relu")
    assert_rel_close(out, ref, tolerance(e4m3, out_dtype=torch.bfloat16))


def test_persistent_tma_split_k_lowered_where_it_cannot_run(device):
    """A split with more slices than K steps launches one slice a step; planes past 32-bit offsets, unsplit."""
    a, b = torch.randn(64, 32, device=device), torch.randn(32, 64, device=device)
    out = torch.full((64, 64), float("nan"), device=device)
    p = _problem(a, b, out)
    cfg = dict(persistent_tma.configs(4)[0], SPLIT_K=3, BLOCK_K=16)  # K = 32: two 16-wide steps
    assert persistent_tma.split_of(p, cfg) == 2
    persistent_tma.run(p, cfg)
    assert_rel_close(out, matmul_reference(a, b), 1e-5)
    assert persistent_tma.split_of(p, dict(cfg, SPLIT_K=1)) == 1 and persistent_tma.split_of(p, cfg | {"BLOCK_K": 32}) == 1
    big = _problem(torch.randn(65536, 16, device="meta"), torch.randn(16, 32768, device="meta"),
                   torch.empty(65536, 32768, device="meta"))
    assert persistent_tma.split_of(big, dict(cfg, BLOCK_K=1)) == 1  # 3 x 2^31 floats of planes


def test_persistent_tma_tuned_split_is_the_wave_split_of_the_problem(device, monkeypatch):
    """A split config found by the tuner (a neighbour class's, say) launches with this problem's wave split,
    not the split it was tuned with; an explicit config keeps its own."""
    a, b = torch.randn(64, 256, device=device), torch.randn(256, 64, device=device)
    out = torch.full((64, 64), float("nan"), device=device)
    p = _problem(a, b, out)
    tuned = dict(persistent_tma.configs(4)[0], SPLIT_K=7, BLOCK_K=16)
    monkeypatch.setattr(persistent_tma.tuning, "lookup_or_tune", lambda *args, **kw: tuned)
    launched = []
    monkeypatch.setattr(persistent_tma, "launch_config", lambda p, cfg: launched.append(cfg))
    persistent_tma.run(p)
    assert launched[-1]["SPLIT_K"] == persistent_tma.wave_split(p, tuned) != 7
    persistent_tma.run(p, tuned)
    assert launched[-1]["SPLIT_K"] == 7


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda d: (torch.randn(37, 129, device=d), torch.randn(129, 70, device=d)), "16-byte aligned"),
        (lambda d: (torch.randn(8, 64, device=d), torch.randn(64, 64, device=d)), "smaller than 16"),
        (lambda d: (torch.randn(64, 128, device=d)[:, ::2], torch.randn(64, 64, device=d)), "no unit stride"),
        (lambda d: (torch.randn(2, 32, 32, device=d), torch.randn(32, 32, device=d)), "batched"),
    ],
)
def test_persistent_tma_falls_back_where_tma_cannot_go(make, reason, device):
    a, b = make(device)
    out = torch.empty(*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1], device=device)
    assert reason in persistent_tma.why_not(_problem(a, b, out))
    got = tilegemm.matmul(a, b, kernel="persistent_tma", precision="ieee")
    assert_rel_close(got, matmul_reference(a, b), 1e-5)


@crossed("split, slices", [1, 2, 3, 7], [pytest.param(False, id="atomic"), pytest.param(True, id="slices"),
                                        pytest.param("apart", id="apart")])
def test_split_k_any_split_and_clean_workspace(split, slices, device, monkeypatch):
    if slices == "apart":  # every split's planes added by the second launch
        monkeypatch.setattr("tilegemm.ops.matmul.split_reduce.APART_BYTES", 0)
        slices = True
    a = torch.randn(2, 20, 150, device=device)
    b = torch.randn(150, 45, device=device)
    bias = torch.randn(45, device=device)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, SPLIT_K=split, SLICES=slices, num_warps=4,
               num_stages=1)
    for _ in range(2):  # the second call relies on the first leaving the workspace (or counters) zeroed
        out = torch.full((2, 20, 45), float("nan"), device=device)
        p = make_problems(a, b, out, None, bias, 2.0, 1.0, "relu", "ieee", False)[0]
        split_k.run(p, cfg)
        assert_rel_close(out, matmul_reference(a, b, bias=bias, alpha=2.0, activation="relu"), 1e-5)
    for (_, _, planes), (ws, count) in split_k.workspaces().items():
        assert not count.any(), "split_k must leave its counters at zero"
        assert planes or not ws.any(), "the atomic reduction must leave its workspace at zero"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn], ids=["fp16", "fp32", "fp8"])
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (16, 4096, 14336), (100, 4096, 4096), (128, 28672, 8192),
                                   (700, 512, 9000)], ids=lambda s: "x".join(map(str, s)))
def test_split_k_candidates_are_sound(monkeypatch, dtype, shape):
    # The GPU's candidate list, built on the CPU: 132 SMs as on an H100/H200.
    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)
    M, N, K = shape
    a = torch.empty(M, K, dtype=dtype)
    b = torch.empty(K, N, dtype=dtype)
    out = torch.empty(M, N, dtype=torch.float16)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    cands = split_k.configs(p)
    assert cands, "at least one candidate"
    size = a.element_size()
    tiles_seen = set()
    for c in cands:
        tile = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"])
        tiles_seen.add(tile)
        assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * size * c["num_stages"] <= 200 * 1024
        assert c["BLOCK_K"] * size >= 64, "a K step of at least 64 bytes"
        if c["SPLIT_K"] > 1:
            tiles = -(-M // c["BLOCK_M"]) * -(-N // c["BLOCK_N"])
            assert tiles * c["SPLIT_K"] <= 4 * 132
            assert -(-K // c["BLOCK_K"]) >= 4 * c["SPLIT_K"], "every slice keeps 4 K steps"
    for tile in tiles_seen:  # unsplit is always a candidate: the tuner may find splitting does not pay
        assert any((c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]) == (*tile, 1) for c in cands)
    assert min(c["BLOCK_M"] for c in cands) <= max(16, min(M, 128)) or M > 128
    picked = split_k.pick_config(p)
    assert picked in cands
    if M <= 16 and K >= 4096:  # few tiles, long K: the untimed pick splits
        assert picked["SPLIT_K"] > 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn], ids=["fp16", "fp32", "fp8"])
@pytest.mark.parametrize("M", [1, 16, 32, 64, 128, 1024])
def test_split_k_candidates_fit_a_99_kb_block(monkeypatch, dtype, M):
    # sm_86/89 GPUs (RTX 4090, L40S) give a block 99 KB of shared memory: the 16x128x128 tile's 4-stage pipeline
    # (108 KB) raised OutOfResources there for every small-M product; the bucket's smaller tiles remain
    import tilegemm.core.hardware as hardware

    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 128)
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (99 * 1024, 8))
    a, b = torch.empty(M, 4096, dtype=dtype), torch.empty(4096, 4096, dtype=dtype)
    p = make_problems(a, b, torch.empty(M, 4096, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    cands = split_k.configs(p)
    assert cands
    for c in [*cands, split_k.pick_config(p)]:
        stages = max(c["num_stages"] - 1, 1)
        assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * a.element_size() * stages <= 99 * 1024, c
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (hardware.HOPPER_SMEM_PER_BLOCK, 9))
    if M <= 32:  # Hopper keeps the larger tile
        assert any(c["BLOCK_N"] == 128 and c["BLOCK_K"] * a.element_size() == 256 for c in split_k.configs(p))


def test_split_k_names_the_shared_memory_where_no_tile_fits(monkeypatch):
    import tilegemm.core.hardware as hardware

    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 40)
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (32 * 1024, 7))
    a, b = torch.empty(16, 4096, dtype=torch.float16), torch.empty(4096, 4096, dtype=torch.float16)
    p = make_problems(a, b, torch.empty(16, 4096, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    with pytest.raises(ValueError, match="none of its tiles for M = 16 fits the 32 KB of shared memory"):
        split_k.configs(p)


_SM89_SHARED = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tilegemm.ops.matmul.split_k import matmul_split_k_kernel as kernel

    def shared(M, N, K, dtype, bm, bn, bk, warps, stages, divisors):
        ints = dict(M=M, N=N, K=K, stride_am=K, stride_ak=1, stride_bk=N, stride_bn=1, stride_om=N, stride_on=1,
                    SPLIT_K=2)  # row-major A, B and out; the other strides 0 (no batch, c, bias or scales)
        flags = dict(HAS_C=False, HAS_BIAS=False, ACTIVATION="none", HAS_SCALE_A=False, HAS_SCALE_B=False,
                     INPUT_PRECISION="ieee", UPCAST=False, INDEX_64=False, MMA_OPERANDS="ab", FAST_ACCUM=False,
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SLICES=True, ATOMIC_READ=True, APART=False,
                     DIVISORS=tuple(divisors))
        sig, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name.endswith("_ptr"):
                sig[name] = "*fp32" if name.startswith(("scale", "ws")) else "*i32" if name == "count_ptr" else \\
                    "*" + dtype
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name.startswith("stride"):
                v = ints.get(name, 0)
                if v in (0, 1):
                    sig[name], constexprs[(i,)] = "constexpr", v
                else:
                    sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
            elif name in ints:
                sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
            elif name in ("alpha", "beta"):
                sig[name] = "fp32"
            else:
                sig[name], constexprs[(i,)] = "constexpr", flags[name]
        compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 89, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        return compiled.metadata.shared

    print(json.dumps([shared(*case) for case in json.loads(sys.argv[1])]))
    """
)


def test_split_k_small_m_configs_compile_within_99_kb_for_sm89(monkeypatch, tmp_path):
    # the rule's untimed choice and the bucket's candidates, compiled for sm_89 (no GPU needed: Triton's ptxas):
    # Triton's own count of the shared memory each needs, which its launch checks against the GPU's limit
    from conftest import compile_offline
    import tilegemm.core.hardware as hardware

    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 128)
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (99 * 1024, 8))
    cases = set()
    for M, dtype, name in [(16, torch.float16, "fp16"), (32, torch.float16, "fp16"), (16, torch.float32, "fp32")]:
        a, b = torch.empty(M, 4096, dtype=dtype), torch.empty(4096, 4096, dtype=dtype)
        p = make_problems(a, b, torch.empty(M, 4096, dtype=dtype), None, None, 1.0, 0.0, "none", "ieee", False)[0]
        for c in split_k.configs(p):
            cases.add((M, 4096, 4096, name, c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"],
                       tuple(p.divisors)))  # (the alignment the launch states: its loads pipelined through shared memory)
    got = compile_offline(tmp_path, _SM89_SHARED, sorted(cases))
    assert len(got) == len(cases) >= 3
    assert all(0 < s <= 99 * 1024 for s in got), dict(zip(sorted(cases), got))


@pytest.mark.parametrize("shape", [(64, 64, 100352), (256, 64, 100352), (8, 96, 50000), (100, 4096, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_untimed_split_k_fills_a_wave_for_small_outputs_with_long_k(monkeypatch, shape):
    """A 1x1 convolution's weight gradient (64x64 over 100352 pixels) ran in 8 slices on 132 SMs; an untimed
    config now splits K into about one wave, each slice at least 4 K steps, whatever its neighbour split."""
    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)
    M, N, K = shape
    p = make_problems(torch.empty(M, K, dtype=torch.float16), torch.empty(K, N, dtype=torch.float16),
                      torch.empty(M, N, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    for cfg in [split_k.pick_config(p), *split_k.configs(p)]:
        got = split_k.filled(p, cfg)
        tiles = -(-M // got["BLOCK_M"]) * -(-N // got["BLOCK_N"])
        steps = -(-K // got["BLOCK_K"])
        assert tiles * got["SPLIT_K"] <= 132 or got == cfg, "never past one wave unless the config was kept"
        assert steps >= 4 * got["SPLIT_K"] or got == cfg
        assert got["SPLIT_K"] >= cfg["SPLIT_K"]
        if tiles * cfg["SPLIT_K"] * 2 <= 132 and steps >= 8 * cfg["SPLIT_K"]:
            assert tiles * got["SPLIT_K"] * 2 > 132 or steps < 4 * (got["SPLIT_K"] + 1) or got["SPLIT_K"] == 256
    assert split_k.wave_split(1, 1568, 132) == 132 and split_k.wave_split(200, 1000, 132) == 1
    assert split_k.wave_split(1, 40, 132) == 10 and split_k.wave_split(1, 10**6, 1000) == 256


def test_auto_splits_k_where_the_cost_model_says_it_pays(monkeypatch):
    """M > 128: few output tiles with a long K go to split_k; many tiles, or a short K, do not."""
    from tilegemm.ops.matmul import dispatch

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "interpreting", lambda: False)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)
    monkeypatch.setattr("tilegemm.core.hardware.sm_count", lambda device: 132)

    def pays(M, N, K, ld=None):
        a = torch.empty(M, ld or K, dtype=torch.float16)[:, :K]
        p = make_problems(a, torch.empty(K, N, dtype=torch.float16), torch.empty(M, N, dtype=torch.float16), None,
                          None, 1.0, 0.0, "none", "ieee", False)[0]
        return dispatch._split_pays(p)

    assert pays(256, 64, 100352) and pays(184, 168, 14400) and pays(2048, 256, 8192)
    assert pays(256, 64, 100352, ld=100353)  # rows not 16-byte aligned: the loads crawl, parallelism helps
    assert not pays(4096, 4096, 8192)  # 1024 tiles of 128x128 fill the GPU many times over
    assert not pays(256, 64, 512)  # short K: nothing to split
    from tilegemm.core import tuning

    real = tuning.lookup
    monkeypatch.setattr(tuning, "lookup", lambda k: {"tuned": True} if k.startswith("autotuned|") else real(k))
    assert not pays(184, 168, 14400), "a class tuned since (even after a cached answer) keeps its measured config"


def test_cost_model_ranks_by_waves_and_tiles():
    from tilegemm.ops.matmul.cost import estimate_us

    def est(M, N, K, bm, bn, bk=64, split=1, stages=3, aligned=True):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SLICES=True, num_stages=stages)
        return estimate_us(M, N, K, 1, 2, 2, cfg, sms=132, peak_tflops=989.0, hbm_gbps=4800.0, aligned=aligned)

    assert est(4096, 4096, 4096, 128, 256) < est(4096, 4096, 4096, 64, 64)  # big tiles where they fill the GPU
    assert est(512, 512, 4096, 64, 64) < est(512, 512, 4096, 128, 256)  # 64 tiles against 8: fill the SMs
    assert est(128, 128, 65536, 128, 128, split=64) < est(128, 128, 65536, 128, 128)  # one tile: split K
    assert est(256, 256, 4096, 128, 128, aligned=False) > est(256, 256, 4096, 128, 128)
    m, n, k = 4096, 8192, 1024
    assert est(m, n, k, 128, 256) >= ((m * k + k * n) * 2 + m * n * 2) / 4.8e6  # never under the HBM floor


@settings(max_examples=200, deadline=None)
@given(M=st.integers(1, 16384), N=st.integers(1, 28672), K=st.integers(1, 28672),
       tile=st.sampled_from([(16, 32, 64), (64, 64, 64), (128, 128, 64), (128, 256, 64), (64, 128, 128)]),
       split=st.sampled_from([1, 2, 4, 8, 33]), elem=st.sampled_from([1, 2, 4]))
def test_misaligned_rows_cost_at_least_their_steps_at_the_per_program_rate(M, N, K, tile, split, elem):
    """A program of misaligned rows moves at most its element size's per-program rate: never faster than the
    same product aligned, and never under its K steps at that rate."""
    from tilegemm.ops.matmul import cost

    bm, bn, bk = tile
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SLICES=True, num_stages=3)

    def est(aligned):
        return cost.estimate_us(M, N, K, 1, elem, 2, cfg, sms=132, peak_tflops=989.0, hbm_gbps=4800.0,
                                aligned=aligned)

    aligned, misaligned = est(True), est(False)
    assert misaligned >= aligned > 0
    program_rate = cost.MISALIGNED_PROGRAM_GBPS[elem]
    assert program_rate < cost.SM_GBPS  # the cap binds below what an aligned program pulls
    # with K steps to walk, a program's waits on its loads show: at least its steps at the capped rate
    steps = -(-(-(-K // bk)) // split)
    assert misaligned >= steps * (bm + bn) * bk * elem / (program_rate * 1e3)


def test_misaligned_rate_is_per_program_so_programs_sharing_an_sm_overlap_their_waits():
    """Twice the programs (two an SM instead of one) take about twice as long aligned, where the SM's bandwidth
    is shared, but about as long misaligned, where each program waits on its own loads."""
    from tilegemm.ops.matmul import cost

    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=3)  # 64 KB of ring: three programs an SM

    def est(M, aligned):
        return cost.estimate_us(M, 128, 8192, 1, 2, 2, cfg, sms=132, peak_tflops=989.0, hbm_gbps=4800.0,
                                aligned=aligned)

    one, two = 128 * 132, 128 * 264  # one tile an SM, then two
    assert est(two, True) > 1.8 * est(one, True)
    assert est(two, False) < 1.1 * est(one, False)
    assert est(one, False) > 5 * est(one, True)  # 4 GB/s a program against the SM's 110 GB/s


@pytest.mark.parametrize("shape", [(1, 45, 300), (37, 5, 500), (20, 45, 150)], ids=lambda s: "x".join(map(str, s)))
def test_split_k_reduction_apart_with_batches_and_an_epilogue(shape, device, monkeypatch):
    """Planes added by the second launch: batched, with c, bias, alpha/beta and an activation, poisoned output."""
    monkeypatch.setattr("tilegemm.ops.matmul.split_reduce.APART_BYTES", 0)
    M, N, K = shape
    a = torch.randn(2, M, K, device=device)
    b = torch.randn(2, K, N, device=device)
    c = torch.randn(2, M, N, device=device)
    bias = torch.randn(N, device=device)
    out = torch.full((2, M, N), float("nan"), device=device)
    p = make_problems(a, b, out, c, bias, 0.5, 2.0, "gelu", "ieee", False)[0]
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, SPLIT_K=5, SLICES=True, num_warps=4, num_stages=1)
    assert split_k.reduce_apart(cfg)
    split_k.run(p, cfg)
    ref = matmul_reference(a, b, c=c, bias=bias, alpha=0.5, beta=2.0, activation="gelu")
    assert_rel_close(out, ref, 1e-5)


def test_split_k_reduces_apart_only_past_its_byte_bound():
    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, SLICES=True)
    assert not split_k.reduce_apart(cfg)  # 128 KB of planes a tile: the last program adds them
    assert split_k.reduce_apart(dict(cfg, SPLIT_K=3))
    assert not split_k.reduce_apart(dict(cfg, SPLIT_K=3, SLICES=False))  # atomics: one plane
    assert not split_k.reduce_apart(dict(cfg, SPLIT_K=1))
    assert split_reduce.reduce_block(4096, 4096, 1, 132) == (64, 64)
    assert split_reduce.reduce_block(184, 168, 1, 132) == (4, 32)  # 276 blocks
    assert split_reduce.reduce_block(64, 64, 1, 132) == (4, 32)  # the smallest: few blocks, planes loaded 32 at once
    assert split_reduce.reduce_planes(132, 4, 32) == 32 and split_reduce.reduce_planes(5, 4, 32) == 8
    assert split_reduce.reduce_planes(3, 4, 32) == 4  # up to four planes: the four-load loop, nothing masked
    assert split_reduce.reduce_planes(132, 16, 64) == 8  # at most 64 values a thread
    assert split_reduce.reduce_planes(132, 64, 64) == 4 == split_reduce.reduce_planes(9, 32, 64)  # four-load loop


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 20000), N=st.integers(1, 30000), batch=st.integers(1, 8), sms=st.sampled_from([78, 114, 132]),
       split=st.integers(2, 256))
def test_reduction_apart_block_and_planes_stay_in_budget(M, N, batch, sms, split):
    """Any product: the reduction's block is one of its six, two blocks an SM where any block gives that, and
    its chunk of planes a power of two (8-32) within 64 values a thread, or the four-load loop for large blocks
    and splits of up to four planes."""
    bm, bn = split_reduce.reduce_block(M, N, batch, sms)
    assert (bm, bn) in ((64, 64), (32, 64), (16, 64), (16, 32), (8, 32), (4, 32))
    assert (bm, bn) == (4, 32) or -(-M // bm) * -(-N // bn) * batch >= 2 * sms
    planes = split_reduce.reduce_planes(split, bm, bn)
    if bm * bn >= 32 * 64 or split <= 4:
        assert planes == 4
    else:
        cap = min(32, 64 * 128 // (bm * bn))  # 32 planes, 64 values a thread
        assert planes in (8, 16, 32) and planes <= cap
        assert planes >= min(split, cap) and (planes < 2 * split or planes == 8)  # one chunk where it fits


# chunks of 32 planes (32 + 1), of 8 (8 + 8 + 1: a full one between), of 8 cut short, and the four-load loop
@pytest.mark.parametrize("block,split", [((4, 32), 33), ((16, 64), 17), ((16, 64), 9), ((64, 64), 6), ((16, 64), 3)])
def test_split_k_reduction_apart_over_chunks_of_planes(block, split, device, monkeypatch):
    """The second launch's chunks of planes: several chunks, a last one cut short (its planes masked), and the
    four-load loop of large blocks; batched, poisoned output, and the same bits from a second call."""
    monkeypatch.setattr("tilegemm.ops.matmul.split_reduce.APART_BYTES", 0)
    monkeypatch.setattr(split_reduce, "reduce_block", lambda *args: block)
    assert split_reduce.reduce_planes(split, *block) == {33: 32, 17: 8, 9: 8}.get(split, 4)
    M, N, K = 13, 40, 16 * split  # two tiles a batch, every block of the reduction cut short
    a = torch.randn(2, M, K, device=device)
    b = torch.randn(2, K, N, device=device)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, SPLIT_K=split, SLICES=True, num_warps=4,
               num_stages=1)
    outs = []
    for _ in range(2):
        out = torch.full((2, M, N), float("nan"), device=device)
        split_k.run(make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0], cfg)
        outs.append(out)
    assert_rel_close(outs[0], matmul_reference(a, b), 1e-5)
    assert torch.equal(outs[0], outs[1])


def test_split_k_picks_more_splits_for_fewer_tiles(device):
    a = torch.randn(16, 8192, dtype=torch.float16, device=device)
    b = torch.randn(8192, 4096, dtype=torch.float16, device=device)
    p = _problem(a, b, torch.empty(16, 4096, dtype=torch.float16, device=device))
    cfg = split_k.pick_config(p)
    assert cfg["SPLIT_K"] >= 1 and cfg["BLOCK_M"] == (16 if device == "cuda" else cfg["BLOCK_M"])


def test_split_k_config_without_slices_uses_the_default_planes(device):
    """A stored config from before SLICES existed gets the same reduction as new candidates: planes."""
    a = torch.randn(20, 150, device=device)
    b = torch.randn(150, 45, device=device)
    out = torch.full((20, 45), float("nan"), device=device)
    p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False)[0]
    split_k.clear_workspaces()
    split_k.run(p, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, SPLIT_K=3, num_warps=4, num_stages=1))
    assert_rel_close(out, matmul_reference(a, b), 1e-5)
    assert [planes for (_, _, planes) in split_k.workspaces()] == [True]


def test_persistent_tma_falls_back_to_a_config_that_fits(device, monkeypatch):
    """An untimed choice that does not fit the SM's shared memory (OutOfResources at launch) gives way to the
    first candidate that does, which is kept for the shape class; a config asked for raises instead; and
    ``auto``'s survey pick that does not fit falls back to the rung's own choice."""
    from triton.runtime.errors import OutOfResources

    from tilegemm.core import tuning
    from tilegemm.ops.matmul import dispatch

    monkeypatch.setattr(tuning, "_guessed", {})
    M, N, K = 40, 72, 48
    a, b = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
    out = torch.full((M, N), float("nan"), device=device)
    p = _problem(a, b, out)
    assert persistent_tma.why_not(p) is None
    big = dict(persistent_tma.configs(4)[0], GROUP_M=4)  # stands for a config too large for the SM
    fits = persistent_tma.configs(4)[0]
    monkeypatch.setattr(persistent_tma, "candidates", lambda p: [big, fits])
    monkeypatch.setattr(tuning, "lookup_or_tune", lambda k, cands, launch, *a, **kw: cands()[0])
    launched = []
    real = persistent_tma.launch_config

    def launch_config(p, cfg):
        if cfg == big:
            raise OutOfResources(278552, 232448, "shared memory")
        launched.append(cfg)
        real(p, cfg)

    monkeypatch.setattr(persistent_tma, "launch_config", launch_config)
    persistent_tma.run(p)
    assert launched == [fits]
    assert_rel_close(out, matmul_reference(a, b), 1e-5)
    assert tuning._guessed[(persistent_tma.tuning_key(p), None)] == fits, "kept for the shape class"
    with pytest.raises(OutOfResources):
        persistent_tma.run(p, big)  # asked for: its error, not another config
    out.fill_(float("nan"))
    monkeypatch.setattr(dispatch, "surveyed", lambda p: ("persistent_tma", big))
    dispatch.launch_auto(p)
    assert launched == [fits, fits]
    assert_rel_close(out, matmul_reference(a, b), 1e-5)


def test_entry_point_launches_auto_a_rung_or_a_rung_config(device):
    """``tilegemm.ops.matmul.launch``, the entry point other families call: auto's choice, a named rung, a rung
    with a config of its own; each writes every element of the (NaN-poisoned) output."""
    from tilegemm.ops.matmul import launch, make_problems as entry_make_problems
    from tilegemm.ops.matmul.configs import fixed_config

    a, b = torch.randn(40, 24, device=device), torch.randn(24, 56, device=device)
    want = matmul_reference(a, b)
    for kernel, config in ((None, None), ("grouped", None), ("naive", fixed_config(a.dtype))):
        out = torch.full((40, 56), float("nan"), device=device)
        for p in entry_make_problems(a, b, out, precision="ieee"):
            launch(p, kernel, config)
        assert_rel_close(out, want, tolerance(torch.float32))
    with pytest.raises(ValueError, match="pass kernel= with it"):
        launch(entry_make_problems(a, b, torch.empty(40, 56, device=device))[0], None, {"BLOCK_M": 16})


def test_autotuned_untimed_choices_fit_a_99_kb_block(monkeypatch):
    # the untimed choice picks among the configs whose pipeline fits (Triton's timed autotuner skips the others)
    import tilegemm.core.hardware as hardware
    from tilegemm.ops.matmul import autotuned, configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (99 * 1024, 8))
    a, b = torch.empty(512, 4096, dtype=torch.float16), torch.empty(4096, 4096, dtype=torch.float16)
    p = make_problems(a, b, torch.empty(512, 4096, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    every = configs.prune_for(configs.autotune_configs(), 2)
    kept = autotuned._fitting(every, p)

    def fits(c):
        return (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 * (c["num_stages"] - 1) <= 99 * 1024

    assert kept and all(fits(c) for c in kept) and len(kept) < len(every)
    assert [c for c in every if fits(c)] == kept
