"""Batch norms folded into the convolutions before them for inference: :func:`fold_batchnorm_`.

In eval mode a ``BatchNorm2d`` with running statistics is an affine map per channel, so a convolution followed by
it is one convolution with a scaled weight and a shifted bias, and the activation after it can run in the
convolution's epilogue: one launch and one pass over the output where there were three. Training mode is left
as it was: the batch norm normalizes by the batch's statistics and updates its running ones, which no fold can do.
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import jit_tracing
from tilegemm.nn.conv import Conv2d
from tilegemm.nn.hooks import has_hooks, tilegemm_hook
from tilegemm.nn.linear import NotScriptable, shallow_copy

__all__ = ["FoldedActivation", "FoldedBatchNorm2d", "fold_batchnorm_", "folds"]


def folds(norm: torch.nn.BatchNorm2d) -> bool:
    """Whether ``norm`` is applied by the convolution before it now: in eval mode and with running statistics (a
    batch norm without them normalizes by the batch's statistics in eval mode too)."""
    return not norm.training and norm.running_mean is not None and norm.running_var is not None


class FoldedBatchNorm2d(NotScriptable, torch.nn.BatchNorm2d):
    """A ``BatchNorm2d`` (same parameters, buffers and state dict) that the :class:`tilegemm.nn.Conv2d` before it
    applies while :func:`folds` says so: its forward then returns its input. In training mode it is torch's."""

    updates = 0  # training-mode calls: they change the running statistics without bumping their versions
    fold = None  # the Fold of the convolution before it (set by fold_batchnorm_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fold = self.fold
        if fold is not None and fold.active():
            return x
        if self.training:
            self.__dict__["updates"] = self.updates + 1
        return super().forward(x)


class FoldedActivation(NotScriptable, torch.nn.Module):
    """The activation module ``act`` after a folded batch norm: the convolution's epilogue applies it while the
    batch norm is folded (the input is returned), ``act`` runs otherwise."""

    def __init__(self, act: torch.nn.Module, fold: "Fold"):
        super().__init__()
        self.act = act
        self.__dict__["fold"] = fold  # (holds the norm and the convolution, which stay where the model holds them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fold.active():
            return x
        return self.act(x)


def _hooked(module: torch.nn.Module) -> bool:
    """:func:`has_hooks`, its dicts' emptiness first (three modules a chain ask on every call)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks) and has_hooks(module)


class Fold:
    """What a :class:`tilegemm.nn.Conv2d` folds: the batch norm after it and the activation after that (a name of
    ``tilegemm.ACTIVATIONS`` or None), and the folded weight and bias of the last call that could keep them."""

    act = None  # (a Fold pickled before it kept its activation module)

    def __init__(self, norm: FoldedBatchNorm2d, activation: str | None, places=(), within: "_Running | None" = None,
                 act: torch.nn.Module | None = None):
        self.norm = norm
        self.activation = activation
        self.act = act  # the activation module folded (None: none), whose settings must still name ``activation``
        # folded only while the forward that calls the chain runs: the traced model's (a pair from its graph) or
        # the Sequential's (neighbours, no trace), so that the convolution called alone, or from a slice of the
        # Sequential or a parent that reads its output, computes what torch's does
        self.within = within
        # (parent, name, module) of the convolution, the norm and the activation's wrapper if any: a fold holds only
        # while all are where it found them (a norm replaced afterwards, e.g. by SyncBatchNorm.convert_sync_batchnorm,
        # must not be applied twice)
        self.places = tuple(places)
        self.key = None
        self.cached = None
        self.held = None  # the key's tensors: their storages kept, so no other tensor takes an address the key names

    def active(self) -> bool:
        # (and no activation set on the convolution since, nor the folded one's settings changed: a LeakyReLU's
        # slope, GELU's approximation; either ends the fold, where the epilogue would apply the old one)
        # (nor a hook put on any of them since: it would see, or change, the folded chain's output)
        return folds(self.norm) and (self.within is None or self.within.depth > 0) and all(
            parent._modules.get(name) is module for parent, name, module in self.places) \
            and not (self.places and self.places[0][2].activation) \
            and (self.act is None or _activation_name(self.act) == self.activation) \
            and not any(_hooked(module) for _, _, module in self.places) \
            and not (self.act is not None and _hooked(self.act))

    def __getstate__(self):  # pickled and copied without the cached tensors
        return dict(norm=self.norm, activation=self.activation, act=self.act, places=self.places, within=self.within,
                    key=None, cached=None, held=None)

    def __deepcopy__(self, memo):
        import copy

        new = Fold.__new__(Fold)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return new

    def parameters(self, weight: torch.Tensor, bias: torch.Tensor | None, cacheable: bool):
        """The folded (weight, bias): ``weight * s`` and ``(bias - mean) * s + beta`` with
        ``s = gamma / sqrt(var + eps)``, computed in fp32 and rounded once to the weight's dtype. Kept between
        calls while no tensor it reads has changed (their versions and storage; the running statistics also by the
        batch norm's training-mode calls, whose updates bump no version) where nothing asks for a graph
        (no autograd, no tracing, no capture) and none is an inference tensor; recomputed otherwise."""
        norm = self.norm
        tensors = (weight, bias, norm.weight, norm.bias, norm.running_mean, norm.running_var)
        # (an inference tensor has no version counter to key on)
        keep = cacheable and not torch.compiler.is_compiling() and not jit_tracing() and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)) and not any(
            t is not None and t.is_inference() for t in tensors)
        if keep:
            key = (norm.eps, norm.updates, torch.is_inference_mode_enabled()) + tuple(
                (t.data_ptr(), t._version, t.dtype) if t is not None else None for t in tensors)
            if key == self.key:
                return self.cached
        scale = torch.rsqrt(norm.running_var.float() + norm.eps)
        if norm.weight is not None:
            scale = scale * norm.weight.float()
        shift = -norm.running_mean.float() if bias is None else bias.float() - norm.running_mean.float()
        shift = shift * scale
        if norm.bias is not None:
            shift = shift + norm.bias.float()
        folded = ((weight.float() * scale.reshape(-1, 1, 1, 1)).to(weight.dtype), shift.to(weight.dtype))
        if keep and not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.key, self.cached = key, folded
            self.held = tuple(t.detach() for t in tensors if t is not None)
        return folded


# Activation modules the convolutions' epilogues compute exactly as the module does.
def _activation_name(module: torch.nn.Module) -> str | None:
    kind = type(module)
    if kind is torch.nn.ReLU:
        return "relu"
    if kind is torch.nn.SiLU:
        return "silu"
    if kind is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if kind is torch.nn.LeakyReLU and module.negative_slope == 0.01:
        return "leaky_relu"
    return None


def _chains_fx(model: torch.nn.Module) -> list[tuple[str, str, str | None]] | None:
    """(conv, batch norm, activation or None) names where the traced graph calls the batch norm on the
    convolution's output and nothing else reads that output (the same for the activation on the norm's); None
    where torch.fx cannot trace ``model``."""
    import torch.fx

    leaves = (torch.nn.Conv2d, torch.nn.modules.batchnorm._BatchNorm, torch.nn.ReLU, torch.nn.SiLU, torch.nn.GELU,
              torch.nn.LeakyReLU)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            # tilegemm's own modules (Linear, Int4Linear, MoE blocks) are called, not traced through
            return isinstance(m, leaves) or type(m).__module__.startswith("tilegemm.nn.") \
                or super().is_leaf_module(m, qualname)

    # traced in eval mode, the only mode a fold applies in: a forward that branches on self.training (a batch norm
    # in training only) is read as it runs folded
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:  # (the flags alone: a module's own train() override may do more)
            m.training = False
        graph = Tracer().trace(model)
    except Exception:  # noqa: BLE001 - data-dependent control flow and the like: the Sequential rule instead
        return None
    finally:
        for m, mode in modes:
            m.training = mode
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1

    def only_call_on(node, user_types):
        """The one user of ``node``: a module called once, on ``node`` alone, of one of ``user_types``."""
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if user.op != "call_module" or calls.get(user.target) != 1 or user.args != (node,) or user.kwargs:
            return None
        return user if isinstance(model.get_submodule(user.target), user_types) else None

    chains = []
    for node in graph.nodes:
        if node.op != "call_module" or calls.get(node.target) != 1:
            continue
        if not isinstance(model.get_submodule(node.target), torch.nn.Conv2d):
            continue
        norm = only_call_on(node, torch.nn.BatchNorm2d)
        if norm is None:
            continue
        act = only_call_on(norm, leaves[2:])
        chains.append((node.target, norm.target, act.target if act is not None else None))
    return chains


def _chains_sequential(model: torch.nn.Module) -> list[tuple[str, str, str | None]]:
    """(conv, batch norm, activation or None) names that follow each other in a ``torch.nn.Sequential`` whose
    forward is Sequential's: each child's output is the next one's only input."""
    chains = []
    for name, seq in model.named_modules():
        if not isinstance(seq, torch.nn.Sequential) or type(seq).forward is not torch.nn.Sequential.forward:
            continue
        kids = list(seq._modules.items())
        for i in range(len(kids) - 1):
            (cname, conv), (nname, norm) = kids[i], kids[i + 1]
            if isinstance(conv, torch.nn.Conv2d) and isinstance(norm, torch.nn.BatchNorm2d):
                act = kids[i + 2][0] if i + 2 < len(kids) else None
                full = (lambda n: f"{name}.{n}" if name else n)
                chains.append((full(cname), full(nname), full(act) if act is not None else None))
    return chains


class _Running:
    """How many calls of one module's own forward (the traced model's, or a Sequential's) are in progress (its
    forward hooks count them; the hooks are objects of their own, not closures, so the model still pickles)."""

    def __init__(self):
        self.depth = 0


class _Enter:
    def __init__(self, running: _Running):
        self.running = running

    def __call__(self, module, args):
        self.running.depth += 1


class _Leave:
    def __init__(self, running: _Running):
        self.running = running

    def __call__(self, module, args, output):
        self.running.depth -= 1


def _running(module: torch.nn.Module) -> _Running:
    """The counter of ``module``'s forward calls in progress, its hooks registered on first use (the leaving one
    called on an exception too; both marked tilegemm's own, so no transform counts them as the user's)."""
    running = module.__dict__.get("_tilegemm_running")
    if running is None:
        running = module.__dict__["_tilegemm_running"] = _Running()
        module.register_forward_pre_hook(tilegemm_hook(_Enter(running)))
        module.register_forward_hook(tilegemm_hook(_Leave(running)), always_call=True)
    return running


def fold_batchnorm_(model: torch.nn.Module) -> torch.nn.Module:
    """Fold each ``BatchNorm2d`` that reads a :class:`tilegemm.nn.Conv2d`'s output (and nothing else does) into
    that convolution for eval mode, with the activation module after it (ReLU, SiLU, GELU, LeakyReLU of slope
    0.01) in the convolution's epilogue; return ``model``. Run it after :func:`tilegemm.nn.convert_` (or pass
    ``fold_batchnorm=True`` to it).

    In eval mode the convolution then applies the batch norm (its weight scaled, its bias shifted, in fp32 and
    rounded once to the weight's dtype; kept between calls until a tensor they come from changes) and the
    activation, and the batch norm and activation modules pass their input through. In training mode, or for a
    batch norm without running statistics, every module computes what it did before. The modules keep their
    names, parameters, buffers and state dict; the batch norms become :class:`FoldedBatchNorm2d`, the activations
    :class:`FoldedActivation` wrappers.

    Which pairs: where torch.fx traces the model (in eval mode), those whose traced graph calls the batch norm on
    the convolution's output alone and nothing else reads that output, folded only while the model's own forward
    runs (forward hooks on it count its calls: the convolution called alone, or a slice of a Sequential, computes
    what torch's modules do); elsewhere the neighbours in a ``torch.nn.Sequential``, folded only while that
    Sequential's own forward runs them (a parent that calls its children one by one, reading each output, gets them
    unfolded). A hook put on any of a chain's modules after folding ends its fold while it is there. A forward
    whose path depends on state changed after folding (a flag that skips the batch norm) is read as it was. Left as
    they are: modules held under several names or called more than once, modules with hooks, a convolution with
    an activation of its own, batch norms of another class (subclasses, ``SyncBatchNorm``) or channel count.
    ``model.tilegemm_folded`` lists ``(conv, batch norm, activation or None)`` names.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fold_batchnorm_ takes a torch.nn.Module, got {type(model).__name__}")
    held: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        held[id(m)] = held.get(id(m), 0) + 1
    chains = _chains_fx(model)
    traced = chains is not None
    if not traced:
        chains = _chains_sequential(model)
    folded = []
    for conv_name, norm_name, act_name in chains:
        conv, norm = model.get_submodule(conv_name), model.get_submodule(norm_name)
        if not isinstance(conv, Conv2d) or conv.activation or conv._tilegemm_fold is not None:
            continue
        if type(norm) is not torch.nn.BatchNorm2d or norm.num_features != conv.out_channels:
            continue
        if held[id(conv)] != 1 or held[id(norm)] != 1 or has_hooks(conv) or has_hooks(norm):
            continue
        act = model.get_submodule(act_name) if act_name is not None else None
        activation = _activation_name(act) if act is not None else None
        if activation is not None and (held[id(act)] != 1 or has_hooks(act)):
            activation = None
        new_norm = shallow_copy(norm, FoldedBatchNorm2d)
        _replace(model, norm_name, new_norm)
        caller = model if traced else model.get_submodule(conv_name.rpartition(".")[0])
        fold = Fold(new_norm, activation, (_place(model, conv_name), _place(model, norm_name)), _running(caller),
                    act if activation is not None else None)
        new_norm.__dict__["fold"] = fold
        conv.__dict__["_tilegemm_fold"] = fold
        if activation is not None:
            _replace(model, act_name, FoldedActivation(act, fold))
            # the wrapper's place too: an activation swapped in later must not find the old one applied by the conv
            fold.places += (_place(model, act_name),)
        folded.append((conv_name, norm_name, act_name if activation is not None else None))
    model.tilegemm_folded = folded
    return model


def _place(model: torch.nn.Module, name: str) -> tuple:
    """(parent, attribute name, module) of the module at ``name``."""
    parent, _, child = name.rpartition(".")
    parent = model.get_submodule(parent) if parent else model
    return parent, child, parent._modules[child]


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
