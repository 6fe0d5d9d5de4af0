"""The Gluon kernel for promoted fp8 (``tilegemm.ops.matmul.gluon_fp8``), a candidate of ``persistent_tma``.

Gluon has no interpreter, so without a GPU the kernel is compiled for sm_90 (Triton ships ptxas) and its
code checked: the promotion waits for one step's MMAs while the next step's are in flight, and nothing
spills. On a GPU (``pytest -m gpu``) it runs against an fp64 reference.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tilegemm.ops.matmul import gluon_fp8, persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import tolerance

from conftest import SM90, assert_rel_close, compile_offline
from test_fp8_tf32 import E4M3, E5M2, dequantized_reference, fp8_operand


def _problem(a, b, out, fast_accum=False):
    return make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False, fast_accum=fast_accum)[0]


def test_ring_depths_fit_in_shared_memory():
    for ws in (False, True):
        def depths(size):
            return [c["STAGES"] for c in gluon_fp8.configs(size) if bool(c.get("WS")) == ws]

        assert depths(2) == [4, 5, 6]  # 16-bit output tile: 32 KB
        assert depths(4) == [4, 5]  # fp32 output tile: 64 KB
    # The one-partition kernel runs two warp groups; the warp-specialized one names its first consumer's.
    assert all(c["GLUON_FP8"] and c["num_warps"] == (4 if c.get("WS") else 8) for c in gluon_fp8.configs(2))


@pytest.mark.parametrize("case, reason", [
    ("nt", None), ("fast", "fast accumulation"), ("nn", "K contiguous"), ("tt", "K contiguous"),
    ("fp16", "not an fp8 problem"),
])
def test_usable_only_for_promoted_k_major_fp8(case, reason):
    dtype = torch.float16 if case == "fp16" else E4M3
    a = torch.zeros(64, 32, dtype=dtype)
    if case == "tt":
        a = torch.zeros(32, 64, dtype=dtype).T
    b = torch.zeros(48, 32, dtype=dtype).T if case in ("nt", "fast", "fp16") else torch.zeros(32, 48, dtype=dtype)
    p = _problem(a, b, torch.empty(64, 48, dtype=torch.bfloat16), fast_accum=case == "fast")
    got = gluon_fp8.why_not(p)
    assert got is None if reason is None else reason in got


# Compiles the kernel for sm_90 in a few epilogue variants and reports, per variant, the waits on MMA
# groups, the MMA instructions and what ptxas says about registers and spills.
_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    from tilegemm.ops.matmul.gluon_fp8 import matmul_fp8_overlap_kernel as kernel

    variants = json.loads(sys.argv[1])
    report = {}
    for name, v in variants.items():
        flags = dict(HAS_C=v["c"], HAS_BIAS=v["bias"], ACTIVATION=v["act"], HAS_SCALE_A=True, HAS_SCALE_B=True,
                     BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, STAGES=v["stages"], GROUP_M=8, NUM_SMS=132, num_warps=8)
        types = dict(a_ptr=v["a"], b_ptr="*fp8e4nv", out_ptr=v["out"], c_ptr="*fp32", bias_ptr="*bf16",
                     scale_a_ptr="*fp32", scale_b_ptr="*fp32")
        compiled, ptx, info = compile_sm90(kernel, *signature(kernel, flags, types), 8)
        report[name] = dict(
            waits=[int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)],
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            registers=[int(n) for n in re.findall(r"Used (\\d+) registers", info)],
            shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)

_VARIANTS = {
    "bf16": dict(a="*fp8e4nv", out="*bf16", c=False, bias=False, act="none", stages=6),
    "fp32-epilogue": dict(a="*fp8e4nv", out="*fp32", c=True, bias=True, act="gelu", stages=5),
    "e5m2-fp16": dict(a="*fp8e5", out="*fp16", c=False, bias=True, act="silu", stages=4),
}


def test_compiled_code_overlaps_the_promotion_and_does_not_spill(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=600)
    for name, r in report.items():
        # Every promotion inside the K loop waits for all but the group just issued; the last waits for all.
        assert r["waits"].count(1) >= 3, f"{name}: no overlapped waits (wait_group 1): {r['waits']}"
        assert set(r["waits"]) <= {0, 1}, f"{name}: {r['waits']}"
        # A 128x128x128 step is 4 m64n128k32 MMAs per warp group, issued at four places: the first K step,
        # two in the loop body, one for an odd step left over.
        assert r["mmas"] == 4 * 4, f"{name}: {r['mmas']} MMA instructions"
        # Without a C tile nothing spills. An fp32 C tile loaded beside the accumulator (64 elements and their
        # 64-bit addresses a thread) makes ptxas spill a little (44 bytes with Triton 3.6).
        allowed = 64 if _VARIANTS[name]["c"] else 0
        assert r["spills"] and max(r["spills"]) <= allowed, f"{name}: spills {r['spills']}"
        assert r["registers"] and max(r["registers"]) <= 255
        stages = _VARIANTS[name]["stages"]
        assert r["shared"] >= stages * 32 * 1024, f"{name}: {r['shared']} bytes of shared memory"


# The warp-specialized kernel: per partition, the MMA waits, the MMA count, setmaxnreg and spills. Its
# arguments are what launch_args gives for a problem of the variant's dtypes (host descriptors included).
_COMPILE_WS = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.ops.matmul import gluon_fp8
    from tilegemm.ops.matmul.problem import make_problems
    kernel = gluon_fp8.matmul_fp8_ws_kernel
    TYPES = {"*fp8e4nv": torch.float8_e4m3fn, "*fp8e5": torch.float8_e5m2, "*bf16": torch.bfloat16,
             "*fp16": torch.float16, "*fp32": torch.float32}

    variants = json.loads(sys.argv[1])
    report = {}
    for name, v in variants.items():
        M = N = K = 512
        a = torch.empty(M, K, dtype=TYPES[v["a"]])
        b = torch.empty(N, K, dtype=torch.float8_e4m3fn).T
        out = torch.empty(M, N, dtype=TYPES[v["out"]])
        c = torch.empty(M, N) if v["c"] else None
        bias = torch.empty(N, dtype=torch.bfloat16) if v["bias"] else None
        scales = (torch.empty(M), 1, torch.empty(()), 0)
        p = make_problems(a, b, out, c, bias, 1.0, 0.5 if v["c"] else 0.0, v["act"], "ieee", False,
                          scales=scales)[0]
        cfg = dict(GLUON_FP8=True, WS=True, STAGES=v["stages"], num_warps=4)
        got, _, args, kwargs = gluon_fp8.launch_args(p, cfg, 132)
        assert got is kernel
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, 4)
        report[name] = dict(
            waits=[int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)],
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
            setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\\.dec\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}),
            tensormaps_made=len(re.findall(r"tensormap\\.replace", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)


def test_warp_specialized_kernel_compiles_for_both_consumers_without_spills(tmp_path):
    variants = {k: v for k, v in _VARIANTS.items() if not v["c"]}  # an fp32 C tile spills a little, as above
    report = compile_offline(tmp_path, _COMPILE_WS, variants, timeout=600)
    for name, r in report.items():
        # Two consumer warp groups, each with the one-partition kernel's four places of four MMAs.
        assert r["mmas"] == 2 * 4 * 4, f"{name}: {r['mmas']} MMA instructions"
        assert r["waits"].count(1) >= 6 and set(r["waits"]) <= {0, 1}, f"{name}: {r['waits']}"
        # The consumers keep their registers (accumulator and two partials), the producer gives its up.
        assert gluon_fp8.WS_PRODUCER_REGS in r["setmaxnreg"] and gluon_fp8.WS_CONSUMER_REGS in r["setmaxnreg"]
        assert r["spills"] and max(r["spills"]) == 0, f"{name}: spills {r['spills']}"
        # The descriptors come from the host: none is made on the device (about 2 us a launch).
        assert r["tensormaps_made"] == 0, f"{name}: {r['tensormaps_made']} descriptors made on the device"
        stages = _VARIANTS[name]["stages"]
        assert r["shared"] >= stages * 32 * 1024, f"{name}: {r['shared']} bytes of shared memory"


_COMPILE_SCALES = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.ops.matmul import gluon_fp8
    from tilegemm.ops.matmul.problem import make_problems

    report = {}
    n = 512
    for kind in ("tensor", "row_col"):
        a = torch.empty(n, n, dtype=torch.float8_e4m3fn)
        b = torch.empty(n, n, dtype=torch.float8_e4m3fn).T
        out = torch.empty(n, n, dtype=torch.bfloat16)
        scales = (torch.empty(()), 0, torch.empty(()), 0) if kind == "tensor" else \\
            (torch.empty(n), 1, torch.empty(n), 1)
        p = make_problems(a, b, out, None, None, 0.5, 0.0, "none", "ieee", False, scales=scales)[0]
        for ws in (False, True):
            cfg = [c for c in gluon_fp8.configs(2) if bool(c.get("WS")) == ws][0]
            kernel, _, args, kwargs = gluon_fp8.launch_args(p, cfg, 132)
            sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
            compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, cfg["num_warps"])
            report[f"{kind}-{'ws' if ws else 'one'}"] = dict(
                loads=len(re.findall(r"ld\\.global", ptx)), scalar=[kwargs["SCALAR_A"], kwargs["SCALAR_B"]],
                spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)])
    print(json.dumps(report))
    """
)


def test_per_tensor_scales_are_loaded_once_not_in_every_epilogue(tmp_path):
    """A per-tensor scale is one number: the kernels fold it into alpha once per program (each consumer
    warp group loads the two scalars), where vector scales are loaded in every tile's epilogue."""
    r = compile_offline(tmp_path, _COMPILE_SCALES, {}, timeout=600)
    for kernel, consumers in (("one", 1), ("ws", 2)):
        tensor, row_col = r[f"tensor-{kernel}"], r[f"row_col-{kernel}"]
        assert tensor["scalar"] == [True, True] and row_col["scalar"] == [False, False]
        assert tensor["loads"] == 2 * consumers, f"{kernel}: {tensor['loads']} global loads"
        assert row_col["loads"] > 8 * tensor["loads"], f"{kernel}: {row_col['loads']} global loads"
        assert max(tensor["spills"] + row_col["spills"]) == 0


# --- on a GPU ---------------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 128, 128), (257, 264, 400), (300, 136, 256), (1000, 520, 384),
                                   (17, 1040, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("ws", [False, True], ids=["one-partition", "ws"])
def test_gluon_fp8_matches_the_reference(shape, stages, ws):
    """Odd M and N (edge tiles), K of 1..16 steps, odd and even step counts, a K that is not a step multiple."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = shape
    a = fp8_operand(M, K, False, E4M3, "cuda")
    b = fp8_operand(K, N, True, E4M3, "cuda")
    scale_a, scale_b = torch.rand(M, device="cuda") + 0.5, torch.tensor(0.75, device="cuda")
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False,
                      scales=(scale_a, 1, scale_b, 0))[0]
    assert persistent_tma.why_not(p) is None and gluon_fp8.why_not(p) is None
    cfg = dict(GLUON_FP8=True, WS=True, STAGES=stages, num_warps=4) if ws else \
        dict(GLUON_FP8=True, STAGES=stages, num_warps=8)
    assert cfg in gluon_fp8.configs(2)
    persistent_tma.run(p, cfg)
    assert_rel_close(out, dequantized_reference(a, b, scale_a, scale_b), tolerance(E4M3, out_dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ws", [False, True], ids=["one-partition", "ws"])
def test_gluon_fp8_epilogue(out_dtype, ws):
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = 200, 152, 640
    a = fp8_operand(M, K, False, E5M2, "cuda")
    b = fp8_operand(K, N, True, E4M3, "cuda")
    scale_a, scale_b = torch.rand(M, device="cuda") + 0.5, torch.rand(N, device="cuda") + 0.5
    c = torch.randn(M, N, device="cuda")
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
    p = make_problems(a, b, out, c, bias, 0.5, -1.0, "gelu", "ieee", False, scales=(scale_a, 1, scale_b, 1))[0]
    persistent_tma.run(p, [c for c in gluon_fp8.configs(out.element_size()) if bool(c.get("WS")) == ws][-1])
    ref = dequantized_reference(a, b, scale_a, scale_b, c=c, bias=bias, alpha=0.5, beta=-1.0, activation="gelu")
    assert_rel_close(out, ref, tolerance(E4M3, out_dtype=out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [False, True], ids=["one-partition", "ws"])
def test_gluon_fp8_per_tensor_scales_fold_into_alpha(ws):
    """Both scales per tensor (folded into alpha in the kernel), alpha != 1, C, bias and an activation."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = 300, 264, 1000
    a = fp8_operand(M, K, False, E4M3, "cuda")
    b = fp8_operand(K, N, True, E5M2, "cuda")
    scale_a, scale_b = torch.tensor(1.5, device="cuda"), torch.tensor(0.75, device="cuda")
    c = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    p = make_problems(a, b, out, c, bias, 0.5, 2.0, "relu", "ieee", False, scales=(scale_a, 0, scale_b, 0))[0]
    persistent_tma.run(p, [c for c in gluon_fp8.configs(out.element_size()) if bool(c.get("WS")) == ws][0])
    ref = dequantized_reference(a, b, scale_a, scale_b, c=c, bias=bias, alpha=0.5, beta=2.0, activation="relu")
    assert_rel_close(out, ref, tolerance(E4M3, out_dtype=torch.bfloat16))


@pytest.mark.gpu
def test_persistent_tma_times_the_gluon_kernel_for_promoted_nt_fp8():
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    a = fp8_operand(256, 512, False, E4M3, "cuda")
    b_nt = fp8_operand(512, 384, True, E4M3, "cuda")
    b_nn = fp8_operand(512, 384, False, E4M3, "cuda")
    out = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
    assert any(c.get("GLUON_FP8") for c in persistent_tma.candidates(_problem(a, b_nt, out)))
    assert not any(c.get("GLUON_FP8") for c in persistent_tma.candidates(_problem(a, b_nn, out)))
    assert not any(c.get("GLUON_FP8") for c in persistent_tma.candidates(_problem(a, b_nt, out, fast_accum=True)))
