"""``tilegemm.nn.Linear``: ``torch.nn.Linear`` through ``tilegemm.matmul``, with an optional fused activation."""

from __future__ import annotations

import sys

import torch
from torch.nn.utils import parametrize

from tilegemm.core.activations import check_activation, torch_activation
from tilegemm.core.dtypes import dtype_name
from tilegemm.core.runtime import check_dense
from tilegemm.core.torch_ops import rows_as
from tilegemm.ops.matmul import matmul
from tilegemm.ops.matmul.problem import DTYPES

_KERNEL_DTYPES = frozenset(DTYPES)

# transformers' Linear subclasses whose forward is nn.Linear's (FalconLinear: bias added after the product)
LINEAR_EQUIVALENT = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


class NotScriptable:
    """Mixin of every ``torch.nn.Module`` in ``tilegemm.nn``: ``torch.jit.script`` refuses it by name. Their forwards
    launch Triton kernels from Python and read Python objects (replay keys, folds, kept outputs), which TorchScript
    cannot compile; its own error names an attribute or a statement deep inside one forward instead."""

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on the module it is given and on every submodule, before compiling anything
        cls = parametrize.type_before_parametrizations(self)
        raise RuntimeError(f"{cls.__module__}.{cls.__qualname__} does not support TorchScript (torch.jit.script): "
                           f"its forward runs Triton kernels from Python. Use torch.compile or torch.export instead "
                           f"(torch.jit.trace records it too)")


def traced_call(module: torch.nn.Module, x: "torch.fx.Proxy") -> "torch.fx.Proxy":
    """Under ``torch.fx.symbolic_trace``: one ``call_module`` node for ``module``, as fx records torch.nn's own
    layers (its forward branches on the input's shape and dtype, which a Proxy does not have). The module traced
    being ``module`` itself, no module holds it to call: refused by name (TraceError)."""
    path = x.tracer.path_of_module(module)
    if not path:  # (the root: a call_module node of '' fails later as an AttributeError of no clear cause)
        raise torch.fx.proxy.TraceError(
            f"torch.fx.symbolic_trace of a tilegemm {type(module).__name__} itself: its traced form is a call of "
            f"its module, and the layer traced has none holding it; trace a module that holds it "
            f"(torch.nn.Sequential(layer))")
    return x.tracer.create_proxy("call_module", path, (x,), {})


def sharding_rules_for(weight) -> None:
    """Register tilegemm's DTensor sharding rules when ``weight`` is a DTensor (a layer parallelized with torch's
    own styles): imported here, not at ``import tilegemm``, because ``torch.distributed.tensor`` is slow to import."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(weight, dtensor.DTensor):
        import tilegemm.parallel.rules  # noqa: F401 (registers the rules)


def _check_dtensor_input(x, weight) -> None:
    """Refuse a plain x with a DTensor weight, saying how the input becomes a DTensor (torch's error says neither)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(weight, dtensor.DTensor) and not isinstance(x, dtensor.DTensor):
        raise TypeError("tilegemm.nn.Linear: the weight is a DTensor (the layer is parallelized) but x is a plain "
                        "torch.Tensor: parallelize it with parallelize_module and a style (tilegemm.nn or torch's "
                        "ColwiseParallel / RowwiseParallel), whose hooks make x a DTensor, or pass x as a DTensor on "
                        "the weight's mesh (DTensor.from_local(x, mesh, placements))")


def shallow_copy(module: torch.nn.Module, cls: type) -> torch.nn.Module:
    """``module`` as a ``cls`` over the same parameters, buffers and submodules, each dict or set of the module
    (those, and the hooks) a copy of its own. Not copy.copy: a parametrized module refuses it."""
    new = object.__new__(cls)
    new.__dict__.update({k: v.copy() if isinstance(v, (dict, set)) else v for k, v in vars(module).items()})
    return new


def refuse_other_forward(module: torch.nn.Module, base: type, ours: type, methods: tuple, where: str,
                         equivalent: frozenset = frozenset()) -> None:
    """Refuse a ``module`` that a copy as ``ours`` would compute otherwise than it does: a lazy one that has not made
    its parameters yet, or a class (parametrized or not) overriding any of ``base``'s ``methods``, unless named in
    ``equivalent`` (QAT's Conv2d fake-quantizes its weight in ``_conv_forward``)."""
    lazy = isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params()
    if lazy:
        raise ValueError(f"tilegemm.nn.{where}: this Lazy{base.__name__} has not made its parameters yet: run it "
                         f"once on an input, then convert it")
    cls = parametrize.type_before_parametrizations(module)
    name = f"{cls.__module__}.{cls.__qualname__}"
    own = [m for m in methods if getattr(cls, m) not in (getattr(base, m), getattr(ours, m))]
    if own and name not in equivalent:
        raise ValueError(f"tilegemm.nn.{where}: {name} overrides torch.nn.{base.__name__}'s {' and '.join(own)}, "
                         f"which the tilegemm layer would not run")


def shallow_copy_as(module: torch.nn.Module, cls: type) -> torch.nn.Module:
    """:func:`shallow_copy` of ``module`` as a ``cls``; a parametrized ``module`` (``torch.nn.utils.parametrize``,
    e.g. ``parametrizations.weight_norm``) gives a parametrized ``cls`` over the same parametrizations and original
    tensors, in parametrization lists of its own."""
    if not parametrize.is_parametrized(module):
        return shallow_copy(module, cls)
    # torch gives each parametrized module a class of its own holding the tensors' properties (and its refusal to
    # pickle): the same attributes on a subclass of cls
    new_cls = type(f"Parametrized{cls.__name__}", (cls,), {
        k: v for k, v in type(module).__dict__.items()
        if k not in ("__module__", "__qualname__", "__dict__", "__weakref__", "__doc__")})
    new = shallow_copy(module, new_cls)
    # lists of its own, so adding or removing a parametrization here leaves the module's; the same originals
    new._modules["parametrizations"] = torch.nn.ModuleDict(
        {name: shallow_copy(plist, type(plist)) for name, plist in module.parametrizations.items()})
    return new


class Linear(NotScriptable, torch.nn.Linear):
    """A drop-in ``torch.nn.Linear`` (same arguments, parameters and state dict), plus ``activation``: one of
    ``tilegemm.ACTIVATIONS`` applied in the GEMM's epilogue after the bias. Autograd runs through
    ``tilegemm.matmul`` (its backward GEMMs are tilegemm's too)."""

    def __init__(self, *args, activation: str | None = None, **kwargs):
        check_activation(activation)  # before the parameters are made: a typo fails here, not at forward
        super().__init__(*args, **kwargs)
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, activation: str | None = None) -> "Linear":
        """A ``Linear`` sharing ``linear``'s parameters, buffers and submodules (no copy). The hooks ``linear`` has
        are copied: a hook added to either module later stays on that one. A parametrized ``linear`` gives a
        parametrized ``Linear`` over the same parametrizations and original tensors, as ``Conv2d.from_conv``."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")
        check_activation(activation)
        refuse_other_forward(linear, torch.nn.Linear, cls, ("forward",), "Linear.from_linear", LINEAR_EQUIVALENT)
        if "forward" in vars(linear):  # copied along, it would run instead of tilegemm's forward
            raise ValueError(
                "tilegemm.nn.Linear.from_linear: this nn.Linear's forward was replaced on the instance "
                "(transformers' tensor-parallel plan installs one, as do accelerate's device_map hooks), and a "
                "converted copy would keep running it instead of tilegemm's forward. Convert first "
                "(tilegemm.nn.convert_), then parallelize; or split with parallelize_module and "
                "tilegemm.nn.ColwiseParallel / RowwiseParallel, or load with "
                "tilegemm.models.from_pretrained(path, device_mesh=mesh)")
        # the dicts and sets its own (hooks too): a hook added to either module later stays on that one
        new = shallow_copy_as(linear, cls)
        new.activation = activation
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy):
            return traced_call(self, x)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"tilegemm.nn.Linear takes a torch.Tensor, got {type(x).__name__}")
        weight = self.weight
        if weight.dtype not in _KERNEL_DTYPES:
            return self._torch_forward(x, weight)
        if type(weight) is not torch.nn.Parameter:
            sharding_rules_for(weight)
            _check_dtensor_input(x, weight)
        if x.is_nested:  # (no sizes for the flatten below, nor for the error's wording)
            check_dense("x", x)
        # [*, in] -> [M, in]: one GEMM, whatever the leading dims (flatten, not reshape(-1, in), which cannot
        # infer M when in_features is 0); a 1-D x is one row, as torch.matmul takes it.
        x2d = x.flatten(0, -2) if x.ndim > 2 else x
        try:
            out = matmul(x2d, weight.t(), bias=self.bias, activation=self.activation)  # [M, out]
        except (TypeError, ValueError):
            problem = self._input_problem(x, weight)  # the product's error names a and b: the layer's names x
            if problem is None:
                raise
            raise problem from None
        return rows_as(out, x.shape[:-1]) if x.ndim > 2 else out  # (a tensor of its own, as torch's linear gives)

    def _input_problem(self, x: torch.Tensor, weight: torch.Tensor) -> Exception | None:
        """The error of a refused input in the layer's terms (its features and dtype), None for another problem."""
        layer = f"tilegemm.nn.Linear(in_features={self.in_features}, out_features={self.out_features})"
        if x.ndim == 0 or x.shape[-1] != weight.shape[1]:
            return ValueError(f"{layer} got input of shape {list(x.shape)}: its last dim must be {weight.shape[1]}")
        if x.dtype != weight.dtype:
            fix = f"convert the module (.to({x.dtype})) or the input, or run it under torch.autocast" \
                if x.dtype in (*_KERNEL_DTYPES, torch.float64) else "give it floating-point input"
            return TypeError(f"{layer} is a module of dtype {dtype_name(weight.dtype)} and got input of dtype "
                             f"{dtype_name(x.dtype)}: {fix}")
        if x.device != weight.device:  # (the product's own check names its operands a and b)
            return ValueError(f"{layer} has its weight on {weight.device} and got input on {x.device}: move the "
                              f"module (.to({str(x.device)!r})) or the input")
        return None

    def _torch_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A float64 layer (``.double()``, e.g. for gradcheck) runs torch's linear, as tilegemm.nn.Conv2d runs
        torch's conv: no kernel takes float64."""
        if weight.dtype != torch.float64:
            raise TypeError(f"tilegemm.nn.Linear runs fp16, bf16, fp32 and (through torch) float64 layers; this "
                            f"one's weight is {dtype_name(weight.dtype)}")
        if x.dtype != weight.dtype:  # torch's own error here is a RuntimeError naming m1 and m2
            raise TypeError(f"tilegemm.nn.Linear: x is {dtype_name(x.dtype)} but the layer is float64")
        return torch_activation(torch.nn.functional.linear(x, weight, self.bias), self.activation or "none")

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return extra + (f", activation={self.activation}" if self.activation else "")
