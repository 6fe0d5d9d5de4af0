"""The interface every op family's bench adapter implements: its sweeps, inputs, baseline, reference, work.

Each family brings its adapter (``tilegemm/ops/<family>/bench.py``), named in its
:class:`~tilegemm.core.registry.OpSpec`. The bench is a thin layer over the public ops and the registry: a
kernel is run through the same function a user calls (``tilegemm.matmul(..., kernel=name)``), never through a
copy of it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tilegemm.core import registry
from tilegemm.core.hardware import peak_gbps, peak_tflops


class BenchError(ValueError):
    """A bad bench request (unknown op, kernel, dtype, malformed shape): one line for the user."""


@dataclass(frozen=True)
class Case:
    """One point of a sweep."""

    label: str
    dims: dict[str, int]
    x: float  # position on the plot's x axis


@dataclass
class Prepared:
    """Inputs for one case: ``sets`` are interchangeable input sets (rotated to defeat L2 in graph mode)."""

    sets: list[dict[str, Any]]
    reference: torch.Tensor
    bytes_per_set: int
    extra: dict = field(default_factory=dict)


class BenchOp:
    name: str = ""
    metric: str = "TFLOPS"  # or "GB/s"
    baseline_name: str = ""
    cpu_baseline_name: str = "torch (CPU)"
    # False where the baseline moves the same bytes but does not compute the op (grey vs a copy): its
    # output is then not checked against the reference.
    baseline_computes_result: bool = True
    dtypes: dict[str, torch.dtype] = {}
    sweeps: dict[str, Callable[[], list[Case]]] = {}
    gpu_sweep: str = ""
    cpu_sweep: str = ""
    tune_sweep: str = ""  # what `tilegemm tune` runs when no sweep is given
    options: tuple[str, ...] = ()  # the bench options this op takes (layout, batch, fast_accum, mode)
    shape_help: str = ""

    def check_options(self, options: dict, dtype: str) -> None:
        """Raise BenchError for an option this op does not take (``layout``, ``batch``, ``fast_accum``)."""
        unset = dict(layout=None, batch=1, fast_accum=False, mode="fwd")
        for name, value in options.items():
            if name not in self.options and value != unset.get(name):
                flag = "--" + name.replace("_", "-")
                raise BenchError(f"{flag} does not apply to --op {self.name}")

    def default_dtype(self) -> str:
        return next(iter(self.dtypes))

    def kernel_names(self, dtype: str | None = None) -> list[str]:
        """The default set: every registered kernel that can run here and takes ``dtype``, then ``auto``."""
        names = [s.name for s in registry.specs(self.name) if s.takes(dtype) and s.unavailable_reason() is None]
        return names + (["auto"] if "auto" in registry.kernels(self.name) else [])

    def overhead_probe(self, device: str):
        """(tilegemm call, baseline call) on a tiny problem, for host time per call; None if not measured."""
        return None

    def check_kernel(self, name: str) -> None:
        if name == "auto" and "auto" in registry.kernels(self.name):
            return
        try:
            registry.get(self.name, name)
        except ValueError as err:
            raise BenchError(str(err)) from None

    def check_dtype(self, dtype: str, capability: tuple[int, int] | None) -> None:
        if dtype not in self.dtypes:
            raise BenchError(f"op {self.name} has no dtype {dtype!r}; choose one of: {', '.join(self.dtypes)}")

    def default_layout(self, dtype: str) -> str:
        return "NN"

    def baseline_label(self, dtype: str) -> str:
        return self.baseline_name

    def parse_shape(self, text: str) -> Case:
        raise NotImplementedError

    def cases(self, sweep: str) -> list[Case]:
        if sweep not in self.sweeps:
            raise BenchError(f"op {self.name} has no sweep {sweep!r}; choose one of: {', '.join(self.sweeps)}")
        return self.sweeps[sweep]()

    def prepare(self, case: Case, dtype: str, device: str, n_sets: int, options: dict) -> Prepared:
        raise NotImplementedError

    def run(self, kernel: str, inputs: dict, dtype: str) -> torch.Tensor:
        raise NotImplementedError

    def baseline(self, inputs: dict, dtype: str) -> torch.Tensor:
        raise NotImplementedError

    # A second baseline timed beside the first (its own row; every kernel gets a second ratio against it).
    second_baseline_name: str = ""

    def second_baseline_reason(self, device: str) -> str | None:
        """None where the second baseline can run on ``device``, else why not."""
        return "this op has no second baseline"

    def second_baseline(self, inputs: dict, dtype: str) -> torch.Tensor:
        raise NotImplementedError

    def second_baseline_tolerance(self, dtype: str) -> float:
        """Its bound against the reference (it may compute in another precision than the op)."""
        return self.tolerance(dtype)

    def baseline_context(self, dtype: str):
        return contextlib.nullcontext()

    def work(self, case: Case, dtype: str, options: dict) -> float:
        """FLOPs (metric TFLOPS) or bytes moved (metric GB/s) of one call."""
        raise NotImplementedError

    def tolerance(self, dtype: str) -> float:
        raise NotImplementedError

    def peak(self, gpu: str | None, dtype: str) -> float | None:
        return peak_gbps(gpu) if self.metric == "GB/s" else peak_tflops(gpu, dtype)

    # A second rate shown beside the first, e.g. "GB/s" of weight traffic for a bandwidth-bound op; its % of
    # the GPU's memory bandwidth is shown too. Empty: none.
    secondary_metric: str = ""

    def secondary_rate(self, case: Case, dtype: str, ms: float, options: dict) -> float | None:
        """The :attr:`secondary_metric` at a time of ``ms`` milliseconds."""
        return None

    def rate(self, case: Case, dtype: str, ms: float, options: dict) -> float:
        """TFLOPS or GB/s at a time of ``ms`` milliseconds."""
        scale = 1e-12 if self.metric == "TFLOPS" else 1e-9  # work in FLOPs or bytes
        return self.work(case, dtype, options) * scale / (ms * 1e-3)


def bench_op(name: str) -> BenchOp:
    """The bench adapter of a registered op."""
    try:
        spec = registry.op(name)
    except ValueError:
        raise BenchError(f"unknown op {name!r}; choose one of: {', '.join(bench_ops())}") from None
    if spec.bench is None:
        raise BenchError(f"op {name!r} has no bench adapter; choose one of: {', '.join(bench_ops())}")
    return spec.bench_adapter()()


def bench_ops() -> list[str]:
    """The registered ops that have a bench adapter."""
    return [name for name in registry.ops() if registry.op(name).bench is not None]


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))
