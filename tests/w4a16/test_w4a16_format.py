"""The Int4Weight format: packing round trips (property tests), quantize/dequantize, moving and saving."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tilegemm import w4a16
from tilegemm.ops.w4a16.format import AWQ_ORDER, pack_cols, pack_rows, unpack_cols, unpack_rows


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_pack_rows_round_trip(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (8 * rows, n), generator=g)
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (rows, n)
    assert torch.equal(unpack_rows(packed).long(), q)
    # nibble i of word r is q[8r + i] (the documented layout, bit by bit)
    r, i, c = seed % rows, seed % 8, seed % n
    assert ((int(packed[r, c]) >> (4 * i)) & 15) == int(q[8 * r + i, c])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.booleans(), st.integers(0, 2**31 - 1))
def test_pack_cols_round_trip(rows, words, awq, seed):
    g = torch.Generator().manual_seed(seed)
    order = AWQ_ORDER if awq else tuple(range(8))
    q = torch.randint(0, 16, (rows, 8 * words), generator=g)
    packed = pack_cols(q, order)
    assert packed.shape == (rows, words)
    assert torch.equal(unpack_cols(packed, order).long(), q)
    r, i, c = seed % rows, seed % 8, seed % words
    assert ((int(packed[r, c]) >> (4 * i)) & 15) == int(q[r, 8 * c + order[i]])


@pytest.mark.parametrize("group_size", [32, 64, 128, 256, -1])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_error_bound(group_size, symmetric, dtype):
    N, K = 24, 512
    W = torch.randn(N, K, dtype=dtype)
    w = w4a16.quantize(W, group_size, symmetric)
    G = 1 if group_size == -1 else K // group_size
    assert w.qweight.shape == (K // 8, N) and w.scales.shape == (G, N) and w.zeros.shape == (G, N)
    assert w.scales.dtype == dtype and w.group_k == (K if group_size == -1 else group_size)
    q = unpack_rows(w.qweight)
    assert int(q.max()) <= 15
    d = w4a16.dequantize(w)
    assert d.shape == (N, K) and d.dtype == dtype
    # round to nearest: each weight is within half a step (plus the 16-bit roundings) of its value
    g = torch.arange(K) // w.group_k
    step = w.scales.float()[g].T  # [N, K]
    err = (d.float() - W.float()).abs()
    slack = 0.51 if not symmetric else 1.01  # symmetric clamps the one value -max/7 * 8 can't reach
    assert bool((err <= slack * step + 1e-2 * W.float().abs() + 1e-6).all())


@pytest.mark.parametrize("dtype, size", [(torch.bfloat16, 3.0), (torch.float16, 1.0), (torch.float16, 1e-6),
                                         (torch.float32, 1e-9)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_keeps_every_weight_within_half_a_step(dtype, size, symmetric):
    # the 16-bit scale is rounded up where rounding to nearest fell below the group's exact step: the extremes
    # were clamped past half a step (bf16 0.54 of a step, fp16's subnormal scales 2 steps); fp32 weights too small
    # for fp16 get the smallest scale, not 1
    torch.manual_seed(0)
    W = (torch.randn(33, 256) * torch.rand(33, 1) * size).to(dtype)
    w = w4a16.quantize(W, 32, symmetric)
    q = unpack_rows(w.qweight).T.float()
    g = torch.arange(256) // 32
    s, z = w.scales.float().T[:, g], w.zeros.float().T[:, g]
    err = ((q - z) * s - W.float()).abs()
    assert bool((err <= 0.5 * s * (1 + 1e-5)).all()), float((err / (0.5 * s)).max())
    if size < 1e-8:  # (fp16's smallest scale, 2**-24, not 1)
        assert float(w.scales.float().max()) < 1e-6


def test_quantize_exact_grid_and_zero_groups():
    # weights already on a 4-bit grid come back exactly; an all-zero group stays zero
    K = 128
    q = torch.randint(0, 16, (8, K)).float()
    W = ((q - 3) * 0.25).half()
    W[:, :64] = 0
    w = w4a16.quantize(W, 64)
    assert torch.equal(w4a16.dequantize(w), W)


def test_to_save_load_and_nbytes(tmp_path):
    W = torch.randn(16, 256, dtype=torch.float16)
    w = w4a16.quantize(W, 128)
    assert w.nbytes == 256 // 8 * 16 * 4 + 2 * (2 * 16 * 2)
    wb = w.to(torch.bfloat16)
    assert wb.scales.dtype == torch.bfloat16 and wb.qweight is w.qweight
    buf = io.BytesIO()
    torch.save({"w": w}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["w"]  # weights_only=True, torch's default
    assert torch.equal(w4a16.dequantize(loaded), w4a16.dequantize(w))
    again = w4a16.Int4Weight.from_state_dict(w.state_dict())
    assert torch.equal(w4a16.dequantize(again), w4a16.dequantize(w))
    assert "shape=[16, 256]" in repr(w)


def _with_perm(perm):
    # built (a weight may be made of buffers not loaded yet), refused by the product
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16), 32)
    w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape, perm=perm)
    return w4a16.matmul(torch.randn(2, 64, dtype=torch.float16), w)


def _experts_with_perm(perm):
    w = w4a16.quantize(torch.randn(2, 16, 64, dtype=torch.float16), 32)
    w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape, perm=perm)
    return w4a16.grouped_matmul(torch.randn(3, 64, dtype=torch.float16), w, torch.tensor([1, 3], dtype=torch.int32))


def _weight_with_perm(perm):
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16), 32)
    return w4a16.Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape, perm=perm)


@pytest.mark.parametrize("call, error, words", [
    (lambda: w4a16.quantize(torch.randn(8, 100, dtype=torch.float16)), ValueError, "multiple of 8"),
    (lambda: w4a16.quantize(torch.randn(8, 96, dtype=torch.float16), 64), ValueError, "not divisible"),
    (lambda: w4a16.quantize(torch.randn(8, 128, dtype=torch.float16), 48), ValueError, "group_size"),
    (lambda: w4a16.quantize(torch.randn(8, 128, dtype=torch.float16), True), ValueError, "group_size"),
    (lambda: w4a16.quantize(torch.randn(8, 128).double()), TypeError, "fp16, bf16 or fp32, got float64"),
    (lambda: w4a16.quantize(torch.randn(2, 2, 8, 128).half()), ValueError, "2-D"),
    (lambda: w4a16.quantize(torch.full((8, 128), float("inf")).half()), ValueError, "non-finite"),
    (lambda: w4a16.dequantize(torch.zeros(3)), TypeError, "Int4Weight"),
    (lambda: w4a16.quantize(torch.randn(8, 128).half().to_sparse()), TypeError, "weight is a tensor of layout "
                                                                                 "torch.sparse_coo"),
    (lambda: w4a16.quantize(torch.randn(8, 128).half(), 32, "yes"), TypeError, "symmetric must be True or False"),
    (lambda: w4a16.quantize(torch.randn(8, 128).half()).to(torch.float32), TypeError, "fp16 or bf16, not fp32"),
    (lambda: _with_perm(torch.full((64,), 1000)), ValueError, r"permutation of 0\.\.63 \(K = 64\) for each weight"),
    (lambda: _with_perm(torch.arange(64).roll(1).clamp(max=62)), ValueError, "permutation"),  # a repeat
    (lambda: _experts_with_perm(torch.stack([torch.randperm(64), torch.arange(64) % 63])), ValueError,
     "permutation of 0..63 .* for each expert"),
    # dequantize, the kernels' reference, checks perm as the products do (a repeat left rows unwritten)
    (lambda: w4a16.dequantize(_weight_with_perm(torch.zeros(64, dtype=torch.int64))), ValueError,
     r"permutation of 0\.\.63"),
    (lambda: w4a16.dequantize(_weight_with_perm(torch.arange(64) + 5)), ValueError, "permutation"),
    (lambda: w4a16.quantize(torch.randn(3, 16, 64).half(), 32).expert(3), ValueError,
     "expert 3 is out of range for 3 experts"),
    (lambda: w4a16.quantize(torch.randn(3, 16, 64).half(), 32).expert(1.0), TypeError,
     "expert.. takes an int index, got float"),
])
def test_errors(call, error, words):
    with pytest.raises(error, match=words):
        call()


def _parts(shape=(16, 64), group_size=32):
    w = w4a16.quantize(torch.randn(shape, dtype=torch.float16), group_size)
    return w.qweight, w.scales, w.zeros


def _built(qweight=None, scales=None, zeros=None, group_size=32, shape=(16, 64), perm=None, frag=None, stacked=False):
    # Int4Weight built by hand from a valid weight's parts with one of them replaced
    q, s, z = _parts((2, 16, 64) if stacked else (16, 64))
    return w4a16.Int4Weight(q if qweight is None else qweight, s if scales is None else scales,
                            z if zeros is None else zeros, group_size, shape, perm, frag)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(qweight=torch.zeros(8, 16, dtype=torch.int64)), TypeError, r"qweight must be int32 \[K/8, N\] = \[8, 16\]"),
    (dict(qweight=torch.zeros(16, 8, dtype=torch.int32)), ValueError, r"qweight must be int32 \[8, 16\].*got \[16, 8\]"),
    (dict(qweight=[[0] * 16] * 8), TypeError, "qweight must be a torch.Tensor, got list"),
    (dict(scales=torch.ones(2, 16)), TypeError, "scales must be fp16 or bf16, got fp32"),
    (dict(scales=torch.ones(1, 16, dtype=torch.float16)), ValueError, r"scales must be \[2, 16\] \(\[G, N\]\), got \[1, 16\]"),
    (dict(zeros=torch.zeros(2, 15, dtype=torch.float16)), ValueError, r"zeros must be \[2, 16\].*got \[2, 15\]"),
    (dict(zeros=torch.zeros(2, 16, dtype=torch.bfloat16)), TypeError, "must share a dtype"),
    (dict(group_size=48), ValueError, "group_size must be one of"),
    (dict(group_size=128, shape=(16, 96)), ValueError, "96 is not divisible by group_size = 128"),
    (dict(group_size=32.9), TypeError, "group_size must be an int, got float"),  # int() truncated it to 32
    (dict(group_size="32"), TypeError, "group_size must be an int, got str"),  # int() parsed it
    (dict(shape=(16.5, 64)), TypeError, "shape must be an int, got float"),
    (dict(shape=16), TypeError, r"shape must be \(N, K\) or \(E, N, K\)"),
    (dict(shape=(-16, 64)), ValueError, "shape must be non-negative"),
    (dict(shape=(16, 128)), ValueError, r"qweight must be int32 \[16, 16\]"),  # parts against the declared shape
    (dict(perm=torch.arange(64, dtype=torch.int32)), TypeError, r"perm must be int64 \[64\], got int32"),
    (dict(perm=torch.arange(63)), ValueError, r"perm must be int64 \[64\], got torch.int64 \[63\]"),
    (dict(perm=torch.arange(64).tolist()), TypeError, "perm must be a torch.Tensor, got list"),
    (dict(perm=torch.arange(64, device="meta")), ValueError, "different devices"),
    (dict(scales=torch.ones(2, 16, dtype=torch.float16, device="meta")), ValueError, "different devices"),
    (dict(stacked=True, shape=(3, 16, 64)), ValueError, r"qweight must be int32 \[3, 8, 16\].*got \[2, 8, 16\]"),
    (dict(stacked=True, shape=(2, 16, 64), perm=torch.arange(64)), ValueError, r"perm must be int64 \[2, 64\]"),
    (dict(stacked=True, shape=(2, 16, 64), zeros=torch.zeros(2, 16, dtype=torch.float16)), ValueError,
     r"zeros must be \[2, 2, 16\]"),
    (dict(frag=torch.zeros(3)), TypeError, r"frag must be a pair of tensors"),
    (dict(frag=(torch.zeros(16, 2, 32, 4), torch.zeros(4, 16, 8, 4, dtype=torch.float16))), TypeError,
     "fweight must be int32"),
    (dict(frag=(torch.zeros(16, 1, 32, 4, dtype=torch.int32), torch.zeros(4, 16, 8, 4, dtype=torch.float16))),
     ValueError, r"fweight must be \[16, 2, 32, 4\] for a weight \[16, 64\] of group_size 32, got \[16, 1, 32, 4\]"),
    (dict(frag=(torch.zeros(16, 2, 32, 4, dtype=torch.int32), torch.zeros(2, 16, 8, 4, dtype=torch.float16))),
     ValueError, r"fzs must be \[4, 16, 8, 4\]"),
    (dict(frag=(torch.zeros(16, 2, 32, 4, dtype=torch.int32), torch.zeros(4, 16, 8, 4, dtype=torch.bfloat16))),
     TypeError, "fzs must be fp16, got bf16"),
])
def test_constructor_refuses_inconsistent_parts(kwargs, error, words):
    # a weight built by hand: each part checked against the others and the declared shape where it is built,
    # not read out of bounds (or its group size truncated) by a kernel later
    with pytest.raises(error, match=words):
        _built(**kwargs)


@pytest.mark.parametrize("shape, group_size", [((16, 64), 32), ((300, 200), -1), ((2, 24, 256), 128),
                                                ((40, 384), 64)])
def test_constructor_takes_its_own_fragments(shape, group_size):
    # fragment_shapes (what the constructor checks a given frag against) is what fragments() makes
    w = w4a16.quantize(torch.randn(shape, dtype=torch.float16), group_size)
    frag = w.fragments()
    assert tuple(tuple(t.shape) for t in frag) == w4a16.format.fragment_shapes(w.shape, w.group_k)
    again = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, group_size, w.shape, None, frag)
    assert again._frag is frag
    meta = w.to("meta")  # shapes only: a meta weight and its fragments' shapes pass the same checks
    w4a16.Int4Weight(meta.qweight, meta.scales, meta.zeros, group_size, torch.Size(shape), None,
                     tuple(t.to("meta") for t in frag))


@pytest.mark.parametrize("shape", [(2, 0, 64), (0, 8, 64), (2, 8, 0)])
def test_quantize_empty_experts(shape):
    # stacked experts with no experts, no rows or no inputs: empty parts of the stacked shapes
    w = w4a16.quantize(torch.randn(shape, dtype=torch.float16), 32)
    E, N, K = shape
    assert w.shape == shape and w.qweight.shape == (E, K // 8, N) and w.scales.shape == (E, K // 32, N)
    assert w4a16.dequantize(w).shape == shape


def _gptq_parts(K=64, N=16, G=2, device="cpu"):
    # random GPTQ v1 tensors: qweight [K/8, N], qzeros [G, N/8], scales [G, N]
    i32 = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32).to(device)  # noqa: E731
    return i32(K // 8, N), i32(G, N // 8), (torch.rand(G, N) + 0.1).half().to(device)


@pytest.mark.parametrize("importer", ["gptq", "awq", "compressed_tensors"])
def test_importers_name_scales_on_another_device(importer):
    # scales on the meta device beside CPU parts: the parts' devices named, not a .item() on a meta tensor
    q, z, s = _gptq_parts()
    s = s.to("meta")
    call = {"gptq": lambda: w4a16.from_gptq(q, z, s),
            "awq": lambda: w4a16.from_awq(torch.zeros(64, 2, dtype=torch.int32), z, s),
            "compressed_tensors": lambda: w4a16.from_compressed_tensors(q.T.contiguous(), s.T)}[importer]
    with pytest.raises(ValueError, match="different devices"):
        call()


def test_importers_take_meta_parts():
    # a checkpoint's tensors on the meta device (shapes only) import as a meta weight, as quantize's do
    q, z, s = _gptq_parts(device="meta")
    w = w4a16.from_gptq(q, z, s)
    assert w.device.type == "meta" and w.shape == (16, 64) and w.group_size == 32
    w = w4a16.from_compressed_tensors(q.T.contiguous(), s.T)
    assert w.device.type == "meta" and w.shape == (16, 64)


def test_gptq_meta_g_idx_is_refused():
    q, z, s = _gptq_parts()
    with pytest.raises(ValueError, match="g_idx is on the meta device"):
        w4a16.from_gptq(q, z, s, torch.zeros(64, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("importer", ["gptq", "compressed_tensors"])
def test_no_inputs_with_g_idx(importer, device):
    # K = 0 (a layer of no inputs): an empty g_idx is the natural order, as the import without one
    q, z, s = _gptq_parts(K=0, G=1, device=device)
    g_idx = torch.zeros(0, dtype=torch.int32, device=device)
    w = (w4a16.from_gptq(q, z, s, g_idx) if importer == "gptq" else
         w4a16.from_compressed_tensors(q.T.contiguous(), s.T, None, g_idx))
    assert w.shape == (16, 0) and w.perm is None
    assert w4a16.matmul(torch.randn(3, 0, dtype=torch.float16, device=device), w).abs().max() == 0


@pytest.mark.parametrize("d, error, words", [
    ([1, 2], TypeError, "from_state_dict takes a dict .*got list"),
    (None, TypeError, "from_state_dict takes a dict .*got NoneType"),
    ("qweight", TypeError, "got str"),
    (dict(scales=torch.ones(1)), ValueError, "has no qweight, zeros, group_size, shape"),
])
def test_from_state_dict_errors(d, error, words):
    with pytest.raises(error, match=words):
        w4a16.Int4Weight.from_state_dict(d)


def test_from_state_dict_names_a_missing_part():
    d = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16), 32).state_dict()
    del d["zeros"]
    with pytest.raises(ValueError, match=r"has no zeros \(it has qweight, scales, group_size, shape\)"):
        w4a16.Int4Weight.from_state_dict(d)


@pytest.mark.parametrize("group_size, kind", [(np.int64(64), "int64"), (torch.tensor(64), "Tensor"),
                                              (True, "bool"), ("64", "str")])
def test_a_listed_group_size_of_another_type_is_named_by_type(group_size, kind):
    # "must be one of 32, 64, ... got np.int64(64)" named a listed value as the problem
    with pytest.raises(ValueError, match=rf"got .*(64|True).*\({kind}, not a Python int\)"):
        w4a16.quantize(torch.randn(8, 128, dtype=torch.float16), group_size)
