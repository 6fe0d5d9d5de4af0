"""Divisibility hints: strides and sizes that are multiples of 2, 4 or 8 elements but not of 16.

Triton only learns "a multiple of 16" from its launch specialization; the kernels get the rest from
``GemmProblem.divisors`` (see ``tilegemm.jit.helpers.below``). A wrong hint would not fail loudly: the
compiler would vectorize accesses that are not aligned. So: the divisors must be right, results must be
right on shapes that use every divisor, and the compiled code must actually be vectorized (checked by
compiling for sm_90 without a GPU, in a subprocess).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tilegemm.ops.matmul import grouped, naive, split_k
from tilegemm.ops.matmul.problem import _divisor, make_problems
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close, compile_offline, crossed


def _problem(a, b, out, c=None, bias=None):
    return make_problems(a, b, out, c, bias, 1.5, 0.5, "none", "ieee", False)[0]


def test_divisor_is_the_largest_power_of_two_up_to_16():
    assert [_divisor(v) for v in (0, 1, 2, 3, 6, 12, 24, 40, 48, 5000, 3000, 4096, -24)] == [
        16, 1, 2, 1, 2, 4, 8, 8, 16, 8, 8, 16, 8]


def test_problem_divisors_follow_strides_and_sizes():
    a = torch.empty(100, 5000, dtype=torch.float16)  # row-major, leading dim 5000 (8 | 5000)
    b = torch.empty(3000, 5000, dtype=torch.float16).mT  # K x N, column-major, leading dim 5000
    out = torch.empty(100, 3000, dtype=torch.float16)
    p = _problem(a, b, out)
    #            am ak bk  bn  om on cm  cn  M  N  K
    assert p.divisors == (8, 1, 1, 8, 8, 1, 16, 16, 1, 8, 8)
    assert p.kernel_flags()["DIVISORS"] == p.divisors
    # M counts only where out (or c) is column-major; a row-major c leaves it out.
    c = torch.empty(100, 3000, dtype=torch.float16)
    assert _problem(a, b, out, c=c).divisors[6:9] == (8, 1, 1)
    out_cm = torch.empty(3000, 100, dtype=torch.float16).mT
    assert _problem(a, b, out_cm).divisors[4:9] == (1, 4, 16, 16, 4)


# N and K multiples of 8, 4 or 2 (never of 16); M odd or a multiple of 8, 4. The last shape has no hint.
SHAPES = [(17, 24, 40), (33, 36, 20), (9, 50, 26), (40, 8, 56), (12, 40, 24), (5, 33, 37)]


@crossed("rung, shape, layout", ["naive", "grouped", "split_k"], SHAPES, ["NN", "NT", "TN", "TT"],
         ids=(None, lambda s: "x".join(map(str, s))))
def test_odd_multiples_are_right(rung, shape, layout, device):
    M, N, K = shape
    dtype = torch.float16 if device == "cuda" else torch.float32
    a = torch.randn(K, M, dtype=dtype, device=device).mT if layout[0] == "T" else torch.randn(M, K, dtype=dtype, device=device)
    b = torch.randn(N, K, dtype=dtype, device=device).mT if layout[1] == "T" else torch.randn(K, N, dtype=dtype, device=device)
    c = torch.randn(N, M, dtype=dtype, device=device).mT  # column-major c: uses the divisor of M
    bias = torch.randn(N, dtype=dtype, device=device)
    # Column-major output when B is transposed: the store then runs along M.
    if layout[1] == "T":
        out = torch.full((N, M), float("nan"), dtype=dtype, device=device).mT
    else:
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    p = _problem(a, b, out, c=c, bias=bias)
    assert any(1 < d < 16 for d in p.divisors) == (shape != (5, 33, 37))
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=2)
    if rung == "split_k":
        split_k.run(p, dict(cfg, SPLIT_K=2, SLICES=True))
    else:
        {"naive": naive, "grouped": grouped}[rung].run(p, cfg)
    ref = matmul_reference(a, b, c=c, bias=bias, alpha=1.5, beta=0.5)
    assert_rel_close(out, ref, tolerance(dtype))


# Compiles the grouped and split_k kernels for sm_90 (no GPU needed: Triton ships ptxas) and counts the
# 16-byte cp.async copies of the K loop, with and without the divisors of a 100x3000x5000 fp16 problem.
_COMPILE = textwrap.dedent(
    """
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tilegemm.ops.matmul.grouped import matmul_grouped_kernel
    from tilegemm.ops.matmul.split_k import matmul_split_k_kernel

    M, N, K = 100, 3000, 5000
    ints = dict(M=M, N=N, K=K, stride_ab=0, stride_am=K, stride_ak=1, stride_bb=0, stride_bk=N, stride_bn=1,
                stride_ob=0, stride_om=N, stride_on=1, stride_cb=0, stride_cm=N, stride_cn=1, stride_bias=0,
                stride_sa=0, stride_sb=0, SPLIT_K=2)
    flags = dict(HAS_C=False, HAS_BIAS=False, ACTIVATION="none", HAS_SCALE_A=False, HAS_SCALE_B=False,
                 INPUT_PRECISION="ieee", UPCAST=False, INDEX_64=False, MMA_OPERANDS="ab", FAST_ACCUM=False,
                 BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SLICES=True, ATOMIC_READ=True, APART=False)

    def count(kernel, divisors):
        sig, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name.endswith("_ptr"):
                sig[name] = "*fp32" if name.startswith(("scale", "ws")) else "*i32" if name == "count_ptr" else "*fp16"
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ints:
                v = ints[name]
                if v in (0, 1) and name.startswith("stride"):  # as Triton specializes them
                    sig[name], constexprs[(i,)] = "constexpr", v
                else:
                    sig[name] = "i32"
                    if v % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ("alpha", "beta"):
                sig[name] = "fp32"
            else:
                sig[name], constexprs[(i,)] = "constexpr", divisors if name == "DIVISORS" else flags[name]
        src = ASTSource(kernel, sig, constexprs, attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3)).asm["ptx"]
        return len(re.findall(r"cp\\.async\\.cg\\.shared\\.global\\S* \\[[^\\]]+\\], \\[[^\\]]+\\], 0x10", ptx))

    hinted = tuple(json.loads(sys.argv[1]))
    none = (1,) * 11
    print(json.dumps({name: [count(k, none), count(k, hinted)] for name, k in
                      (("grouped", matmul_grouped_kernel), ("split_k", matmul_split_k_kernel))}))
    """
)


def test_hints_vectorize_the_k_loop_in_compiled_code(tmp_path):
    a = torch.empty(100, 5000, dtype=torch.float16)
    b = torch.empty(5000, 3000, dtype=torch.float16)
    divisors = _problem(a, b, torch.empty(100, 3000, dtype=torch.float16)).divisors
    assert divisors == (8, 1, 8, 1, 8, 1, 16, 16, 1, 8, 8)  # no c: its strides are 0
    counts = compile_offline(tmp_path, _COMPILE, divisors, timeout=300)
    for name, (without, with_hints) in counts.items():
        # Without hints no row of A or B starts provably aligned: no 16-byte copies at all.
        assert without == 0, f"{name}: expected no 16-byte cp.async without hints, got {without}"
        assert with_hints > 0, f"{name}: the hints should give 16-byte cp.async copies"
