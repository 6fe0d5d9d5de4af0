"""Triton-Puzzles 10-12 with their exact signatures, each beside its plain-torch spec.

A puzzle harness launches ``kernel[grid](*tensors, z, **B, **nelem)``: the tensors positionally, every
size and block by keyword. The output starts as garbage, so each kernel writes every element of z, and
every access is masked, so no kernel touches memory outside its tensors (``tilegemm puzzles`` checks both
under the interpreter). Block sizes must be powers of two (``tl.arange``); sizes are free.
"""

from __future__ import annotations

import inspect

import torch

from tilegemm.core.runtime import ensure_backend

ensure_backend()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Puzzle 12's packing: 8 four-bit values per integer, and one scale/shift per group of 8 weights.
FPINT = 8
GROUP = 8

# Puzzle 10 walks each output row in chunks of this many columns (its signature has no column block).
_CONV_COLS = tl.constexpr(32)


# --- puzzle 10: 2-D convolution ---------------------------------------------------------------------


def conv2d_spec(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """z[b, i, j] = sum over a < KH, c < KW (with i+a < H, j+c < W) of k[a, c] * x[b, i+a, j+c]."""
    if x.dim() != 3 or k.dim() != 2:
        raise ValueError(f"conv2d_spec takes x of [N0, H, W] and k of [KH, KW], got x {list(x.shape)} and k "
                         f"{list(k.shape)}")
    N0, H, W = x.shape
    KH, KW = k.shape
    padded = torch.zeros(N0, H + KH - 1, W + KW - 1, dtype=torch.float64, device=x.device)
    padded[:, :H, :W] = x.double()
    z = torch.zeros(N0, H, W, dtype=torch.float64, device=x.device)
    for a in range(KH):
        for c in range(KW):
            z += k[a, c].double() * padded[:, a:a + H, c:c + W]
    return z.to(x.dtype)


@triton.jit
def conv2d_kernel(x_ptr, k_ptr, z_ptr, N0, H, W, KH: tl.constexpr, KW: tl.constexpr, B0: tl.constexpr):
    # This program: images [pid * B0, pid * B0 + B0) of the batch.
    imgs = tl.program_id(0) * B0 + tl.arange(0, B0)  # [B0]
    img_ok = imgs < N0
    cols = tl.arange(0, _CONV_COLS)  # [C]
    for i in range(0, H):
        for j0 in range(0, W, _CONV_COLS):
            out_j = j0 + cols
            acc = tl.zeros((B0, _CONV_COLS), dtype=tl.float32)
            # Every tap of the kernel: KH and KW are compile-time, so these loops unroll.
            for a in tl.static_range(KH):
                for c in tl.static_range(KW):
                    tap = tl.load(k_ptr + a * KW + c).to(tl.float32)
                    src_j = out_j + c
                    ok = img_ok[:, None] & (src_j[None, :] < W) & (i + a < H)  # zero past bottom/right
                    x = tl.load(x_ptr + imgs[:, None] * H * W + (i + a) * W + src_j[None, :], mask=ok, other=0.0)
                    acc += tap * x.to(tl.float32)
            keep = img_ok[:, None] & (out_j[None, :] < W)
            tl.store(z_ptr + imgs[:, None] * H * W + i * W + out_j[None, :], acc.to(z_ptr.dtype.element_ty),
                     mask=keep)


# --- puzzle 11: batched matrix multiply -------------------------------------------------------------


def dot_spec(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """z = x @ y for x [N2, N0, MID], y [N2, MID, N1]."""
    return (x.double() @ y.double()).to(x.dtype)


@triton.jit
def dot_kernel(
    x_ptr, y_ptr, z_ptr, N0, N1, N2, MID,
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B_MID: tl.constexpr,
):
    # This program: a [B2, B0, B1] block of z.
    rows = tl.program_id(0) * B0 + tl.arange(0, B0)  # [B0]
    cols = tl.program_id(1) * B1 + tl.arange(0, B1)  # [B1]
    mats = tl.program_id(2) * B2 + tl.arange(0, B2)  # [B2]
    mids = tl.arange(0, B_MID)  # [BM]
    m3 = mats[:, None, None]
    acc = tl.zeros((B2, B0, B1), dtype=tl.float32)
    for k0 in range(0, MID, B_MID):
        k = k0 + mids
        # x tile [B2, B0, BM] and y tile [B2, BM, B1], zero outside the tensors.
        x_ok = (m3 < N2) & (rows[None, :, None] < N0) & (k[None, None, :] < MID)
        x = tl.load(x_ptr + m3 * N0 * MID + rows[None, :, None] * MID + k[None, None, :], mask=x_ok, other=0.0)
        y_ok = (m3 < N2) & (k[None, :, None] < MID) & (cols[None, None, :] < N1)
        y = tl.load(y_ptr + m3 * MID * N1 + k[None, :, None] * N1 + cols[None, None, :], mask=y_ok, other=0.0)
        # Any block size works: multiply with broadcasting and sum over the shared axis.
        acc += tl.sum(x.to(tl.float32)[:, :, :, None] * y.to(tl.float32)[:, None, :, :], axis=2)
    z_ok = (m3 < N2) & (rows[None, :, None] < N0) & (cols[None, None, :] < N1)
    tl.store(z_ptr + m3 * N0 * N1 + rows[None, :, None] * N1 + cols[None, None, :], acc.to(z_ptr.dtype.element_ty),
             mask=z_ok)


# --- puzzle 12: 4-bit quantized matrix multiply -----------------------------------------------------


def _nibble(v: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    return (v.long() >> (4 * n)) & 15


def quant_dot_spec(scale, offset, weight, activation) -> torch.Tensor:
    """z[j, k] = sum_l scale[j, l/8] * (nib(weight[j, l/8], l%8) - nib(offset[j], l/8)) * activation[l, k]."""
    N0, groups = weight.shape
    MID = groups * FPINT
    l = torch.arange(MID, device=weight.device)
    q = _nibble(weight[:, l // FPINT], l % FPINT)  # [N0, MID]
    zero = _nibble(offset[:, None], l // GROUP)  # [N0, MID]
    w = scale[:, l // GROUP].double() * (q - zero).double()
    return (w @ activation.double()).to(activation.dtype)


@triton.jit
def quant_dot_kernel(
    scale_ptr, offset_ptr, weight_ptr, activation_ptr, z_ptr, N0, N1, MID,
    B0: tl.constexpr, B1: tl.constexpr, B_MID: tl.constexpr,
):
    # This program: a [B0, B1] block of z.
    rows = tl.program_id(0) * B0 + tl.arange(0, B0)  # [B0]
    cols = tl.program_id(1) * B1 + tl.arange(0, B1)  # [B1]
    row_ok = rows < N0
    groups = MID // GROUP  # weight and scale are [N0, MID / 8]
    shifts = tl.load(offset_ptr + rows, mask=row_ok, other=0)  # [B0], 8 zero points per row
    acc = tl.zeros((B0, B1), dtype=tl.float32)
    for l0 in range(0, MID, B_MID):
        l = l0 + tl.arange(0, B_MID)  # [BM] weight columns
        ok = row_ok[:, None] & (l[None, :] < MID)  # [B0, BM]
        packed = tl.load(weight_ptr + rows[:, None] * groups + (l // FPINT)[None, :], mask=ok, other=0)
        q = (packed >> (4 * (l % FPINT))[None, :]) & 15
        zero = (shifts[:, None] >> (4 * (l // GROUP))[None, :]) & 15
        s = tl.load(scale_ptr + rows[:, None] * groups + (l // GROUP)[None, :], mask=ok, other=0.0)
        w = s.to(tl.float32) * (q - zero).to(tl.float32)  # [B0, BM] dequantized weights
        a_ok = (l[:, None] < MID) & (cols[None, :] < N1)
        a = tl.load(activation_ptr + l[:, None] * N1 + cols[None, :], mask=a_ok, other=0.0)  # [BM, B1]
        acc += tl.sum(w[:, :, None] * a.to(tl.float32)[None, :, :], axis=1)
    tl.store(z_ptr + rows[:, None] * N1 + cols[None, :], acc.to(z_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < N1))


# --- running them -----------------------------------------------------------------------------------


def _garbage(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def make_case(puzzle: str, gen: torch.Generator, int_dtype=torch.int64) -> tuple:
    """Random inputs for one puzzle: (kernel, spec, tensors, z, B, nelem)."""
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    if puzzle == "conv2d":
        N0, H, W, KH, KW = r(1, 6), r(1, 20), r(1, 40), r(1, 5), r(1, 5)
        x = torch.randn(N0, H, W, generator=gen)
        k = torch.randn(KH, KW, generator=gen)
        return (conv2d_kernel, conv2d_spec, [x, k], _garbage((N0, H, W)), dict(B0=4),
                dict(N0=N0, H=H, W=W, KH=KH, KW=KW))
    if puzzle == "dot":
        N0, N1, N2, MID = r(1, 40), r(1, 40), r(1, 3), r(1, 50)
        x = torch.randn(N2, N0, MID, generator=gen)
        y = torch.randn(N2, MID, N1, generator=gen)
        return (dot_kernel, dot_spec, [x, y], _garbage((N2, N0, N1)), dict(B0=16, B1=16, B2=1, B_MID=16),
                dict(N0=N0, N1=N1, N2=N2, MID=MID))
    if puzzle == "quant_dot":
        N0, N1, groups = r(1, 40), r(1, 40), r(1, 8)  # offset packs 8 nibbles: at most 8 groups
        MID = groups * GROUP
        scale = torch.rand(N0, groups, generator=gen) + 0.5
        offset = torch.randint(0, 2**31 - 1, (N0,), generator=gen).to(int_dtype)
        weight = torch.randint(0, 2**31 - 1, (N0, groups), generator=gen).to(int_dtype)
        activation = torch.randn(MID, N1, generator=gen)
        return (quant_dot_kernel, quant_dot_spec, [scale, offset, weight, activation], _garbage((N0, N1)),
                dict(B0=16, B1=16, B_MID=16), dict(N0=N0, N1=N1, MID=MID))
    raise ValueError(f"unknown puzzle {puzzle!r}; choose one of: conv2d, dot, quant_dot")


PUZZLES = ("conv2d", "dot", "quant_dot")


def grid_for(puzzle: str, B: dict, nelem: dict) -> tuple[int, int, int]:
    if puzzle not in PUZZLES:
        raise ValueError(f"unknown puzzle {puzzle!r}; choose one of: {', '.join(PUZZLES)}")
    cdiv = triton.cdiv
    if puzzle == "conv2d":
        return (cdiv(nelem["N0"], B["B0"]), 1, 1)
    if puzzle == "dot":
        return (cdiv(nelem["N0"], B["B0"]), cdiv(nelem["N1"], B["B1"]), cdiv(nelem["N2"], B["B2"]))
    return (cdiv(nelem["N0"], B["B0"]), cdiv(nelem["N1"], B["B1"]), 1)


def check_puzzle(puzzle: str, seed: int = 0, int_dtype=torch.int64) -> tuple[bool, str]:
    """Run one puzzle as its harness would, under the bounds checker; compare with its spec."""
    from tilegemm.learn.debug import OutOfBoundsError, bounds_checked

    if int_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"check_puzzle: int_dtype must be torch.int32 or torch.int64 (quant_dot's packed "
                        f"offsets and weights), got {int_dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    kernel, spec, tensors, z, B, nelem = make_case(puzzle, gen, int_dtype)
    sizes = ", ".join(f"{k}={v}" for k, v in nelem.items())
    inputs = [t.clone() for t in tensors]  # the spec reads these: a kernel may write its inputs (that fails below)

    def run(out):
        with bounds_checked(*tensors, out):
            kernel[grid_for(puzzle, B, nelem)](*tensors, out, **B, **nelem)

    try:
        run(z)
    except OutOfBoundsError as err:
        return False, f"{sizes}: {err}"
    for name, t, before in zip(inspect.signature(spec).parameters, tensors, inputs):
        if not torch.equal(t, before):
            return False, f"{sizes}: the kernel wrote its input {name} (only z is an output)"
    want = spec(*inputs)
    if torch.isnan(z).any():
        # NaN is the poison: runs into zeros and into ones tell the elements never written (both fills left), those
        # the kernel added to (the fill read back: the results differ by one), and NaNs the kernel wrote
        nan = torch.isnan(z)
        zeros, ones = torch.zeros_like(z), torch.ones_like(z)
        run(zeros)
        run(ones)
        unwritten = int(((zeros == 0) & (ones == 1)).sum())
        if unwritten:
            return False, f"{sizes}: {unwritten} output element(s) never written"
        if torch.allclose((ones - zeros)[nan], torch.ones(()), rtol=0, atol=1e-3):
            return False, (f"{sizes}: the kernel reads z before writing it: {int(nan.sum())} output element(s) "
                           f"hold what it added to the poisoned fill (z is an output only: start from zero)")
        return False, (f"{sizes}: the kernel wrote NaN into {int(nan.sum())} output element(s) "
                       f"(the spec gives {int(torch.isnan(want).sum())} NaN)")
    if not torch.allclose(z, want, rtol=1e-4, atol=1e-4):
        return False, f"{sizes}: max error {float((z - want).abs().max()):.3g}"
    return True, sizes


def run_all(trials: int = 3, console=None) -> int:
    """``tilegemm puzzles``: every puzzle on ``trials`` random sizes; 0 when all pass."""
    from rich.console import Console
    from rich.table import Table

    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"run_all: trials must be a whole number of random sizes, at least 1, got {trials!r}")
    console = console or Console()
    table = Table(title="Triton-Puzzles 10-12 under the interpreter (bounds-checked, against the spec)")
    for column in ("puzzle", "trial", "result", "sizes / problem"):
        table.add_column(column)
    failures = done = 0
    try:
        for puzzle in PUZZLES:
            for trial in range(trials):
                ok, detail = check_puzzle(puzzle, seed=trial)
                failures += not ok
                done += 1
                table.add_row(puzzle, str(trial), "[green]pass[/]" if ok else "[bold red]FAIL[/]", detail)
    except KeyboardInterrupt:  # Ctrl-C: the trials done so far, said to be partial, as the bench does
        console.print(table)
        console.print(f"interrupted after {done} of {trials * len(PUZZLES)} trials: {done - failures} passed, "
                      f"{failures} failed")
        return 130
    console.print(table)
    console.print(f"{done - failures} passed, {failures} failed")
    return 1 if failures else 0
