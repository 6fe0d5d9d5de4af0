"""The cooperative warp-specialized 16-bit Gluon GEMM (``tilegemm.ops.matmul.gluon_f16``), one of
``persistent_tma``'s candidates for fp16/bf16 with a 16-bit output on sm_90.

Gluon has no interpreter: without a GPU the kernel is compiled for sm_90 and its code checked, and the
host side (configs, usable, how persistent_tma and auto take it) is checked; on a GPU (``pytest -m gpu``)
it runs against an fp64 reference in every layout, on edge tiles and with the whole epilogue.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tilegemm.core.hardware import HOPPER_SMEM_PER_BLOCK
from tilegemm.ops.matmul import gluon_f16, persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import SM90, assert_rel_close, compile_offline


def _operands(M, N, K, layout, dtype, device):
    a = torch.randn(M, K, device=device).to(dtype) if layout[0] == "N" else \
        torch.randn(K, M, device=device).to(dtype).T
    b = torch.randn(K, N, device=device).to(dtype) if layout[1] == "N" else \
        torch.randn(N, K, device=device).to(dtype).T
    return a, b


def _problem(a, b, out, c=None, bias=None, alpha=1.0, beta=0.0, act="none"):
    return make_problems(a, b, out, c, bias, alpha, beta, act, "ieee", False)[0]


def test_configs_fit_in_shared_memory():
    cfgs = gluon_f16.configs()
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in cfgs} == {(256, 128), (128, 256), (128, 128)}
    for c in cfgs:
        ring = c["STAGES"] * (c["BLOCK_M"] + c["BLOCK_N"]) * gluon_f16.BLOCK_K * 2
        out = c["BLOCK_M"] * c["BLOCK_N"] * 2 // (2 if c["SHARED_OUT"] else 1)
        assert ring + out <= HOPPER_SMEM_PER_BLOCK
        # The deepest ring that fits: one more slot would not.
        assert ring + (c["BLOCK_M"] + c["BLOCK_N"]) * gluon_f16.BLOCK_K * 2 + out > HOPPER_SMEM_PER_BLOCK
    # For the 32K-element tiles four stages only fit with the shared output buffer.
    big = [c for c in cfgs if c["BLOCK_M"] * c["BLOCK_N"] == 256 * 128]
    assert {(c["STAGES"], c["SHARED_OUT"]) for c in big} == {(3, False), (4, True)}
    small = {(c["BLOCK_M"], c["BLOCK_N"]): c["STAGES"] for c in cfgs if c["BLOCK_M"] * c["BLOCK_N"] < 256 * 128}
    assert small == {(128, 128): 6}


def test_descriptors_describe_the_operands_as_they_lie():
    a = torch.empty(64, 96, dtype=torch.float16).T  # A^T: [96, 64] stored as [64, 96]
    b = torch.empty(64, 48, dtype=torch.float16)
    p = _problem(a, b, torch.empty(96, 48, dtype=torch.float16))
    da, db, do = gluon_f16.descriptors(p, dict(BLOCK_M=128, BLOCK_N=64))
    assert (da.shape, da.strides, da.block_shape) == ([64, 96], [96, 1], [64, 128])  # A stored [K, M]
    assert (db.shape, db.strides, db.block_shape) == ([64, 48], [48, 1], [64, 64])
    assert (do.shape, do.strides, do.block_shape) == ([96, 48], [48, 1], [64, 64])  # half a tile's rows


@pytest.mark.parametrize("case, reason", [
    ("fp16", None), ("bf16", None), ("fp32", "16-bit"), ("fp32-out", "16-bit output"),
    ("batched", None),  # its batched launch (tests/matmul/test_gluon_f16_batched.py)
])
def test_usable(case, reason):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(case, torch.float16)
    shape = (2, 64, 32) if case == "batched" else (64, 32)
    a = torch.zeros(*shape, dtype=dtype)
    b = torch.zeros(32, 48, dtype=dtype)
    out_dtype = torch.float32 if case in ("fp32", "fp32-out") else dtype
    out = torch.empty(*shape[:-1], 48, dtype=out_dtype)
    p = _problem(a, b.expand(2, 32, 48) if case == "batched" else b, out)
    got = gluon_f16.why_not(p)
    assert got is None if reason is None else reason in got


def test_persistent_tma_offers_it_for_16_bit_outputs_on_sm90(monkeypatch):
    # The real gluon_kernel_for answers None off an sm_90 GPU; pretend to be one.
    monkeypatch.setattr(persistent_tma, "interpreting", lambda: False)
    monkeypatch.setattr("tilegemm.core.hardware.interpreting", lambda: False)
    monkeypatch.setattr("tilegemm.core.hardware.compute_capability", lambda: (9, 0))
    for layout in ("NN", "NT", "TN", "TT"):
        a, b = _operands(256, 128, 64, layout, torch.float16, "cpu")
        cands = persistent_tma.candidates(_problem(a, b, torch.empty(256, 128, dtype=torch.float16)))
        assert [c for c in cands if c.get("GLUON_F16")] == gluon_f16.configs(), layout
        assert any(not c.get("GLUON_F16") for c in cands)  # Triton's configs stay candidates
    a, b = _operands(256, 128, 64, "NN", torch.float16, "cpu")
    fp32_out = persistent_tma.candidates(_problem(a, b, torch.empty(256, 128)))
    assert not any(c.get("GLUON_F16") for c in fp32_out)
    monkeypatch.setattr("tilegemm.core.hardware.compute_capability", lambda: (10, 0))
    assert not any(c.get("GLUON_F16") for c in
                   persistent_tma.candidates(_problem(a, b, torch.empty(256, 128, dtype=torch.float16))))


def test_auto_times_the_two_rungs_from_a_quarter_tile_per_sm_to_two(monkeypatch):
    """Where the Gluon kernel takes a 16-bit problem, auto takes persistent_tma from two 128x128 tiles per
    SM, times it against autotuned from a quarter of a tile per SM to two, and keeps autotuned below."""
    import tilegemm.core.hardware
    from tilegemm.ops.matmul import dispatch

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(persistent_tma, "why_not", lambda p: None)
    monkeypatch.setattr(tilegemm.core.hardware, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent_tma, "gluon_kernel_for", lambda p: gluon_f16)
    timed = []
    monkeypatch.setattr(dispatch, "_timed_choice", lambda p, rungs, **kw: timed.append(rungs) or "timed")

    def problem(n):
        a = torch.empty(n, 256, device="meta", dtype=torch.float16)
        b = torch.empty(256, n, device="meta", dtype=torch.float16)
        return _problem(a, b, torch.empty(n, n, device="meta", dtype=torch.float16))

    assert dispatch.choose_kernel(problem(4096)) == "persistent_tma"  # 1024 tiles
    assert dispatch.choose_kernel(problem(2048)) == "timed" and timed == [("autotuned", "persistent_tma")]  # 256
    assert dispatch.choose_kernel(problem(1024)) == "timed" and len(timed) == 2  # 64 tiles
    assert dispatch.choose_kernel(problem(768)) == "timed" and len(timed) == 3  # 36 tiles: over a quarter per SM
    assert dispatch.choose_kernel(problem(640)) == "autotuned" and len(timed) == 3  # 25 tiles: under a quarter


# Compiles the kernel for sm_90 (the descriptors as the host would pass them) and reports the MMA waits,
# the MMA count, the register requests, the descriptors made on the device, spills and shared memory.
_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    from tilegemm.ops.matmul import gluon_f16

    kernel = gluon_f16.matmul_f16_coop_kernel
    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        p = cpu_problem(v["dtype"], v["layout"], v["epilogue"])
        cfg = dict(GLUON_F16=True, BLOCK_M=v["bm"], BLOCK_N=v["bn"], STAGES=v["stages"],
                   SHARED_OUT=v["shared_out"], num_warps=4)
        cfg.update(zip(("GROUP_M", "SERPENTINE"), gluon_f16.ORDER.get((v["bm"], v["bn"]), (8, False))))
        _, _, args, kwargs = gluon_f16.launch_args(p, cfg, 132)
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, 4)
        report[name] = dict(
            waits=[int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)],
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
            setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}),
            tensormaps_made=len(re.findall(r"tensormap\\.replace", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            warps=compiled.metadata.num_warps,
            shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)

_VARIANTS = {
    "nn-256x128-s3": dict(dtype="float16", layout="NN", epilogue=False, bm=256, bn=128, stages=3, shared_out=False),
    "tt-128x256-s4-epilogue": dict(dtype="bfloat16", layout="TT", epilogue=True, bm=128, bn=256, stages=4,
                                   shared_out=True),
    "tn-256x128-s4": dict(dtype="float16", layout="TN", epilogue=False, bm=256, bn=128, stages=4, shared_out=True),
    "nt-128x128-s6": dict(dtype="float16", layout="NT", epilogue=False, bm=128, bn=128, stages=6, shared_out=False),
}


def test_compiled_code(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=600)
    for name, r in report.items():
        v = _VARIANTS[name]
        # One MMA group in flight in the K loop (wait_group 1), all of them before the epilogue.
        assert r["waits"].count(1) >= 2 and 0 in r["waits"] and set(r["waits"]) <= {0, 1}, f"{name}: {r['waits']}"
        # A 64-wide K step is 4 k16 MMAs per 64 rows of a warp group's half tile, issued at two places
        # (first step, loop body) in each of the two consumer partitions.
        assert r["mmas"] == 4 * (v["bm"] // 2 // 64) * 2 * 2, f"{name}: {r['mmas']} MMA instructions"
        assert r["warps"] == 12  # two consumer warp groups and the producer's
        for regs in (gluon_f16.CONSUMER_REGS, gluon_f16.PRODUCER_REGS):
            assert regs in r["setmaxnreg"], f"{name}: {regs} not among {r['setmaxnreg']}"
        # The descriptors come from the host: nothing made on the device.
        assert r["tensormaps_made"] == 0, f"{name}: {r['tensormaps_made']} descriptor edits"
        if not v["epilogue"]:  # a C tile and GELU on 64x256 a warp group spill (about 2 KB); plain ones must not
            assert r["spills"] and max(r["spills"]) == 0, f"{name}: spills {r['spills']}"
        ring = v["stages"] * (v["bm"] + v["bn"]) * gluon_f16.BLOCK_K * 2
        out = v["bm"] * v["bn"] * 2 // (2 if v["shared_out"] else 1)
        assert ring + out <= r["shared"] <= HOPPER_SMEM_PER_BLOCK


# --- on a GPU ---------------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("shape", [(128, 128, 64), (257, 264, 400), (300, 136, 40), (17, 1040, 2048),
                                   (1000, 520, 384)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gluon_f16_matches_the_reference(layout, shape, dtype):
    """Edge tiles, one to 32 K steps, K not a step multiple, fewer tiles than SMs; every config."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = shape
    if layout[0] == "T":
        M += -M % 8  # A stored as [K, M]: TMA needs its rows 16-byte aligned (M still not a tile multiple)
    a, b = _operands(M, N, K, layout, dtype, "cuda")
    ref = matmul_reference(a, b)
    for cfg in gluon_f16.configs():
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        p = _problem(a, b, out)
        assert gluon_f16.why_not(p) is None and persistent_tma.why_not(p) is None
        persistent_tma.run(p, cfg)
        assert_rel_close(out, ref, tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2304, 256), (3000, 2000, 192)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gluon_f16_epilogue_and_many_tiles(dtype, shape):
    """alpha, beta * C, bias, activation; several tiles per program (more tiles than SMs), in whole bands of
    tile rows and (3000 rows: 24 of 128) with a last band shorter than GROUP_M, walked right to left."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = shape
    a, b = _operands(M, N, K, "TN", dtype, "cuda")
    c = torch.randn(M, N, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    ref = matmul_reference(a, b, c=c, bias=bias, alpha=0.5, beta=-1.0, activation="gelu")
    for cfg in gluon_f16.configs():
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        persistent_tma.run(_problem(a, b, out, c, bias, 0.5, -1.0, "gelu"), cfg)
        assert_rel_close(out, ref, tolerance(dtype))


@pytest.mark.gpu
def test_persistent_tma_offers_it_on_the_gpu():
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    a, b = _operands(256, 256, 128, "NN", torch.float16, "cuda")
    p = _problem(a, b, torch.empty(256, 256, device="cuda", dtype=torch.float16))
    assert persistent_tma.gluon_kernel_for(p) is gluon_f16
    assert any(c.get("GLUON_F16") for c in persistent_tma.candidates(p))


def test_shipped_entries_are_configs_of_the_kernel():
    """A shipped entry is launched as it is: each GLUON_F16 one must be a config the kernel offers."""
    import json
    from pathlib import Path

    import tilegemm

    shipped = Path(tilegemm.__file__).parent / "tuned"
    found = 0
    for path in shipped.glob("*.json"):
        for key, cfg in json.loads(path.read_text())["entries"].items():
            if cfg.get("GLUON_F16"):
                found += 1
                assert key.startswith("persistent_tma|") and cfg in gluon_f16.configs(), (path.name, key)
    assert found  # the H200 ships some


def test_persistent_tma_knows_every_gluon_kernels_config_key():
    from tilegemm.ops.matmul import gluon_fp8, gluon_tf32

    modules = (gluon_fp8, gluon_tf32, gluon_f16)
    assert set(persistent_tma.GLUON_CONFIG_KEYS) == {m.CONFIG_KEY for m in modules}
