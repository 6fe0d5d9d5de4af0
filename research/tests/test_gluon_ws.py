"""The warp-specialized ping-pong Gluon GEMM (``tilegemm.ops.matmul.gluon_ws``), an exploration kernel.

No rung launches it (it ran 0.93x-0.97x of cuBLAS where ``persistent_tma`` ran 0.96x-1.02x; see
docs/rungs/persistent_tma.md), but ``research/explore_gluon_ws.py`` times it, so it is kept correct here.
Gluon has no interpreter: without a GPU it is compiled for sm_90 and its code checked; on a GPU
(``pytest -m gpu``) it runs against an fp64 reference in every layout.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tilegemm.core.hardware import HOPPER_SMEM_PER_BLOCK
import gluon_ws  # research/gluon_ws.py: run with PYTHONPATH=src:research
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import SM90, assert_rel_close, compile_offline


def _operands(M, N, K, layout, dtype, device):
    a = torch.randn(M, K, device=device).to(dtype) if layout[0] == "N" else \
        torch.randn(K, M, device=device).to(dtype).T
    b = torch.randn(K, N, device=device).to(dtype) if layout[1] == "N" else \
        torch.randn(N, K, device=device).to(dtype).T
    return a, b


def test_configs_fit_in_shared_memory():
    cfgs = gluon_ws.configs()
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in cfgs} == {(128, 128), (64, 256)}
    for c in cfgs:
        ring = c["STAGES"] * (c["BLOCK_M"] + c["BLOCK_N"]) * gluon_ws.BLOCK_K * 2
        assert ring + 2 * c["BLOCK_M"] * c["BLOCK_N"] * 2 <= HOPPER_SMEM_PER_BLOCK


@pytest.mark.parametrize("case, reason", [
    ("fp16", None), ("bf16", None), ("fp32", "16-bit"), ("fp32-out", "16-bit output"), ("batched", "batched"),
])
def test_usable(case, reason):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(case, torch.float16)
    shape = (2, 64, 32) if case == "batched" else (64, 32)
    a = torch.zeros(*shape, dtype=dtype)
    b = torch.zeros(32, 48, dtype=dtype)
    out_dtype = torch.float32 if case in ("fp32", "fp32-out") else dtype
    out = torch.empty(*shape[:-1], 48, dtype=out_dtype)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    if case == "batched":
        p = make_problems(a, b.expand(2, 32, 48), out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    got = gluon_ws.usable(p)
    assert got is None if reason is None else reason in got


def test_descriptors_describe_the_operands_as_they_lie():
    a, b = _operands(64, 48, 32, "TN", torch.float16, "cpu")
    out = torch.empty(64, 48, dtype=torch.float16)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    da, db, do = gluon_ws.descriptors(p, dict(BLOCK_M=128, BLOCK_N=128))
    assert (da.shape, da.strides, da.block_shape) == ([32, 64], [64, 1], [64, 128])  # A^T stored [K, M]
    assert (db.shape, db.strides, db.block_shape) == ([32, 48], [48, 1], [64, 128])
    assert (do.shape, do.block_shape) == ([64, 48], [128, 128])


# Compiles the kernel for sm_90 in a few variants (the descriptors as the host would pass them) and reports
# the MMA waits, MMA count, register requests, descriptor-making code and ptxas's registers and spills.
_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import gluon_ws

    kernel = gluon_ws.matmul_ws_kernel
    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        p = cpu_problem(v["dtype"], v["layout"], v["epilogue"])
        cfg = dict(GLUON_WS=True, BLOCK_M=v["bm"], BLOCK_N=v["bn"], STAGES=v["stages"], num_warps=4)
        _, _, args, kwargs = gluon_ws.launch_args(p, cfg, 132)
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, 4)
        report[name] = dict(
            waits=[int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)],
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
            setmaxnreg=[int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)],
            maxnreg=[int(n) for n in re.findall(r"\\.maxnreg\\s+(\\d+)", ptx)],
            tensormaps_made=len(re.findall(r"tensormap\\.replace", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            warps=compiled.metadata.num_warps,
            shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)

_VARIANTS = {
    "nn-fp16": dict(dtype="float16", layout="NN", epilogue=False, bm=128, bn=128, stages=5),
    "tt-bf16-epilogue": dict(dtype="bfloat16", layout="TT", epilogue=True, bm=128, bn=128, stages=4),
    "nt-64x256": dict(dtype="float16", layout="NT", epilogue=False, bm=64, bn=256, stages=4),
}


def test_compiled_code(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=600)
    for name, r in report.items():
        v = _VARIANTS[name]
        # One MMA group in flight in the K loop (wait_group 1), all of them before the epilogue.
        assert r["waits"].count(1) >= 2 and 0 in r["waits"] and set(r["waits"]) <= {0, 1}, f"{name}: {r['waits']}"
        # A 64-wide K step of a warp group's tile is 4 k16 MMAs per 64 rows; issued at two places (first
        # step, loop body) in each of the two consumer partitions.
        assert r["mmas"] == 4 * (v["bm"] // 64) * 2 * 2, f"{name}: {r['mmas']} MMA instructions"
        # Three warp groups: two consumers and the producer's (one of 4 warps).
        assert r["warps"] == 12
        # The partitions' register requests fit the 64K registers the program starts with.
        (maxnreg,) = r["maxnreg"]
        default = 3 * maxnreg - gluon_ws.CONSUMER_REGS - gluon_ws.PRODUCER_REGS
        for regs in (gluon_ws.CONSUMER_REGS, gluon_ws.PRODUCER_REGS, default):
            assert regs in r["setmaxnreg"], f"{name}: {regs} not among {r['setmaxnreg']}"
        assert max(r["setmaxnreg"]) <= 256
        # The descriptors come from the host: nothing made on the device.
        assert r["tensormaps_made"] == 0
        if not v["epilogue"]:
            assert r["spills"] and max(r["spills"]) == 0, f"{name}: spills {r['spills']}"
        ring = v["stages"] * (v["bm"] + v["bn"]) * gluon_ws.BLOCK_K * 2
        assert r["shared"] >= ring + 2 * v["bm"] * v["bn"] * 2


# --- on a GPU ---------------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _run(p, cfg):
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import launch

    launch(*gluon_ws.launch_args(p, cfg, sm_count(p.out.device)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("shape", [(128, 128, 64), (257, 264, 400), (300, 136, 40), (17, 1040, 2048),
                                   (1000, 520, 384)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gluon_ws_matches_the_reference(layout, shape, dtype):
    """Edge tiles, one to 32 K steps, K not a step multiple, fewer tiles than programs x 2."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = shape
    if layout[0] == "T":
        M += -M % 8  # A stored as [K, M]: TMA needs its rows 16-byte aligned (M still not a tile multiple)
    a, b = _operands(M, N, K, layout, dtype, "cuda")
    for cfg in (gluon_ws.configs()[-1], gluon_ws.configs()[2]):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
        assert gluon_ws.usable(p) is None and persistent_tma.describable(p) is None
        _run(p, cfg)
        assert_rel_close(out, matmul_reference(a, b), tolerance(dtype))


@pytest.mark.gpu
def test_gluon_ws_epilogue_and_many_tiles():
    """alpha, beta * C, bias, activation; several tiles per consumer warp group."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = 2048, 1536, 512
    a, b = _operands(M, N, K, "NT", torch.float16, "cuda")
    c = torch.randn(M, N, device="cuda", dtype=torch.float16)
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    for cfg in gluon_ws.configs():
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
        p = make_problems(a, b, out, c, bias, 0.5, -1.0, "gelu", "ieee", False)[0]
        _run(p, cfg)
        ref = matmul_reference(a, b, c=c, bias=bias, alpha=0.5, beta=-1.0, activation="gelu")
        assert_rel_close(out, ref, tolerance(torch.float16))


@pytest.mark.gpu
def test_launches_with_host_descriptors_replay_with_new_tensors():
    """A replay passes each host descriptor again over the new call's tensor (tilegemm.core.launch): recorded
    from one call, replayed with other operands and a poisoned output, it computes the new product."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    from tilegemm.core.launch import Replay, recording

    a, b = _operands(256, 256, 128, "NN", torch.float16, "cuda")
    out = torch.full((256, 256), float("nan"), device="cuda", dtype=torch.float16)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
    with recording() as rec:
        _run(p, gluon_ws.configs()[0])
    assert rec.launches is not None and len(rec.launches) == 1
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))
    replay = Replay(rec.launches[0], (a, b, out))
    a2, b2 = _operands(256, 256, 128, "NN", torch.float16, "cuda")
    out2 = torch.full((256, 256), float("nan"), device="cuda", dtype=torch.float16)
    assert replay(a2, b2, out2)
    torch.cuda.synchronize()
    assert_rel_close(out2, matmul_reference(a2, b2), tolerance(torch.float16))
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))  # the first output untouched
