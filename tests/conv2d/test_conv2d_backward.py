"""Autograd of tilegemm.conv2d against F.conv2d's in float64; the torch.library ops under opcheck and
torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import assert_rel_close, crossed

CL = torch.channels_last


def _grads(device, dtype, shape, conv, activation, channels_last, tol):
    N, C, H, W, K, R, S = shape
    groups = conv.get("groups", 1)
    x = torch.randn(N, C, H, W, device=device).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    w = (torch.randn(K, C // groups, R, S, device=device) / (C // groups * R * S) ** 0.5).to(dtype)
    b = torch.randn(K, device=device).to(dtype)
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = tilegemm.conv2d(xs, ws, bs, **conv, activation=activation, precision="ieee")
    dy = torch.randn(out.shape, device=device).to(dtype)
    got = torch.autograd.grad(out, (xs, ws, bs), dy)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = conv2d_reference(xr, wr, br, **conv, activation=activation)
    want = torch.autograd.grad(ref, (xr, wr, br), dy.double())
    assert_rel_close(out, ref.detach(), tol)
    for name, g, r in zip(("x", "weight", "bias"), got, want):
        assert g.dtype == dtype, name
        assert_rel_close(g, r, tol)
    if channels_last:
        assert got[0].is_contiguous(memory_format=CL), "grad of x keeps x's memory format"
    else:
        assert got[0].is_contiguous()


@pytest.mark.parametrize("shape,conv", [  # at most 64 pixels: one block of the interpreter's implicit-GEMM tile
    pytest.param((2, 8, 5, 6, 12, 3, 3), dict(padding=1), id="3x3"),
    pytest.param((2, 6, 7, 4, 8, 3, 3), dict(stride=2, padding=1), id="3x3-stride2"),
    pytest.param((1, 3, 7, 7, 8, 5, 5), dict(stride=2, padding=2), id="5x5-C3-stride2"),
    pytest.param((1, 8, 5, 4, 8, 3, 2), dict(padding="same", dilation=(2, 1), groups=2), id="same-dilated-groups2"),
    pytest.param((2, 16, 5, 5, 24, 1, 1), dict(), id="pointwise"),
    pytest.param((2, 16, 5, 5, 8, 1, 1), dict(stride=2), id="1x1-stride2"),
    pytest.param((2, 8, 5, 5, 8, 3, 3), dict(padding=1, groups=8), id="depthwise"),
    pytest.param((1, 4, 7, 6, 8, 3, 3), dict(stride=2, padding=1, groups=4), id="depthwise-mult2-stride2"),
    pytest.param((1, 4, 4, 4, 4, 3, 3), dict(padding=3), id="padding-wider-than-filter"),
    # strides past the image (one output pixel): 2**31 - 1 overflowed the kernels' 32-bit stride arithmetic (the
    # depthwise forward looped on, the data gradient launched a program per stride phase)
    pytest.param((1, 6, 5, 4, 8, 3, 3), dict(stride=2**31 - 1, padding=1), id="huge-stride"),
    pytest.param((1, 6, 5, 4, 6, 3, 3), dict(stride=(2**31 - 1, 64), padding=1, groups=6), id="depthwise-huge-stride"),
    pytest.param((2, 4, 5, 4, 8, 1, 1), dict(stride=(3, 2**20)), id="1x1-one-output-column"),
])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_gradients_fp32(shape, conv, channels_last, device):
    _grads(device, torch.float32, shape, conv, "none", channels_last, 1e-5)


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_gradients_through_the_fused_activation(activation, device):
    _grads(device, torch.float32, (2, 8, 6, 6, 8, 3, 3), dict(padding=1), activation, True, 1e-5)


def test_gradients_fp16(device):
    _grads(device, torch.float16, (2, 16, 6, 6, 16, 3, 3), dict(padding=1), "relu", True, tolerance(torch.float16))


def test_backward_runs_no_torch_convolution(device):
    # every convolution of forward and backward is tilegemm's: no aten convolution op is dispatched
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 4, 5, 5, device=device, requires_grad=True)
    w = torch.randn(4, 4, 3, 3, device=device, requires_grad=True)
    with Recorder() as rec:
        out = tilegemm.conv2d(x, w, padding=1, precision="ieee")
        out.sum().backward()
    assert "tilegemm.conv2d_dgrad.default" in rec.names and "tilegemm.conv2d_wgrad.default" in rec.names
    assert not [n for n in rec.names if "convolution" in n or "conv2d." in n and not n.startswith("tilegemm")]
    assert x.grad is not None and w.grad is not None


def test_opcheck(device):
    # an image of few pixels and a 3x2 filter: opcheck calls each op many times, and the interpreter pays for
    # each pixel block and each tap of the weight gradient
    x = torch.randn(1, 4, 3, 4, device=device).contiguous(memory_format=CL)
    w = torch.randn(6, 2, 3, 2, device=device)
    b = torch.randn(6, device=device)
    args = (x, w, b, [2, 1], [1, 1, 0, 0], [1, 1], 2, "relu", "ieee", "auto")
    torch.library.opcheck(torch.ops.tilegemm.conv2d.default, args)
    dy = torch.randn(1, 6, 2, 3, device=device)
    torch.library.opcheck(torch.ops.tilegemm.conv2d_dgrad.default,
                          (dy, w, [1, 4, 3, 4], True, [2, 1], [1, 1, 0, 0], [1, 1], 2, "ieee"))
    torch.library.opcheck(torch.ops.tilegemm.conv2d_wgrad.default,
                          (dy, x, [6, 2, 3, 2], [2, 1], [1, 1, 0, 0], [1, 1], 2, "ieee"))
    torch.library.opcheck(torch.ops.tilegemm.conv2d_wgrad.default,  # a channels-last weight's, of an NCHW x
                          (dy, x.contiguous(), [6, 2, 3, 2], [2, 1], [1, 1, 0, 0], [1, 1], 2, "ieee", True))
    # the gradients' own autograd (double backward), with their inputs requiring gradients
    dy, w, x = (t.detach().clone().requires_grad_() for t in (dy, w, x))
    torch.library.opcheck(torch.ops.tilegemm.conv2d_dgrad.default,
                          (dy, w, [1, 4, 3, 4], True, [2, 1], [1, 1, 0, 0], [1, 1], 2, "ieee"))
    torch.library.opcheck(torch.ops.tilegemm.conv2d_wgrad.default,
                          (dy, x, [6, 2, 3, 2], [2, 1], [1, 1, 0, 0], [1, 1], 2, "ieee"))


@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
@pytest.mark.parametrize("bad, err, text", [
    (dict(stride=[0, 1]), ValueError, r"stride must be >= 1, got \[0, 1\]"),
    (dict(padding=[-1, 3, 1, 1]), ValueError, r"padding must be >= 0, got \[-1, 3, 1, 1\]"),
    (dict(dilation=[1, 0]), ValueError, r"dilation must be >= 1"),
    (dict(dtype=torch.float16), TypeError, r"dy is fp16 and (weight|x) fp32: give both one dtype"),
    (dict(dy_dtype=torch.int64), TypeError, r"dy has integer dtype int64"),
])
def test_the_gradient_ops_called_directly_refuse_what_the_forward_would(op, bad, err, text):
    # a stride of 0 divided by zero, a negative padding returned a gradient of nothing, mixed or integer dtypes
    # failed inside the kernels: each named before anything runs
    x, w, dy = torch.randn(2, 4, 6, 6), torch.randn(6, 4, 3, 3), torch.randn(2, 6, 6, 6)
    if "dtype" in bad:
        dy = dy.to(bad["dtype"])
    if "dy_dtype" in bad:
        dy = dy.to(bad["dy_dtype"])
    geo = dict(stride=bad.get("stride", [1, 1]), padding=bad.get("padding", [1, 1, 1, 1]),
               dilation=bad.get("dilation", [1, 1]))
    with pytest.raises(err, match=f"(tilegemm::conv2d_{op}: )?" + text):
        if op == "dgrad":
            torch.ops.tilegemm.conv2d_dgrad(dy, w, [2, 4, 6, 6], False, geo["stride"], geo["padding"],
                                            geo["dilation"], 1, "default")
        else:
            torch.ops.tilegemm.conv2d_wgrad(dy, x, [6, 4, 3, 3], geo["stride"], geo["padding"], geo["dilation"], 1,
                                            "default")


@pytest.mark.parametrize("w_cl", [False, True], ids=["w-nchw", "w-cl"])
@pytest.mark.parametrize("w_shape,groups,cl,pad", [((6, 4, 3, 3), 1, True, 1), ((6, 4, 3, 3), 1, False, 1),
                                                   ((6, 2, 3, 1), 2, True, 1), ((6, 2, 3, 1), 2, False, 1),
                                                   ((6, 4, 1, 1), 1, True, 1), ((6, 4, 1, 1), 1, True, 0),
                                                   ((8, 1, 3, 3), 4, True, 1)])
def test_weight_gradient_follows_the_layers_layout(w_shape, groups, cl, pad, w_cl, device):
    """A channels-last activation or weight (``w_cl``) gets a channels-last weight gradient (as torch's
    convolution backward returns it), an NCHW layer a contiguous one; 1x1 and one-channel filters, where the two
    layouts are the same memory, contiguous ones. The fake says the same strides, and the values are
    F.conv2d's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    H, W = 4, 3
    x = torch.randn(2, 4, H, W, device=device)
    x = x.contiguous(memory_format=CL) if cl else x
    K, _, R, S = w_shape
    dy = torch.randn(2, K, H - R + 1 + 2 * pad, W - S + 1 + 2 * pad, device=device).contiguous(memory_format=CL)
    args = (dy, x, list(w_shape), [1, 1], [pad] * 4, [1, 1], groups, "ieee", w_cl)  # pad 0 1x1: the GEMM path
    dw = torch.ops.tilegemm.conv2d_wgrad(*args)
    want = torch.channels_last if (cl or w_cl) and R * S > 1 and w_shape[1] > 1 else torch.contiguous_format
    assert dw.is_contiguous(memory_format=want)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.tilegemm.conv2d_wgrad(mode.from_tensor(dy), mode.from_tensor(x), *args[2:])
    assert fake.shape == dw.shape and fake.stride() == dw.stride()
    xr = x.double().requires_grad_()
    wr = torch.zeros(w_shape, dtype=torch.float64, device=device, requires_grad=True)
    torch.nn.functional.conv2d(xr, wr, None, 1, pad, 1, groups).backward(dy.double())
    assert_rel_close(dw, wr.grad, 1e-5)


def _dense_strides(t: torch.Tensor) -> tuple:
    """``t``'s strides but those of its size-1 dimensions, which address nothing (what autograd's layout contract
    for a ``.grad`` compares)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


_LAYERS = [("3x3", (6, 4, 3, 3), dict(padding=1)),
           ("3x3-stride2-groups2", (6, 2, 3, 3), dict(stride=2, padding=1, groups=2)),
           ("pointwise", (6, 4, 1, 1), dict()),
           ("depthwise", (8, 1, 3, 3), dict(padding=1, groups=4))]
_FORMATS = [(x, w, dy) for x in ("nchw", "cl") for w in ("nchw", "cl") for dy in ("as-output", "nchw")]


@pytest.mark.parametrize("w_shape,conv,x_format,w_format,dy_format", [
    pytest.param(w_shape, conv, x, w, dy, id=f"{name}-{x}-{w}-{dy}")
    for name, w_shape, conv in _LAYERS for x, w, dy in _FORMATS
    # each distinct call once: an NCHW layer's output is NCHW (its "as-output" dy is the "nchw" one), and a 1x1 or
    # one-channel filter made channels-last keeps its strides (its "cl" weight is the "nchw" one)
    if not (x == w == dy == "nchw") and not (w == "cl" and (w_shape[1] == 1 or w_shape[2:] == (1, 1)))
])
def test_gradient_memory_formats_match_torch(w_shape, conv, x_format, w_format, dy_format, device):
    """Every pairing of NCHW and channels-last x and weight: the gradients autograd returns (x's, the weight's,
    the bias's) have F.conv2d's strides (channels-last where x or the weight is, as the output), and so have the
    ``.grad`` that backward() accumulates; the values are F.conv2d's. An NCHW incoming gradient (a mean's backward
    gives one) changes nothing. 1x1 and one-channel filters are both layouts at once: their strides are compared
    where a dimension has more than one element."""
    x = torch.randn(2, 4, 4, 3, device=device)
    w = torch.randn(w_shape, device=device) / (w_shape[1] * w_shape[2] * w_shape[3]) ** 0.5
    b = torch.randn(w_shape[0], device=device)
    x = x.contiguous(memory_format=CL) if x_format == "cl" else x
    w = w.contiguous(memory_format=CL) if w_format == "cl" else w
    got, want, layout = [], [], []
    # values against torch's float64, layouts against its float32: on CUDA a float64 convolution is NCHW whatever
    # its inputs' layouts (cuDNN's channels-last takes no double), where a float32 one follows them
    for fn, grads, dtype in ((tilegemm.conv2d, got, torch.float32), (torch.nn.functional.conv2d, want, torch.float64),
                             (torch.nn.functional.conv2d, layout, torch.float32)):
        xs, ws, bs = (t.detach().to(dtype).requires_grad_() for t in (x, w, b))  # (.to keeps the strides)
        out = fn(xs, ws, bs, **conv)
        dy = torch.randn(out.shape, device=device, generator=torch.Generator(device).manual_seed(7)).to(dtype)
        dy = dy.contiguous(memory_format=CL if out.is_contiguous(memory_format=CL) and dy_format == "as-output"
                           else torch.contiguous_format)
        # one backward: the hooks see the gradients as autograd.grad returns them, before .grad accumulates them
        returned = [None] * 3
        for i, t in enumerate((xs, ws, bs)):
            t.register_hook(lambda g, i=i: returned.__setitem__(i, g))
        out.backward(dy)
        grads.append(out)
        grads.extend(returned)
        grads.extend((xs.grad, ws.grad, bs.grad))
    names = ("output", "grad x", "grad weight", "grad bias", "x.grad", "weight.grad", "bias.grad")
    for name, g, r, lay in zip(names, got, want, layout):
        assert _dense_strides(g) == _dense_strides(lay), (name, g.stride(), lay.stride())
        assert_rel_close(g, r, 1e-5)
    if w_shape[1] > 1 and w_shape[2] > 1:  # not a layout of both: channels-last where x or the weight is
        layer = CL if "cl" in (x_format, w_format) else torch.contiguous_format
        for name, g in zip(names[:3], got[:3]):
            assert g.is_contiguous(memory_format=layer), name
            assert g.stride() == layout[names.index(name)].stride(), name


_VIEWS = {  # views whose layout is told apart by torch's stride test, not by is_contiguous(channels_last)
    "cl-channels-sliced": lambda t: t.repeat(1, 2, 1, 1).contiguous(memory_format=CL)[:, :t.shape[1]],  # torch.chunk
    "cl-batch-sliced": lambda t: t.repeat(2, 1, 1, 1).contiguous(memory_format=CL)[::2],
    "hwc-unsqueezed": lambda t: t[:1].permute(0, 2, 3, 1).contiguous()[0].permute(2, 0, 1)[None],  # CL-contiguous
    # .to(channels_last) restrides a 1x1 or one-channel filter (contiguous either way) to what torch reads as
    # channels-last, where .contiguous(memory_format=...) leaves its strides
    "to-cl": lambda t: t.to(memory_format=CL),
}


@pytest.mark.parametrize("of,view", [("x", view) for view in _VIEWS if view != "to-cl"]
                         + [("weight", "cl-channels-sliced"), ("weight", "cl-batch-sliced"), ("weight", "to-cl")])
@pytest.mark.parametrize("w_shape,conv", [
    pytest.param((6, 4, 3, 3), dict(padding=1), id="3x3"),
    pytest.param((6, 4, 1, 1), dict(stride=2), id="1x1-stride2"),
    pytest.param((8, 1, 3, 3), dict(padding=1, groups=4), id="depthwise"),
])
def test_memory_formats_of_views_match_torch(w_shape, conv, of, view, device):
    """A view of a channels-last tensor (its channels or batch sliced, as torch.chunk gives them) makes the output
    and the gradients channels-last, and an HWC image unsqueezed to a batch of one does not (its batch stride
    breaks torch's test), as torch's convolution decides by ``suggest_memory_format``."""
    x = torch.randn(2, 4, 4, 3, device=device)
    w = torch.randn(w_shape, device=device) / (w_shape[1] * w_shape[2] * w_shape[3]) ** 0.5
    x, w = (_VIEWS[view](x), w) if of == "x" else (x, _VIEWS[view](w))
    got, want, layout = [], [], []
    for fn, out_of, dtype in ((tilegemm.conv2d, got, torch.float32), (torch.nn.functional.conv2d, want, torch.float64),
                              (torch.nn.functional.conv2d, layout, torch.float32)):  # (layouts: float32's, above)
        xs, ws = (t.detach().to(dtype).requires_grad_() for t in (x, w))  # (.to and detach keep the strides)
        out = fn(xs, ws, None, **conv)
        dy = torch.randn(out.shape, device=device, generator=torch.Generator(device).manual_seed(7)).to(dtype)
        out_of.append(out)
        out_of.extend(torch.autograd.grad(out, (xs, ws), dy.contiguous(memory_format=torch.preserve_format)))
    for name, g, r, lay in zip(("output", "grad x", "grad weight"), got, want, layout):
        assert _dense_strides(g) == _dense_strides(lay), (name, g.stride(), lay.stride())
        assert_rel_close(g, r, 1e-5)
    meta = [torch.empty_strided(t.shape, t.stride(), device="meta") for t in (x, w)]  # (through the op's fake)
    assert _dense_strides(tilegemm.conv2d(*meta, None, **conv)) == _dense_strides(layout[0])


def test_torch_compile_fullgraph_forward_and_backward(device):
    def f(x, w, b):
        return tilegemm.conv2d(x, w, b, stride=1, padding=1, activation="gelu", precision="ieee") * 2.0

    x = torch.randn(2, 4, 5, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(8, 4, 3, 3, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, b)
    ref = 2.0 * conv2d_reference(x.detach(), w.detach(), b.detach(), padding=1, activation="gelu")
    assert_rel_close(out, ref, 1e-5)
    out.sum().backward()
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    (2.0 * conv2d_reference(xr, wr, br, padding=1, activation="gelu")).sum().backward()
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert_rel_close(got, want, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("shape,conv", [
    ((4, 64, 28, 28, 64, 3, 3), dict(padding=1)),
    ((4, 128, 28, 28, 256, 3, 3), dict(stride=2, padding=1)),
    ((4, 3, 64, 64, 64, 7, 7), dict(stride=2, padding=3)),
    ((4, 256, 14, 14, 512, 1, 1), dict()),
    ((4, 256, 14, 14, 512, 1, 1), dict(stride=2)),
    ((4, 96, 28, 28, 96, 3, 3), dict(padding=1, groups=96)),
    ((4, 64, 15, 17, 64, 3, 3), dict(padding=1, groups=4)),
])
def test_gpu_gradients(shape, conv, dtype, channels_last, device):
    _grads(device, dtype, shape, conv, "relu", channels_last, tolerance(dtype))


@pytest.mark.parametrize("shape,stride", [
    pytest.param((2, 70, 7, 5, 12), (2, 2), id="odd-image-C70"),
    pytest.param((1, 8, 9, 8, 16), (3, 2), id="stride3x2"),
    pytest.param((3, 16, 1, 6, 8), (2, 2), id="one-row"),
])
def test_strided_pointwise_data_gradient_is_the_product_spread_out(shape, stride, device, monkeypatch):
    """A strided 1x1 layer's data gradient (channels-last): the product over the kept pixels, then every input
    pixel written, the product's row where the stride kept it and zeros elsewhere (outputs poisoned first, C
    wider than one channel block, images not stride multiples); and the spread kernel is what ran."""
    from tilegemm.core import runtime
    from tilegemm.ops.conv2d import gemm_1x1, op
    from tilegemm.ops.conv2d.problem import DgradCall

    N, C, H, W, K = shape
    ran = []
    spread = gemm_1x1.strided_dgrad
    monkeypatch.setattr(gemm_1x1, "strided_dgrad", lambda *a: ran.append(1) or spread(*a))
    real_new = runtime.new_output
    monkeypatch.setattr(runtime, "new_output", lambda *a, **k: real_new(*a, **k).fill_(float("nan")))
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=CL)
    w = torch.randn(K, C, 1, 1, device=device)
    P, Q = (H - 1) // stride[0] + 1, (W - 1) // stride[1] + 1
    dy = torch.randn(N, K, P, Q, device=device).contiguous(memory_format=CL)
    dx = op.backward_data(DgradCall(dy, w, list(x.shape), True, list(stride), [0, 0, 0, 0], [1, 1], 1, "ieee"))
    assert ran and dx.is_contiguous(memory_format=CL) and dx.shape == x.shape
    xr = x.double().requires_grad_()
    torch.nn.functional.conv2d(xr, w.double(), None, stride).backward(dy.double())
    assert_rel_close(dx, xr.grad, 1e-5)
    kept = torch.zeros(H, W, dtype=torch.bool)
    kept[::stride[0], ::stride[1]] = True
    assert (dx[:, :, ~kept] == 0).all()


@pytest.mark.parametrize("split", [1, 3, 7])  # 70 pixels in 16-pixel steps: one slice, 32+32+6, five (7 clamped)
@pytest.mark.parametrize("groups", [1, 2])
def test_weight_gradient_split_reduction_is_right_and_leaves_counters_at_zero(split, groups, device):
    """The weight gradient's pixel slices hand partial tiles to the last program to arrive, which adds them in
    order and stores: any number of slices (uneven last slice included) gives F.conv2d's gradient, and every
    launch leaves the shared counters at zero for the next one."""
    from tilegemm.core import workspace
    from tilegemm.ops.conv2d import implicit_gemm
    from tilegemm.ops.conv2d.configs import wgrad_config
    from tilegemm.ops.conv2d.problem import geometry_of

    N, C, H, W, K, R = 2, 6 * groups, 7, 5, 10 * groups, 3
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=CL)
    w_shape = (K, C // groups, R, R)
    dy = torch.randn(N, K, H, W, device=device).contiguous(memory_format=CL)
    g = geometry_of(x.shape, w_shape, [1, 1], [1, 1, 1, 1], [1, 1], groups)
    cfg = dict(wgrad_config(g, x.dtype, 4), SPLIT=split, BLOCK_K=16)
    for _ in range(2):  # the second launch starts from the counters the first left
        dw = implicit_gemm.wgrad(dy, x, g, "ieee", False, x.dtype, cfg)
        assert dw.shape == w_shape and dw.is_contiguous()
        xr = x.double().requires_grad_()
        wr = torch.zeros(w_shape, dtype=torch.float64, device=device, requires_grad=True)
        torch.nn.functional.conv2d(xr, wr, None, 1, 1, 1, groups).backward(dy.double())
        assert_rel_close(dw, wr.grad, 1e-5)
        for _, count in workspace._workspaces.values():
            assert not count.any(), "every launch must leave the arrival counters at zero"


@pytest.mark.parametrize("channels_last", [True, False])
def test_weight_gradient_past_the_grids_second_axis_runs_a_call_per_run_of_groups(channels_last, device,
                                                                                  monkeypatch):
    """Taps times groups past the grid's second axis (65535 on a GPU; 17 here: three groups of 3x3 taps) run
    two groups, then one, on channel slices: F.conv2d's gradient, every launch within the axis."""
    from tilegemm.ops.conv2d import implicit_gemm

    grids = []
    launch = implicit_gemm.launch
    monkeypatch.setattr(implicit_gemm, "launch", lambda kernel, grid, *a, **k: (grids.append(grid),
                                                                                launch(kernel, grid, *a, **k))[1])
    monkeypatch.setattr(implicit_gemm, "_MAX_GRID_Y", 2 * 3 * 3 - 1)
    fmt = CL if channels_last else torch.contiguous_format
    x = torch.randn(1, 48, 5, 6, device=device).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(12, 16, 3, 3, device=device).contiguous(memory_format=fmt).requires_grad_()  # a tap a program
    dy = torch.randn(1, 12, 5, 6, device=device)
    tilegemm.conv2d(x, w, None, 1, 1, 1, 3).backward(dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    torch.nn.functional.conv2d(xr, wr, None, 1, 1, 1, 3).backward(dy.double())
    assert_rel_close(w.grad, wr.grad, 1e-5)
    assert_rel_close(x.grad, xr.grad, 1e-5)
    assert grids and all(grid[1] <= 17 for grid in grids)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("C,groups,R,S,stride", [(3, 1, 7, 7, 2), (2, 1, 3, 5, 1), (6, 2, 3, 3, 2)])
def test_few_channel_weight_gradient_runs_the_filter_as_one_row_of_columns(C, groups, R, S, stride, split, device):
    """Fewer than 16 channels a group (the stem's C=3): the weight gradient's columns are (r, s, c) as one index
    (FLAT), its tiles crossing taps; every element of dw lands where F.conv2d's gradient has it."""
    from tilegemm.ops.conv2d import implicit_gemm
    from tilegemm.ops.conv2d.configs import wgrad_config
    from tilegemm.ops.conv2d.problem import geometry_of

    N, H, W, K = 2, 11, 9, 5 * groups
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=CL)
    w_shape = (K, C // groups, R, S)
    pad = [R // 2, R // 2, S // 2, S // 2]
    g = geometry_of(x.shape, w_shape, [stride, stride], pad, [1, 1], groups)
    cfg = wgrad_config(g, x.dtype, 4)
    assert cfg["FLAT"]
    dy = torch.randn(N, K, g.P, g.Q, device=device).contiguous(memory_format=CL)
    dw = implicit_gemm.wgrad(dy, x, g, "ieee", False, x.dtype, dict(cfg, SPLIT=split, BLOCK_K=16))
    xr = x.double()
    wr = torch.zeros(w_shape, dtype=torch.float64, device=device, requires_grad=True)
    xp = torch.nn.functional.pad(xr, (pad[2], pad[3], pad[0], pad[1]))
    torch.nn.functional.conv2d(xp, wr, None, stride, 0, 1, groups).backward(dy.double())
    assert_rel_close(dw, wr.grad, 1e-5)


@pytest.mark.parametrize("mult", [1, 2])
def test_depthwise_weight_gradient_in_one_launch_over_any_split(mult, device):
    """The depthwise weight gradient's slices reduce in the kernel too (last arrival adds them in order)."""
    from tilegemm.core import workspace
    from tilegemm.ops.conv2d import depthwise
    from tilegemm.ops.conv2d.configs import depthwise_config
    from tilegemm.ops.conv2d.problem import geometry_of

    # 12 channels: one block of 16 at mult 1, two at mult 2 (each block's slices summed apart); a 1x3 filter (a
    # program a tap: the interpreter pays for each)
    N, C, H, W, R, S = 2, 12, 3, 5, 1, 3
    K = C * mult
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=CL)
    dy = torch.randn(N, K, H, W, device=device).contiguous(memory_format=CL)
    g = geometry_of(x.shape, (K, 1, R, S), [1, 1], [0, 0, 1, 1], [1, 1], C)
    for block_m, split in ((8, 4), (8, 2), (32, 1)):  # 30 pixels: a tile a slice, two (uneven slices), one
        cfg = dict(depthwise_config(g, x.dtype), BLOCK_M=block_m, SPLIT=split)
        dw = depthwise.wgrad(dy, x, g, x.dtype, cfg)
        assert dw.shape == (K, 1, R, S) and dw.is_contiguous()
        xr = x.double().requires_grad_()
        wr = torch.zeros(K, 1, R, S, dtype=torch.float64, device=device, requires_grad=True)
        torch.nn.functional.conv2d(xr, wr, None, 1, (0, 1), 1, C).backward(dy.double())
        assert_rel_close(dw, wr.grad, 1e-5)
        for _, count in workspace._workspaces.values():
            assert not count.any()


@crossed("case, s_pad, block_m, split", [  # images of 20 output pixels (image: N, H, W)
    pytest.param(dict(C=9, mult=1, R=7, S=7, stride=1, pad=3, dil=1, image=(1, 5, 4)), id="7x7-odd-channels"),
    pytest.param(dict(C=20, mult=1, R=3, S=3, stride=1, pad=1, dil=1, image=(1, 4, 5)), id="3x3"),
    pytest.param(dict(C=6, mult=2, R=5, S=5, stride=2, pad=2, dil=1, image=(2, 4, 9)), id="5x5-s2-mult2"),
    pytest.param(dict(C=8, mult=1, R=3, S=2, stride=1, pad=1, dil=2, image=(1, 6, 5)), id="3x2-dilated"),
], [pytest.param(1, id="a-tap"), pytest.param("row", id="a-row")],
    # 20 pixels (a program a tap runs R * S programs a slice, so few): at (16, 1) one slice of a whole block and a
    # partial one; three slices at (8, 5), the last of 4 pixels (under the interpreter the 3x3 and 3x2 filters'
    # programs a tap take these, the 7x7 and 5x5 filters' programs a row)
    [pytest.param(16, 1, id="one-slice-16"), pytest.param(8, 5, id="slices-8x5")])
def test_depthwise_weight_gradient_a_program_a_tap_or_a_filter_row(case, s_pad, block_m, split, device):
    """The depthwise weight gradient's two program shapes (one tap, or one filter row's taps padded to S_PAD:
    configs.depthwise_wgrad_config) give torch's gradient at any split, filter, stride, dilation and multiplier."""
    from tilegemm.core import workspace
    from tilegemm.ops.conv2d import depthwise
    from tilegemm.ops.conv2d.configs import depthwise_config
    from tilegemm.ops.conv2d.problem import geometry_of

    C, R, S, st, pad, dil = case["C"], case["R"], case["S"], case["stride"], case["pad"], case["dil"]
    N, H, W = case["image"]
    K = C * case["mult"]
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=CL)
    g = geometry_of(x.shape, (K, 1, R, S), [st, st], [pad, pad, pad, pad], [dil, dil], C)
    assert N * g.P * g.Q == 20
    dy = torch.randn(N, K, g.P, g.Q, device=device).contiguous(memory_format=CL)
    sp = 1 if s_pad == 1 else 1 << (S - 1).bit_length()
    xr = x.double().requires_grad_()
    wr = torch.zeros(K, 1, R, S, dtype=torch.float64, device=device, requires_grad=True)
    torch.nn.functional.conv2d(xr, wr, None, st, pad, dil, C).backward(dy.double())
    cfg = dict(depthwise_config(g, x.dtype), BLOCK_M=block_m, SPLIT=split, S_PAD=sp)
    dw = depthwise.wgrad(dy, x, g, x.dtype, cfg)
    assert dw.shape == (K, 1, R, S) and dw.is_contiguous()
    assert_rel_close(dw, wr.grad, 1e-5 if x.dtype == torch.float32 else 1e-2)
    for _, count in workspace._workspaces.values():
        assert not count.any()


def test_depthwise_weight_gradient_refuses_a_row_narrower_than_the_filter(device, monkeypatch):
    from tilegemm.ops.conv2d import configs, depthwise
    from tilegemm.ops.conv2d.configs import depthwise_config, depthwise_wgrad_config
    from tilegemm.ops.conv2d.problem import geometry_of

    x = torch.randn(1, 8, 9, 9, device=device).contiguous(memory_format=CL)
    g = geometry_of(x.shape, (8, 1, 5, 5), [1, 1], [2, 2, 2, 2], [1, 1], 8)
    assert "S_PAD" not in depthwise_wgrad_config(g, x.dtype)  # off: a program a tap (the faster, measured)
    monkeypatch.setattr(configs, "DEPTHWISE_WGRAD_ROW_TAPS", True)
    assert depthwise_wgrad_config(g, x.dtype)["S_PAD"] == 8  # on: 5 columns padded to 8
    dy = torch.randn(1, 8, 9, 9, device=device).contiguous(memory_format=CL)
    with pytest.raises(ValueError, match="S_PAD=4 holds fewer than the filter's 5 columns"):
        depthwise.wgrad(dy, x, g, x.dtype, dict(depthwise_config(g, x.dtype), S_PAD=4))


def test_depthwise_weight_gradient_rows_by_name_whatever_the_default(monkeypatch):
    """``rows`` asks for a program per filter row (or per tap) whatever DEPTHWISE_WGRAD_ROW_TAPS says, so the research
    script's "row" candidates time rows with the rule's default at a program a tap."""
    import importlib.util
    import sys
    from pathlib import Path

    from tilegemm.ops.conv2d import configs
    from tilegemm.ops.conv2d.problem import geometry_of

    g = geometry_of((2, 8, 9, 9), (8, 1, 5, 5), [1, 1], [2, 2, 2, 2], [1, 1], 8)
    monkeypatch.setattr(configs, "DEPTHWISE_WGRAD_ROW_TAPS", False)
    assert configs.depthwise_wgrad_config(g, torch.float16, rows=True)["S_PAD"] == 8
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    try:
        spec = importlib.util.spec_from_file_location("depthwise_wgrad_rows", root / "research/depthwise_wgrad_rows.py")
        research = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(research)
    finally:
        sys.path.remove(str(root / "tools"))
    assert research.config("row-2-8", g)["S_PAD"] == 8
    assert "S_PAD" not in research.config("tap-2-8", g)
    monkeypatch.setattr(configs, "DEPTHWISE_WGRAD_ROW_TAPS", True)
    assert "S_PAD" not in configs.depthwise_wgrad_config(g, torch.float16, rows=False)
    assert "S_PAD" not in research.config("tap-2-8", g)


@pytest.mark.gpu
@pytest.mark.parametrize("C,K,H", [(232, 696, 56), (96, 40, 14), (40, 120, 14), (64, 64, 56)])
def test_pointwise_wgrad_tiles_on_the_gpu(C, K, H):
    """Each tile ``gemm_1x1.wgrad_tile`` picks (the wide one from 2^31 multiply-adds), into a NaN-poisoned
    output, against the fp32 product."""
    from tilegemm.ops.conv2d import gemm_1x1

    x = torch.randn(32 * H * H, C, device="cuda", dtype=torch.float16)
    dy = torch.randn(32 * H * H, K, device="cuda", dtype=torch.float16)
    dw = gemm_1x1.pointwise_wgrad(dy.t(), x, "ieee")
    ref = dy.t().float() @ x.float()
    assert not dw.isnan().any()
    assert ((dw.float() - ref).norm() / ref.norm()).item() < 4e-3


def test_a_bias_written_in_place_after_the_call_is_no_autograd_error(device):
    # as for torch's convolution: the backward needs the bias's dtype, not its values (unless an activation's input
    # is recomputed)
    x = torch.randn(1, 4, 5, 5, device=device, requires_grad=True)
    w, b = torch.randn(6, 4, 3, 3, device=device), torch.randn(6, device=device, requires_grad=True)
    out = tilegemm.conv2d(x, w, b, padding=1)
    with torch.no_grad():
        b.add_(1)
    gx, gb = torch.autograd.grad(out.sum(), (x, b))
    want = torch.nn.functional.conv_transpose2d(torch.ones(1, 6, 5, 5, dtype=torch.float64, device=device),
                                                w.double(), padding=1)
    assert_rel_close(gx, want, 1e-5)
    assert torch.equal(gb, torch.full_like(b, 25.0))
