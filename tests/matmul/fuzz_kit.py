"""What the matmul fuzz tests share: the drawn products (every dtype; transposed, padded and offset operands;
batches; epilogues), the operands made from them, the check, and one drawn product run three times."""

from __future__ import annotations

import math
import zlib

import torch
from hypothesis import strategies as st

import tilegemm
from tilegemm.core.checks import tile_errors
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

FP8 = torch.float8_e4m3fn
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "ieee": torch.float32, "fp8": FP8}


@st.composite
def dims(draw, hi: int) -> int:
    """A size in 1..hi: log-uniform, or a multiple of 8, 16 or 64 give or take one."""
    kind = draw(st.sampled_from(["log", "log", "near"]))
    if kind == "log":
        return max(1, min(hi, int(math.exp(draw(st.floats(0.0, math.log(hi)))))))
    unit = draw(st.sampled_from([8, 16, 64]))
    return max(1, min(hi, unit * draw(st.integers(1, max(1, hi // unit))) + draw(st.sampled_from([-1, 0, 0, 1]))))


@st.composite
def products(draw, names=tuple(DTYPES), mn: int = 4096, k: int = 8192):
    """A product's dtype (one of ``names``), sizes (M, N up to ``mn``, K up to ``k``), layout and epilogue."""
    name = draw(st.sampled_from(names))
    M, N, K = draw(dims(mn)), draw(dims(mn)), draw(dims(k))
    if draw(st.integers(0, 5)) == 0:  # a skinny product: M or N of 1..8
        if draw(st.booleans()):
            M = draw(st.integers(1, 8))
        else:
            N = draw(st.integers(1, 8))
    while M * N * K > 4e9:  # keep the fp64 reference quick
        K = max(1, K // 2)
    batch = draw(st.sampled_from([(), (), (), (2,), (3,), (2, 2)]))
    return dict(
        name=name, M=M, N=N, K=K, batch=batch,
        broadcast_b=bool(batch) and draw(st.booleans()),  # b without the batch dims
        a_t=draw(st.booleans()), b_t=draw(st.booleans()),  # transposed storage (column-major)
        a_pad=draw(st.sampled_from([0, 0, 1, 8, 64])), b_pad=draw(st.sampled_from([0, 0, 1, 8, 64])),
        offset=draw(st.sampled_from([1, 3, 8])),  # elements: the third call's operands start here (8: fp8 only)
        bias=draw(st.booleans()), c=draw(st.integers(0, 3)) == 0,
        alpha=draw(st.sampled_from([1.0, 1.0, 0.5])),
        activation=draw(st.sampled_from([None, None, "relu", "gelu", "silu"])),
        out_dtype=draw(st.sampled_from([None, None, torch.float32])),
        # fp8 only: b's format, one scale per tensor or per row of a / column of b, the tensor cores' own sums
        b_e5m2=draw(st.integers(0, 3)) == 0, row_scales=draw(st.booleans()), col_scales=draw(st.booleans()),
        fast_accum=draw(st.integers(0, 3)) == 0,
    )


def operand(rows: int, cols: int, batch: tuple, transposed: bool, pad: int, offset: int, dtype, device):
    """A ``[*batch, rows, cols]`` view of random values: row-major (or column-major when ``transposed``) with
    ``pad`` elements more per leading dimension, starting ``offset`` elements into its storage."""
    inner, outer = (rows, cols) if transposed else (cols, rows)
    ld = inner + pad
    per = outer * ld
    flat = torch.randn(offset + math.prod(batch) * per, device=device).to(dtype)
    t = flat[offset:].view(*batch, outer, ld)[..., :inner]
    return t.mT if transposed else t


def check(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, K: int, tol: float, what: str) -> None:
    """``out`` within ``tol`` of ``ref`` relative to its norm, or where the sums cancel (a few outputs, tf32's
    rounded operands) to half the norm their terms' magnitudes give (``terms / sqrt(K)``); and no 32x32 tile of
    a larger output more than four times off."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element never written)"
    norm = ref.norm().item()
    err = (out.double() - ref).norm().item() / max(norm, 0.5 * terms.norm().item() / math.sqrt(K), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"
    if out.numel() >= 4096:
        worst = tile_errors(out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1]), 32, 32).max().item()
        assert worst <= 4 * tol, f"{what}: a 32x32 tile's relative error {worst:.2e} > {4 * tol:.1e}"


def run_product(p: dict, device: str) -> None:
    """Product ``p`` through ``auto`` three times (recorded, replayed, then from operands at another offset),
    each checked against the float64 reference."""
    torch.manual_seed(zlib.crc32(repr(sorted(p.items())).encode()))  # the same values each time it is drawn
    dtype = DTYPES[p["name"]]
    precision = {"tf32": "tf32", "ieee": "ieee"}.get(p["name"])
    fp8 = dtype == FP8
    kw = dict(alpha=p["alpha"], activation=p["activation"], out_dtype=p["out_dtype"], precision=precision)
    tol = tolerance(dtype, precision or "ieee", p["out_dtype"] or (torch.bfloat16 if fp8 else dtype),
                    fast_accum=fp8 and p["fast_accum"])
    b_dtype = torch.float8_e5m2 if fp8 and p["b_e5m2"] else dtype
    M, N, K, batch = p["M"], p["N"], p["K"], p["batch"]
    b_batch = () if p["broadcast_b"] else batch
    epilogue_dtype = torch.bfloat16 if fp8 else dtype
    for call, offset in enumerate((0, 0, p["offset"])):
        a = operand(M, K, batch, p["a_t"], p["a_pad"], offset, dtype, device)
        b = operand(K, N, b_batch, p["b_t"], p["b_pad"], offset, b_dtype, device)
        bias = torch.randn(N, device=device).to(epilogue_dtype) if p["bias"] else None
        c = torch.randn(M, N, device=device).to(epilogue_dtype) if p["c"] else None
        scales = {}
        if fp8:
            scales = dict(scale_a=torch.rand(M if p["row_scales"] else (), device=device) + 0.5,
                          scale_b=torch.rand(N if p["col_scales"] else (), device=device) + 0.5,
                          fast_accum=p["fast_accum"])
        with torch.no_grad():
            out = tilegemm.matmul(a, b, bias=bias, c=c, beta=0.5, **scales, **kw)
        ra, rb = a.double(), b.double()
        if fp8:
            sa, sb = scales["scale_a"].double(), scales["scale_b"].double()
            ra = ra * (sa[:, None] if sa.dim() else sa)
            rb = rb * sb  # per column: broadcasts along N
        ref = matmul_reference(ra, rb, bias=bias, c=c, alpha=p["alpha"], beta=0.5, activation=p["activation"])
        terms = matmul_reference(ra.abs(), rb.abs(), bias=None if bias is None else bias.abs(),
                                 c=None if c is None else c.abs(), alpha=p["alpha"], beta=0.5)
        check(out.float(), ref, terms, K, tol, f"call {call} ({'replay' if call == 1 else 'record'}) of {p}")
    if device == "cuda":
        torch.cuda.synchronize()
