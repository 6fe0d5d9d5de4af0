"""Fuzz tilegemm.grouped_mm on the GPU (`pytest -m gpu`): a seeded loop of random calls (500 by default,
$TILEGEMM_FUZZ_EXAMPLES), every layout, fp16 / bf16 / fp32, 1-24 groups with empty ones, sizes from 1 to a few
hundred, b row- or column-major, sliced operands, bias [N] or [G, N], rows past offs[-1]; a 16-bit MoE forward
also names ``tma`` or ``gluon`` now and then (``auto`` gives them only larger groups than most draws make; a kernel
that refuses the draw leaves it to ``auto``); each checked against the float64 loop of products with NaN-poisoned
outputs. Also random 4-bit expert calls (MoE-sized now and then, symmetric, act-order, gated) and the fused
16-bit gate/up product."""

from __future__ import annotations

import os
import random

import pytest
import torch

import tilegemm
from tilegemm.core.activations import torch_activation
from tilegemm.core.checks import relative_error
from tilegemm.core.registry import NotApplicable
from tilegemm.ops.grouped.api import moe_gate_up, moe_gate_up_int4
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("TILEGEMM_FUZZ_EXAMPLES", "500"))
SEED = int(os.environ.get("TILEGEMM_FUZZ_SEED") or 0)  # a draw of its own (conftest.fuzz_draw); unset: the default
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICE = "cuda"  # (a dry run of the draws on the CPU, under the interpreter, sets it to "cpu")


def _sizes(rng: random.Random, G: int, big: bool) -> list[int]:
    top = 300 if big else 40
    return [0 if rng.random() < 0.25 else rng.choice((1, rng.randint(1, 17), rng.randint(1, top))) for _ in range(G)]


def _operand(rng, shape, dtype, transposed: bool):
    """A tensor of ``shape``: contiguous, a transposed (column-major) view, or a slice of a wider buffer."""
    kind = rng.random()
    if transposed and len(shape) >= 2:
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], device=DEVICE, dtype=dtype)
        return t.transpose(-2, -1)
    if kind < 0.2:
        t = torch.randn(*shape[:-1], shape[-1] + 5, device=DEVICE, dtype=dtype)
        return t[..., 3:3 + shape[-1]]
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _case(rng: random.Random, i: int):
    layout = rng.choice(("2d3d", "2d3d", "3d3d", "2d2d", "3d2d"))
    dtype = rng.choice(DTYPES)
    G = rng.choice((1, 2, rng.randint(1, 8), rng.randint(1, 24)))
    big = rng.random() < 0.3
    sizes = _sizes(rng, G, big)
    tail = rng.choice((0, 0, rng.randint(1, 9)))
    M = rng.choice((1, rng.randint(1, 17), rng.randint(1, 200)))
    N = rng.choice((1, 8, rng.randint(1, 33), rng.randint(1, 300)))
    K = rng.choice((1, 16, rng.randint(1, 33), rng.randint(1, 300)))
    total = sum(sizes) + tail
    tb = rng.random() < 0.4
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    if layout == "2d3d":
        a, b = _operand(rng, (total, K), dtype, False), _operand(rng, (G, K, N), dtype, tb)
    elif layout == "3d3d":
        a, b, offs = _operand(rng, (G, M, K), dtype, rng.random() < 0.2), _operand(rng, (G, K, N), dtype, tb), None
    elif layout == "2d2d":
        a, b = _operand(rng, (M, total), dtype, rng.random() < 0.3), _operand(rng, (total, N), dtype, tb)
    else:
        a, b = _operand(rng, (G, M, K), dtype, False), _operand(rng, (K, total), dtype, tb)
    bias = None
    if rng.random() < 0.3:
        n = b.shape[-1]
        bias = torch.randn(n if layout == "3d2d" or rng.random() < 0.5 else (G, n), device=DEVICE, dtype=dtype)
    kernel = rng.choice(("auto", "auto", "tma", "gluon")) if layout == "2d3d" and dtype != torch.float32 else "auto"
    return layout, dtype, a, b, offs, bias, kernel


def test_grouped_mm_fuzz():
    rng = random.Random(2026 + SEED)
    torch.manual_seed(2026)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    failures = []
    try:
        for i in range(EXAMPLES):
            layout, dtype, a, b, offs, bias, kernel = _case(rng, i)
            try:
                out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias, kernel=kernel)
            except NotApplicable:
                kernel = "auto"
                out = tilegemm.grouped_mm(a, b, offs=offs, bias=bias)
            ref = grouped_mm_reference(a, b, offs, bias=bias)
            err = relative_error(out, ref)
            if out.shape != ref.shape or not err <= tolerance(dtype):
                failures.append((i, kernel, layout, dtype, tuple(a.shape), tuple(b.shape), tuple(b.stride()),
                                 None if offs is None else offs.tolist(), None if bias is None else bias.dim(), err))
    finally:
        torch.set_float32_matmul_precision(old)
    assert not failures, f"{len(failures)} of {EXAMPLES} wrong: {failures[:10]}"


def _moe_sizes(rng: random.Random, E: int) -> list[int]:
    """A MoE layer's rows an expert at prefill: skewed (a few experts take most rows), some experts empty."""
    total = rng.choice((64, 512, 2048))
    weights = [0.0 if rng.random() < 0.2 else rng.random() ** 3 for _ in range(E)]
    scale = total / (sum(weights) or 1.0)
    return [int(w * scale) for w in weights]


def _int4_case(rng: random.Random):
    """4-bit experts: small random ones, or (one in six) a MoE layer's sizes, which reach the prefill kernels;
    symmetric or not, act-order now and then, plain or gated (the gate/up product with the activation fused)."""
    dtype = rng.choice((torch.float16, torch.bfloat16))
    moe = rng.random() < 1 / 6
    E = rng.choice((8, 16, 64)) if moe else rng.randint(1, 16)
    group_size = rng.choice((32, 64, 128, 128, -1))
    unit = group_size if group_size > 0 else 8
    K = rng.choice((1024, 2048)) if moe else unit * rng.randint(1, 6)
    K = -(-K // unit) * unit
    gated = rng.random() < 0.3
    N = rng.choice((768, 1408, 2816)) if moe else rng.choice((8, rng.randint(1, 40) * 8, rng.randint(1, 300)))
    N = 2 * -(-N // 2) if gated else N
    w = tilegemm.w4a16.quantize(torch.randn(E, N, K, device=DEVICE, dtype=dtype), group_size=group_size,
                                symmetric=rng.random() < 0.3)
    if rng.random() < 0.2:  # GPTQ act-order: each expert's inputs in an order of its own
        perm = torch.stack([torch.randperm(K, device=DEVICE) for _ in range(E)])
        w = tilegemm.w4a16.Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, perm)
    sizes = _moe_sizes(rng, E) if moe else _sizes(rng, E, rng.random() < 0.3)
    x = torch.randn(sum(sizes) + rng.randint(0, 4), K, device=DEVICE, dtype=dtype)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    bias = torch.randn(E, N, device=DEVICE, dtype=dtype) if rng.random() < 0.3 else None
    act = rng.choice(("silu", "gelu")) if gated else rng.choice(("none", "silu", "gelu"))
    return dtype, w, x, offs, sizes, bias, act, gated


def test_int4_experts_fuzz():
    rng = random.Random(7 + SEED)
    failures = []
    for i in range(max(EXAMPLES // 5, 20)):
        dtype, w, x, offs, sizes, bias, act, gated = _int4_case(rng)
        ref = grouped_mm_reference(x, tilegemm.w4a16.dequantize(w).transpose(1, 2), offs, bias=bias)
        if gated:
            out = moe_gate_up_int4(x, w, offs, bias=bias, activation=act)
            gate, up = ref.chunk(2, dim=-1)
            ref = torch_activation(gate, act) * up
        else:
            out = tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation=act)
            ref = torch_activation(ref, act)
        err = relative_error(out, ref)
        if out.shape != ref.shape or torch.isnan(out[:int(offs[-1])]).any() or not err <= tolerance(dtype):
            failures.append((i, dtype, tuple(w.shape), w.group_size, w.perm is not None, gated, sizes, act, err))
    assert not failures, failures[:10]


def test_gated_16bit_fuzz():
    """The 16-bit gate/up product with the activation fused (``moe_gate_up``), w as transformers stores
    ``gate_up_proj`` (``[E, 2I, K]``, passed transposed) or contiguous ``[E, K, 2I]``."""
    rng = random.Random(11 + SEED)
    failures = []
    for i in range(max(EXAMPLES // 10, 20)):
        dtype = rng.choice((torch.float16, torch.bfloat16))
        moe = rng.random() < 0.2
        E = rng.choice((8, 64)) if moe else rng.randint(1, 12)
        K = rng.choice((1024, 2048)) if moe else rng.choice((8, 16, rng.randint(1, 40) * 8))
        I = rng.choice((768, 1408)) if moe else rng.randint(1, 150)
        w = _operand(rng, (E, K, 2 * I), dtype, rng.random() < 0.5)
        sizes = _moe_sizes(rng, E) if moe else _sizes(rng, E, rng.random() < 0.3)
        x = torch.randn(sum(sizes), K, device=DEVICE, dtype=dtype)
        offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
        bias = torch.randn(E, 2 * I, device=DEVICE, dtype=dtype) if rng.random() < 0.3 else None
        act = rng.choice(("silu", "gelu"))
        out = moe_gate_up(x, w, offs, bias=bias, activation=act)
        gate, up = grouped_mm_reference(x, w, offs, bias=bias).chunk(2, dim=-1)
        ref = torch_activation(gate, act) * up
        err = relative_error(out, ref)
        if out.shape != ref.shape or not err <= tolerance(dtype):
            failures.append((i, dtype, E, K, I, tuple(w.stride()), sizes, act, err))
    assert not failures, failures[:10]
