"""GPTQ act-order weights (``perm``: inputs stored sorted by group): the public calls reorder x first (the route and
its replays: tests/w4a16/test_w4a16_reorder.py); here the replay key, the op's plumbing and gradient with ``perm``
(under the interpreter, through kernels that take x reordered), and ``frag_wgmma``'s ``GATHER`` (x read through
perm, for the op called with perm and ``frag_wgmma`` named): its config, ``launch_args`` and an offline sm_90
compile of each loop form. The results on the GPU: tests/w4a16/test_w4a16_actorder_gpu.py."""

from __future__ import annotations

import pytest
import torch
from conftest import HERE, assert_rel_close
from w4a16_kit import act_order_weight as act_order, compile_report

from tilegemm import w4a16
from tilegemm.ops.w4a16 import api, checks, configs, dispatch, op
from tilegemm.ops.w4a16.reference import reference

SMEM = 227 * 1024  # shared memory a block may use on Hopper


class _Rows:
    """What dispatch reads of 2-D activations (rows, device): a CUDA tensor's stand-in on a machine without one."""

    def __init__(self, M: int, K: int):
        self.shape, self.device = (M, K), torch.device("cuda")


# --- routing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 128, -1])
def test_auto_picks_the_natural_orders_kernel_on_hopper(monkeypatch, group):
    # act-order changes no kernel choice: the fragment kernel wherever the natural order takes it, x reordered
    monkeypatch.setitem(dispatch._FRAG_REASON, torch.device("cuda"), "")  # an sm_90 GPU, pretended
    w = act_order(16, 256, group)
    natural = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape)
    for M in (1, 3, 17, 64, 65, 128, 256, 1024):
        assert dispatch.wants_frag("auto", _Rows(M, 256), w) == dispatch.wants_frag("auto", _Rows(M, 256), natural)
    assert not hasattr(dispatch, "GATHER_MAX_M") and not hasattr(api, "_ordered")


# --- the replay key and tensors (CPU) -------------------------------------------------------------------------


def test_replay_key_holds_perm():
    w = act_order(64, 256, 64)
    x = torch.randn(3, 256, dtype=torch.float16)
    keyed = checks.key_of(x, w, None, "none", "auto", w.perm)
    assert keyed != checks.key_of(x, w, None, "none", "auto")  # same x layout: act-order's entries kept apart
    assert keyed == checks.key_of(x.clone(), act_order(64, 256, 64, seed=1), None, "none", "auto",
                                  act_order(64, 256, 64, seed=1).perm)  # another perm, same layout: replayed
    as_int32 = checks.key_of(x, w, None, "none", "auto", w.perm.to(torch.int32))
    assert as_int32 != keyed  # Triton specializes on the index dtype
    strided = torch.stack([w.perm, w.perm], 1)[:, 0]
    assert checks.key_of(x, w, None, "none", "auto", strided) != keyed  # and on its stride
    bias = torch.randn(64, dtype=torch.float16)
    tensors = checks.call_tensors(x, w, bias)
    assert tensors[0] is x and tensors[-1] is bias and not any(t is w.perm for t in tensors)


# --- output and gradient: the public call, and the op called with perm ----------------------------------------


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("group, K", [(32, 96), (64, 256), (-1, 200)])  # 200: no multiple of 64, one group
def test_act_order_matches_the_reference(M, group, K):
    # x reordered by the gather from any strides, then the kernel. Outputs are NaN-poisoned (conftest).
    w = act_order(40, K, group, device=HERE)
    bias = torch.randn(40, dtype=torch.float16, device=HERE)
    wide = torch.randn(2 * M, K + 24, dtype=torch.float16, device=HERE)
    x = wide[::2, 5:K + 5]  # a sliced, strided view: rows 2 (K + 24) elements apart, starting 10 bytes in
    for kernel in ("auto", "mma"):
        out = w4a16.matmul(x, w, bias=bias, activation="silu", kernel=kernel)
        assert_rel_close(out, reference(x, w, bias, "silu"), 2e-3)
    # K strided, through gemv (a program a row: its first rows, at most three)
    xk = x[:3].T.contiguous().T
    assert_rel_close(w4a16.matmul(xk, w, kernel="gemv"), reference(xk, w), 2e-3)


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("through", ["api", "op"])
def test_gradient_of_x_through_perm(activation, through):
    # api: x reordered by index_select, which autograd sees; the op called with perm: its backward computes the
    # gradient by the stored inputs and puts it back in x's order through perm
    w = act_order(24, 128, 32, device=HERE)
    bias = torch.randn(24, dtype=torch.float16, device=HERE, requires_grad=True)
    x = torch.randn(3, 128, dtype=torch.float16, device=HERE, requires_grad=True)
    grad = torch.randn(3, 24, dtype=torch.float16, device=HERE)
    if through == "api":
        out = w4a16.matmul(x, w, bias=bias, activation=activation, kernel="mma")
    else:
        out = op._w4a16_op(x, w.qweight, w.scales, w.zeros, None, None, bias, w.group_k, activation, "mma", w.perm)
    out.backward(grad)
    xr, br = x.detach().float().requires_grad_(True), bias.detach().float().requires_grad_(True)
    reference(xr, w, br, activation, dtype=torch.float32).backward(grad.float())
    assert_rel_close(x.grad, xr.grad, 1e-2)
    assert_rel_close(bias.grad, br.grad, 1e-2)


def test_op_reorders_for_kernels_that_do_not_gather():
    # the registered op called with perm directly: every kernel but frag_wgmma named gets x reordered first
    w = act_order(32, 128, 64, device=HERE)
    x = torch.randn(4, 256, dtype=torch.float16, device=HERE)[:, ::2]  # inputs strided: the gather takes them
    for kernel in ("auto", "gemv", "mma", "dequant_cublas"):
        out = op._w4a16_op(x, w.qweight, w.scales, w.zeros, None, None, None, w.group_k, "none", kernel, w.perm)
        assert_rel_close(out, reference(x, w), 2e-3)


# --- launch_args and the offline sm_90 compile ----------------------------------------------------------------


def test_config_keeps_gathered_tiles_from_spilling(monkeypatch):
    # x's gathered tile in registers on top of PIPE's two MMA groups of fragments: two row tiles a warp spill
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    plain = configs.frag_wgmma_config(64, 18944, 3584, "cuda")
    gathered = configs.frag_wgmma_config(64, 18944, 3584, "cuda", gather=True)
    assert plain["RH"] == 2 and gathered["RH"] == 1 and gathered["PIPE"] and gathered["BM"] == 64
    wide = configs.frag_wgmma_config(256, 14336, 4096, "cuda")  # 256 rows of x a program: 8 warps spill gathering
    assert wide["BM"] == 256 and configs.frag_wgmma_config(256, 14336, 4096, "cuda", gather=True)["BM"] == 128
    for M in (1, 16, 48):  # elsewhere the same config
        assert configs.frag_wgmma_config(M, 18944, 3584, "cuda", gather=True) == \
            configs.frag_wgmma_config(M, 18944, 3584, "cuda")
    # at 17..32 rows the same tile and split, on the plain loop: PAIRS was timed without the gather
    plain, gathered = (configs.frag_wgmma_config(32, 18944, 3584, "cuda", gather=g) for g in (False, True))
    assert plain.pop("PAIRS") and plain.pop("STAGES") == 6 and "PAIRS" not in gathered and gathered.pop("STAGES") == 4
    assert plain == gathered


def _frag_args(M=4, K=256, N=200):
    x = torch.empty(M, K, dtype=torch.float16)
    fw = torch.empty(16, -(-K // 128) * 2, 32, 4, dtype=torch.int32)
    fzs = torch.empty(8, 16, 8, 4, dtype=torch.float16)
    out = torch.empty(M, N, dtype=torch.float16)
    return x, fw, fzs, out


def test_launch_args_gather_only_for_act_order():
    from tilegemm.ops.w4a16 import frag_wgmma

    x, fw, fzs, out = _frag_args()
    cfg = dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=1)
    _, _, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 128, "none", cfg)
    assert "GATHER" not in kwargs and "perm_ptr" not in kwargs and args[10] == 256 // 8
    perm = torch.randperm(256).to(torch.int32)
    _, _, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 128, "none", cfg, perm)
    assert kwargs["GATHER"] is True and kwargs["perm_ptr"] is perm and args[10] == 256  # row stride in elements
    # gathered x is read element by element: rows and start need no 16-byte alignment (no copy of x)
    odd = torch.empty(4 * 261 + 1, dtype=torch.float16)[1:].view(4, 261)[:, :256]
    _, _, args, _ = frag_wgmma.launch_args(odd, fw, fzs, None, out, 200, 256, 128, "none", cfg, perm.long())
    assert args[0] is odd and args[10] == 261
    for bad in (perm[:255], perm.to(torch.int16), perm.float(), torch.randperm(512).to(torch.int32)[::2]):
        with pytest.raises(ValueError, match="perm must be"):
            frag_wgmma.launch_args(x, fw, fzs, None, out, 200, 256, 128, "none", cfg, bad)
    with pytest.raises(ValueError, match="stride 1"):
        frag_wgmma.launch_args(torch.empty(256, 4, dtype=torch.float16).T, fw, fzs, None, out, 200, 256, 128,
                               "none", cfg, perm)


_VARIANTS = {  # each loop form with GATHER; K: steps of 64, group 32, and one group over a K no multiple of 64
    "act-m1-split": dict(dtype="float16", mnk=[1, 5120, 5120], bias=False, act="none", act_order="int64",
                         cfg=dict(BM=8, RH=1, num_warps=4, STAGES=4, SPLIT_K=8, OVERLAP=False)),
    "act-g32-m16-bf16": dict(dtype="bfloat16", mnk=[16, 4096, 4128], bias=True, act="silu", group=32,
                             act_order="int64", cfg=dict(BM=16, RH=1, num_warps=4, STAGES=4, SPLIT_K=4, OVERLAP=False)),
    "act-m64-pipe-split": dict(dtype="float16", mnk=[64, 4096, 4096], bias=True, act="gelu", act_order="int64",
                               cfg=dict(BM=64, RH=1, num_warps=4, STAGES=4, SPLIT_K=3, OVERLAP=True, PIPE=True)),
    "act-m32-rh2-int32": dict(dtype="float16", mnk=[32, 18944, 3584], bias=False, act="none", act_order="int32",
                              cfg=dict(BM=32, RH=2, num_warps=4, STAGES=4, SPLIT_K=1, OVERLAP=False)),
    "act-m48-overlap-oddk": dict(dtype="float16", mnk=[48, 1000, 200], bias=False, act="none", group=256,
                                 act_order="int64", cfg=dict(BM=64, RH=1, num_warps=4, STAGES=3, SPLIT_K=1,
                                                          OVERLAP=True)),
}


def test_gather_compiles_for_sm90(tmp_path):
    # x's tile through registers (2-byte loads) into the swizzled slot; the weights' 16-byte cp.async ring, the
    # wgmma from registers (not serialized) and the dequantization as before; no spills
    report = compile_report(tmp_path, "frag_wgmma", _VARIANTS)
    for name, r in report.items():
        assert r["gather"], name
        assert r["scalar_loads"] >= 8, name  # x's gathered elements
        assert r["cp_async"] >= 2, name  # the packed words (x's tile is stored from registers)
        assert r["wgmma"] >= 4 and r["lop3"] >= 16, name
        assert not r["serialized"], name
        assert r["spills"] in ([], [0]), name
        assert r["shared"] <= SMEM, name
        if _VARIANTS[name]["cfg"].get("PIPE"):
            assert r["wgmma"] >= 16 and "1" in r["waits"], name


def test_opcheck_with_perm():
    w = act_order(32, 128, 64, device=HERE)
    x = torch.randn(3, 128, dtype=torch.float16, device=HERE)
    bias = torch.randn(32, dtype=torch.float16, device=HERE)
    torch.library.opcheck(torch.ops.tilegemm.w4a16_matmul.default,
                          (x, w.qweight, w.scales, w.zeros, None, None, bias, w.group_k, "silu", "auto", w.perm),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_compile_fullgraph_with_perm():
    # the reorder (index_select) and the op traced, as any act-order call under a tracer
    w = act_order(32, 128, 64, device=HERE)
    x = torch.randn(2, 128, dtype=torch.float16, device=HERE)
    compiled = torch.compile(lambda x: w4a16.matmul(x, w, activation="silu") * 2, fullgraph=True,
                             backend="aot_eager")
    assert_rel_close(compiled(x), reference(x, w, activation="silu") * 2, 2e-3)


def test_a_strided_perm_is_taken_as_it_lies():
    # a valid act-order weight may hold perm as a strided view: the gather reads it with its stride
    w = act_order(16, 256, 64, device=HERE)
    strided = torch.stack([w.perm, w.perm], 1)[:, 0]
    assert strided.stride(0) == 2 and torch.equal(strided, w.perm)
    w2 = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 64, w.shape, strided)
    x = torch.randn(3, 256, dtype=torch.float16, device=HERE)
    assert torch.equal(w4a16.matmul(x, w2), w4a16.matmul(x, w))
