"""Kernel ``tma`` (the Hopper MoE forward) under Triton's interpreter, whose tensor descriptors are emulated (a load
past a descriptor's bounds reads zeros, as TMA does): the group search of its persistent loop, the rows past
``offs[-1]``, bias, the gate, both b layouts; what it refuses; and ``auto``'s choice on a Hopper-like setup (the
GPU's own run: test_grouped_tma_gpu.py; its compiled sm_90 code: test_grouped_compiled.py). Outputs start as NaN."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core import hardware
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import interpreting
from tilegemm.ops.grouped import configs, dispatch, tma
from tilegemm.ops.grouped.bench import group_sizes
from tilegemm.ops.grouped.problem import make_problem
from tilegemm.core.checks import relative_error
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

from conftest import assert_rel_close
from test_grouped_layouts import operands

# skewed: empty groups first, between and last; sizes not multiples of the interpreter's 16-row tiles
SKEWED = [0, 40, 0, 1, 35, 0, 7, 0]


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b_kn", "b_nk"])
@pytest.mark.parametrize("bias", [None, "per_group", "shared"])
def test_matches_the_reference(b_transposed, bias, device):
    a, b, offs = operands("2d3d", SKEWED, 48, 56, torch.float16, device, tail=5, b_transposed=b_transposed)
    c = {None: None, "per_group": torch.randn(8, 56, dtype=torch.float16, device=device),
         "shared": torch.randn(56, dtype=torch.float16, device=device)}[bias]
    out = tilegemm.grouped_mm(a, b, offs=offs, bias=c, kernel="tma")
    assert_rel_close(out, grouped_mm_reference(a, b, offs, bias=c), tolerance(torch.float16))
    assert torch.equal(out[-5:], torch.zeros_like(out[-5:]))  # rows past offs[-1]: zero, no bias


@pytest.mark.parametrize("sizes", [[0, 0, 0], [70], [1, 1, 0, 1]], ids=["all_empty", "one_group", "single_rows"])
def test_edge_groupings(sizes, device):
    a, b, offs = operands("2d3d", sizes, 32, 40, torch.float16, device, tail=3)
    out = tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))


def test_more_units_than_programs(device):
    # the interpreter's grid is one program: it walks every unit of every group, in order, and the tail's
    a, b, offs = operands("2d3d", [33, 0, 50, 17], 64, 72, torch.float16, device, tail=20)
    out = torch.full((a.shape[0], 72), float("nan"), dtype=torch.float16, device=device)
    tma.run(make_problem("2d3d", 4, a, b, offs, None, out),
            dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1))
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))


@pytest.mark.parametrize("gated", [False, True])
def test_flattened_loop_keeps_the_tail_zero(gated, device):
    # FLATTEN (a candidate config): the tail's tiles run the K loop too (the fused loop needs invariant bounds) and
    # must still store zeros; a gated product's activation of those sums must not leak either
    a, b, offs = operands("2d3d", [33, 0, 50, 17], 64, 2 * 24 if gated else 72, torch.float16, device, tail=20)
    N = 24 if gated else 72
    out = torch.full((a.shape[0], N), float("nan"), dtype=torch.float16, device=device)
    tma.run(make_problem("2d3d", 4, a, b, offs, None, out, "ieee", "silu" if gated else "none", gated),
            dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, FLATTEN=True, num_warps=4, num_stages=1))
    pre = grouped_mm_reference(a, b, offs).float()
    ref = torch.nn.functional.silu(pre[:, :N]) * pre[:, N:] if gated else pre
    assert_rel_close(out, ref.to(out.dtype), tolerance(torch.float16))
    assert torch.equal(out[-20:], torch.zeros_like(out[-20:]))


@pytest.mark.parametrize("b_transposed", [False, True], ids=["b_kn", "b_nk"])
def test_gated_with_bias(b_transposed, device):
    sizes, N = [2, 0, 21, 1], 24
    a, _, offs = operands("2d3d", sizes, 64, 1, torch.float16, device, tail=2)
    w = torch.randn(4, 2 * N, 64, dtype=torch.float16, device=device)
    b = w.transpose(1, 2) if b_transposed else w.transpose(1, 2).contiguous()  # gate columns [0, N), up [N, 2N)
    bias = torch.randn(4, 2 * N, dtype=torch.float16, device=device)
    out = torch.full((a.shape[0], N), float("nan"), dtype=torch.float16, device=device)
    tma.run(make_problem("2d3d", 4, a, b, offs, bias, out, "ieee", "silu", True))
    full = grouped_mm_reference(a, b, offs, bias=bias)
    assert_rel_close(out, torch.nn.functional.silu(full[:, :N]) * full[:, N:], 4e-3)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_fp32_output(device):
    a, b, offs = operands("2d3d", SKEWED, 32, 24, torch.float16, device, tail=1)
    out = tilegemm.grouped_mm(a, b, offs=offs, out_dtype=torch.float32, kernel="tma")
    assert out.dtype == torch.float32
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))


# --- what it refuses, clearly --------------------------------------------------------------------------------


def _refusal(a, b, offs, match):
    with pytest.raises(NotApplicable, match=match):
        tilegemm.grouped_mm(a, b, offs=offs, kernel="tma")


def test_refuses_other_layouts(device):
    a, b, _ = operands("3d3d", [4, 4], 32, 32, torch.float16, device)
    _refusal(a, b, None, "2-D x 3-D")


def test_refuses_fp32(device):
    a, b, offs = operands("2d3d", [4, 4], 32, 32, torch.float32, device)
    _refusal(a, b, offs, "fp16 and bf16")


def test_refuses_unaligned_strides(device):
    a, b, offs = operands("2d3d", [4, 4], 12, 32, torch.float16, device)  # rows of 24 bytes
    _refusal(a, b, offs, "a's base or row stride")
    a, b, offs = operands("2d3d", [4, 4], 32, 36, torch.float16, device)  # b's rows of 72 bytes
    _refusal(a, b, offs, "b's base or strides")


def test_refuses_column_major_a(device):
    a, b, offs = operands("2d3d", [4, 4], 32, 32, torch.float16, device)
    _refusal(a.T.contiguous().T, b, offs, "a is not row-major")


def test_refuses_broadcast_operands(device):
    a, b, offs = operands("2d3d", [4, 4], 32, 32, torch.float16, device)
    _refusal(a, b[:1].expand(2, 32, 32), offs, "broadcast")
    _refusal(a[:1].expand(8, 32), b, offs, "broadcast")


def test_refuses_without_hopper(monkeypatch):
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 0))
    a, b, offs = operands("2d3d", [4, 4], 32, 32, torch.float16, "cpu")
    p = make_problem("2d3d", 2, a, b, offs, None, torch.empty(8, 32, dtype=torch.float16))
    assert "Hopper" in tma.why_not(p)
    assert dispatch.choose(p) == "tiled"


# --- auto on a Hopper-like setup -----------------------------------------------------------------------------


@pytest.fixture
def hopper(monkeypatch):
    """What dispatch sees on an H200: not the interpreter, TMA available."""
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(tma, "why_not_tma", lambda: None)
    monkeypatch.setattr(dispatch, "takes_gluon", lambda p: False)  # (gluon's share of the rule: test_grouped_gluon)


def _problem(M, G, K=4096, N=1024, dtype=torch.bfloat16, b_nk=True, layout="2d3d"):
    a = torch.empty(M, K, dtype=dtype)
    b = torch.empty(G, N, K, dtype=dtype).transpose(1, 2) if b_nk else torch.empty(G, K, N, dtype=dtype)
    return make_problem(layout, G, a, b, torch.empty(G, dtype=torch.int32), None, torch.empty(M, N, dtype=dtype))


@pytest.mark.parametrize("I, b_nk, want", [(124, False, "tiled"), (124, True, "tma"), (128, False, "tma")])
def test_auto_leaves_a_gated_up_half_tma_cannot_start_to_tiled(hopper, I, b_nk, want):
    # the fused gate/up product over b [G, K, 2I] with I * 2 bytes not a multiple of 16 (the fuzz draw that faulted)
    M, G, K = 4096, 8, 256
    a = torch.empty(M, K, dtype=torch.bfloat16)
    b = torch.empty(G, 2 * I, K, dtype=torch.bfloat16).transpose(1, 2) if b_nk else \
        torch.empty(G, K, 2 * I, dtype=torch.bfloat16)
    p = make_problem("2d3d", G, a, b, torch.empty(G, dtype=torch.int32), None, torch.empty(M, I, dtype=torch.bfloat16),
                     "ieee", "silu", True)
    assert dispatch.choose(p) == want


def test_auto_leaves_no_groups_to_tiled(hopper):
    # no experts (b [0, K, N]): b's descriptor would have a dimension of size 0, which TMA does not take
    M, K, N = 4096, 256, 128
    p = make_problem("2d3d", 0, torch.empty(M, K, dtype=torch.bfloat16), torch.empty(0, K, N, dtype=torch.bfloat16),
                     torch.empty(0, dtype=torch.int32), None, torch.empty(M, N, dtype=torch.bfloat16))
    assert dispatch.tma_rows(p)  # rows enough: only the missing groups keep auto off tma
    assert dispatch.choose(p) == "tiled"


@pytest.mark.parametrize("M, G, want", [
    (16384 * 2, 8, "tma"),  # Mixtral, 16384 tokens: 4096 rows an expert
    (4096 * 8, 128, "tma"),  # Qwen3-30B-A3B, 4096 tokens: 256 rows an expert
    (512 * 8, 128, "tma"),  # 512 tokens: 32 rows an expert (tma's 64-row tiles)
    (512 * 6, 64, "tma"),  # DeepSeek-V2-Lite, 512 tokens: 48
    (64 * 8, 8, "tma"),  # 64 rows an expert
    (16 * 8, 8, "tiled"),  # Mixtral, 64 tokens: 16 rows an expert
    (16 * 8 + 1, 8, "tma"),  # just over 16
    (512 * 2, 8, "tma"),  # Mixtral, 512 tokens: 128
    (8, 128, "tiled"),  # a decode step (its K split is tiled's)
])
def test_auto_takes_tma_for_large_groups(hopper, M, G, want):
    assert dispatch.choose(_problem(M, G)) == want
    # the rule: tma exactly from more than TMA_MIN_ROWS rows an expert on average
    assert (M / G > dispatch.TMA_MIN_ROWS) == (want == "tma")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_auto_runs_tma_on_mixtral_512_routing(hopper, dtype, device):
    # Mixtral's gate/up at 512 tokens as the grouped bench routes it (8 experts, top 2, skewed: 55 to 368 rows
    # and one expert empty, 128 an expert on average), K and N cut to the interpreter's size: auto takes tma there
    # now, and its tiles (the interpreter's 16 rows) end inside groups and straddle the next group's rows
    sizes = group_sizes(512, 8, 2)
    assert 0 in sizes and sum(sizes) == 1024
    a, b, offs = operands("2d3d", sizes, 32, 32, dtype, device, tail=3, b_transposed=True)
    p = make_problem("2d3d", 8, a, b, offs, None, torch.empty(a.shape[0], 32, dtype=dtype))
    assert dispatch.choose(p) == "tma"
    out = tilegemm.grouped_mm(a, b, offs=offs)
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(dtype))
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


def test_programs_per_sm_walks_units_with_a_stride(device):
    # PROGRAMS_PER_SM (the candidate tool's knob): the interpreter runs that many programs, each walking every
    # third unit of the skewed groups and the tail
    sizes = [s // 8 for s in group_sizes(512, 8, 2)]
    a, b, offs = operands("2d3d", sizes, 64, 40, torch.float16, device, tail=5, b_transposed=True)
    out = torch.full((a.shape[0], 40), float("nan"), dtype=torch.float16, device=device)
    tma.run(make_problem("2d3d", 8, a, b, offs, None, out),
            dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, PROGRAMS_PER_SM=3, num_warps=4, num_stages=1))
    assert_rel_close(out, grouped_mm_reference(a, b, offs), tolerance(torch.float16))
    with pytest.raises(ValueError, match="PROGRAMS_PER_SM"):
        tma.run(make_problem("2d3d", 8, a, b, offs, None, out), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32,
                                                                      GROUP_M=2, PROGRAMS_PER_SM=0))


# --- the tail split (TAIL_SPLIT, a candidate: configs.TMA_TAIL_SPLIT) ----------------------------------------------


@pytest.mark.parametrize("live, k_steps, programs, split_max, want", [
    (69 * 16, 224, 132, 4, (1056, 48, 2, 112)),  # Mixtral's down projection at 4096 tokens, 128 x 256 tiles
    (20 * 16, 224, 132, 4, (264, 56, 2, 112)),  # at 512 tokens, 64-row tiles
    (260 * 16, 224, 132, 4, (4092, 68, 1, 224)),  # at 16384: the last wave over half full, nothing cut
    (10, 224, 132, 4, (0, 10, 4, 56)),  # fewer units than programs: all of them cut, at most split_max ways
    (40, 12, 132, 4, (0, 40, 1, 12)),  # slices would keep under TMA_TAIL_MIN_STEPS steps: none cut
    (264, 224, 132, 4, (264, 0, 4, 56)),  # whole waves: nothing left to cut (no item is sliced)
])
def test_tail_plan(live, k_steps, programs, split_max, want):
    assert configs.tail_plan(live, k_steps, programs, split_max, 8) == want


def _tail_units(sizes, N, bm=16, bn=16):
    return sum(-(-n // bm) for n in sizes) * -(-N // bn)


@pytest.mark.parametrize("sizes, K, N, programs, split_max, bias, b_transposed", [
    ([33, 0, 50, 17], 512, 40, 22, 4, None, True),  # 27 units: 22 whole, 5 cut 4 ways
    ([33, 0, 50, 17], 256, 40, 8, 4, "per_group", False),  # 24 whole, 3 cut in halves (8 programs)
    ([40, 23], 256, 40, 7, 3, "shared", True),  # one unit left, cut in two (the min-steps bound)
    ([3, 0, 5, 0], 512, 32, 13, 4, None, True),  # 4 units, fewer than the programs: every one cut 3 ways
])
def test_tail_split_matches_the_reference(sizes, K, N, programs, split_max, bias, b_transposed, device, monkeypatch):
    # the interpreter runs PROGRAMS_PER_SM programs one after another: each slice of a cut unit stores its partial,
    # the last to arrive adds them and runs the epilogue (bias, activation) on the sum; the counters end at zero
    monkeypatch.setattr(configs, "TMA_TAIL_MIN_STEPS", 8)
    plan = configs.tail_plan(_tail_units(sizes, N), K // 16, programs, split_max)
    assert plan[1] > 0 and plan[2] > 1, plan  # (the case cuts units)
    a, b, offs = operands("2d3d", sizes, K, N, torch.float16, device, tail=5, b_transposed=b_transposed)
    c = {None: None, "per_group": torch.randn(len(sizes), N, dtype=torch.float16, device=device),
         "shared": torch.randn(N, dtype=torch.float16, device=device)}[bias]
    out = torch.full((a.shape[0], N), float("nan"), dtype=torch.float16, device=device)
    p = make_problem("2d3d", len(sizes), a, b, offs, c, out, "ieee", "relu")
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, PROGRAMS_PER_SM=programs, TAIL_SPLIT=split_max,
               num_warps=4, num_stages=1)
    tma.run(p, cfg)
    want = torch.relu(grouped_mm_reference(a, b, offs, bias=c).float())
    want[-5:] = 0
    assert_rel_close(out, want.to(out.dtype), tolerance(torch.float16))
    assert torch.equal(out[-5:], torch.zeros_like(out[-5:]))  # rows past offs[-1]: zeros, never cut
    from tilegemm.core.workspace import split_workspace

    _, counters = split_workspace(out.device, 1, 1, tag="grouped_tma")
    assert not counters.any()  # every cut unit's last slice reset its counter: a replay starts at zero
    tma.run(p, cfg)  # (and a second launch on the same workspace is right too)
    assert_rel_close(out, want.to(out.dtype), tolerance(torch.float16))


def test_tail_split_refusals(device):
    a, b, offs = operands("2d3d", [33, 0, 50, 17], 64, 48, torch.float16, device, tail=2)
    out = torch.empty(a.shape[0], 24, dtype=torch.float16, device=device)
    base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    gated = make_problem("2d3d", 4, a, b, offs, None, out, "ieee", "silu", True)
    with pytest.raises(ValueError, match="TAIL_SPLIT"):
        tma.run(gated, dict(base, TAIL_SPLIT=2))  # the gate's second accumulator has no slot
    plain = make_problem("2d3d", 4, a, b, offs, None, torch.empty(a.shape[0], 48, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="TAIL_SPLIT"):
        tma.run(plain, dict(base, TAIL_SPLIT=2, FLATTEN=True))  # the fused loop needs one K range for every unit
    with pytest.raises(ValueError, match="TAIL_SPLIT"):
        tma.run(plain, dict(base, TAIL_SPLIT=0))


def test_tail_split_knob_reaches_the_config(monkeypatch):
    # off as shipped; the knob (the candidates tool's) adds it to the plain product's config only
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    assert configs.TMA_TAIL_SPLIT == 1 and "TAIL_SPLIT" not in configs.tma_config(_problem(8192, 8))
    monkeypatch.setattr(configs, "TMA_TAIL_SPLIT", 4)
    assert configs.tma_config(_problem(8192, 8))["TAIL_SPLIT"] == 4
    assert configs.tma_config(_problem(1024, 8))["TAIL_SPLIT"] == 4  # (64-row tiles too)
    gated = make_problem("2d3d", 8, torch.empty(8192, 4096, dtype=torch.bfloat16),
                         torch.empty(8, 4096, 2048, dtype=torch.bfloat16), torch.empty(8, dtype=torch.int32), None,
                         torch.empty(8192, 1024, dtype=torch.bfloat16), "ieee", "silu", True)
    assert "TAIL_SPLIT" not in configs.tma_config(gated)


def test_auto_keeps_tiled_where_tma_refuses(hopper):
    assert dispatch.choose(_problem(8192, 8, b_nk=False)) == "tma"  # both b layouts taken
    assert dispatch.choose(_problem(8192, 8, dtype=torch.float32)) == "tiled"
    assert dispatch.choose(_problem(8192, 8, K=4100)) == "tiled"  # rows of a not 16-byte aligned
    a, b = torch.empty(8, 8192, 4096, dtype=torch.bfloat16), torch.empty(8, 4096, 1024, dtype=torch.bfloat16)
    p = make_problem("3d3d", 8, a, b, None, None, torch.empty(8, 8192, 1024, dtype=torch.bfloat16))
    assert dispatch.choose(p) == "tiled"


@pytest.mark.skipif(not interpreting(), reason="the interpreter's choice")
def test_auto_stays_on_tiled_under_the_interpreter():
    assert dispatch.choose(_problem(16384, 8)) == "tiled"


def test_allocator_set_lazily_and_kept(monkeypatch):
    # importing tilegemm sets no allocator; the first launch sets one where none is; a user's is kept
    import triton
    from triton.runtime import _allocation

    from tilegemm.core import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    token = _allocation._allocator.set(_allocation.NullAllocator())
    try:
        launch.ensure_allocator()
        assert _allocation._allocator.get() is launch.scratch
        mine = lambda size, align, stream: None  # noqa: E731
        triton.set_allocator(mine)
        launch.ensure_allocator()
        assert _allocation._allocator.get() is mine
    finally:
        _allocation._allocator.reset(token)


def test_refuses_a_gated_up_half_not_16_byte_aligned(device):
    # b [G, K, 2N] with N's columns of 24 bytes: the up half's boxes would start 24 bytes into each row, which TMA
    # answered with an illegal instruction on the H200 (a GPU fuzz draw, I = 124); b [G, 2N, K] (rows of K) is fine
    a, b, offs = operands("2d3d", [4, 4], 32, 24, torch.float16, device)
    out = torch.empty(8, 12, dtype=torch.float16, device=device)
    with pytest.raises(NotApplicable, match=r"the up half of a gated b \[G, K, 2N\] starts N = 12 columns"):
        tma.run(make_problem("2d3d", 2, a, b, offs, None, out, "ieee", "silu", True))
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)  # [G, K, 2N] read with unit stride along K
    tma.run(make_problem("2d3d", 2, a, bt, offs, None, out, "ieee", "silu", True))
    gate, up = grouped_mm_reference(a, bt, offs).chunk(2, dim=-1)
    assert relative_error(out, torch.nn.functional.silu(gate) * up) <= tolerance(torch.float16)


def test_refuses_no_groups(device):
    # b [0, K, N]: a TMA descriptor's dimensions must be at least one (b's is made on the device, where a size of 0
    # is no Python error); every row lies past offs[-1], so the answer is zeros, which auto's tiled gives
    a = torch.randn(40, 32, dtype=torch.float16, device=device)
    b = torch.randn(0, 32, 24, dtype=torch.float16, device=device)
    offs = torch.zeros(0, dtype=torch.int32, device=device)
    assert "no groups" in tma.operands_reason(make_problem("2d3d", 0, a, b, offs, None, torch.empty(40, 24)))
    _refusal(a, b, offs, r"no groups \(a descriptor of b needs at least one\)")
    assert torch.equal(tilegemm.grouped_mm(a, b, offs=offs), torch.zeros(40, 24, dtype=torch.float16, device=device))
