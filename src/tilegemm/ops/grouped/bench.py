"""The bench adapter of the grouped family: MoE experts' products (gate/up and down) of three models under skewed
routing, batched products, and a tiny sweep for the interpreter; work in FLOPs.

Baseline: the faster, for each case, of a loop of cuBLAS products (``torch.mm``) over the non-empty groups (its group
bounds read on the host while the inputs are prepared, outside the timed region) and ``torch.nn.functional.grouped_mm``
(CUDA only; chosen by a few timed calls while preparing); F.grouped_mm is also the second baseline, its own row.
``batched``: ``torch.matmul``. :class:`GroupedW4A16Bench` (``--op grouped_w4a16``): 16-bit activations times 4-bit
experts (group 128), against the same 16-bit baselines. Option ``mode``: ``fwd``, or ``bwd`` (the gradients of a
and b from one output gradient, returned flattened and concatenated on both sides).
"""

from __future__ import annotations

import math
import re

import torch

from tilegemm.bench.base import BenchError, BenchOp, Case, Prepared
from tilegemm.core.registry import NotApplicable
from tilegemm.ops.grouped.api import grouped_matmul, grouped_mm
from tilegemm.ops.grouped.reference import grouped_mm_reference, tolerance
from tilegemm.ops.w4a16 import dequantize, quantize

# (name, experts, top-k, hidden, intermediate): the MoE layers of the models the sweep is named after.
MOE_MODELS = (("mixtral", 8, 2, 4096, 14336), ("qwen3_30b_a3b", 128, 8, 2048, 768),
              ("deepseek_v2_lite", 64, 6, 2048, 1408))
TOKENS = (1, 8, 64, 512, 4096, 16384)
PRODUCTS = ("gate_up", "down")
SEED = 2026
# The host-time probe's group sizes: a decode step of 8 token-expert rows over 16 experts, most of them empty.
PROBE_SIZES = (1, 0, 2, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 2, 0, 0)


def _moe(name, E, topk, H, I, T, product, x) -> Case:
    return Case(f"{name}/{product}/t{T}", dict(kind=0, E=E, topk=topk, H=H, I=I, T=T,
                                              product=PRODUCTS.index(product)), float(x))


def _moe_cases() -> list[Case]:
    cases = []
    for name, E, topk, H, I in MOE_MODELS:
        for product in PRODUCTS:
            for T in TOKENS:
                cases.append(_moe(name, E, topk, H, I, T, product, len(cases)))
    return cases


def _batched(B, M, N, K, x) -> Case:
    return Case(f"{M}x{N}x{K}/b{B}", dict(kind=1, B=B, M=M, N=N, K=K), float(x))


def _batched_cases() -> list[Case]:
    """Attention's two products per head (S x S over d, then S x d over S), MoE experts with equal groups, many
    small products and a few large ones."""
    shapes = []
    for s, d, b in ((512, 64, 64), (1024, 64, 32), (2048, 128, 32), (4096, 128, 8)):
        shapes += [(b, s, s, d), (b, s, d, s)]
    shapes += [(8, 512, 14336, 4096), (8, 512, 4096, 14336), (256, 128, 128, 128), (4, 1000, 1000, 1000),
               (2, 4096, 4096, 4096), (16, 2048, 2048, 128), (8, 4096, 4096, 64)]
    return [_batched(*s, x=i) for i, s in enumerate(shapes)]


def _tiny_cases() -> list[Case]:
    cases = [_moe("tiny", 4, 2, 64, 32, T, p, i) for i, (T, p) in enumerate(((1, "gate_up"), (17, "gate_up"),
                                                                           (9, "down")))]
    return cases + [_batched(3, 17, 24, 32, 3)]


def routing(T: int, E: int, topk: int, seed: int = SEED) -> torch.Tensor:
    """Skewed top-k routing from a fixed seed: expert popularity falls off as ``1 / rank^1.2`` over a shuffled
    order, and an eighth of the experts (at least one when E >= 8) get no token. Returns the expert ids, [T, topk]."""
    g = torch.Generator().manual_seed(seed + 7919 * T + E)
    order = torch.randperm(E, generator=g)
    weight = 1.0 / (torch.arange(E, dtype=torch.float64) + 1.0) ** 1.2
    weight[max(E - E // 8, topk):] = 0.0  # the least popular eighth: never routed to
    probs = torch.empty(E, dtype=torch.float64)
    probs[order] = weight
    return torch.multinomial(probs.expand(T, E), topk, replacement=False, generator=g)


def group_sizes(T: int, E: int, topk: int) -> list[int]:
    ids = routing(T, E, topk).reshape(-1)
    return torch.bincount(ids, minlength=E).tolist()


class GroupedBench(BenchOp):
    name = "grouped"
    metric = "TFLOPS"
    baseline_name = "faster of cuBLAS loop, F.grouped_mm"
    cpu_baseline_name = "torch loop (CPU)"
    second_baseline_name = "F.grouped_mm"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
    int4 = False  # the experts' weight 4-bit (GroupedW4A16Bench)
    sweeps = {"moe": _moe_cases, "batched": _batched_cases, "tiny": _tiny_cases}
    gpu_sweep = "moe"
    cpu_sweep = "tiny"
    options = ("mode",)
    shape_help = ("E,TOPK,HIDDEN,INTERMEDIATE,TOKENS,gate_up|down (a MoE product, e.g. 8,2,4096,14336,512,gate_up) "
                  "or B,M,N,K (a batched product)")
    # a transformers MoE model on tilegemm's experts against its built-in implementations (docs/grouped.md)
    models = {"qwen3_moe": "tilegemm.models.bench:MoEBench", "mixtral": "tilegemm.models.bench:MixtralBench"}

    @staticmethod
    def _mode(options) -> str:
        mode = options.get("mode") or "fwd"
        if mode not in ("fwd", "bwd"):
            raise BenchError(f"--mode must be fwd or bwd, got {mode!r}")
        return mode

    def check_options(self, options, dtype):
        super().check_options(options, dtype)
        self._mode(options)

    def parse_shape(self, text: str) -> Case:
        parts = [p for p in re.split(r"[,x\s]+", text.strip()) if p]
        try:
            if len(parts) == 6 and parts[5] in PRODUCTS:
                E, topk, H, I, T = (int(p) for p in parts[:5])
                if min(E, topk, H, I, T) < 1 or topk > E:
                    raise ValueError
                return _moe(f"e{E}k{topk}h{H}i{I}", E, topk, H, I, T, parts[5], 0)  # (its label: every size)
            if len(parts) == 4:
                B, M, N, K = (int(p) for p in parts)
                if min(B, M, N, K) < 1:
                    raise ValueError
                return _batched(B, M, N, K, 0)
        except ValueError:
            pass
        raise BenchError(f"malformed grouped shape {text!r}: expected {self.shape_help}")

    @staticmethod
    def _precision(dtype: str) -> str:
        return "tf32" if dtype == "tf32" else "ieee"

    def _dims(self, case):
        """(groups, M_total, N, K, group sizes or None) of a case."""
        d = case.dims
        if d["kind"] == 1:
            return d["B"], d["M"], d["N"], d["K"], None
        N, K = (2 * d["I"], d["H"]) if d["product"] == 0 else (d["H"], d["I"])
        sizes = group_sizes(d["T"], d["E"], d["topk"])
        return d["E"], d["T"] * d["topk"], N, K, sizes

    def case_bytes(self, case, dtype, options):
        """a, b (and dy; a 4-bit expert's dequantized copy too), their float64 copies, the float64 reference (the
        gradients also concatenated), one kernel's output. From the dims alone: no routing is drawn."""
        d = case.dims
        if d["kind"] == 1:
            a, b, y = d["B"] * d["M"] * d["K"], d["B"] * d["K"] * d["N"], d["B"] * d["M"] * d["N"]
        else:
            N, K = (2 * d["I"], d["H"]) if d["product"] == 0 else (d["H"], d["I"])
            M = d["T"] * d["topk"]
            a, b, y = M * K, d["E"] * N * K, M * N
        size = self.dtypes[dtype].itemsize
        extra = b * size if self.int4 else 0
        if self._mode(options) == "fwd":
            return (a + b) * (size + 8) + y * (8 + size) + extra
        return (a + b + y) * (size + 8) + (a + b) * (8 + 8 + size) + extra

    def prepare(self, case, dtype, device, n_sets, options):
        mode = self._mode(options)
        tdtype = self.dtypes[dtype]
        G, M, N, K, sizes = self._dims(case)
        gen = torch.Generator(device=device).manual_seed(SEED)
        r = lambda *s: (torch.randn(*s, device=device, generator=gen) / math.sqrt(K)).to(tdtype)  # noqa: E731
        shared = {}
        if sizes is None:  # batched
            b = r(G, K, N)
            shared.update(kind="batched", b=b)
            make_a = lambda: r(G, M, K) * math.sqrt(K)  # noqa: E731
            reference = None
        else:
            offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
            ends = offs.tolist()
            bounds = [(g, lo, hi) for g, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)) if hi > lo]
            weight = r(G, N, K)  # experts stored as transformers does: [E, N, K]
            shared.update(kind="moe", offs=offs.to(device), bounds=bounds, b=weight.transpose(1, 2))
            if self.int4:
                shared["w4"] = quantize(weight, group_size=128 if K % 128 == 0 else -1)
                shared["b"] = dequantize(shared["w4"]).transpose(1, 2)  # what the baselines multiply
            make_a = lambda: r(M, K) * math.sqrt(K)  # noqa: E731
        sets = []
        for _ in range(n_sets):
            inputs = dict(shared, a=make_a(), mode=mode, precision=self._precision(dtype))
            if mode == "bwd":
                out_shape = (G, M, N) if sizes is None else (M, N)
                inputs["dy"] = torch.randn(*out_shape, device=device, generator=gen).to(tdtype)
            sets.append(inputs)
        first = sets[0]
        if device == "cuda" and sizes is not None and self.second_baseline_reason(device) is None:
            with self.baseline_context(dtype):
                faster = self._faster_baseline(first, dtype)
            for inputs in sets:
                inputs["faster"] = faster
        a, b = first["a"].double(), first["b"].double()
        offs = first.get("offs")
        if mode == "fwd":
            reference = grouped_mm_reference(a, b, offs)
        else:
            dy = first["dy"].double()
            ga = grouped_mm_reference(dy, b.transpose(-2, -1), offs)
            gb = grouped_mm_reference(a.transpose(-2, -1), dy, offs)
            reference = torch.cat([ga.flatten(), gb.flatten()])
        size = tdtype.itemsize
        nbytes = (first["a"].numel() + first["b"].numel() + M * N * (G if sizes is None else 1)) * size
        return Prepared(sets, reference, bytes_per_set=nbytes * (2 if mode == "bwd" else 1))

    def run(self, kernel, inputs, dtype):
        a, b, offs = inputs["a"], inputs["b"], inputs.get("offs")
        if self.int4:
            if inputs["kind"] != "moe":
                raise NotApplicable("4-bit experts: a MoE product, not a batched one")
            return grouped_matmul(a, inputs["w4"], offs, kernel=kernel)
        with _Tf32Mode(inputs["precision"] == "tf32"):
            if inputs["mode"] == "fwd":
                return grouped_mm(a, b, offs=offs, kernel=kernel)
            dy = inputs["dy"]
            ga = grouped_mm(dy, b.transpose(-2, -1), offs=offs, kernel=kernel)
            gb = grouped_mm(a.transpose(-2, -1), dy, offs=offs, kernel=kernel)
            return torch.cat([ga.flatten(), gb.flatten()])

    def _faster_baseline(self, inputs, dtype) -> str:
        """``"loop"`` or ``"grouped_mm"``: which of the two baselines runs this case faster (a few timed calls,
        while preparing; F.grouped_mm loses where it refuses the case, or where a CUDA graph cannot capture it:
        outside bf16 torch's grouped_mm falls back to a form that reads ``offs`` on the host, and a baseline must
        run in every timing mode, ``--cuda-graph`` included)."""
        times = {}
        for name, fn in (("loop", self._loop), ("grouped_mm", self.second_baseline)):
            try:
                for _ in range(2):
                    fn(inputs, dtype)
                if name == "grouped_mm":
                    with torch.cuda.graph(torch.cuda.CUDAGraph()):
                        fn(inputs, dtype)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    fn(inputs, dtype)
                end.record()
                end.synchronize()
                times[name] = start.elapsed_time(end)
            except RuntimeError:
                times[name] = float("inf")
        return min(times, key=times.get)

    def baseline(self, inputs, dtype):
        if inputs.get("faster") == "grouped_mm":
            return self.second_baseline(inputs, dtype)
        return self._loop(inputs, dtype)

    def _loop(self, inputs, dtype):
        """A loop of cuBLAS products over the non-empty groups (torch.matmul for batched cases)."""
        a, b = inputs["a"], inputs["b"]
        if inputs["kind"] == "batched":
            if inputs["mode"] == "fwd":
                return torch.matmul(a, b)
            dy = inputs["dy"]
            return torch.cat([torch.matmul(dy, b.transpose(1, 2)).flatten(), torch.matmul(a.transpose(1, 2), dy)
                              .flatten()])
        bounds = inputs["bounds"]
        if inputs["mode"] == "fwd":
            out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
            for g, lo, hi in bounds:
                torch.mm(a[lo:hi], b[g], out=out[lo:hi])
            return out
        dy = inputs["dy"]
        ga = torch.zeros_like(a)
        gb = torch.zeros_like(b)
        for g, lo, hi in bounds:
            torch.mm(dy[lo:hi], b[g].T, out=ga[lo:hi])
            torch.mm(a[lo:hi].T, dy[lo:hi], out=gb[g])
        return torch.cat([ga.flatten(), gb.flatten()])

    def second_baseline_reason(self, device):
        if device != "cuda":
            return "torch.nn.functional.grouped_mm runs on CUDA only"
        if not hasattr(torch.nn.functional, "grouped_mm"):
            return "this torch has no torch.nn.functional.grouped_mm"
        return None

    def second_baseline(self, inputs, dtype):
        F = torch.nn.functional
        a, b, offs = inputs["a"], inputs["b"], inputs.get("offs")
        if inputs["mode"] == "fwd":
            return F.grouped_mm(a, b, offs=offs)
        dy = inputs["dy"]
        return torch.cat([F.grouped_mm(dy, b.transpose(-2, -1), offs=offs).flatten(),
                          F.grouped_mm(a.transpose(-2, -1), dy, offs=offs).flatten()])

    def baseline_context(self, dtype):
        return _Tf32Mode(dtype == "tf32")

    def overhead_probe(self, device):
        """(tilegemm's call, the baseline's) on a tiny decode step (:data:`PROBE_SIZES`: 8 rows over 16 experts,
        K 256, N 128, bf16), as the runner's host-time probe asks; tilegemm's calls after the first are replays.
        The baseline is F.grouped_mm (a loop of torch.mm over the non-empty groups where it cannot run)."""
        if device != "cuda":
            return None
        gen = torch.Generator(device=device).manual_seed(SEED)
        E, K, N = len(PROBE_SIZES), 256, 128
        x = torch.randn(sum(PROBE_SIZES), K, device=device, dtype=torch.bfloat16, generator=gen)
        weight = torch.randn(E, N, K, device=device, dtype=torch.bfloat16, generator=gen) / math.sqrt(K)
        ends = torch.tensor(PROBE_SIZES).cumsum(0)
        offs = ends.to(device=device, dtype=torch.int32)
        if self.int4:
            w4 = quantize(weight, group_size=128)
            b = dequantize(w4).transpose(1, 2)
            ours = lambda: grouped_matmul(x, w4, offs)  # noqa: E731
        else:
            b = weight.transpose(1, 2)  # [E, K, N] read in place, experts stored [E, N, K]
            ours = lambda: grouped_mm(x, b, offs=offs)  # noqa: E731
        if self.second_baseline_reason(device) is None:
            theirs = lambda: torch.nn.functional.grouped_mm(x, b, offs=offs)  # noqa: E731
            try:
                theirs()
                return ours, theirs
            except RuntimeError:  # (a GPU or layout torch's kernel does not take)
                pass
        bounds = [(g, int(hi) - n, int(hi)) for g, (n, hi) in enumerate(zip(PROBE_SIZES, ends)) if n]

        def loop():
            out = torch.zeros(x.shape[0], N, dtype=x.dtype, device=device)
            for g, lo, hi in bounds:
                torch.mm(x[lo:hi], b[g], out=out[lo:hi])
            return out

        return ours, loop

    def work(self, case, dtype, options):
        G, M, N, K, sizes = self._dims(case)
        flops = 2.0 * M * N * K * (G if sizes is None else 1)
        return flops * (2 if self._mode(options) == "bwd" else 1)

    def tolerance(self, dtype):
        return tolerance(self.dtypes[dtype], self._precision(dtype))


class GroupedW4A16Bench(GroupedBench):
    """4-bit experts (``tilegemm.w4a16.grouped_matmul``, group 128) on the MoE products, forward only, against the
    16-bit baselines on the dequantized weight (the reference multiplies the dequantized weight too)."""

    name = "grouped_w4a16"
    int4 = True
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    sweeps = {"moe": _moe_cases, "tiny": lambda: _tiny_cases()[:3]}
    options = ()
    shape_help = "E,TOPK,HIDDEN,INTERMEDIATE,TOKENS,gate_up|down (e.g. 8,2,4096,14336,1,gate_up)"
    models = {"qwen3_moe": "tilegemm.models.bench:MoEInt4Bench", "mixtral": "tilegemm.models.bench:MixtralInt4Bench"}

    @staticmethod
    def _mode(options) -> str:
        return "fwd"

    def parse_shape(self, text):
        case = super().parse_shape(text)
        if case.dims["kind"] != 0:
            raise BenchError(f"malformed grouped_w4a16 shape {text!r}: expected {self.shape_help}")
        K = self._dims(case)[3]  # the product's K: HIDDEN for gate_up, INTERMEDIATE for down
        if K % 8:
            what = "HIDDEN" if case.dims["product"] == 0 else "INTERMEDIATE"
            raise BenchError(f"malformed grouped_w4a16 shape {text!r}: {what} = {K} is the product's K, which 4-bit "
                             f"weights need a multiple of 8")
        return case


class _Tf32Mode:
    """cuBLAS (and tilegemm's fp32 default) in tf32 for the ``tf32`` dtype only."""

    def __init__(self, allow: bool):
        self.allow = allow

    def __enter__(self):
        self.old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if self.allow else "highest")

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.old)
