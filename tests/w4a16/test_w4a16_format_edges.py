"""Edges of the 4-bit format found by comparing with an fp64 product: weights whose quantized values overflow the
scales' dtype are refused (never an inf weight), dtype conversions that overflow the scales or the weights they
make are refused, ``half()`` / ``bfloat16()`` convert like ``to(dtype)``, and ``to`` takes ``Tensor.to``'s arguments."""

from __future__ import annotations

import pytest
import torch

from tilegemm import w4a16


@pytest.mark.parametrize("weight", [
    torch.full((8, 64), 1e5),  # fp32 past fp16's range: scale 6667 is finite, 15 * 6667 is not
    torch.cat([torch.full((8, 32), 7e4), torch.full((8, 32), -1.0)], 1),
])
def test_fp32_weight_past_fp16_range_is_refused(weight):
    with pytest.raises(ValueError, match="overflow to inf"):
        w4a16.quantize(weight, 32)
    w = w4a16.quantize(weight.bfloat16(), 32)  # what the message suggests: finite
    assert bool(torch.isfinite(w4a16.dequantize(w)).all())


def test_fp32_weight_near_fp16_limit_that_fits_is_taken():
    W = torch.cat([torch.full((8, 32), 6e4), torch.full((8, 32), -6e4)], 1)
    w = w4a16.quantize(W, -1)
    d = w4a16.dequantize(w)
    assert bool(torch.isfinite(d).all()) and float((d.float() - W).abs().max()) <= 0.51 * float(w.scales.max())


def test_conversion_that_overflows_the_scales_is_refused():
    w = w4a16.quantize(torch.full((8, 64), 1e30, dtype=torch.bfloat16), 32)
    with pytest.raises(ValueError, match="scales converted to fp16 has non-finite"):
        w.to(torch.float16)
    with pytest.raises(ValueError, match="non-finite"):
        w.half()


@pytest.mark.parametrize("stacked", [False, True])
def test_conversion_whose_weights_pass_fp16s_range_is_refused(stacked):
    # scales of 1.3e4 fit fp16 but 15 steps of them do not: dequantize gave inf, gemv finite numbers, mma NaN
    W = torch.cat([torch.full((8, 32), 2e5), torch.full((8, 32), -1.0)], 1).bfloat16()
    w = w4a16.quantize(torch.stack([W / 1e5, W]) if stacked else W, 32)
    assert bool(torch.isfinite(w.scales.half()).all())
    with pytest.raises(ValueError, match="dequantized values pass fp16's range"):
        w.half()
    with pytest.raises(ValueError, match="dequantized values pass fp16's range"):
        w.to(torch.float16)


def test_conversion_reads_the_values_where_the_scales_alone_would_overflow():
    # every q is 8 and every zero 0: 8 * 6144 fits fp16 though 15 * 6144 would not (taken), 8 * 9216 does not
    from tilegemm.ops.w4a16.format import Int4Weight, pack_rows

    qweight = pack_rows(torch.full((64, 16), 8))
    zeros = torch.zeros(2, 16, dtype=torch.bfloat16)
    w = Int4Weight(qweight, torch.full((2, 16), 6144.0, dtype=torch.bfloat16), zeros, 32, (16, 64))
    h = w.half()
    assert torch.equal(w4a16.dequantize(h).float(), torch.full((16, 64), 49152.0))
    w = Int4Weight(qweight, torch.full((2, 16), 9216.0, dtype=torch.bfloat16), zeros, 32, (16, 64))
    with pytest.raises(ValueError, match="dequantized values pass fp16's range"):
        w.half()


def test_half_and_bfloat16(device):
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16, device=device), 32)
    b = w.bfloat16()
    assert b.dtype == torch.bfloat16 and b.zeros.dtype == torch.bfloat16 and b.qweight is w.qweight
    h = b.half()
    assert h.dtype == torch.float16 and torch.equal(h.zeros, w.zeros)
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=device)
    ref = x.double() @ w4a16.dequantize(b).double().T
    out = w4a16.matmul(x.half(), h).double()
    assert float((out - x.half().double() @ w4a16.dequantize(h).double().T).abs().max()) < 2e-3 * float(ref.abs().max())


def test_to_takes_tensor_to_arguments_and_refuses_unknown_keywords():
    # copy=True was ignored (the result shared the parts), and a misspelt keyword did nothing
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16), 32)
    assert w.to("cpu").qweight is w.qweight
    for c in (w.to("cpu", copy=True), w.to(copy=True), w.to(torch.float16, False, True)):
        assert all(getattr(c, n).data_ptr() != getattr(w, n).data_ptr() for n in ("qweight", "scales", "zeros"))
        assert torch.equal(w4a16.dequantize(c), w4a16.dequantize(w))
    assert w.to(dtype=torch.bfloat16, non_blocking=True).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="unexpected keyword argument 'devcie'"):
        w.to(devcie="meta")
    with pytest.raises(TypeError, match="at most two bools"):
        w.to(True, True, True)
