"""One registry of kernels, read by the public API, the tests and the benchmark.

Every kernel is registered by its op family (``matmul``, later ``w4a16``, ``conv2d``, ...) and a name
(``naive``, ``grouped``, ...). A registration is light: the launcher lives in a module that is imported
only when the kernel first runs, after :func:`tilegemm.runtime.ensure_backend` has chosen between
Triton's compiler and its interpreter. Adding a rung to a ladder is one file and one ``register`` call.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from .runtime import ensure_backend


@dataclass(frozen=True)
class KernelSpec:
    """A registered kernel.

    ``target`` is ``"module:function"``: the launcher, imported lazily. ``requires`` returns ``None``
    when the kernel can run on this machine, or a sentence saying why not (e.g. "needs a Hopper GPU").
    """

    op: str
    name: str
    summary: str
    target: str
    order: int = 0
    requires: Callable[[], str | None] | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)

    def unavailable_reason(self) -> str | None:
        return self.requires() if self.requires is not None else None

    def launcher(self) -> Callable[..., Any]:
        ensure_backend()
        module_name, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module_name), attr)


_REGISTRY: dict[str, dict[str, KernelSpec]] = {}
_PSEUDO: dict[str, dict[str, str]] = {}


def register(spec: KernelSpec) -> KernelSpec:
    family = _REGISTRY.setdefault(spec.op, {})
    if spec.name in family:
        raise ValueError(f"kernel {spec.op}/{spec.name} is registered twice")
    family[spec.name] = spec
    return spec


def register_pseudo(op: str, name: str, summary: str) -> None:
    """A name that is accepted but resolves to a registered kernel per call (``auto``)."""
    _PSEUDO.setdefault(op, {})[name] = summary


def ops() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def specs(op: str) -> list[KernelSpec]:
    """The registered kernels of one op family, in ladder order."""
    _load_families()
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(sorted(_REGISTRY))}")
    return sorted(_REGISTRY[op].values(), key=lambda s: (s.order, s.name))


def get(op: str, name: str) -> KernelSpec:
    _load_families()
    family = _REGISTRY.get(op)
    if family is None:
        specs(op)  # raises: unknown op
    if name not in family:
        choices = [s.name for s in specs(op)] + list(_PSEUDO.get(op, {}))
        raise ValueError(f"unknown {op} kernel {name!r}; choose one of: {', '.join(choices)}")
    return family[name]


def kernels(op: str = "matmul") -> dict[str, str]:
    """Names of the kernels of ``op`` with a one-line description each, in ladder order.

    Pseudo-kernels such as ``auto`` come last.
    """
    listing = {s.name: s.summary for s in specs(op)}
    listing.update(_PSEUDO.get(op, {}))
    return listing


_loaded = False


def _load_families() -> None:
    # Each family registers itself when its package is imported; these imports pull in no triton.
    global _loaded
    if _loaded:
        return
    _loaded = True
    from .ops import guide, matmul  # noqa: F401
