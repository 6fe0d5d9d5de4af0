"""Fitting data for ``frag_wgmma``'s config rule (GPU): configs around today's rule on the fitting draws of the
``w4-random`` recipe, each checked, then timed as CUDA-graph replays against cuBLAS fp16; ``--fit`` proposes the
rule per M from such data (no GPU).

    PYTHONPATH=src python3 tools/w4a16_frag_sweep.py --out $OUT/w4-frag-sweep.json      (one H200, ~4 minutes)
    PYTHONPATH=src python3 tools/w4a16_frag_sweep.py --fit $OUT/w4-frag-sweep.json [MORE.json ...] [--out P.json]
    PYTHONPATH=src python3 tools/w4a16_frag_sweep.py --smoke --out /tmp/smoke.json      (CPU, Triton's
        interpreter, tiny shapes; frag_wgmma has no interpreter, so its candidates are listed as unavailable)

Shapes: the (N, K) pairs of ``w4_random_shapes(seed=...)`` for ``--seeds`` (default 60418,60419, the draws
``auto``'s rules are fitted on; 60417, the bench's held-out ``w4-random`` draw, is refused: no rule may be fitted
on it), each at every M of ``--ms`` (default 8,16,32,64,128,256), g128 fp16 weights; the seeds alternate shape by
shape, so a run cut by ``--budget`` (seconds, default 240, compiles included: no case starts after it) keeps
shapes of both; ``--limit-shapes N`` takes the first N pairs of each seed. Work splits over calls by ``--ms``
(``--fit`` takes several files).

Per case (seed, M, N, K): cuBLAS fp16 ``F.linear`` on the dequantized weight, today's ``auto`` (the public
``w4a16.matmul``; its kernel and config recorded), ``dequant_cublas``, and ``frag_wgmma`` launched as the op
launches it, ``frag_wgmma.run(problem, cfg)``, with each candidate config:

- families, timed on every case so that they compare across cases: each tile (BM rows of x, RH row tiles a
  warp, warps) the kernel takes for M (BM the power of two that holds M, from M = 64 also half of it and from
  128 a quarter, at least 32; RH 1/2 by 4/8 warps where the accumulator keeps to 128 fp32 registers a thread,
  RH * BM <= 256) at the K split today's rule would fill the GPU with for that tile (``fill``: its programs a SM
  by BM, slices of 8 steps or more), twice and half that and 1, all at today's STAGES and mode (OVERLAP/PIPE);
  and today's config itself (family ``rule``) with its split x2, /2, 1, STAGES 3/4/6 and each mode (none,
  OVERLAP alone, PIPE, PAIRS). Rings past 227 KB of shared memory are left out; a config the kernel refuses
  otherwise (its launch's ValueError, a compile or out-of-resources error) is recorded with the reason;
- then ``--refine-rounds`` (default 2) rounds, while the budget lasts, of up to ``--refine`` (4) one-step
  changes of each case's best so far (split x2 / x0.5, STAGES, mode): they count toward "the best of each case".

Each candidate is checked against an fp32 reference (``x.float() @ dequantize(w).float().T``, TF32 off; relative
Frobenius error below 2e-3, the output NaN-filled first) before it is timed. Times: a CUDA graph of one call
sizes a graph of back-to-back calls of about 300 us of GPU work (at most 64 calls), replayed 15 times, each
replay timed by events; the median replay over its calls, in microseconds (GPU time alone: the host drops out).
The L2 is NOT cleared and one call repeats, so a weight that fits in L2 (50 MB on the H200: every weight here
under about 100M values) is partly read from it; the bench's ``w4-random --cuda-graph`` run rotates copies past
L2 instead, which ``--rotate`` does here too (copies of every input, more memory and set-up). A split-K launch in
a graph also zeroes its arrival counters (one memset a call), as the op's launches do under capture.

Triton compiles each distinct constexpr config once per specialization of the launch's integers (1, multiples
of 16: here M, K / 64 and the steps a slice vary); the families' launches (507 distinct ones, of 349 constexpr
configs, among the default sweep's 5087 family candidates) are compiled first in ``--precompile J`` worker processes (default the CPU count less
one, up to 16; 0: none) into Triton's disk cache while the weights are made, so the timing loop finds them
compiled (each refinement round's likewise); half the budget left at most is spent waiting for them.

The JSON (``--out``) is rewritten after every case of the families (and every 16 cases of a refinement round),
one case a line: seed, M, N, K, input sets, today's config (``rule``), cuBLAS us, auto's us, kernel and config,
dequant_cublas's us, each candidate's config, families, stage and us and error (or why it did not run) and the
case's best. Printed: a line per case, the proposed rule per M (``--fit``'s), then last a table per M of geomean
ratios (cuBLAS time / time): auto, today's rule (frag_wgmma with today's config), the fitted rule, the best single
family (one per M; and one per M and N/K class: N below 3200 or not, K below 4096 or not), the best frag_wgmma
config of each case, dequant_cublas, and the best of frag_wgmma and dequant_cublas of each case.

``--fit FILE.json [...]`` proposes, per M, the rule with the best geomean that gives every case a config that was
timed: a tile, or two (the first where its tiles make at least ``alpha`` SMs' worth, else the second; it must beat
the best one-tile rule by 1%), a K split ``split_within(tiles, ceil(K / 64), P x SMs, S)`` capped or not at 4
(P programs a SM, S least steps a slice), at the families' STAGES and mode unless another was timed on every
case and wins by 1%. Beside it: today's rule, the best of each case, the rule fitted on one seed alone and
scored on the other, today's rule with one knob changed, and the N below which dequant_cublas would be better;
then, for neighbouring M up to 16, the weights whose time grows by more than 10% from one M to the next (the
W4A16 target for M = 1..16), under today's rule and the proposed one. With ``--out`` the proposal is written as
JSON too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HELD_OUT_SEED = 60417  # the bench's w4-random seed (tilegemm.ops.w4a16.bench.W4_RANDOM_SEED; checked below)
DEFAULT_SEEDS = (60418, 60419)
DEFAULT_MS = (8, 16, 32, 64, 128, 256)
SMOKE_SHAPES = ((128, 256), (192, 384))  # (N, K) under the interpreter
SMOKE_MS = (1, 8, 16)
SMEM_LIMIT = 227 * 1024  # shared memory a block may take on Hopper
TOL = 2e-3  # relative error of a candidate against the fp32 reference
# (OVERLAP, PIPE, PAIRS); PAIRS is the plain loop waiting once every two K steps (STAGES >= 4)
MODES = {"none": (False, False, False), "overlap": (True, False, False), "pipe": (True, True, False),
         "pairs": (False, False, True)}
TILES = ((1, 4), (2, 4), (1, 8), (2, 8))  # (RH, num_warps): 64, 128, 128, 256 weight rows a program


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- the candidates ------------------------------------------------------------------------------------------


def mode_of(cfg: dict) -> str:
    """``none``, ``overlap``, ``pipe`` or ``pairs`` (PIPE runs with OVERLAP on; the kernel takes PIPE first)."""
    if cfg["PIPE"]:
        return "pipe"
    if cfg.get("PAIRS"):
        return "pairs"
    return "overlap" if cfg["OVERLAP"] else "none"


def with_mode(cfg: dict, mode: str) -> dict:
    overlap, pipe, pairs = MODES[mode]
    return dict(cfg, OVERLAP=overlap, PIPE=pipe, PAIRS=pairs)


def effective_split(K: int, split: int) -> int:
    """The K split the launch makes of ``split`` (``frag_wgmma.launch_args``: whole slices of 64-wide steps)."""
    steps = cdiv(K, 64)
    return cdiv(steps, cdiv(steps, max(1, min(split, steps))))


def canonical(cfg: dict, K: int) -> dict:
    """``cfg`` with the split the launch makes of it, in one key order (equal configs compare equal)."""
    return dict(BM=cfg["BM"], RH=cfg["RH"], num_warps=cfg["num_warps"], STAGES=cfg["STAGES"],
                SPLIT_K=effective_split(K, cfg["SPLIT_K"]), OVERLAP=bool(cfg["OVERLAP"]), PIPE=bool(cfg["PIPE"]),
                PAIRS=bool(cfg.get("PAIRS", False)))


def config_key(cfg: dict) -> str:
    return "bm{BM}.rh{RH}.w{num_warps}.s{STAGES}.k{SPLIT_K}.".format(**cfg) + mode_of(cfg)


def smem_bytes(cfg: dict) -> int:
    """The ring's shared memory: a slot holds x's [BM, 64] 16-bit tile and RH * warps row tiles of 512 bytes."""
    return cfg["STAGES"] * (cfg["BM"] * 64 * 2 + cfg["RH"] * cfg["num_warps"] * 512)


def bm_options(M: int) -> list[int]:
    """x's rows a program: the power of two (8 .. 256) that holds M; from M = 64 also half of it, from 128 a
    quarter (at least 32: fewer rows read the weight once more per extra tile of x)."""
    top = min(256, max(8, 1 << (M - 1).bit_length()))
    out = [top]
    if M >= 64:
        out += [b for b in (top // 2, top // 4 if M >= 128 else 0) if b >= 32]
    return out


def programs_per_sm(bm: int) -> int:
    """Today's rule: K-split programs a SM it fills to by x's rows a program (configs.FRAG_WGMMA_PROGRAMS_PER_SM)."""
    from tilegemm.ops.w4a16.configs import FRAG_WGMMA_PROGRAMS_PER_SM as per_sm

    return per_sm[0 if bm <= 16 else 1 if bm <= 64 else 2]


def tiles_of(M: int, N: int, bm: int, rh: int, warps: int) -> int:
    """Programs before the K split as today's rule counts them: tiles of 16 * RH * warps weight rows by tiles of
    BM rows of x."""
    return cdiv(N, 16 * rh * warps) * cdiv(M, bm)


def split_policy(tiles: int, K: int, sms: int, per_sm: float, min_steps: int, cap: int = 0) -> int:
    """The K split of a rule: powers of two while ``tiles * split`` stays within ``per_sm * sms`` programs and
    a slice keeps ``min_steps`` steps (configs.split_within), at most ``cap`` (0: no cap)."""
    from tilegemm.ops.w4a16.configs import split_within

    split = split_within(tiles, cdiv(K, 64), max(1, int(per_sm * sms)), min_steps)
    return min(split, cap) if cap else split


def fill_split(M: int, N: int, K: int, bm: int, rh: int, warps: int, sms: int) -> int:
    """The split today's rule makes for this tile: up to its programs a SM, slices of its least steps or more."""
    from tilegemm.ops.w4a16.configs import FRAG_WGMMA_MIN_STEPS

    return split_policy(tiles_of(M, N, bm, rh, warps), K, sms, programs_per_sm(bm),
                        FRAG_WGMMA_MIN_STEPS[0 if bm <= 8 else 1])


SPLIT_LABELS = ("fill", "fill*2", "fill/2", "1")


def split_for_label(label: str, fill: int) -> int:
    return {"fill": fill, "fill*2": 2 * fill, "fill/2": max(1, fill // 2), "1": 1}[label]


def family_candidates(M: int, N: int, K: int, sms: int, base: dict) -> dict[str, list[str]]:
    """The families' configs of a case: ``{config_key: [family, ...]}`` (configs in canonical form, the ring
    within shared memory), with ``configs[key]`` to read them back; ``base`` is today's rule's config."""
    base = canonical(base, K)
    found: dict[str, tuple[dict, list[str]]] = {}

    def add(family: str, cfg: dict) -> None:
        cfg = canonical(cfg, K)
        if smem_bytes(cfg) > SMEM_LIMIT:
            return
        found.setdefault(config_key(cfg), (cfg, []))[1].append(family)

    add("rule", base)
    for bm in bm_options(M):
        for rh, warps in TILES:
            if rh * bm > 256:  # accumulators past 128 fp32 registers a thread
                continue
            fill = fill_split(M, N, K, bm, rh, warps, sms)
            tile = dict(base, BM=bm, RH=rh, num_warps=warps)
            for label in SPLIT_LABELS:
                add(f"bm{bm}.rh{rh}.w{warps}.split={label}", dict(tile, SPLIT_K=split_for_label(label, fill)))
    split = base["SPLIT_K"]
    for label, value in (("x2", 2 * split), ("/2", max(1, split // 2)), ("1", 1)):
        add(f"rule.split{label}", dict(base, SPLIT_K=value))
    for stages in (3, 4, 6):
        if stages != base["STAGES"]:
            add(f"rule.stages={stages}", dict(base, STAGES=stages))
    for mode in MODES:
        if mode != mode_of(base):
            add(f"rule.mode={mode}", with_mode(base, mode))
    return {key: (cfg, families) for key, (cfg, families) in found.items()}


def neighbours(cfg: dict, K: int) -> list[dict]:
    """One-step changes of ``cfg`` for the per-case refinement: split x2 / x0.5, the other STAGES, the other
    modes (within shared memory)."""
    out = [dict(cfg, SPLIT_K=2 * cfg["SPLIT_K"])]
    if cfg["SPLIT_K"] > 1:
        out.append(dict(cfg, SPLIT_K=cfg["SPLIT_K"] // 2))
    out += [dict(cfg, STAGES=s) for s in (3, 4, 6) if s != cfg["STAGES"]]
    out += [with_mode(cfg, m) for m in MODES if m != mode_of(cfg)]
    out = [canonical(c, K) for c in out]
    # (PAIRS runs the plain loop on a ring of 4 slots or more: the launch refuses it otherwise)
    return [c for c in out if smem_bytes(c) <= SMEM_LIMIT and (not c["PAIRS"] or c["STAGES"] >= 4)]


# --- compiling ahead (GPU): Triton's disk cache filled by worker processes ---------------------------------------


def compile_spec(M: int, N: int, K: int, cfg: dict, group_k: int = 128) -> tuple:
    """(grid, arguments, keyword arguments) of the launch ``frag_wgmma.run`` makes for a fp16 case with ``cfg``,
    every tensor replaced by its dtype (what ``JITFunction.warmup`` takes); made from shape-only (meta) tensors by
    the op's own ``launch_args``, so the integers that Triton specializes on are the launch's."""
    import torch

    from tilegemm.ops.w4a16 import frag_wgmma

    meta = dict(device="meta")
    n16, k64 = cdiv(N, 256) * 16, cdiv(K, 128) * 2  # format.pack_fragments' padding
    x = torch.empty(M, K, dtype=torch.float16, **meta)
    fw = torch.empty(n16, k64, 32, 4, dtype=torch.int32, **meta)
    fzs = torch.empty(cdiv(k64 * 64, group_k), n16, 8, 4, dtype=torch.float16, **meta)
    out = torch.empty(M, N, dtype=torch.float16, **meta)
    _, grid, args, kwargs = frag_wgmma.launch_args(x, fw, fzs, None, out, N, K, group_k, "none", cfg)
    args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
    return grid, args, kwargs


def spec_key(spec: tuple) -> tuple:
    """What Triton's cache key holds of a launch: dtypes, each integer as 1, a multiple of 16 or neither (and its
    width), the constexprs."""
    _, args, kwargs = spec

    def special(a):
        if not isinstance(a, int) or isinstance(a, bool):
            return str(a)
        return "1" if a == 1 else ("i64" if abs(a) >= 2 ** 31 else "i32") + ("D" if a % 16 == 0 else "")

    return tuple(special(a) for a in args), tuple(sorted((k, str(v)) for k, v in kwargs.items()))


def _warm(specs: list) -> tuple[int, list[str]]:
    """In a worker process: compile each launch into Triton's cache (no launch); (compiled, errors)."""
    import importlib

    importlib.import_module("tilegemm")  # first: it chooses the GPU (not the interpreter) before triton loads
    from tilegemm.ops.w4a16.frag_wgmma import frag_wgmma_kernel

    done, errors = 0, []
    for grid, args, kwargs in specs:
        try:
            frag_wgmma_kernel.warmup(*args, grid=grid, **kwargs)
            done += 1
        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: the timing loop reports it
            errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
    return done, errors


class Precompiler:
    """Compiles launches in ``jobs`` worker processes (spawned: each its own CUDA context) into Triton's disk
    cache, where the timing loop's first launch of each then finds it. Specs already sent are not sent again."""

    def __init__(self, jobs: int):
        self.jobs, self.sent, self.pool, self.futures = jobs, set(), None, []
        self.stats = dict(workers=jobs, sent=0, compiled=0, refused=0, errors=[], seconds=0.0)

    def submit(self, specs: list) -> None:
        fresh = []
        for spec in specs:
            key = spec_key(spec)
            if key not in self.sent:
                self.sent.add(key)
                fresh.append(spec)
        if not fresh or self.jobs <= 0:
            return
        try:
            if self.pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                self.pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
            chunk = max(1, min(8, len(fresh) // (4 * self.jobs)))
            self.futures += [self.pool.submit(_warm, fresh[i:i + chunk]) for i in range(0, len(fresh), chunk)]
            self.stats["sent"] += len(fresh)
        except Exception as exc:  # noqa: BLE001 - a broken pool: the launches compile on first use instead
            self.stats["errors"].append(f"pool: {type(exc).__name__}: {str(exc)[:160]}")
            self.jobs = 0

    def wait(self, timeout: float) -> None:
        """Until every sent compile is done or ``timeout`` seconds pass (what is left compiles on first launch)."""
        from concurrent.futures import wait

        start = time.time()
        done, pending = wait(self.futures, timeout=max(0.0, timeout))
        for f in done:
            try:
                n, errors = f.result()
            except Exception as exc:  # noqa: BLE001 - a worker that died: its configs compile on first launch
                n, errors = 0, [f"worker: {type(exc).__name__}: {str(exc)[:160]}"]
            self.stats["compiled"] += n
            self.stats["refused"] += len(errors)
            self.stats["errors"] += errors[: max(0, 20 - len(self.stats["errors"]))]  # the first few messages
        self.futures = list(pending)
        self.stats["seconds"] += time.time() - start

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


# --- timing --------------------------------------------------------------------------------------------------

GRAPH_US = 300.0  # GPU work captured in one graph
REPLAYS = 15


_STREAM = []  # the one side stream the graphs are warmed and captured on (its split-K workspace made once)


def graph_us(call, sets: int, calls: int, replays: int) -> float:
    """Median GPU microseconds per call: ``calls`` calls of ``call(i)`` (i cycling over ``sets`` input sets)
    captured back to back in one CUDA graph (after a warm call of each set on the capture stream), replayed
    ``replays`` times, each replay timed by events. Captured by ``capture_begin``/``capture_end`` rather than
    ``torch.cuda.graph``, which empties the allocator's cache (and in some torch versions collects garbage)
    before every capture."""
    import torch

    if not _STREAM:
        _STREAM.append(torch.cuda.Stream())
    stream = _STREAM[0]
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for i in range(sets):
            call(i)
        stream.synchronize()
        graph.capture_begin()
        try:
            for c in range(calls):
                call(c % sets)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) * 1e3 / calls for start, end in events)
    del graph
    return times[len(times) // 2]


def timed_us(call, sets: int) -> float:
    """GPU microseconds per call: a graph of one call a set gives the estimate that sizes the timed graph (about
    GRAPH_US of work, at most 64 calls), replayed REPLAYS times."""
    estimate = graph_us(call, sets, sets, 3)
    per_set = max(1, min(64 // sets, round(GRAPH_US / max(estimate, 1.0) / sets)))
    return graph_us(call, sets, sets * per_set, REPLAYS)


def host_us(call) -> float:
    """The interpreter (smoke runs): median wall time of three calls; says nothing about a GPU."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call(0)
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[1]


def warm_gpu(seconds: float = 1.0) -> None:
    """Half-precision GEMMs for ``seconds``: the clocks up before the first case (the GPU idled while compiling)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    end = time.time() + seconds
    while time.time() < end:
        a @ a
        torch.cuda.synchronize()


def rel_err(out, ref) -> float:
    """Relative Frobenius error of ``out`` against the fp32 ``ref`` (inf where it holds NaN or inf)."""
    import torch

    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def measure(call, ref, sets: int, gpu: bool, fill=None) -> dict:
    """``call`` checked on set 0 against ``ref`` (``fill()`` first: its output made NaN, so a tile left unwritten
    shows), then timed: ``{"us", "err"}``, or ``{"error"}`` (and ``err`` where the check failed)."""
    try:
        if fill is not None:
            fill()
        err = rel_err(call(0), ref)
        if not err < TOL:
            return dict(err=err, error=f"wrong: relative error {err:.2e} >= {TOL:g}")
        us = timed_us(call, sets) if gpu else host_us(call)
        return dict(us=round(us, 3), err=float(f"{err:.3g}"))
    except Exception as exc:  # noqa: BLE001 - the kernel's own refusal (launch check, compile, resources)
        text = str(exc).strip()
        message = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
        if gpu:
            import torch

            try:  # a fault (an illegal address) leaves the context unusable: every later call would fail
                torch.cuda.synchronize()
            except Exception as sticky:  # noqa: BLE001
                raise ContextLost(f"{message}; then {type(sticky).__name__}: {str(sticky)[:200]}") from exc
        return dict(error=message)


class ContextLost(RuntimeError):
    """The GPU's context failed (a kernel fault): nothing more can be measured in this process."""


# --- the sweep -----------------------------------------------------------------------------------------------


class Shape:
    """One (N, K) weight, g128 fp16 from a fixed seed, in ``sets`` copies (``--rotate``): its 4-bit form (the
    fragment layout made, as ``Int4Linear`` makes it) and the dequantized fp16 weight cuBLAS multiplies."""

    def __init__(self, seed: int, index: int, N: int, K: int, sets: int, device: str):
        import torch

        from tilegemm import w4a16

        self.seed, self.index, self.N, self.K, self.device = seed, index, N, K, device
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + index)
        w = w4a16.quantize(torch.randn(N, K, device=device, dtype=torch.float16, generator=gen) * 0.02, 128)
        self.weights = [w] + [w4a16.Int4Weight(w.qweight.clone(), w.scales.clone(), w.zeros.clone(), w.group_size,
                                               w.shape) for _ in range(sets - 1)]
        if device == "cuda":
            for wi in self.weights:
                wi.fragments()
        dense = w4a16.dequantize(w)
        self.dense = [dense] + [dense.clone() for _ in range(sets - 1)]


class Case:
    """One M on a :class:`Shape`: x and the output per input set, the fp32 reference of set 0."""

    def __init__(self, shape: Shape, M: int, sets: int):
        import torch

        from tilegemm.ops.w4a16.problem import W4A16Problem

        self.shape, self.M, self.sets = shape, M, sets
        dev, N, K = shape.device, shape.N, shape.K
        gen = torch.Generator(device=dev).manual_seed(shape.seed * 100000 + shape.index * 10000 + M)
        self.x = [torch.randn(M, K, device=dev, dtype=torch.float16, generator=gen) for _ in range(sets)]
        self.out = [torch.empty(M, N, device=dev, dtype=torch.float16) for _ in range(sets)]
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference in full fp32
        try:
            self.ref = self.x[0].float() @ shape.dense[0].float().T
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        self.problems = []
        for i in range(sets):
            w = shape.weights[i]
            fw, fzs = w.fragments() if dev == "cuda" else (None, None)
            self.problems.append(W4A16Problem(x=self.x[i], qweight=w.qweight, scales=w.scales, zeros=w.zeros,
                                              bias=None, out=self.out[i], group_k=w.group_k, activation="none",
                                              fweight=fw, fzs=fzs, kernel="frag_wgmma"))

    def fill(self) -> None:
        self.out[0].fill_(float("nan"))


def run_baselines(case: Case, gpu: bool) -> dict:
    """cuBLAS fp16, today's auto (its kernel and config) and dequant_cublas on ``case``."""
    import torch.nn.functional as F

    from tilegemm import w4a16
    from tilegemm.ops.w4a16 import configs, dispatch

    s, M, N, K = case.shape, case.M, case.shape.N, case.shape.K
    cublas = measure(lambda i: F.linear(case.x[i], s.dense[i]), case.ref, case.sets, gpu)
    frag = dispatch.frag_usable(s.weights[0].group_k, case.x[0].device, K)
    kernel = dispatch.choose(M, frag, N)
    auto = measure(lambda i: w4a16.matmul(case.x[i], s.weights[i]), case.ref, case.sets, gpu)
    auto["kernel"] = kernel
    if kernel == "frag_wgmma":
        auto["config"] = canonical(configs.frag_wgmma_config(M, N, K, case.x[0].device), K)
    dequant = measure(lambda i: w4a16.matmul(case.x[i], s.weights[i], kernel="dequant_cublas"), case.ref,
                      case.sets, gpu)
    return dict(cublas=cublas, auto=auto, dequant_cublas=dequant)


def run_candidate(case: Case, cfg: dict, gpu: bool, unavailable: str) -> dict:
    """frag_wgmma with ``cfg``, launched as the op launches it (``frag_wgmma.run(problem, cfg)``)."""
    if unavailable:
        return dict(error=f"unavailable: {unavailable}")
    from tilegemm.ops.w4a16 import dispatch

    run = dispatch.launcher("frag_wgmma")

    def call(i):
        run(case.problems[i], cfg)
        return case.out[i]

    return measure(call, case.ref, case.sets, gpu, fill=case.fill)


def rotation_sets(shape_bytes: int, M: int, N: int, K: int, rotate: bool, machine) -> int:
    """Input sets a case rotates through: 1, or with ``--rotate`` as the bench's CUDA-graph mode does (enough to
    pass L2 twice, at most 16)."""
    if not rotate:
        return 1
    from tilegemm.bench.runner import rotation_count

    return rotation_count(shape_bytes + (M * K + M * N) * 2, machine, True)


def write_json(path: str, data: dict) -> None:
    """``data`` to ``path`` (replaced whole), compact, one case a line; keys starting with ``_`` left out."""
    def public(d: dict) -> dict:
        return {k: v for k, v in d.items() if not k.startswith("_")}

    cases = data.get("cases")
    head = json.dumps({k: v for k, v in data.items() if k != "cases"}, indent=1)
    if cases is not None:
        head = head[:-2] + ',\n "cases": [\n' + ",\n".join(json.dumps(public(c), separators=(",", ":"))
                                                          for c in cases) + "\n]}"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(head + "\n")
    os.replace(tmp, path)


def case_record(shape: Shape, M: int, sets: int, rule: dict, baselines: dict) -> dict:
    return dict(seed=shape.seed, M=M, N=shape.N, K=shape.K, sets=sets, rule=rule,
                cublas_us=baselines["cublas"].get("us"), cublas=baselines["cublas"], auto=baselines["auto"],
                dequant_cublas=baselines["dequant_cublas"], candidates=[])


def best_candidate(record: dict) -> dict | None:
    timed = [c for c in record["candidates"] if c.get("us")]
    return min(timed, key=lambda c: c["us"]) if timed else None


class Sweep:
    """One run: the plan (every case's families), the weights, the compilers, the JSON written as it goes."""

    def __init__(self, args):
        import torch

        from tilegemm.core import registry
        from tilegemm.core.hardware import machine_info, sm_count
        from tilegemm.ops.w4a16 import configs

        self.args, self.started = args, time.time()
        self.deadline = self.started + args.budget
        self.gpu = not args.smoke
        if self.gpu and not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run on the GPU machine, or use --smoke for a CPU run under the interpreter")
        self.device = "cuda" if self.gpu else "cpu"
        self.machine = machine_info()
        self.sms = sm_count(torch.device(self.device))
        self.unavailable = registry.get("w4a16", "frag_wgmma").unavailable_reason() or ""
        self.shapes = shape_list(args)
        # (a smoke run compiles ahead only when asked: its workers then report the interpreter's refusal)
        self.pre = Precompiler(args.precompile if not self.gpu or not self.unavailable else 0)
        self.data = dict(tool="tools/w4a16_frag_sweep.py", meta=dict(
            machine=self.machine.to_dict(), sms=self.sms, seeds=args.seeds, ms=args.ms, budget_s=args.budget,
            rotate=args.rotate, refine=args.refine, refine_rounds=args.refine_rounds, tolerance=TOL,
            timer="host wall clock (interpreter)" if not self.gpu else
            f"CUDA-graph replays, median of {REPLAYS}, ~{GRAPH_US:g} us of work a graph, L2 " +
            ("rotated past (copies)" if args.rotate else "not cleared (one call repeated)"),
            frag_wgmma_unavailable=self.unavailable or None, precompile=self.pre.stats, partial=True), cases=[])
        self.plan = []  # (shape index, M, today's config, families)
        for si, (seed, index, N, K) in enumerate(self.shapes):
            for M in args.ms:
                rule = canonical(configs.frag_wgmma_config(M, N, K, torch.device(self.device)), K)
                self.plan.append((si, M, rule, family_candidates(M, N, K, self.sms, rule)))
        self.made: dict[int, Shape] = {}
        self.records: dict[tuple[int, int], dict] = {}

    def sets(self, si: int, M: int) -> int:
        seed, index, N, K = self.shapes[si]
        return rotation_sets(weight_bytes(N, K), M, N, K, self.args.rotate, self.machine)

    def shape(self, si: int) -> Shape:
        if si not in self.made:
            seed, index, N, K = self.shapes[si]
            self.made[si] = Shape(seed, index, N, K, max(self.sets(si, M) for M in self.args.ms), self.device)
        return self.made[si]

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        if self.args.out:
            write_json(self.args.out, self.data)

    def run(self) -> dict:
        meta = self.data["meta"]
        specs = [compile_spec(M, self.shapes[si][2], self.shapes[si][3], cfg)
                 for si, M, rule, fams in self.plan for cfg, _ in fams.values()]
        meta["family_candidates"] = len(specs)
        meta["family_compiles"] = len({spec_key(spec) for spec in specs})  # distinct launches Triton compiles
        print(f"{len(self.plan)} cases, {len(specs)} family candidates, {meta['family_compiles']} distinct "
              f"compiles", flush=True)
        self.pre.submit(specs)
        if self.pre.jobs:
            for si in range(len(self.shapes)):  # the weights made while the workers compile
                self.shape(si)
            self.pre.wait(0.5 * self.left())
            print(f"precompiled {self.pre.stats['compiled']} of {self.pre.stats['sent']} launches in "
                  f"{time.time() - self.started:.0f} s ({self.pre.stats['refused']} refused)", flush=True)
        if self.gpu:
            warm_gpu()
        try:
            self.families()
            self.refine()
        except ContextLost as exc:
            meta["aborted"] = str(exc)
            print(f"stopped: the GPU context failed ({exc})", flush=True)
        self.pre.close()
        meta["partial"] = len(self.data["cases"]) < len(self.plan) or "aborted" in meta
        meta["seconds"] = round(time.time() - self.started, 1)
        self.save()
        return self.data

    def families(self) -> None:
        """Baselines and the families of every case in plan order, while the budget lasts."""
        for n, (si, M, rule, fams) in enumerate(self.plan):
            if self.left() < 0:
                print(f"budget spent: {n} of {len(self.plan)} cases", flush=True)
                return
            s = self.shape(si)
            case = Case(s, M, self.sets(si, M))
            record = case_record(s, M, case.sets, rule, run_baselines(case, self.gpu))
            for key, (cfg, families) in fams.items():
                record["candidates"].append(dict(key=key, config=cfg, families=families, stage="family",
                                                 **run_candidate(case, cfg, self.gpu, self.unavailable)))
            finish_record(record)
            self.records[si, M] = record
            self.data["cases"].append(record)
            self.save()
            print(progress_line(record), flush=True)

    def refine(self) -> None:
        """Rounds of one-step changes from each case's best so far (``--refine`` a case), compiled together, then
        timed, while the budget lasts."""
        for round_ in range(1, self.args.refine_rounds + 1):
            todo = []
            for (si, M), record in self.records.items():
                best = best_candidate(record)
                if best is None:
                    continue
                seen = {c["key"] for c in record["candidates"]}
                fresh = {config_key(c): c for c in neighbours(best["config"], record["K"]) if config_key(c) not in seen}
                if fresh:
                    todo.append((si, M, record, list(fresh.values())[: self.args.refine]))
            if not todo or self.left() < 0:
                return
            self.pre.submit([compile_spec(M, r["N"], r["K"], c) for si, M, r, fresh in todo for c in fresh])
            if self.pre.jobs:
                self.pre.wait(0.5 * self.left())
            done = 0
            for si, M, record, fresh in todo:
                if self.left() < 0:
                    break
                case = Case(self.shape(si), M, record["sets"])
                for cfg in fresh:
                    record["candidates"].append(dict(key=config_key(cfg), config=cfg, families=[],
                                                     stage=f"refine{round_}",
                                                     **run_candidate(case, cfg, self.gpu, self.unavailable)))
                finish_record(record)
                done += 1
                if done % 16 == 0:  # (the families' JSON went out case by case; here every 16 cases and at the end)
                    self.save()
            self.save()
            print(f"refinement round {round_}: {done} of {len(todo)} cases", flush=True)


def weight_bytes(N: int, K: int) -> int:
    """A g128 fp16 weight's bytes (packed values, scales and zeros), as the bench counts them."""
    return N * K // 2 + 2 * 2 * cdiv(K, 128) * N


def finish_record(record: dict) -> None:
    best = best_candidate(record)
    record["best"] = None if best is None else dict(key=best["key"], config=best["config"], us=best["us"])


def progress_line(r: dict) -> str:
    def ratio(us):
        return f"{r['cublas_us'] / us:.2f}x" if us and r.get("cublas_us") else "-"

    best = r.get("best") or {}
    rule = next((c.get("us") for c in r["candidates"] if "rule" in c["families"]), None)
    return (f"seed {r['seed']} M={r['M']:<5d} {r['N']:>6d} x {r['K']:<6d} cuBLAS {r['cublas_us'] or 0:8.1f} us  "
            f"auto {ratio(r['auto'].get('us'))} ({r['auto']['kernel']})  rule {ratio(rule)}  best "
            f"{ratio(best.get('us'))} {best.get('key', '')}  dequant {ratio(r['dequant_cublas'].get('us'))}")


def shape_list(args) -> list[tuple[int, int, int, int]]:
    """(seed, index, N, K) of every weight, the seeds alternating (a run cut by the budget keeps both)."""
    if args.smoke:
        return [(args.seeds[0], i, N, K) for i, (N, K) in enumerate(SMOKE_SHAPES[: args.limit_shapes or None])]
    from tilegemm.ops.w4a16.bench import W4_RANDOM_SEED, w4_random_shapes

    assert W4_RANDOM_SEED == HELD_OUT_SEED, "the bench's held-out seed moved: update HELD_OUT_SEED"
    per_seed = {seed: w4_random_shapes(seed=seed)[: args.limit_shapes or None] for seed in args.seeds}
    longest = max(len(v) for v in per_seed.values())
    return [(seed, i, *per_seed[seed][i]) for i in range(longest) for seed in args.seeds if i < len(per_seed[seed])]


# --- summary and fit (no GPU) --------------------------------------------------------------------------------

NARROW_N = 3200  # dispatch.FRAG_WGMMA_NARROW_N: below it, narrow weights
LONG_K = 4096
SPLIT_POLICIES = tuple((p, s, c) for p in (0.5, 1, 2, 4, 8, 16) for s in (4, 8) for c in (0, 4))
ALPHAS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)  # share of a wave at which a rule's first tile gives way
SIMPLER_BY = 1.01  # a two-tile rule must beat the best one-tile rule by this factor (geomean) to be proposed


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def nk_class(case: dict) -> str:
    return f"N{'<' if case['N'] < NARROW_N else '>='}{NARROW_N},K{'<' if case['K'] < LONG_K else '>='}{LONG_K}"


def timed(case: dict) -> dict[str, float]:
    """config key -> us of the candidates that ran and passed the check."""
    return {c["key"]: c["us"] for c in case["candidates"] if c.get("us")}


def family_times(case: dict) -> dict[str, float]:
    return {f: c["us"] for c in case["candidates"] if c.get("us") for f in c["families"]}


def ratio_of(case: dict, us: float | None) -> float | None:
    return case["cublas_us"] / us if us and case.get("cublas_us") else None


def best_family(cases: list[dict]) -> tuple[str | None, float | None]:
    """The family timed in every one of ``cases`` with the best geomean ratio."""
    times = [family_times(c) for c in cases]
    common = set(times[0]).intersection(*times[1:]) if times else set()
    scored = [(geomean(ratio_of(c, t[f]) for c, t in zip(cases, times)), f) for f in common]
    scored = [(g, f) for g, f in scored if g]
    if not scored:
        return None, None
    g, f = max(scored)
    return f, g


def by_m(cases: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for c in cases:
        if c.get("cublas_us"):
            out.setdefault(c["M"], []).append(c)
    return dict(sorted(out.items()))


def default_knobs(cases: list[dict]) -> tuple[int, str]:
    """(STAGES, mode) the families are measured at: today's rule's for this M."""
    rule = cases[0]["rule"]
    return rule["STAGES"], mode_of(rule)


def rule_config(rule: dict, case: dict) -> dict:
    """The config ``rule`` gives ``case`` (canonical)."""
    M, N, K, sms = case["M"], case["N"], case["K"], case["sms"]
    tile = rule["tiles"][0]
    if len(rule["tiles"]) > 1 and tiles_of(M, N, *tile) < rule["alpha"] * sms:
        tile = rule["tiles"][1]
    bm, rh, warps = tile
    per_sm, min_steps, cap = rule["split"]
    split = split_policy(tiles_of(M, N, bm, rh, warps), K, sms, per_sm, min_steps, cap)
    cfg = dict(BM=bm, RH=rh, num_warps=warps, STAGES=rule["STAGES"], SPLIT_K=split)
    return canonical(with_mode(cfg, rule["mode"]), K)


def score(rule: dict, cases: list[dict]) -> tuple[float | None, float]:
    """(geomean ratio over the cases where the rule's config was timed, the share of cases that is)."""
    ratios = []
    for c in cases:
        us = c["_timed"].get(config_key(rule_config(rule, c)))
        ratios.append(ratio_of(c, us))
    covered = [r for r in ratios if r]
    return geomean(covered), len(covered) / max(1, len(cases))


def prepare_cases(cases: list[dict], sms: int) -> list[dict]:
    for c in cases:
        c.setdefault("sms", sms)
        c["_timed"] = timed(c)
    return cases


def fit_rule(cases: list[dict]) -> dict | None:
    """The best rule for one M over ``cases`` (every case covered): a tile or two (the second where the first's
    tiles make less than ``alpha`` of a wave), a split policy (programs a SM, least steps a slice, cap), at the
    families' STAGES and mode; then the STAGES and mode that beat those where the data covers them."""
    stages, mode = default_knobs(cases)
    tiles = sorted({(c["config"]["BM"], c["config"]["RH"], c["config"]["num_warps"]) for case in cases
                    for c in case["candidates"] if c["stage"] == "family" and c.get("us")})
    # log ratio of each (case, tile, split policy) at the families' STAGES and mode; None: not timed
    logs = {}
    for i, c in enumerate(cases):
        for t in tiles:
            for sp in SPLIT_POLICIES:
                rule = dict(tiles=[t], alpha=None, split=sp, STAGES=stages, mode=mode)
                r = ratio_of(c, c["_timed"].get(config_key(rule_config(rule, c))))
                logs[i, t, sp] = math.log(r) if r else None
    wave = {(i, t): tiles_of(c["M"], c["N"], *t) / c["sms"] for i, c in enumerate(cases) for t in tiles}

    def total(pick) -> float | None:
        s = 0.0
        for i in range(len(cases)):
            v = logs[pick(i)]
            if v is None:
                return None
            s += v
        return s

    best = None  # (sum of logs, rule)
    for sp in SPLIT_POLICIES:
        for t in tiles:
            s = total(lambda i: (i, t, sp))
            if s is not None and (best is None or s > best[0]):
                best = (s, dict(tiles=[t], alpha=None, split=sp, STAGES=stages, mode=mode))
    if best is None:
        return None
    single = best[0]
    for sp in SPLIT_POLICIES:
        for a in tiles:
            for b in tiles:
                if a == b:
                    continue
                for alpha in ALPHAS:
                    s = total(lambda i: (i, a if wave[i, a] >= alpha else b, sp))
                    if s is not None and s > best[0] and s > single + len(cases) * math.log(SIMPLER_BY):
                        best = (s, dict(tiles=[a, b], alpha=alpha, split=sp, STAGES=stages, mode=mode))
    rule = best[1]
    # STAGES and mode: only where the chosen configs were timed with them (coverage said)
    knobs = []
    for st in (3, 4, 6):
        for m in MODES:
            if (st, m) == (stages, mode):
                continue
            variant = dict(rule, STAGES=st, mode=m)
            vg, cover = score(variant, cases)
            if vg and cover >= 0.75:
                same = [c for c in cases if c["_timed"].get(config_key(rule_config(variant, c)))]
                knobs.append(dict(STAGES=st, mode=m, coverage=round(cover, 2),
                                  gain=round(vg / score(rule, same)[0], 4)))
    better = [k for k in knobs if k["gain"] > SIMPLER_BY and k["coverage"] == 1.0]
    if better:
        k = max(better, key=lambda k: k["gain"])
        rule = dict(rule, STAGES=k["STAGES"], mode=k["mode"])
    g, cover = score(rule, cases)
    return dict(rule=rule, geomean=g, coverage=cover, knobs=knobs)


def describe(rule: dict) -> str:
    def tile(t):
        return f"BM={t[0]} RH={t[1]} {t[2]} warps"

    per_sm, min_steps, cap = rule["split"]
    text = tile(rule["tiles"][0])
    if len(rule["tiles"]) > 1:
        text += f" where its tiles make >= {rule['alpha']:g} x SMs, else {tile(rule['tiles'][1])}"
    text += (f"; SPLIT_K = split_within(tiles, ceil(K/64), {per_sm:g} x SMs, {min_steps})"
             + (f" capped at {cap}" if cap else "") + f"; STAGES={rule['STAGES']}; {rule['mode']}")
    return text


def ofat(cases: list[dict]) -> dict[str, float]:
    """Today's rule with one knob changed (the families ``rule.*``): geomean of its time ratio to the rule's over
    the cases where both ran (> 1: faster)."""
    out = {}
    for name in ("rule.stages=3", "rule.stages=6", "rule.mode=none", "rule.mode=overlap", "rule.mode=pipe",
                 "rule.split/2", "rule.splitx2", "rule.split1"):
        gains = []
        for c in cases:
            t = family_times(c)
            if t.get(name) and t.get("rule"):
                gains.append(t["rule"] / t[name])
        if gains:
            out[name] = round(geomean(gains), 4)
    return out


def dequant_threshold(cases: list[dict], rule: dict) -> tuple[int, float]:
    """(T, geomean) of ``dequant_cublas where N < T, else the rule`` with the best T over the cases' N values."""
    best = (0, -1.0)
    for T in sorted({0, *(c["N"] + 1 for c in cases)}):
        ratios = []
        for c in cases:
            frag = ratio_of(c, c["_timed"].get(config_key(rule_config(rule, c))))
            dq = ratio_of(c, c["dequant_cublas"].get("us"))
            ratios.append(dq if c["N"] < T and dq else frag)
        g = geomean(ratios)
        if g and g > best[1]:
            best = (T, g)
    return best


def fit(cases: list[dict], out=print) -> dict:
    """The proposed rule per M (printed), and the proposal as a dict."""
    proposal = {}
    for M, group in by_m(cases).items():
        found = fit_rule(group)
        if found is None:
            out(f"M={M}: no rule covers every case (no frag_wgmma times?)")
            continue
        seeds = sorted({c["seed"] for c in group})
        cross = []
        for a in seeds:
            train = [c for c in group if c["seed"] == a]
            test = [c for c in group if c["seed"] != a]
            if not test:
                continue
            fitted = fit_rule(train)
            if fitted:
                g, cover = score(fitted["rule"], test)
                today = geomean(ratio_of(c, family_times(c).get("rule")) for c in test)
                cross.append(dict(fit_on=a, score=g, coverage=round(cover, 2), today=today))
        today = geomean(ratio_of(c, family_times(c).get("rule")) for c in group)
        best_case = geomean(ratio_of(c, min(c["_timed"].values(), default=None)) for c in group)
        T, with_dq = dequant_threshold(group, found["rule"])
        proposal[M] = dict(rule=found["rule"], text=describe(found["rule"]), geomean=found["geomean"],
                           today=today, best_per_case=best_case, cases=len(group), cross_seed=cross,
                           knobs=found["knobs"], ofat=ofat(group), dequant_below_n=T, with_dequant=with_dq)
        out(f"M={M} ({len(group)} cases): {describe(found['rule'])}")
        out(f"    geomean {found['geomean']:.3f}x (today's rule {fmt(today)}, best of each case {fmt(best_case)})")
        for x in cross:
            out(f"    fitted on seed {x['fit_on']} alone, scored on the other: {fmt(x['score'])} over "
                f"{x['coverage']:.0%} of it (today's rule {fmt(x['today'])})")
        if found["knobs"]:
            out("    STAGES/mode against the rule's configs (gain, coverage): " +
                ", ".join(f"s{k['STAGES']} {k['mode']} {k['gain']:.3f} ({k['coverage']:.0%})" for k in found["knobs"]))
        out("    today's rule with one knob changed (time ratio, > 1 faster): " +
            ", ".join(f"{k[5:]} {v:.3f}" for k, v in proposal[M]["ofat"].items()))
        out(f"    with dequant_cublas for N < {T}: {with_dq:.3f}x" if T else
            f"    dequant_cublas nowhere better as an N threshold ({with_dq:.3f}x)")
    for line in steps_in_m(cases, proposal):
        out(line)
    return proposal


SMALL_M = 16  # up to here a call reads the weight once: its time should not grow with M
STEP_LIMIT = 1.10  # the W4A16 target: no M in 1..16 more than 10% slower than its neighbours


def steps_in_m(cases: list[dict], proposal: dict) -> list[str]:
    """For each pair of neighbouring M up to SMALL_M in the data, the weights whose time grows by more than
    STEP_LIMIT from the smaller M to the larger, under today's rule and under the proposed one."""
    ms = sorted(m for m in by_m(cases) if m <= SMALL_M)
    at = {(c["seed"], c["N"], c["K"], c["M"]): c for c in cases if c.get("cublas_us")}
    lines = []
    for a, b in zip(ms, ms[1:]):
        pairs = [(at[s, n, k, a], at[s, n, k, b]) for (s, n, k, m) in at if m == a and (s, n, k, b) in at]
        for name, us_of in (("today's rule", lambda c: family_times(c).get("rule")),
                            ("proposed", lambda c: c["_timed"].get(config_key(rule_config(proposal[c["M"]]["rule"],
                                                                                           c)))
                             if c["M"] in proposal else None)):
            steps = [(us_of(cb) / us_of(ca), ca) for ca, cb in pairs if us_of(ca) and us_of(cb)]
            if not steps:
                continue
            over = sorted([x for x in steps if x[0] > STEP_LIMIT], key=lambda x: -x[0])
            worst = ", ".join(f"{c['N']}x{c['K']} {r:.2f}" for r, c in over[:4])
            lines.append(f"M={a} -> {b}, {name}: {len(over)} of {len(steps)} weights over {STEP_LIMIT:g}x the time"
                         + (f" (worst: {worst})" if over else ""))
    return lines


def fmt(v) -> str:
    return f"{v:.3f}x" if v else "-"


def table(cases: list[dict], proposal: dict) -> str:
    """Per M: geomean ratio of auto, today's rule, the fitted rule, the best family (one per M; one per M and N/K
    class), the best frag_wgmma config of each case, dequant_cublas, and the best of both of each case."""
    head = ("M", "cases", "auto", "rule", "fitted", "family", "fam/class", "best frag", "dequant", "best any")
    rows = [head]
    for M, group in by_m(cases).items():
        fam, fam_g = best_family(group)
        per_class = []
        for cls in sorted({nk_class(c) for c in group}):
            members = [c for c in group if nk_class(c) == cls]
            f, _ = best_family(members)
            per_class += [ratio_of(c, family_times(c).get(f)) for c in members] if f else [None] * len(members)
        rows.append((
            str(M), str(len(group)),
            fmt(geomean(ratio_of(c, c["auto"].get("us")) for c in group)),
            fmt(geomean(ratio_of(c, family_times(c).get("rule")) for c in group)),
            fmt(proposal.get(M, {}).get("geomean")),
            fmt(fam_g),
            fmt(geomean(per_class)) if all(per_class) else "-",
            fmt(geomean(ratio_of(c, min(c["_timed"].values(), default=None)) for c in group)),
            fmt(geomean(ratio_of(c, c["dequant_cublas"].get("us")) for c in group)),
            fmt(geomean(max(filter(None, (ratio_of(c, min(c["_timed"].values(), default=None)),
                                          ratio_of(c, c["dequant_cublas"].get("us")))), default=None)
                        for c in group)),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    best = {M: best_family(g)[0] for M, g in by_m(cases).items()}
    lines += [f"  best family at M={M}: {f}" for M, f in best.items() if f]
    return "\n".join(lines)


def load(paths: list[str]) -> list[dict]:
    cases = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("tool") != "tools/w4a16_frag_sweep.py":
            raise SystemExit(f"{path}: not a w4a16_frag_sweep.py file")
        if HELD_OUT_SEED in data["meta"].get("seeds", []):
            raise SystemExit(f"{path}: holds the held-out seed {HELD_OUT_SEED}; nothing may be fitted on it")
        cases += prepare_cases(data["cases"], data["meta"]["sms"])
    return cases


def report(cases: list[dict]) -> dict:
    proposal = fit(cases)
    print()
    print("cuBLAS fp16 time / time, geomean per M (fitted: the proposed rule on these cases; family: one config "
          "family per M; fam/class: per M and N/K class):")
    print(table(cases, proposal))
    return proposal


# --- command line ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)),
                   help="w4_random_shapes seeds to fit on (never %d, the held-out one)" % HELD_OUT_SEED)
    p.add_argument("--ms", help="rows M of x (default %s; --smoke: %s)" % (",".join(map(str, DEFAULT_MS)),
                                                                          ",".join(map(str, SMOKE_MS))))
    p.add_argument("--budget", type=float, default=240.0, help="seconds: no case starts after them")
    p.add_argument("--limit-shapes", type=int, default=0, help="the first N (N, K) pairs of each seed (0: all 16)")
    p.add_argument("--refine", type=int, default=4, help="one-step changes a case and round after the families")
    p.add_argument("--refine-rounds", type=int, default=2)
    p.add_argument("--rotate", action="store_true", help="rotate input copies past L2 (as the bench's graphs)")
    p.add_argument("--precompile", type=int, default=-1,
                   help="worker processes compiling ahead (default: the CPU count less one, up to 16; with --smoke "
                        "0; 0: none)")
    p.add_argument("--out", help="the JSON (rewritten after every case); with --fit: the proposal")
    p.add_argument("--fit", nargs="+", metavar="FILE", help="propose the rule from sweep JSON files (no GPU)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in str(args.seeds).split(",") if s]
        args.ms = [int(m) for m in args.ms.split(",") if m] if args.ms else \
            list(SMOKE_MS if args.smoke else DEFAULT_MS)
    except ValueError:
        p.error("--seeds and --ms take comma-separated integers")
    if HELD_OUT_SEED in args.seeds:
        p.error(f"seed {HELD_OUT_SEED} is the bench's held-out w4-random draw: no rule may be fitted on it "
                f"(fit on {DEFAULT_SEEDS[0]}, {DEFAULT_SEEDS[1]} or another seed, check on {HELD_OUT_SEED} with "
                f"tilegemm bench --op w4a16 --sweep w4-random)")
    if not args.seeds or not args.ms or min(args.ms) < 1:
        p.error("--seeds and --ms need at least one value; M >= 1")
    if args.precompile < 0:
        args.precompile = 0 if args.smoke else max(0, min(16, (os.cpu_count() or 2) - 1))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fit:
        proposal = report(load(args.fit))
        if args.out:
            write_json(args.out, dict(tool="tools/w4a16_frag_sweep.py --fit", files=args.fit,
                                      proposal={str(m): v for m, v in proposal.items()}))
        return
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before tilegemm (and triton) load
    import importlib

    importlib.import_module("tilegemm")  # first: it chooses the interpreter or the GPU before torch and triton load
    data = Sweep(args).run()
    if args.out:
        print(f"wrote {args.out}\n")
    report(prepare_cases(data["cases"], data["meta"]["sms"]))


if __name__ == "__main__":
    sys.exit(main())
