"""The convolutions of torchvision's classification models, as the bench's ``zoo`` sweep reads them.

``zoo.json`` beside this file holds every distinct ``nn.Conv2d`` of those models (written by
``tools/conv2d_zoo_layers.py`` from the models themselves; see its docstring for how), each with the models it
comes from, so nothing here needs torchvision. ``zoo:I/N`` is part I (0-based) of N of the sweep: every N-th
layer from the I-th, so each part holds a like mix of small and large layers and a GPU call can run one part.
``zoo:KIND`` is one kind of layer (:data:`KINDS`: stems, depthwise, grouped, 1x1, the other dense layers), and
``zoo:KIND:I/N`` a part of those.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources

SCHEMA = "tilegemm-conv2d-zoo/1"
FIELDS = ("C", "K", "H", "W", "R", "S", "stride", "padding", "dilation", "groups", "padding_mode", "bias")
BATCH = 32  # the sweep's batch (the and the model bench's)
_PART = re.compile(r"^zoo:(?:([a-z0-9]+):)?(\d+)/(\d+)$")
KINDS = ("stem", "depthwise", "grouped", "pointwise", "dense")  # the kinds auto routes apart (docs/conv2d.md)


def kind(layer: dict) -> str:
    """A layer's kind: ``stem`` (one group of at most 8 input channels, a filter of more than one tap),
    ``depthwise`` (a group an input channel), ``grouped`` (other groups), ``pointwise`` (1x1, one group, any
    stride) or ``dense`` (the rest)."""
    if layer["groups"] > 1:
        return "depthwise" if layer["groups"] == layer["C"] else "grouped"
    if layer["R"] == layer["S"] == 1:
        return "pointwise"
    return "stem" if layer["C"] <= 8 else "dense"


@lru_cache(maxsize=1)
def load() -> dict:
    """The parsed ``zoo.json`` (schema :data:`SCHEMA`)."""
    return json.loads(resources.files("tilegemm.ops.conv2d").joinpath("zoo.json").read_text())


def geometry_key(layer: dict) -> tuple:
    """A layer's convolution without its bias: what the bench times (it runs every case without a bias)."""
    return tuple(tuple(layer[f]) if isinstance(layer[f], list) else layer[f] for f in FIELDS[:-1])


def bench_layers() -> list[dict]:
    """The layers the bench times: the file's, those differing only in their bias merged (their models too)."""
    merged: dict[tuple, dict] = {}
    for layer in load()["layers"]:
        entry = merged.setdefault(geometry_key(layer), dict(layer, models=[]))
        entry["models"] = sorted(set(entry["models"]) | set(layer["models"]))
    return list(merged.values())


def parse_part(sweep: str) -> tuple[int, int, str | None] | None:
    """(part, parts, kind or None) of a ``zoo``, ``zoo:I/N``, ``zoo:KIND`` or ``zoo:KIND:I/N`` sweep name (the
    whole sweep: part 0 of 1), None for another name; ValueError for a malformed part or an unknown kind."""
    if sweep == "zoo":
        return 0, 1, None
    if not sweep.startswith("zoo:"):
        return None
    if sweep[4:] in KINDS:
        return 0, 1, sweep[4:]
    m = _PART.match(sweep)
    if not m:
        raise ValueError(f"malformed sweep {sweep!r}: expected zoo, zoo:I/N (part I of N, 0 <= I < N), zoo:KIND "
                         f"or zoo:KIND:I/N, KIND one of {', '.join(KINDS)}")
    name, part, parts = m.group(1), int(m.group(2)), int(m.group(3))
    if name is not None and name not in KINDS:
        raise ValueError(f"malformed sweep {sweep!r}: unknown kind {name!r}; the kinds: {', '.join(KINDS)}")
    if not 0 <= part < parts:
        raise ValueError(f"malformed sweep {sweep!r}: the part I of zoo:I/N must satisfy 0 <= I < N")
    return part, parts, name


def part_layers(part: int, parts: int, of_kind: str | None = None) -> list[dict]:
    """Every ``parts``-th layer of :func:`bench_layers` (those of kind ``of_kind`` where given) from the
    ``part``-th."""
    layers = bench_layers()
    if of_kind is not None:
        layers = [layer for layer in layers if kind(layer) == of_kind]
    return layers[part::parts]
