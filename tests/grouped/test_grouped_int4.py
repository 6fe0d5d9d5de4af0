"""4-bit experts: quantize of an [E, N, K] weight, and w4a16.grouped_matmul against the dequantized weight."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.grouped.api import moe_gate_up_int4
from tilegemm.ops.grouped.op import forward_int4, grouped_w4a16_op
from tilegemm.ops.grouped.reference import grouped_mm_reference
from tilegemm.core.activations import torch_activation

from conftest import assert_rel_close

O = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


def experts(E=4, N=24, K=64, group_size=32, dtype=torch.float16, device="cpu"):
    return tilegemm.w4a16.quantize(torch.randn(E, N, K, device=device).to(dtype), group_size=group_size)


def reference(x, w, offs, bias=None, activation="none"):
    ref = grouped_mm_reference(x, tilegemm.w4a16.dequantize(w).transpose(1, 2), offs, bias=bias)
    return torch_activation(ref, activation)  # (rows past offs[-1] stay 0: every activation keeps 0 at 0)


def test_quantize_stacks_experts_like_one_at_a_time():
    w = torch.randn(3, 16, 64, dtype=torch.float16)
    stacked = tilegemm.w4a16.quantize(w, group_size=32)
    assert stacked.shape == (3, 16, 64)
    assert tuple(stacked.qweight.shape) == (3, 8, 16) and tuple(stacked.scales.shape) == (3, 2, 16)
    for e in range(3):
        alone = tilegemm.w4a16.quantize(w[e], group_size=32)
        assert torch.equal(stacked.expert(e).qweight, alone.qweight)
        assert torch.equal(tilegemm.w4a16.dequantize(stacked)[e], tilegemm.w4a16.dequantize(alone))
    again = tilegemm.w4a16.Int4Weight.from_state_dict(stacked.state_dict())
    assert again.shape == stacked.shape and torch.equal(again.qweight, stacked.qweight)


@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("sizes", [[5, 0, 12, 9], [0, 0, 0, 1], [17, 0, 0, 0]])
def test_grouped_matmul(group_size, sizes, device):
    w = experts(group_size=group_size, device=device)
    x = torch.randn(sum(sizes) + 3, 64, device=device, dtype=torch.float16)
    offs = torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    out = tilegemm.w4a16.grouped_matmul(x, w, offs)
    assert_rel_close(out, reference(x, w, offs), 4e-3)
    assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))


@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize("activation", ["none", "silu", "gelu"])
def test_bias_and_activation(per_expert, activation, device):
    w = experts(N=40, device=device)
    x = torch.randn(21, 64, device=device, dtype=torch.float16)
    offs = O(4, 4, 15, 21).to(device)
    bias = torch.randn(4, 40, device=device).half() if per_expert else torch.randn(40, device=device).half()
    out = tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation=activation)
    assert_rel_close(out, reference(x, w, offs, bias, activation), 4e-3)



def test_negative_views_are_read_as_their_values(device):
    # a contiguous negative view (torch._neg_view) holds its values negated in memory: read as such, x flipped sign
    w = experts(device=device)
    x, offs = torch.randn(21, 64, device=device, dtype=torch.float16), O(4, 4, 15, 21).to(device)
    bias = torch.randn(4, 24, device=device).half()
    xn, bn = torch._neg_view(x.neg()), torch._neg_view(bias.neg())
    assert xn.is_neg() and torch.equal(xn, x)
    assert_rel_close(tilegemm.w4a16.grouped_matmul(xn, w, offs, bias=bn), reference(x, w, offs, bias), 4e-3)


def test_bf16(device):
    w = experts(dtype=torch.bfloat16, device=device)
    x = torch.randn(19, 64, device=device, dtype=torch.bfloat16)
    offs = O(3, 10, 10, 19).to(device)
    assert_rel_close(tilegemm.w4a16.grouped_matmul(x, w, offs), reference(x, w, offs), 2.5e-2)
    bias = torch.randn(4, 24, device=device, dtype=torch.bfloat16)  # x's dtype: taken
    out = tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation="silu")
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, reference(x, w, offs, bias, "silu"), 2.5e-2)


def test_gated_product_fuses_activation_and_gate(device):
    # the MoE gate/up product: rows [0, N) gate, [N, 2N) up; out = silu(gate) * up
    w = experts(N=32, device=device)
    x = torch.randn(14, 64, device=device, dtype=torch.float16)
    offs = O(6, 6, 9, 14).to(device)
    out = forward_int4(x, w.qweight, w.scales, w.zeros, offs, None, w.group_k, "silu", True, "auto")
    full = reference(x, w, offs).float()
    want = torch.nn.functional.silu(full[:, :16]) * full[:, 16:]
    assert_rel_close(out, want, 4e-3)


def test_gradients_of_x_and_bias(device):
    w = experts(N=16, device=device)
    x = torch.randn(12, 64, device=device, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(4, 16, device=device, dtype=torch.float16, requires_grad=True)
    offs = O(3, 3, 8, 12).to(device)
    out = tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation="gelu")
    grad = torch.randn_like(out)
    gx, gb = torch.autograd.grad(out, (x, bias), grad)
    x64, b64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = reference(x64, w, offs, b64, "gelu")
    wx, wb = torch.autograd.grad(ref, (x64, b64), grad.double())
    assert_rel_close(gx, wx, 1e-2)
    assert_rel_close(gb, wb, 1e-2)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_double_backward_through_the_activation(gated, device):
    # create_graph=True: x's gradient was cut from x (the recomputed pre-activation detached), so a second
    # derivative failed with torch's "does not require grad"; now it matches the float64 one
    w = tilegemm.w4a16.quantize(torch.randn(4, 16, 64, device=device).half() / 4, group_size=32)
    offs = O(0, 3, 3, 7).to(device)
    x0 = torch.randn(9, 64, device=device, dtype=torch.float16) / 4  # rows 7.. past offs[-1]
    b0 = torch.randn(4, 16, device=device, dtype=torch.float16)
    vx = torch.randn_like(x0)

    def second_order(fn, x, bias):
        (gx,) = torch.autograd.grad(fn(x, bias).float().pow(2).sum(), x, create_graph=True)
        return (gx,) + torch.autograd.grad((gx.float() * vx.to(gx.dtype)).sum(), (x, bias))

    if gated:
        ours = lambda x, bias: moe_gate_up_int4(x, w, offs, bias, "silu")  # noqa: E731

        def ref(x, bias):
            pre = grouped_mm_reference(x, tilegemm.w4a16.dequantize(w).double().transpose(1, 2), offs, bias=bias)
            return torch.nn.functional.silu(pre[:, :8]) * pre[:, 8:]
    else:
        ours = lambda x, bias: tilegemm.w4a16.grouped_matmul(x, w, offs, bias=bias, activation="silu")  # noqa: E731
        ref = lambda x, bias: reference(x, w, offs, bias, "silu")  # noqa: E731
    got = second_order(ours, x0.clone().requires_grad_(), b0.clone().requires_grad_())
    want = second_order(ref, x0.double().requires_grad_(), b0.double().requires_grad_())
    for g, r in zip(got, want):
        assert_rel_close(g.detach(), r.detach(), 5e-3)


def test_opcheck(device):
    w = experts(N=16, device=device)
    x = torch.randn(9, 64, device=device, dtype=torch.float16)
    torch.library.opcheck(grouped_w4a16_op, (x, w.qweight, w.scales, w.zeros, O(2, 2, 5, 9).to(device), None,
                                             w.group_k, "none", False, "auto"))


CASES = [
    ("2-D weight", lambda w, x, o: tilegemm.w4a16.grouped_matmul(
        x, tilegemm.w4a16.quantize(torch.randn(8, 64).half(), 32), o), ValueError, "stacked experts"),
    ("stacked weight to w4a16.matmul", lambda w, x, o: tilegemm.w4a16.matmul(x, w), ValueError, "grouped_matmul"),
    ("not an Int4Weight", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, torch.randn(4, 24, 64), o), TypeError,
     "Int4Weight"),
    ("fp32 x", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x.float(), w, o), TypeError, "fp16 or bf16"),
    ("bf16 x, fp16 scales", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x.bfloat16(), w, o), TypeError,
     "scales are fp16"),
    ("K mismatch", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x[:, :32], w, o), ValueError, "K = 64"),
    ("offs length", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, w, o[:3]), ValueError, "3 entries"),
    ("offs None", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, w, None), ValueError, "offs is required"),
    ("sparse x", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x.to_sparse(), w, o), TypeError,
     "x is a tensor of layout torch.sparse_coo"),
    ("bias shape", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, w, o, bias=torch.randn(3).half()), ValueError,
     "bias must have shape"),
    ("activation", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, w, o, activation="tanhh"), ValueError,
     "unknown activation"),
    # the output is x's dtype: a bias of another is refused, naming both
    ("bf16 bias, fp16 x", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, w, o, bias=torch.randn(24).bfloat16()),
     TypeError, r"bias has dtype bf16; expected x's dtype, fp16 \(the output's\)$"),
    ("fp32 bias [E, N], fp16 x", lambda w, x, o: tilegemm.w4a16.grouped_matmul(x, w, o, bias=torch.randn(4, 24)),
     TypeError, r"bias has dtype fp32; expected x's dtype, fp16 \(the output's\)$"),
    ("bf16 bias, gated", lambda w, x, o: moe_gate_up_int4(x, w, o, bias=torch.randn(24).bfloat16()), TypeError,
     r"bias has dtype bf16; expected x's dtype, fp16"),
    # zero points are whole numbers: the 16-bit kernels would round a fraction away, off from dequantize
    ("fractional zeros", lambda w, x, o: tilegemm.w4a16.grouped_matmul(
        x, tilegemm.w4a16.Int4Weight(w.qweight, w.scales, w.zeros + 0.25, w.group_size, w.shape), o), ValueError,
     r"zeros must be whole numbers \(the 4-bit zero points, held as floats\), got \d+\.25 at \[0, 0, 0\]"),
]


@pytest.mark.parametrize("fn, err, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(fn, err, text):
    w = experts()
    with pytest.raises(err, match=text):
        fn(w, torch.randn(10, 64).half(), O(2, 4, 6, 10))
