"""Rung 3, ``autotuned``: the grouped kernel with its block sizes, warps and stages chosen by timing.

A shape class (M bucketed to a power of two, N, K, dtypes, layout) takes its tuned config, shipped or kept
from an earlier tuning. An unseen one takes, untimed, the config of the nearest tuned class
(:func:`tilegemm.core.tuning.nearest`) if one is near, else the config
:mod:`tilegemm.ops.matmul.cost` estimates fastest. Where timing is asked for
(``tilegemm tune``, ``TILEGEMM_TUNE=1``), Triton's autotuner times every candidate in
:func:`tilegemm.ops.matmul.configs.autotune_configs` that suits the dtype, and the fastest is kept by
:mod:`tilegemm.core.tuning` (memory, then disk), so later calls and later processes do not tune again.
"""

import threading

import triton

from tilegemm.core import tuning
from tilegemm.core.hardware import pipeline_fits
from tilegemm.core.launch import launch, spoil
from tilegemm.core.runtime import fork_safe
from tilegemm.ops.matmul.configs import autotune_configs, prune_for
from tilegemm.ops.matmul.cost import fastest
from tilegemm.ops.matmul.grouped import grid, matmul_grouped_kernel
from tilegemm.ops.matmul.problem import GemmProblem, rows_aligned

_autotuning = fork_safe(threading.Lock())


def _prune(configs, named_args, **kwargs):
    return prune_for(configs, named_args["a_ptr"].element_size())


def _to_triton(cfg: dict) -> triton.Config:
    kw = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return triton.Config(kw, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


matmul_autotuned_kernel = triton.autotune(
    configs=[_to_triton(c) for c in autotune_configs()],
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": _prune},
)(matmul_grouped_kernel)


def _fitting(configs: list, p: GemmProblem) -> list:
    """The ``configs`` whose pipeline fits the GPU's shared memory a block (all where none does: the first then
    fails at its launch, naming the shared memory it needs)."""
    kept = [c for c in configs if pipeline_fits(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], p.a.element_size(),
                                                c["num_stages"], p.out.device)]
    return kept or configs


def run(p: GemmProblem, config: dict | None = None) -> None:
    k = None
    if config is None:
        # A config tuned earlier for this shape class (M bucketed), in memory, on disk or shipped.
        k = p.tuning_key("autotuned")
        config = tuning.lookup(k)
        if config is None and not tuning.timing_enabled():
            # Not timed unless asked: a near tuned shape class's config, else the one the cost model ranks
            # fastest (tilegemm.ops.matmul.cost).
            config = tuning.choose_untimed(k, lambda: _fitting(prune_for(autotune_configs(), p.a.element_size()), p),
                                           lambda opts: fastest(opts, p), tuning.NEAR, variant=rows_aligned(p))
    if config is not None:
        flags = {**p.kernel_flags(), **config}
        launch(matmul_grouped_kernel, grid(p), p.kernel_args(), flags)
        return
    # Triton's autotuner keeps its own winners keyed by M, N, K and the tensors' dtypes only: not the layout
    # (strides), precision, fast accumulation or epilogue. Its winner for an earlier problem of the same
    # sizes would be taken here untimed and recorded under this key (docs/rungs/autotuned.md). tilegemm's key
    # is the one that says what was timed, so the autotuner starts afresh for it.
    spoil()  # the autotuner's launches do not go through launch(): a recording of this call must not be kept
    with _autotuning:  # one autotuner for every shape: its winner is read before another thread's run replaces it
        matmul_autotuned_kernel.cache.clear()
        matmul_autotuned_kernel[grid(p)](*p.kernel_args(), **p.kernel_flags())
        best = matmul_autotuned_kernel.best_config
        tuning.record(k, {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages})
