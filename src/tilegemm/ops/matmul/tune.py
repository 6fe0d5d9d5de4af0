"""``tilegemm tune --op matmul``: run each shape once through the tuned kernels, so their configs are timed
and kept in the tuning cache (:mod:`tilegemm.core.tuning`)."""

from __future__ import annotations

import torch

from tilegemm.core.runtime import interpreting

TUNABLE = ("autotuned", "persistent_tma", "split_k", "gluon_f16", "gluon_fp8", "gluon_tf32")


def tune(bench, cases, dtype: str, kernels) -> None:
    """Call ``tilegemm.matmul`` once per case and kernel (``auto`` tunes what it would pick)."""
    from tilegemm.ops.matmul.api import matmul

    device = "cpu" if interpreting() else "cuda"
    fp8 = dtype.startswith("fp8")
    precision = "tf32" if dtype == "tf32" else "ieee"
    for case in cases:
        inputs = bench.prepare(case, dtype, device, 1, {}).sets[0]
        for kernel in kernels:
            if fp8:
                matmul(inputs["a"], inputs["b"], kernel=kernel, scale_a=inputs["scale_a"], scale_b=inputs["scale_b"],
                       out_dtype=torch.bfloat16)
            else:
                matmul(inputs["a"], inputs["b"], kernel=kernel, precision=precision)
        del inputs
