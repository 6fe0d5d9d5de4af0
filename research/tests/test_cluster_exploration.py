"""The two-CTA cluster kernels with TMA multicast (``research/cluster_f16.py``, A shared;
``research/cluster_fp8.py``, promoted fp8 with B shared), exploration kernels.

No rung launches them (the 16-bit one ran even with the same kernel without clusters, the fp8 one slower;
docs/rungs/persistent_tma.md), but ``research/explore_cluster.py`` and ``research/explore_cluster_fp8.py``
time them, and they are the one place that writes the multicast copy, the cross-CTA release and the
cluster launch that Triton 3.6 lacks, so they are kept compiling and correct here:
without a GPU they are compiled for sm_90 and their PTX checked (the shared-memory offsets they rely on
included); on a GPU (``pytest -m gpu``) they run against an fp64 reference.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest
import torch

from conftest import SM90, assert_rel_close, compile_offline

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent  # research/

_COMPILE = SM90 + textwrap.dedent(
    f"""
    import json, re, sys
    import torch
    from triton.runtime.jit import mangle_type
    sys.path.insert(0, {str(SCRIPTS)!r})
    import cluster_f16 as cf
    from tilegemm.ops.matmul.gluon_f16 import host_descriptor

    kernel = cf.matmul_f16_cluster_kernel
    report = {{}}
    for name, v in json.loads(sys.argv[1]).items():
        cfg = dict(BLOCK_M=v["bm"], BLOCK_N=v["bn"], STAGES=v["stages"], SHARED_OUT=v["shared_out"])
        flags = dict(A_OFF=cf._a_offset(cfg), B_T=v["b_t"], HAS_C=False, HAS_BIAS=False, ACTIVATION="none",
                     BLOCK_M=v["bm"], BLOCK_N=v["bn"], BLOCK_K=cf.BLOCK_K, STAGES=v["stages"], GROUP_M=8,
                     SHARED_OUT=v["shared_out"], MCAST=v["mcast"], REMOTE=v["mcast"], SCOPE="cta",
                     A_GLUON=False, CONSUMER_REGS=232, PRODUCER_REGS=40, num_warps=4)
        sig, constexprs, attrs = signature(kernel, flags, "*fp16")
        sig["a_half_desc"] = "*u8"
        # B and the output arrive as host-made descriptors (typed as Triton types them).
        n = 512
        b = torch.empty(n, n, dtype=torch.float16)
        block_b = [v["bn"], cf.BLOCK_K] if v["b_t"] else [cf.BLOCK_K, v["bn"]]
        sig["b_desc"] = mangle_type(host_descriptor(b, [n, n], n, block_b))
        sig["o_desc"] = mangle_type(host_descriptor(b, [n, n], n, [v["bm"] // 2, v["bn"]]))
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, 4)
        llir = compiled.asm["llir"]
        ready, empty = cf._offsets(llir, 4 if v["mcast"] else 2)
        report[name] = dict(
            multicast=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.2d\\.shared::cluster\\.global\\.mbarrier::"
                                     r"complete_tx::bytes\\.multicast::cluster", ptx)),
            remote_arrives=len(re.findall(r"mbarrier\\.arrive\\.shared::cluster\\.b64", ptx)),
            cluster_arrives=len(re.findall(r"barrier\\.cluster\\.arrive\\.release;", ptx)),
            smem_base=len(re.findall(r"mov\\.u32 %r\\d+, global_smem;", ptx)),
            a_off=flags["A_OFF"], a_off_in_llir=f"@global_smem, i32 {{flags['A_OFF']}})" in llir,
            ready=ready, empty=empty,
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)

_VARIANTS = {
    "nn-256x128-s4-multicast": dict(bm=256, bn=128, stages=4, shared_out=True, b_t=False, mcast=True),
    "nt-128x256-s3-multicast": dict(bm=128, bn=256, stages=3, shared_out=False, b_t=True, mcast=True),
    "nn-128x256-s4-own": dict(bm=128, bn=256, stages=4, shared_out=True, b_t=False, mcast=False),
    "nn-128x64-s8-multicast": dict(bm=128, bn=64, stages=8, shared_out=False, b_t=False, mcast=True),
}


def test_cluster_kernel_compiles_with_multicast(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=600)
    for name, r in report.items():
        v = _VARIANTS[name]
        ring = v["stages"] * (v["bm"] + v["bn"]) * 64 * 2
        if v["mcast"]:
            assert r["multicast"] == 1, f"{name}: {r['multicast']} multicast copies"
            # Each consumer warp group releases a slot in both CTAs, in the K loop and after it.
            assert r["remote_arrives"] == 2 * 2 * 2, f"{name}: {r['remote_arrives']}"
        else:
            assert r["multicast"] == 0 and r["remote_arrives"] == 0, f"{name}: {r}"
        # A cluster barrier at the start and the end of each of the three partitions.
        assert r["cluster_arrives"] == 6, f"{name}: {r['cluster_arrives']}"
        assert r["smem_base"] >= 1
        # The offsets the host derives: A's ring where the allocator put it, the barriers past every buffer.
        assert r["a_off"] == 0 or r["a_off_in_llir"], f"{name}: A's ring is not at {r['a_off']}"
        assert ring <= r["ready"] < r["empty"] < r["shared"], f"{name}: {r}"
        assert r["empty"] - r["ready"] >= 8 * v["stages"]
        assert r["spills"] and max(r["spills"]) == 0, f"{name}: spills {r['spills']}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["mc", "own"])
@pytest.mark.parametrize("b_t", [False, True], ids=["NN", "NT"])
@pytest.mark.parametrize("shape", [(256, 512, 64), (1000, 520, 384), (17, 1040, 2048), (264, 1032, 408)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cluster_kernel_matches_the_reference(shape, b_t, mode):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the cluster kernel is written for sm_90")
    sys.path.insert(0, str(SCRIPTS))
    import cluster_f16
    from explore_cluster import CONFIGS, MODES

    from tilegemm.ops.matmul import persistent_tma

    persistent_tma.ensure_allocator()
    M, N, K = shape
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(N, K, device="cuda", dtype=torch.float16).T if b_t else \
        torch.randn(K, N, device="cuda", dtype=torch.float16)
    ref = a.double() @ b.double()
    for cfg in CONFIGS.values():
        for clusters in (66, 3):  # one pair per cluster or fewer; several pairs per cluster
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
            fn, _ = cluster_f16.prepare(a, b, out, cfg, clusters, **MODES[mode])
            fn()
            torch.cuda.synchronize()
            assert_rel_close(out, ref, 1e-2)


# --- the promoted-fp8 cluster kernel (research/cluster_fp8.py): B shared by multicast ------------------------

_COMPILE_FP8 = SM90 + textwrap.dedent(
    f"""
    import json, re, sys
    sys.path.insert(0, {str(SCRIPTS)!r})
    import cluster_fp8 as cf

    kernel = cf.matmul_fp8_cluster_kernel
    report = {{}}
    for name, v in json.loads(sys.argv[1]).items():
        flags = dict(HAS_C=False, HAS_BIAS=False, ACTIVATION="none", HAS_SCALE_A=True, HAS_SCALE_B=True,
                     STAGES=v["stages"], GROUP_M=4, MCAST=v["mcast"], REMOTE=v["remote"],
                     SPLIT=v.get("split", False), FORWARD=v.get("forward", False), CONSUMER_REGS=232,
                     PRODUCER_REGS=40, num_warps=4)
        types = dict(a_ptr=v["a"], b_ptr="*fp8e4nv", out_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16",
                     scale_a_ptr="*fp32", scale_b_ptr="*fp32")
        sig, constexprs, attrs = signature(kernel, flags, types)
        sig["b_half_desc"] = "*u8"
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, 4)
        llir = compiled.asm["llir"]
        ready, empty = cf._offsets(llir, 4 if v["remote"] else 2)
        gate = cf._gate_offset(llir, v["stages"])
        report[name] = dict(
            multicast=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.2d\\.shared::cluster\\.global\\.mbarrier::"
                                     r"complete_tx::bytes\\.multicast::cluster", ptx)),
            remote_arrives=len(re.findall(r"mbarrier\\.arrive\\.shared::cluster\\.b64", ptx)),
            local_asm_arrives=len(re.findall(r"mbarrier\\.arrive\\.shared::cta\\.b64 _, \\[%r", ptx)),
            cluster_arrives=len(re.findall(r"barrier\\.cluster\\.arrive\\.release;", ptx)),
            o_after_ring=f"@global_smem, i32 {{v['stages'] * cf.SLOT.value}})" in llir,
            ready=ready, empty=empty, gate=gate,
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)

_VARIANTS_FP8 = {
    "s6-multicast": dict(stages=6, mcast=True, remote=True, a="*fp8e4nv"),
    "s5-own-e5m2": dict(stages=5, mcast=False, remote=False, a="*fp8e5"),  # A e5m2, B e4m3: one ring
    "s6-multicast-split": dict(stages=6, mcast=True, remote=True, split=True, a="*fp8e4nv"),
    "s6-multicast-forward": dict(stages=6, mcast=True, remote=False, forward=True, a="*fp8e4nv"),
}


def test_fp8_cluster_kernel_compiles_with_multicast(tmp_path):
    report = compile_offline(tmp_path, _COMPILE_FP8, _VARIANTS_FP8, timeout=600)
    for name, r in report.items():
        v = _VARIANTS_FP8[name]
        if v["mcast"]:
            assert r["multicast"] == 1, f"{name}: {r['multicast']} multicast copies"
            # Each consumer warp group releases a slot in both CTAs at four places (two in the K loop, the
            # odd step's two, the even case's one: 2 + 2 + 1), to two CTAs: 5 x 2 x 2.
            # Split: one of the two is a local arrive. Forward: the producer's pair, once, and the consumers'
            # five local arrives each (Gluon's, which read the same in PTX).
            want = (1, 11) if v.get("forward") else (10, 10) if v.get("split") else (20, 0)
            assert (r["remote_arrives"], r["local_asm_arrives"]) == want, f"{name}: {r}"
        else:
            assert r["multicast"] == 0 and r["remote_arrives"] == 0, f"{name}: {r}"
        assert r["cluster_arrives"] == 6, f"{name}: {r['cluster_arrives']}"
        # The ring (A and B^T of each slot, one buffer) at 0, the output buffers right after it, the
        # barriers past both.
        assert r["o_after_ring"], f"{name}: the output buffers are not right after the ring"
        ring = v["stages"] * 2 * 128 * 128
        assert ring + 2 * 64 * 128 * 2 <= r["ready"] < r["empty"] < r["shared"], f"{name}: {r}"
        assert ring + 2 * 64 * 128 * 2 <= r["gate"] < r["shared"] and r["gate"] not in (r["ready"], r["empty"])
        assert r["spills"] and max(r["spills"]) == 0, f"{name}: spills {r['spills']}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["mc", "mc_sp", "nomc", "own", "fwd"])
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(300, 136, 256), (1000, 520, 384), (17, 1040, 2048), (257, 264, 400)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_cluster_kernel_matches_the_reference(shape, a_dtype, mode):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the cluster kernel is written for sm_90")
    sys.path.insert(0, str(SCRIPTS))
    import cluster_fp8
    from explore_cluster_fp8 import MODES

    from tilegemm.ops.matmul import persistent_tma

    persistent_tma.ensure_allocator()
    M, N, K = shape
    a = (torch.randn(M, K, device="cuda") * 2).to(a_dtype)
    w = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
    sa = torch.tensor(0.75, device="cuda")
    sb = torch.tensor(1.25, device="cuda")
    ref = (a.double() @ w.double().T) * (0.75 * 1.25)
    for clusters in (66, 3):  # one pair per cluster or fewer; several pairs per cluster
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        fn, _ = cluster_fp8.prepare(a, w.T, out, 6, clusters, scale_a=sa, scale_b=sb, **MODES[mode])
        fn()
        torch.cuda.synchronize()
        assert_rel_close(out, ref, 1e-2)
