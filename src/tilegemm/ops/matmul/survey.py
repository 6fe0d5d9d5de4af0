"""``auto``'s untimed choice for unseen shapes: the candidates that ran best on the nearest surveyed shapes.

``tools/survey_configs.py`` times every config of every rung (``autotuned``, ``persistent_tma`` with its Gluon
kernel, ``split_k``) on a few hundred shapes drawn like the bench's ``random`` sweep from other seeds, on one
GPU; ``tools/fit_survey.py`` keeps, per surveyed shape, each candidate's efficiency (that shape's best time over
the candidate's) in ``tuned/survey/<gpu>.json`` (16-bit, NN) and ``<gpu>[-<family>][-<layout>].json`` (each other
layout surveyed: NT, ``nn.Linear``'s ``x @ W.T``; each other dtype family: ``tf32``, ``fp8``, see :func:`family`).
For a problem of such a family and layout whose shape class has no tuned entry, ``auto``
ranks the candidates valid for it by their efficiency on the :data:`NEIGHBOURS` surveyed shapes nearest to it
(the sum of |log2| ratios of M, N and K), weighted by ``1 / (DISTANCE_SOFTENING + distance)``, averaging logs;
a candidate a neighbour did not keep counts as :data:`FLOOR`. Each neighbour's log-efficiency is moved by how
the candidate's launch fills the GPU at the target rather than there (:func:`utilization`, :data:`WAVE_WEIGHT`).
It launches the best-ranked one.

It applies at every size; how its choices compare with the best candidate and with the rules, by survey and by
size of product: docs/rungs/auto.md.

:func:`identity`, :func:`rank` and the constants are plain Python (the fitting tool uses them without a GPU).
"""

from __future__ import annotations

import heapq
import json
import math
import warnings
from pathlib import Path

import torch

from tilegemm.core import hardware
from tilegemm.core.runtime import cdiv
from tilegemm.core.tuning import gpu_slug, table_slug

SCHEMA = "tilegemm-survey/1"
NEIGHBOURS = 3
DISTANCE_SOFTENING = 0.25
FLOOR = 0.5  # efficiency assumed for a candidate a neighbour ran slower than this (or not at all)
FIXED_SPLITS = (1, 2, 3, 4, 8)  # split_k's fixed splits; larger ones are the wave-filling split of the shape
# How much a change of utilization (:func:`utilization`) from a neighbour to the target moves a candidate's
# log-efficiency. Fitted leave-one-out on the surveys (docs/rungs/auto.md).
WAVE_WEIGHT = 0.5
GLUON_BLOCK_K = 64  # gluon_f16's K step (its configs do not name one)
# The tiles (M, N, K step) of the Gluon kernels whose configs do not name one: gluon_fp8's, and gluon_tf32's as
# it lies for NN operands (its accumulator is C^T's 128 x 256 there; tf32 is surveyed NN only). Plain Python, so
# that the fitting tool needs no GPU; a test holds them to the kernels' own constants.
GLUON_FP8_TILE = (128, 128, 128)
GLUON_TF32_NN_TILE = (256, 128, 32)


def identity(rung: str, config: dict) -> tuple[str, str]:
    """A candidate as the table names it: (rung, config as sorted JSON), a wave-filling split as ``"wave"``
    (``split_k``'s above :data:`FIXED_SPLITS`, every split of ``persistent_tma``)."""
    config = dict(config)
    if (rung == "split_k" and config.get("SPLIT_K") not in FIXED_SPLITS) or (rung == "persistent_tma"
                                                                          and "SPLIT_K" in config):
        config["SPLIT_K"] = "wave"
    return rung, json.dumps(config, sort_keys=True)


def distance(a, b) -> float:
    return sum(abs(math.log2(max(x, 1) / max(y, 1))) for x, y in zip(a, b))


def tile(config: dict) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a candidate's launch (KeyError for a config that names no tile)."""
    if config.get("GLUON_FP8"):
        return GLUON_FP8_TILE
    if config.get("GLUON_TF32"):
        return GLUON_TF32_NN_TILE
    return config["BLOCK_M"], config["BLOCK_N"], config.get("BLOCK_K", GLUON_BLOCK_K)


def utilization(config: dict, shape, sms: int, rung: str = "split_k") -> float:
    """The share of what ``config``'s launch at ``shape`` (M, N, K) could compute in the waves it takes that is the
    product's own: the padding of edge tiles and of K slices times the fill of the last wave of programs (one an
    SM: ``autotuned`` and ``split_k``'s tiles times SPLIT_K, ``persistent_tma``'s tiles (and K slices) on as many
    SMs). ``split_k``'s wave-filling split (``"wave"``) fills the GPU by construction: its tiles' padding only;
    ``persistent_tma``'s is worked out for the shape (one wave of work units, as the kernel launches it)."""
    M, N, K = (max(d, 1) for d in shape)
    bm, bn, bk = tile(config)
    tiles = -(-M // bm) * -(-N // bn)
    split = config.get("SPLIT_K", 1)
    if split == "wave" and rung == "persistent_tma":
        from tilegemm.ops.matmul.persistent_tma import slices
        from tilegemm.ops.matmul.split_k import wave_split

        steps = -(-K // bk)
        split = slices(steps, wave_split(tiles, steps, sms))  # as persistent_tma.split_of launches it
    elif split == "wave":
        return M * N / (tiles * bm * bn)
    programs, steps = tiles * split, -(-K // (bk * split))  # steps: a program's K steps (at most)
    return M * N * K / (-(-programs // sms) * sms * bm * bn * steps * bk)


def rank(shapes: list, target: tuple[int, int, int], candidates: list[int], configs: list | None = None,
         sms: int | None = None) -> list[int]:
    """``candidates`` (indices into the table's configs) best first for an ``(M, N, K)`` target, from the
    :data:`NEIGHBOURS` nearest of ``shapes`` (``[M, N, K, [[index, efficiency], ...]]``); with the table's
    ``configs`` (``[rung, config]``) and the GPU's ``sms``, corrected for utilization as ``auto`` ranks."""
    return _rank(_indexed(shapes), target, candidates, configs, sms)


def _indexed(shapes: list) -> list[tuple[float, float, float, dict, tuple]]:
    """The shapes as (log2 M, log2 N, log2 K, {candidate: efficiency}, (M, N, K)): what ranking reads."""
    return [(*(math.log2(max(d, 1)) for d in shape[:3]), dict((i, e) for i, e in shape[3]), tuple(shape[:3]))
            for shape in shapes]


def _rank(indexed: list, target, candidates: list[int], configs: list | None = None,
          sms: int | None = None) -> list[int]:
    logs = [math.log2(max(d, 1)) for d in target]

    def away(shape) -> float:
        return abs(shape[0] - logs[0]) + abs(shape[1] - logs[1]) + abs(shape[2] - logs[2])

    # A neighbour's efficiency of a candidate partly reflects how its grid filled the GPU there: a partial last
    # wave, edge tiles and K slices padded (a long-K product with few tiles leaves most SMs idle without a K
    # split). Each neighbour's log-efficiency is moved by WAVE_WEIGHT x the log of the candidate's utilization
    # at the target over that at the neighbour (floors too: a candidate slow there may fill the GPU here).
    def filled(i, shape) -> float:
        return (WAVE_WEIGHT * math.log(utilization(configs[i][1], shape, sms, configs[i][0])) if configs is not None
                else 0.0)

    here = {i: filled(i, target) for i in candidates}
    score = dict.fromkeys(candidates, 0.0)
    for shape in heapq.nsmallest(NEIGHBOURS, indexed, key=away):
        weight = 1.0 / (DISTANCE_SOFTENING + away(shape))
        kept = shape[3]
        for i in candidates:
            score[i] += weight * (math.log(kept.get(i, FLOOR)) + here[i] - filled(i, shape[4]))
    return sorted(candidates, key=lambda i: (-score[i], i))


# --- on the GPU ------------------------------------------------------------------------------------------------

_tables: dict[tuple[str, str, str], dict | None] = {}
_choices: dict[tuple, tuple[str, dict] | None] = {}
_MISSING = object()


# The dtype families a table speaks for, by the operands' dtype names (:func:`family`): one table serves fp16 and
# bf16 (they run the same kernels at the same speed), one tf32, one every pair of fp8 operands.
FAMILIES = {"fp16": "", "bf16": "", "tf32": "tf32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
            "fp8_e5m2xfp8_e4m3": "fp8", "fp8_e4m3xfp8_e5m2": "fp8"}


def family(dtype_name: str) -> str | None:
    """The table family of a :attr:`GemmProblem.tuning_dtype` (``fast`` accumulation aside): ``""`` for 16-bit,
    ``"tf32"``, ``"fp8"``; None for what no table speaks for (IEEE fp32, mixed 16-bit dtypes)."""
    return FAMILIES.get(dtype_name.removesuffix("+fast"))


def table_path(gpu_name: str, layout: str = "NN", family: str = "", own: bool = False) -> Path:
    """Where the table of a GPU, an operand layout and a dtype family ships: ``<gpu>.json`` for 16-bit NN,
    ``<gpu>[-<family>][-<layout>].json`` for the others (``nvidia-h200-NT.json``, ``nvidia-h200-fp8-NT.json``);
    ``<gpu>`` is the GPU's own slug or, where the package ships nothing for it, a sibling's
    (:func:`tilegemm.core.tuning.table_slug`). ``own``: always the GPU's own slug (where a survey of it is written,
    never over a sibling's table)."""
    name = (gpu_slug(gpu_name) if own else table_slug(gpu_name)) + (f"-{family}" if family else "") + ("" if layout == "NN" else f"-{layout}")
    return Path(__file__).resolve().parent.parent.parent / "tuned" / "survey" / f"{name}.json"


def table_for(gpu_name: str, layout: str = "NN", family: str = "") -> dict | None:
    """The survey table shipped for this GPU, layout and dtype family, or None (read once). A damaged table is
    ignored with a warning: the rules decide, as on a GPU without one."""
    table = _tables.get((gpu_name, layout, family), _MISSING)
    if table is _MISSING:
        table = None
        path = table_path(gpu_name, layout, family)
        if path.exists():
            try:
                doc = json.loads(path.read_text())
                if doc.get("schema") != SCHEMA:
                    raise ValueError(f"schema {doc.get('schema')!r}, expected {SCHEMA!r}")
                if doc.get("family", "") != family:
                    raise ValueError(f"it surveyed the {doc.get('family') or '16-bit'} family, not "
                                     f"{family or '16-bit'}")
                if family == "tf32" and layout != "NN":
                    raise ValueError("tf32 tables are NN only: tile() gives gluon_tf32's tile as it lies for NN")
                configs = [(str(rung), dict(config)) for rung, config in doc["configs"]]
                surveyed = doc.get("layouts") or [doc.get("layout", "NN")]
                if layout not in surveyed:
                    raise ValueError(f"it surveyed {sorted(surveyed)}, not {layout}")
                shapes = _indexed(doc["shapes"])
                # the surveyed box (log2 of M, N, K): the neighbours say nothing of shapes far outside it
                bounds = [(min(sh[d] for sh in shapes), max(sh[d] for sh in shapes)) for d in range(3)]
                table = dict(configs=configs, shapes=shapes, bounds=bounds)
                if not all(0 <= i < len(configs) for shape in shapes for i in shape[3]):
                    raise ValueError("a shape names a config the table lacks")
                for _, config in configs:
                    tile(config)  # utilization() reads it: a KeyError names a config without its tile
            except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
                warnings.warn(f"tilegemm: ignoring the damaged survey table {path} ({err}); auto's rules decide",
                              stacklevel=2)
                table = None
        _tables[(gpu_name, layout, family)] = table
    return table


# How far past the surveyed box (in log2 of each of M, N, K) a shape may lie and still be ranked from its
# neighbours: a factor of about 1.4. Far outside, the nearest surveyed shapes' choice ran slower than the rules
# (docs/rungs/auto.md).
OUTSIDE = 0.5


def table_of(p) -> dict | None:
    """The table of ``p``'s GPU, layout and dtype family (:func:`table_for`); None where it has none (IEEE fp32
    and mixed 16-bit dtypes have no family)."""
    fam = family(p.tuning_dtype)
    return None if fam is None else table_for(torch.cuda.get_device_name(p.out.device), p.layout, fam)


def covers(p) -> bool:
    """Whether ``p``'s GPU has a (readable) survey table of ``p``'s layout and dtype family (one file each;
    what has none keeps the rules) and ``p``'s shape lies within the surveyed box (:data:`OUTSIDE`)."""
    table = table_of(p)
    return table is not None and within(table, (p.M, p.N, p.K))


def within(table: dict, shape: tuple[int, int, int]) -> bool:
    """Whether ``shape`` lies within ``table``'s surveyed box, :data:`OUTSIDE` included."""
    return all(lo - OUTSIDE <= math.log2(max(d, 1)) <= hi + OUTSIDE for d, (lo, hi) in zip(shape, table["bounds"]))


def why_not(p) -> str | None:
    """None when the survey speaks for ``p`` whatever its size: operands of a dtype family that has tables
    (:func:`family`: 16-bit of one dtype, tf32, fp8 with its scales), one product (no batch), on a GPU; otherwise
    why not. (Its rows must also be 16-byte aligned, as the surveyed shapes' were: ``dispatch.surveyed`` asks.)"""
    fam = family(p.tuning_dtype)
    if fam is None:
        return "no surveyed dtype family"
    if p.batch != 1:
        return "batched"
    if not p.out.is_cuda:
        return "not on a GPU"
    if fam != "fp8" and (p.scale_a is not None or p.scale_b is not None):
        return "scales outside fp8"
    return None


def choose(p) -> tuple[str, dict] | None:
    """(rung, config) for problem ``p`` from its GPU's table; None without a table or a valid candidate.
    Answered once per shape, dtypes, layout and TMA-describability (bounded; a wave split is computed for
    the exact shape)."""
    from tilegemm.ops.matmul.persistent_tma import why_not as why_not_tma

    described = why_not_tma(p) is None
    key = (p.M, p.N, p.K, p.tuning_dtype, p.out.dtype, p.layout, described, p.out.device)
    picked = _choices.get(key, _MISSING)
    if picked is not _MISSING:
        return picked
    table = table_of(p)
    picked = None
    if table is not None:
        configs, sms = table["configs"], hardware.sm_count(p.out.device)
        valid = _valid_candidates(p, configs, described, sms)
        if valid:
            best = _rank(table["shapes"], (p.M, p.N, p.K), valid, configs, sms)[0]
            rung, config = configs[best]
            picked = rung, _resolved(p, rung, config)
    if len(_choices) >= 4096:
        _choices.clear()
    _choices[key] = picked
    return picked


def _valid_candidates(p, configs: list, described: bool, sms: int) -> list[int]:
    from tilegemm.ops.matmul import persistent_tma  # (kernel modules: imported when first asked, after triton's
    from tilegemm.ops.matmul.split_k import sensible_split  # backend is chosen; importing tilegemm imports none)

    tma = persistent_tma.candidates(p) if described else []
    valid = []
    for i, (rung, config) in enumerate(configs):
        if rung == "persistent_tma" and config.get("SPLIT_K") == "wave":
            ok = described and persistent_tma.offers_split(p, config)
        elif rung == "persistent_tma":
            ok = config in tma
        elif rung == "split_k":  # as split_k.configs
            split = config["SPLIT_K"]
            tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"])
            ok = split == "wave" or sensible_split(split, tiles, cdiv(p.K, config["BLOCK_K"]), sms)
        else:
            ok = rung == "autotuned"
        if ok:
            valid.append(i)
    return valid


def _resolved(p, rung: str, config: dict) -> dict:
    """The config to launch: a wave-filling split computed for ``p``."""
    config = dict(config)
    if rung == "persistent_tma" and config.get("SPLIT_K") == "wave":
        from tilegemm.ops.matmul.persistent_tma import wave_split

        config["SPLIT_K"] = wave_split(p, config)
    elif rung == "split_k" and config["SPLIT_K"] == "wave":
        from tilegemm.ops.matmul.split_k import wave_split

        tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"])
        config["SPLIT_K"] = wave_split(tiles, cdiv(p.K, config["BLOCK_K"]), hardware.sm_count(p.out.device))
    return config
