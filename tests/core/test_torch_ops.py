"""The registered ops' lean autograd kernel (tilegemm.core.torch_ops): installed on every op, taken only by
calls that nothing needs to see, and the same answer as the custom op's own path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tilegemm
from tilegemm.core.torch_ops import _tensor_positions, lean_autograd, plain_args
from tilegemm.ops.conv2d import op as conv_op
from tilegemm.ops.grouped import routing
from tilegemm.ops.matmul import op as matmul_torch_op
from tilegemm.ops.w4a16 import op as w4a16_op


class PassThrough(TorchDispatchMode):
    """A mode that changes nothing: calls under it must take the custom op's own path."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", [conv_op._conv2d_op, conv_op._dgrad_op, conv_op._wgrad_op, matmul_torch_op.matmul_op,
                                w4a16_op._w4a16_op, routing.group_columns_op, routing.moe_route_op,
                                routing.moe_combine_op], ids=lambda o: o._name)
def test_every_op_has_the_lean_kernel(op):
    # False means torch's internals moved and compiled graphs pay the custom op's Python layers again
    assert getattr(op, "_tilegemm_lean_autograd", False)


def test_tensor_positions_come_from_the_schema():
    assert _tensor_positions(conv_op._conv2d_op._opoverload._schema) == (0, 1, 2)  # x, weight, bias (optional)
    assert _tensor_positions(conv_op._dgrad_op._opoverload._schema) == (0, 1)
    lib = torch.library.Library("tilegemm_test_positions", "FRAGMENT")
    lib.define("f(Tensor[] xs, int n) -> Tensor")
    assert _tensor_positions(torch.ops.tilegemm_test_positions.f.default._schema) is None  # a list: look at all


def test_plain_args():
    x, p = torch.randn(3), torch.nn.Parameter(torch.randn(3))
    assert plain_args((x, [1, 2], 3, "relu", None), (0, 4))
    assert not plain_args((x, p), (0, 1))  # grad mode on and a parameter: autograd must see it
    with torch.no_grad():
        assert plain_args((x, p), (0, 1))
    with torch.no_grad(), PassThrough():
        assert not plain_args((x,), (0,))

    class Sub(torch.Tensor):
        pass

    with torch.no_grad():
        assert not plain_args((x.as_subclass(Sub),), (0,))
        assert not plain_args((x, x.as_subclass(Sub)), (0, 1))
        assert plain_args((x, x.as_subclass(Sub)), (0,))  # only the positions asked about
        assert plain_args((x, None, 3), (0, 1))  # an optional tensor left out
        assert plain_args((x,), (0, 1))  # a trailing argument the dispatcher left at its default
    assert not plain_args((x, p, None), (0, 1, 2))


def test_an_op_with_a_tensor_list_keeps_its_own_kernel():
    @torch.library.custom_op("tilegemm_test_lean::stack_sum", mutates_args=())
    def stack_sum(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).sum(0)

    assert not lean_autograd(stack_sum)
    with torch.no_grad():
        torch.testing.assert_close(stack_sum([torch.ones(2), torch.ones(2)]), torch.full((2,), 2.0))


def test_conv2d_op_lean_and_full_paths_agree(device):
    x = torch.randn(2, 4, 7, 6, device=device)
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3, device=device))
    args = (x, w, None, [1, 1], [1, 1, 1, 1], [1, 1], 1, "relu", "ieee", "auto")
    with torch.no_grad():
        lean = torch.ops.tilegemm.conv2d.default(*args)
        with PassThrough():
            full = torch.ops.tilegemm.conv2d.default(*args)
    ref = torch.relu(torch.nn.functional.conv2d(x, w.detach(), padding=1))
    torch.testing.assert_close(lean, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    assert not lean.requires_grad
    out = torch.ops.tilegemm.conv2d.default(*args)  # grad mode: the custom op's kernel records the graph
    out.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


def test_matmul_under_no_grad_and_with_grad(device):
    a = torch.randn(17, 9, device=device)
    b = torch.nn.Parameter(torch.randn(9, 5, device=device))
    with torch.no_grad():
        y = tilegemm.nn.Linear(9, 5).to(device)(a)
    assert y.shape == (17, 5) and not y.requires_grad
    out = tilegemm.matmul(a, b, precision="ieee")
    out.sum().backward()
    torch.testing.assert_close(b.grad, a.sum(0)[:, None].expand(9, 5), rtol=1e-5, atol=1e-5)


def test_own_storage_outputs_takes_any_return_a_custom_op_may_have():
    """None (an op that only mutates), a tuple of tensors: views among them come back as no views."""
    from tilegemm.core.torch_ops import own_storage_outputs

    @torch.library.custom_op("tilegemm_test_own::fill_ones", mutates_args=("x",))
    def fill_ones(x: torch.Tensor) -> None:
        x.fill_(1)

    @torch.library.custom_op("tilegemm_test_own::pair", mutates_args=())
    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 2).reshape(1, -1).mT, x + 1  # a view, and a tensor of its own

    assert own_storage_outputs(fill_ones) and own_storage_outputs(pair)
    x = torch.zeros(3)
    assert fill_ones(x) is None and torch.equal(x, torch.ones(3))
    a, b = pair(x)
    assert a._base is None and b._base is None
    assert torch.equal(a, torch.full((3, 1), 2.0)) and torch.equal(b, torch.full((3,), 2.0))


def test_a_call_autograd_records_skips_the_custom_ops_own_kernel(device, monkeypatch):
    """Eager training: plain tensors requiring gradients take the recorded Function (no per-call filling of
    defaults from the schema, no redispatch), and give what the custom op's own kernel gives, gradients too."""
    import torch._library.utils as library_utils

    x = torch.randn(2, 4, 7, 6, device=device, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3, device=device))
    args = (x, w, None, [1, 1], [1, 1, 1, 1], [1, 1], 1, "relu", "ieee", "auto")  # out_dtype left at its default
    filled = []
    real = library_utils.fill_defaults
    monkeypatch.setattr(library_utils, "fill_defaults", lambda *a: filled.append(1) or real(*a))
    lean = torch.ops.tilegemm.conv2d.default(*args)
    assert not filled and type(lean.grad_fn).__name__.startswith("Recorded")
    assert lean._base is None  # its own storage: an in-place op after it is allowed
    gy = torch.randn_like(lean)
    lean_grads = torch.autograd.grad(lean, (x, w), gy)
    with PassThrough():
        full = torch.ops.tilegemm.conv2d.default(*args)
    assert filled  # the custom op's own kernel
    full_grads = torch.autograd.grad(full, (x, w), gy)
    torch.testing.assert_close(lean, full, rtol=0, atol=0)
    for a, b in zip(lean_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_func_transforms_keep_the_custom_op_s_own_kernel():
    """Inside torch.func's transforms a call is not a plain recorded one: the Function of recorded calls would be
    dispatched from inside an autograd kernel, which functorch cannot take."""
    from tilegemm.core.torch_ops import grad_only_args

    t = torch.randn(3, requires_grad=True)
    assert grad_only_args((t,), (0,))
    seen = []

    def f(x):
        seen.append(grad_only_args((x,), (0,)))
        return (x * x).sum()

    torch.func.grad(f)(torch.randn(3))
    assert seen == [False]


def _outputs(dev):
    """(name, a call) of the public ops whose results came back as views of a kernel's buffer: a conv2d's 1x1 GEMM
    result reshaped, its channels-last output permuted, W4A16's and the Linear's rows unflattened."""
    wq = tilegemm.w4a16.quantize(torch.randn(16, 32, device=dev, dtype=torch.float16), group_size=32)
    lin = tilegemm.nn.Linear(16, 8).to(dev)
    x = torch.randn(2, 4, 5, 5, device=dev)
    return [
        ("conv2d 1x1", lambda: tilegemm.conv2d(x, torch.randn(4, 4, 1, 1, device=dev))),
        ("conv2d channels-last", lambda: tilegemm.conv2d(x.contiguous(memory_format=torch.channels_last),
                                                         torch.randn(4, 4, 3, 3, device=dev))),
        ("w4a16 3-D", lambda: tilegemm.w4a16.matmul(torch.randn(2, 3, 32, device=dev, dtype=torch.float16), wq)),
        ("w4a16 1-D", lambda: tilegemm.w4a16.matmul(torch.randn(32, device=dev, dtype=torch.float16), wq)),
        ("Linear 3-D", lambda: lin(torch.randn(2, 3, 16, device=dev))),
        ("matmul 3-D", lambda: tilegemm.matmul(torch.randn(2, 3, 16, device=dev), torch.randn(16, 8, device=dev))),
        ("matmul 2-D @ 1-D", lambda: tilegemm.matmul(torch.randn(5, 16, device=dev), torch.randn(16, device=dev))),
        ("matmul 1-D @ 3-D", lambda: tilegemm.matmul(torch.randn(16, device=dev), torch.randn(2, 16, 3, device=dev))),
        ("matmul 1-D @ 1-D", lambda: tilegemm.matmul(torch.randn(16, device=dev), torch.randn(16, device=dev))),
    ]


@pytest.mark.parametrize("i", range(9))
def test_results_are_tensors_of_their_own(i):
    # as torch's linear and convolution return: a result made under no_grad is written in place by a product
    # that requires grad, and detached in place (both errors on a view made under no_grad)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    name, call = _outputs(dev)[i]
    for _ in range(2):  # a first call, then a replayed one where replays run
        with torch.no_grad():
            y = call()
        assert y._base is None, name
        scale = torch.full((), 2.0, device=dev, dtype=y.dtype, requires_grad=True)
        y.mul_(scale).sum().backward()
        assert scale.grad is not None, name
        y.detach_()
