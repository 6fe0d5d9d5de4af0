"""The records of one ``tilegemm.matmul`` call: :class:`MatmulCall`, its arguments as they travel from the public
function to the dispatch, and :class:`GemmProblem`, one kernel launch's ``[B, M, K] @ [B, K, N]`` described by
base tensors and stride tuples.

:func:`make_problems` cuts a checked call into :class:`GemmProblem` pieces; every rung launches one piece. Batch
dims that broadcast get stride 0; dims that merge become one batch axis; only what cannot merge (or more than
MAX_GRID_Y batches) becomes several pieces, each an ``as_strided`` view. Nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from tilegemm.core import tuning
from tilegemm.core.dtypes import dtype_name

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # inputs and outputs
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # inputs only; the output is 16- or 32-bit
INPUT_DTYPES = DTYPES + FP8_DTYPES


def default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The output dtype when none is asked for: the input's, or bfloat16 for fp8 inputs."""
    return torch.bfloat16 if dtype in FP8_DTYPES else dtype


class MatmulCall(NamedTuple):
    """``activation(alpha * scale_a * scale_b * (a @ b) + beta * c + bias)``, one call's worth: an immutable
    record (a NamedTuple rather than a frozen dataclass: it is built on every call that is not replayed, and
    a frozen dataclass costs several microseconds more there).

    The fields are in the order of the ``torch.ops.tilegemm.matmul`` schema, so :meth:`op_args` and
    ``MatmulCall(*args)`` convert between the two. ``precision`` is ``"default"`` until the op runs and
    reads torch's setting (:func:`tilegemm.core.dtypes.resolve_precision`).
    """

    a: torch.Tensor
    b: torch.Tensor
    bias: Optional[torch.Tensor] = None
    c: Optional[torch.Tensor] = None
    alpha: float = 1.0
    beta: float = 1.0
    activation: str = "none"
    out_dtype: Optional[torch.dtype] = None
    precision: str = "default"
    kernel: str = "auto"
    scale_a: Optional[torch.Tensor] = None
    scale_b: Optional[torch.Tensor] = None
    fast_accum: bool = False

    def op_args(self) -> tuple:
        """The positional arguments of ``torch.ops.tilegemm.matmul``."""
        return tuple(self)

    def without_product(self) -> "MatmulCall":
        """The call at ``alpha`` 0: a product of no inputs (K = 0), reading neither operand, as BLAS; on ``auto``
        (a kernel named may refuse K = 0)."""
        return self.replace(a=self.a[..., :0], b=self.b[..., :0, :], kernel="auto")

    def replace(self, **changes) -> "MatmulCall":
        return self._replace(**changes)

    @property
    def output_dtype(self) -> torch.dtype:
        return self.out_dtype or default_out_dtype(self.a.dtype)


# Largest grid extent on CUDA's y axis, where the batch goes.
MAX_GRID_Y = 65535
_INT32_MAX = 2**31 - 1


@dataclass(slots=True)
class GemmProblem:
    a: torch.Tensor  # base of A; element (b, m, k) at a_strides . (b, m, k)
    a_strides: tuple[int, int, int]
    b: torch.Tensor
    b_strides: tuple[int, int, int]
    out: torch.Tensor  # written
    out_strides: tuple[int, int, int]
    c: torch.Tensor | None
    c_strides: tuple[int, int, int]
    bias: torch.Tensor | None
    M: int
    N: int
    K: int
    batch: int
    alpha: float
    beta: float
    activation: str  # "none" or a name in ACTIVATIONS
    input_precision: str  # "ieee" or "tf32": how tl.dot treats fp32 operands
    upcast: bool  # interpreter only: upcast bf16 tiles to fp32 before tl.dot
    # fp8 dequantization: out = alpha * scale_a[m] * scale_b[n] * (A @ B) + ...; stride 0 for one scale.
    scale_a: torch.Tensor | None = None
    scale_a_stride: int = 0
    scale_b: torch.Tensor | None = None
    scale_b_stride: int = 0
    fast_accum: bool = False  # fp8: accumulate without promoting to fp32 every BLOCK_K (see jit_helpers.mma)

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    @property
    def index_64(self) -> bool:
        """True when some in-batch offset may not fit in int32, so kernels index in int64."""
        spans = (
            (self.M - 1) * abs(self.a_strides[1]) + (self.K - 1) * abs(self.a_strides[2]),
            (self.K - 1) * abs(self.b_strides[1]) + (self.N - 1) * abs(self.b_strides[2]),
            (self.M - 1) * abs(self.out_strides[1]) + (self.N - 1) * abs(self.out_strides[2]),
            (self.M - 1) * abs(self.c_strides[1]) + (self.N - 1) * abs(self.c_strides[2]),
        )
        return max(spans) > _INT32_MAX

    def kernel_args(self) -> tuple:
        """The argument list every dense-GEMM kernel takes, in the order of its signature.

        Missing c or bias are passed as the output pointer with HAS_C/HAS_BIAS false; an empty K
        passes the output pointer for A and B too, since no load happens.
        """
        out = self.out
        has_k = self.K > 0
        return (
            self.a if has_k else out, self.b if has_k else out, out, *self.epilogue_pointers(),
            self.M, self.N, self.K,
            *self.a_strides, *self.b_strides, *self.out_strides, *self.c_strides,
            self.bias_stride, self.scale_a_stride, self.scale_b_stride,
            self.alpha, self.beta,
        )

    def epilogue_pointers(self) -> tuple:
        """c, bias, scale_a, scale_b, each one absent passed as the output (its HAS_ flag is then false)."""
        return tuple(t if t is not None else self.out for t in (self.c, self.bias, self.scale_a, self.scale_b))

    @property
    def bias_stride(self) -> int:
        return self.bias.stride(0) if self.bias is not None else 0

    @property
    def tma_view(self) -> tuple[bool, bool, int, int]:
        """(A_T, B_T, A's row stride, B's row stride) as the TMA kernels describe the operands: an operand
        whose inner stride is not 1 is described as its transpose (A as [K, M], B as [N, K])."""
        _, sam, sak = self.a_strides
        _, sbk, sbn = self.b_strides
        a_t, b_t = sak != 1, sbn != 1
        return a_t, b_t, sak if a_t else sam, sbn if b_t else sbk

    def tma_boxes(self, bm: int, bn: int, bk: int) -> tuple[tuple, tuple]:
        """(tensor, shape, row stride, block) of A and of B as :attr:`tma_view` describes them, for tiles of
        ``bm`` x ``bn`` output and ``bk`` K: what a host-side TMA descriptor of each is made from."""
        a_t, b_t, stride_a, stride_b = self.tma_view
        a = (self.a, [self.K, self.M], stride_a, [bk, bm]) if a_t else (self.a, [self.M, self.K], stride_a, [bm, bk])
        b = (self.b, [self.N, self.K], stride_b, [bn, bk]) if b_t else (self.b, [self.K, self.N], stride_b, [bk, bn])
        return a, b

    def tuning_key(self, rung: str) -> str:
        """This problem's shape-class key for ``rung`` (:func:`tilegemm.core.tuning.key`, batch included)."""
        return tuning.key(rung, self.M, self.N, self.K, self.tuning_dtype, self.out.dtype, self.layout, self.batch)

    @property
    def tuning_dtype(self) -> str:
        """The operand dtypes as tuned configs are keyed: ``tf32`` apart from IEEE fp32, fp8 pairs joined."""
        a, b = dtype_name(self.a.dtype), dtype_name(self.b.dtype)
        label = a if a == b else f"{a}x{b}"
        if label == "fp32" and self.input_precision == "tf32":
            return "tf32"
        return label + "+fast" if self.fast_accum else label

    @property
    def layout(self) -> str:
        """BLAS-style layout letters of A and B: N (row-major), T (column-major) or S (neither)."""
        def letter(inner: int, outer: int) -> str:
            return "N" if inner == 1 else "T" if outer == 1 else "S"

        return letter(self.a_strides[2], self.a_strides[1]) + letter(self.b_strides[2], self.b_strides[1])

    @property
    def mma_operands(self) -> str:
        """How the operands meet the tensor cores; see :func:`mma_operands`."""
        return mma_operands(self.dtype, self.input_precision, self.a_strides, self.b_strides)

    @property
    def divisors(self) -> tuple[int, ...]:
        """What kernels may assume divides each stride and size: the largest power of two, at most 16.

        In this order (the kernels' ``DIVISORS`` constexpr): A's row and column strides, B's, out's, c's,
        then M, N, K. Triton itself only knows "a multiple of 16"; see :func:`tilegemm.jit.helpers.below`.
        M's entry is 1 unless A, out or c is column-major, the only places it matters: M is the batch size
        in LLM inference, and each new value would otherwise compile the kernels again. Where A is
        contiguous along M, its loads may be vectorized only in runs that M's divisor allows (see
        :func:`tilegemm.ops.matmul.mainloop.tile_rows_cols`); N's divisor plays that part for B.
        """
        a, b, o, c = self.a_strides, self.b_strides, self.out_strides, self.c_strides
        m_matters = a[1] == 1 or o[1] == 1 or (self.c is not None and c[1] == 1)
        return (
            _divisor(a[1]), _divisor(a[2]), _divisor(b[1]), _divisor(b[2]),
            _divisor(o[1]), _divisor(o[2]), _divisor(c[1]), _divisor(c[2]),
            _divisor(self.M) if m_matters else 1, _divisor(self.N), _divisor(self.K),
        )

    def kernel_flags(self) -> dict:
        return dict(
            HAS_C=self.c is not None,
            HAS_BIAS=self.bias is not None,
            ACTIVATION=self.activation,
            HAS_SCALE_A=self.scale_a is not None,
            HAS_SCALE_B=self.scale_b is not None,
            INPUT_PRECISION=self.input_precision,
            UPCAST=self.upcast,
            INDEX_64=self.index_64,
            MMA_OPERANDS=self.mma_operands,
            FAST_ACCUM=self.fast_accum,
            DIVISORS=self.divisors,
        )


def _divisor(value: int) -> int:
    """The largest power of two dividing ``value``, at most 16 (16 for 0)."""
    value = abs(value)
    return 16 if value == 0 else min(16, value & -value)


def mma_operands(dtype, input_precision: str, a_strides, b_strides) -> str:
    """How the operands should meet Hopper's tensor cores: ``"ab"``, ``"reg_a"`` or ``"swap"``.

    wgmma takes 16-bit operands from shared memory in either order, but tf32 and fp8 operands only
    K-major (K the contiguous dim). The first operand may come from registers instead, in any layout.
    So: A and B both K-major, or 16-bit, or IEEE fp32 (no tensor cores): as they are. Only A not
    K-major: A through registers. B not K-major: swap, so that B^T is the first operand and goes
    through registers, and A^T (K-major when A is) is the second (the swap's gain:
    docs/rungs/persistent_tma.md).
    """
    if dtype in (torch.float16, torch.bfloat16) or (dtype == torch.float32 and input_precision == "ieee"):
        return "ab"
    a_k_major = a_strides[-1] == 1
    b_k_major = b_strides[-2] == 1
    if b_k_major:
        return "ab" if a_k_major else "reg_a"
    return "swap"


def _aligned_strides(t: torch.Tensor, shape: tuple[int, ...]) -> list[int]:
    """Strides of ``t`` broadcast to ``shape`` (right-aligned): 0 where ``t`` has size 1 or no dim."""
    lead = len(shape) - t.dim()
    strides = [0] * lead
    for size, stride in zip(t.shape, t.stride()):
        strides.append(0 if size == 1 else stride)
    return strides


def make_problems(a, b, out, c=None, bias=None, alpha=1.0, beta=1.0, activation="none", precision="ieee",
                  upcast=False, scales=(None, 0, None, 0), fast_accum: bool = False) -> list[GemmProblem]:
    """Cut ``out = a @ b`` (broadcast batch dims, ``out`` of shape [*batch, M, N]) into kernel launches, each
    one :class:`GemmProblem` for :func:`tilegemm.ops.matmul.launch` (nothing is checked or copied here).

    ``c`` broadcasts to ``out`` (scaled by ``beta``), ``bias`` is ``[N]``; ``activation`` a name in
    ``ACTIVATIONS`` or ``"none"``; ``precision`` ``"ieee"`` or ``"tf32"`` (resolved); ``upcast`` the
    interpreter's bf16 upcast. ``scales`` is ``(scale_a, its stride along M, scale_b, its stride along N)``; the
    same for every batch.
    """
    if out.dim() == 2:
        # The common case, kept short: one [M, K] @ [K, N] launch.
        M, N = out.shape
        c_strides = (0, *_aligned_strides(c, (M, N))) if c is not None else (0, 0, 0)
        return [GemmProblem(a, (0, *a.stride()), b, (0, *b.stride()), out, (0, *out.stride()), c, c_strides,
                            bias, M, N, a.shape[1], 1, alpha, beta, activation, precision, upcast, *scales,
                            fast_accum)]
    shape = tuple(out.shape)
    batch_shape = shape[:-2]
    M, N = shape[-2:]
    K = a.shape[-1]
    tensors = [a, b, out] + ([c] if c is not None else [])
    full_shapes = [(*batch_shape, M, K), (*batch_shape, K, N), shape, shape]
    strides = [_aligned_strides(t, full) for t, full in zip(tensors, full_shapes)]
    inner = [s[-2:] for s in strides]

    # Merge batch dims (dropping size-1 ones) where every tensor's strides chain.
    groups: list[tuple[int, list[int]]] = []  # (size, batch stride per tensor)
    for d, size in enumerate(batch_shape):
        if size == 1:
            continue
        dim_strides = [s[d] for s in strides]
        if groups:
            prev_size, prev = groups[-1]
            if all(p == s * size for p, s in zip(prev, dim_strides)):
                groups[-1] = (prev_size * size, dim_strides)
                continue
        groups.append((size, dim_strides))
    if not groups:
        groups = [(1, [0] * len(tensors))]
    *outer, (count, batch_strides) = groups

    def problem(bases, start, n):
        s3 = [(batch_strides[i], *inner[i]) for i in range(len(tensors))]
        return GemmProblem(
            bases[0], s3[0], bases[1], s3[1], bases[2], s3[2],
            bases[3] if c is not None else None, s3[3] if c is not None else (0, 0, 0),
            bias, M, N, K, n, alpha, beta, activation, precision, upcast, *scales, fast_accum,
        )

    if not outer and count <= MAX_GRID_Y:
        return [problem(tensors, 0, count)]

    # Rare: batch dims that do not merge, or more batches than one grid holds. Each piece starts at a
    # storage offset of its own, so it gets as_strided views (still no copies).
    pieces = []
    outer_sizes = [g[0] for g in outer]
    for flat in range(_prod(outer_sizes)):
        index = _unflatten(flat, outer_sizes)
        for start in range(0, count, MAX_GRID_Y):
            n = min(MAX_GRID_Y, count - start)
            bases = []
            for i, t in enumerate(tensors):
                if t.numel() == 0:  # A and B when K == 0: never read
                    bases.append(t)
                    continue
                offset = t.storage_offset() + start * batch_strides[i]
                offset += sum(ix * g[1][i] for ix, g in zip(index, outer))
                bases.append(torch.as_strided(t, (1,), (1,), offset))
            pieces.append(problem(bases, start, n))
    return pieces


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def _unflatten(flat: int, sizes: list[int]) -> list[int]:
    index = []
    for size in reversed(sizes):
        index.append(flat % size)
        flat //= size
    return list(reversed(index))


def rows_aligned(p: GemmProblem) -> bool:
    """Whether every row (or column) A and B are read along starts 16 bytes apart: their strides other than the
    unit one are multiples of 16 bytes."""
    size = p.a.element_size()
    strides = [p.a_strides[2], *p.b_strides[1:]] + ([p.a_strides[1]] if p.M > 1 else [])  # one row: no stride
    return all((s * size) % 16 == 0 for s in strides if s not in (0, 1))
