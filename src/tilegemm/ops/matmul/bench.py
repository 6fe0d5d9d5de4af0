"""The bench adapter of dense GEMM: sweeps, inputs, cuBLAS / ``torch._scaled_mm`` baselines, work in FLOPs."""

from __future__ import annotations

import math
import random
import re

import torch

from tilegemm.bench.base import BenchError, BenchOp, Case, Prepared


def _mnk(m: int, n: int, k: int, x: float | None = None, b: int | None = None) -> Case:
    """A product M x N x K; with ``b``, a batch of ``b`` of them (both operands batched), labelled ``MxNxK/bB``."""
    if b is None:
        return Case(f"{m}x{n}x{k}", dict(M=m, N=n, K=k), float(x if x is not None else m))
    return Case(f"{m}x{n}x{k}/b{b}", dict(M=m, N=n, K=k, B=b), float(x if x is not None else m))


def _llm_cases() -> list[Case]:
    cases = []
    for i, (n, k) in enumerate([(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]):
        for j, m in enumerate([1, 16, 128, 2048, 8192]):
            cases.append(_mnk(m, n, k, x=i * 5 + j))
    return cases


# The random sweep's held-out seed: nothing shipped may be fitted on its shapes. Its predecessor, 2026, was read
# while rules were fitted (docs/performance.md) and is now a fitting seed like any other (``random:2026``).
RANDOM_SEED = 4099


def _random_cases(count: int = 200, seed: int = RANDOM_SEED) -> list[Case]:
    """``count`` shapes from ``seed``: M log-uniform in 1..16384, N and K log-uniform in 64..28672, a third of
    them with every dimension above 8 moved off a multiple of 8 (rows not 16-byte aligned in 16-bit). With the
    held-out seed they measure how ``auto``'s choice generalises: nothing shipped is tuned on them."""
    rng = random.Random(seed)

    def log_uniform(lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    cases = []
    for i in range(count):
        m, n, k = log_uniform(1, 16384), log_uniform(64, 28672), log_uniform(64, 28672)
        if i % 3 == 2:  # misaligned: no dimension a multiple of 8 (M, N, K > 8)
            m, n, k = (d + 1 if d > 8 and d % 8 == 0 else d for d in (m, n, k))
        else:  # aligned: multiples of 8, as most model shapes are
            m, n, k = (max(8, d - d % 8) if d > 8 else d for d in (m, n, k))
        cases.append(_mnk(m, n, k, x=i))
    return cases


def _model_cases() -> list[Case]:
    """Linear layers of popular models not in ``llm``: hidden/intermediate sizes 3072, 5120, 6144, 11008,
    13824, 18944 as N or K, at decode (M=1, 16) and prefill (M=512, 4096) sizes."""
    pairs = [(11008, 4096), (4096, 11008), (13824, 5120), (5120, 13824), (18944, 3584), (3584, 18944),
             (6144, 6144), (3072, 3072), (8192, 3072), (3072, 8192)]
    return [_mnk(m, n, k, x=i * 4 + j) for i, (n, k) in enumerate(pairs) for j, m in enumerate((1, 16, 512, 4096))]


def _batched_cases() -> list[Case]:
    """Batched products, both operands batched (``torch.matmul``'s batched cuBLAS the baseline), each case with
    its own batch: attention's two products per head (scores S x S over the head dimension d, then S x d over
    S) at S = 512 .. 4096, a mixture-of-experts layer's experts (512 tokens each, 4096 <-> 14336), many small
    products and a few large ones. ``--batch`` does not apply to it."""
    cases = []
    for s, d, b in ((512, 64, 64), (1024, 64, 32), (2048, 128, 32), (4096, 128, 8)):
        cases += [_mnk(s, s, d, b=b), _mnk(s, d, s, b=b)]
    cases += [_mnk(512, 14336, 4096, b=8), _mnk(512, 4096, 14336, b=8), _mnk(128, 128, 128, b=256),
              _mnk(1000, 1000, 1000, b=4), _mnk(4096, 4096, 4096, b=2)]
    return [Case(c.label, c.dims, float(i)) for i, c in enumerate(cases)]


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
        "tiny": lambda: [_mnk(s, s, s) for s in (32, 64, 96, 128)],
        "random": _random_cases,
        "models": _model_cases,
        "batched": _batched_cases,
    }
    seeded_sweeps = {"random": lambda seed: _random_cases(seed=seed)}
    gpu_sweep = "square"
    cpu_sweep = "tiny"
    tune_sweep = "llm"
    options = ("layout", "batch", "fast_accum")
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

    def check_options(self, options, dtype):
        super().check_options(options, dtype)
        if options.get("fast_accum") and not self._fp8(dtype):
            raise BenchError("--fast-accum applies to --op matmul with an fp8 --dtype only")

    def check_dtype(self, dtype: str, capability: tuple[int, int] | None) -> None:
        super().check_dtype(dtype, capability)
        if self._fp8(dtype) and capability is not None and capability < (8, 9):
            raise BenchError(f"{dtype} needs a GPU of compute capability 8.9 or newer")

    @staticmethod
    def batch_of(case, options) -> int:
        """The case's own batch (the ``batched`` sweep's), else ``--batch``'s; both at once is an error."""
        own = case.dims.get("B")
        if own is None:
            return options.get("batch", 1)
        if options.get("batch", 1) > 1:
            raise BenchError(f"--batch {options['batch']} does not apply to {case.label}: the case carries its "
                             "own batch (the batched sweep)")
        return own

    def prepare(self, case, dtype, device, n_sets, options):
        M, N, K = case.dims["M"], case.dims["N"], case.dims["K"]
        batch = self.batch_of(case, options)
        tdtype = self.dtypes[dtype]
        fp8 = self._fp8(dtype)
        sets = self._sets(case, dtype, device, n_sets, options)
        first = sets[0]
        reference = torch.matmul(first["a"].double(), first["b"].double())
        if fp8:
            reference *= self.FP8_SCALES[0] * self.FP8_SCALES[1]
        out_size = 2 if fp8 else tdtype.itemsize
        nbytes = batch * ((M * K + K * N) * tdtype.itemsize + M * N * out_size)
        return Prepared(sets, reference, bytes_per_set=nbytes)

    def case_bytes(self, case, dtype, options):
        """A, B, their float64 copies and float64 product (the reference), and one kernel's output."""
        d = case.dims
        M, N, K = d["M"], d["N"], d["K"]
        size = self.dtypes[dtype].itemsize
        out_size = 2 if self._fp8(dtype) else size
        return self.batch_of(case, options) * ((M * K + K * N) * (size + 8) + M * N * (8 + out_size))

    def precompile_inputs(self, case, dtype, device, options):
        """Without the float64 reference: at the random sweep's sizes it is gigabytes a worker."""
        return self._sets(case, dtype, device, 1, options)[0]

    def _sets(self, case, dtype, device, n_sets, options) -> list[dict]:
        M, N, K = case.dims["M"], case.dims["N"], case.dims["K"]
        batch = self.batch_of(case, options)
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
        return sets

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
        return 2.0 * d["M"] * d["N"] * d["K"] * self.batch_of(case, options)

    def tolerance(self, dtype):
        from tilegemm.ops.matmul.reference import tolerance

        return tolerance(self.dtypes[dtype], self._precision(dtype), torch.bfloat16 if self._fp8(dtype) else None)



class _Tf32Mode:
    def __init__(self, allow: bool):
        self.allow = allow

    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.allow

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old
