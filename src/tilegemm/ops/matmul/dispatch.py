"""``auto``'s choice of rung per problem, and the launch of one checked call (:func:`forward`) or one problem
(:func:`launch`, the entry point other families call). The measurements behind every threshold: docs/rungs/auto.md.
"""

from __future__ import annotations

import torch

from tilegemm.core import hardware, registry, tuning
from tilegemm.core.runtime import ensure_backend, interpreting, new_output, on_device
from tilegemm.ops.matmul import survey
from tilegemm.ops.matmul.checks import output_shape, resolve_precision
from tilegemm.ops.matmul.configs import autotune_configs, prune_for
from tilegemm.ops.matmul.problem import GemmProblem, MatmulCall, make_problems, rows_aligned

# auto's thresholds (docs/rungs/auto.md#thresholds holds each one's measurements).
SMALL_M = 128  # up to here split_k (or split_k timed against persistent_tma): few rows stream B
TIMED_M = 16  # above this a small-M problem may be timed against persistent_tma; at or below split_k only
TIMED_MIN_MNK = 1 << 24  # below this M*N*K timing picks by noise while the rungs' host costs differ: split_k
UNTIMED_RUNG_DISTANCE = 2.0  # untimed, a tuned class's rung is taken only this near (tuning.nearest), else split_k
SPLIT_MIN_K = 1024  # below this K a split cannot pay: each slice would be a handful of K steps
SPLIT_GAIN = 0.85  # split_k above SMALL_M only where the cost model ranks it this much faster than unsplit
NARROW_N = 512  # narrower 16-bit outputs go to autotuned: persistent_tma's tiles are 128 or 256 wide along N
MIN_TILES_PER_SM = 2  # persistent_tma from this many 128x128 tiles per SM: a persistent grid needs work to balance
# (a batched 16-bit problem counts the tiles of every batch: its persistent grid walks them all in one launch)
MIN_TILES_PER_SM_FP8 = 4  # fp8 in Triton's kernels (no Gluon kernel) needs more before the persistent grid pays
# Batched 16-bit products (16-bit output) on gluon_f16's batched launch (warp-specialized: each tile's stores
# overlap the next tile's loads and MMAs) rather than persistent_tma's Triton kernel, from this many 128x128
# tiles per SM over all batches: ahead on the batched sweeps' attention-like products (tools/batched_candidates.py;
# the numbers in docs/rungs/persistent_tma.md, "Batched products on gluon_f16").
GLUON_F16_BATCHED = True
GLUON_F16_BATCHED_MIN_TILES_PER_SM = 1
# With it on, outputs narrower than NARROW_N too: off, mixed against autotuned there (same doc).
GLUON_F16_BATCHED_NARROW = False
# Batched products of at most SMALL_M rows a batch take that launch from this many rows and up to this K (with its
# tiles-per-SM floor; the narrow rule does not apply: split_k is the alternative there): a tile of a few K steps is
# mostly its epilogue, which that launch overlaps; fewer rows fit split_k's smaller tiles, longer K its slices
# (docs/rungs/persistent_tma.md, "Batched products on gluon_f16").
GLUON_F16_BATCHED_MIN_M = 65
GLUON_F16_BATCHED_SMALL_M_MAX_K = 384
GLUON_TIMED_FROM = 4  # a Gluon kernel's 16-bit problem is timed from 1/4 tile per SM (other dtypes: 1/2) up to 2
DECISIONS_KEPT = 4096  # answers kept per shape class (bounded: cleared when full); each estimate costs ~100 us


def choose_kernel(p: GemmProblem) -> str:
    """``auto``: the rung measured fastest for this class of problem (docs/rungs/auto.md).

    - Under the interpreter: ``grouped`` (autotuning has nothing to time there).
    - M <= :data:`SMALL_M`: a batched 16-bit product from :data:`GLUON_F16_BATCHED_MIN_M` rows and up to
      :data:`GLUON_F16_BATCHED_SMALL_M_MAX_K` that :func:`_batched_gluon` takes (any N): ``gluon_f16``'s batched
      launch. Else ``split_k``, which tunes its tile and number of K slices (1 included) per shape class;
      from :data:`TIMED_MIN_MNK` up, where TMA can describe the problem, timed once against ``persistent_tma``.
      Rows not 16-byte aligned go to split_k too.
    - Larger problems on Hopper that TMA can describe, with at least :data:`MIN_TILES_PER_SM` 128x128 tiles per SM
      (:data:`MIN_TILES_PER_SM_FP8` for fp8 that no Gluon kernel takes; a batched 16-bit problem's tiles of every
      batch counted): ``persistent_tma``, except tf32 with an
      operand through registers, which goes to ``autotuned`` unless a Gluon kernel takes it. Where a Gluon kernel
      takes the problem the two rungs are timed between :data:`GLUON_TIMED_FROM` and two tiles per SM.
    - M > :data:`SMALL_M` where splitting K pays by the cost model (:func:`_split_pays`): ``split_k``.
    - With :data:`GLUON_F16_BATCHED` on, a batched 16-bit product with a 16-bit output of at least
      :data:`GLUON_F16_BATCHED_MIN_TILES_PER_SM` 128x128 tiles per SM (every batch's), N >= :data:`NARROW_N` unless
      :data:`GLUON_F16_BATCHED_NARROW`: ``gluon_f16``'s batched launch (:func:`_batched_gluon`).
    - M > :data:`SMALL_M`, 16-bit, with N < :data:`NARROW_N`, or otherwise: ``autotuned``.
    """
    if interpreting():
        return "grouped"
    if p.M <= SMALL_M:
        if (p.batch != 1 and GLUON_F16_BATCHED and p.M >= GLUON_F16_BATCHED_MIN_M
                and p.K <= GLUON_F16_BATCHED_SMALL_M_MAX_K and _batched_gluon(p, narrow=True)):
            return "gluon_f16"
        if p.M > TIMED_M and p.M * p.N * p.K >= TIMED_MIN_MNK and _has_tma():
            if _kernels().persistent_tma.why_not(p) is None:
                return _timed_choice(p, ("split_k", "persistent_tma"), max_distance=UNTIMED_RUNG_DISTANCE)
        return "split_k"
    if _split_pays(p):
        return "split_k"
    if p.batch != 1 and GLUON_F16_BATCHED and _batched_gluon(p):
        return "gluon_f16"
    if p.N < NARROW_N and p.a.element_size() == 2:
        return "autotuned"
    if _has_tma():
        tma = _kernels().persistent_tma
        tiles = -(-p.M // 128) * -(-p.N // 128) * p.batch  # every batch's tiles (persistent_tma.why_not_batched)
        sms = hardware.sm_count(p.out.device)
        min_tiles = sms * (MIN_TILES_PER_SM_FP8 if p.a.element_size() == 1 else MIN_TILES_PER_SM)
        described = tma.why_not(p) is None
        gluon = tma.gluon_kernel_for(p) if described else None
        if gluon is None and p.dtype == torch.float32 and p.mma_operands != "ab":
            # tf32 with an operand that is not K-major: persistent_tma's Triton loops for it stay serialized.
            return "autotuned"
        if gluon is not None:
            if (GLUON_TIMED_FROM if p.a.element_size() == 2 else 2) * tiles < sms:
                return "autotuned"
            if tiles >= 2 * sms:
                return "persistent_tma"
            return _timed_choice(p, ("autotuned", "persistent_tma"))
        if tiles >= min_tiles and described:
            return "persistent_tma"
    return "autotuned"


def _batched_gluon(p: GemmProblem, narrow: bool = False) -> bool:
    """Whether ``auto`` takes batched ``p`` to ``gluon_f16``'s batched launch (with :data:`GLUON_F16_BATCHED` on):
    on Hopper with TMA, where that launch takes it (16-bit operands and output, TMA can describe it), with at
    least :data:`GLUON_F16_BATCHED_MIN_TILES_PER_SM` 128x128 tiles per SM over all batches, and N >=
    :data:`NARROW_N` unless :data:`GLUON_F16_BATCHED_NARROW` or ``narrow``."""
    if not _has_tma() or (p.N < NARROW_N and not (GLUON_F16_BATCHED_NARROW or narrow)):
        return False
    tiles = -(-p.M // 128) * -(-p.N // 128) * p.batch
    if tiles < hardware.sm_count(p.out.device) * GLUON_F16_BATCHED_MIN_TILES_PER_SM:
        return False
    return _kernels().persistent_tma.batched_gluon_f16(p) is not None


def _split_pays(p: GemmProblem) -> bool:
    """Whether ``split_k`` should take a problem with M > :data:`SMALL_M`: where the shape class was not tuned and
    the cost model (:mod:`tilegemm.ops.matmul.cost`) ranks the best K split at least :data:`SPLIT_GAIN` of the
    best unsplit config of ``autotuned``'s time. That is a product with too few output tiles to fill the GPU and
    a long K (a 1x1 convolution's weight gradient)."""
    if p.K < SPLIT_MIN_K or interpreting():
        return False
    if tuning.lookup(p.tuning_key("autotuned")) is not None:
        return False  # a tuned class (perhaps tuned since a cached answer): its measured config stands
    key = ("split", p.M, p.N, p.K, p.batch, p.tuning_dtype, p.out.dtype, p.layout, rows_aligned(p), p.out.device)
    return _decided(key, lambda: _split_estimated_faster(p))


_decisions: dict[tuple, object] = {}  # _split_pays's, _pads's, _restrides's and surveyed's answers per shape class


def _decided(key: tuple, decide):
    """``decide()``, made once per ``key`` (bounded: cleared when full)."""
    found = _decisions.get(key)
    if found is None:
        if len(_decisions) >= DECISIONS_KEPT:
            _decisions.clear()
        found = _decisions[key] = decide()
    return found


def _split_estimated_faster(p: GemmProblem) -> bool:
    k = _kernels()
    estimate = k.cost.problem_estimator(p)
    splits = [estimate(c) for c in k.split_k.configs(p) if c["SPLIT_K"] > 1]
    whole = [estimate(c) for c in prune_for(autotune_configs(), p.a.element_size())]
    return bool(splits) and min(splits) < SPLIT_GAIN * min(whole)


def _timed_choice(p: GemmProblem, rungs: tuple[str, ...], max_distance: float = float("inf")) -> str:
    """The faster of ``rungs`` for this shape class: timed once, then remembered. Untimed (the default), the
    choice of the nearest tuned shape class within ``max_distance``, else the first of ``rungs``.

    A rung that tunes its own config does so in its first launch, which ``do_bench`` makes before it times
    anything; a rung that fails there is not chosen (see :func:`tilegemm.core.tuning.lookup_or_tune`).
    """
    return tuning.lookup_or_tune(p.tuning_key("auto"), lambda: [{"rung": r} for r in rungs],
                                 lambda cfg: launcher(cfg["rung"])(p), max_distance=max_distance)["rung"]


_tma: bool | None = None


def _has_tma() -> bool:
    global _tma
    if _tma is None:
        _tma = hardware.why_not_tma() is None
    return _tma


class _Rungs:
    """The rung modules (and the cost model over them) with their launch functions, imported at the first launch
    after the backend is chosen: they import triton, and importing tilegemm imports none."""

    def __init__(self):
        ensure_backend()
        from tilegemm.ops.matmul import autotuned, cost, grouped, naive, padding, persistent_tma, residue, split_k

        self.persistent_tma, self.split_k, self.padding, self.residue = persistent_tma, split_k, padding, residue
        self.cost = cost  # (its split model reads split_reduce's, a kernel module)
        self.launchers = {
            "naive": naive.run, "grouped": grouped.run, "autotuned": autotuned.run, "split_k": split_k.run,
            "persistent_tma": persistent_tma.run, "gluon_f16": persistent_tma.run_gluon_f16,
            "gluon_fp8": persistent_tma.run_gluon_fp8, "gluon_tf32": persistent_tma.run_gluon_tf32,
        }


_rungs: _Rungs | None = None


def _kernels() -> _Rungs:
    global _rungs
    if _rungs is None:
        _rungs = _Rungs()
    return _rungs


def launcher(name: str):
    """The launch function ``run(p, config=None)`` of a matmul rung by its registered name."""
    found = _kernels().launchers.get(name)
    # Else a kernel registered from outside (a plug-in, a test), or an unknown name: the registry raises, naming
    # the choices.
    return found if found is not None else registry.launcher("matmul", name)


def _scale_stride(scale: torch.Tensor | None) -> int:
    """Stride along M (scale_a) or N (scale_b): 0 for one scale, else the stride of its long dim."""
    if scale is None or scale.numel() == 1:
        return 0
    return scale.stride(0) if scale.dim() == 1 or scale.shape[0] != 1 else scale.stride(1)


def _pads(p: GemmProblem, a: torch.Tensor, b: torch.Tensor, c=None, bias=None) -> bool:
    """Whether ``auto`` runs this problem as its aligned twin (:mod:`tilegemm.ops.matmul.padding`): rows not
    16-byte aligned, a call it can pad, and the cost model says it pays. Answered once per shape class and
    alignment."""
    if interpreting() or p.batch != 1 or rows_aligned(p):
        return False
    k = _kernels()
    if k.residue.why_not(p) is None:
        return False  # split_k reads B as it lies, by residue class: no copies
    if not k.padding.can_pad(a, b, c, bias, p.out):
        return False
    key = ("pad", p.M, p.N, p.K, p.tuning_dtype, p.out.dtype, p.layout, a.stride(), b.stride(), p.out.device)
    return _decided(key, lambda: k.padding.padding_pays(p))


def _restrides(p: GemmProblem, a: torch.Tensor, b: torch.Tensor) -> str:
    """Which operands ``auto`` copies into buffers with 128-byte rows first (:func:`tilegemm.ops.matmul.padding.
    restride_plan`): answered once per shape class, strides and the operands' offsets within 128 bytes."""
    if interpreting() or p.batch != 1 or not rows_aligned(p):
        return ""
    padding = _kernels().padding
    key = ("restride", p.M, p.N, p.K, a.dtype, b.dtype, a.stride(), b.stride(), a.data_ptr() % padding.ROW_BYTES,
           b.data_ptr() % padding.ROW_BYTES, p.out.device)
    return _decided(key, lambda: padding.restride_plan(p, a, b))


def forward(call: MatmulCall) -> torch.Tensor:
    """Launch the kernels of one checked call and return its output."""
    a, b, kernel = call.a, call.b, call.kernel
    if a.dim() == 2 and b.dim() == 2:
        shape = (a.shape[0], b.shape[1])
    else:
        shape = output_shape(a.shape, b.shape)
    out = new_output(shape, call.output_dtype, a.device)
    if out.numel() == 0:
        return out
    # Only fp32 has a precision to read (core/dtypes.resolve_precision); 16-bit and fp8 dots are exact.
    precision = resolve_precision(call.precision, a.dtype) if a.dtype is torch.float32 else "ieee"
    upcast = a.dtype == torch.bfloat16 and interpreting()
    scales = (call.scale_a, _scale_stride(call.scale_a), call.scale_b, _scale_stride(call.scale_b))

    def problems(a, b, out, c, bias):
        return make_problems(a, b, out, c=c, bias=bias, alpha=call.alpha, beta=call.beta, activation=call.activation,
                             precision=precision, upcast=upcast, scales=scales, fast_accum=call.fast_accum)

    with on_device(a.device):
        for p in problems(a, b, out, call.c, call.bias):
            if kernel != "auto":
                launcher(kernel)(p)
            elif _pads(p, a, b, call.c, call.bias):
                def twin(a2, b2, bias2, out2):
                    for q in problems(a2, b2, out2, None, bias2):
                        launch_auto(q)

                _kernels().padding.run_padded(a, b, call.bias, out, twin)
            elif plan := _restrides(p, a, b):
                def restrided(a2, b2):
                    for q in problems(a2, b2, out, call.c, call.bias):
                        launch_auto(q)

                _kernels().padding.run_restrided(a, b, plan, restrided)
            else:
                launch_auto(p)
    return out


def launch(p: GemmProblem, kernel: str | None = None, config: dict | None = None) -> None:
    """Launch one problem of :func:`make_problems` (the entry point other families call; docs/internals.md).

    ``kernel`` None (or ``"auto"``): ``auto``'s choice of rung and config; a rung's name: that rung, with
    ``config`` (one of that rung's config dicts) or its own choice. Raises :class:`~tilegemm.core.registry.
    NotApplicable` before launching anything where a Gluon rung does not take the problem. The caller makes the
    problem's device current (:func:`tilegemm.core.runtime.on_device`)."""
    if kernel is None or kernel == "auto":
        if config is not None:
            raise ValueError("a config names a rung's parameters: pass kernel= with it")
        launch_auto(p)
    elif config is None:
        launcher(kernel)(p)
    else:
        launcher(kernel)(p, config)


def launch_auto(p: GemmProblem) -> None:
    """Launch ``auto``'s choice for one problem: where the survey speaks for it (:func:`surveyed`), the
    rung and config it ranks best; otherwise the rung :func:`choose_kernel` names, with that rung's config."""
    picked = surveyed(p)
    if picked is not None:
        rung, config = picked
        from triton.runtime.errors import OutOfResources  # (triton is imported by now: a rung module is)

        try:
            launcher(rung)(p, config)
        except OutOfResources:
            # Ranked with another output dtype or epilogue, it does not fit the SM's shared memory here: the
            # rung's own choice (persistent_tma's falls back to a config that fits).
            launcher(rung)(p)
    else:
        launcher(choose_kernel(p))(p)


_RUNGS_TUNED = ("auto", "autotuned", "persistent_tma", "split_k")


def surveyed(p: GemmProblem) -> tuple[str, dict] | None:
    """(rung, config) from the GPU's survey table (:mod:`tilegemm.ops.matmul.survey`) for an aligned problem of a
    surveyed dtype family and layout whose shape class has no tuned entry (shipped or tuned: those keep their
    measured choice), while timing is off; else None. What depends on the shape alone is answered once per
    shape (a dict lookup on later calls); a no costs nothing more."""
    if interpreting():
        return None
    key = ("survey", p.M, p.N, p.K, p.tuning_dtype, p.out.dtype, p.layout, p.batch, p.scale_a is None,
           p.scale_b is None, p.out.device, tuning.generation())
    if not _decided(key, lambda: _survey_speaks(p)):
        return None
    if not rows_aligned(p) or tuning.timing_enabled():
        return None
    return survey.choose(p)


def _survey_speaks(p: GemmProblem) -> bool:
    """Whether the survey may choose for ``p``'s shape, dtypes and layout (alignment and timing aside): not for a
    shape class with a measured choice of rung (an ``auto`` entry, shipped or tuned here) or any entry tuned on
    this machine. A shipped config of a single rung does not keep it out: it says how that rung runs the class,
    not which rung to run (docs/rungs/auto.md#the-survey-16-bit-tf32-fp8)."""
    if survey.why_not(p) is not None or not survey.covers(p):
        return False
    keys = {r: p.tuning_key(r) for r in _RUNGS_TUNED}
    if tuning.lookup(keys["auto"]) is not None:
        return False
    return not any(tuning.measured(k) for k in keys.values())
