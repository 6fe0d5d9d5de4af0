"""Act-order 4-bit experts (GPTQ desc_act: each expert's inputs stored in its own order, ``perm`` ``[E, K]``): the
stacked format, ``group_columns`` (each expert's rows read through its order) and the grouped products on them,
against the dequantized weights; the sharding that cannot take them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import tilegemm
from tilegemm.core.runtime import interpreting
from tilegemm.ops.grouped.api import grouped_matmul, moe_gate_up_int4
from tilegemm.ops.grouped.routing import group_columns
from tilegemm.ops.w4a16 import Int4Weight, dequantize, quantize
from tilegemm.ops.w4a16.format import concat_outputs, stack_experts

from test_grouped_int4 import reference
from conftest import assert_rel_close

O = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


def act_order(w: Int4Weight, perm: torch.Tensor | None) -> Int4Weight:
    """``w``'s stored rows read as inputs ``perm`` (what from_gptq makes of an act-order checkpoint)."""
    return Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, perm)


def act_order_experts(E=3, N=24, K=64, group_size=32, dtype=torch.float16, device="cpu", identity=(1,)):
    ws = [act_order(quantize(torch.randn(N, K).to(dtype), group_size),
                    None if e in identity else torch.randperm(K)) for e in range(E)]
    return stack_experts(ws).to(device)


def columns_reference(x, offs, perm):
    out = x.clone()
    lo = 0
    for g, hi in enumerate(offs.tolist()):
        out[lo:hi] = x[lo:hi][:, perm[g]]
        lo = hi
    return out


def test_stacked_format_keeps_each_experts_order():
    w = act_order_experts()
    assert w.perm.shape == (3, 64) and w.perm.dtype == torch.int64
    assert torch.equal(w.perm[1], torch.arange(64))  # an expert without an order: the identity
    for e in range(3):
        assert torch.equal(dequantize(w)[e], dequantize(w.expert(e)))
        assert torch.equal(w.expert(e).perm, w.perm[e])
    again = Int4Weight.from_state_dict(w.state_dict())
    assert torch.equal(again.perm, w.perm)
    with pytest.raises(ValueError, match=r"perm must be int64 \[3, 64\]"):
        Int4Weight(w.qweight, w.scales, w.zeros, 32, w.shape, w.perm[0])


def test_concat_outputs_needs_one_order():
    a, b = quantize(torch.randn(16, 64), 32), quantize(torch.randn(16, 64), 32)
    p = torch.randperm(64)
    joined = concat_outputs([act_order(a, p), act_order(b, p)])
    assert torch.equal(joined.perm, p)
    assert torch.equal(dequantize(joined), torch.cat([dequantize(act_order(a, p)), dequantize(act_order(b, p))]))
    ident = concat_outputs([act_order(a, torch.arange(64)), b])  # None reads as the identity
    assert torch.equal(dequantize(ident), torch.cat([dequantize(a), dequantize(b)]))
    with pytest.raises(ValueError, match="act-order input permutation differs"):
        concat_outputs([act_order(a, p), act_order(b, torch.randperm(64))])
    with pytest.raises(ValueError, match="act-order input permutation differs"):
        concat_outputs([act_order(a, p), b])


@pytest.mark.parametrize("sizes,tail", [([3, 0, 9, 4], 5), ([0, 0, 0, 0], 3), ([40, 1, 0, 20], 0)])
def test_group_columns(sizes, tail, device):
    E, K = 4, 200  # K past one program's columns
    x = torch.randn(sum(sizes) + tail, K, device=device)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    perm = torch.stack([torch.randperm(K) for _ in range(E)]).to(device)
    out = group_columns(x, offs, perm)
    assert torch.equal(out, columns_reference(x, offs.cpu(), perm))
    if tail:
        assert torch.equal(out[-tail:], x[-tail:])  # rows past offs[-1] as they are


def test_group_columns_launches_under_the_interpreters_lock(monkeypatch, device):
    # under the interpreter every launch holds one lock (threads' launches interleaved raised InterpreterErrors)
    import contextlib

    from tilegemm.ops.grouped import routing

    held = []

    @contextlib.contextmanager
    def one_launch():
        held.append(True)
        yield

    monkeypatch.setattr(routing, "_one_launch", one_launch)
    x, offs = torch.randn(5, 16, device=device), torch.tensor([2, 5], dtype=torch.int32, device=device)
    routing.columns(x, offs, torch.stack([torch.randperm(16) for _ in range(2)]).to(device))
    assert held == [True]


def test_group_columns_strided_x_and_gradient(device):
    E, K = 3, 48
    x = torch.randn(K, 11, device=device).t().requires_grad_()  # [11, 48], columns strided
    offs = O(4, 4, 9).to(device)
    perm = torch.stack([torch.randperm(K) for _ in range(E)]).to(device)
    out = group_columns(x, offs, perm)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    x2 = x.detach().clone().requires_grad_()
    (gx2,) = torch.autograd.grad(columns_reference(x2, offs.cpu(), perm), x2, g)
    assert torch.equal(out.detach(), columns_reference(x.detach(), offs.cpu(), perm))
    assert torch.equal(gx, gx2)


def test_group_columns_opcheck(device):
    x = torch.randn(7, 16, device=device, requires_grad=True)
    perm = torch.stack([torch.randperm(16) for _ in range(2)]).to(device)
    torch.library.opcheck(torch.ops.tilegemm.group_columns.default, (x, O(3, 6).to(device), perm))


# offs' and perm's values are checked on CPU tensors only (on the GPU reading them would stall the host; the kernel
# reads an entry of perm outside 0..K-1 as zero, test_kernel_reads_perm_outside_the_row_as_zero), and a GPU machine
# refuses CPU tensors before that check: those cases are the interpreter's
CPU_VALUES = pytest.mark.skipif(not interpreting(), reason="offs' and perm's values are checked on CPU tensors only, "
                                "which a GPU machine refuses first")


def here(args, device):
    """``args`` where kernels run (a tensor on meta stays there)."""
    return tuple(t.to(device) if t.device.type == "cpu" else t for t in args)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 8), O(2, 4), torch.zeros(2, 8, dtype=torch.int64)[0]), r"perm \[E, K\]"),
    ((torch.zeros(4, 8), O(2, 4), torch.zeros(3, 8, dtype=torch.int64)), r"perm must be \[E, K\] = \[2, 8\]"),
    ((torch.zeros(4, 8), O(2, 4), torch.zeros(2, 8, dtype=torch.int32)), "int64"),
    ((torch.zeros(4, 8), O(2, 4).long(), torch.zeros(2, 8, dtype=torch.int64)), "int32"),
    # values, checked on the CPU (an entry past K read outside x's row; a repeat gave a wrong gradient)
    pytest.param((torch.zeros(4, 8), O(2, 4), torch.arange(8).repeat(2, 1) + 100), "permutation of 0..7",
                 marks=CPU_VALUES),
    pytest.param((torch.zeros(4, 8), O(2, 4), torch.zeros(2, 8, dtype=torch.int64)), "permutation of 0..7",
                 marks=CPU_VALUES),
    pytest.param((torch.zeros(4, 8), O(3, 1), torch.arange(8).repeat(2, 1)), "non-decreasing", marks=CPU_VALUES),
    pytest.param((torch.zeros(4, 8), O(2, 5), torch.arange(8).repeat(2, 1)), r"past the end .* x\.shape\[0\] = 4",
                 marks=CPU_VALUES),
])
def test_group_columns_refuses(args, match, device):
    with pytest.raises((ValueError, TypeError), match=match):
        group_columns(*here(args, device))


@pytest.mark.parametrize("args,error,match", [
    ((torch.zeros(4, 8), O(2, 4), torch.zeros(3, 8, dtype=torch.int64)), ValueError, r"perm must be \[E, K\] = \[2, 8\]"),
    ((torch.zeros(4, 8), O(2, 4), torch.arange(6).repeat(2, 1)), ValueError, r"perm must be \[E, K\] = \[2, 8\]"),
    ((torch.zeros(4, 8), O(2, 4), torch.arange(8, dtype=torch.int32).repeat(2, 1)), TypeError, "perm int64"),
    ((torch.zeros(4, 8), O(2, 4).long(), torch.arange(8).repeat(2, 1)), TypeError, "offs must be int32"),
    ((torch.zeros(4, 8), O(2, 4), torch.arange(8).repeat(2, 1).to("meta")), ValueError, "different devices"),
    pytest.param((torch.zeros(4, 8), O(2, 4), torch.arange(8).repeat(2, 1) + 100), ValueError, "permutation of 0..7",
                 marks=CPU_VALUES),
    pytest.param((torch.zeros(4, 8), O(3, 1), torch.arange(8).repeat(2, 1)), ValueError, "non-decreasing",
                 marks=CPU_VALUES),
    pytest.param((torch.zeros(4, 8), O(2, 5), torch.arange(8).repeat(2, 1)), ValueError,
                 r"past the end .* x\.shape\[0\] = 4", marks=CPU_VALUES),
])
def test_the_registered_op_checks_its_arguments(args, error, match, device):
    # torch.ops.tilegemm.group_columns called directly gets group_columns' checks, not a launch that reads
    # outside x's rows (perm of another K, offs past M) or a perm of the wrong length
    with pytest.raises(error, match=match):
        torch.ops.tilegemm.group_columns(*here(args, device))


def test_kernel_reads_perm_outside_the_row_as_zero(device):
    # perm's values are checked on the CPU only; the kernel itself must not read outside x's row (it crashed the
    # process): run in a child so a fault fails this test rather than the runner
    code = textwrap.dedent(f"""
        import torch
        from tilegemm.ops.grouped.routing import columns
        x = torch.arange(1., 33.).view(4, 8).to("{device}")
        perm = torch.arange(8).repeat(2, 1)
        perm[0, 1], perm[1, 2] = 1 << 40, -3
        out = columns(x, torch.tensor([2, 4], dtype=torch.int32).to("{device}"), perm.to("{device}")).cpu()
        want = x.cpu().clone()
        want[:2, 1] = 0
        want[2:, 2] = 0
        assert torch.equal(out, want), out
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_the_registered_op_checks_traced_shapes():
    # the fake checks too: a traced call with mismatched shapes fails at the trace, values unread
    x = torch.zeros(4, 8, device="meta")
    with pytest.raises(ValueError, match=r"perm must be \[E, K\] = \[2, 8\]"):
        torch.ops.tilegemm.group_columns(x, O(2, 4).to("meta"), torch.zeros(2, 6, dtype=torch.int64, device="meta"))
    out = torch.ops.tilegemm.group_columns(x, O(2, 4).to("meta"), torch.zeros(2, 8, dtype=torch.int64, device="meta"))
    assert out.shape == (4, 8) and out.device.type == "meta"


@pytest.mark.parametrize("sizes", [[3, 0, 9], [0, 14, 1]])
def test_grouped_matmul_act_order(sizes, device):
    w = act_order_experts(device=device)
    x = torch.randn(sum(sizes) + 2, 64, dtype=torch.float16, device=device)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    out = grouped_matmul(x, w, offs)
    assert_rel_close(out, reference(x, w, offs), 2e-3)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_gated_act_order_and_gradient(device):
    w = act_order_experts(N=48, device=device, identity=())
    x = torch.randn(12, 64, dtype=torch.float16, device=device, requires_grad=True)
    offs = O(5, 5, 12).to(device)
    out = moe_gate_up_int4(x, w, offs, activation="silu")
    pre = reference(x.detach(), w, offs).float()
    want = torch.nn.functional.silu(pre[:, :24]) * pre[:, 24:]
    assert_rel_close(out, want.to(out.dtype), 2e-3)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    x32 = x.detach().float().requires_grad_()
    wt = dequantize(w).float()
    rows = [x32[a:b] @ wt[e].T for e, (a, b) in enumerate(zip([0, 5, 5], [5, 5, 12]))]
    pre32 = torch.cat(rows)
    y = torch.nn.functional.silu(pre32[:, :24]) * pre32[:, 24:]
    (gx32,) = torch.autograd.grad(y, x32, g.float())
    assert_rel_close(gx, gx32.to(gx.dtype), 5e-3)


def test_public_name():
    assert tilegemm.w4a16.grouped_matmul is grouped_matmul
