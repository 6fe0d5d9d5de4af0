"""The host side of a GEMM launch: one batch of ``[B, M, K] @ [B, K, N]`` described by views and strides.

:func:`tilegemm.matmul.op.matmul` validates user input and cuts it into :class:`GemmProblem` pieces; every
kernel launcher takes one piece. The views are made with ``as_strided`` and ``expand``, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Largest grid extent on CUDA's y axis, where the batch goes.
MAX_GRID_Y = 65535
_INT32_MAX = 2**31 - 1


@dataclass
class GemmProblem:
    a: torch.Tensor  # [B, M, K]
    b: torch.Tensor  # [B, K, N]
    out: torch.Tensor  # [B, M, N], written
    c: torch.Tensor | None  # [B, M, N] (strides may be 0 where c broadcasts)
    bias: torch.Tensor | None  # [N]
    alpha: float
    beta: float
    activation: str  # "none" or a name in ACTIVATIONS
    input_precision: str  # "ieee" or "tf32": how tl.dot treats fp32 operands
    upcast: bool  # interpreter only: upcast bf16 tiles to fp32 before tl.dot

    @property
    def batch(self) -> int:
        return self.out.shape[0]

    @property
    def M(self) -> int:
        return self.out.shape[1]

    @property
    def N(self) -> int:
        return self.out.shape[2]

    @property
    def K(self) -> int:
        return self.a.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    @property
    def index_64(self) -> bool:
        """True when some in-batch offset may not fit in int32, so kernels index in int64."""
        return any(_max_offset(t, skip_batch=True) > _INT32_MAX for t in self._tensors())

    def _tensors(self):
        return [t for t in (self.a, self.b, self.out, self.c) if t is not None]

    def kernel_args(self) -> tuple:
        """The argument list every dense-GEMM kernel takes, in the order of its signature.

        Missing c or bias are passed as the output pointer with HAS_C/HAS_BIAS false; an empty K
        passes the output pointer for A and B too, since no load happens.
        """
        out = self.out
        a = self.a if self.K > 0 else out
        b = self.b if self.K > 0 else out
        c = self.c if self.c is not None else out
        bias = self.bias if self.bias is not None else out
        c_strides = self.c.stride() if self.c is not None else (0, 0, 0)
        return (
            a, b, out, c, bias,
            self.M, self.N, self.K,
            *self.a.stride(), *self.b.stride(), *out.stride(), *c_strides,
            self.bias.stride(0) if self.bias is not None else 0,
            float(self.alpha), float(self.beta),
        )

    def kernel_flags(self) -> dict:
        return dict(
            HAS_C=self.c is not None,
            HAS_BIAS=self.bias is not None,
            ACTIVATION=self.activation,
            INPUT_PRECISION=self.input_precision,
            UPCAST=self.upcast,
            INDEX_64=self.index_64,
        )


def _max_offset(t: torch.Tensor, skip_batch: bool = False) -> int:
    dims = range(1, t.dim()) if skip_batch else range(t.dim())
    return sum((t.shape[d] - 1) * abs(t.stride(d)) for d in dims if t.shape[d] > 0)


def split_batches(
    batch_shape: tuple[int, ...],
    tensors: list[torch.Tensor | None],
) -> list[list[torch.Tensor | None]]:
    """Cut tensors of shape ``[*batch_shape, r, s]`` into lists of ``[B, r, s]`` views.

    Adjacent batch dims merge when every tensor's strides allow it (always for contiguous data); what
    cannot merge becomes an outer loop. Each piece has at most MAX_GRID_Y batches.
    """
    present = [t for t in tensors if t is not None]
    # Drop size-1 batch dims, then merge neighbours whose strides chain in every tensor.
    dims = [d for d, size in enumerate(batch_shape) if size != 1]
    groups: list[tuple[int, list[int]]] = []  # (size, stride per tensor)
    for d in dims:
        size = batch_shape[d]
        strides = [t.stride(d) for t in present]
        if groups:
            prev_size, prev_strides = groups[-1]
            if all(ps == s * size for ps, s in zip(prev_strides, strides)):
                groups[-1] = (prev_size * size, strides)
                continue
        groups.append((size, strides))
    if not groups:
        groups = [(1, [0] * len(present))]

    *outer, (inner_size, inner_strides) = groups
    pieces: list[list[torch.Tensor | None]] = []
    outer_sizes = [g[0] for g in outer]
    for flat in range(_prod(outer_sizes)):
        index = _unflatten(flat, outer_sizes)
        for start in range(0, inner_size, MAX_GRID_Y):
            count = min(MAX_GRID_Y, inner_size - start)
            views = []
            for i, t in enumerate(present):
                offset = t.storage_offset() + start * inner_strides[i]
                offset += sum(ix * g[1][i] for ix, g in zip(index, outer))
                views.append(
                    torch.as_strided(
                        t,
                        (count, t.shape[-2], t.shape[-1]),
                        (inner_strides[i], t.stride(-2), t.stride(-1)),
                        offset,
                    )
                )
            it = iter(views)
            pieces.append([next(it) if t is not None else None for t in tensors])
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
