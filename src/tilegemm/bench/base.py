"""The interface every op family's bench adapter implements: its sweeps, inputs, baseline, reference, work.

Each family brings its adapter (``tilegemm/ops/<family>/bench.py``), named in its
:class:`~tilegemm.core.registry.OpSpec`. The bench is a thin layer over the public ops and the registry: a
kernel is run through the same function a user calls (``tilegemm.matmul(..., kernel=name)``), never through a
copy of it.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tilegemm.core import registry
from tilegemm.core.hardware import peak_gbps, peak_tflops
from tilegemm.core.runtime import interpreting


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
    # Model entries (``tilegemm bench --op OP --model NAME``): a whole model on this op's kernels, timed against
    # the same model on the baseline's; name -> its adapter, a :class:`ModelBench` as ``"module:Class"``.
    models: dict[str, str] = {}

    def model_bench(self, name: str, **kwargs) -> "ModelBench":
        """The adapter of this op's model entry ``name`` (built with ``kwargs``); BenchError if there is none."""
        if not self.models:
            entries = ", ".join(f"--op {op} --model {model}" for op, model in model_entries()) or "none"
            raise BenchError(f"op {self.name} has no model entries; those there are: {entries}")
        if name not in self.models:
            raise BenchError(f"op {self.name} has no model {name!r}; choose one of: {', '.join(self.models)}")
        return registry.resolve(self.models[name])(**kwargs)

    def run_meta(self, cases: list[Case]) -> dict:
        """Fields the run's result header gets besides the runner's own (a model entry describes its model)."""
        return {}

    def check_options(self, options: dict, dtype: str) -> None:
        """Raise BenchError for an option this op does not take (``layout``, ``batch``, ``fast_accum``)."""
        unset = dict(layout=None, batch=1, fast_accum=False, mode="fwd", memory_format="channels_last")
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

    # Sweeps drawn from a seed: ``NAME`` is the held-out draw (nothing shipped is fitted on it), ``NAME:SEED`` the
    # same recipe from another seed, the one a rule is fitted on (docs/bench.md, "Held-out sweeps").
    seeded_sweeps: dict = {}

    def cases(self, sweep: str) -> list[Case]:
        name, colon, seed = sweep.partition(":")
        if colon and name in self.seeded_sweeps:
            try:
                value = int(seed)
            except ValueError:
                raise BenchError(f"malformed sweep {sweep!r}: {name}:SEED takes an integer seed") from None
            return self.seeded_sweeps[name](value)
        if sweep not in self.sweeps:
            seeded = "".join(f", {n}:SEED" for n in self.seeded_sweeps)
            raise BenchError(f"op {self.name} has no sweep {sweep!r}; choose one of: {', '.join(self.sweeps)}"
                             f"{seeded}")
        return self.sweeps[sweep]()

    def prepare(self, case: Case, dtype: str, device: str, n_sets: int, options: dict) -> Prepared:
        raise NotImplementedError

    def case_bytes(self, case: Case, dtype: str, options: dict) -> int | None:
        """About the most memory :meth:`prepare` and one call of ``case`` hold at once (one input set, the
        float64 reference and its operands' float64 copies, one output): a lower bound, or None where the op does
        not say. Under the interpreter, where every tensor lives in host memory, a case that needs more than is
        free is refused (:func:`memory_shortfall`) instead of being killed by the OS mid-allocation."""
        return None

    def precompile_inputs(self, case: Case, dtype: str, device: str, options: dict) -> dict:
        """One input set of ``case`` for a ``--precompile`` worker's calls (:mod:`tilegemm.bench.precompile`):
        the same tensors :meth:`prepare` makes (shapes, strides and alignment pick the compiled variant). An op
        whose reference is costly makes the set without it."""
        return self.prepare(case, dtype, device, 1, options).sets[0]

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


def _gib(n: float) -> str:
    gib = n / 2**30
    return f"{gib:,.0f} GiB" if gib >= 100 else f"{gib:.3g} GiB" if gib >= 1 else f"{n / 2**20:.3g} MiB"


def memory_shortfall(op: BenchOp, case: Case, dtype: str, options: dict, available: int | None) -> str:
    """A one-line message where ``case`` needs more memory than ``available`` bytes (:meth:`BenchOp.case_bytes`),
    else an empty string (also where either is unknown)."""
    need = op.case_bytes(case, dtype, options)
    if need is None or available is None or need <= available:
        return ""
    return (f"{op.name} {case.label} ({dtype}) needs about {_gib(need)} of memory for its inputs, outputs and "
            f"reference; {_gib(available)} is available")


# FLOPs (or bytes moved, for a GB/s op) of one call above which a case runs for minutes a call or more under the
# interpreter: a warning, not a refusal (docs/bench.md, "Under the interpreter").
INTERPRETER_SLOW_WORK = 1e9


def interpreter_slow(op: BenchOp, case: Case, dtype: str, options: dict) -> bool:
    """Whether ``case`` is large enough to run for a long time under the interpreter (model entries: never,
    they run their tiny models there)."""
    if isinstance(op, ModelBench) or op.metric not in ("TFLOPS", "GB/s"):
        return False
    return op.work(case, dtype, options) > INTERPRETER_SLOW_WORK


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


def model_entries() -> list[tuple[str, str]]:
    """(op, model) of every model entry of the registered ops' bench adapters."""
    return [(name, model) for name in bench_ops() for model in registry.op(name).bench_adapter().models]


class ModelBench(BenchOp):
    """A model entry: a whole model on tilegemm's layers (row ``auto``: each layer's op picks its kernel per
    call), timed end to end against the same model on the baseline's kernels; the rate is the batch's items
    (tokens, images) per second of one call.

    A case is a batch size and a mode, both in its ``dims`` (``batch``, ``mode``), with what else the model
    needs. The model is built once per adapter and kept across cases; what a case builds around it (caches,
    CUDA graphs, compiled code) lives in its :class:`Prepared` and is released before the next case.
    """

    model: str = ""  # its name under --model (``name`` is "op:model")
    metric = "items/s"
    gpu_modes: tuple[str, ...] = ()  # the modes a --shape may name on a GPU; under the interpreter: eager

    def __init__(self):
        self._compiled = False  # a case ran torch.compile: its compiled code is dropped before the next case

    def kernel_names(self, dtype=None):
        return ["auto"]

    def check_kernel(self, name):
        if name != "auto":
            extra = [row for row in (getattr(self, "FUSED", None), getattr(self, "FOLD", None)) if row]
            takes = "all or auto" + "".join(f", or auto,{row}" for row in extra)  # (an entry's rows of its own)
            raise BenchError(f"--model {self.model} times tilegemm's model as a whole (its layers pick their kernels: "
                             f"auto): --kernels takes {takes}, not {name!r}")

    def check_options(self, options, dtype):
        unset = dict(layout=None, batch=1, fast_accum=False, mode="fwd", memory_format="channels_last")
        for name, value in options.items():
            if value != unset.get(name):
                flag = "--" + name.replace("_", "-")
                raise BenchError(f"{flag} {value if value is not True else ''}".rstrip()
                                 + f" does not apply to --model {self.model}")

    def peak(self, gpu, dtype):
        return None

    def work(self, case, dtype, options):
        """Items (tokens, images) of one call: the batch."""
        return float(case.dims["batch"])

    def rate(self, case, dtype, ms, options):
        return self.work(case, dtype, options) / (ms * 1e-3)

    def modes(self) -> tuple[str, ...]:
        """The modes this machine runs: CUDA graphs and torch.compile need a GPU."""
        return ("eager",) if interpreting() else self.gpu_modes

    def parse_shape(self, text: str) -> Case:
        """``BATCH[,MODE]``: the batch size and mode (default: the first this machine runs), of the model the
        machine's default sweep runs."""
        parts = [p for p in text.replace(" ", ",").split(",") if p]
        modes = self.modes()
        if not 1 <= len(parts) <= 2 or not parts[0].isdigit() or int(parts[0]) < 1:
            raise BenchError(f"malformed --model {self.model} shape {text!r}: expected {self.shape_help}")
        mode = parts[1] if len(parts) == 2 else modes[0]
        if mode not in ("eager", *self.gpu_modes):
            raise BenchError(f"malformed --model {self.model} shape {text!r}: expected {self.shape_help}")
        if mode not in modes:
            raise BenchError(f"--model {self.model} runs in mode {', '.join(modes)} here, not {mode!r}")
        return self.custom_case(int(parts[0]), mode)

    def custom_case(self, batch: int, mode: str) -> Case:
        """The case of a ``--shape BATCH[,MODE]``: the full-size model on a GPU, the tiny one under the
        interpreter (:meth:`_require` refuses what cannot run here)."""
        from tilegemm.core.runtime import interpreting

        tiny = interpreting()
        self._require(tiny)
        return self._case(batch, mode, tiny, batch)

    def _require(self, tiny: bool) -> None:
        """Raise BenchError where the model (tiny or full-size) cannot run here."""
        raise NotImplementedError

    def _case(self, batch: int, mode: str, tiny: bool, x: float) -> Case:
        raise NotImplementedError

    def release(self) -> None:
        """Free what the previous case left (its caches, graphs and compiled code; the model stays)."""
        if self._compiled:
            # Compiled code may hold the last case's objects; a later case compiles its own, and old entries
            # would count toward dynamo's recompilation limit.
            torch._dynamo.reset()
            self._compiled = False
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def description(self, cases: list[Case]) -> str:
        raise NotImplementedError

    def run_meta(self, cases):
        return dict(model=self.model, model_description=self.description(cases))


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))
