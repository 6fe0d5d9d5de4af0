"""torch.jit.trace sees every family's op: the fast paths that skip the dispatcher (plain calls, replayed
launches) are off while it records.

A launch made outside the dispatcher is invisible to the tracer: the traced graph would keep only the output's
allocation, and the traced module return uninitialised memory.
"""
import pytest
import torch

import tilegemm
import tilegemm.nn as tnn


def _traced_ops(traced) -> list[str]:
    return [n.kind() for n in traced.inlined_graph.nodes() if n.kind().startswith("tilegemm::")]


def _check(fn, inputs, fresh, reference, *, grad: bool, rtol: float = 1e-4):
    with torch.no_grad():
        fn(*inputs)  # an eager call first: on a GPU it records the launches a later plain call replays
    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        traced = torch.jit.trace(fn, inputs, check_trace=False)
    assert _traced_ops(traced), "the traced graph holds no tilegemm op"
    with torch.no_grad():
        got = traced(*fresh)
        want = reference(*fresh)
    # relative to the output's scale: an unwritten (uninitialised) output fails by orders of magnitude
    err = (got.double() - want.double()).abs().max() / want.double().abs().max()
    assert err < rtol, f"traced output off by {err:.2e} of its scale"


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_matmul(device, grad):
    g = torch.Generator().manual_seed(0)
    b = torch.randn(24, 40, generator=g).to(device)
    a, a2 = (torch.randn(17, 24, generator=g).to(device) for _ in range(2))
    # fp32 runs as tf32 on a GPU
    _check(lambda a: tilegemm.matmul(a, b), (a,), (a2,), lambda a: a.double() @ b.double(), grad=grad,
           rtol=1e-4 if device == "cpu" else 5e-3)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_conv2d_module(device, grad):
    dtype = torch.float32 if device == "cpu" else torch.float16
    ref = torch.nn.Conv2d(8, 16, 3, padding=1).to(device, dtype).requires_grad_(False)
    m = tnn.convert_(torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1))).to(device, dtype)
    m.load_state_dict({"0." + k: v for k, v in ref.state_dict().items()})
    m.eval().requires_grad_(False)
    x, x2 = (torch.randn(2, 8, 9, 9, device=device, dtype=dtype) for _ in range(2))
    _check(m, (x,), (x2,), lambda x: ref.double()(x.double()), grad=grad, rtol=1e-4 if device == "cpu" else 2e-3)


def test_linear_module(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    lin = torch.nn.Linear(24, 40).to(device, dtype)
    m = tnn.convert_(torch.nn.Sequential(torch.nn.Linear(24, 40))).to(device, dtype).eval()
    m[0].load_state_dict(lin.state_dict())
    x, x2 = (torch.randn(5, 24, device=device, dtype=dtype) for _ in range(2))
    _check(m, (x,), (x2,), lambda x: lin.double()(x.double()), grad=False, rtol=1e-4 if device == "cpu" else 2e-3)


def test_w4a16(device):
    g = torch.Generator().manual_seed(0)
    w = tilegemm.w4a16.quantize(torch.randn(64, 256, generator=g).half().to(device), group_size=128)
    dense = tilegemm.w4a16.dequantize(w).double()
    x, x2 = (torch.randn(3, 256, generator=g).half().to(device) for _ in range(2))
    _check(lambda x: tilegemm.w4a16.matmul(x, w), (x,), (x2,), lambda x: x.double() @ dense.T, grad=False,
           rtol=2e-3)


def test_grouped_mm(device):
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.float16
    b = torch.randn(3, 16, 24, generator=g).to(device, dtype)
    offs = torch.tensor([5, 5, 11], dtype=torch.int32, device=device)
    a, a2 = (torch.randn(11, 16, generator=g).to(device, dtype) for _ in range(2))

    def reference(a):
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        return torch.cat([a[s:e].double() @ b[i].double() for i, (s, e) in enumerate(zip(starts, ends))])

    _check(lambda a: tilegemm.grouped_mm(a, b, offs=offs), (a,), (a2,), reference, grad=False,
           rtol=1e-4 if device == "cpu" else 2e-3)


@pytest.mark.gpu
def test_every_family_on_the_gpu():
    """The same checks on CUDA tensors, where plain calls also replay recorded launches."""
    for grad in (False, True):
        test_matmul("cuda", grad)
        test_conv2d_module("cuda", grad)
    test_linear_module("cuda")
    test_w4a16("cuda")
    test_grouped_mm("cuda")
