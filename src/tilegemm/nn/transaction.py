"""Changes to a model that happen whole or not at all: :func:`unchanged_on_error` records every module's and config's
attributes and puts them back where the block raises (the checkpoint loader's and quantize_'s transactions)."""

from __future__ import annotations

import contextlib
import copy

from torch import nn


def _state_of(obj) -> tuple[dict, list]:
    """``obj``'s attributes, and a copy of each dict, list and set among them (a module's parameters, buffers,
    submodules and hooks; a config's settings), for :func:`unchanged_on_error`."""
    attrs = dict(vars(obj))
    return attrs, [(v, copy.copy(v)) for v in attrs.values() if isinstance(v, (dict, list, set))]


def _put_back(obj, state: tuple[dict, list]) -> None:
    attrs, containers = state
    vars(obj).clear()
    vars(obj).update(attrs)
    for container, contents in containers:  # the same dict objects, with what they held (shared ones too)
        if isinstance(container, list):
            container[:] = contents
        else:
            container.clear()
            container.update(contents)


@contextlib.contextmanager
def unchanged_on_error(model: nn.Module):
    """Leave ``model`` exactly as it was given where the block raises (any exception, a KeyboardInterrupt too,
    which then propagates): every module's attributes and every config's (the model's, its submodels', their
    sub-configs) are recorded on entry and put back. Sound for what loading does, which replaces modules and
    tensors (setattr, ``_parameters`` / ``_buffers`` entries, hooks, config settings) and never writes into a
    tensor the model holds; recording costs a shallow copy of each module's attributes, no tensor data."""
    objs: dict[int, object] = {}
    for m in model.modules():
        objs[id(m)] = m
    stack = [vars(m).get("config") for m in list(objs.values())]
    while stack:  # the configs, and the configs they hold (text_config, vision_config, ...)
        c = stack.pop()
        if hasattr(c, "to_dict") and hasattr(c, "__dict__") and id(c) not in objs:
            objs[id(c)] = c
            stack += list(vars(c).values())
    saved = [(obj, _state_of(obj)) for obj in objs.values()]
    try:
        yield model
    except BaseException:
        for obj, state in saved:
            _put_back(obj, state)
        raise
