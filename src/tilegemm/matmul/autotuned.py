"""Rung 3, ``autotuned``: the grouped kernel with its block sizes, warps and stages chosen by timing.

On the first call for a new (M, N, K, dtype), Triton's autotuner times every candidate in
:func:`tilegemm.matmul.configs.autotune_configs` that suits the dtype and keeps the fastest.
"""

import triton

from tilegemm.matmul.configs import autotune_configs, prune_for
from tilegemm.matmul.grouped import grid, matmul_grouped_kernel
from tilegemm.matmul.problem import GemmProblem


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


def run(p: GemmProblem, config: dict | None = None) -> None:
    if config is not None:
        matmul_grouped_kernel[grid(p)](*p.kernel_args(), **p.kernel_flags(), **config)
        return
    matmul_autotuned_kernel[grid(p)](*p.kernel_args(), **p.kernel_flags())


def best_config(p: GemmProblem) -> dict | None:
    """The config the autotuner chose for this problem's key, if it has tuned it."""
    cfg = getattr(matmul_autotuned_kernel, "best_config", None)
    if cfg is None:
        return None
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
