"""persistent_tma's sm_90 code, compiled without a GPU: no candidate config has its wgmma serialized.

With an operand passed through registers (tf32 or fp8 with B not K-major: ``"swap"``; A not K-major:
``"reg_a"``) and the tile loop flattened into the K loop, ptxas serializes every wgmma of the K loop
(its info C7515), which cost tf32 NN a third of its speed on the H200. :func:`persistent_tma.configs`
leaves those loops unflattened; this checks what ptxas says about each candidate.
"""

from __future__ import annotations

import textwrap

import pytest

from tilegemm.ops.matmul import persistent_tma

from conftest import compile_offline


def test_register_operand_configs_are_not_flattened():
    # (Under the interpreter configs() gives one small config; hopper_configs() is the GPU's list.)
    for size in (1, 4):
        for mode in ("swap", "reg_a"):
            for cfg in persistent_tma.hopper_configs(size, mode):
                assert cfg["FLATTEN"] is False, (size, mode, cfg)
        as_loaded = persistent_tma.hopper_configs(size, "ab")
        assert any(cfg["FLATTEN"] for cfg in as_loaded), "the flattened tile loop stays where it is harmless"


_COMPILE = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tilegemm.ops.matmul import persistent_tma
    from tilegemm.ops.matmul.persistent_tma import matmul_persistent_tma_kernel as kernel

    PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    UNIT = ("stride_cn",)

    def ptxas_info(mode, a_t, b_t, cfg):
        flags = dict(HAS_C=False, HAS_BIAS=True, ACTIVATION="none", INPUT_PRECISION="tf32", HAS_SCALE_A=False,
                     HAS_SCALE_B=False, MMA_OPERANDS=mode, FAST_ACCUM=False, A_T=a_t, B_T=b_t, NUM_SMS=132,
                     **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")})
        sig, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name.endswith("_ptr"):
                sig[name] = "*fp32"
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in flags:
                sig[name], constexprs[(i,)] = "constexpr", flags[name]
            elif name in UNIT:
                sig[name], constexprs[(i,)] = "constexpr", 1
            elif name in ("alpha", "beta"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(compiled.asm["ptx"])
            run = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stderr

    out = {}
    # tf32 NN (swap) and TT (A through registers): every candidate, and one flattened config as a control.
    for mode, a_t, b_t in (("swap", False, False), ("reg_a", True, True)):
        cands = persistent_tma.configs(4, mode)
        control = dict(cands[0], FLATTEN=True, WARP_SPECIALIZE=0)
        for i, cfg in enumerate(cands + [control]):
            name = f"{mode}/{'control' if i == len(cands) else i}"
            out[name] = dict(cfg=cfg, serialized="C7515" in ptxas_info(mode, a_t, b_t, cfg))
    print(json.dumps(out))
    """
)


def test_no_candidate_serializes_its_mmas(tmp_path):
    results = compile_offline(tmp_path, _COMPILE, None, timeout=600)
    controls = {k: v for k, v in results.items() if k.endswith("control")}
    assert len(controls) == 2 and len(results) > 2 * 5
    for name, r in controls.items():
        # The check can see a serialized loop: the flattened loop of the same tile has one.
        assert r["serialized"], f"{name}: expected ptxas to serialize the flattened loop ({r['cfg']})"
    for name, r in results.items():
        if name not in controls:
            assert not r["serialized"], f"{name}: ptxas serialized the wgmma of {r['cfg']}"


def test_shipped_register_operand_entries_are_not_flattened():
    """The shipped tuned configs follow the same rule (an entry is launched as it is, not re-checked)."""
    import json
    from pathlib import Path

    import tilegemm

    checked = 0
    for path in (Path(tilegemm.__file__).parent / "tuned").glob("*.json"):
        for key, cfg in json.loads(path.read_text())["entries"].items():
            rung, _, _, _, dtype, _, layout = key.split("|")
            if rung != "persistent_tma" or cfg.get("GLUON_FP8") or dtype not in ("tf32", "float8_e4m3fn", "float8_e5m2"):
                continue
            # B row-major (layout ?N) is not K-major: swapped; A column-major with B K-major (TT): A in registers.
            through_registers = layout[1] == "N" or layout == "TT"
            if through_registers:
                assert cfg["FLATTEN"] is False, f"{path.name}: {key} {cfg}"
                checked += 1
    assert checked >= 5, "the H200 file ships tf32 NN entries"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "TN", "TT"])
def test_every_register_operand_candidate_is_right_on_the_gpu(layout):
    """Each unflattened tf32 candidate (operands swapped, or A through registers), forced, on odd shapes
    with a bias and C, into a NaN-poisoned output: several tiles per program, ragged edges."""
    import torch

    from tilegemm.ops.matmul.problem import make_problems
    from tilegemm.ops.matmul.reference import matmul_reference, tolerance

    from conftest import assert_rel_close

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("needs a Hopper GPU")
    M, N, K = 1000, 776, 520
    a = torch.randn(K, M, device="cuda").mT if layout[0] == "T" else torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").mT if layout[1] == "T" else torch.randn(K, N, device="cuda")
    c = torch.randn(M, N, device="cuda")
    bias = torch.randn(N, device="cuda")
    ref = matmul_reference(a, b, c=c, bias=bias, alpha=1.5, beta=0.5)
    p0 = make_problems(a, b, torch.empty(M, N, device="cuda"), c, bias, 1.5, 0.5, "none", "tf32", False)[0]
    assert p0.mma_operands != "ab"
    cands = persistent_tma.configs(4, p0.mma_operands)
    assert cands and all(cfg["FLATTEN"] is False for cfg in cands)
    for cfg in cands:
        out = torch.full((M, N), float("nan"), device="cuda")
        p = make_problems(a, b, out, c, bias, 1.5, 0.5, "none", "tf32", False)[0]
        persistent_tma.run(p, cfg)
        torch.cuda.synchronize()
        assert_rel_close(out, ref, tolerance(torch.float32, "tf32"))
