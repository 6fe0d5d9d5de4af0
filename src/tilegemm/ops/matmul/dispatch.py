"""``auto``'s choice of rung per problem, the rungs' launchers, and the launch of one checked call."""

from __future__ import annotations

import torch

from tilegemm.core import registry, tuning
from tilegemm.core.runtime import interpreting, new_output, on_device
from tilegemm.ops.matmul.call import MatmulCall
from tilegemm.ops.matmul.checks import output_shape, resolve_precision
from tilegemm.ops.matmul import survey
from tilegemm.ops.matmul.problem import GemmProblem, make_problems, rows_aligned


# Below this M * N * K a problem is over in a few microseconds on any rung, so timing the rungs picks by noise,
# while their host costs differ: at 64^3 fp16 on the H200 a call through split_k cost 19-22 us of host
# time and one through persistent_tma (three TMA descriptors) 24-31 us; when the timing had picked
# persistent_tma the bench's tiny-problem probe read 2.1x torch.matmul's host time instead of 1.4x
# (benchmarks/results/2026-11-22-h200/4998843/). Such problems with M <= 128 go to split_k untimed.
TIMED_MIN_MNK = 1 << 24


def choose_kernel(p: GemmProblem) -> str:
    """``auto``: the rung measured fastest for this class of problem (H200, benchmarks/results/2026-11-21-h200).

    - Under the interpreter: ``grouped`` (autotuning has nothing to time there).
    - M <= 128: ``split_k``, which tunes its tile and number of K slices (1 included) per shape class. On the
      llm shapes (fp16, H200) the best split-K configs ran 1.05x-1.07x cuBLAS at M=1 and 16 with N=4096,
      where ``autotuned`` ran 0.73x-0.88x (research/explore_skinny.py). Where TMA can describe the problem,
      ``split_k`` and ``persistent_tma`` (each with its own tuned config) are timed against each other once
      per shape class and the faster is kept (from :data:`TIMED_MIN_MNK` up; below it ``split_k``). With its
      6-stage 64x64x128 tile ``split_k`` wins all four M=128 llm shapes on the H200 (0.96x-0.98x cuBLAS);
      before that tile, ``persistent_tma``'s 64x64 tiles had won 128x4096x14336 (0.95x against 0.88x,
      research/explore_tma_small_m.py).
    - Larger problems on Hopper that TMA can describe, with at least two 128x128 tiles per SM (four for
      fp8 that no Gluon kernel takes): ``persistent_tma`` (fp16 1.02x / 1.03x at 8192^3 / 16384^3, where
      ``autotuned`` ran 1.00x / 0.93x), except tf32 with an operand through registers, which goes to
      ``autotuned`` unless it is NN or TT and ``persistent_tma``'s Gluon kernel takes it. Where a Gluon
      kernel takes the problem (that tf32, promoted K-major fp8, 16-bit with a 16-bit output), the two
      rungs are timed from half a tile per SM to two (16-bit: a quarter; see the code).
    - M > 128 where splitting K pays by the cost model (few output tiles with a long K; :func:`_split_pays`):
      ``split_k``.
    - M > 128, 16-bit, with N < :data:`NARROW_N`: ``autotuned``.
    - Otherwise ``autotuned``.
    """
    if interpreting():
        return "grouped"
    if p.M <= 128:
        # Rows not 16-byte aligned go to split_k too: since the wrapped-tile hint fix its misaligned loads ran
        # ahead of autotuned's on all nine such shapes of the random sweep's worst (7x340x10945: 1.00x cuBLAS
        # against 0.17x; H200, benchmarks/results/2026-11-23-h200/4e789c1/diagnose-random-fp16.json).
        if p.M > 16 and p.M * p.N * p.K >= TIMED_MIN_MNK and _has_tma():
            from tilegemm.ops.matmul.persistent_tma import why_not

            if why_not(p) is None:
                return _timed_choice(p, ("split_k", "persistent_tma"), max_distance=UNTIMED_RUNG_DISTANCE)
        return "split_k"
    if _split_pays(p):
        return "split_k"
    if p.N < NARROW_N and p.a.element_size() == 2:
        return "autotuned"
    if _has_tma():
        from tilegemm.core.hardware import sm_count
        from tilegemm.ops.matmul.persistent_tma import gluon_kernel_for, why_not

        # With few tiles per SM a persistent grid has little to balance: at 1024^3 it ran 0.69x cuBLAS where
        # autotuned's smaller tiles reached 0.87x; at 2048^3 (1.9 tiles per SM) 0.93x against 1.00x, and at
        # 4096^3 (7.8 per SM) 0.94x against 0.88x (fp16, research/explore_hopper.py).
        tiles = -(-p.M // 128) * -(-p.N // 128)
        # fp8 in Triton's kernels needs more tiles per SM before the persistent grid pays: at 2048^3 (2 tiles
        # per SM) it ran 0.43x torch._scaled_mm where autotuned ran 0.63x; at 4096^3 (8 per SM) 0.79x
        # against 0.73x.
        sms = sm_count(p.out.device)
        min_tiles = sms * (4 if p.a.element_size() == 1 else 2)
        described = why_not(p) is None
        gluon = gluon_kernel_for(p) if described else None
        if gluon is None and p.dtype == torch.float32 and p.mma_operands != "ab":
            # tf32 with an operand that is not K-major. persistent_tma's Triton loops for it must stay
            # serialized to be right (0.55x-0.70x cuBLAS, see persistent_tma.hopper_configs), and autotuned
            # ran 0.80x-0.92x.
            return "autotuned"
        if gluon is not None:
            # A Gluon kernel takes it: tf32 NN/TT (gluon_tf32, NN: 0.94x-0.99x from 2048^3 up, 0.58x at
            # 1024^3 with 32 of its tiles for 132 SMs), promoted K-major fp8 (gluon_fp8's warp-specialized
            # kernel: 0.85x torch._scaled_mm at 2048^3, 256 tiles, where autotuned ran 0.80x) or 16-bit with
            # a 16-bit output (gluon_f16; at 2048^3 persistent_tma's candidates, with host-made descriptors,
            # ran 0.99x cuBLAS where autotuned ran 0.95x-0.96x, research/explore_host_desc.py). From two
            # tiles per SM persistent_tma; from half a tile to two, the two rungs are timed once. For 16-bit
            # operands from a quarter of a tile: at 1024^3 (64 tiles) persistent_tma's 64x128x128 tile ran
            # 1.01x / 1.03x cuBLAS in fp16 / bf16 where autotuned's best ran 0.95x-0.96x / 0.99x (H200,
            # tools/time_candidates.py, 12 rounds; benchmarks/results/2026-11-22-h200/5d1f6a3/).
            if (4 if p.a.element_size() == 2 else 2) * tiles < sms:
                return "autotuned"
            if tiles >= 2 * sms:
                return "persistent_tma"
            return _timed_choice(p, ("autotuned", "persistent_tma"))
        if tiles >= min_tiles and described:
            return "persistent_tma"
    return "autotuned"


# Below this K a split does not pay whatever the tiles: each slice would be a handful of K steps.
SPLIT_MIN_K = 1024

# Narrower 16-bit outputs (M > 128) go to autotuned, not persistent_tma: its tiles are 128 or 256 wide along N
# (fp8 and tf32, not measured there, keep their rules). On
# ResNet-50's 1x1 convolutions as GEMMs (fp16, H200, research/diagnose_random.py,
# benchmarks/results/2026-11-24-h200/a61b6ed/diagnose-random-fp16.json) autotuned's untimed config beat
# persistent_tma on all six with N <= 256 (100352x64x64: 0.82x cuBLAS against 0.61x; 6272x256x1024: 0.84x
# against 0.60x; 25088x128x512: 0.96x against 0.80x), and persistent_tma stayed ahead at N = 512 and 2048
# (6272x512x1024: 0.95x against 0.87x; 1568x2048x512: 0.93x against 0.90x).
NARROW_N = 512


def _split_pays(p: GemmProblem) -> bool:
    """Whether ``split_k`` should take a problem with M > 128: where the shape class was not tuned and the cost
    model (:mod:`tilegemm.ops.matmul.cost`) ranks the best K split at least 15% faster than the best unsplit
    config of ``autotuned``. That is a product with too few output tiles to fill the GPU and a long K: a 1x1
    convolution's weight gradient (256x64 over 100352 pixels), or 526x773x7638, which ran 0.12x cuBLAS
    unsplit (H200, benchmarks/results/2026-11-23-h200/4e789c1/)."""
    if p.K < SPLIT_MIN_K or interpreting():
        return False
    from tilegemm.core import tuning

    if tuning.lookup(p.tuning_key("autotuned")) is not None:
        return False  # a tuned class (perhaps tuned since a cached answer): its measured config stands
    key = ("split", p.M, p.N, p.K, p.batch, p.tuning_dtype, p.out.dtype, p.layout, rows_aligned(p), p.out.device)
    return _decided(key, lambda: _split_estimated_faster(p))


_decisions: dict[tuple, object] = {}  # _split_pays's, _pads's and _restrides's answers: the estimates cost the host ~100 us


def _decided(key: tuple, decide):
    """``decide()``, made once per ``key`` (bounded: cleared when full)."""
    found = _decisions.get(key)
    if found is None:
        if len(_decisions) >= 4096:
            _decisions.clear()
        found = _decisions[key] = decide()
    return found


def _split_estimated_faster(p: GemmProblem) -> bool:
    from tilegemm.ops.matmul import split_k
    from tilegemm.ops.matmul.configs import autotune_configs, prune_for
    from tilegemm.ops.matmul.cost import problem_estimator

    estimate = problem_estimator(p)
    splits = [estimate(c) for c in split_k.configs(p) if c["SPLIT_K"] > 1]
    whole = [estimate(c) for c in prune_for(autotune_configs(), p.a.element_size())]
    return bool(splits) and min(splits) < 0.85 * min(whole)


# Untimed, a small-M problem takes the rung of a tuned shape class at most this far (:func:`tilegemm.core.tuning.
# nearest`), else split_k: tf32's nearest "auto" entry was 2048^3's persistent_tma, which ran 24x128x20968 in one
# unsplit tile at 0.05x cuBLAS (the random sweep's M = 17..128 tf32 products: 0.38x; H200,
# benchmarks/results/2026-11-24-h200/c4fcbea/).
UNTIMED_RUNG_DISTANCE = 2.0


def _timed_choice(p: GemmProblem, rungs: tuple[str, ...], max_distance: float = float("inf")) -> str:
    """The faster of ``rungs`` for this shape class: timed once, then remembered. Untimed (the default), the
    choice of the nearest tuned shape class within ``max_distance``, else the first of ``rungs``.

    A rung that tunes its own config does so in its first launch, which ``do_bench`` makes before it times
    anything; a rung that fails there is not chosen (see :func:`tilegemm.core.tuning.lookup_or_tune`).
    """
    from tilegemm.core import tuning

    k = p.tuning_key("auto")
    return tuning.lookup_or_tune(k, lambda: [{"rung": r} for r in rungs], lambda cfg: launcher(cfg["rung"])(p),
                                 max_distance=max_distance)["rung"]


_tma: bool | None = None


def _has_tma() -> bool:
    global _tma
    if _tma is None:
        _tma = registry.get("matmul", "persistent_tma").unavailable_reason() is None
    return _tma


def launcher(name: str):
    """The launch function of a registered matmul kernel (:func:`tilegemm.core.registry.launcher`)."""
    return registry.launcher("matmul", name)


def _scale_stride(scale: torch.Tensor | None) -> int:
    """Stride along M (scale_a) or N (scale_b): 0 for one scale, else the stride of its long dim."""
    if scale is None or scale.numel() == 1:
        return 0
    return scale.stride(0) if scale.dim() == 1 or scale.shape[0] != 1 else scale.stride(1)


def _pads(p: GemmProblem, a: torch.Tensor, b: torch.Tensor, c=None, bias=None) -> bool:
    """Whether ``auto`` runs this problem as its aligned twin (:mod:`tilegemm.ops.matmul.padding`): rows not
    16-byte aligned, a call it can pad, and the cost model says it pays. Answered once per shape class and alignment (the estimates cost the host ~100 us)."""
    if interpreting() or p.batch != 1 or rows_aligned(p):
        return False
    from tilegemm.ops.matmul import padding, residue

    if residue.why_not(p) is None:
        return False  # split_k reads B as it lies, by residue class: no copies

    if not padding.can_pad(a, b, c, bias, p.out):
        return False
    key = ("pad", p.M, p.N, p.K, p.tuning_dtype, p.out.dtype, p.layout, a.stride(), b.stride(), p.out.device)
    return _decided(key, lambda: padding.padding_pays(p))


def _restrides(p: GemmProblem, a: torch.Tensor, b: torch.Tensor) -> str:
    """Which operands ``auto`` copies into buffers with 128-byte rows first (:func:`tilegemm.ops.matmul.padding.
    restride_plan`): answered once per shape class, strides and the operands' offsets within 128 bytes."""
    if interpreting() or p.batch != 1 or not rows_aligned(p):
        return ""
    from tilegemm.ops.matmul import padding

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
    upcast = a.dtype == torch.bfloat16 and interpreting()
    precision = resolve_precision(call.precision, a.dtype)
    scales = (call.scale_a, _scale_stride(call.scale_a), call.scale_b, _scale_stride(call.scale_b))
    rest = (call.c, call.bias, call.alpha, call.beta, call.activation, precision, upcast, scales, call.fast_accum)
    with on_device(a.device):
        for p in make_problems(a, b, out, *rest):
            if kernel == "auto" and _pads(p, a, b, call.c, call.bias):
                from tilegemm.ops.matmul.padding import run_padded

                def twin(a2, b2, bias2, out2):
                    for q in make_problems(a2, b2, out2, None, bias2, *rest[2:]):
                        launch_auto(q)

                run_padded(a, b, call.bias, out, twin)
                continue
            if kernel == "auto" and (plan := _restrides(p, a, b)):
                from tilegemm.ops.matmul.padding import run_restrided

                def restrided(a2, b2):
                    for q in make_problems(a2, b2, out, *rest):
                        launch_auto(q)

                run_restrided(a, b, plan, restrided)
                continue
            if kernel == "auto":
                launch_auto(p)
            else:
                launcher(kernel)(p)
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
        from triton.runtime.errors import OutOfResources

        try:
            launcher(rung)(p, config)
        except OutOfResources:
            # The survey ranked the config with another output dtype or epilogue, and here it does not fit
            # the SM's shared memory: the rung's own choice (persistent_tma's falls back to a config that fits).
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
    not which rung to run. Over the shipped tables' classes with such entries only (fp16 / bf16, NN) the survey's
    picks ran 0.996x / 0.992x cuBLAS on the H200 and 0.993x / 0.986x on the H100, where the rules with those
    entries ran 0.981x / 0.988x and 0.977x / 0.982x (research/ab_survey.py --rung-entries,
    benchmarks/results/2026-11-25-h200/00a4928/, 2026-11-25-h100/9ed2d01/)."""
    if survey.why_not(p) is not None or not survey.covers(p):
        return False
    keys = {r: p.tuning_key(r) for r in _RUNGS_TUNED}
    if tuning.lookup(keys["auto"]) is not None:
        return False
    return not any(tuning.measured(k) for k in keys.values())
