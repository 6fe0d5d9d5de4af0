"""Rung 3, ``autotuned``: the grouped kernel with its block sizes, warps and stages chosen by timing.

On the first call for a new (M, N, K, dtype), Triton's autotuner times every candidate in
:func:`tilegemm.ops.matmul.configs.autotune_configs` that suits the dtype and keeps the fastest.
"""

import triton

from tilegemm.launch import launch
from tilegemm.ops.matmul.configs import autotune_configs, prune_for
from tilegemm.ops.matmul.grouped import grid, matmul_grouped_kernel
from tilegemm.ops.matmul.problem import GemmProblem


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


# (M, N, K, input dtype, output dtype) -> the config the autotuner chose. Later calls launch the kernel
# with it directly: Triton's Autotuner rebuilds its key from every argument on each call.
_chosen: dict[tuple, dict] = {}


def run(p: GemmProblem, config: dict | None = None) -> None:
    if config is None:
        config = _chosen.get((p.M, p.N, p.K, p.dtype, p.out.dtype))
    if config is not None:
        launch(matmul_grouped_kernel, grid(p), p.kernel_args(), {**p.kernel_flags(), **config})
        return
    matmul_autotuned_kernel[grid(p)](*p.kernel_args(), **p.kernel_flags())
    best = matmul_autotuned_kernel.best_config
    _chosen[(p.M, p.N, p.K, p.dtype, p.out.dtype)] = {
        **best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages,
    }


def chosen_configs() -> dict[tuple, dict]:
    """What the autotuner picked so far, by (M, N, K, dtype, out dtype)."""
    return dict(_chosen)
