"""The argument checks of ``tilegemm.w4a16.matmul`` (TypeError/ValueError naming the problem), and the key of a
plain call that the replay cache (:mod:`tilegemm.core.replay`) keeps."""

from __future__ import annotations

import torch

from tilegemm.core import registry
from tilegemm.core.activations import check_activation
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.launch import PLAIN_TENSOR_TYPES, plain_call, plain_tensor, tensor_key
from tilegemm.core.runtime import check_dense, check_same_device, interpreting
from tilegemm.core.workspace import in_graph_tree
from tilegemm.ops.w4a16.dispatch import FRAG_KERNELS
from tilegemm.ops.w4a16.format import FLOAT_DTYPES, GROUP_SIZES, Int4Weight, validate


def check_inputs(x, w, bias, activation, kernel) -> None:
    """Raise TypeError/ValueError naming the problem."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight (tilegemm.w4a16.quantize / from_gptq / from_awq), "
                        f"got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"w holds stacked experts {list(w.shape)}: multiply them with w4a16.grouped_matmul")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_dense("x", x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {dtype_name(x.dtype)}; w4a16.matmul takes fp16 or bf16 activations")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {dtype_name(x.dtype)} but the weight's scales are {dtype_name(w.dtype)}: convert one "
                        f"(w.to({x.dtype}))")
    N, K = w.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K] with K = in_features = {K}, got {list(x.shape)}")
    validate(w, values=True)
    named = {"x": x, "w": w.qweight}
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        check_dense("bias", bias)
        if bias.dtype != x.dtype:  # x's dtype is the output's (as F.linear refuses a bias of another dtype)
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected x's dtype, {dtype_name(x.dtype)} "
                            f"(the output's)")
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"bias must have shape [N] = [{N}], got {list(bias.shape)}")
        named["bias"] = bias
    check_activation(activation)
    if kernel != "auto":
        spec = registry.get("w4a16", kernel)
        reason = spec.unavailable_reason()
        if reason:
            raise registry.NotApplicable(f"w4a16 kernel {kernel!r} cannot run here: {reason}")
    check_same_device(named)


def weight_of_op_args(qweight, scales, zeros, group_k, perm=None, fweight=None, fzs=None,
                      stacked: bool = False) -> Int4Weight:
    """The :class:`Int4Weight` that a registered op's flat weight arguments make: qweight ``[K/8, N]`` (``stacked``:
    ``[E, K/8, N]``, the grouped family's experts), scales and zeros of group length ``group_k`` (K: one group),
    perm, and the fragment layout ``(fweight, fzs)`` or neither. Building it checks that the parts fit together
    (:func:`~tilegemm.ops.w4a16.format.validate`, :func:`~tilegemm.ops.w4a16.format.check_fragments`): the errors
    of a weight built by hand, naming the part."""
    if not isinstance(qweight, torch.Tensor):
        raise TypeError(f"qweight must be a torch.Tensor, got {type(qweight).__name__}")
    if qweight.dim() != (3 if stacked else 2):
        raise ValueError(f"qweight must be int32 {'[E, K/8, N]' if stacked else '[K/8, N]'}, got shape "
                         f"{list(qweight.shape)}")
    K, N = qweight.shape[-2] * 8, qweight.shape[-1]
    if isinstance(group_k, bool) or not isinstance(group_k, (int, torch.SymInt)) or \
            group_k != K and group_k not in GROUP_SIZES[:-1]:
        raise ValueError(f"group_k must be K = {K} (one group) or a group size that divides K ("
                         f"{', '.join(map(str, GROUP_SIZES[:-1]))}), got {group_k!r}")
    if (fweight is None) != (fzs is None):
        raise TypeError("fweight and fzs go together (Int4Weight.fragments()): pass both or neither")
    frag = None if fweight is None else (fweight, fzs)
    return Int4Weight(qweight, scales, zeros, -1 if group_k == K else group_k, (*qweight.shape[:-2], N, K), perm, frag)


def check_op_args(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel, perm=None) -> None:
    """The checks of ``torch.ops.tilegemm.w4a16_matmul`` called with its flat arguments (the op's body makes them:
    called directly, nothing else did): the weight its parts make (:func:`weight_of_op_args`), x ``[M, K]`` against
    it, then :func:`check_inputs`: the public function's errors, by the same code."""
    w = weight_of_op_args(qweight, scales, zeros, group_k, perm, fweight, fzs)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] with K = 8 * qweight.shape[0] = {w.shape[1]} (qweight is [K/8, N] = "
                         f"{list(qweight.shape)}), got {list(x.shape)}")
    if kernel in FRAG_KERNELS and fweight is None:
        raise ValueError(f"w4a16 kernel {kernel!r} reads the fragment layout: pass fweight and fzs "
                         f"(Int4Weight.fragments())")
    check_inputs(x, w, bias, activation, kernel)


# --- the replay key: a plain call (no tracer, dispatch mode or autograd watching; CUDA, not the interpreter) is
# keyed by everything Triton specializes its launch on ------------------------------------------------------


def key_of(x2: torch.Tensor, w, bias, activation: str, kernel: str, perm=None) -> tuple:
    """The replay key of a call with 2-D activations ``x2`` (already reshaped, in the caller's order) and, for an
    act-order weight, its ``perm``: the layouts of every tensor the launches take (each with its device) and the
    call's named options. An act-order call's entries (x reordered, then the product on it) are kept under it."""
    frag = w._frag
    return (kernel, activation, w.group_k, tensor_key(x2), tensor_key(w.qweight), tensor_key(w.scales),
            tensor_key(w.zeros), None if frag is None else (tensor_key(frag[0]), tensor_key(frag[1])),
            None if bias is None else tensor_key(bias), None if perm is None else tensor_key(perm))


def replay_key(x2, w, bias, activation: str, kernel: str, perm=None):
    """The replay key of a call, or None when the call may not be replayed (CPU, the interpreter, a tensor
    subclass, autograd or a tracer watching x or the bias, a bias that is not a tensor).

    The weight's tensors are checked for their type only: the key holds every tensor's device, and a call is
    recorded only after :func:`check_inputs` found them all on x's device; the weight is frozen, so its
    ``requires_grad`` does not route a call through the op (:func:`tilegemm.ops.w4a16.api.matmul`) either."""
    if torch.compiler.is_compiling():  # first: Dynamo must trace none of the rest
        return None
    if not plain_tensor(x2) or not x2.is_cuda or interpreting() or in_graph_tree() or not plain_call(x2, bias):
        return None
    if x2.is_neg() or bias is not None and bias.is_neg():  # (a negative view: the full path resolves it)
        return None
    if type(w.qweight) not in PLAIN_TENSOR_TYPES or type(w.scales) not in PLAIN_TENSOR_TYPES \
            or type(w.zeros) not in PLAIN_TENSOR_TYPES or perm is not None and type(perm) not in PLAIN_TENSOR_TYPES:
        return None
    try:
        return key_of(x2, w, bias, activation, kernel, perm)
    except RuntimeError:  # a sparse or nested tensor has no strides or storage: the full path refuses it by name
        return None


def call_tensors(x2, w, bias) -> tuple:
    """The tensors a product's replay takes, the output aside (the fragment layout, when made). Of an act-order
    call, ``x2`` is x reordered (its gather's replay takes ``(x2, perm)``)."""
    parts = (x2, w.qweight, w.scales, w.zeros) + tuple(w._frag or ())
    return parts if bias is None else parts + (bias,)
