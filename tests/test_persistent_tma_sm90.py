"""persistent_tma with an operand through registers: which loops its candidates get, what ptxas does with
them, and whether every candidate computes the right tiles on a GPU.

tf32 (and fp8) operands must be K-major in shared memory, so with B row-major (NN, TN) the kernel swaps
the operands and takes B^T through registers, and with only A column-major (TT) it takes A through
registers. There ptxas serializes every wgmma of a loop whose tile loop is flattened into the K loop (its
info C7515). Unflattened loops are not serialized and ran up to 1.5x faster, but on the H200 they gave
wrong tiles (all of them for some TT configs, now and then for NN; scripts/diagnose_register_operand.py),
so :func:`persistent_tma.configs` keeps these loops flattened: slower, and right.
"""

from __future__ import annotations

import textwrap

import pytest

from tilegemm.checks import worst_tile_error
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
    from tilegemm.ops.matmul import persistent_tma
    from tilegemm.ops.matmul.persistent_tma import matmul_persistent_tma_kernel as kernel

    def ptxas_info(mode, a_t, b_t, cfg):
        flags = dict(HAS_C=False, HAS_BIAS=True, ACTIVATION="none", INPUT_PRECISION="tf32", HAS_SCALE_A=False,
                     HAS_SCALE_B=False, MMA_OPERANDS=mode, FAST_ACCUM=False, A_T=a_t, B_T=b_t, NUM_SMS=132,
                     **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")})
        sig = signature(kernel, flags, "*fp32", unit=("stride_cn",), aligned_ints=True)
        return compile_sm90(kernel, *sig, cfg["num_warps"], num_stages=cfg["num_stages"], gluon=False)[2]

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
    again, and check the unflattened ones for wrong tiles with scripts/diagnose_register_operand.py.)"""
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
# Ragged against every tile, yet 16-byte aligned rows even for fp8 (TMA's rule: persistent_tma.describable).
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
    assert persistent_tma.describable(p0) is None
    mode = p0.mma_operands
    assert mode == ("ab" if layout == "NT" else "reg_a" if layout == "TT" else "swap")
    cands = persistent_tma.configs(a.element_size(), mode)
    ran = 0
    persistent_tma._ensure_allocator()
    for cfg in cands:
        for _ in range(3):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
            try:
                persistent_tma._launch(problem(out), cfg)
            except OutOfResources:
                break
            torch.cuda.synchronize()
            err = worst_tile_error(out, ref, cfg["BLOCK_M"], cfg["BLOCK_N"])
            assert err <= tol, f"{cfg}: a tile's relative error is {err:.2e} (bound {tol:.1e})"
        else:
            ran += 1
    assert ran >= len(cands) // 2, f"only {ran} of {len(cands)} candidates fit"
