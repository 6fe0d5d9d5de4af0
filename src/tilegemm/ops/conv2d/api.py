"""``tilegemm.conv2d``: the replay fast path, the checks, then the op or a plain call."""

from __future__ import annotations

import torch

from tilegemm.core.activations import check_activation
from tilegemm.core.dtypes import autocast_inputs, check_precision
from tilegemm.core.launch import PLAIN_TENSOR_TYPES, plain_call
from tilegemm.core.runtime import any_negative, resolved as resolved_neg
from tilegemm.core.torch_ops import own_storage
from tilegemm.ops.conv2d import dispatch, op
from tilegemm.ops.conv2d.checks import check_conv, check_kernel, check_unbatched, forward_key, forward_key_of
from tilegemm.ops.conv2d.op import REPLAYS
from tilegemm.ops.conv2d.problem import ConvCall, output_format


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    activation: str | None = None,
    *,
    precision: str | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """``activation(F.conv2d(x, weight, bias, stride, padding, dilation, groups))`` in one kernel.

    Args:
        x: ``[N, C, H, W]``, float16, bfloat16 or float32; NCHW or channels-last (the fast path). The output
            ``[N, K, P, Q]`` is channels-last where ``x`` or ``weight`` is, as torch's, else contiguous. An
            unbatched ``[C, H, W]`` gives ``[K, P, Q]``, as ``F.conv2d``.
        weight: ``[K, C/groups, R, S]``, the dtype of ``x``.
        bias: ``[K]``, added in the epilogue.
        stride, dilation: an int or a pair (>= 1).
        padding: an int, a pair, ``"same"`` (stride 1 only; an odd total pads bottom/right more, as torch) or
            ``"valid"``. Zero padding.
        groups: any divisor of C and K; ``groups = C`` is a depthwise convolution.
        activation: ``None``/``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"leaky_relu"``
            (slope 0.01), applied after the bias.
        precision: for float32 inputs, ``"ieee"``/``"highest"`` or ``"tf32"``/``"high"``/``"medium"``; by default
            ``torch.get_float32_matmul_precision()`` (read when the op runs).
        kernel: ``"auto"`` or a name from ``tilegemm.kernels("conv2d")``.

    Differentiable in x, weight and bias, to any order (the backward runs tilegemm's kernels too); the gradients
    of x and the weight take the output's memory format, as torch's convolution backward returns them. Under
    ``torch.autocast`` the floating-point tensors on the autocast device, float64 excepted, are cast to its dtype
    first, as autocast casts ``F.conv2d``'s. Under ``torch.fx.symbolic_trace`` the call is one ``call_function``
    node.

    Raises:
        TypeError, ValueError: naming the bad argument (ranks, dtypes, devices, channel counts, sizes).
    """
    if (type(x) not in PLAIN_TENSOR_TYPES or type(weight) not in PLAIN_TENSOR_TYPES) \
            and _fx_proxy(x, weight, bias) is not None:
        # torch.fx.symbolic_trace: one node for the call (the checks below cannot branch on a Proxy)
        return _fx_proxy(x, weight, bias).tracer.create_proxy(
            "call_function", conv2d, (x, weight, bias, stride, padding, dilation, groups, activation),
            {"precision": precision, "kernel": kernel})
    if torch._C._is_any_autocast_enabled():
        x, weight, bias = autocast_inputs(x, weight, bias)
    if isinstance(x, torch.Tensor) and x.ndim not in (3, 4):  # (named here: the checks below see 4-D only)
        raise ValueError(f"x must be a batched [N, C, H, W] (4 dims) or unbatched [C, H, W] (3 dims) input, got "
                         f"shape {list(x.shape)}")
    if isinstance(x, torch.Tensor) and x.ndim == 3:  # unbatched [C, H, W], as F.conv2d takes it: a batch of one
        # (a tensor only: a 3-D array or list goes on to the checks, which name its type)
        check_unbatched(x)  # (an empty H or W named as given, not as the batch of one checked below)
        return conv2d(x.unsqueeze(0), weight, bias, stride, padding, dilation, groups, activation,
                      precision=precision, kernel=kernel).squeeze(0)
    if activation is None:
        activation = "none"
    # The key first: a hit replays a call that passed every check below with the same arguments and layouts.
    key = forward_key(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel)
    if key is not None:
        out = REPLAYS.replayed(key, (x, weight) if bias is None else (x, weight, bias))
        if out is not None:
            return out
    # Under autograd no call has a replay key, but the checks need one pass per layout (docs/conv2d.md, "Host
    # fast path"): a layout that passed them keeps its resolved geometry.
    layout = None if key is not None else _layout_key(x, weight, bias, stride, padding, dilation, groups, activation,
                                                      precision, kernel)
    resolved = None if layout is None else _PASSED.get(layout)
    if resolved is None:
        check_activation(activation)
        if precision is not None:
            check_precision(precision)
        check_kernel(kernel)
        g = check_conv(x, weight, bias, stride, padding, dilation, groups)
        resolved = (g.stride, g.padding, g.dilation, g.groups)
        if layout is not None:
            if len(_PASSED) >= MAX_LAYOUTS:
                _PASSED.clear()
            _PASSED[layout] = resolved
    if any_negative(x, weight, bias):  # (z.conj().imag: the kernels would read the values negated; never keyed)
        x, weight, bias = resolved_neg(x, weight, bias)
    c = ConvCall(x, weight, bias, list(resolved[0]), list(resolved[1]), list(resolved[2]), resolved[3], activation,
                 precision or "default", kernel)
    if key is not None:
        with REPLAYS.recording(key, (x, weight) if bias is None else (x, weight, bias),
                               output_format(x, weight)) as kept:
            return kept(own_storage(dispatch.forward(c)))
    if plain_call(x, weight, bias):  # (own_storage: a 1x1's GEMM result reshaped is a view, as torch's is not)
        return own_storage(dispatch.forward(c))
    return op.call(c)


_PASSED: dict = {}  # the layout key of a call that passed the checks -> its (stride, padding, dilation, groups)
MAX_LAYOUTS = 4096  # forgotten all at once past this many: a model's layers make a few hundred


def _layout_key(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel):
    """What the checks of a call read (:func:`forward_key_of`: the tensors' dtypes, shapes, strides and devices,
    the arguments), or None: a tensor that is not plain (a subclass, a tracer's, one without storage) or on the
    meta device, or while Dynamo traces. The checks read no tensor's values, so a layout that passed them passes
    again."""
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest (it reads data pointers)
        return None
    if type(x) not in PLAIN_TENSOR_TYPES or type(weight) not in PLAIN_TENSOR_TYPES or x.is_meta \
            or bias is not None and type(bias) not in PLAIN_TENSOR_TYPES:
        return None
    try:
        return forward_key_of(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel)
    except (RuntimeError, AttributeError):  # (a functorch wrapper has no data pointer)
        return None


def forget_checks() -> None:
    """Forget the layouts that passed the checks (tests)."""
    _PASSED.clear()


def _fx_proxy(*args):
    """The first of ``args`` that is a ``torch.fx.Proxy`` (symbolic tracing), or None."""
    for a in args:
        if isinstance(a, torch.fx.Proxy):
            return a
    return None

