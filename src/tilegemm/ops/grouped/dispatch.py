"""``auto`` for the grouped family: the kernel a problem runs on, and its launch."""

from __future__ import annotations

import torch

from tilegemm.core import registry
from tilegemm.core.hardware import why_not_gluon
from tilegemm.core.runtime import interpreting, on_device
from tilegemm.ops.grouped import configs
from tilegemm.ops.grouped.problem import GroupedInt4Problem, GroupedProblem
from tilegemm.ops.w4a16 import fits_fragments

# (Rule) every layout goes to ``tiled``, the family's kernel of every layout and dtype, but for:
AUTO = "tiled"
# the 16-bit MoE forward (2-D x 3-D) on Hopper from more than TMA_MIN_ROWS rows an expert on average (M / G, from the
# shapes): tma's TMA-fed pipelined K loop ran ahead of tiled's pointer loads on 128-row tiles (docs/grouped.md,
# "Measured"), and under configs.TMA_HALF_TILE_MAX_ROWS rows an expert its 64-row tiles (configs.tma_config) ran ahead
# of tiled's 32- and 64-row tiles too, from 32 rows an expert (the many-expert models at 512 tokens); at 16 rows an
# expert (Mixtral at 64 tokens) neither kernel led on both products, and below it a decode step needs tiled's K split
# (docs/grouped.md, "Kernels")
TMA_MIN_ROWS = 16


def tma_rows(p: GroupedProblem) -> bool:
    """Whether ``p`` has rows enough an expert for ``tma``."""
    return p.M > TMA_MIN_ROWS * max(p.groups, 1)


# ``gluon`` (the dense gluon_f16 skeleton: a TMA producer warp group beside two consumers) for the plain 16-bit MoE
# forward (not gated) from configs.TMA_HALF_TILE_MAX_ROWS rows an expert on average, where tma runs its full 128-row
# tiles: there it ran ahead of tma on most of the moe sweep's cases, most on the many-expert models; under it tma's
# 64-row tiles stayed ahead (docs/grouped.md, "Kernels": gluon). The switch (off: tma there too) is a knob of the
# candidates tool (tools/grouped_rule_candidates.py), for tma's variants on the cases gluon takes
GLUON_FORWARD = True


def gluon_rows(p: GroupedProblem) -> bool:
    """Whether ``p`` has rows enough an expert for ``gluon`` (tma's full tiles)."""
    return p.M >= configs.TMA_HALF_TILE_MAX_ROWS * max(p.groups, 1)


# the 16-bit 2-D x 2-D product (groups along K: the MoE weight gradient, dB = A^T dY) on Hopper with at least this
# many tokens (K) a group on average (K / G, from the shapes): with long groups its TMA-fed K loop beats tiled's
# pointer loads, with short ones tiled stays ahead (docs/grouped.md, "Kernels": tma_k)
TMA_K_MIN_TOKENS_PER_GROUP = 512

# 4-bit experts (grouped_w4a16): ``dequant_dot`` (the weight dequantized inside the K loop) for all but:
INT4_AUTO = "dequant_dot"
# ``frag`` (W4A16's fragment kernel on the stacked experts' fragments, Hopper with Gluon, never the interpreter) up to
# this many rows an expert on average (M / E, from the shapes): decode steps, where a call streams the routed
# experts' weights once and the weight's 4 bits a value set its time (the dense fragment kernel's ratios at those M
# against dequant_dot's at decode: docs/grouped.md, "4-bit experts at decode: `frag`"). An estimate from the dense
# kernel, not refit: 16 covers the moe sweep's 1-64 token steps (Mixtral at 64 tokens: 16 rows an expert), where
# the row tile (four times the average, configs.INT4_FRAG) is at most 32 rows; above, dequant_dot stays (the many-expert
# models at 512 tokens, where it ran well) (docs/grouped.md, "4-bit experts at decode: `frag`")
INT4_FRAG_MAX_ROWS_PER_GROUP = 16
FRAG_KERNELS = ("frag",)  # the grouped_w4a16 kernels that read the stacked fragment layout
# ``dequant_grouped`` (one pass writes the 16-bit weight, then the 16-bit grouped product) from this many rows an
# expert on average (M / E, from the shapes): there the pass over every expert's weight costs less than what
# dequant_dot's in-loop dequantization adds to the product (docs/grouped.md, "4-bit experts at prefill")
INT4_DEQUANT_MIN_ROWS_PER_GROUP = 128
# its 16-bit scratch holds at most this many bytes a call; a larger weight is dequantized and multiplied a slice of
# the output's columns at a time (every expert's), and where not even one slice fits, dequant_dot runs it
INT4_DEQUANT_MAX_BYTES = 2 << 30


def takes_tma(p: GroupedProblem) -> bool:
    """Whether kernel ``tma`` takes ``p`` (:func:`tilegemm.ops.grouped.tma.why_not`; its module, which imports
    triton, only for a 16-bit 2-D x 3-D problem). Never under the interpreter, whose descriptors are emulated."""
    if p.layout != "2d3d" or p.dtype.itemsize != 2 or interpreting():
        return False
    from tilegemm.ops.grouped import tma

    return tma.why_not(p) is None


def takes_gluon(p: GroupedProblem) -> bool:
    """Whether kernel ``gluon`` takes ``p`` (:func:`tilegemm.ops.grouped.gluon.why_not`; its module, which imports
    Gluon, only for a plain 16-bit 2-D x 3-D problem). Never under the interpreter (Gluon has none)."""
    if p.layout != "2d3d" or p.dtype.itemsize != 2 or p.gated or interpreting():
        return False
    if why_not_gluon() is not None:  # (asked first: the module imports Gluon, whose API is Triton 3.6's)
        return False
    from tilegemm.ops.grouped import gluon

    return gluon.why_not(p) is None


def takes_tma_k(p: GroupedProblem) -> bool:
    """Whether kernel ``tma_k`` takes ``p`` (:func:`tilegemm.ops.grouped.tma_k.why_not`), never under the
    interpreter (as :func:`takes_tma`)."""
    if p.layout != "2d2d" or p.dtype.itemsize != 2 or interpreting():
        return False
    from tilegemm.ops.grouped import tma_k

    return tma_k.why_not(p) is None


def choose(p: GroupedProblem) -> str:
    if GLUON_FORWARD and p.layout == "2d3d" and not p.gated and gluon_rows(p) and takes_gluon(p):
        return "gluon"
    if p.layout == "2d3d" and tma_rows(p) and takes_tma(p):
        return "tma"
    if p.layout == "2d2d" and p.K >= TMA_K_MIN_TOKENS_PER_GROUP * max(p.groups, 1) and takes_tma_k(p):
        return "tma_k"
    return AUTO


def dequant_chunk(p: GroupedInt4Problem) -> int:
    """The output columns one pass and product of ``dequant_grouped`` take: all N where the scratch (every
    expert's ``[N, K]``, twice N gated, 16-bit) fits :data:`INT4_DEQUANT_MAX_BYTES`, else the most whole
    :data:`~tilegemm.ops.grouped.configs.INT4_DEQUANT_CHUNK_ALIGN` columns that fit; 0 where none fit."""
    per_column = p.groups * p.K * p.x.element_size() * (2 if p.gated else 1)
    if p.N * per_column <= INT4_DEQUANT_MAX_BYTES:
        return p.N
    align = configs.INT4_DEQUANT_CHUNK_ALIGN
    return INT4_DEQUANT_MAX_BYTES // max(per_column, 1) // align * align


_FRAG_REASON: dict = {}  # device -> why kernel frag cannot run there ("" when it can), asked once


def frag_usable(group_k: int, K: int, device: torch.device) -> bool:
    """Whether kernel ``frag`` can run on ``device`` for experts of group length ``group_k`` and ``K`` inputs: a
    Hopper GPU with Gluon (never the interpreter) and a group length the fragment layout takes."""
    if device.type != "cuda" or not fits_fragments(group_k, K):
        return False
    reason = _FRAG_REASON.get(device)
    if reason is None:
        with on_device(device):  # (the kernel's check reads the current GPU's capability: asked of this one)
            reason = _FRAG_REASON[device] = registry.get("grouped_w4a16", "frag").unavailable_reason() or ""
    return not reason


def keeps_fragments(group_k: int, K: int, device: torch.device) -> bool:
    """Whether a MoE block keeps its 4-bit experts' fragment layouts on ``device``: where kernel ``frag`` may run
    (:func:`frag_usable`). Elsewhere no call reads them and they would double the experts' memory."""
    return frag_usable(group_k, K, device)


def frag_rows(M: int, E: int) -> bool:
    """Whether ``auto`` gives M rows over E experts to ``frag`` (where it can run)."""
    return M <= INT4_FRAG_MAX_ROWS_PER_GROUP * max(E, 1)


def wants_frag(kernel: str, x: torch.Tensor, w, gated: bool) -> bool:
    """Whether a call of x ``[M, K]`` and stacked experts ``w`` runs ``frag``, or under ``auto`` may: its fragment
    layout (``w.fragments(gated)``) goes along. By name only where the kernel can run (elsewhere it refuses by
    name); under ``auto`` not inside a CUDA-graph capture that would have to make them (packing is no graph work:
    dequant_dot runs the call instead); while torch.compile traces, where they were made before."""
    if kernel not in FRAG_KERNELS and kernel != "auto":
        return False
    if torch.compiler.is_compiling():
        # packing is no graph work: a traced call takes the fragments made before (the MoE blocks keep them as
        # buffers), and the op picks its kernel when it runs
        return (w._frag_gated if gated else w._frag) is not None
    if x.device != w.device or x.dtype != w.dtype or x.shape[-1] != w.shape[-1] or (gated and w.shape[-2] % 2):
        return False  # (a call the checks refuse: nothing to pack for)
    if not frag_usable(w.group_k, w.shape[-1], x.device):
        return False
    if kernel != "auto":
        return True
    made = (w._frag_gated if gated else w._frag) is not None
    return frag_rows(x.shape[0], w.shape[0]) and (made or not torch.cuda.is_current_stream_capturing())


def choose_int4(p: GroupedInt4Problem) -> str:
    """The 4-bit experts' kernel: ``frag`` at decode sizes on Hopper (given the fragments), ``dequant_grouped`` at
    prefill sizes where its scratch fits, else dequant_dot."""
    if p.fweight is not None and frag_rows(p.M, p.groups) and frag_usable(p.group_k, p.K, p.x.device):
        return "frag"
    if p.M >= INT4_DEQUANT_MIN_ROWS_PER_GROUP * max(p.groups, 1) and dequant_chunk(p) > 0:
        return "dequant_grouped"
    return INT4_AUTO


def launch(p: GroupedProblem, kernel: str = "auto") -> None:
    """Run ``p`` on ``kernel`` (``auto``: :func:`choose`) on the operands' device."""
    name = choose(p) if kernel == "auto" else kernel
    with on_device(p.a.device):
        registry.launcher("grouped", name)(p)
