"""The records of a 2-D convolution: its geometry, the calls of the three ``torch.library`` ops (their arguments
travel in these, never as positional tuples) and the problem a kernel's launcher takes (plain Python: no
triton here).

Names follow the implicit-GEMM convention: an input ``x`` of ``[N, C, H, W]``, a weight of ``[K, C/groups, R, S]``,
an output of ``[N, K, P, Q]``. Seen as a GEMM per group: M = N*P*Q output pixels, N_gemm = K/groups output
channels, K_gemm = C/groups * R * S.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

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


def geometry_of(x_shape, w_shape, stride, padding, dilation, groups) -> Geometry:
    """Geometry from shapes and already-resolved lists (what the torch.library op receives)."""
    N, C, H, W = x_shape
    K, _, R, S = w_shape
    # SymInts (torch.compile's dynamic shapes, the fake's) kept: int() would specialize them, a recompile each size
    N, C, H, W, K, R, S, groups = (v if isinstance(v, torch.SymInt) else int(v) for v in (N, C, H, W, K, R, S, groups))
    g = Geometry(N, C, H, W, K, R, S, groups, tuple(stride), tuple(padding), tuple(dilation))
    return _least_stride(g) if type(H) is int and type(W) is int and type(R) is int and type(S) is int else g


_LONG_STRIDE = 2**15  # strides above it are cut (one output row or column): products with sizes stay in 32 bits


def _least_stride(g: Geometry) -> Geometry:
    """``g`` with a stride past ``_LONG_STRIDE`` that leaves one output row (column) cut to the least that does:
    the same convolution, and the kernels' stride arithmetic stays in 32 bits (a stride of 2**31 - 1 overflowed
    it: the depthwise forward looped on, the data gradient launched a program per stride phase, 2**62 of them)."""
    top, bottom, left, right = g.padding
    span_h = g.H + top + bottom - g.dilation[0] * (g.R - 1)  # the rows of the padded image a tap can start at
    span_w = g.W + left + right - g.dilation[1] * (g.S - 1)
    # (only past _LONG_STRIDE: a smaller one stays as given, the routes' rules read it)
    sh = max(1, span_h) if g.P == 1 and g.stride[0] > _LONG_STRIDE else g.stride[0]
    sw = max(1, span_w) if g.Q == 1 and g.stride[1] > _LONG_STRIDE else g.stride[1]
    return g if (sh, sw) == g.stride else replace(g, stride=(sh, sw))


def channels_last(t: torch.Tensor) -> bool:
    """True when ``t`` is laid out channels-last and not also plain contiguous (then NCHW wins, as in torch)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def strides_like_channels_last(t: torch.Tensor) -> bool:
    """Whether ``t.suggest_memory_format()`` is channels-last, the test torch's convolutions choose their output's
    and gradients' format by: strides ordered C < W < H < N, each at least the extent of the dims inside it. Unlike
    :func:`channels_last`, views of a channels-last tensor pass (a slice of its channels or its batch, as
    ``torch.chunk`` gives), and ``[C, H, W]`` of an HWC image unsqueezed to a batch of one does not. A tensor
    contiguous either way (a 1x1 filter, one channel a group) is read by its strides alone, as torch reads it: a
    ``[K, C, 1, 1]`` weight made channels-last passes, one made contiguous does not."""
    if t.dim() != 4:
        return False
    sizes, strides = t.shape, t.stride()
    if not all(type(v) is int for v in (*sizes, *strides)):  # symbolic (torch.compile's dynamic shapes): torch's own
        from torch._prims_common import suggest_memory_format

        return suggest_memory_format(t) == torch.channels_last
    if strides[1] == 0:  # (channels broadcast: NCHW, as torch)
        return False
    extent = 0
    for d in (1, 3, 2, 0):
        # (d = 0 at the channels' stride: [N, 1, 1, 1]-like, as NCHW as channels-last; torch says NCHW)
        if sizes[d] == 0 or strides[d] < extent or d == 0 and strides[1] == extent:
            return False
        extent = strides[d] * sizes[d]
    return True


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if channels_last(t) else torch.contiguous_format


def output_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """A convolution's output memory format: channels-last where ``x`` or the weight is (strided like it,
    :func:`strides_like_channels_last`), as torch's convolutions choose it (a channels-last model fed NCHW images
    gives channels-last outputs from its first layer on, and its next layers read them in place), else
    contiguous."""
    return torch.channels_last if strides_like_channels_last(x) or strides_like_channels_last(weight) \
        else torch.contiguous_format


def wgrad_format(x: torch.Tensor, w_shape, w_channels_last: bool = False) -> torch.memory_format:
    """The weight gradient's memory format: that of the layer's output (:func:`output_format`: channels-last where
    ``x`` or the weight, ``w_channels_last``, is strided like it), as torch's convolution backward returns it; but
    contiguous for a filter of one tap or one channel a group, where the two layouts are the same memory.
    Channels-last, the kernels store a tile of one tap as whole rows, not one element every R*S."""
    _, cg, r, s = w_shape
    return torch.channels_last if r * s > 1 and cg > 1 and (w_channels_last or strides_like_channels_last(x)) \
        else torch.contiguous_format


# --- the calls of the three ops (tilegemm.ops.conv2d.op), in their schemas' order ---------------------------


@dataclass(frozen=True)
class ConvCall:
    """One forward call (``tilegemm::conv2d``): ``activation(conv2d(x, weight) + bias)`` in ``out_dtype`` (None:
    x's), the hyper-parameters resolved to lists (padding as top, bottom, left, right)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: list
    padding: list
    dilation: list
    groups: int
    activation: str
    precision: str  # a name check_precision takes, or "default" (torch's fp32 matmul precision when it runs)
    kernel: str
    out_dtype: torch.dtype | None = None

    def op_args(self) -> tuple:
        return (self.x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
                self.activation, self.precision, self.kernel, self.out_dtype)

    def geometry(self) -> Geometry:
        return geometry_of(self.x.shape, self.weight.shape, self.stride, self.padding, self.dilation, self.groups)


@dataclass(frozen=True)
class DgradCall:
    """One data gradient (``tilegemm::conv2d_dgrad``): grad of x ``x_shape`` from ``dy``, channels-last where
    ``x_channels_last`` says (autograd's backward sets it from :func:`output_format`, as torch's returns it)."""

    dy: torch.Tensor
    weight: torch.Tensor
    x_shape: list
    x_channels_last: bool
    stride: list
    padding: list
    dilation: list
    groups: int
    precision: str

    def op_args(self) -> tuple:
        return (self.dy, self.weight, self.x_shape, self.x_channels_last, self.stride, self.padding, self.dilation,
                self.groups, self.precision)

    def geometry(self) -> Geometry:
        return geometry_of(self.x_shape, self.weight.shape, self.stride, self.padding, self.dilation, self.groups)

    @property
    def x_format(self) -> torch.memory_format:
        return torch.channels_last if self.x_channels_last else torch.contiguous_format


@dataclass(frozen=True)
class WgradCall:
    """One weight gradient (``tilegemm::conv2d_wgrad``): grad of a weight of ``w_shape`` from ``dy`` and ``x``, in
    :func:`wgrad_format` (``w_channels_last``: the weight is strided channels-last,
    :func:`strides_like_channels_last`)."""

    dy: torch.Tensor
    x: torch.Tensor
    w_shape: list
    stride: list
    padding: list
    dilation: list
    groups: int
    precision: str
    w_channels_last: bool = False

    def op_args(self) -> tuple:
        return (self.dy, self.x, self.w_shape, self.stride, self.padding, self.dilation, self.groups, self.precision,
                self.w_channels_last)

    @property
    def w_format(self) -> torch.memory_format:
        return wgrad_format(self.x, self.w_shape, self.w_channels_last)

    def geometry(self) -> Geometry:
        return geometry_of(self.x.shape, self.w_shape, self.stride, self.padding, self.dilation, self.groups)


@dataclass(frozen=True)
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
        out_numel = self.geo.N * self.geo.K * self.geo.P * self.geo.Q
        return out_numel >= 2**31 - 1 or needs_index_64(self.x, self.weight)


def needs_index_64(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into one of ``tensors`` may pass 2^31 - 1: by its size, or by its strides (a view
    into a larger tensor reaches past its own element count)."""
    return any(t.numel() >= 2**31 - 1 or _span(t) >= 2**31 - 1 for t in tensors)


def _span(t: torch.Tensor) -> int:
    """The largest element offset a tensor's strides reach."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
