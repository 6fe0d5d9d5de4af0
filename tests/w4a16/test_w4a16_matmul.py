"""tilegemm.w4a16.matmul against x.double() @ dequantize(w).double().T, every kernel, odd shapes, errors,
the torch.library op (opcheck, autograd)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel_close, crossed

import tilegemm
from tilegemm import w4a16
from tilegemm.ops.w4a16.reference import reference
from tilegemm.core import registry
from tilegemm.core.activations import torch_activation as reference_activation
from tilegemm.core.dtypes import dtype_name

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
KERNELS = [name for name in tilegemm.kernels("w4a16")]  # the registered ones, then auto


def test_registered():
    assert {"gemv", "mma", "dequant_cublas", "auto"} <= set(KERNELS)


@crossed("dtype, M, kernel", [torch.float16, torch.bfloat16], [1, 3, 17], KERNELS, ids=(lambda d: str(d)[6:],))
def test_kernels(device, kernel, M, dtype):
    N, K = 72, 256  # N not a multiple of the blocks; K split into several slices
    w = w4a16.quantize(torch.randn(N, K, dtype=dtype, device=device), 64)
    x = torch.randn(M, K, dtype=dtype, device=device)
    reason = kernel != "auto" and registry.get("w4a16", kernel).unavailable_reason()
    if reason:  # e.g. a Gluon kernel under the interpreter: refused by name, with the reason
        with pytest.raises(registry.NotApplicable, match=kernel):
            w4a16.matmul(x, w, kernel=kernel)
        return
    assert_rel_close(w4a16.matmul(x, w, kernel=kernel), reference(x, w), TOL[dtype])


@pytest.mark.parametrize("group_size", [32, 128, 256, -1])
def test_group_sizes(device, group_size):
    w = w4a16.quantize(torch.randn(40, 512, dtype=torch.float16, device=device), group_size)
    for M in (1, 5):
        x = torch.randn(M, 512, dtype=torch.float16, device=device)
        assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)


def test_whole_k_group_with_k_not_a_block_multiple(device):
    # group_size -1 with K = 200: the last K step is partial (masked)
    w = w4a16.quantize(torch.randn(16, 200, dtype=torch.float16, device=device), -1)
    for kernel in ("gemv", "mma"):
        for M in (1, 4):
            x = torch.randn(M, 200, dtype=torch.float16, device=device)
            assert_rel_close(w4a16.matmul(x, w, kernel=kernel), reference(x, w), 2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["gemv", "mma", "dequant_cublas", "auto"])
def test_bias_activation_and_batch(device, kernel, dtype):
    w = w4a16.quantize(torch.randn(64, 128, dtype=dtype, device=device), 128)
    bias = torch.randn(64, dtype=dtype, device=device)
    x = torch.randn(2, 3, 128, dtype=dtype, device=device)  # any leading shape
    for activation in ("silu", "relu"):
        out = w4a16.matmul(x, w, bias=bias, activation=activation, kernel=kernel)
        assert out.shape == (2, 3, 64) and out.dtype == dtype
        assert_rel_close(out, reference(x, w, bias, activation), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bias_of_another_dtype_than_x(device, dtype):
    # the output is x's dtype: a bias of the other 16-bit dtype (or fp32) is refused, naming both dtypes
    w = w4a16.quantize(torch.randn(32, 64, dtype=dtype, device=device), 32)
    x = torch.randn(3, 64, dtype=dtype, device=device)
    own = dtype_name(dtype)
    for other in (torch.bfloat16 if dtype == torch.float16 else torch.float16, torch.float32):
        bias = torch.randn(32, dtype=other, device=device)
        message = f"bias has dtype {dtype_name(other)}; expected x's dtype, {own} (the output's)"
        for kernel in ("gemv", "mma", "auto"):
            with pytest.raises(TypeError, match=re.escape(message)):
                w4a16.matmul(x, w, bias=bias, kernel=kernel)
        with pytest.raises(TypeError, match=re.escape(message)):  # [..., K] activations: the same check
            w4a16.matmul(x[None], w, bias)
    with pytest.raises(TypeError, match=f"bias has dtype int64; expected x's dtype, {own}"):
        w4a16.matmul(x, w, bias=torch.zeros(32, dtype=torch.int64, device=device))


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_bias(device, kernel):
    # a bias viewed with stride 2: every kernel reads its own elements, called twice (a replay on the GPU) and
    # through the op itself
    if kernel != "auto" and registry.get("w4a16", kernel).unavailable_reason():
        pytest.skip(f"{kernel} does not run here (test_kernels checks its refusal)")
    w = w4a16.quantize(torch.randn(24, 64, dtype=torch.float16, device=device), 32)
    bias = torch.randn(48, dtype=torch.float16, device=device)[::2]
    for M in (1, 5, 5):
        x = torch.randn(M, 64, dtype=torch.float16, device=device)
        assert_rel_close(w4a16.matmul(x, w, bias, kernel=kernel), reference(x, w, bias), 2e-3)
    fweight, fzs = w.fragments() if kernel.startswith("frag") else (None, None)
    out = torch.ops.tilegemm.w4a16_matmul(x, w.qweight, w.scales, w.zeros, fweight, fzs, bias, w.group_k, "none",
                                          kernel)
    assert_rel_close(out, reference(x, w, bias), 2e-3)


def test_strided_x_and_one_dim(device):
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    big = torch.randn(5, 256, dtype=torch.float16, device=device)
    x = big[:, ::2]  # stride 2 along K
    assert_rel_close(w4a16.matmul(x, w), reference(x, w), 2e-3)
    v = torch.randn(128, dtype=torch.float16, device=device)
    assert w4a16.matmul(v, w).shape == (32,)
    assert w4a16.matmul(torch.empty(0, 128, dtype=torch.float16, device=device), w).shape == (0, 32)



def test_negative_views_are_read_as_their_values(device):
    # a negative view (torch._neg_view; z.conj().imag is one) holds its values negated in memory, a bit torch's ops
    # resolve: the kernels read the memory, and a contiguous x or bias came out with its sign flipped
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    x = torch.randn(3, 128, dtype=torch.float16, device=device)
    bias = torch.randn(32, dtype=torch.float16, device=device)
    xn, bn = torch._neg_view(x.neg()), torch._neg_view(bias.neg())
    assert xn.is_neg() and xn.is_contiguous() and torch.equal(xn, x)
    assert_rel_close(w4a16.matmul(xn, w, bn), reference(x, w, bias), 2e-3)
    out = torch.ops.tilegemm.w4a16_matmul(xn, w.qweight, w.scales, w.zeros, None, None, bn, w.group_k, "none", "auto")
    assert_rel_close(out, reference(x, w, bias), 2e-3)


def test_kernels_agree_with_split_k(device):
    # large enough K for several slices under the interpreter's 4 "SMs"; gemv and mma see the same weight
    w = w4a16.quantize(torch.randn(48, 1024, dtype=torch.float16, device=device), 128)
    x = torch.randn(2, 1024, dtype=torch.float16, device=device)
    ref = reference(x, w)
    for kernel in ("gemv", "mma"):
        assert_rel_close(w4a16.matmul(x, w, kernel=kernel), ref, 2e-3)


def test_errors(device):
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    x = torch.randn(2, 128, dtype=torch.float16, device=device)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        w4a16.matmul(x.float(), w)
    with pytest.raises(TypeError, match="scales are"):
        w4a16.matmul(x.bfloat16(), w)
    with pytest.raises(ValueError, match="K = in_features = 128"):
        w4a16.matmul(torch.randn(2, 64, dtype=torch.float16, device=device), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        w4a16.matmul(x, w, bias=torch.zeros(31, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="unknown activation"):
        w4a16.matmul(x, w, activation="swish")
    with pytest.raises(ValueError, match="unknown w4a16 kernel"):
        w4a16.matmul(x, w, kernel="marlin")
    with pytest.raises(TypeError, match="w4a16 kernel must be a str, one of: gemv"):
        w4a16.matmul(x, w, kernel=1)
    with pytest.raises(TypeError, match="Int4Weight"):
        w4a16.matmul(x, torch.zeros(32, 128))
    with pytest.raises(TypeError, match="x is a tensor of layout torch.sparse_coo"):  # (it reached torch's copy)
        w4a16.matmul(x.to_sparse(), w)
    with pytest.raises(TypeError, match="bias is a tensor of layout torch.sparse_coo"):
        w4a16.matmul(x, w, bias=torch.zeros(32, dtype=torch.float16, device=device).to_sparse())


def test_opcheck(device):
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    x = torch.randn(3, 128, dtype=torch.float16, device=device)
    bias = torch.randn(32, dtype=torch.float16, device=device)
    for fw, fzs in ((None, None), w.fragments()):  # with and without the fragment layout
        torch.library.opcheck(torch.ops.tilegemm.w4a16_matmul.default,
                              (x, w.qweight, w.scales, w.zeros, fw, fzs, bias, w.group_k, "silu", "auto"),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_autograd_x_and_bias(device):
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16, device=device), 32)
    x = torch.randn(3, 64, dtype=torch.float16, device=device, requires_grad=True)
    bias = torch.randn(16, dtype=torch.float16, device=device, requires_grad=True)
    out = w4a16.matmul(x, w, bias=bias, activation="relu")
    g = torch.randn_like(out)
    out.backward(g)
    xd = x.detach().double().requires_grad_(True)
    bd = bias.detach().double().requires_grad_(True)
    ref = F.relu(xd @ w4a16.dequantize(w).double().T + bd)
    ref.backward(g.double())
    assert_rel_close(x.grad, xd.grad, 5e-3)
    assert_rel_close(bias.grad, bd.grad, 5e-3)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_double_backward_through_the_activation(activation, device):
    # create_graph=True: x's gradient was cut from x (the recomputed pre-activation detached), so a second
    # derivative failed with torch's "does not require grad"; now it matches the float64 one
    w = w4a16.quantize(torch.randn(16, 64, dtype=torch.float16, device=device) / 4, 32)
    x0 = torch.randn(3, 64, dtype=torch.float16, device=device) / 4
    b0 = torch.randn(16, dtype=torch.float16, device=device)
    vx = torch.randn_like(x0)

    def second_order(fn, x, bias):
        (gx,) = torch.autograd.grad(fn(x, bias).float().pow(2).sum(), x, create_graph=True)
        return (gx,) + torch.autograd.grad((gx.float() * vx.to(gx.dtype)).sum(), (x, bias))

    got = second_order(lambda x, bias: w4a16.matmul(x, w, bias=bias, activation=activation),
                       x0.clone().requires_grad_(), b0.clone().requires_grad_())
    wd = w4a16.dequantize(w).double()
    want = second_order(lambda x, bias: reference_activation(x @ wd.T + bias, activation),
                        x0.double().requires_grad_(), b0.double().requires_grad_())
    for g, r in zip(got, want):
        assert_rel_close(g.detach(), r.detach(), 5e-3)


def test_compile_fullgraph(device):
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    x = torch.randn(2, 128, dtype=torch.float16, device=device)

    def f(x):
        return w4a16.matmul(x, w, activation="silu") * 2

    try:
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        out = compiled(x)
    except Exception as exc:  # noqa: BLE001 - a CPU torch without a working compiler
        if "compile" in type(exc).__name__.lower() and "Unsupported" not in type(exc).__name__:
            pytest.skip(f"torch.compile unavailable here: {exc}")
        raise
    assert_rel_close(out, reference(x, w, activation="silu") * 2, 2e-3)


@pytest.mark.parametrize("hopper", [False, True])
def test_export_with_a_dynamic_batch(device, hopper, monkeypatch):
    """auto's fragment-kernel rows (M <= 128, 512) are not compared while tracing: a traced M was guarded on, so
    torch.export refused a batch dim above 128 and torch.compile recompiled across 128 and 512 where the fragment
    kernel runs (Hopper; ``hopper``: simulated here, the kernel then picked by M when the op runs), and a weight
    without its fragments made was packed inside the graph. One graph for every M, no packing traced."""
    from tilegemm.ops.w4a16 import dispatch

    if hopper and not dispatch.frag_usable(64, torch.device(device), 128):
        choose = dispatch.choose
        monkeypatch.setattr(dispatch, "frag_usable", lambda *a, **k: True)
        monkeypatch.setattr(dispatch, "choose", lambda M, frag=False, N=None: choose(M, False, N))
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    if hopper:
        bare = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)

        class Bare(torch.nn.Module):
            def forward(self, x):
                return w4a16.matmul(x, bare)

        ep = torch.export.export(Bare(), (torch.randn(3, 128, dtype=torch.float16, device=device),),
                                 dynamic_shapes=({0: torch.export.Dim("batch", max=4096)},))
        assert bare._frag is None  # not packed by the trace (nor a traced tensor left in it)
        assert len([n for n in ep.graph.nodes if n.op == "call_function"]) <= 4  # the product, no packing
        w.fragments()  # as Int4Linear keeps them where the kernel runs
        graphs = []
        compiled = torch.compile(lambda x: w4a16.matmul(x, w),
                                 backend=lambda gm, _: graphs.append(gm) or gm.forward)
        torch._dynamo.reset()
        with torch.no_grad():
            for m in (5, 129, 513, 3):
                x = torch.randn(m, 128, dtype=torch.float16, device=device)
                torch._dynamo.mark_dynamic(x, 0)  # (a serving step's token count)
                assert_rel_close(compiled(x), reference(x, w), 2e-3)
        assert len(graphs) == 1
        torch._dynamo.reset()

    class M(torch.nn.Module):
        def forward(self, x):
            return w4a16.matmul(x, w)

    batch = torch.export.Dim("batch", max=4096)
    x = torch.randn(5, 128, dtype=torch.float16, device=device)
    for module in (M(), tilegemm.nn.Int4Linear.from_weight(w)):
        ep = torch.export.export(module, (torch.randn(3, 128, dtype=torch.float16, device=device),),
                                 dynamic_shapes=({0: batch},))
        with torch.no_grad():
            assert_rel_close(ep.module()(x), reference(x, w), 2e-3)


@pytest.mark.parametrize("rows_n", [True, False])
@pytest.mark.parametrize("N, K, group_size", [(200, 512, 64), (17, 256, 128), (136, 96, 32)])
def test_dequant_kernel_both_layouts(device, rows_n, N, K, group_size):
    from tilegemm.ops.w4a16.dequant_cublas import dequantize_w

    w = w4a16.quantize(torch.randn(N, K, dtype=torch.float16, device=device), group_size)
    got = dequantize_w(w.qweight, w.scales, w.zeros, w.group_k, rows_n=rows_n, block_r=4, block_n=64)
    want = w4a16.dequantize(w)
    assert torch.equal(got, want if rows_n else want.T)


def test_compiled_with_every_size_dynamic(device):
    # torch.compile(dynamic=True) of a function holding an Int4Weight: the weight's sizes are traced too, and its
    # group length (K / groups) reached the checks as a SymInt, refused as "group_k must be ... got s22"
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: w4a16.matmul(x, w), dynamic=True, backend="eager")
    with torch.no_grad():
        for m in (5, 9, 300):
            x = torch.randn(m, 128, dtype=torch.float16, device=device)
            assert_rel_close(compiled(x), reference(x, w), 2e-3)
    torch._dynamo.reset()


def test_a_named_fragment_kernel_is_traced_only_with_its_layout_made(device, monkeypatch):
    # no graph packs the layout: a kernel that reads it, named while torch.compile traces a weight without it, is
    # refused saying what to do (it failed deep in the op's fake check), and nothing is packed
    from tilegemm.core import registry

    spec = registry.get("w4a16", "frag_wgmma")
    if spec.unavailable_reason() is not None:  # (elsewhere than Hopper: as there, the check after it)
        monkeypatch.setattr(type(spec), "unavailable_reason", lambda self: None)
    w = w4a16.quantize(torch.randn(32, 128, dtype=torch.float16, device=device), 64)
    x = torch.randn(4, 128, dtype=torch.float16, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: w4a16.matmul(t, w, kernel="frag_wgmma"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"kernel='frag_wgmma' reads the weight's fragment layout, which a traced "
                                        r"graph does not make: make it before compiling"):
        compiled(x)
    assert w._frag is None
    torch._dynamo.reset()
