"""persistent_tma on batched 16-bit products: (batch, tile) work units, 3-D TMA descriptors for batched operands
and the output, 2-D ones for an operand broadcast over the batch; and ``auto`` taking such products there.

Under the interpreter the batched path runs on small shapes (fp16: a bf16 ``tl.dot`` is wrong there); offline it
is compiled for sm_90 and its code compared with the unbatched kernel's; on a GPU (``pytest -m gpu``) every layout
and dtype runs against an fp64 reference into NaN-poisoned outputs.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import tilegemm
from tilegemm.core import launch
from tilegemm.ops.matmul import dispatch, persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import SM90, compile_offline, rel_err


def _operand(batch, rows, cols, transposed, dtype, device, broadcast=False):
    """A [batch, rows, cols] operand (a transposed view where ``transposed``); ``broadcast``: one matrix
    expanded over the batch (batch stride 0)."""
    lead = () if broadcast else (batch,)
    t = torch.randn(*lead, cols, rows, device=device).to(dtype).mT if transposed else \
        torch.randn(*lead, rows, cols, device=device).to(dtype)
    return t.expand(batch, rows, cols) if broadcast else t


def _problem(a, b, out, c=None, bias=None, alpha=1.0, beta=0.0):
    return make_problems(a, b, out, c, bias, alpha, beta, "none", "ieee", False)[0]


def _check_batches(out, ref, tol):
    assert not torch.isnan(out).any(), "an output element was not written"
    for i in range(out.shape[0]):
        err = rel_err(out[i], ref[i])
        assert err <= tol, f"batch {i}: relative error {err:.2e} (bound {tol:.1e})"


@pytest.fixture
def no_fallback(monkeypatch):
    """A problem the batched path refused would run on autotuned and still be right: make that fail."""
    def refuse(p, *args, **kwargs):
        raise AssertionError(f"fell back to autotuned: {persistent_tma.why_not(p)}")

    # auto launches through dispatch's table of rung functions, made once a process: patch the entry, so
    # that the table never keeps the refusal past this test.
    monkeypatch.setitem(dispatch._kernels().launchers, "autotuned", refuse)


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
def test_batched_layouts(layout, device, no_fallback):
    B, M, N, K = 3, 40, 48, 24  # two tiles each way under the interpreter's 32x32 config, ragged edges
    a = _operand(B, M, K, layout[0] == "T", torch.float16, device)
    b = _operand(B, K, N, layout[1] == "T", torch.float16, device)
    p = _problem(a, b, torch.empty(B, M, N, dtype=torch.float16, device=device))
    assert p.batch == B and persistent_tma.why_not(p) is None
    out = tilegemm.matmul(a, b, kernel="persistent_tma")
    _check_batches(out, matmul_reference(a, b), tolerance(torch.float16))


@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_through_the_tma_path(batch, device, no_fallback):
    # bf16 tiles by descriptor, unbatched and batched: under the interpreter they are upcast before the dot (its
    # bf16 dot is wrong: the results were ~1e10 off), on a GPU they go to the tensor cores as they are
    M, N, K = 40, 48, 32
    a = _operand(batch, M, K, False, torch.bfloat16, device)
    b = _operand(batch, K, N, True, torch.bfloat16, device)
    p = _problem(a, b, torch.empty(batch, M, N, dtype=torch.bfloat16, device=device))
    assert persistent_tma.why_not(p) is None
    out = tilegemm.matmul(a[0] if batch == 1 else a, b[0] if batch == 1 else b, kernel="persistent_tma")
    _check_batches(out.reshape(batch, M, N), matmul_reference(a, b), tolerance(torch.bfloat16))


@pytest.mark.parametrize("which", ["a", "b"])
def test_batched_broadcast_operand(which, device, no_fallback):
    B, M, N, K = 3, 40, 48, 24
    a = _operand(B, M, K, False, torch.float16, device, broadcast=which == "a")
    b = _operand(B, K, N, True, torch.float16, device, broadcast=which == "b")
    p = _problem(a, b, torch.empty(B, M, N, dtype=torch.float16, device=device))
    assert (p.a_strides[0] == 0) == (which == "a") and (p.b_strides[0] == 0) == (which == "b")
    assert persistent_tma.why_not(p) is None
    out = tilegemm.matmul(a, b, kernel="persistent_tma")
    _check_batches(out, matmul_reference(a, b), tolerance(torch.float16))


def test_batched_views_that_do_not_merge(device, no_fallback):
    """Batch dims whose strides do not chain become pieces (as_strided views at each piece's start), each a
    batched problem of its own; a strided batch steps over the skipped matrices."""
    base = torch.randn(2, 5, 40, 24, device=device).half()
    a = base[:, 1:4]  # [2, 3, 40, 24]: the two batch dims do not merge
    b = torch.randn(2, 3, 24, 48, device=device).half()
    pieces = make_problems(a, b, torch.empty(2, 3, 40, 48, device=device, dtype=torch.float16))
    assert [p.batch for p in pieces] == [3, 3] and all(persistent_tma.why_not(p) is None for p in pieces)
    out = tilegemm.matmul(a, b, kernel="persistent_tma")
    _check_batches(out.flatten(0, 1), matmul_reference(a, b).flatten(0, 1), tolerance(torch.float16))
    strided = base.flatten(0, 1)[::2]  # every other matrix: batch stride 2 * 40 * 24
    b2 = torch.randn(5, 24, 48, device=device).half()
    assert _problem(strided, b2, torch.empty(5, 40, 48, dtype=torch.float16, device=device)).a_strides[0] == 1920
    out = tilegemm.matmul(strided, b2, kernel="persistent_tma")
    _check_batches(out, matmul_reference(strided, b2), tolerance(torch.float16))


def test_batched_epilogue_reads_each_batch_of_c(device, no_fallback):
    B, M, N, K = 3, 40, 48, 24
    a = _operand(B, M, K, False, torch.float16, device)
    b = _operand(B, K, N, False, torch.float16, device)
    c = torch.randn(B, M, N, device=device).half()
    bias = torch.randn(N, device=device).half()
    kw = dict(c=c, bias=bias, alpha=0.5, beta=2.0, activation="silu")
    out = tilegemm.matmul(a, b, kernel="persistent_tma", **kw)
    _check_batches(out, matmul_reference(a, b, **kw), tolerance(torch.float16))


def test_batched_descriptors():
    B, M, N, K = 4, 96, 40, 64
    a = torch.empty(B, K, M, dtype=torch.float16).mT  # each A^T: [K, M] rows
    b = torch.empty(K, N, dtype=torch.float16).expand(B, K, N)  # broadcast
    out = torch.empty(B, M, N, dtype=torch.float16)
    p = _problem(a, b, out)
    da, db, do = persistent_tma.host_descriptors(p, persistent_tma.make_config(128, 64, 32, 4, 3))
    assert (da.shape, da.strides, da.block_shape) == ([B, K, M], [K * M, M, 1], [1, 32, 128])
    assert (list(db.shape), list(db.strides), list(db.block_shape)) == ([K, N], [N, 1], [32, 64])
    assert (do.shape, do.strides, do.block_shape) == ([B, M, N], [M * N, N, 1], [1, 128, 32])
    _, grid, _, kwargs = persistent_tma.triton_launch_args(p, persistent_tma.make_config(128, 64, 32, 4, 3), 132)
    assert kwargs["BATCHED"] and kwargs["A_BATCHED"] and not kwargs["B_BATCHED"] and kwargs["batch"] == B
    assert grid == (B * 1 * 1,)  # one 128x64 tile per batch


def test_batched_launch_has_no_split_and_host_descriptors():
    """A K split's planes are per product, and the batched kernel takes host descriptors: a config that asks
    for either (a neighbouring class's) launches without."""
    a = torch.empty(2, 128, 8192, dtype=torch.float16)
    b = torch.empty(2, 8192, 128, dtype=torch.float16)
    p = _problem(a, b, torch.empty(2, 128, 128, dtype=torch.float16))
    assert persistent_tma.split_configs(p) == []
    cfg = persistent_tma.make_config(128, 128, 64, 4, 4, host_desc=False)
    assert persistent_tma.split_of(p, dict(cfg, SPLIT_K=8)) == 1
    _, _, args, kwargs = persistent_tma.triton_launch_args(p, cfg, 132)
    assert kwargs["HOST_DESC"] is True and kwargs["SPLIT"] is False
    assert all(hasattr(d, "block_shape") for d in args[:3])


@pytest.mark.parametrize("case, reason", [
    ("fp32", "fp16/bf16"), ("batch-stride", "batch stride"), ("ok", None),
])
def test_batched_refusals(case, reason):
    dtype = torch.float32 if case == "fp32" else torch.float16
    B, M, N, K = 3, 40, 48, 24
    if case == "batch-stride":
        # Each batch 4 elements (8 bytes) past a 16-byte multiple: TMA cannot step it.
        a = torch.empty(B * (M * K + 4), dtype=dtype).as_strided((B, M, K), (M * K + 4, K, 1))
    else:
        a = torch.empty(B, M, K, dtype=dtype)
    p = _problem(a, torch.empty(B, K, N, dtype=dtype), torch.empty(B, M, N, dtype=dtype))
    got = persistent_tma.why_not(p)
    assert got is None if reason is None else reason in got


def _fake_hopper(monkeypatch, sms=132):
    import tilegemm.core.hardware
    from tilegemm.ops.matmul import dispatch

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(tilegemm.core.hardware, "sm_count", lambda device: sms)
    return dispatch


def _meta_problem(B, M, N, K, dtype=torch.float16):
    a = torch.empty(B, M, K, device="meta", dtype=dtype)
    b = torch.empty(B, K, N, device="meta", dtype=dtype)
    return _problem(a, b, torch.empty(B, M, N, device="meta", dtype=dtype))


def test_auto_takes_big_batched_16_bit_products_to_persistent_tma(monkeypatch):
    """auto counts the tiles of every batch against MIN_TILES_PER_SM (132 SMs: 264 tiles of 128x128); with
    gluon_f16's batched launch off (where Gluon runs it takes these first: test_gluon_f16_batched.py)."""
    dispatch = _fake_hopper(monkeypatch)
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", False)
    assert dispatch.choose_kernel(_meta_problem(32, 4096, 4096, 128)) == "persistent_tma"  # attention-like
    assert dispatch.choose_kernel(_meta_problem(16, 2048, 2048, 128, torch.bfloat16)) == "persistent_tma"
    assert dispatch.choose_kernel(_meta_problem(8, 1024, 1024, 64)) == "persistent_tma"  # 8 x 64 = 512 tiles
    assert dispatch.choose_kernel(_meta_problem(2, 1024, 1024, 64)) == "autotuned"  # 128 tiles: too few
    assert dispatch.choose_kernel(_meta_problem(8, 1024, 1024, 64, torch.float32)) == "autotuned"  # not taken


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_batched_matmul_entry_follows_auto(dtype, device, monkeypatch):
    """tilegemm.ops.grouped.batched_matmul: 16-bit operands through tilegemm.matmul's auto, others on the
    grouped family's kernel; both torch.matmul's result."""
    import tilegemm.ops.grouped.api as grouped_api

    dense = []
    real = grouped_api.dense_matmul
    monkeypatch.setattr(grouped_api, "dense_matmul", lambda a, b: dense.append(a.shape) or real(a, b))
    a = torch.randn(3, 40, 24, device=device).to(dtype)
    b = torch.randn(3, 48, 24, device=device).to(dtype).mT
    out = tilegemm.ops.grouped.batched_matmul(a, b)
    _check_batches(out, matmul_reference(a, b), tolerance(dtype))
    assert len(dense) == (1 if dtype == torch.float16 else 0)
    with pytest.raises(ValueError, match="groups"):
        tilegemm.ops.grouped.batched_matmul(a, b[:2])


_COMPILE_BATCHED = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.ops.matmul import persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    def code(batch, layout, broadcast_b, cfg):
        n = 512
        def op(t, batched):
            shape = (batch, n, n) if batched else (n, n)
            x = torch.empty(shape, dtype=torch.float16)
            return x.mT if t else x
        a = op(layout[0] == "T", batch > 1)
        b = op(layout[1] == "T", batch > 1 and not broadcast_b)
        out = torch.empty((batch, n, n) if batch > 1 else (n, n), dtype=torch.float16)
        p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
        assert persistent_tma.why_not(p) is None
        kernel, _, args, kwargs = persistent_tma.triton_launch_args(p, cfg, 132)
        warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        _, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, warps, num_stages=stages, gluon=False)
        count = lambda pattern: len(re.findall(pattern, ptx))
        spills = re.findall(r"(\\d+) bytes spill stores", info)
        return dict(wgmma=count(r"wgmma\\.mma_async"), tma=count(r"cp\\.async\\.bulk\\.tensor"),
                    shared=count(r"ld\\.shared") + count(r"ldmatrix"), made=count(r"tensormap\\.replace"),
                    spills=max(map(int, spills)) if spills else 0)

    report = {}
    for tile in json.loads(sys.argv[1]):
        cfg = persistent_tma.make_config(*tile)
        for name, (batch, layout, bcast) in {"2d-NN": (1, "NN", False), "NN": (4, "NN", False),
                                             "TT": (4, "TT", False), "NT-broadcast-b": (4, "NT", True)}.items():
            report["x".join(map(str, tile[:3])) + "/" + name] = code(batch, layout, bcast, cfg)
    print(json.dumps(report))
    """
)


def test_batched_kernel_compiles_like_the_unbatched_one_for_sm90(tmp_path):
    """The 3-D descriptor loads, reshaped to 2-D tiles, go straight to the MMAs from shared memory: the batched
    kernel has the unbatched one's MMAs and TMA copies, no operand read back from shared memory into registers,
    no descriptor made on the device, and no spills."""
    tiles = [(128, 256, 64, 8, 3), (64, 64, 128, 4, 6)]
    report = compile_offline(tmp_path, _COMPILE_BATCHED, tiles, timeout=600)
    for tile in report:
        base = report[tile.split("/")[0] + "/2d-NN"]
        r = report[tile]
        assert r["wgmma"] == base["wgmma"] > 0 and r["tma"] == base["tma"] > 0, (tile, r, base)
        assert r["shared"] == base["shared"] and r["made"] == 0 and r["spills"] == 0, (tile, r, base)


# --- on the GPU ---------------------------------------------------------------------------------------------


def _hopper():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("TMA needs sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(3, 264, 136, 200), (5, 72, 520, 40), (2, 1000, 1032, 1048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_candidate_batched_on_the_gpu(shape, dtype, layout):
    """Every 16-bit candidate, forced, on batches with ragged edge tiles (each dimension a multiple of 8, as TMA
    needs for transposed operands), into NaN-poisoned outputs, each batch against the fp64 reference."""
    from triton.runtime.errors import OutOfResources

    _hopper()
    B, M, N, K = shape
    torch.manual_seed(0)
    a = _operand(B, M, K, layout[0] == "T", dtype, "cuda")
    b = _operand(B, K, N, layout[1] == "T", dtype, "cuda")
    ref = matmul_reference(a, b)
    launch.ensure_allocator()
    ran = 0
    for cfg in persistent_tma.configs(2, "ab"):
        out = torch.full((B, M, N), float("nan"), device="cuda", dtype=dtype)
        p = _problem(a, b, out)
        assert persistent_tma.why_not(p) is None
        try:
            persistent_tma.launch_config(p, cfg)
        except OutOfResources:
            continue
        torch.cuda.synchronize()
        _check_batches(out, ref, tolerance(dtype))
        ran += 1
    assert ran >= 5


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_broadcast_and_epilogue_on_the_gpu(dtype, which, no_fallback):
    _hopper()
    B, M, N, K = 6, 136, 264, 88
    torch.manual_seed(1)
    a = _operand(B, M, K, True, dtype, "cuda", broadcast=which == "a")
    b = _operand(B, K, N, False, dtype, "cuda", broadcast=which == "b")
    c = torch.randn(M, N, device="cuda").to(dtype)  # broadcast over the batch too
    bias = torch.randn(N, device="cuda").to(dtype)
    kw = dict(c=c, bias=bias, alpha=1.5, beta=0.5, activation="gelu")
    from triton.runtime.errors import OutOfResources

    ran = 0
    for cfg in [None, *persistent_tma.configs(2, "ab")[:4]]:  # None: the rung's own choice, which falls back
        out = torch.full((B, M, N), float("nan"), device="cuda", dtype=dtype)
        p = make_problems(a, b, out, c, bias, 1.5, 0.5, "gelu", "ieee", False)[0]
        assert p.batch == B and persistent_tma.why_not(p) is None
        try:
            persistent_tma.run(p, cfg)
        except OutOfResources:
            assert cfg is not None, "the rung's own choice must fit (launch_first_fitting)"
            continue  # a config asked for is launched as it is: the C tile's shared memory may not fit with it
        torch.cuda.synchronize()
        _check_batches(out, matmul_reference(a, b, **kw), tolerance(dtype))
        ran += 1
    assert ran >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_auto_runs_big_batched_products_on_persistent_tma_and_replays(dtype, monkeypatch):
    """On the GPU, with gluon_f16's batched launch off, auto takes a batched product of enough tiles to
    persistent_tma (the real SM count), and a second call (a replay of the recorded launch, its 3-D descriptors
    rebased) computes new operands right."""
    from tilegemm.ops.matmul import dispatch

    _hopper()
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", False)
    B, M, N, K = 8, 1024, 1024, 64
    a = _operand(B, M, K, False, dtype, "cuda")
    b = _operand(B, K, N, False, dtype, "cuda")
    p = _problem(a, b, torch.empty(B, M, N, device="cuda", dtype=dtype))
    assert dispatch.surveyed(p) is None  # batched: the rules decide
    assert dispatch.choose_kernel(p) == "persistent_tma"
    for _ in range(3):
        a = _operand(B, M, K, False, dtype, "cuda")
        b = _operand(B, K, N, False, dtype, "cuda")
        out = tilegemm.matmul(a, b)
        torch.cuda.synchronize()
        _check_batches(out, matmul_reference(a, b), tolerance(dtype))
    out = tilegemm.ops.grouped.batched_matmul(a, b)
    _check_batches(out, matmul_reference(a, b), tolerance(dtype))
