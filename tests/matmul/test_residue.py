"""split_k's residue-class path (``tilegemm.ops.matmul.residue``): small-M products whose B rows are not 16 bytes
apart, B read in whole 16-byte vectors by residue class of its rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.ops.matmul import residue, split_k
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close, crossed


@pytest.fixture
def taken(monkeypatch):
    """Let the interpreter (and any size of B) take the path; count the configs it ran."""
    monkeypatch.setattr(residue, "TAKE_UNDER_INTERPRETER", True)
    configs = []
    real = residue.run
    monkeypatch.setattr(residue, "run", lambda p, cfg=None: configs.append(dict(residue.config(p), **(cfg or {})))
                        or real(p, cfg))
    return configs


def operands(M, N, K, layout, dtype=torch.float16, device="cpu", batch=()):
    a = torch.randn(*batch, M, K, dtype=dtype, device=device)
    b = (torch.randn(*batch, K, N, dtype=dtype, device=device) if layout == "NN"
         else torch.randn(*batch, N, K, dtype=dtype, device=device).mT)
    return a, b


def problem(a, b, out, c=None, bias=None, beta=1.0, activation="none"):
    return make_problems(a, b, out, c, bias, 1.0, beta, activation, "ieee", a.dtype == torch.bfloat16
                         and not a.is_cuda)[0]


@crossed("shape, slices, layout", [(3, 37, 45), (16, 130, 301), (1, 17, 9), (7, 21, 9), (5, 9, 1001)], [1, 2, 3, 5],
         ["NN", "NT"], ids=(lambda s: "x".join(map(str, s)),))
def test_residue_product(layout, slices, shape, device, taken):
    """Every output element written (NaN-poisoned output), with the epilogue, for odd leading dimensions in K
    slices of any count (more slices than steps leave some empty: their planes hold zeros)."""
    M, N, K = shape
    a, b = operands(M, N, K, layout, device=device)
    bias, c = torch.randn(N, dtype=a.dtype, device=device), torch.randn(M, N, dtype=a.dtype, device=device)
    out = torch.full((M, N), float("nan"), dtype=a.dtype, device=device)
    p = problem(a, b, out, c=c, bias=bias, beta=0.5, activation="gelu")
    assert (residue.why_not(p) is None) and residue.config(p)["LAYOUT"] == layout
    residue.run(p, dict(SLICES=slices))
    ref = matmul_reference(a, b, c=c, bias=bias, beta=0.5, activation="gelu")
    assert_rel_close(out, ref, tolerance(a.dtype))


@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_residue_through_split_k_and_bf16(layout, device, taken):
    """``kernel="split_k"`` takes the path (bf16: upcast under the interpreter, whose bf16 dots are wrong)."""
    for dtype in (torch.float16, torch.bfloat16):
        a, b = operands(4, 45, 67, layout, dtype=dtype, device=device)
        got = tilegemm.matmul(a, b, kernel="split_k")
        assert_rel_close(got, matmul_reference(a, b), tolerance(dtype))
    assert [c["LAYOUT"] for c in taken] == [layout, layout]


@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_residue_batched(layout, device, taken):
    """Batches: B's own (its batch stride odd too) and one B broadcast over A's batch (stride 0)."""
    a, b = operands(3, 29, 41, layout, device=device, batch=(3,))
    assert_rel_close(tilegemm.matmul(a, b, kernel="split_k"), matmul_reference(a, b), tolerance(a.dtype))
    assert_rel_close(tilegemm.matmul(a, b[0], kernel="split_k"), matmul_reference(a, b[0]), tolerance(a.dtype))
    assert len(taken) == 2


@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_residue_neighbours_values_never_reach_the_output(layout, device, taken):
    """A class reads a few values of the neighbouring rows: an infinite one there must not turn another
    output column into NaN (NT zeroes them; NN's land in columns outside the output)."""
    M, N, K = 2, 27, 43
    a, b = operands(M, N, K, layout, device=device)
    if layout == "NT":
        b.mT[5, K - 1] = float("inf")  # row 5's last value: row 6 (another class) reads it before its start
        bad = [5]
    else:
        b[5, N - 1] = float("inf")  # row 5's last value: row 6 reads it as its first shifted column
        bad = [N - 1]
    got = tilegemm.matmul(a, b, kernel="split_k")
    ref = matmul_reference(a, b)
    keep = [n for n in range(N) if n not in bad]
    assert torch.isfinite(got[:, keep]).all()
    assert_rel_close(got[:, keep], ref[:, keep], tolerance(a.dtype))
    assert len(taken) == 1


@pytest.mark.parametrize("layout", ["NN", "NT"])
@pytest.mark.parametrize("slices", [1, 3])
def test_residue_b_ending_its_storage(layout, slices, device, taken):
    """B's last row ends where its storage ends: that row is read with exact masks, never past it (under the
    interpreter every load is bounds-checked against the storages of the call's tensors and workspace)."""
    from tilegemm.core import workspace
    from tilegemm.learn.debug import bounds_checked

    M, N, K = 3, 23, 35
    storage = torch.randn(8 + N * K, dtype=torch.float16, device=device)  # B at offset 8: 16-byte aligned
    b = storage[8:].view(K, N) if layout == "NN" else storage[8:].view(N, K).mT
    a = torch.randn(M, K, dtype=torch.float16, device=device)
    out = torch.full((M, N), float("nan"), dtype=a.dtype, device=device)
    p = problem(a, b, out)
    residue.run(p, dict(SLICES=slices))
    assert_rel_close(out, matmul_reference(a, b), tolerance(a.dtype))
    if device == "cpu":
        ws = [t for k, v in workspace._workspaces.items() if k[2] == "residue" for t in v]
        out.fill_(float("nan"))
        with bounds_checked(a, storage, out, *ws):
            residue.run(p, dict(SLICES=slices))
        assert_rel_close(out, matmul_reference(a, b), tolerance(a.dtype))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(1, 16), N=st.integers(8, 70), K=st.integers(8, 70), layout=st.sampled_from(["NN", "NT"]),
       slices=st.integers(1, 4))
def test_residue_drawn_shapes(M, N, K, layout, slices, device):
    """Drawn shapes whose B rows are misaligned (the other dimension made odd where it was not)."""
    residue.TAKE_UNDER_INTERPRETER = True
    try:
        if layout == "NN":
            N |= 1
        else:
            K |= 1
        a, b = operands(M, N, K, layout, device=device)
        out = torch.full((M, N), float("nan"), dtype=a.dtype, device=device)
        p = problem(a, b, out)
        assert (residue.why_not(p) is None)
        residue.run(p, dict(SLICES=slices))
        assert_rel_close(out, matmul_reference(a, b), tolerance(a.dtype))
    finally:
        residue.TAKE_UNDER_INTERPRETER = False


def test_residue_rules(monkeypatch):
    """Which products the path takes, and its K split (as on a 132-SM GPU)."""
    monkeypatch.setattr(residue, "interpreting", lambda: False)
    monkeypatch.setattr(residue, "sm_count", lambda device: 132)

    def p(M, N, K, layout="NN", dtype=torch.float16, offset=0):
        a = torch.empty(M, K, dtype=dtype)
        if layout == "NN":
            b = torch.empty(K * N + offset, dtype=dtype)[offset:].view(K, N)
        else:
            b = torch.empty(N * K + offset, dtype=dtype)[offset:].view(N, K).T
        return problem(a, b, torch.empty(M, N, dtype=dtype))

    assert (residue.why_not(p(6, 5661, 26729)) is None) and (residue.why_not(p(1, 4096, 4097, "NT")) is None)
    assert residue.why_not(p(6, 5664, 26729)) is not None, "NN rows 16-byte aligned"
    assert residue.why_not(p(1, 4097, 4096, "NT")) is not None, "NT rows 16-byte aligned"
    assert residue.why_not(p(17, 5661, 26729)) is not None, "M above 16"
    assert residue.why_not(p(6, 5661, 26729, dtype=torch.float32)) is not None, "16-bit only"
    assert residue.why_not(p(6, 5661, 26729, offset=1)) is not None, "B's first element not 16-byte aligned"
    assert residue.why_not(p(8, 1001, 3001)) is not None, "under MIN_B_BYTES: one launch of the path before"
    assert residue.why_not(p(16, 8793, 1201)) is not None, "NN planes above PLANE_SHARE of B (K under 128 M)"
    nn = residue.config(p(6, 5661, 26729))
    assert (nn["BLOCK_O"], nn["BLOCK_I"]) == residue.TILES["NN"][:2]
    # 23 windows x 8 classes = 184 programs: 2 slices make 368 <= 4 x 132, 4 would pass it
    assert nn["SLICES"] == 2
    nt = residue.config(p(1, 4096, 4097, "NT"))
    # 8 windows x 8 classes = 64 programs: 16 slices make 1024 <= 8 x 132, each of 2 of the 33 K steps or more
    assert nt["SLICES"] == 16
    assert residue.planes_of(p(1, 4096, 4097, "NT"), dict(nt, SLICES=1)) == 0  # one slice: stored directly
    assert residue.planes_of(p(6, 5661, 26729), nn) == 16


def test_auto_takes_residue_over_padding(monkeypatch):
    """``auto``'s aligned twin (copies of the operands) is not made where the residue path applies."""
    from tilegemm.ops.matmul import dispatch

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(residue, "TAKE_UNDER_INTERPRETER", True)
    a, b = operands(3, 37, 45, "NN")
    p = problem(a, b, torch.empty(3, 37, dtype=a.dtype))
    assert (residue.why_not(p) is None) and not dispatch._pads(p, a, b)


def test_residue_compiles_to_vector_copies_for_sm90(tmp_path):
    """On sm_90 every load of B is a 16-byte ``cp.async`` (pipelined), whatever B's odd leading dimension: the
    point of reading by residue class (the path before loaded two bytes at a time); with 64-bit offsets too."""
    import textwrap

    from conftest import SM90, compile_offline

    source = SM90 + textwrap.dedent(
        """
        import json, re, sys
        import torch
        from tilegemm.ops.matmul import residue
        from tilegemm.ops.matmul.problem import make_problems

        report = {}
        for name in json.loads(sys.argv[1]):
            layout, index_64 = name[:2], name.endswith("64")
            M, N, K = 6, 5661, 2673
            a = torch.empty(M, K, dtype=torch.float16)
            b = torch.empty(K, N, dtype=torch.float16) if layout == "NN" else torch.empty(N, K, dtype=torch.float16).T
            p = make_problems(a, b, torch.empty(M, N, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee",
                              False)[0]
            cfg = dict(LAYOUT=layout, BLOCK_O=residue.TILES[layout][0], BLOCK_I=residue.TILES[layout][1],
                       num_warps=residue.TILES[layout][2], num_stages=residue.TILES[layout][3], SLICES=2)
            kernel, _, args, kw = residue.launch_args(p, cfg, torch.empty(16), torch.zeros(4, dtype=torch.int32))
            warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
            kw["INDEX_64"] = index_64  # as for a B past 2^31 elements
            sig, constexprs, attrs = launch_signature(kernel, args, kw)
            for i, arg in enumerate(kernel.arg_names):  # Triton specializes integers equal to 1, as launched
                if sig.get(arg) == "i32" and i < len(args) and args[i] == 1:
                    sig[arg], constexprs[(i,)] = "constexpr", 1
            compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, warps, num_stages=stages, gluon=False)
            report[name] = dict(cp16=len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global[^;]*, 0x10", ptx)),
                                  cp=len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global", ptx)),
                                  spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)])
        print(json.dumps(report))
        """
    )
    report = compile_offline(tmp_path, source, ["NN", "NT", "NN-index64", "NT-index64"])
    assert len(report) == 4
    for name, r in report.items():
        bo, bi, warps, stages = residue.TILES[name[:2]]
        # a [BO, BI] tile a stage, eight 2-byte values a copy, every thread's copies
        assert r["cp16"] == r["cp"] == bo * bi // 8 // (32 * warps) * stages, f"{name}: {r}"
        assert r["spills"] in ([], [0]), f"{name}: {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "NT"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_auto_takes_residue_on_large_misaligned_products(layout, dtype, monkeypatch):
    """On the GPU, ``auto`` takes the path for products past :data:`residue.MIN_B_BYTES` (K split, planes,
    reduction), right with a bias and an activation, and replays it."""
    calls = []
    real = residue.run
    monkeypatch.setattr(residue, "run", lambda p, cfg=None: calls.append(residue.config(p)) or real(p, cfg))
    M, N, K = (6, 5661, 1999) if layout == "NN" else (5, 3001, 2047)
    a, b = operands(M, N, K, layout, dtype=dtype, device="cuda")
    bias = torch.randn(N, dtype=dtype, device="cuda")
    ref = matmul_reference(a, b, bias=bias, activation="relu")
    for _ in range(3):  # the first call records, the others replay
        assert_rel_close(tilegemm.matmul(a, b, bias=bias, activation="relu"), ref, tolerance(dtype))
    assert len(calls) == 1 and calls[0]["LAYOUT"] == layout
    a2, b2 = operands(M, N, K, layout, dtype=dtype, device="cuda")  # new tensors in the replay's slots
    assert_rel_close(tilegemm.matmul(a2, b2, bias=bias, activation="relu"),
                     matmul_reference(a2, b2, bias=bias, activation="relu"), tolerance(dtype))
    assert len(calls) == 1
