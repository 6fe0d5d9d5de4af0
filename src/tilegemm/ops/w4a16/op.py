"""``tilegemm.w4a16.matmul``: checks, the ``torch.library`` op ``tilegemm::w4a16_matmul``, autograd for x, and
the choice of kernel."""

from __future__ import annotations

import math
from typing import Optional

import torch

from tilegemm.core import registry
from tilegemm.core.activations import ACTIVATIONS, check_activation, torch_activation  # noqa: F401 (re-exported)
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.runtime import check_same_device, interpreting, new_output, on_device
from tilegemm.core.launch import plain_call, recording
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.w4a16 import configs, replay
from tilegemm.ops.w4a16.format import FLOAT_DTYPES, Int4Weight, fits_fragments, validate



# --- checks -------------------------------------------------------------------------------------------


def check_inputs(x, w, bias, activation, kernel) -> None:
    """Raise TypeError/ValueError naming the problem."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight (tilegemm.w4a16.quantize / from_gptq / from_awq), "
                        f"got {type(w).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {dtype_name(x.dtype)}; w4a16.matmul takes fp16 or bf16 activations")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {dtype_name(x.dtype)} but the weight's scales are {dtype_name(w.dtype)}: convert one "
                        f"(w.to({x.dtype}))")
    N, K = w.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K] with K = in_features = {K}, got {list(x.shape)}")
    validate(w)
    named = {"x": x, "w": w.qweight}
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        if bias.dtype not in FLOAT_DTYPES:
            raise TypeError(f"bias has dtype {dtype_name(bias.dtype)}; expected fp16 or bf16")
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


# --- the op ---------------------------------------------------------------------------------------------


def launcher(name: str):
    """The launch function of a registered w4a16 kernel (:func:`tilegemm.core.registry.launcher`)."""
    return registry.launcher("w4a16", name)


def choose_kernel(M: int, frag: bool = False) -> str:
    """``auto``: by M bucket (:func:`tilegemm.ops.w4a16.configs.choose`); ``frag``: the fragment kernel can run."""
    return configs.choose(M, frag)


_FRAG_REASON: dict = {}  # device -> why the frag kernel cannot run there ("" when it can), asked once


FRAG_KERNELS = ("frag", "frag_wgmma")  # the kernels that read the weight's fragment layout


def frag_usable(group_k: int, device: torch.device) -> bool:
    """Whether ``auto`` may use the fragment kernels on ``device`` for a weight of group length ``group_k``: a
    Hopper GPU with Gluon (not the interpreter) and a group length that is a multiple of 64 (their K step)."""
    if device.type != "cuda" or not fits_fragments(group_k):
        return False
    reason = _FRAG_REASON.get(device)
    if reason is None:
        reason = _FRAG_REASON[device] = registry.get("w4a16", "frag").unavailable_reason() or ""
    return not reason


def _wants_frag(kernel: str, x2: torch.Tensor, w: Int4Weight) -> bool:
    """Whether a call runs, or under ``auto`` may run, a kernel that takes the fragment layout."""
    return kernel in FRAG_KERNELS or (kernel == "auto" and x2.shape[0] <= configs.FRAG_WGMMA_MAX_M
                                      and frag_usable(w.group_k, x2.device))


def _forward(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel) -> torch.Tensor:
    from tilegemm.ops.w4a16.common import W4A16Problem

    M, N = x.shape[0], qweight.shape[1]
    out = new_output((M, N), x.dtype, x.device)
    if M == 0:
        return out
    if x.shape[1] == 0:  # K = 0: the product is zero, as torch's (Linear(0, N) returns its bias)
        pre = torch.zeros(N, device=x.device) if bias is None else bias.float()
        return out.copy_(torch_activation(pre, activation).to(out.dtype).expand(M, N))
    if x.stride(-1) != 1:
        x = x.contiguous()
    p = W4A16Problem(x, qweight, scales, zeros, bias, out, group_k, activation,
                     upcast=x.dtype == torch.bfloat16 and interpreting(), fweight=fweight, fzs=fzs)
    with on_device(x.device):
        frag = fweight is not None and frag_usable(group_k, x.device)
        launcher(choose_kernel(M, frag) if kernel == "auto" else kernel)(p)
    return out


@torch.library.custom_op("tilegemm::w4a16_matmul", mutates_args=())
def _w4a16_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    fweight: Optional[torch.Tensor],
    fzs: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    group_k: int,
    activation: str,
    kernel: str,
) -> torch.Tensor:
    return _forward(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel)


@_w4a16_op.register_fake
def _w4a16_fake(x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel):
    return x.new_empty((x.shape[0], qweight.shape[1]))


# --- autograd: the weight is frozen; x's gradient through the dequantized weight ---------------------------


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, fweight, fzs, bias, group_k, activation, kernel = inputs
    ctx.save_for_backward(x, qweight, scales, zeros, bias)
    ctx.group_k, ctx.activation = group_k, activation


def _backward(ctx, grad_out):
    from tilegemm.core.activations import torch_activation

    x, qweight, scales, zeros, bias = ctx.saved_tensors
    grad = grad_out.float()
    if ctx.activation != "none":
        pre = _w4a16_op(x, qweight, scales, zeros, None, None, bias, ctx.group_k, "none", "auto").float()
        with torch.enable_grad():
            pre = pre.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(torch_activation(pre, ctx.activation), pre, grad)
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        K = x.shape[1]
        g = torch.arange(K, device=x.device) // max(ctx.group_k, 1)  # (group_k is 0 with K: no rows then)
        shifts = torch.arange(8, device=x.device, dtype=torch.int32) * 4
        q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(K, qweight.shape[1])
        wt = ((q.float() - zeros.float()[g]) * scales.float()[g]).to(x.dtype)  # [K, N]
        grad_x = (grad.to(x.dtype) @ wt.T).to(x.dtype)
    if bias is not None and ctx.needs_input_grad[6]:
        grad_bias = grad.sum(0).to(bias.dtype)
    return grad_x, None, None, None, None, None, grad_bias, None, None, None


_w4a16_op.register_autograd(_backward, setup_context=_setup_context)
lean_autograd(_w4a16_op)  # a compiled graph's calls skip the custom op's Python layers (core/torch_ops.py)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[M, K]`` (reshape(-1, K) cannot infer M when K is 0)."""
    K = x.shape[-1]
    return x.reshape(-1, K) if K else x.reshape(math.prod(x.shape[:-1]), 0)


# --- the public function --------------------------------------------------------------------------------


def matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, activation: str | None = None,
           *, kernel: str = "auto") -> torch.Tensor:
    """``activation(x @ dequantize(w).T + bias)``, accumulated in fp32, with the 4-bit weight read as is.

    Args:
        x: ``[..., K]``, float16 or bfloat16 (the weight's scales' dtype); any number of rows, from 1.
        w: an :class:`~tilegemm.ops.w4a16.format.Int4Weight` of shape ``[N, K]``.
        bias: ``[N]``, float16 or bfloat16.
        activation: ``None``/``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"leaky_relu"``.
        kernel: ``"auto"`` (by the number of rows M) or a name from ``tilegemm.kernels("w4a16")``.

    Returns ``[..., N]`` in x's dtype. Differentiable in x and bias (the weight is frozen).

    Raises:
        TypeError, ValueError: naming the bad argument (shapes, dtypes, devices, unknown names).
    """
    activation = "none" if activation is None else activation
    # The fast path: a replay of an earlier plain call with the same key (tilegemm.ops.w4a16.replay).
    key = None
    if type(w) is Int4Weight and w.perm is None and type(x) is torch.Tensor and x.dim() >= 1 \
            and x.shape[-1] == w.shape[1]:
        x2 = _rows(x)
        if w._frag is None and _wants_frag(kernel, x2, w):
            w.fragments()  # before the key, which holds the fragments' layouts
        key = replay.replay_key(x2, w, bias, activation, kernel)
        if key is not None:
            hit = replay.lookup(key)
            if hit is not None:
                out = new_output(hit.shape, x.dtype, x.device)
                if hit(*replay.call_tensors(x2, w, bias, out)):
                    return out.reshape(*x.shape[:-1], w.shape[0])
                # (False: recorded for another stream or device; launched afresh below)
    check_inputs(x, w, bias, activation, kernel)
    lead = x.shape[:-1]
    x2 = _rows(x)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)  # act-order: the stored weight rows are sorted by group
    # The fragment layout goes along when the frag kernel is asked for, or may be chosen by auto.
    frag = _wants_frag(kernel, x2, w)
    fweight, fzs = w.fragments() if frag else (None, None)
    args = (x2, w.qweight, w.scales, w.zeros, fweight, fzs, bias, w.group_k, activation, kernel)
    # Dispatch through torch.ops costs tens of microseconds of host time, more than an M=1 kernel; a call that
    # no tracer, mode or autograd needs to see skips it (as tilegemm.matmul does).
    if not plain_call(x2, bias):
        return _w4a16_op(*args).reshape(*lead, w.shape[0])
    if key is None or (choose_kernel(x2.shape[0], frag) if kernel == "auto" else kernel) not in replay.REPLAYED_KERNELS:
        return _forward(*args).reshape(*lead, w.shape[0])
    with recording() as rec:
        out = _forward(*args)
    replay.store(key, rec.launches, replay.call_tensors(x2, w, bias, out), shape=out.shape)
    return out.reshape(*lead, w.shape[0])
