"""The arguments of one ``tilegemm.matmul`` call, as they travel from the public function to the kernels."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from tilegemm.core.activations import ACTIVATIONS  # noqa: F401 (re-exported: tilegemm.ACTIVATIONS)
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

    def replace(self, **changes) -> "MatmulCall":
        return self._replace(**changes)

    @property
    def output_dtype(self) -> torch.dtype:
        return self.out_dtype or default_out_dtype(self.a.dtype)
