"""Kernel ``frag`` of ``grouped_w4a16`` on the CPU: the stacked (and gated) fragment layout, auto's rule, the config,
the launch's arguments, the refusals, and the kernel's program logic emulated over the launch's grid. The kernel is
Gluon (no interpreter): it compiles for sm_90 in ``test_grouped_frag_compiled.py`` and runs in
``test_grouped_frag_gpu.py``."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from tilegemm import w4a16
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import interpreting
from tilegemm.ops.grouped import dispatch, frag
from tilegemm.ops.grouped.problem import GroupedInt4Problem
from tilegemm.ops.w4a16.format import gate_up_tiles, pack_fragments, unpack_rows

from conftest import assert_rel_close, crossed

CUDA = torch.device("cuda")


def experts(E: int, N: int, K: int, group: int, dtype=torch.float16, symmetric: bool = False):
    return w4a16.quantize(torch.randn(E, N, K, dtype=dtype), group, symmetric=symmetric)


@pytest.mark.parametrize("group, K", [(32, 96), (64, 192), (128, 384), (256, 256), (-1, 200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stacked_fragments_are_each_experts_own(group, K, dtype):
    w = experts(3, 37, K, group, dtype)
    fw, fzs = w.fragments()
    assert fw.shape[0] == fzs.shape[0] == 3 and fw.dtype == torch.int32 and fzs.dtype == dtype
    assert fw.is_contiguous() and fzs.is_contiguous()
    for e in range(3):
        one_w, one_zs = w.expert(e).fragments()
        assert torch.equal(fw[e], one_w) and torch.equal(fzs[e], one_zs)
    assert w.fragments()[0] is fw  # made once, kept
    assert w.nbytes == sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros, fw, fzs))


def test_gate_up_tiles_alternate_16_row_tiles_of_each_half():
    half = 20  # padded to 32 rows a half: two tiles each
    rows = torch.arange(2 * half)[None, :]  # [1, 2 * half]: each row's own number
    out = gate_up_tiles(rows, half)
    assert out.shape == (1, 64)
    want = torch.zeros(64, dtype=rows.dtype)
    for j in range(2):  # tile 2j: gate rows 16j..; tile 2j + 1: the up rows of the same numbers
        for i in range(16):
            r = 16 * j + i
            if r < half:
                want[32 * j + i] = r
                want[32 * j + 16 + i] = half + r
    assert torch.equal(out[0], want)


@pytest.mark.parametrize("group, K, N", [(32, 64, 40), (128, 256, 64), (-1, 72, 18)])
def test_gated_fragments_hold_the_gated_row_order(group, K, N):
    w = experts(2, N, K, group)
    fw, fzs = w.fragments(gated=True)
    assert w.fragments(gated=True)[0] is fw and w._frag is None  # kept apart from the plain layout
    for e in range(2):
        q = unpack_rows(w.qweight[e])
        want = pack_fragments(gate_up_tiles(q, N // 2), gate_up_tiles(w.scales[e], N // 2),
                              gate_up_tiles(w.zeros[e], N // 2), w.group_k)
        assert torch.equal(fw[e], want[0]) and torch.equal(fzs[e], want[1])
    with pytest.raises(ValueError, match="even"):
        experts(2, 7, 64, 32).fragments(gated=True)


# --- auto --------------------------------------------------------------------------------------------------------


class _X:
    """What dispatch reads of x (rows, device): a CUDA tensor's stand-in on a machine without one."""

    def __init__(self, M: int, K: int, device=CUDA, dtype=torch.float16):
        self.shape, self.device, self.dtype = (M, K), device, dtype


def problem(M, E, N, K, group_k, fragments: bool, gated=False, device="cpu"):
    """A GroupedInt4Problem of stand-in tensors (dispatch reads shapes and the device only)."""
    x = mock.Mock(shape=(M, K), device=torch.device(device), dtype=torch.float16, element_size=lambda: 2)
    fw = torch.empty(0) if fragments else None
    return GroupedInt4Problem(x, None, None, None, None, None, None, E, M, N, K, group_k, "none", gated, fw, fw)


def test_auto_takes_frag_at_decode_sizes_on_hopper(monkeypatch):
    monkeypatch.setitem(dispatch._FRAG_REASON, CUDA, "")  # the registry's answer on an sm_90 GPU, pretended
    limit = dispatch.INT4_FRAG_MAX_ROWS_PER_GROUP
    for E, M in ((8, 2), (8, 128), (128, 8), (128, 512), (64, 384), (8, limit * 8)):
        assert dispatch.choose_int4(problem(M, E, 4096, 4096, 128, True, device="cuda")) == "frag", (E, M)
    assert dispatch.choose_int4(problem(limit * 8 + 1, 8, 4096, 4096, 128, True, device="cuda")) == "dequant_dot"
    # prefill sizes keep dequant_grouped; no fragments given (a call that did not make them): dequant_dot
    with mock.patch.object(dispatch, "dequant_chunk", lambda p: p.N):
        assert dispatch.choose_int4(problem(128 * 8, 8, 4096, 4096, 128, True, device="cuda")) == "dequant_grouped"
    assert dispatch.choose_int4(problem(2, 8, 4096, 4096, 128, False, device="cuda")) == "dequant_dot"
    # every group length the fragments take, on Hopper only
    for group_k, K in ((32, 4096), (64, 4096), (256, 4096), (200, 200)):
        assert dispatch.frag_usable(group_k, K, CUDA)
    assert not dispatch.frag_usable(96, 4096, CUDA)  # not a multiple of the K step
    assert not dispatch.frag_usable(128, 4096, torch.device("cpu"))


@pytest.mark.skipif(not interpreting(), reason="what the interpreter (no Gluon) makes auto do; Hopper: the GPU tests")
def test_auto_never_takes_frag_here():
    # under the interpreter (and on any GPU but Hopper) the registry says why not: auto keeps dequant_dot
    assert frag.why_not_gluon() is not None
    assert not dispatch.frag_usable(128, 4096, CUDA)
    assert dispatch.choose_int4(problem(2, 8, 4096, 4096, 128, True, device="cuda")) == "dequant_dot"
    w = experts(2, 16, 64, 32)
    assert not dispatch.wants_frag("auto", _X(2, 64), w, False) and not dispatch.wants_frag("frag", _X(2, 64), w, False)


def test_wants_frag_makes_the_layout_only_where_it_may_run(monkeypatch):
    monkeypatch.setitem(dispatch._FRAG_REASON, CUDA, "")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build of torch has none)
    w = experts(4, 16, 64, 32)
    w_cuda = mock.Mock(wraps=w, device=CUDA, dtype=w.dtype, shape=w.shape, group_k=w.group_k, _frag=None,
                       _frag_gated=None)
    limit = dispatch.INT4_FRAG_MAX_ROWS_PER_GROUP
    assert dispatch.wants_frag("auto", _X(2, 64), w_cuda, False)
    assert dispatch.wants_frag("auto", _X(2, 64), w_cuda, True)
    assert not dispatch.wants_frag("auto", _X(4 * limit + 1, 64), w_cuda, False)  # past the rule: not made
    assert dispatch.wants_frag("frag", _X(4 * limit + 1, 64), w_cuda, False)  # by name: any rows
    assert not dispatch.wants_frag("dequant_dot", _X(2, 64), w_cuda, False)
    assert not dispatch.wants_frag("auto", _X(2, 64), w, False)  # x on another device than the weight
    assert not dispatch.wants_frag("frag", _X(2, 64, dtype=torch.bfloat16), w_cuda, False)  # refused by the checks
    assert not dispatch.wants_frag("frag", _X(2, 32), w_cuda, False)
    odd = experts(2, 15, 64, 32)
    odd_cuda = mock.Mock(wraps=odd, device=CUDA, dtype=odd.dtype, shape=odd.shape, group_k=odd.group_k, _frag=None,
                         _frag_gated=None)
    assert not dispatch.wants_frag("auto", _X(2, 64), odd_cuda, True)  # gated needs two halves (the checks say so)
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        # inside a capture the layout cannot be made: auto keeps dequant_dot unless it was made before
        assert not dispatch.wants_frag("auto", _X(2, 64), w_cuda, False)
        w_cuda._frag = (torch.empty(0), torch.empty(0))
        assert dispatch.wants_frag("auto", _X(2, 64), w_cuda, False)
        assert not dispatch.wants_frag("auto", _X(2, 64), w_cuda, True)


# --- config and launch arguments ------------------------------------------------------------------------------------


def test_config_splits_k_to_fill_the_gpu_at_decode(monkeypatch):
    monkeypatch.setattr(frag, "sm_count", lambda device: 132)
    # Mixtral's down projection at one token: 2 rows, 64 row tiles of 64 weight rows, K = 14336 (224 steps)
    down = frag.frag_config(problem(2, 8, 4096, 14336, 128, True, device="cuda"), 4096)
    assert down == dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=8)
    # its gate/up at one token: 448 row tiles (both halves) over K = 4096: two slices make 1792 programs
    up = frag.frag_config(problem(2, 8, 14336, 4096, 128, True, gated=True, device="cuda"), 28672)
    assert up["BM"] == 8 and up["SPLIT_K"] == 1
    # 64 tokens to 2 of 8 experts: 16 rows an expert on average, tiles of 32 (the most); 224 K steps split in two,
    # no slice past INT4_FRAG_MAX_SLICE_STEPS
    mixtral64 = frag.frag_config(problem(128, 8, 4096, 14336, 128, True, device="cuda"), 4096)
    assert mixtral64["BM"] == 32 and mixtral64["SPLIT_K"] == 2
    # at 8 tokens (tiles of 8) the split stays what fills the GPU: one slice of 224 steps
    assert frag.frag_config(problem(16, 8, 4096, 14336, 128, True, device="cuda"), 4096)["SPLIT_K"] == 1
    # Qwen3-30B-A3B's down at 64 tokens (512 rows over 128 experts: 4 on average, tiles of 16; K = 768: 12 steps):
    # no split below 8 steps
    qwen = frag.frag_config(problem(512, 128, 2048, 768, 128, True, device="cuda"), 2048)
    assert qwen["BM"] == 16 and qwen["SPLIT_K"] == 1
    assert frag.frag_config(problem(8 * 64, 8, 4096, 4096, 128, True, device="cuda"), 4096)["BM"] == 32


def _launch(E=3, M=9, N=40, K=256, group=64, gated=False, bias=None, cfg=None, x=None, dtype=torch.float16):
    w = experts(E, 2 * N if gated else N, K, group, dtype)
    fw, fzs = w.fragments(gated)
    x = torch.randn(M, K, dtype=dtype) if x is None else x
    out = torch.empty(M, N, dtype=dtype)
    offs = torch.tensor([2, 2, M][:E], dtype=torch.int32)
    cfg = cfg or dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=2)
    made = []

    def workspace(dev, floats, counters, tag=None):
        made.append((floats, counters, tag))
        return torch.empty(floats), torch.empty(counters, dtype=torch.int32)

    with mock.patch.object(frag, "split_workspace", workspace):
        result = frag.launch_args(x, fw, fzs, bias, out, offs, N, K, w.group_k, "none", gated, cfg)
    return result, made


def test_launch_args_grid_and_workspace():
    (kernel, grid, args, kwargs, ws), made = _launch()
    # (row tiles of 64 weight rows, experts + the zeroed tail, K slices); the planes hold each slice's [M, N]
    assert grid == (1, 4, 2) and kwargs["SPLIT_K"] == 2 and not kwargs["GATED"] and not kwargs["GROUP32"]
    assert not kwargs["COMPACT"] and kwargs["EP"] == 128
    assert made == [(2 * 9 * 40, 9 * 1, "grouped")] and ws is not None
    names = kernel.arg_names
    assert args[names.index("N")] == 40 and args[names.index("plane")] == 9 * 40
    # gated: 2 x 24 rows (each half padded to 16s), 24 output columns; the planes even unsplit
    (kernel, grid, args, kwargs, ws), made = _launch(N=24, gated=True, cfg=dict(BM=16, RH=1, num_warps=4, STAGES=4,
                                                                                 SPLIT_K=1))
    assert grid == (1, 4, 1) and kwargs["GATED"] and ws is not None and made[0][0] == 9 * 64
    assert args[names.index("N")] == 64 and args[names.index("HALF")] == 32 and args[names.index("N_OUT")] == 24
    # unsplit, ungated: no workspace
    (_, grid, _, kwargs, ws), made = _launch(cfg=dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1))
    assert ws is None and not made and kwargs["SPLIT_K"] == 1
    # fewer rows than experts: slots for the non-empty experts (2 rows: 2 at most) and the tail
    (_, grid, args, kwargs, _), _ = _launch(M=2)
    assert grid == (1, 3, 2) and kwargs["COMPACT"] and args[names.index("SLOTS")] == 2
    # a bias per expert: its row stride; group 32: GROUP32
    (_, _, args, kwargs, _), _ = _launch(group=32, bias=torch.randn(3, 40, dtype=torch.float16))
    assert args[names.index("stride_be")] == 40 and kwargs["GROUP32"] and kwargs["HAS_BIAS"]


def test_launch_args_refusals():
    with pytest.raises(ValueError, match="16-byte aligned"):
        _launch(x=torch.randn(9, 260, dtype=torch.float16)[:, :256])  # rows 260 elements apart
    with pytest.raises(ValueError, match="16-byte aligned"):
        _launch(x=torch.randn(9 * 256 + 1, dtype=torch.float16)[1:].view(9, 256))  # starts 2 bytes off
    with pytest.raises(ValueError, match="STAGES"):
        _launch(cfg=dict(BM=64, RH=1, num_warps=4, STAGES=1, SPLIT_K=1))
    with pytest.raises(ValueError, match="BM = 128"):
        _launch(cfg=dict(BM=128, RH=1, num_warps=4, STAGES=4, SPLIT_K=1))
    with pytest.raises(ValueError, match="256-row"):
        _launch(cfg=dict(BM=8, RH=3, num_warps=4, STAGES=4, SPLIT_K=1))
    w = experts(2, 16, 64, 32)
    fw, fzs = w.fragments()
    x, out, offs = torch.randn(3, 64, dtype=torch.float16), torch.empty(3, 16, dtype=torch.float16), \
        torch.tensor([1, 3], dtype=torch.int32)
    cfg = dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1)
    with pytest.raises(ValueError, match="stacked fragments"):
        frag.launch_args(x, fw[0], fzs[0], None, out, offs, 16, 64, 32, "none", False, cfg)  # one expert's
    with pytest.raises(ValueError, match="stacked fragments"):
        frag.launch_args(x.bfloat16(), fw, fzs, None, out, offs, 16, 64, 32, "none", False, cfg)
    with pytest.raises(ValueError, match="group length"):
        frag.launch_args(x, fw, fzs, None, out, offs, 16, 64, 48, "none", False, cfg)


def test_kernel_by_name_refuses_here_with_the_reason(device):
    if frag.why_not_gluon() is None:
        pytest.skip("kernel frag runs on this GPU: test_grouped_frag_gpu.py runs it by name")
    w = experts(2, 16, 64, 32).to(device)
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
    with pytest.raises(NotApplicable, match="'frag'.*Gluon"):
        w4a16.grouped_matmul(x, w, offs, kernel="frag")
    assert w._frag is None  # nothing packed for a kernel that cannot run here
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, None,
                           torch.empty(3, 16, dtype=torch.float16, device=device), 2, 3, 16, 64, 32)
    assert "Gluon" in frag.why_not(p)


def test_the_launcher_names_the_machine_then_the_device_then_the_fragments():
    # why_not's order, on any machine (why_not_gluon stood in for; nothing is launched: x on the CPU is the
    # problem named)
    w = experts(2, 16, 64, 32)
    x, offs = torch.randn(3, 64, dtype=torch.float16), torch.tensor([1, 3], dtype=torch.int32)
    p = GroupedInt4Problem(x, w.qweight, w.scales, w.zeros, offs, None, torch.empty(3, 16, dtype=torch.float16), 2,
                           3, 16, 64, 32)
    with mock.patch.object(frag, "why_not_gluon", lambda: "no Gluon here"):
        assert frag.why_not(p) == "no Gluon here"
    with mock.patch.object(frag, "why_not_gluon", lambda: None):
        assert "on cpu" in frag.why_not(p)
        on_gpu = dataclasses.replace(p, x=mock.Mock(device=CUDA))
        assert "fragment layout" in frag.why_not(on_gpu)
        assert "not 96" in frag.why_not(dataclasses.replace(on_gpu, group_k=96, K=192))
        with pytest.raises(NotApplicable, match="'frag'.*fragment layout"):
            frag.run(on_gpu)


def test_moe_blocks_keep_their_int4_weight_while_the_buffers_stay():
    # the MoE integration builds the experts' Int4Weight from its buffers each forward: the same object (and so
    # the fragments it made) while the buffers are unchanged; a new one once they are written or replaced
    from tilegemm.nn import moe

    w = experts(2, 16, 64, 32)
    module = torch.nn.Module()
    for part in ("qweight", "scales", "zeros"):
        module.register_buffer(f"tilegemm_down_proj_{part}", getattr(w, part).clone())
    module.tilegemm_group_size = 32
    first = moe._int4(module, "down_proj")
    assert first.shape == w.shape and moe._int4(module, "down_proj") is first
    first.fragments()
    assert moe._int4(module, "down_proj")._frag is not None
    module.tilegemm_down_proj_scales.mul_(2)  # written in place (load_state_dict copies so)
    second = moe._int4(module, "down_proj")
    assert second is not first and second._frag is None
    module.tilegemm_down_proj_zeros = w.zeros.clone()  # replaced
    assert moe._int4(module, "down_proj") is not second
    assert moe._int4(module, "up_proj") is None


def test_the_op_takes_the_fragments_along(device):
    # the op's schema carries the fragments (optional tensors); off Hopper auto runs dequant_dot and ignores them
    # (on Hopper it runs frag on them: the same product up to rounding), and the gradient of x flows as before
    from tilegemm.ops.grouped.op import grouped_w4a16_op
    from tilegemm.ops.grouped.reference import tolerance

    w = experts(3, 16, 64, 32).to(device)
    fw, fzs = w.fragments()
    x = torch.randn(9, 64, dtype=torch.float16, device=device)
    offs = torch.tensor([2, 5, 9], dtype=torch.int32, device=device)
    args = (x, w.qweight, w.scales, w.zeros, offs, None, w.group_k, "none", False, "auto")
    torch.library.opcheck(grouped_w4a16_op, args + (fw, fzs))
    with_fragments, without = grouped_w4a16_op(*args, fw, fzs), grouped_w4a16_op(*args)
    if dispatch.frag_usable(w.group_k, 64, x.device) and dispatch.frag_rows(9, 3):
        assert_rel_close(with_fragments.float(), without.float(), tolerance(torch.float16))
    else:
        assert torch.equal(with_fragments, without)
    xg = x.clone().requires_grad_(True)
    grouped_w4a16_op(xg, *args[1:], fw, fzs).float().sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape


# --- the kernel's program logic, emulated on the CPU ------------------------------------------------------------------
# Gluon has no interpreter: this walks the launch's grid in Python with the kernel's own formulas (the expert and
# rows of a slot, compact or not; the row blocks; the K slices; the workspace columns of the gated row order; the
# last arrival's sum and epilogue; the tail) over the weight the fragments hold, so the layout and the launch's
# arguments are checked against the reference where the kernel's index arithmetic lives. (The dequantization and
# the MMA are frag_wgmma's, tested on the GPU.)


def _fragment_weights(fw, fzs, group_k: int, rows: int, K: int):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "w4a16" / "test_w4a16_fragments.py"
    spec = importlib.util.spec_from_file_location("_w4a16_fragments", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [module.dequantize_fragments(fw[e], fzs[e], group_k, rows, K).float() for e in range(fw.shape[0])]


def emulate(x, w, offs, bias, activation, gated, cfg):
    from tilegemm.core.activations import torch_activation

    E, N_w, K = w.shape
    n_out = N_w // 2 if gated else N_w
    fw, fzs = w.fragments(gated)
    out = torch.full((x.shape[0], n_out), float("nan"))
    with mock.patch.object(frag, "split_workspace", lambda dev, floats, counters, tag=None: (
            torch.full((floats,), float("nan")), torch.zeros(counters, dtype=torch.int32))):
        kernel, grid, args, kw, ws = frag.launch_args(x, fw, fzs, bias, out, offs, n_out, K, w.group_k, activation,
                                                      gated, cfg)
    a = dict(zip(kernel.arg_names, args))
    planes, counters = ws if ws is not None else (None, None)
    M, N, HALF, plane, SLOTS = a["M"], a["N"], a["HALF"], a["plane"], a["SLOTS"]
    BM, SPLIT = kw["BM"], kw["SPLIT_K"]
    BN = 16 * kw["RH"] * kw["num_warps"]
    BNO = BN // 2 if gated else BN
    W = _fragment_weights(fw, fzs, w.group_k, fw.shape[1] * 16, K)  # [packed rows, K] an expert
    ends = [min(max(int(v), 0), M) for v in offs]
    starts = [0] + ends[:-1]
    starts = [min(max(s, 0), e) for s, e in zip(starts, ends)]
    full = [e for e in range(E) if ends[e] > starts[e]]
    b = None if bias is None else (bias.float() if bias.dim() == 2 else bias.float().expand(E, -1))
    epilogues = []
    for pid_n in range(grid[0]):
        for slot in range(grid[1]):
            for split in range(grid[2]):
                if kw["COMPACT"]:
                    if slot == SLOTS:
                        e, start, end = E, max(ends), M
                    elif slot < len(full):
                        e = full[slot]
                        start, end = starts[e], ends[e]
                    else:
                        e, start, end = 0, 0, 0
                else:
                    e = slot
                    start, end = (starts[e], ends[e]) if e < E else (max(ends), M)
                k_first = split * a["steps_per_split"] * 64
                k_end = min(k_first + a["steps_per_split"] * 64, a["k_stop"], K)
                cols_o = torch.arange(pid_n * BNO, (pid_n + 1) * BNO)
                if e == E:
                    if split == 0:
                        for m0 in range(start, end, BM):
                            rows = torch.arange(m0, min(m0 + BM, end))
                            c = cols_o[cols_o < n_out]
                            out[rows[:, None], c[None, :]] = 0.0
                    continue
                nn = torch.arange(pid_n * BN, (pid_n + 1) * BN)
                for m0 in range(start, end, BM):
                    rows = torch.arange(m0, min(m0 + BM, end))
                    acc = W[e][nn][:, k_first:k_end] @ x[rows][:, k_first:k_end].float().T  # [BN, rows]
                    if SPLIT == 1 and not gated:
                        ok = nn < N
                        v = acc[ok] + (b[e][nn[ok]][:, None] if b is not None else 0)
                        out[rows[:, None], nn[ok][None, :]] = torch_activation(v, activation).T.to(out.dtype)
                        continue
                    if gated:
                        t = nn // 16
                        r = (t // 2) * 16 + nn % 16
                        col, row_ok = r + (t % 2) * HALF, r < HALF
                    else:
                        col, row_ok = nn, nn < N
                    for i, m in enumerate(rows.tolist()):
                        planes[split * plane + m * N + col[row_ok]] = acc[row_ok, i]
                    if SPLIT > 1:
                        tile = m0 * grid[0] + pid_n
                        counters[tile] += 1
                        if counters[tile] != SPLIT:
                            continue
                        counters[tile] = 0
                    epilogues.append((e, rows, cols_o[cols_o < n_out]))
    # every epilogue after every program's stores: the order on the GPU is any, and a workspace element two
    # programs write would show here
    for e, rows, c in epilogues:
        total = sum(planes[s * plane + rows[:, None] * N + c[None, :]] for s in range(SPLIT))
        if b is not None:
            total = total + b[e][c]
        total = torch_activation(total, activation)
        if gated:
            up = sum(planes[s * plane + rows[:, None] * N + HALF + c[None, :]] for s in range(SPLIT))
            if b is not None:
                up = up + b[e][n_out + c]
            total = total * up
        out[rows[:, None], c[None, :]] = total.to(out.dtype)
    assert counters is None or not counters.any(), "every tile's counter is back at zero"
    return out


# (the emulation walks each program in Python: under the interpreter half the cross, every pair of choices met)
@crossed("gated, split, sizes, tail, group, K",
         [pytest.param(False, id="plain"), pytest.param(True, id="gated")], [1, 3],
         [pytest.param([0, 1, 11, 0, 3, 1, 20, 0], 5, id="rows"),
          pytest.param([0, 2, 0, 0, 0, 0, 1, 0], 2, id="compact")],
         [pytest.param(32, 256, id="32-256"), pytest.param(-1, 200, id="-1-200")])
def test_the_programs_cover_the_product(gated, split, sizes, tail, group, K):
    from tilegemm.ops.grouped.reference import grouped_mm_reference

    E = len(sizes)
    N_w = 2 * 40 if gated else 72  # gated: halves of 40 rows (padded to 48); plain: 72 (no multiple of 64)
    w = experts(E, N_w, K, group)
    M = sum(sizes) + tail
    x = torch.randn(M, K, dtype=torch.float16)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    bias = torch.randn(E, N_w, dtype=torch.float16)
    act = "silu" if gated else "gelu"
    out = emulate(x, w, offs, bias, act, gated, dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=split))
    full = grouped_mm_reference(x, w4a16.dequantize(w).transpose(1, 2), offs, bias=bias, dtype=torch.float32)
    from tilegemm.core.activations import torch_activation
    ref = torch_activation(full[:, :N_w // 2], act) * full[:, N_w // 2:] if gated else torch_activation(full, act)
    assert not torch.isnan(out).any(), "an element no program writes"
    assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
