"""Every option of the gemv kernel (dequantization trick, prefetch, several rows, x in 16-byte rows, split-K)
computes ``x @ dequantize(w).T``: the variants ``tools/w4a16_gpu_check.py`` times, checked here first."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.core.runtime import new_output
from tilegemm.ops.w4a16 import gemv
from tilegemm.ops.w4a16.problem import W4A16Problem

from conftest import assert_rel_close

VARIANTS = [
    dict(DEQ="i2f"), dict(DEQ="magic"), dict(DEQ="exp16"), dict(DEQ="magic", PREFETCH=True),
    dict(DEQ="exp16", XVEC=True), dict(DEQ="magic", XVEC=True, PREFETCH=True, SPLIT_K=3),
    dict(DEQ="magic", ROWS=2), dict(DEQ="exp16", ROWS=4, SPLIT_K=2), dict(DEQ="exp16", STAGES=3, XVEC=True),
    dict(DEQ="magic", ROWS=2, STAGES=2, SPLIT_K=3),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_variants(variant, M, device):
    N, K, group = 40, 256, 64
    w = tilegemm.w4a16.quantize(torch.randn(N, K, device=device, dtype=torch.float16), group)
    x = torch.randn(M, K, device=device, dtype=torch.float16)
    out = new_output((M, N), x.dtype, x.device)
    p = W4A16Problem(x, w.qweight, w.scales, w.zeros, None, out, w.group_k, "none", upcast=False)
    cfg = {**dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=1), **variant}
    gemv.run(p, cfg)
    ref = x.double() @ tilegemm.w4a16.dequantize(w).double().T
    assert_rel_close(out, ref.to(out.dtype), 2e-3)
