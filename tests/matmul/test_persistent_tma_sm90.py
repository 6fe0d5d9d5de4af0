"""persistent_tma with an operand through registers: which loops its candidates get, what ptxas does with
them, and whether every candidate computes the right tiles on a GPU.

tf32 (and fp8) operands must be K-major in shared memory, so with B row-major (NN, TN) the kernel swaps
the operands and takes B^T through registers, and with only A column-major (TT) it takes A through
registers. There ptxas serializes every wgmma of a loop whose tile loop is flattened into the K loop (its
info C7515). Unflattened loops are not serialized and ran up to 1.5x faster, but on the H200 they gave
wrong tiles (all of them for some TT configs, now and then for NN; docs/rungs/persistent_tma.md),
so :func:`persistent_tma.configs` keeps these loops flattened: slower, and right.
"""

from __future__ import annotations

import textwrap

import pytest

from tilegemm.core import launch
from tilegemm.core.checks import worst_tile_error
from tilegemm.ops.matmul import persistent_tma

from conftest import SM90, compile_offline


def test_register_operand_configs_stay_flattened():
    # (Under the interpreter configs() gives one small config; hopper_configs() is the GPU's list.)
    for size in (1, 4):
        for mode in ("swap", "reg_a"):
            cands = persistent_tma.hopper_configs(size, mode)
            assert cands
            for cfg in cands:
                assert cfg["FLATTEN"] is True and cfg["WARP_SPECIALIZE"] == 0, (size, mode, cfg)
            assert len({tuple(sorted(c.items())) for c in cands}) == len(cands), "no duplicates"
        as_loaded = persistent_tma.hopper_configs(size, "ab")
        assert any(not cfg["FLATTEN"] for cfg in as_loaded), "K-major operands keep their unflattened configs"


_COMPILE = SM90 + textwrap.dedent(
    """
    import json
    import torch
    from tilegemm.ops.matmul import persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    def ptxas_info(mode, a_t, b_t, cfg):
        # A tf32 problem in the layout, with a bias; compiled as the rung launches it (host descriptors).
        M = N = K = 512
        a = torch.empty(K, M).T if a_t else torch.empty(M, K)
        b = torch.empty(N, K).T if b_t else torch.empty(K, N)
        p = make_problems(a, b, torch.empty(M, N), None, torch.empty(N), 1.0, 0.0, "none", "tf32", False)[0]
        assert p.mma_operands == mode
        kernel, _, args, kwargs = persistent_tma.triton_launch_args(p, cfg, 132)
        warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
        sig = launch_signature(kernel, args, kwargs)
        return compile_sm90(kernel, *sig, warps, num_stages=stages, gluon=False)[2]

    out = {}
    # tf32 NN (swap) and TT (A through registers): every candidate, and one unflattened config as a control.
    for mode, a_t, b_t in (("swap", False, False), ("reg_a", True, True)):
        cands = persistent_tma.configs(4, mode)
        control = dict(cands[0], FLATTEN=False)
        for i, cfg in enumerate(cands + [control]):
            name = f"{mode}/{'control' if i == len(cands) else i}"
            out[name] = dict(cfg=cfg, serialized="C7515" in ptxas_info(mode, a_t, b_t, cfg))
    print(json.dumps(out))
    """
)


def test_ptxas_serializes_the_flattened_loops_and_not_the_unflattened(tmp_path):
    """What the choice costs, as Triton 3.6's ptxas says it: every candidate's MMAs are serialized; the same
    tile unflattened is not. (If a later Triton stops serializing the flattened loops, this fails: time them
    again, and check the unflattened ones for wrong tiles
    as research/diagnose_register_operand.py did: docs/research.md.)"""
    results = compile_offline(tmp_path, _COMPILE, None, timeout=600)
    controls = {k: v for k, v in results.items() if k.endswith("control")}
    assert len(controls) == 2 and len(results) > 2 * 5
    for name, r in results.items():
        expected = name not in controls
        assert r["serialized"] is expected, f"{name}: serialized={r['serialized']} for {r['cfg']}"


def test_shipped_register_operand_entries_stay_flattened():
    """The shipped tuned configs follow the same rule (an entry is launched as it is, not re-checked)."""
    import json
    from pathlib import Path

    import tilegemm

    seen = 0
    for path in (Path(tilegemm.__file__).parent / "tuned").glob("*.json"):
        for key, cfg in json.loads(path.read_text())["entries"].items():
            rung, _, _, _, dtype, _, layout = key.split("|")
            gluon = cfg.get("GLUON_FP8") or cfg.get("GLUON_TF32")
            if rung != "persistent_tma" or gluon or dtype not in ("tf32", "float8_e4m3fn", "float8_e5m2"):
                continue
            seen += 1
            # B row-major (layout ?N) is not K-major: swapped; A column-major with B K-major (TT): A in registers.
            if layout[1] == "N" or layout == "TT":
                assert cfg["FLATTEN"] is True and cfg.get("WARP_SPECIALIZE", 0) == 0, f"{path.name}: {key} {cfg}"
    assert seen >= 4, "the H200 file ships tf32 NT entries: the keys were read"


@pytest.mark.gpu
# Ragged against every tile, yet 16-byte aligned rows even for fp8 (TMA's rule: persistent_tma.why_not).
@pytest.mark.parametrize("shape", [(1008, 784, 528), (1024, 1024, 1024)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,layout", [("tf32", "NN"), ("tf32", "TN"), ("tf32", "TT"), ("tf32", "NT"),
                                          ("fp8", "NN"), ("fp8", "TT")])
def test_every_candidate_is_right_on_the_gpu(dtype, layout, shape):
    """Each candidate for tf32 / fp8 operands, forced, three times, with a bias and C, into a NaN-poisoned
    output, every tile checked on its own (a race that spoils one tile of 32 barely moves the whole
    matrix's error). The unflattened register-operand loops failed exactly this on the H200. A candidate
    whose shared memory does not fit beside the C tile is skipped, as the tuner skips it."""
    import torch
    from triton.runtime.errors import OutOfResources

    from tilegemm.ops.matmul.problem import make_problems
    from tilegemm.ops.matmul.reference import matmul_reference, tolerance

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("needs a Hopper GPU")
    M, N, K = shape
    torch.manual_seed(0)
    a = torch.randn(K, M, device="cuda").mT if layout[0] == "T" else torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").mT if layout[1] == "T" else torch.randn(K, N, device="cuda")
    precision, out_dtype, scales = "tf32", torch.float32, (None, 0, None, 0)
    if dtype == "fp8":
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        precision, out_dtype = "ieee", torch.bfloat16
        one = torch.ones(1, device="cuda")
        scales = (one, 0, one, 0)
    c = torch.randn(M, N, device="cuda", dtype=out_dtype)
    bias = torch.randn(N, device="cuda", dtype=out_dtype)
    ref = matmul_reference(a, b, c=c, bias=bias, alpha=1.5, beta=0.5)
    tol = tolerance(a.dtype, precision, out_dtype)

    def problem(out):
        return make_problems(a, b, out, c, bias, 1.5, 0.5, "none", precision, False, scales)[0]

    p0 = problem(torch.empty(M, N, device="cuda", dtype=out_dtype))
    assert persistent_tma.why_not(p0) is None
    mode = p0.mma_operands
    assert mode == ("ab" if layout == "NT" else "reg_a" if layout == "TT" else "swap")
    cands = persistent_tma.configs(a.element_size(), mode)
    ran = 0
    launch.ensure_allocator()
    for cfg in cands:
        for _ in range(3):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
            try:
                persistent_tma.launch_config(problem(out), cfg)
            except OutOfResources:
                break
            torch.cuda.synchronize()
            err = worst_tile_error(out, ref, cfg["BLOCK_M"], cfg["BLOCK_N"])
            assert err <= tol, f"{cfg}: a tile's relative error is {err:.2e} (bound {tol:.1e})"
        else:
            ran += 1
    assert ran >= len(cands) // 2, f"only {ran} of {len(cands)} candidates fit"


_COMPILE_DESCRIPTORS = SM90 + textwrap.dedent(
    """
    import json, re, sys
    from tilegemm.ops.matmul import persistent_tma

    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        p = cpu_problem("float16", v["layout"], False)
        cfg = persistent_tma.make_config(128, 64, 64, 4, 4, host_desc=v["host"])
        kernel, _, args, kwargs = persistent_tma.triton_launch_args(p, cfg, 132)
        warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, warps, num_stages=stages, gluon=False)
        report[name] = dict(made=len(re.findall(r"tensormap\\.replace", ptx)),
                            loads=len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)))
    print(json.dumps(report))
    """
)


def test_host_descriptors_leave_the_device_nothing_to_make(tmp_path):
    """With HOST_DESC the kernel takes A's, B's and the output's TMA descriptors as parameters (made on the
    host, :func:`persistent_tma.host_descriptors`): no descriptor is written on the device, where without
    it each program makes three; both move tiles by TMA."""
    variants = {f"{layout}-{'host' if host else 'device'}": dict(layout=layout, host=host)
                for layout in ("NN", "TT") for host in (True, False)}
    report = compile_offline(tmp_path, _COMPILE_DESCRIPTORS, variants, timeout=600)
    for name, r in report.items():
        assert r["loads"] > 0, name
        if variants[name]["host"]:
            assert r["made"] == 0, f"{name}: {r}"
        else:
            assert r["made"] > 0, f"{name}: {r}"


def test_host_descriptors_match_the_operands():
    import torch

    from tilegemm.ops.matmul.problem import make_problems

    a = torch.empty(64, 96, dtype=torch.float16).T  # A^T: [96, 64] stored as [64, 96]
    b = torch.empty(40, 64, dtype=torch.float16).T  # B^T: [64, 40] stored as [40, 64]
    p = make_problems(a, b, torch.empty(96, 40, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee",
                      False)[0]
    da, db, do = persistent_tma.host_descriptors(p, persistent_tma.make_config(128, 64, 32, 4, 3, host_desc=True))
    assert (list(da.shape), list(da.strides), list(da.block_shape)) == ([64, 96], [96, 1], [32, 128])
    assert (list(db.shape), list(db.strides), list(db.block_shape)) == ([40, 64], [64, 1], [64, 32])
    assert (list(do.shape), list(do.strides), list(do.block_shape)) == ([96, 40], [40, 1], [128, 32])
    assert da.base is a and db.base is b


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype", ["fp16", "tf32"])
def test_host_descriptor_configs_are_right_and_replay_on_the_gpu(dtype, layout):
    """Triton's host-side descriptors (HOST_DESC configs): right on edge tiles in every layout, and a
    replay of the recorded launch over new tensors (tilegemm.core.launch rebases each descriptor) computes the
    new product into a poisoned output."""
    import torch

    from tilegemm.core.launch import Replay, recording
    from tilegemm.ops.matmul.problem import make_problems
    from tilegemm.ops.matmul.reference import matmul_reference, tolerance

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("TMA needs sm_90")
    dt = torch.float16 if dtype == "fp16" else torch.float32
    precision = "ieee" if dtype == "fp16" else "tf32"
    M, N, K = 264, 136, 200

    def operands():
        a = torch.randn(K, M, device="cuda").to(dt).T if layout[0] == "T" else torch.randn(M, K, device="cuda").to(dt)
        b = torch.randn(N, K, device="cuda").to(dt).T if layout[1] == "T" else torch.randn(K, N, device="cuda").to(dt)
        return a, b

    a, b = operands()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", precision, False)[0]
    assert persistent_tma.why_not(p) is None
    tol = tolerance(dt, precision)
    for cfg in persistent_tma.hopper_configs(p.a.element_size(), p.mma_operands)[:3]:
        cfg = dict(cfg, HOST_DESC=True)
        out.fill_(float("nan"))
        with recording() as rec:
            persistent_tma.run(p, cfg)
        torch.cuda.synchronize()
        ref = matmul_reference(a, b)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < tol, (cfg, err)
        assert rec.launches is not None and len(rec.launches) == 1
        a2, b2 = operands()
        out2 = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
        replay = Replay(rec.launches[0], (a, b, out))
        assert replay(a2, b2, out2)
        torch.cuda.synchronize()
        ref2 = matmul_reference(a2, b2)
        err2 = ((out2.double() - ref2.double()).norm() / ref2.double().norm()).item()
        assert err2 < tol, (cfg, err2)
