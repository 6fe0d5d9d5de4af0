"""The bench adapter of W4A16: llm sweeps, cuBLAS fp16/bf16 (F.linear with the dense weight) as the baseline,
work in FLOPs (``2 M N K``); the weight traffic in GB/s is :meth:`W4A16Bench.weight_gbps`.

A case's weight format is in its dims: ``G`` the group size (-1: all of K; 128 when absent), ``S`` 1 for symmetric,
``A`` 1 for act-order (GPTQ ``desc_act``: a random input order). The ``formats`` sweep crosses them with M on two
Llama shapes; ``--shape M,N,K,G[,sym][,act]`` times one.

The second baseline column: fbgemm-gpu-genai's preshuffled bf16 x int4 kernel where that package imports, else
torch's own int4 kernel (tinygemm, bf16), which tools/w4a16_gpu_check.py also records. The ``w4-random`` sweep
holds shapes out for checking rules fitted elsewhere (:data:`W4_RANDOM_SEED`).
"""

from __future__ import annotations

import re

import torch

from tilegemm.bench.base import BenchError, BenchOp, Case, Prepared
from tilegemm.core.registry import NotApplicable
from tilegemm.ops.w4a16 import reference

_LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 8192)]
_LLM_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
GROUP_SIZE = 128


def _case(m: int, n: int, k: int, x: float | None = None, group: int = GROUP_SIZE, symmetric: bool = False,
          act_order: bool = False) -> Case:
    """A case; the weight's format (dims G, S, A) named in the label where it is not group-128 asymmetric."""
    dims = dict(M=m, N=n, K=k)
    label = f"{m}x{n}x{k}"
    if group != GROUP_SIZE or symmetric or act_order:
        dims.update(G=group, S=int(symmetric), A=int(act_order))
        label += f"-g{'K' if group == -1 else group}{'-sym' if symmetric else ''}{'-act' if act_order else ''}"
    return Case(label, dims, float(x if x is not None else m))


def _format(case: Case) -> tuple[int, bool, bool]:
    """(group size, symmetric, act-order) of a case."""
    d = case.dims
    return d.get("G", GROUP_SIZE), bool(d.get("S", 0)), bool(d.get("A", 0))


# The formats sweep: every group size, symmetric or not, and GPTQ act-order, against group 128 at the same M
# (run it once per --dtype).
FORMATS_NK = ((5120, 5120), (4096, 11008))
FORMATS_M = (1, 3, 16, 48, 128)
FORMATS = tuple((g, sym, False) for g in (32, 64, 128, 256, -1) for sym in (False, True)) + \
    ((128, False, True), (32, False, True))  # (group size, symmetric, act-order)


def _formats_cases() -> list[Case]:
    cases = []
    for n, k in FORMATS_NK:
        for g, sym, act in FORMATS:
            for m in FORMATS_M:
                cases.append(_case(m, n, k, x=len(cases), group=g, symmetric=sym, act_order=act))
    return cases


def _llm_cases() -> list[Case]:
    return [_case(m, n, k, x=i * len(_LLM_M) + j) for i, (n, k) in enumerate(_LLM_NK) for j, m in enumerate(_LLM_M)]


# The w4-random sweep: held-out shapes. No rule or config shipped may be fitted on this seed (derive rules on
# another seed and check them here); docs/w4a16.md "The w4-random sweep".
W4_RANDOM_SEED = 60417
W4_RANDOM_SHAPES = 16  # (N, K) pairs
W4_RANDOM_M = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
W4_RANDOM_RANGE = (1024, 32768)  # N and K: log-uniform in this range, multiples of 128


def w4_random_shapes(count: int = W4_RANDOM_SHAPES, seed: int = W4_RANDOM_SEED) -> list[tuple[int, int]]:
    """``count`` (N, K) pairs from ``seed``, each log-uniform in 1024..32768 and rounded to a multiple of 128."""
    import math
    import random

    rng = random.Random(seed)
    lo, hi = W4_RANDOM_RANGE

    def draw() -> int:
        v = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        return min(hi, max(lo, int(round(v / 128)) * 128))

    return [(draw(), draw()) for _ in range(count)]


def _w4_random_cases(seed: int = W4_RANDOM_SEED) -> list[Case]:
    return [_case(m, n, k, x=i * len(W4_RANDOM_M) + j) for i, (n, k) in enumerate(w4_random_shapes(seed=seed))
            for j, m in enumerate(W4_RANDOM_M)]


def fbgemm_reason() -> str | None:
    """None where fbgemm-gpu-genai's preshuffled bf16 x int4 kernel imports, else why not (asked once)."""
    if "fbgemm" not in _FBGEMM:
        try:
            from fbgemm_gpu.experimental.gen_ai.quantize import quantize_int4_preshuffle  # registers torch.ops.fbgemm

            _FBGEMM["quantize"] = quantize_int4_preshuffle
            _FBGEMM["fbgemm"] = None if hasattr(torch.ops.fbgemm, "bf16i4bf16_shuffled") else \
                "fbgemm_gpu imports but has no torch.ops.fbgemm.bf16i4bf16_shuffled"
        except Exception as err:  # noqa: BLE001 - a missing package or a build for another torch: say which
            _FBGEMM["fbgemm"] = f"fbgemm-gpu-genai does not import ({type(err).__name__}: {str(err)[:120]})"
    return _FBGEMM["fbgemm"]


_FBGEMM: dict = {}


class W4A16Bench(BenchOp):
    name = "w4a16"
    metric = "TFLOPS"
    baseline_name = "cuBLAS (dense 16-bit weight)"
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    sweeps = {
        "llm": _llm_cases,
        "w4-random": _w4_random_cases,
        "decode": lambda: [_case(m, 8192, 8192) for m in (1, 2, 4, 8, 16, 32, 64)],
        "tiny": lambda: [_case(m, n, k) for m, n, k in ((1, 64, 128), (3, 96, 256), (17, 64, 128))],
        "formats": _formats_cases,
    }
    seeded_sweeps = {"w4-random": lambda seed: _w4_random_cases(seed)}
    gpu_sweep = "llm"
    cpu_sweep = "tiny"
    shape_help = ("M,N,K[,G][,sym][,act] (e.g. 16,8192,8192 or 3,5120,5120,32,sym; G the group size, 128 unless "
                  "given, -1 all of K; K a multiple of it)")
    # decode tokens/s of a 4-bit model vs the same in fp16: Llama-3-8B's shapes, and Qwen2-7B's (a second architecture)
    models = {"llama": "tilegemm.models.bench:LlamaDecodeBench", "qwen2": "tilegemm.models.bench:Qwen2DecodeBench"}

    def parse_shape(self, text: str) -> Case:
        from tilegemm.ops.w4a16.format import GROUP_SIZES

        parts = [p for p in re.split(r"[,x\s]+", text.strip()) if p]
        if len(parts) > 3 and parts[3] in ("sym", "act"):  # no G: the default group size
            parts.insert(3, str(GROUP_SIZE))
        flags = [p for p in parts[4:] if p in ("sym", "act")]
        try:
            if not 3 <= len(parts) <= 6 or len(flags) != len(set(flags)) or len(flags) != len(parts[4:]):
                raise ValueError
            m, n, k = (int(p) for p in parts[:3])
            group = int(parts[3]) if len(parts) > 3 else GROUP_SIZE
        except ValueError:
            raise BenchError(f"malformed w4a16 shape {text!r}: expected {self.shape_help}") from None
        if group not in GROUP_SIZES:
            raise BenchError(f"malformed w4a16 shape {text!r}: the group size must be one of "
                             f"{', '.join(map(str, GROUP_SIZES))}")
        unit = 8 if group == -1 else group
        if min(m, n, k) < 1 or k % unit:
            raise BenchError(f"malformed w4a16 shape {text!r}: sizes must be >= 1 and K a multiple of {unit}")
        return _case(m, n, k, group=group, symmetric="sym" in flags, act_order="act" in flags)

    def prepare(self, case, dtype, device, n_sets, options):
        from tilegemm import w4a16

        M, N, K = case.dims["M"], case.dims["N"], case.dims["K"]
        group, symmetric, act_order = _format(case)
        tdtype = self.dtypes[dtype]
        sets = []
        for _ in range(n_sets):
            dense = torch.randn(N, K, device=device, dtype=tdtype) * 0.02
            w = w4a16.quantize(dense, group, symmetric=symmetric)
            if act_order:  # a GPTQ desc_act weight: its stored rows are inputs in another order
                w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, group, (N, K),
                                     torch.randperm(K, device=device))
            if torch.device(device).type == "cuda":  # as Int4Linear does: the fragment layout made before any timed (or captured) call
                w.fragments()
            # The baseline multiplies by the dequantized weight, so it computes the same result.
            inputs = dict(x=torch.randn(M, K, device=device, dtype=tdtype), w=w, dense=w4a16.dequantize(w))
            if self.second_baseline_reason(device) is None:  # its packing, made once here
                if fbgemm_reason() is None:
                    # fbgemm quantizes the (already 4-bit) dequantized weight itself: its own scales and zeros
                    # (bf16) on the same grid. A shape it refuses gets an "unavailable" row, not a failed run.
                    try:
                        inputs["fbgemm"] = _FBGEMM["quantize"](inputs["dense"].to(torch.bfloat16),
                                                               group_size=K if group == -1 else group, dtype="bf16",
                                                               use_zp=True)
                    except Exception as err:  # noqa: BLE001 - its own checks (asserts, RuntimeErrors)
                        inputs["fbgemm"] = f"fbgemm's quantize_int4_preshuffle refused {N}x{K}: {err}"[:300]
                elif act_order or group == -1:
                    inputs["tinygemm"] = "torch's int4 kernel takes groups of 32 .. 256 in input order only"
                else:
                    from tilegemm.ops.w4a16.baselines import tinygemm_weight

                    inputs["tinygemm"] = tinygemm_weight(w)
                inputs["x_bf16"] = inputs["x"].to(torch.bfloat16)  # its activations, cast outside the timing
            sets.append(inputs)
        first = sets[0]
        return Prepared(sets, reference.reference(first["x"], first["w"]),
                        bytes_per_set=first["w"].nbytes + (M * K + M * N) * tdtype.itemsize)

    def case_bytes(self, case, dtype, options):
        """The random dense weight, its 4-bit form and dequantized copy (the baseline's), x, the float64
        reference and its operands' float64 copies, one kernel's output."""
        M, N, K = case.dims["M"], case.dims["N"], case.dims["K"]
        size = self.dtypes[dtype].itemsize
        return N * K * (2 * size + 8) + N * K // 2 + M * K * (size + 8) + M * N * (8 + size)

    def run(self, kernel, inputs, dtype):
        from tilegemm import w4a16

        return w4a16.matmul(inputs["x"], inputs["w"], kernel=kernel)

    def baseline(self, inputs, dtype):
        return torch.nn.functional.linear(inputs["x"], inputs["dense"])

    # The second baseline: fbgemm-gpu-genai's preshuffled bf16 x int4 CUTLASS kernel (what torchao runs for int4
    # on Hopper) where that package imports, else torch's own int4 kernel (tinygemm); both take bf16 activations,
    # CUDA only. The run's header says which, and why fbgemm is absent.
    @property
    def second_baseline_name(self):
        return "fbgemm int4 (preshuffled)" if fbgemm_reason() is None else "torch int4"

    def second_baseline_reason(self, device):
        if device != "cuda":
            return "the int4 baselines (fbgemm's preshuffled kernel, torch's tinygemm) run on CUDA only"
        return None

    def second_baseline(self, inputs, dtype):
        if "fbgemm" in inputs:
            if isinstance(inputs["fbgemm"], str):
                raise NotApplicable(inputs["fbgemm"])
            wq, (scale, zero) = inputs["fbgemm"]
            return torch.ops.fbgemm.bf16i4bf16_shuffled(inputs["x_bf16"], wq, scale, zero)
        from tilegemm.ops.w4a16.baselines import tinygemm_mm

        if isinstance(inputs["tinygemm"], str):
            raise NotApplicable(inputs["tinygemm"])
        return tinygemm_mm(inputs["x_bf16"], *inputs["tinygemm"])

    def run_meta(self, cases):
        reason = fbgemm_reason()
        return {} if reason is None else {"second_baseline_note": f"not fbgemm's kernel but torch int4 (tinygemm): {reason}"}

    def second_baseline_tolerance(self, dtype):
        return 2e-2  # bf16 activations and output, whatever the op's dtype

    def overhead_probe(self, device):
        from tilegemm import w4a16

        dense = torch.randn(64, 128, device=device, dtype=torch.float16)
        w = w4a16.quantize(dense, GROUP_SIZE)
        x = torch.randn(1, 128, device=device, dtype=torch.float16)
        return (lambda: w4a16.matmul(x, w)), (lambda: torch.nn.functional.linear(x, dense))

    def work(self, case, dtype, options):
        d = case.dims
        return 2.0 * d["M"] * d["N"] * d["K"]

    @staticmethod
    def weight_bytes(N: int, K: int, dtype_size: int = 2, group: int = GROUP_SIZE) -> int:
        """Bytes of a 4-bit weight in groups of ``group`` (-1: all of K): packed values plus scales and zeros."""
        return N * K // 2 + 2 * (1 if group == -1 else K // group) * N * dtype_size

    secondary_metric = "GB/s"  # of weight traffic (packed weights, scales, zeros): the small-M roofline's measure

    def secondary_rate(self, case, dtype, ms, options):
        return self.weight_gbps(case, ms)

    def weight_gbps(self, case: Case, ms: float) -> float:
        """GB/s of weight traffic at a time of ``ms`` milliseconds (the M=1 roofline's measure)."""
        return self.weight_bytes(case.dims["N"], case.dims["K"], group=_format(case)[0]) / (ms * 1e-3) / 1e9

    def tolerance(self, dtype):
        return reference.tolerance(self.dtypes[dtype])
