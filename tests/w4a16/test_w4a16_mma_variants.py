"""Every option of the mma kernel (unpacking by reshape, gather or eight per-nibble dots; 16-bit dequantization
by conversion or the magic exponent; weights as the first operand or the second; split-K) computes
``x @ dequantize(w).T``, with groups shorter than a K step too; and the launch-config rules keep their promises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tilegemm
from tilegemm.core.runtime import interpreting, new_output
from tilegemm.ops.w4a16 import configs, mma
from tilegemm.ops.w4a16.problem import W4A16Problem

from conftest import assert_rel_close

VARIANTS = [
    dict(UNPACK="reshape", DEQ16="magic"), dict(UNPACK="gather", DEQ16="magic", SWAP=False),
    dict(UNPACK="perm", DEQ16="magic"), dict(UNPACK="perm", DEQ16="cvt", SWAP=False, SPLIT_K=3),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("dtype, group", [(torch.float16, 64), (torch.float16, -1), (torch.bfloat16, 32)])
def test_mma_variants(variant, dtype, group, device):
    N, K, M = 72, 384, 17
    w = tilegemm.w4a16.quantize(torch.randn(N, K, device=device, dtype=dtype), group)
    x = torch.randn(M, K, device=device, dtype=dtype)
    out = new_output((M, N), x.dtype, x.device)
    p = W4A16Problem(x, w.qweight, w.scales, w.zeros, None, out, w.group_k, "none",
                     upcast=dtype == torch.bfloat16 and interpreting())
    cfg = {**dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, SPLIT_K=2, SWAP=True, num_warps=4,
                  num_stages=2), **variant}
    mma.run(p, cfg)
    ref = x.double() @ tilegemm.w4a16.dequantize(w).double().T
    assert_rel_close(out, ref.to(out.dtype), 2e-3 if dtype == torch.float16 else 1e-2)


@settings(max_examples=200, deadline=None)
@given(tiles=st.integers(1, 5000), steps=st.integers(1, 2000), capacity=st.integers(1, 2000),
       min_steps=st.integers(1, 4))
def test_split_within(tiles, steps, capacity, min_steps):
    split = configs.split_within(tiles, steps, capacity, min_steps)
    assert split >= 1 and split & (split - 1) == 0  # a power of two
    if split > 1:
        assert tiles * split <= capacity and steps // split >= min_steps
    # the next power of two would break one of the two bounds
    assert tiles * split * 2 > capacity or steps // (2 * split) < min_steps


def test_gemv_config_fills_one_wave(monkeypatch):
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    for N, K in ((4096, 4096), (8192, 8192), (14336, 4096), (28672, 8192), (5000, 3000)):
        cfg = configs.gemv_config(1, N, K, "cuda")
        tiles = -(-N // cfg["BLOCK_N"])
        assert cfg["BLOCK_N"] == (128 if N >= configs.GEMV_WIDE_N else 64)
        assert tiles * cfg["SPLIT_K"] <= configs.GEMV_PROGRAMS_PER_SM * 132 or cfg["SPLIT_K"] == 1


def test_perm_needs_steps_of_128(device):
    w = tilegemm.w4a16.quantize(torch.randn(32, 256, device=device, dtype=torch.float16), 64)
    x = torch.randn(2, 256, device=device, dtype=torch.float16)
    p = W4A16Problem(x, w.qweight, w.scales, w.zeros, None, new_output((2, 32), x.dtype, x.device), w.group_k,
                     "none", upcast=False)
    with pytest.raises(ValueError, match="BLOCK_K >= 128"):
        mma.run(p, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, UNPACK="perm", num_warps=4,
                        num_stages=2))
