"""The geometry of a 2-D convolution and the checks on its arguments (plain Python: no triton here).

Names follow the implicit-GEMM convention: an input ``x`` of ``[N, C, H, W]``, a weight of ``[K, C/groups, R, S]``,
an output of ``[N, K, P, Q]``. Seen as a GEMM per group: M = N*P*Q output pixels, N_gemm = K/groups output
channels, K_gemm = C/groups * R * S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilegemm.core.dtypes import dtype_name
from tilegemm.core.runtime import check_same_device

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pair(name: str, value) -> tuple[int, int]:
    """An int or a pair of ints as (h, w), or TypeError naming the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got a bool")
    if isinstance(value, int):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


@dataclass(frozen=True)
class Geometry:
    """Sizes and hyper-parameters of one convolution, padding resolved to (top, bottom, left, right)."""

    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    groups: int
    stride: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, bottom, left, right ("same" may pad one side more)
    dilation: tuple[int, int]

    @property
    def P(self) -> int:
        top, bottom, _, _ = self.padding
        return (self.H + top + bottom - self.dilation[0] * (self.R - 1) - 1) // self.stride[0] + 1

    @property
    def Q(self) -> int:
        _, _, left, right = self.padding
        return (self.W + left + right - self.dilation[1] * (self.S - 1) - 1) // self.stride[1] + 1

    @property
    def Cg(self) -> int:  # input channels per group
        return self.C // self.groups

    @property
    def Kg(self) -> int:  # output channels per group
        return self.K // self.groups

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.N, self.K, self.P, self.Q)

    def flops(self) -> float:
        """2 * N*P*Q * K * C/groups * R*S: one multiply-add per weight tap per output element."""
        return 2.0 * self.N * self.P * self.Q * self.K * self.Cg * self.R * self.S

    @property
    def is_depthwise(self) -> bool:
        return self.groups == self.C and self.groups > 1 and self.Cg == 1

    @property
    def is_pointwise(self) -> bool:
        """1x1, stride 1, no padding, one group: a plain GEMM over the channels-last pixels."""
        return (self.R == 1 and self.S == 1 and self.stride == (1, 1) and self.padding == (0, 0, 0, 0)
                and self.groups == 1)

    @property
    def is_strided_pointwise(self) -> bool:
        """1x1 with a stride above 1, no padding, one group: a plain GEMM over the pixels the stride keeps."""
        return (self.R == 1 and self.S == 1 and self.stride != (1, 1) and self.padding == (0, 0, 0, 0)
                and self.groups == 1)


def resolve_padding(padding, R: int, S: int, stride: tuple[int, int], dilation: tuple[int, int]):
    """(top, bottom, left, right) from an int, a pair, "same" or "valid", as F.conv2d reads them."""
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return (0, 0, 0, 0)
        if mode == "same":
            if stride != (1, 1):
                raise ValueError(f"padding='same' needs stride 1 (as in torch), got stride={stride}")
            # torch pads the extra element of an odd total at the bottom/right
            total_h, total_w = dilation[0] * (R - 1), dilation[1] * (S - 1)
            return (total_h // 2, total_h - total_h // 2, total_w // 2, total_w - total_w // 2)
        raise ValueError(f"padding must be an int, a pair of ints, 'same' or 'valid', got {padding!r}")
    ph, pw = _pair("padding", padding)
    if ph < 0 or pw < 0:
        raise ValueError(f"padding must be >= 0, got {padding!r}")
    return (ph, ph, pw, pw)


def _check_tensor(name: str, t, ranks: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        kind = "integer" if not (t.dtype.is_floating_point or t.dtype.is_complex) else "unsupported"
        raise TypeError(f"{name} has {kind} dtype {dtype_name(t.dtype)}; tilegemm.conv2d supports fp16, bf16, "
                        "fp32")
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have {want} dims, got shape {list(t.shape)}")


def check_conv(x, weight, bias, stride, padding, dilation, groups) -> Geometry:
    """Raise TypeError/ValueError naming the problem; return the resolved geometry."""
    _check_tensor("x", x, (4,))
    _check_tensor("weight", weight, (4,))
    if weight.dtype != x.dtype:
        raise TypeError(f"dtypes differ: x is {dtype_name(x.dtype)}, weight is {dtype_name(weight.dtype)}")
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"groups must be an int, got {type(groups).__name__}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    stride, dilation = _pair("stride", stride), _pair("dilation", dilation)
    if min(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if min(dilation) < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    N, C, H, W = x.shape
    K, Cg, R, S = weight.shape
    if C % groups:
        raise ValueError(f"input channels C={C} are not divisible by groups={groups}")
    if K % groups:
        raise ValueError(f"output channels K={K} (weight.shape[0]) are not divisible by groups={groups}")
    if Cg * groups != C:
        raise ValueError(f"channel mismatch: x has C={C} channels, weight {list(weight.shape)} expects "
                         f"C/groups={Cg} per group, so C={Cg * groups} for groups={groups}")
    if min(K, Cg, R, S) < 1:
        raise ValueError(f"weight must have no empty dimension, got shape {list(weight.shape)}")
    pad = resolve_padding(padding, R, S, stride, dilation)
    g = Geometry(N, C, H, W, K, R, S, groups, stride, pad, dilation)
    if g.P < 1 or g.Q < 1:
        raise ValueError(
            f"kernel larger than the padded input: input {H}x{W} padded by {pad} (top, bottom, left, right) "
            f"is smaller than the dilated kernel {dilation[0] * (R - 1) + 1}x{dilation[1] * (S - 1) + 1}")
    named = {"x": x, "weight": weight}
    if bias is not None:
        _check_tensor("bias", bias, (1,))
        if bias.dtype != x.dtype:
            raise TypeError(f"dtypes differ: x is {dtype_name(x.dtype)}, bias is {dtype_name(bias.dtype)}")
        if bias.shape[0] != K:
            raise ValueError(f"bias must have shape [K] = [{K}], got {list(bias.shape)}")
        named["bias"] = bias
    check_same_device(named)
    return g


def geometry_of(x_shape, w_shape, stride, padding, dilation, groups) -> Geometry:
    """Geometry from shapes and already-resolved lists (what the torch.library op receives)."""
    N, C, H, W = x_shape
    K, _, R, S = w_shape
    return Geometry(int(N), int(C), int(H), int(W), int(K), int(R), int(S), int(groups), tuple(stride),
                    tuple(padding), tuple(dilation))


def channels_last(t: torch.Tensor) -> bool:
    """True when ``t`` is laid out channels-last and not also plain contiguous (then NCHW wins, as in torch)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if channels_last(t) else torch.contiguous_format


@dataclass
class ConvProblem:
    """One launch's worth of a convolution: the tensors as the kernels take them, and the flags.

    A launcher takes ``x`` and ``weight`` in any layout (it makes them channels-last where its loops need that)
    and returns the output ``[N, K, P, Q]`` in ``out_format``, of ``out_dtype``.
    """

    x: torch.Tensor  # [N, C, H, W]
    weight: torch.Tensor  # [K, C/groups, R, S]
    bias: torch.Tensor | None  # [K]
    geo: Geometry
    out_dtype: torch.dtype
    out_format: torch.memory_format
    activation: str
    precision: str  # "ieee" or "tf32" (fp32 only)
    upcast: bool  # interpreter only: bf16 tiles go to fp32 before tl.dot
    out: torch.Tensor | None = None  # where the output goes (``[N, K, P, Q]`` in out_format); None: a new tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def index_64(self) -> bool:
        """True when an element offset may pass 2^31 - 1 (then kernels compute addresses in int64)."""
        limit = 2**31 - 1
        out_numel = self.geo.N * self.geo.K * self.geo.P * self.geo.Q
        return out_numel >= limit or any(t.numel() >= limit or _span(t) >= limit for t in (self.x, self.weight))


def _span(t: torch.Tensor) -> int:
    """The largest element offset a tensor's strides reach."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
