"""One registry of op families and their kernels, read by the public API, the tests, the bench and the CLI.

An op (``matmul``, ``w4a16``, ``conv2d``, ``copy``, ...) is registered with :func:`register_op`: its bench
adapter and what ``tilegemm tune`` can do with it, each named as ``"module:attribute"`` and imported only when
used. Its kernels are registered with :func:`register` by name (``naive``, ``grouped``, ...); a kernel's
launcher, too, lives in a module imported only when the kernel first runs, after
:func:`tilegemm.core.runtime.ensure_backend` has chosen between Triton's compiler and its interpreter.

Families register themselves when their package under :mod:`tilegemm.ops` is imported, which
``import tilegemm`` does (:data:`tilegemm.ops.FAMILIES`). This module imports nothing of tilegemm's but
:mod:`tilegemm.core.runtime`, so any layer may import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from tilegemm.core.runtime import ensure_backend


class NotApplicable(ValueError):
    """A kernel cannot run here (no GPU of its kind) or does not take this problem; the bench reports such a
    kernel as ``unavailable`` rather than failed."""


def resolve(target: str) -> Any:
    """The object that ``"package.module:attribute"`` names, its module imported now."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True)
class OpSpec:
    """A registered op.

    ``bench`` names the bench adapter class (a :class:`tilegemm.bench.base.BenchOp`); ``tune`` names the
    function ``tilegemm tune`` calls, ``tune(op_adapter, cases, dtype, kernels) -> list[row]``, and
    ``tunable`` the kernels it can tune; ``warmup`` names ``warmup(on_key=None, cases=None, dtype=None) ->
    list[str]``, which ``tilegemm warmup`` calls to compile the kernels of every known shape class ahead of
    time (or, given ``cases``, what ``auto`` picks for those). ``pseudo`` holds names accepted as ``kernel=``
    that pick a registered kernel per call (``auto``).
    """

    name: str
    summary: str
    bench: str | None = None
    tune: str | None = None
    tunable: tuple[str, ...] = ()
    warmup: str | None = None
    pseudo: dict[str, str] = field(default_factory=dict)

    def bench_adapter(self):
        if self.bench is None:
            return None
        return resolve(self.bench)


@dataclass(frozen=True)
class KernelSpec:
    """A registered kernel.

    ``target`` is ``"module:function"``: the launcher, imported lazily. ``why_not`` returns ``None``
    when the kernel can run on this machine, or a sentence saying why not (e.g. "needs a Hopper GPU"):
    the machine's side of the one contract, ``why_not(...) -> str | None``, that kernels answer per problem.
    ``tags`` say more about it (``"sm_90"``, ``"gluon"``, ``"variant of persistent_tma"``). ``dtypes`` names
    the bench dtypes (:mod:`tilegemm.core.dtypes`) it takes; empty: every dtype of its op.
    """

    op: str
    name: str
    summary: str
    target: str
    order: int = 0
    why_not: Callable[[], str | None] | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)
    dtypes: tuple[str, ...] = field(default_factory=tuple)

    def takes(self, dtype: str | None) -> bool:
        return dtype is None or not self.dtypes or dtype in self.dtypes

    def unavailable_reason(self) -> str | None:
        return self.why_not() if self.why_not is not None else None

    def launcher(self) -> Callable[..., Any]:
        ensure_backend()
        return resolve(self.target)


_OPS: dict[str, OpSpec] = {}
_KERNELS: dict[str, dict[str, KernelSpec]] = {}
_LAUNCHERS: dict[tuple[str, str], Callable[..., Any]] = {}  # (op, kernel) -> its launch function, once imported


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"op {spec.name} is registered twice")
    _OPS[spec.name] = spec
    _KERNELS.setdefault(spec.name, {})
    return spec


def register(spec: KernelSpec) -> KernelSpec:
    if spec.op not in _OPS:
        raise ValueError(f"kernel {spec.op}/{spec.name}: register the op {spec.op!r} first (register_op)")
    family = _KERNELS[spec.op]
    if spec.name in family or spec.name in _OPS[spec.op].pseudo:
        raise ValueError(f"kernel {spec.op}/{spec.name} is registered twice")
    family[spec.name] = spec
    _LAUNCHERS.pop((spec.op, spec.name), None)
    return spec


def unregister(op_name: str, name: str) -> KernelSpec:
    """Remove a registered kernel (for tests and plug-ins that registered one for a while)."""
    family = _KERNELS.get(op_name, {})
    if name not in family:
        raise ValueError(f"no {op_name} kernel {name!r} is registered")
    _LAUNCHERS.pop((op_name, name), None)
    return family.pop(name)


def ops() -> list[str]:
    """The registered ops, sorted."""
    return sorted(_OPS)


def op(name: str) -> OpSpec:
    if not isinstance(name, str):  # (a list is unhashable: its TypeError named no argument)
        raise TypeError(f"an op name is a str, one of: {', '.join(ops())}; got {type(name).__name__}")
    if name not in _OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(ops())}")
    return _OPS[name]


def specs(op_name: str) -> list[KernelSpec]:
    """The registered kernels of one op, in ladder order."""
    op(op_name)
    return sorted(_KERNELS[op_name].values(), key=lambda s: (s.order, s.name))


def get(op_name: str, name: str) -> KernelSpec:
    family = _KERNELS.get(op_name)
    if family is None:
        op(op_name)  # raises: unknown op
    named = type(name) is str  # (else a TypeError, as for any argument of the wrong type; a list is not hashable)
    if not named or name not in family:
        choices = ", ".join([s.name for s in specs(op_name)] + list(_OPS[op_name].pseudo))
        if not named:
            raise TypeError(f"{op_name} kernel must be a str, one of: {choices}; got {type(name).__name__}")
        raise ValueError(f"unknown {op_name} kernel {name!r}; choose one of: {choices}")
    return family[name]


def launcher(op_name: str, name: str) -> Callable[..., Any]:
    """The launch function of a registered kernel, imported on first use and kept (the families' hot path)."""
    fn = _LAUNCHERS.get((op_name, name))
    if fn is None:
        fn = _LAUNCHERS[op_name, name] = get(op_name, name).launcher()
    return fn


def kernels(op_name: str = "matmul") -> dict[str, str]:
    """Names of the kernels of ``op_name`` with a one-line description each, in ladder order.

    Pseudo-kernels such as ``auto`` come last.
    """
    listing = {s.name: s.summary for s in specs(op_name)}
    listing.update(op(op_name).pseudo)
    return listing
