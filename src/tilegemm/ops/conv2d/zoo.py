"""The convolutions of torchvision's classification models, as the bench's ``zoo`` sweep reads them.

``zoo.json`` beside this file holds every distinct ``nn.Conv2d`` of those models (written by
``tools/conv2d_zoo_layers.py`` from the models themselves; see its docstring for how), each with the models it
comes from, so nothing here needs torchvision. ``zoo:I/N`` is part I (0-based) of N of the sweep: every N-th
layer from the I-th, so each part holds a like mix of small and large layers and a GPU call can run one part.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources

SCHEMA = "tilegemm-conv2d-zoo/1"
FIELDS = ("C", "K", "H", "W", "R", "S", "stride", "padding", "dilation", "groups", "padding_mode", "bias")
BATCH = 32  # the sweep's batch (the and the model bench's)
_PART = re.compile(r"^zoo:(\d+)/(\d+)$")


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


def parse_part(sweep: str) -> tuple[int, int] | None:
    """(part, parts) of a ``zoo:I/N`` sweep name, ``(0, 1)`` for ``zoo``, None for another name; ValueError
    for a malformed part."""
    if sweep == "zoo":
        return 0, 1
    if not sweep.startswith("zoo:"):
        return None
    m = _PART.match(sweep)
    if not m:
        raise ValueError(f"malformed sweep {sweep!r}: expected zoo or zoo:I/N (part I of N, 0 <= I < N)")
    part, parts = int(m.group(1)), int(m.group(2))
    if not 0 <= part < parts:
        raise ValueError(f"malformed sweep {sweep!r}: the part I of zoo:I/N must satisfy 0 <= I < N")
    return part, parts


def part_layers(part: int, parts: int) -> list[dict]:
    """Every ``parts``-th layer of :func:`bench_layers` from the ``part``-th."""
    return bench_layers()[part::parts]
