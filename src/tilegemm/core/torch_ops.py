"""What every family's registered op (``torch.library.custom_op``) shares: a lean autograd-key kernel.

A graph compiled by ``torch.compile`` calls ``torch.ops.tilegemm.*`` for every convolution and matmul. A
``custom_op``'s call runs three Python layers before the op's own function: the autograd kernel (even with no
gradient to record), a redispatch below autograd, and the backend kernel's aliasing check inside a wrapper
that turns Dynamo off and on: most of a replayed convolution's host time, enough for a compiled ResNet-50 to
spend more time on its host than its GPU (docs/performance.md).

:func:`lean_autograd` gives such an op an autograd kernel that calls the op's function at once when nothing
needs to see the call (no gradient, plain tensors, no dispatch or function mode, not tracing): what the
redispatch would have reached with the same arguments. Any other call takes the custom op's own autograd
kernel (gradients, fake and functional tensors, subclasses, modes).

A call that autograd must record but that nothing else needs to see (plain tensors, some requiring a gradient,
no mode, not tracing: eager training) takes :func:`recorded_call`'s ``autograd.Function`` over the op's function and
its registered setup and backward: what the custom op's own kernel would record, without its per-call filling of
defaults from the schema, its redispatch and its backend wrapper (docs/performance.md, "Host time of a training
step").

:func:`own_storage_outputs` (which :func:`lean_autograd` installs too) keeps an op's outputs from being views
when autograd records the call: the kernels build channels-last and batched outputs as views of a buffer
(``permute``, ``view``), and autograd refuses an in-place op on a view made inside a custom function, so
``conv -> ReLU(inplace=True)`` (VGG, SqueezeNet, EfficientNet's squeeze-excitation) failed in training.
"""

from __future__ import annotations

import warnings

import torch
import torch.autograd.forward_ad as _forward_ad

from tilegemm.core.launch import (PLAIN_TENSOR_TYPES, dispatch_stack_depth, forward_ad_on, function_mode_on,
                                  functorch_level, jit_tracing)


def plain_args(args: tuple, tensor_positions: tuple[int, ...]) -> bool:
    """True when no tracer, mode, subclass or gradient needs to see an op called with ``args`` (positional, as
    the dispatcher passes them; ``tensor_positions``: where the schema has a ``Tensor`` or ``Tensor?``): those
    tensors plain and not requiring a gradient while grad mode is on."""
    if dispatch_stack_depth() or function_mode_on() or torch.compiler.is_compiling() or jit_tracing():
        return False
    grad = torch.is_grad_enabled()
    n = len(args)
    for i in tensor_positions:
        if i < n:  # the dispatcher may leave out trailing arguments at their defaults
            a = args[i]
            if a is not None and (type(a) not in PLAIN_TENSOR_TYPES or (grad and a.requires_grad) or a.is_meta):
                return False  # (meta tensors go on to the op's fake)
    return True


def grad_only_args(args: tuple, tensor_positions: tuple[int, ...]) -> bool:
    """True when autograd is the only thing that needs to see an op called with ``args`` (a call
    :func:`plain_args` refused): no tracer or mode, the tensors plain and on no meta device, whether or not they
    require a gradient."""
    if dispatch_stack_depth() or function_mode_on() or torch.compiler.is_compiling() or jit_tracing() \
            or functorch_level() is not None:  # (torch.func's transforms: the custom op's own kernel, as before)
        return False
    n = len(args)
    for i in tensor_positions:
        if i < n:
            a = args[i]
            if a is not None and (type(a) not in PLAIN_TENSOR_TYPES or a.is_meta):
                return False
    return True


def _defaults(schema) -> tuple:
    """The default of every argument of ``schema`` in order (None where it has none): what fills the trailing
    arguments the dispatcher leaves out at their defaults."""
    return tuple(arg.default_value if arg.has_default_value() else None for arg in schema.arguments)


def recorded_call(fn, setup_context, backward, defaults: tuple):
    """An ``autograd.Function`` whose ``apply(*args)`` runs ``fn`` (grad mode off, as in any Function's forward),
    gives each output its own storage (:func:`own_storage`), calls ``setup_context(ctx=, inputs=, output=)`` with
    the arguments the dispatcher left out filled from ``defaults``, and whose backward is ``backward``: the graph
    the custom op's own autograd kernel records for a call of plain tensors (torch's ``make_autograd_impl``)."""
    n_args = len(defaults)

    def forward(*args):
        out = fn(*args)
        if isinstance(out, torch.Tensor):
            return own_storage(out)
        if out is not None:
            out = type(out)(own_storage(t) if isinstance(t, torch.Tensor) else t for t in out)
        return out

    def setup(ctx, inputs, output):  # (a separate setup_context: what torch.func's transforms ask of a Function)
        setup_context(ctx=ctx, inputs=inputs, output=output)

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    function = type("Recorded_" + getattr(fn, "__name__", "op"), (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
                     "backward": staticmethod(backward_)})
    apply = function.apply

    def call(*args):
        if len(args) < n_args:
            args = args + defaults[len(args):]
        return apply(*args)

    return call


def _tensor_positions(schema) -> tuple[int, ...] | None:
    """Positions of a schema's ``Tensor`` and ``Tensor?`` arguments; None if it has tensor lists or
    keyword-only arguments (such an op keeps its own kernel)."""
    positions = []
    for i, arg in enumerate(schema.arguments):
        kind = str(arg.type)
        if arg.kwarg_only or "Tensor" in kind and kind not in ("Tensor", "Optional[Tensor]"):
            return None
        if kind in ("Tensor", "Optional[Tensor]"):
            positions.append(i)
    return tuple(positions)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where ``t`` is a view, a tensor over the same memory (same storage, offset, sizes, strides) that
    autograd does not take for one: no copy."""
    if t._base is None:
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


_unsafe_view = torch.ops.aten._unsafe_view.default  # a reshape autograd takes for a new tensor, not a view


def rows_as(out: torch.Tensor, lead) -> torch.Tensor:
    """A product's ``[M, N]`` rows as ``[*lead, N]``, a tensor of its own (as torch's linear returns one), not a
    view of the 2-D result: a view made under no_grad cannot be written in place under autograd, nor detached in
    place. Subclasses (DTensor, fake tensors) and non-contiguous results are reshaped."""
    return shaped_as(out, (*lead, out.shape[-1]))


def shaped_as(out: torch.Tensor, shape) -> torch.Tensor:
    """A product's result given ``shape`` (the same elements), a tensor of its own as :func:`rows_as` makes it."""
    if type(out) is torch.Tensor and out.is_contiguous():
        return _unsafe_view(out, tuple(shape))
    return out.reshape(shape)


try:
    from torch._C._functorch import TransformType

    _DIFFERENTIATING = (TransformType.Grad, TransformType.Jvp)
except ImportError:  # an older torch without them
    _DIFFERENTIATING = ()


def refuse_functorch(name: str) -> None:
    """Raise a clear error inside torch.func's gradient transforms (grad, vjp, jvp and those built on them): a custom
    op whose autograd is registered through ``torch.library`` has no functorch rule (torch's own kernel refuses with
    a message about ``setup_context``), and a call there on inputs the transform does not watch would launch on
    the transform's wrapped output. ``vmap`` passes: torch runs the op once a batch element."""
    level = functorch_level()
    if level is not None and level.key() in _DIFFERENTIATING:
        raise NotImplementedError(
            f"tilegemm::{name} does not run inside torch.func's gradient transforms (grad, vjp, jvp, jacrev, jacfwd, "
            f"hessian): tilegemm's ops have no functorch rules. Use torch.autograd.grad or torch.autograd.functional "
            f"(vectorize=False); torch.func.vmap runs them, one call a batch element")


def refuse_forward_ad(name: str, args: tuple) -> None:
    """Raise a clear error for a call on dual tensors of ``torch.autograd.forward_ad``: tilegemm's ops have no
    forward-mode derivative, and a custom op called on them returns an output without a tangent, which the code
    after it would read as a zero derivative. Outside a dual level it reads one module global."""
    if not forward_ad_on():
        return
    for a in args:
        if isinstance(a, torch.Tensor) and _forward_ad.unpack_dual(a).tangent is not None:
            raise NotImplementedError(
                f"tilegemm::{name} has no forward-mode derivative (torch.autograd.forward_ad's dual tensors): its "
                f"output would carry no tangent. Use reverse mode (backward, torch.autograd.grad)")


def own_storage_outputs(op) -> bool:
    """Register ``op``'s CPU and CUDA kernels as its function with :func:`own_storage` on each output tensor.
    These kernels run where the custom op's own autograd kernel redispatches (a call autograd records);
    :func:`lean_autograd`'s plain calls skip them, so a call without gradients pays nothing. True when
    registered."""
    fn = getattr(op, "_init_fn", None)
    if fn is None or not hasattr(op, "register_kernel"):
        return False

    name = getattr(op, "_name", "op")

    def kernel(*args, **kwargs):
        refuse_functorch(name)
        refuse_forward_ad(name, args)
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return own_storage(out)
        if out is None:  # an op that only mutates its arguments
            return out
        return type(out)(own_storage(t) if isinstance(t, torch.Tensor) else t for t in out)

    try:
        op.register_kernel(("cpu", "cuda"), kernel)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def lean_autograd(op) -> bool:
    """Install the lean autograd kernel on ``op`` (a ``torch.library.custom_op`` whose autograd, if any, is
    registered already); True when installed. Built on torch internals (``make_autograd_impl``, the custom
    op's library and function) and ``Library.impl(..., allow_override=True)``: where they are missing or
    refuse, the op keeps its own kernel and this returns False (tests/core/test_torch_ops.py fails then, so
    the loss does not go unnoticed). Also installs :func:`own_storage_outputs`."""
    own_storage_outputs(op)
    try:
        from torch._library.autograd import make_autograd_impl

        full = make_autograd_impl(op._opoverload, op)  # the custom op's own kernel (reads op's autograd info)
        fn, lib, name = op._init_fn, op._lib, op._name
        schema = op._opoverload._schema
        positions = _tensor_positions(schema)
        setup, backward = op._setup_context_fn, op._backward_fn
        mutable = schema.is_mutable
        defaults = _defaults(schema)
    except (ImportError, AttributeError, TypeError):
        return False
    if positions is None:
        return False
    # a recorded call skips the custom op's own kernel's Python layers (docs/performance.md, "Host time of a
    # training step"); an op that mutates or has no registered autograd keeps that kernel
    recorded = recorded_call(fn, setup, backward, defaults) if setup and backward and not mutable else None

    def kernel(keyset, *args, **kwargs):
        refuse_functorch(name)
        refuse_forward_ad(name, args)
        if not kwargs:
            if plain_args(args, positions):
                return fn(*args)
            if recorded is not None and grad_only_args(args, positions):
                return recorded(*args)
        return full(keyset, *args, **kwargs)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point
            lib.impl(name, kernel, "Autograd", with_keyset=True, allow_override=True)
    except (RuntimeError, TypeError):
        return False
    op._tilegemm_lean_autograd = True
    return True
