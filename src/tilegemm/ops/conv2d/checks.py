"""The argument checks of ``tilegemm.conv2d`` (TypeError/ValueError naming the problem), and the key of a plain
call that the replay cache (:mod:`tilegemm.core.replay`) keeps (plain Python: no triton)."""

from __future__ import annotations

import operator

import torch

from tilegemm.core import registry
from tilegemm.core.activations import ACTIVATIONS
from tilegemm.core.dtypes import check_precision, dtype_name, torch_fp32_precision
from tilegemm.core.launch import (PLAIN_TENSOR_TYPES, dispatch_stack_depth, forward_ad_on, function_mode_on,
                                  jit_tracing, recording_active, tensor_key)
from tilegemm.core.runtime import check_dense, check_same_device, interpreting
from tilegemm.core.workspace import in_graph_tree
from tilegemm.ops.conv2d.problem import Geometry

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _int(value) -> int | None:
    """``value`` as an int where it is one or stands for one (numpy's integers, as F.conv2d takes them), else
    None; a bool is none."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, int):
        return value
    # (no try/except: torch.compile traces this, and its operator.index of a tuple is an internal error)
    if isinstance(value, (tuple, list, str)) or not hasattr(type(value), "__index__"):
        return None
    # (a numpy array has __index__ but takes it only as an integer scalar: its TypeError named no argument)
    if getattr(value, "ndim", 0) != 0 or getattr(getattr(value, "dtype", None), "kind", "i") not in "iu":
        return None
    return operator.index(value)


def _pair(name: str, value) -> tuple[int, int]:
    """An int, a pair of ints or a one-element sequence (expanded to both, as F.conv2d and nn.Conv2d take it) as
    (h, w), or TypeError naming the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got a bool")
    if _int(value) is not None:
        return _int(value), _int(value)
    if isinstance(value, (tuple, list)) and len(value) in (1, 2) and all(_int(v) is not None for v in value):
        return _int(value[0]), _int(value[-1])
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


INDEX_LIMIT = 2**31 - 1  # the kernels' row and column coordinates (p * stride - pad + r * dilation) are int32
INT64_LIMIT = 2**63 - 1  # what a kernel argument (and a tensor's size in bytes) can be


def check_padded_size(padding, H: int, W: int, pad: tuple[int, int, int, int]) -> None:
    """ValueError naming ``padding`` where it pads an ``H x W`` input past what the kernels index in 32 bits."""
    top, bottom, left, right = pad
    Hp, Wp = H + top + bottom, W + left + right
    if (top + bottom or left + right) and max(Hp, Wp) > INDEX_LIMIT:
        raise ValueError(f"padding={padding!r} pads the {H}x{W} input to {Hp}x{Wp} (top, bottom, left, right = "
                         f"{pad}): past 2**31 - 1 rows or columns, which the kernels' 32-bit index math cannot "
                         f"address")


def resolve_padding(padding, R: int, S: int, stride: tuple[int, int], dilation: tuple[int, int]):
    """(top, bottom, left, right) from an int, a pair, "same" or "valid", as F.conv2d reads them."""
    if isinstance(padding, str):
        if padding == "valid":  # lowercase only, as F.conv2d and nn.Conv2d
            return (0, 0, 0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(f"padding='same' needs stride 1 (as in torch), got stride={stride}")
            # torch pads the extra element of an odd total at the bottom/right
            total_h, total_w = dilation[0] * (R - 1), dilation[1] * (S - 1)
            return (total_h // 2, total_h - total_h // 2, total_w // 2, total_w - total_w // 2)
        raise ValueError(f"padding must be an int, a pair of ints, 'same' or 'valid' (lowercase, as torch), got "
                         f"{padding!r}")
    ph, pw = _pair("padding", padding)
    if ph < 0 or pw < 0:
        raise ValueError(f"padding must be >= 0, got {padding!r}")
    return (ph, ph, pw, pw)


def _check_tensor(name: str, t, ranks: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)
    if t.dtype not in DTYPES:
        kind = "unsupported" if t.dtype.is_floating_point or t.dtype.is_complex else \
            "boolean" if t.dtype == torch.bool else "integer"
        raise TypeError(f"{name} has {kind} dtype {dtype_name(t.dtype)}; tilegemm.conv2d supports fp16, bf16, "
                        "fp32")
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have {want} dims, got shape {list(t.shape)}")


def check_conv(x, weight, bias, stride, padding, dilation, groups, resolved_pad=None) -> Geometry:
    """Raise TypeError/ValueError naming the problem; return the resolved geometry. ``resolved_pad``: padding
    as (top, bottom, left, right) already (the registered op's), instead of ``padding`` resolved."""
    _check_tensor("x", x, (4,))
    _check_tensor("weight", weight, (4,))
    if weight.dtype != x.dtype:
        raise TypeError(f"dtypes differ: x is {dtype_name(x.dtype)}, weight is {dtype_name(weight.dtype)}")
    if _int(groups) is None:
        raise TypeError(f"groups must be an int, got {type(groups).__name__}")
    groups = _int(groups)
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    stride, dilation = _pair("stride", stride), _pair("dilation", dilation)
    if min(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if min(dilation) < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    for name, pair in (("stride", stride), ("dilation", dilation)):  # (Triton cannot pass a larger int)
        if max(pair) > INT64_LIMIT:
            raise ValueError(f"{name} must be at most 2**63 - 1 (an int64), got {pair}")
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
    if N and (H == 0 or W == 0):
        # F.conv2d refuses this too (only an empty batch may be empty): the output would be all padding
        raise ValueError(f"x has an empty spatial dimension (H={H}, W={W}) in a batch of {N}: only the batch "
                         f"may be empty, as in torch")
    pad = resolve_padding(padding, R, S, stride, dilation) if resolved_pad is None else tuple(resolved_pad)
    check_padded_size(padding, H, W, pad)
    g = Geometry(N, C, H, W, K, R, S, groups, stride, pad, dilation)
    if g.P < 1 or g.Q < 1:
        raise ValueError(
            f"kernel larger than the padded input: input {H}x{W} padded by {pad} (top, bottom, left, right) "
            f"is smaller than the dilated kernel {dilation[0] * (R - 1) + 1}x{dilation[1] * (S - 1) + 1}")
    if N * K * g.P * g.Q * x.element_size() > INT64_LIMIT:  # (torch's own message: a storage size overflow)
        raise ValueError(f"padding={padding!r} makes the output [N, K, P, Q] = {list(g.out_shape)}: more bytes than "
                         f"a tensor can hold (2**63 - 1)")
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


def _check_lists(op: str, stride, padding, dilation) -> None:
    """The registered ops' geometry lists as the public functions pass them: stride and dilation pairs, padding as
    (top, bottom, left, right)."""
    for name, value, n in (("stride", stride, 2), ("padding", padding, 4), ("dilation", dilation, 2)):
        if len(value) != n:
            raise ValueError(f"{op}: {name} must be a list of {n} ints"
                             f"{' (top, bottom, left, right)' if n == 4 else ''}, got {list(value)}")


def check_op_call(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel,
                  out_dtype) -> None:
    """The checks of ``torch.ops.tilegemm.conv2d`` called directly, which nothing before it checked (a stride of
    0 divided by zero, a float64 x failed inside the kernel): the public function's, on the arguments as it
    passes them (a batched x; stride and dilation pairs; padding as (top, bottom, left, right))."""
    _check_lists("tilegemm::conv2d", stride, padding, dilation)
    if min(padding) < 0:
        raise ValueError(f"padding must be >= 0, got {list(padding)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of: {', '.join(ACTIVATIONS)}")
    if precision != "default":
        check_precision(precision)
    check_kernel(kernel)
    if out_dtype is not None and out_dtype not in DTYPES:
        raise TypeError(f"out_dtype must be None, fp16, bf16 or fp32, got {dtype_name(out_dtype)}")
    check_conv(x, weight, bias, tuple(stride), list(padding), tuple(dilation), groups, resolved_pad=padding)


def check_grad_call(op: str, dy, other, shape, stride, padding, dilation, groups: int) -> None:
    """The checks of ``torch.ops.tilegemm.conv2d_dgrad`` (``other`` the weight, ``shape`` x's) and ``conv2d_wgrad``
    (``other`` x, ``shape`` the weight's) called directly: the shapes one convolution relates (a shape that did not
    fit read channels or rows that do not exist). Skipped on dynamic sizes (a trace: the forward checked them)."""
    from tilegemm.ops.conv2d.problem import geometry_of

    name = f"tilegemm::conv2d_{op}"
    _check_lists(name, stride, padding, dilation)
    # (the values the forward's checks would have refused: a stride of 0 divided by zero, a negative padding
    # returned a gradient of nothing, mixed or integer dtypes failed inside the kernels)
    for what, value, least in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if any(type(v) is int and v < least for v in value):
            raise ValueError(f"{name}: {what} must be >= {least}, got {list(value)}")
    other_name = "weight" if op == "dgrad" else "x"
    _check_tensor("dy", dy, (dy.dim(),))
    _check_tensor(other_name, other, (other.dim(),))
    if dy.dtype != other.dtype:
        raise TypeError(f"{name}: dy is {dtype_name(dy.dtype)} and {other_name} {dtype_name(other.dtype)}: give both "
                        f"one dtype")
    if len(shape) != 4 or dy.dim() != 4 or other.dim() != 4:
        raise ValueError(f"{name}: dy, {'weight' if op == 'dgrad' else 'x'} and the "
                         f"{'x' if op == 'dgrad' else 'weight'} shape must be 4-D, got {list(dy.shape)}, "
                         f"{list(other.shape)}, {list(shape)}")
    x_shape, w_shape = (list(shape), list(other.shape)) if op == "dgrad" else (list(other.shape), list(shape))
    sizes = [*x_shape, *w_shape, *dy.shape, groups]
    if not all(type(v) is int for v in sizes):
        return
    if groups < 1 or w_shape[0] % groups:
        raise ValueError(f"{name}: the weight's K={w_shape[0]} output channels are not divisible by groups={groups}")
    if x_shape[1] != w_shape[1] * groups:
        raise ValueError(f"{name}: x {x_shape} has C={x_shape[1]} channels, the weight {w_shape} takes "
                         f"{w_shape[1]} a group: C={w_shape[1] * groups} for groups={groups}")
    want = list(geometry_of(x_shape, w_shape, stride, padding, dilation, groups).out_shape)
    if list(dy.shape) != want:
        raise ValueError(f"{name}: dy is {list(dy.shape)}, but x {x_shape} and weight {w_shape} with stride "
                         f"{list(stride)}, padding {list(padding)} and dilation {list(dilation)} make {want}")


def check_unbatched(x: torch.Tensor) -> None:
    """ValueError for an unbatched ``[C, H, W]`` x with an empty H or W, named as the caller gave it (the rest of
    the checks see it as a batch of one, ``[1, C, H, W]``)."""
    _, H, W = x.shape
    if H == 0 or W == 0:  # F.conv2d refuses this too: the output would be all padding
        raise ValueError(f"x has an empty spatial dimension (H={H}, W={W}) in an unbatched [C, H, W] input of shape "
                         f"{list(x.shape)}: only a batched input's batch may be empty, as in torch")


def check_kernel(kernel) -> None:
    """TypeError for a kernel name that is not a str, ValueError naming the choices for an unknown one,
    :class:`~tilegemm.core.registry.NotApplicable` for one that cannot run on this machine."""
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
    if kernel != "auto":
        reason = registry.get("conv2d", kernel).unavailable_reason()  # ValueError naming the choices if unknown
        if reason:
            raise registry.NotApplicable(f"conv2d kernel {kernel!r} cannot run here: {reason}")


# --- the replay key (tilegemm.core.replay) ---------------------------------------------------------------
# A call's Python path (checks, geometry, config, layouts, Triton's launch wrapper) costs more host time than most
# of ResNet-50's layers take on the GPU (docs/conv2d.md). A plain call (CUDA, no tracer, dispatch mode or autograd
# watching) is keyed by everything its launches depend on; the first records its launches (up to eight Triton
# launches over the call's tensors or the launchers' workspaces) and later calls with the key replay them. A call
# whose path makes copies or torch ops of its own is not kept. Inside another op's recording nothing replays.


def _replayable(x, weight, bias) -> bool:
    """The tests of :func:`plain_call` spelled out for host time, shared by both keys: no tracer, mode, recording
    or autograd watching; plain CUDA tensors; not the interpreter."""
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest (guards on thread state)
        return False
    if type(x) not in PLAIN_TENSOR_TYPES or type(weight) not in PLAIN_TENSOR_TYPES or not x.is_cuda:
        return False
    if (interpreting() or recording_active() or dispatch_stack_depth() or function_mode_on() or in_graph_tree()
            or jit_tracing() or forward_ad_on()):
        return False
    if bias is not None and type(bias) not in PLAIN_TENSOR_TYPES:
        return False
    if x.is_neg() or weight.is_neg() or bias is not None and bias.is_neg():
        return False  # a negative view (z.conj().imag): the full path resolves it, a replay would read it negated
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or bias is not None and bias.requires_grad))


def replay_key(part: str, x: torch.Tensor, weight: torch.Tensor, bias, conv: tuple, *options):
    """The key of a call, or None when it may not be replayed. ``part``: ``"fwd"``, ``"dgrad"`` or ``"wgrad"``;
    ``x`` is the activation the kernel reads (dy for the gradients); ``conv``: (stride, padding, dilation, groups)
    as given; ``options``: whatever else selects the launch (activation, precision, kernel, output layout).

    Written for host time, as matmul's: the tests of :func:`plain_call` spelled out, and the devices in the key
    rather than compared (a call on two devices is refused on the full path, so it is never recorded)."""
    if not _replayable(x, weight, bias):
        return None
    try:
        return key_of(part, x, weight, bias, conv, *options)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None


def forward_key(x: torch.Tensor, weight: torch.Tensor, bias, stride, padding, dilation, groups, activation: str,
                precision, kernel):
    """The key of a public forward call (``tilegemm.conv2d``, ``tilegemm.nn.Conv2d``), or None when it may not be
    replayed: :func:`replay_key`'s tests in the same order, and a flat tuple of what :func:`key_of` keeps.

    Flat for host time: a replayed call's key is on every call's path, and nested tensor keys cost a tuple and a
    hash each. A key that hits vouches for the checks: the recorded call had the same dtypes, shapes, strides,
    devices and arguments, so nothing is checked again. Only ints, pairs of ints and padding strings are keyed
    (a list as its tuple): a bool or float, equal to an int in a tuple, gets no key and meets the checks.
    ``activation``: already "none" for None."""
    if not _replayable(x, weight, bias):
        return None
    try:
        return forward_key_of(x, weight, bias, stride, padding, dilation, groups, activation, precision, kernel)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None


def forward_key_of(x: torch.Tensor, weight: torch.Tensor, bias, stride, padding, dilation, groups, activation,
                   precision, kernel):
    """The key itself (see :func:`forward_key`), or None if an argument cannot be part of one."""
    # stride, padding, dilation: an int, a str (padding), or a pair of ints (a list keyed as its tuple)
    t = type(stride)
    if t is not int:
        if (t is not tuple and t is not list) or len(stride) != 2 or type(stride[0]) is not int \
                or type(stride[1]) is not int:
            return None
        if t is list:
            stride = (stride[0], stride[1])
    t = type(padding)
    if t is not int and t is not str:
        if (t is not tuple and t is not list) or len(padding) != 2 or type(padding[0]) is not int \
                or type(padding[1]) is not int:
            return None
        if t is list:
            padding = (padding[0], padding[1])
    t = type(dilation)
    if t is not int:
        if (t is not tuple and t is not list) or len(dilation) != 2 or type(dilation[0]) is not int \
                or type(dilation[1]) is not int:
            return None
        if t is list:
            dilation = (dilation[0], dilation[1])
    if type(groups) is not int or type(activation) is not str or type(kernel) is not str \
            or precision is not None and type(precision) is not str:
        return None
    dtype = x.dtype
    if bias is None:
        return ("fwd", dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16 == 0, weight.dtype, weight.shape,
                weight.stride(), weight.device, weight.data_ptr() % 16 == 0, stride, padding, dilation, groups,
                activation, precision, kernel,
                torch_fp32_precision() if dtype is torch.float32 else None)
    # With a bias, its part in the same literal (a second tuple concatenated on is one more allocation a call)
    return ("fwd", dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16 == 0, weight.dtype, weight.shape,
            weight.stride(), weight.device, weight.data_ptr() % 16 == 0, stride, padding, dilation, groups,
            activation, precision, kernel,
            torch_fp32_precision() if dtype is torch.float32 else None,
            bias.dtype, bias.shape, bias.stride(), bias.device, bias.data_ptr() % 16 == 0)


_OPTION_TYPES = (str, int, bool, tuple, type(None))


def key_of(part: str, x: torch.Tensor, weight: torch.Tensor, bias, conv: tuple, *options):
    """The key itself (see :func:`replay_key`), or None if an argument cannot be part of one."""
    geometry = []
    for c in conv:  # ints, strings ("same") and sequences of ints, as the public function takes them
        t = type(c)
        if t is list or t is tuple:
            for v in c:
                if type(v) is not int:
                    return None  # something the checks will reject, naming it, on the full path
            c = tuple(c)
        elif t is not int and t is not str:
            return None
        geometry.append(c)
    for o in options:
        if type(o) not in _OPTION_TYPES:
            return None
    precision = torch_fp32_precision() if x.dtype == torch.float32 else None
    return (part, tensor_key(x), tensor_key(weight), None if bias is None else tensor_key(bias), tuple(geometry),
            precision, options)
