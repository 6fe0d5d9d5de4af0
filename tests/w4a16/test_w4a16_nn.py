"""tilegemm.nn: Int4Linear as a drop-in nn.Linear, its state_dict, and quantize_ on a small model."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from conftest import assert_rel_close

from tilegemm import w4a16
from tilegemm.nn import Int4Linear, quantize_


def test_from_linear_forward(device):
    lin = nn.Linear(128, 40, dtype=torch.float16, device=device)
    q = Int4Linear.from_linear(lin, group_size=64)
    x = torch.randn(2, 3, 128, dtype=torch.float16, device=device)
    ref = x.double() @ q.dequantize().double().T + lin.bias.double()
    assert_rel_close(q(x), ref, 2e-3)
    # close to the float layer too (4-bit error only)
    assert_rel_close(q(x), lin(x).double(), 0.2)
    assert "group_size=64" in repr(q)


def test_state_dict_round_trip_and_save(device):
    lin = nn.Linear(256, 24, bias=False, dtype=torch.bfloat16, device=device)
    q = Int4Linear.from_linear(lin, group_size=128)
    fresh = Int4Linear(256, 24, bias=False, group_size=32, dtype=torch.bfloat16, device=device)
    fresh.load_state_dict(q.state_dict())  # another group size: shapes come from the checkpoint
    assert fresh.group_size == 128
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=device)
    assert torch.equal(fresh(x), q(x))
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    again = Int4Linear(256, 24, bias=False, dtype=torch.bfloat16, device=device)
    again.load_state_dict(torch.load(buf))
    assert torch.equal(again(x), q(x))


def test_act_order_state_dict(device):
    from test_w4a16_import import random_gptq

    qweight, qzeros, scales, g_idx = random_gptq(16, 128, 32, act_order=True)
    q = Int4Linear.from_gptq(qweight, qzeros, scales, g_idx).to(device)
    assert q.perm.numel() == 128
    plain = Int4Linear(128, 16, bias=False, group_size=32, device=device)
    plain.load_state_dict(q.state_dict())
    x = torch.randn(2, 128, dtype=torch.float16, device=device)
    assert torch.equal(plain(x), q(x))
    assert_rel_close(q(x), x.double() @ q.dequantize().double().T, 2e-3)


def test_quantize_model_in_place(device):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 10)).half().to(device)
    x = torch.randn(4, 64, dtype=torch.float16, device=device)
    before = model(x).double()
    out = quantize_(model, group_size=32, filter=lambda name, m: m.out_features != 10)
    assert out is model
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], Int4Linear)
    assert type(model[3]) is nn.Linear
    after = model(x)
    assert_rel_close(after, before, 0.25)
    sd = model.state_dict()
    assert "0.qweight" in sd and "3.weight" in sd


def test_quantize_takes_transformers_conv1d(device):
    # GPT-2's Conv1D (x @ W + b, W [in, out]) becomes the Int4Linear of W's transpose
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(96, 64), nn.ReLU(), Conv1D(64, 96)).half().to(device)
    original = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    x = torch.randn(2, 3, 64, dtype=torch.float16, device=device)
    quantize_(model, group_size=32)
    assert isinstance(model[0], Int4Linear) and (model[0].in_features, model[0].out_features) == (64, 96)
    for layer, w in zip((model[0], model[2]), original):  # 4-bit round-to-nearest of the [in, out] weight
        assert_rel_close(layer.dequantize().T, w, 0.15)
    ref = torch.relu(x.double() @ model[0].dequantize().double().T + model[0].bias.double())
    ref = ref @ model[2].dequantize().double().T + model[2].bias.double()
    assert_rel_close(model(x), ref, 2e-3)


def test_bad_construction_is_named():
    # torch.zeros raised for these, naming neither argument (a RuntimeError for a negative size)
    with pytest.raises(ValueError, match="Int4Linear's in_features must be >= 0, got -8"):
        Int4Linear(-8, 16)
    with pytest.raises(TypeError, match="Int4Linear's out_features must be an int, got float 16.0"):
        Int4Linear(64, 16.0)
    with pytest.raises(TypeError, match="Int4Linear's in_features must be an int, got str"):
        Int4Linear("64", 16)
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16), 32)
    # from_weight: a tensor raised AttributeError, stacked experts "too many values to unpack", a list bias
    # AttributeError, and a bias of the wrong length was taken (refused only at the first forward)
    with pytest.raises(TypeError, match="from_weight takes an Int4Weight .* got Tensor"):
        Int4Linear.from_weight(torch.randn(16, 64))
    with pytest.raises(ValueError, match=r"got stacked experts \[2, 16, 64\]"):
        Int4Linear.from_weight(w4a16.quantize(torch.randn(2, 16, 64, dtype=torch.float16), 32))
    with pytest.raises(TypeError, match="bias must be a torch.Tensor or None, got list"):
        Int4Linear.from_weight(w, [0.0] * 16)
    with pytest.raises(ValueError, match=r"bias must have shape \[out_features\] = \[16\], got \[3\]"):
        Int4Linear.from_weight(w, torch.zeros(3))


def test_from_linear_rejects_other_modules():
    with pytest.raises(TypeError, match="nn.Linear"):
        Int4Linear.from_linear(nn.Conv1d(8, 8, 1))
    with pytest.raises(ValueError, match="not divisible"):
        Int4Linear.from_linear(nn.Linear(96, 8).half(), group_size=64)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_the_backward_keeps_only_what_it_reads(activation, device):
    # as torch's Linear: without an activation x and the bias are not kept (a residual's h += layer(h), a bias
    # written in place, or an input made under inference_mode is no autograd error), a bias alone to train keeps
    # nothing; with one, the recompute keeps x and bias (torch's would keep its output)
    torch.manual_seed(0)
    lin = Int4Linear.from_linear(nn.Linear(64, 64, dtype=torch.float16), group_size=32).to(device)
    x = torch.randn(4, 64, dtype=torch.float16, device=device, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        h = x * 1
        y = lin(h) if activation is None else w4a16.matmul(h, lin.weight, bias=lin.bias, activation=activation)
    assert (x.shape in [t.shape for t in kept]) == (activation is not None)
    if activation is None:
        w = w4a16.dequantize(lin.weight).double()
        h += y  # in place, after the call
        (gx,) = torch.autograd.grad(h.float().sum(), x)
        assert_rel_close(gx, 1 + torch.ones(4, 64, dtype=torch.float64, device=device) @ w, 2e-3)
        lin.bias.requires_grad_(True)
        with torch.inference_mode():
            xi = torch.randn(4, 64, dtype=torch.float16, device=device)
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = lin(xi)
        (gb,) = torch.autograd.grad(out.float().sum(), lin.bias)
        assert kept == [] and torch.equal(gb, torch.full_like(gb, 4.0))
