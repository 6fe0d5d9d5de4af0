"""What the bench knows about each op family: its sweeps, inputs, baseline, reference and work.

The bench is a thin layer over the public ops and the registry: a kernel is run through the same
function a user calls (``tilegemm.matmul(..., kernel=name)``), never through a copy of it.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tilegemm import registry
from tilegemm.hardware import peak_gbps, peak_tflops


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
    shape_help: str = ""

    def default_dtype(self) -> str:
        return next(iter(self.dtypes))

    def kernel_names(self) -> list[str]:
        """The default set: every registered kernel, then ``auto`` where the family has it."""
        names = [s.name for s in registry.specs(self.name)]
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

    def baseline_context(self, dtype: str):
        return contextlib.nullcontext()

    def work(self, case: Case, dtype: str, options: dict) -> float:
        """FLOPs (metric TFLOPS) or bytes moved (metric GB/s) of one call."""
        raise NotImplementedError

    def tolerance(self, dtype: str) -> float:
        raise NotImplementedError

    def peak(self, gpu: str | None, dtype: str) -> float | None:
        return peak_gbps(gpu) if self.metric == "GB/s" else peak_tflops(gpu, dtype)

    def rate(self, case: Case, dtype: str, ms: float, options: dict) -> float:
        """TFLOPS or GB/s at a time of ``ms`` milliseconds."""
        scale = 1e-12 if self.metric == "TFLOPS" else 1e-9  # work in FLOPs or bytes
        return self.work(case, dtype, options) * scale / (ms * 1e-3)


# --- dense GEMM -----------------------------------------------------------------------------------------


def _mnk(m: int, n: int, k: int, x: float | None = None) -> Case:
    return Case(f"{m}x{n}x{k}", dict(M=m, N=n, K=k), float(x if x is not None else m))


def _llm_cases() -> list[Case]:
    cases = []
    for i, (n, k) in enumerate([(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]):
        for j, m in enumerate([1, 16, 128, 2048, 8192]):
            cases.append(_mnk(m, n, k, x=i * 5 + j))
    return cases


class MatmulBench(BenchOp):
    name = "matmul"
    metric = "TFLOPS"
    baseline_name = "cuBLAS"
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32,
              "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    # fp8: per-tensor scales, bf16 output, against torch._scaled_mm (cuBLASLt), which takes A row-major and
    # B column-major only (layout NT) and no e5m2 x e5m2: "fp8_e5m2" is an e5m2 A times an e4m3 B. With the
    # option fast_accum (--fast-accum) both sides accumulate without fp32 promotion.
    FP8_SCALES = (0.75, 1.25)
    sweeps = {
        "square": lambda: [_mnk(s, s, s) for s in (1024, 2048, 4096, 8192, 16384)],
        "llm": _llm_cases,
        "skinny": lambda: [_mnk(m, 8192, 8192) for m in (1, 2, 4, 8, 16, 32, 64, 128)],
        "tiny": lambda: [_mnk(s, s, s) for s in (64, 96, 128, 192)],
    }
    gpu_sweep = "square"
    cpu_sweep = "tiny"
    shape_help = "M,N,K (e.g. 4096,4096,4096)"

    def parse_shape(self, text: str) -> Case:
        parts = re.split(r"[,x\s]+", text.strip())
        try:
            m, n, k = (int(p) for p in parts)
        except ValueError:
            raise BenchError(f"malformed matmul shape {text!r}: expected {self.shape_help}") from None
        if min(m, n, k) < 1:
            raise BenchError(f"malformed matmul shape {text!r}: sizes must be >= 1")
        return _mnk(m, n, k)

    def _precision(self, dtype: str) -> str:
        return "tf32" if dtype == "tf32" else "ieee"

    @staticmethod
    def _fp8(dtype: str) -> bool:
        return dtype.startswith("fp8")

    def default_layout(self, dtype: str) -> str:
        return "NT" if self._fp8(dtype) else "NN"

    def baseline_label(self, dtype: str) -> str:
        return "torch._scaled_mm" if self._fp8(dtype) else self.baseline_name

    def check_dtype(self, dtype: str, capability: tuple[int, int] | None) -> None:
        super().check_dtype(dtype, capability)
        if self._fp8(dtype) and capability is not None and capability < (8, 9):
            raise BenchError(f"{dtype} needs a GPU of compute capability 8.9 or newer")

    def prepare(self, case, dtype, device, n_sets, options):
        M, N, K = case.dims["M"], case.dims["N"], case.dims["K"]
        batch = options.get("batch", 1)
        layout = options.get("layout") or self.default_layout(dtype)
        fp8 = self._fp8(dtype)
        tdtype = self.dtypes[dtype]
        a_dtype, b_dtype = (tdtype, torch.float8_e4m3fn if dtype == "fp8_e5m2" else tdtype)
        lead = (batch,) if batch > 1 else ()

        def operand(rows, cols, transposed, dt):
            shape = (*lead, cols, rows) if transposed else (*lead, rows, cols)
            x = torch.randn(*shape, device=device, dtype=torch.float32 if fp8 else dt).to(dt)
            return x.mT if transposed else x

        sets = []
        for _ in range(n_sets):
            inputs = dict(a=operand(M, K, layout[0] == "T", a_dtype), b=operand(K, N, layout[1] == "T", b_dtype))
            if fp8:
                inputs.update(scale_a=torch.tensor(self.FP8_SCALES[0], device=device),
                              scale_b=torch.tensor(self.FP8_SCALES[1], device=device),
                              fast_accum=bool(options.get("fast_accum")))
            sets.append(inputs)
        first = sets[0]
        reference = torch.matmul(first["a"].double(), first["b"].double())
        if fp8:
            reference *= self.FP8_SCALES[0] * self.FP8_SCALES[1]
        out_size = 2 if fp8 else tdtype.itemsize
        nbytes = batch * ((M * K + K * N) * tdtype.itemsize + M * N * out_size)
        return Prepared(sets, reference, bytes_per_set=nbytes)

    def run(self, kernel, inputs, dtype):
        from tilegemm import matmul

        if self._fp8(dtype):
            return matmul(inputs["a"], inputs["b"], kernel=kernel, scale_a=inputs["scale_a"],
                          scale_b=inputs["scale_b"], out_dtype=torch.bfloat16, fast_accum=inputs["fast_accum"])
        return matmul(inputs["a"], inputs["b"], kernel=kernel, precision=self._precision(dtype))

    def baseline(self, inputs, dtype):
        if self._fp8(dtype):
            a, b = inputs["a"], inputs["b"]
            if not a.is_cuda:  # the interpreter's baseline: the same formula in fp32 on the CPU
                product = torch.matmul(a.float(), b.float()) * inputs["scale_a"] * inputs["scale_b"]
                return product.to(torch.bfloat16)
            if a.dim() != 2 or a.stride(1) != 1 or b.stride(0) != 1:
                raise BenchError("torch._scaled_mm takes 2-D A row-major and B column-major only (--layout NT, "
                                 "no --batch); add --no-baseline for other layouts")
            return torch._scaled_mm(a, b, inputs["scale_a"], inputs["scale_b"], out_dtype=torch.bfloat16,
                                    use_fast_accum=inputs["fast_accum"])
        # torch.matmul's fp32 path follows allow_tf32; the runner sets it per dtype (see tf32_mode).
        return torch.matmul(inputs["a"], inputs["b"])

    def baseline_context(self, dtype):
        return _Tf32Mode(dtype == "tf32")

    def overhead_probe(self, device):
        from tilegemm import matmul

        a = torch.randn(64, 64, device=device, dtype=torch.float16)
        b = torch.randn(64, 64, device=device, dtype=torch.float16)
        return (lambda: matmul(a, b)), (lambda: torch.matmul(a, b))

    def work(self, case, dtype, options):
        d = case.dims
        return 2.0 * d["M"] * d["N"] * d["K"] * options.get("batch", 1)

    def tolerance(self, dtype):
        from tilegemm.ops.matmul.reference import tolerance

        return tolerance(self.dtypes[dtype], self._precision(dtype), torch.bfloat16 if self._fp8(dtype) else None)

    def peak(self, gpu, dtype):
        return super().peak(gpu, "fp8" if self._fp8(dtype) else dtype)


class _Tf32Mode:
    def __init__(self, allow: bool):
        self.allow = allow

    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.allow

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


_OPS: dict[str, Callable[[], BenchOp]] = {"matmul": MatmulBench}


def register_bench_op(name: str, factory: Callable[[], BenchOp]) -> None:
    _OPS[name] = factory


def bench_op(name: str) -> BenchOp:
    _load()
    if name not in _OPS:
        raise BenchError(f"unknown op {name!r}; choose one of: {', '.join(sorted(_OPS))}")
    return _OPS[name]()


def bench_ops() -> list[str]:
    _load()
    return sorted(_OPS)


def _load() -> None:
    from tilegemm.bench.guide_ops import CopyBench, GreyBench

    _OPS.setdefault("copy", CopyBench)
    _OPS.setdefault("grey", GreyBench)


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))
