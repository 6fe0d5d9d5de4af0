"""Argument checks of ``tilegemm.grouped_mm`` and ``tilegemm.w4a16.grouped_matmul``: TypeError/ValueError naming
the problem; and the keys of plain calls that the family's replay cache keeps (:mod:`tilegemm.core.replay`).

Checks that need the values of ``offs`` (non-decreasing, within the grouped dimension) are made only where
``offs`` is on the CPU (under the interpreter) and nothing traces the call: on the GPU reading them would stall
the host on the device and break CUDA-graph capture. A kernel clamps every group to the operand's bounds, so
bad values there give wrong numbers, never a fault.
"""

from __future__ import annotations

import torch

from tilegemm.core import registry
from tilegemm.core.activations import check_activation
from tilegemm.core.dtypes import dtype_name, resolve_precision
from tilegemm.core.launch import PLAIN_TENSOR_TYPES, plain_call, recording_active, tensor_key
from tilegemm.core.runtime import any_negative, check_dense, check_same_device, interpreting
from tilegemm.core.workspace import in_graph_tree
from tilegemm.ops.w4a16 import Int4Weight, validate, weight_of_op_args

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)


def check_offs(offs, groups: int | None, groups_of: str, grouped_dim: str, extent: int) -> None:
    """``offs``: int32, 1-D, ``groups`` long (None: any length; ``groups_of`` names where that number comes
    from), the cumulative ends of groups along ``grouped_dim`` of ``extent`` (the value checks only where they cost
    no device sync)."""
    _tensor("offs", offs)
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32 (the cumulative ends of the groups), got {dtype_name(offs.dtype)}")
    if offs.dim() != 1:
        raise ValueError(f"offs must be 1-D [G], got shape {list(offs.shape)}")
    if groups is not None and offs.shape[0] != groups:
        raise ValueError(f"offs has {offs.shape[0]} entries but there are {groups} groups ({groups_of}); offs "
                         f"splits {grouped_dim}")
    # (not on a batched tensor of vmap, which reports type Tensor but has no values to read here: the op then runs
    # a call a batch element, each checked)
    if offs.device.type == "cpu" and offs.numel() and not torch.compiler.is_compiling() \
            and _values_readable(offs) and not _batched(offs):
        v = offs.to(torch.int64)
        if int(v[0]) < 0:
            raise ValueError(f"offs[0] = {int(v[0])} is negative")
        if offs.numel() > 1 and bool((v[1:] < v[:-1]).any()):
            raise ValueError(f"offs must be non-decreasing (cumulative ends of the groups), got {offs.tolist()}")
        if int(v[-1]) > extent:
            raise ValueError(f"offs[-1] = {int(v[-1])} is past the end of the grouped dimension, {grouped_dim} = "
                             f"{extent}")


def _values_readable(t: torch.Tensor) -> bool:
    """Whether the check may read ``t``'s values: torch's own tensor, or a subclass overriding neither torch function
    nor dispatch (a tracer's fake or functional tensor, a DTensor: no values to read here)."""
    cls = type(t)
    return cls in (torch.Tensor, torch.nn.Parameter) or (
        cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and getattr(cls.__torch_function__, "__func__", None) is torch.Tensor.__torch_function__.__func__)


def _batched(t: torch.Tensor) -> bool:
    try:
        return torch._C._functorch.is_batchedtensor(t)
    except AttributeError:  # a torch without functorch's C module
        return False


def check_op_devices(names: tuple, tensors: tuple) -> None:
    """The device check of a registered op's body (``tensors``, None for an absent one, named by ``names``): called
    directly (``torch.ops.tilegemm.moe_route``, ...) nothing checked that they share a device, and CPU tensors while
    kernels compile for the GPU reached Triton's launch, whose error names no tensor. Tensors on one CUDA device pass
    on a short path (this runs on every call of a compiled graph); others get :func:`check_same_device`'s errors."""
    device = tensors[0].device
    if device.type == "cuda":
        for t in tensors:
            if t is not None and t.device != device:
                break
        else:
            return
    check_same_device({n: t for n, t in zip(names, tensors) if t is not None})


def check_grouped(a, b, offs, bias, out_dtype) -> tuple[str, int]:
    """Check a ``grouped_mm`` call; return its layout (``"2d3d"``, ...) and number of groups."""
    _tensor("a", a)
    _tensor("b", b)
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(t.dtype)}; grouped_mm takes fp16, bf16 or fp32")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got a {dtype_name(a.dtype)} and b {dtype_name(b.dtype)}")
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
        if out_dtype not in (a.dtype, torch.float32):
            raise TypeError(f"out_dtype must be the operands' dtype ({dtype_name(a.dtype)}) or fp32, got "
                            f"{dtype_name(out_dtype)}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"a and b must be 2-D or 3-D, got a {list(a.shape)} and b {list(b.shape)}")
    layout = f"{a.dim()}d{b.dim()}d"
    named = {"a": a, "b": b}
    if layout == "3d3d":
        if offs is not None:
            raise ValueError("offs must be None when a and b are both 3-D (a batched product: one group per batch)")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"a and b have different numbers of groups: a {list(a.shape)}, b {list(b.shape)}")
        if a.shape[2] != b.shape[1]:
            raise ValueError(f"K mismatch: a is [G, M, K] = {list(a.shape)}, b is [G, K, N] = {list(b.shape)}")
        groups = a.shape[0]
    else:
        if offs is None:
            what = {"2d3d": "a's rows", "2d2d": "K", "3d2d": "b's columns"}[layout]
            raise ValueError(f"offs is required for a {a.dim()}-D a and a {b.dim()}-D b: it splits {what} into "
                             f"groups (int32 cumulative ends)")
        if layout == "2d3d":
            if a.shape[1] != b.shape[1]:
                raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)}, b is [G, K, N] = {list(b.shape)}")
            groups = b.shape[0]
            check_offs(offs, groups, "b.shape[0]", "a's rows: a.shape[0]", a.shape[0])
        elif layout == "2d2d":
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)}, b is [K, N] = {list(b.shape)}")
            check_offs(offs, None, "", "K: a.shape[1]", a.shape[1])
            groups = offs.shape[0]
        else:
            if a.shape[2] != b.shape[0]:
                raise ValueError(f"K mismatch: a is [G, M, K] = {list(a.shape)}, b is [K, N] = {list(b.shape)}")
            groups = a.shape[0]
            check_offs(offs, groups, "a.shape[0]", "b's columns: b.shape[1]", b.shape[1])
        named["offs"] = offs
    if bias is not None:
        _tensor("bias", bias)
        if bias.dtype not in (a.dtype, out_dtype or a.dtype):
            also = "" if out_dtype in (None, a.dtype) else f" or the output's, {dtype_name(out_dtype)}"
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected the operands' "
                            f"{dtype_name(a.dtype)}{also}")
        N = b.shape[-1]
        shapes = [(N,)] if layout == "3d2d" else [(N,), (groups, N)]
        if tuple(bias.shape) not in shapes:
            raise ValueError(f"bias must have shape {' or '.join(str(list(s)) for s in shapes)}, got "
                             f"{list(bias.shape)}")
        named["bias"] = bias
    check_same_device(named)
    return layout, groups


def check_grouped_int4(x, w, offs, bias, activation, gated: bool = False) -> None:
    """Check a ``w4a16.grouped_matmul`` call (w: an ``Int4Weight`` of stacked experts ``[E, N, K]``)."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight of stacked experts (tilegemm.w4a16.quantize of an [E, N, K] "
                        f"weight), got {type(w).__name__}")
    if len(w.shape) != 3:
        raise ValueError(f"w must hold stacked experts [E, N, K]; this Int4Weight is {list(w.shape)} (quantize "
                         f"the 3-D weight)")
    validate(w, values=True)
    _tensor("x", x)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x has dtype {dtype_name(x.dtype)}; grouped_matmul takes fp16 or bf16 activations")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {dtype_name(x.dtype)} but the weight's scales are {dtype_name(w.dtype)}: convert one "
                        f"(w.to({x.dtype}))")
    E, N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, K] with K = {K} (the experts' in_features), got {list(x.shape)}")
    if offs is None:
        raise ValueError("offs is required: the int32 cumulative ends of each expert's rows of x")
    check_offs(offs, E, "the experts: w.shape[0]", "x's rows: x.shape[0]", x.shape[0])
    named = {"x": x, "w": w.qweight, "offs": offs}
    if bias is not None:
        _tensor("bias", bias)
        if bias.dtype != x.dtype:  # x's dtype is the output's, as for w4a16.matmul
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected x's dtype, {dtype_name(x.dtype)} "
                            f"(the output's)")
        if tuple(bias.shape) not in ((N,), (E, N)):
            raise ValueError(f"bias must have shape [{N}] or [{E}, {N}], got {list(bias.shape)}")
        named["bias"] = bias
    if gated and N % 2:
        raise ValueError(f"a gated product needs an even number of weight rows (gate, then up), got {N}")
    check_activation(activation)
    check_same_device(named)


# --- the checks of a call, shared by each public function and its registered op (called directly, an op's body
# checks its arguments itself: nothing else did) --------------------------------------------------------------


def check_mm_call(a, b, offs, bias, out_dtype, kernel) -> tuple[str, int]:
    """The checks of ``grouped_mm`` and of ``torch.ops.tilegemm.grouped_mm``: :func:`check_grouped` and the
    kernel's name; return the layout and number of groups."""
    if kernel != "auto":  # the name first: its refusal does not depend on where the tensors are
        registry.get("grouped", kernel)
    return check_grouped(a, b, offs, bias, out_dtype)


def check_gated_call(x, w, offs, bias, activation) -> None:
    """The checks of ``moe_gate_up`` and of ``torch.ops.tilegemm.grouped_mm_gated``: x ``[M, K]``, w ``[E, K, 2I]``
    (gate columns, then up), offs and bias as :func:`check_grouped` takes them, the activation."""
    check_activation(activation)
    # the layout first (check_grouped would take 3-D x 3-D for a batched product and ask for offs to be None)
    if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and (x.dim() != 2 or w.dim() != 3
                                                                         or w.shape[2] % 2):
        raise ValueError(f"moe_gate_up takes x [M, K] and w [E, K, 2I] (an even number of columns), got "
                         f"{list(x.shape)} and {list(w.shape)}")
    check_grouped(x, w, offs, bias, None)


def check_int4_call(x, w, offs, bias, activation, gated: bool, kernel) -> None:
    """The checks of ``w4a16.grouped_matmul`` / ``moe_gate_up_int4``: :func:`check_grouped_int4` and the kernel's
    name."""
    if kernel != "auto":  # the name first: its refusal does not depend on where the tensors are
        registry.get("grouped_w4a16", kernel)
    check_grouped_int4(x, w, offs, bias, activation, gated)


def check_int4_op_args(x, qweight, scales, zeros, offs, bias, group_k, activation, gated, kernel, fweight=None,
                       fzs=None) -> None:
    """The checks of ``torch.ops.tilegemm.grouped_w4a16`` called with its flat arguments: the stacked weight its
    parts make (:func:`tilegemm.ops.w4a16.weight_of_op_args`: qweight ``[E, K/8, N]``, scales and zeros
    ``[E, G, N]`` of group length ``group_k``, the fragment layout), then :func:`check_int4_call` on it."""
    w = weight_of_op_args(qweight, scales, zeros, group_k, None, fweight, fzs, stacked=True)
    check_int4_call(x, w, offs, bias, activation, gated, kernel)


# --- replay keys: a plain call (no tracer, mode, autograd or CUDA-graph capture watching; CUDA, not the interpreter)
# is keyed by everything Triton specializes its launch on and everything the config choice reads (shapes, strides,
# dtypes, devices, 16-byte alignment; never the values of offs: grids and configs come from shapes) ---------------


def replayable(first, *others) -> bool:
    """True when a call with these tensors (``first`` the activations; None for an absent one) may be replayed
    or recorded. Not inside a CUDA-graph capture: a fresh call there gets the K split's workspace through
    :func:`tilegemm.core.workspace.split_workspace`, which zeroes its counters inside the graph; a replay would
    skip that. Not inside another op's recording (that op's replay must see this call's launch)."""
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest
        return False
    if type(first) not in PLAIN_TENSOR_TYPES or not first.is_cuda or interpreting():
        return False
    if recording_active() or in_graph_tree() or torch.cuda.is_current_stream_capturing():
        return False
    # (a negative view, z.conj().imag, takes the full path, which resolves it: a replay would read it negated)
    return plain_call(first, *others) and not any_negative(first, *others)


def _opt_key(t) -> tuple | None:
    return None if t is None else tensor_key(t)


def key_of(a, b, offs, bias, out_dtype, precision: str, kernel: str) -> tuple:
    """The replay key of a ``grouped_mm`` call (``precision``: ``ieee`` or ``tf32``, as the fresh path resolves
    it): the layouts of every tensor it launches with and the call's named options. The layout (2-D x 3-D, ...)
    follows from the tensors' shapes."""
    return ("mm", kernel, precision, out_dtype, tensor_key(a), tensor_key(b), _opt_key(offs), _opt_key(bias))


def replay_key(a, b, offs, bias, out_dtype, kernel):
    """The replay key of a ``grouped_mm`` call, or None when it may not be replayed (:func:`replayable`; options
    of the wrong type, which the full path then refuses by name)."""
    if not replayable(a, b, offs, bias):
        return None
    if type(kernel) is not str or out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        return None
    # torch's fp32 setting is read at every call: a replay recorded under "highest" never serves "high"
    precision = resolve_precision("default", a.dtype) if a.dtype is torch.float32 else "ieee"
    try:
        return key_of(a, b, offs, bias, out_dtype, precision, kernel)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None


def gated_key_of(a, b, offs, bias, activation: str, precision: str) -> tuple:
    """The replay key of a ``moe_gate_up`` call (the gated 2-D x 3-D product)."""
    return ("gated", activation, precision, tensor_key(a), tensor_key(b), _opt_key(offs), _opt_key(bias))


def gated_replay_key(a, b, offs, bias, activation):
    """The replay key of a ``moe_gate_up`` call, or None (as :func:`replay_key`)."""
    if not replayable(a, b, offs, bias) or type(activation) is not str:
        return None
    precision = resolve_precision("default", a.dtype) if a.dtype is torch.float32 else "ieee"
    try:
        return gated_key_of(a, b, offs, bias, activation, precision)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None


def int4_key_of(x, w, offs, bias, activation: str, gated: bool, kernel: str, frag=None) -> tuple:
    """The replay key of a 4-bit experts call: x's, the stacked weight's parts', offs' and the bias's layouts,
    the group length, the activation, whether gated, the kernel, and the layouts of the fragments the call passes
    (``frag``: ``(fweight, fzs)`` where kernel ``frag`` may run, else None)."""
    return ("int4", kernel, activation, gated, w.group_k, tensor_key(x), tensor_key(w.qweight),
            tensor_key(w.scales), tensor_key(w.zeros), _opt_key(offs), _opt_key(bias),
            None if frag is None else (tensor_key(frag[0]), tensor_key(frag[1])))


def int4_replay_key(x, w, offs, bias, activation, gated: bool = False, kernel="auto", frag=None):
    """The replay key of a ``w4a16.grouped_matmul`` call (``gated``: the MoE gate/up product), or None (as
    :func:`replay_key`; a weight that is no plain ``Int4Weight`` of three plain tensors)."""
    if torch.compiler.is_compiling() or type(w) is not Int4Weight or w.perm is not None:
        return None
    if not replayable(x, w.qweight, w.scales, w.zeros, offs, bias):
        return None
    if type(activation) is not str or type(kernel) is not str:
        return None
    try:
        return int4_key_of(x, w, offs, bias, activation, gated, kernel, frag)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None


def call_tensors(*tensors) -> tuple:
    """The tensors a replay takes, the output aside: the given ones but the absent (None) ones, in order."""
    return tuple(t for t in tensors if t is not None)
