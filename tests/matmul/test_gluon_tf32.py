"""The Gluon kernel for tf32 with A and B row-major (``tilegemm.ops.matmul.gluon_tf32``), a candidate of
``persistent_tma``.

Without a GPU the kernel is compiled for sm_90 and its PTX checked for the hazard it exists to avoid: no
instruction writes a register that an MMA still in flight reads as its A fragment. The same check run on
``persistent_tma``'s Triton loop, unflattened, finds the hazard (that loop gave wrong tiles on an H200),
so the check can fail. On a GPU (``pytest -m gpu``) every tile of the results is compared with an fp64
reference.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tilegemm.core.checks import worst_tile_error
from tilegemm.ops.matmul import gluon_tf32, persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import SM90, compile_offline


def _problem(a, b, out, c=None, bias=None, alpha=1.0, beta=0.0, activation="none", precision="tf32"):
    return make_problems(a, b, out, c, bias, alpha, beta, activation, precision, False)[0]


def test_ring_depths_fit_in_shared_memory():
    cfgs = gluon_tf32.configs()
    assert [c["STAGES"] for c in cfgs] == [3, 4]  # 48 KB a stage; the output needs no shared memory
    assert all(c[gluon_tf32.CONFIG_KEY] and c["num_warps"] == 8 for c in cfgs)
    assert gluon_tf32.configs(2) == cfgs


@pytest.mark.parametrize("case, reason", [
    ("nn", None), ("tt", None), ("nt", "(NN) or both column-major (TT)"), ("tn", "(NN) or both column-major"),
    ("ieee", "not a tf32 problem"), ("fp16", "not a tf32 problem"), ("out_cm", "row-major output"),
])
def test_usable_only_for_tf32_nn_and_tt(case, reason):
    dtype = torch.float16 if case == "fp16" else torch.float32
    a = torch.zeros(32, 64, dtype=dtype).T if case in ("tn", "tt") else torch.zeros(64, 32, dtype=dtype)
    b = torch.zeros(48, 32, dtype=dtype).T if case in ("nt", "tt") else torch.zeros(32, 48, dtype=dtype)
    out = torch.empty(48, 64, dtype=dtype).T if case == "out_cm" else torch.empty(64, 48, dtype=dtype)
    p = _problem(a, b, out, precision="ieee" if case == "ieee" else "tf32")
    got = gluon_tf32.why_not(p)
    assert got is None if reason is None else reason in got


def test_persistent_tma_offers_it_only_for_tf32_nn_and_tt_on_sm90(monkeypatch):
    # The real gluon_kernel_for answers None off an sm_90 GPU; pretend to be one.
    monkeypatch.setattr(persistent_tma, "interpreting", lambda: False)
    monkeypatch.setattr("tilegemm.core.hardware.interpreting", lambda: False)
    monkeypatch.setattr("tilegemm.core.hardware.compute_capability", lambda: (9, 0))
    a, b = torch.zeros(256, 64), torch.zeros(64, 128)
    out = torch.empty(256, 128)
    nn = persistent_tma.candidates(_problem(a, b, out))
    assert [c for c in nn if c.get("GLUON_TF32")] == gluon_tf32.configs()
    a_cm, b_cm = a.T.contiguous().T, b.T.contiguous().T
    assert [c for c in persistent_tma.candidates(_problem(a_cm, b_cm, out)) if c.get("GLUON_TF32")]
    assert not any(c.get("GLUON_TF32") for c in persistent_tma.candidates(_problem(a, b_cm, out)))
    assert not any(c.get("GLUON_TF32") for c in persistent_tma.candidates(_problem(a, b, out, precision="ieee")))
    monkeypatch.setattr("tilegemm.core.hardware.compute_capability", lambda: (10, 0))
    assert not any(c.get("GLUON_TF32") for c in persistent_tma.candidates(_problem(a, b, out)))


# Compiles the Gluon kernel (three variants) and persistent_tma's Triton kernel for tf32 NN with the tile
# loop unflattened, and looks in each PTX for writes to an in-flight MMA's A registers: walking the code
# (each loop body twice, so a write at the top of the next iteration counts), an MMA's A registers are in
# flight from its commit until a `wgmma.wait_group N` leaves fewer than its group's age in flight.
_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    from tilegemm.ops.matmul.gluon_tf32 import matmul_tf32_regs_kernel as gluon_kernel
    from tilegemm.ops.matmul.persistent_tma import matmul_persistent_tma_kernel as triton_kernel

    def code_lines(ptx):
        lines = (re.sub(r"\\s*//.*", "", l).strip() for l in ptx.split(".section")[0].splitlines())
        return [l for l in lines if l and not l.startswith((".loc", ".file"))]

    def unrolled(lines):
        # Each backward branch's loop body appended once more after the branch.
        labels = {l[:-1]: i for i, l in enumerate(lines) if re.match(r"^\\$L__BB\\w+:$", l)}
        out = []
        for i, l in enumerate(lines):
            out.append(l)
            m = re.search(r"bra(?:\\.uni)?\\s+(\\$L__BB\\w+);", l)
            if m and labels.get(m.group(1), i + 1) < i:
                out.extend(lines[labels[m.group(1)] + 1:i + 1])
        return out

    def a_register_hazards(ptx):
        groups, pending, hazards = [], [], []
        mmas = sum(l.startswith("wgmma.mma_async") for l in code_lines(ptx))
        for l in unrolled(code_lines(ptx)):
            if l.startswith("wgmma.mma_async"):
                m = re.search(r"\\}, \\{([^}]*)\\}", l)
                if m:
                    pending.extend(r.strip() for r in m.group(1).split(","))
            elif l.startswith("wgmma.commit_group"):
                groups.append(set(pending))
                pending = []
            elif l.startswith("wgmma.wait_group"):
                n = int(re.search(r"(\\d+)\\s*;", l).group(1))
                groups = groups[len(groups) - n:] if n else []
            elif not l.startswith(("st.", "bar.", "wgmma", "@", "mbarrier", "fence", "cp.", "ret", "bra")):
                head = l.split(None, 1)
                if len(head) == 2:
                    dest = head[1].split("}", 1)[0] if head[1].startswith("{") else head[1].split(",", 1)[0]
                    written = set(re.findall(r"%r\\d+", dest))
                    if any(written & g for g in groups):
                        hazards.append(l[:80])
        return hazards, mmas

    def compile_gluon(stages, c, bias, act, out, swapped):
        flags = dict(SWAPPED=swapped, HAS_C=c, HAS_BIAS=bias, ACTIVATION=act, BLOCK_R=128, BLOCK_S=256,
                     BLOCK_K=32, STAGES=stages, GROUP_M=8, NUM_SMS=132, num_warps=8)
        types = dict(y_ptr="*fp32", x_ptr="*fp32", out_ptr=out, c_ptr="*fp32", bias_ptr="*fp32")
        return compile_sm90(gluon_kernel, *signature(gluon_kernel, flags, types), 8)

    def compile_triton_unflattened():
        flags = dict(HAS_C=False, HAS_BIAS=False, ACTIVATION="none", INPUT_PRECISION="tf32", HAS_SCALE_A=False,
                     HAS_SCALE_B=False, MMA_OPERANDS="swap", FAST_ACCUM=False, A_T=False, B_T=False, NUM_SMS=132,
                     BLOCK_M=256, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, FLATTEN=False, WARP_SPECIALIZE=0,
                     HOST_DESC=False, SERPENTINE=False, SPLIT=False, BATCHED=False, A_BATCHED=False,
                     B_BATCHED=False)  # (the control that showed the hazard; descriptors do not matter to it)
        sig = signature(triton_kernel, flags, "*fp32", unit=("stride_cn", "SPLIT_K"), aligned_ints=True)
        return compile_sm90(triton_kernel, *sig, 8, num_stages=3, gluon=False)[1]

    report = {}
    for name, (stages, c, bias, act, out, swapped) in json.loads(sys.argv[1]).items():
        compiled, ptx, info = compile_gluon(stages, c, bias, act, out, swapped)
        hazards, mmas = a_register_hazards(ptx)
        report[name] = dict(
            hazards=hazards, mmas=mmas,
            waits=[int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)],
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            registers=[int(n) for n in re.findall(r"Used (\\d+) registers", info)],
            shared=compiled.metadata.shared,
        )
    hazards, mmas = a_register_hazards(compile_triton_unflattened())
    report["triton-unflattened"] = dict(hazards=hazards, mmas=mmas)
    print(json.dumps(report))
    """
)

_VARIANTS = {  # (stages, C, bias, activation, output type, swapped: NN rather than TT)
    "plain": (4, False, False, "none", "*fp32", True),
    "epilogue": (3, True, True, "gelu", "*fp32", True),
    "bf16-out": (4, False, True, "relu", "*bf16", True),
    "tt": (4, False, True, "none", "*fp32", False),
}


def test_no_mma_has_its_a_registers_rewritten_in_flight(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=600)
    control = report.pop("triton-unflattened")
    assert control["mmas"] > 0 and control["hazards"], "the check should find the hazard in Triton's loop"
    for name, r in report.items():
        assert r["hazards"] == [], f"{name}: writes to an in-flight MMA's A registers: {r['hazards'][:3]}"
        # Four m64n256k8 MMAs a K step, issued at four places (first step, the two of the loop, one left over).
        assert r["mmas"] == 16, f"{name}: {r['mmas']} MMA instructions"
        assert set(r["waits"]) <= {0, 1} and r["waits"].count(1) >= 3, f"{name}: {r['waits']}"
        # Without a C tile nothing spills, but for a TT bias: a thread holds 64 of the tile's columns there, so
        # 64 bias values beside the accumulator (60 bytes spilled, Triton 3.6). Loading C beside the
        # accumulator spills more (1.4 KB NN).
        stages, c, bias, _, _, swapped = _VARIANTS[name]
        allowed = 2048 if c else 128 if bias and not swapped else 0
        assert r["spills"] and max(r["spills"]) <= allowed, f"{name}: spills {r['spills']}"
        assert r["shared"] >= stages * 48 * 1024


# --- on a GPU ---------------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _worst_tile_error(out, ref):
    return worst_tile_error(out, ref, 256, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 128, 32), (1000, 776, 520), (1008, 784, 528), (300, 4100, 1000),
                                   (17, 4100, 64), (2048, 2048, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_gluon_tf32_every_tile_matches_the_reference(shape, stages, layout):
    """Edge tiles in M and N, K of 1..64 steps (odd and even counts, a K not a step multiple), three runs
    into a NaN-poisoned output, every tile checked on its own."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = shape
    if layout == "TT":
        M += -M % 4  # A^T's rows (M elements) must be 16-byte aligned for TMA
        a, b = torch.randn(K, M, device="cuda").T, torch.randn(N, K, device="cuda").T
    else:
        a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    ref = matmul_reference(a, b)
    for _ in range(3):
        out = torch.full((M, N), float("nan"), device="cuda")
        p = _problem(a, b, out)
        assert persistent_tma.why_not(p) is None and gluon_tf32.why_not(p) is None
        persistent_tma.run(p, dict(GLUON_TF32=True, STAGES=stages, num_warps=8))
        torch.cuda.synchronize()
        assert _worst_tile_error(out, ref) <= tolerance(torch.float32, "tf32")


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_gluon_tf32_epilogue_and_views(out_dtype, layout):
    """alpha, beta * C (a transposed view), bias, GELU, a 16-bit output; A a slice of a wider matrix."""
    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    M, N, K = 520, 392, 300
    if layout == "TT":  # A^T a slice of a wider [K, M + 36] matrix, B^T a plain [N, K]
        a = torch.randn(K, M + 36, device="cuda")[:, 4:M + 4].T
        b = torch.randn(N, K, device="cuda").T
    else:
        a = torch.randn(M, K + 36, device="cuda")[:, 4:K + 4]  # row stride K + 36: still 16-byte aligned
        b = torch.randn(K, N, device="cuda")
    c = torch.randn(N, M, device="cuda").T
    bias = torch.randn(N, device="cuda")
    out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
    p = _problem(a, b, out, c=c, bias=bias, alpha=0.5, beta=-1.0, activation="gelu")
    assert persistent_tma.why_not(p) is None and gluon_tf32.why_not(p) is None
    persistent_tma.run(p, gluon_tf32.configs()[0])
    ref = matmul_reference(a, b, c=c, bias=bias, alpha=0.5, beta=-1.0, activation="gelu")
    assert _worst_tile_error(out, ref) <= tolerance(torch.float32, "tf32", out_dtype)


@pytest.mark.gpu
def test_matmul_picks_among_candidates_with_the_gluon_kernel():
    """Through the public op: persistent_tma tunes over its candidates (Gluon included) and is right."""
    import tilegemm

    if not _hopper():
        pytest.skip("the Gluon kernel is written for sm_90")
    a, b = torch.randn(1536, 768, device="cuda"), torch.randn(768, 1152, device="cuda")
    for x, y in ((a, b), (a.T.contiguous().T, b.T.contiguous().T)):  # NN, TT
        got = tilegemm.matmul(x, y, kernel="persistent_tma", precision="tf32")
        assert _worst_tile_error(got, matmul_reference(x, y)) <= tolerance(torch.float32, "tf32")
        auto = tilegemm.matmul(x, y, precision="tf32")
        assert _worst_tile_error(auto, matmul_reference(x, y)) <= tolerance(torch.float32, "tf32")
