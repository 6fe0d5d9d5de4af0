"""``tilegemm tune --op matmul``: run each shape once through the tuned kernels, so their configs are timed
and kept in the tuning cache (:mod:`tilegemm.core.tuning`). ``tilegemm warmup --op matmul``: compile the kernel
variant of every known shape class ahead of time, so a first call finds it in Triton's disk cache."""

from __future__ import annotations

import torch

from tilegemm.core import registry, tuning
from tilegemm.core.runtime import interpreting
from tilegemm.ops.matmul import api
from tilegemm.ops.matmul.op import REPLAYS

def tune(bench, cases, dtype: str, kernels) -> None:
    """Call ``tilegemm.matmul`` once per case and kernel, as the bench calls it (``auto`` tunes what it would
    pick)."""
    device = "cpu" if interpreting() else "cuda"
    for case in cases:
        inputs = bench.prepare(case, dtype, device, 1, {}).sets[0]
        for kernel in kernels:
            bench.run(kernel, inputs, dtype)
        del inputs


_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def warmup(on_key=None, cases=None, dtype: str | None = None) -> list[str]:
    """Call every kernel that has a known config (shipped or tuned, this GPU) once on random data of its shape
    class (M at its bucket), so Triton compiles the variant and keeps it on disk. Returns the keys warmed;
    ``on_key(key)`` is called before each. Entries of ``auto`` and layouts with no unit stride are skipped.

    With ``cases`` (bench cases, e.g. a model's shapes given as ``tilegemm warmup --shape``), instead call
    ``auto`` once on each in ``dtype`` (default fp16), so what it picks for exactly those shapes, untimed, is
    compiled; returns ``"auto|MxNxK|dtype"`` labels."""
    device = "cpu" if interpreting() else "cuda"
    if cases is not None:
        from tilegemm.ops.matmul.bench import MatmulBench

        return _warm_cases(MatmulBench(), cases, dtype or "fp16", on_key)
    names = {s.name for s in registry.specs("matmul") if s.unavailable_reason() is None}
    warmed = []
    for key in sorted(tuning.entries()):
        parsed = tuning.parse_key(key)  # None for a batched class (|B..): not warmed, it has no 2-D problem here
        if parsed is None or parsed[0] not in names or len(parsed[6]) != 2 or set(parsed[6]) - set("NT"):
            continue
        rung, M, N, K, dtype, out, layout = parsed
        label, _, fast = dtype.partition("+")
        a_name, _, b_name = label.partition("x")
        if a_name not in _TORCH or (b_name or a_name) not in _TORCH or out not in _TORCH:
            continue
        if on_key is not None:
            on_key(key)

        def operand(rows, cols, transposed, name):
            t = torch.randn(cols, rows, device=device) if transposed else torch.randn(rows, cols, device=device)
            t = t.to(_TORCH[name])
            return t.T if transposed else t

        a = operand(M, K, layout[0] == "T", a_name)
        b = operand(K, N, layout[1] == "T", b_name or a_name)
        if a_name.startswith("fp8"):
            one = torch.ones((), device=device)
            api.matmul(a, b, kernel=rung, scale_a=one, scale_b=one, out_dtype=_TORCH[out], fast_accum=bool(fast))
        else:
            api.matmul(a, b, kernel=rung, out_dtype=_TORCH[out], precision="tf32" if label == "tf32" else "ieee")
        warmed.append(key)
        del a, b
        REPLAYS.clear()  # the compiled kernel is what warmup is for; the replays need not stay
    return warmed


def _warm_cases(bench, cases, dtype: str, on_key) -> list[str]:
    """``auto`` once on each case (:func:`tune`'s call), then its replays dropped."""
    warmed = []
    for case in cases:
        label = f"auto|{case.label}|{dtype}"
        if on_key is not None:
            on_key(label)
        tune(bench, [case], dtype, ["auto"])
        warmed.append(label)
        REPLAYS.clear()
    return warmed
