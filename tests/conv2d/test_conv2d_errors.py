"""Bad conv2d input raises TypeError/ValueError naming the problem, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import tilegemm


def _xw(device, x_shape=(1, 4, 6, 6), w_shape=(8, 4, 3, 3), dtype=torch.float32):
    return torch.randn(*x_shape, device=device, dtype=dtype), torch.randn(*w_shape, device=device, dtype=dtype)


@pytest.mark.parametrize("x_shape,w_shape,kwargs,error,match", [
    ((1, 4, 6, 6), (8, 3, 3, 3), {}, ValueError, "channel mismatch: x has C=4 channels"),
    ((1, 6, 6, 6), (8, 4, 3, 3), dict(groups=4), ValueError, "input channels C=6 are not divisible by groups=4"),
    ((1, 4, 6, 6), (6, 1, 3, 3), dict(groups=4), ValueError, "output channels K=6"),
    ((1, 4, 2, 6), (8, 4, 3, 3), {}, ValueError, "kernel larger than the padded input"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(dilation=3), ValueError, "kernel larger than the padded input"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(stride=0), ValueError, "stride must be >= 1"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(dilation=(1, 0)), ValueError, "dilation must be >= 1"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(padding=-1), ValueError, "padding must be >= 0"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(padding="full"), ValueError, "padding must be an int, a pair of ints, 'same'"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(padding="same", stride=2), ValueError, "padding='same' needs stride 1"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(padding="SAME"), ValueError, r"'same' or 'valid' \(lowercase, as torch\)"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(padding="Valid"), ValueError, "got 'Valid'"),
    ((1, 4, 0, 6), (8, 4, 3, 3), dict(padding=2), ValueError, r"empty spatial dimension \(H=0, W=6\)"),
    ((2, 4, 6, 0), (8, 4, 1, 1), {}, ValueError, r"empty spatial dimension \(H=6, W=0\) in a batch of 2"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(stride=()), TypeError, "stride must be an int or a pair"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(stride=(1, 2, 3)), TypeError, "stride must be an int or a pair"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(groups=0), ValueError, "groups must be >= 1"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(groups=1.0), TypeError, "groups must be an int"),
    ((6, 6), (8, 4, 3, 3), {}, ValueError, r"x must be a batched \[N, C, H, W\] .* got shape \[6, 6\]"),
    ((1, 1, 4, 6, 6), (8, 4, 3, 3), {}, ValueError,
     r"\[N, C, H, W\] \(4 dims\) or unbatched \[C, H, W\] \(3 dims\) input, got shape \[1, 1, 4, 6, 6\]"),
    ((1, 4, 6, 6), (8, 4, 3), {}, ValueError, "weight must have 4 dims"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(activation="tanh"), ValueError, "unknown activation 'tanh'"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(kernel="winograd"), ValueError, "unknown conv2d kernel 'winograd'"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(precision="double"), ValueError, "unknown precision 'double'"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(precision=3), TypeError, "precision must be a str"),
])
def test_bad_arguments(x_shape, w_shape, kwargs, error, match, device):
    x, w = _xw(device, x_shape, w_shape)
    with pytest.raises(error, match=match):
        tilegemm.conv2d(x, w, **kwargs)


def test_bad_dtypes_and_bias(device):
    x, w = _xw(device)
    with pytest.raises(TypeError, match="dtypes differ: x is fp32, weight is fp16"):
        tilegemm.conv2d(x, w.half())
    with pytest.raises(TypeError, match="x has unsupported dtype float64"):
        tilegemm.conv2d(x.double(), w.double())
    with pytest.raises(TypeError, match="x has integer dtype int32"):
        tilegemm.conv2d(x.int(), w.int())
    with pytest.raises(TypeError, match="x has boolean dtype bool"):
        tilegemm.conv2d(x > 0, w > 0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        tilegemm.conv2d(x.tolist(), w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):  # 3-D: no unbatched route
        tilegemm.conv2d(x[0].cpu().numpy(), w)
    with pytest.raises(ValueError, match=r"bias must have shape \[K\] = \[8\], got \[7\]"):
        tilegemm.conv2d(x, w, torch.randn(7, device=device))
    with pytest.raises(TypeError, match="dtypes differ: x is fp32, bias is fp16"):
        tilegemm.conv2d(x, w, torch.randn(8, device=device, dtype=torch.float16))


@pytest.mark.parametrize("x_shape", [(4, 0, 6), (4, 6, 0)])
def test_an_unbatched_input_with_an_empty_side_is_named_as_given(x_shape, device):
    # checked as a batch of one ([1, C, H, W]), but named as the caller's unbatched [C, H, W] input
    x, w = _xw(device, x_shape, (8, 4, 1, 1))
    H, W = x_shape[1:]
    with pytest.raises(ValueError, match=rf"empty spatial dimension \(H={H}, W={W}\) in an unbatched \[C, H, W\] "
                                         rf"input of shape \[4, {H}, {W}\]") as err:
        tilegemm.conv2d(x, w)
    assert "batch of" not in str(err.value)
    with pytest.raises(ValueError, match="in an unbatched"):
        tilegemm.nn.Conv2d(4, 8, 1).to(device)(x)


def test_sparse_tensors(device):
    """Tensors without strides are refused by name (they reached torch's memory-format conversion)."""
    x, w = _xw(device)
    with pytest.raises(TypeError, match=r"x is a tensor of layout torch.sparse_coo; .* x.to_dense\(\)"):
        tilegemm.conv2d(x.to_sparse(), w)
    with pytest.raises(TypeError, match="weight is a tensor of layout torch.sparse_coo"):
        tilegemm.conv2d(x, w.to_sparse())
    with pytest.raises(TypeError, match="bias is a tensor of layout torch.sparse_coo"):
        tilegemm.conv2d(x, w, torch.randn(8, device=device).to_sparse())

def test_devices_must_agree(device):
    if device == "cpu":
        # under the interpreter every tensor is on the CPU; a meta tensor stands for "another device"
        x, w = _xw(device)
        with pytest.raises(ValueError, match="tensors are on different devices: x on cpu, weight on meta"):
            tilegemm.conv2d(x, w.to("meta"))
    else:
        x, w = _xw(device)
        with pytest.raises(ValueError, match="different devices"):
            tilegemm.conv2d(x, w.cpu())
        with pytest.raises(ValueError, match="move the tensors to the GPU"):
            tilegemm.conv2d(x.cpu(), w.cpu())


@pytest.mark.parametrize("kwargs,match", [
    (dict(padding=2**40), r"padding=1099511627776 pads the 6x6 input to 2199023255558x2199023255558 .*32-bit"),
    (dict(padding=(0, 2**31)), r"padding=\(0, 2147483648\) pads the 6x6 input to 6x4294967302"),
    (dict(padding=2**63), r"padding=9223372036854775808 pads"),
    (dict(padding="same", dilation=2**31), r"padding='same' pads the 6x6 input to 4294967302x4294967302"),
    # padded sides that fit, an output that no tensor can hold (torch's message: a storage size overflow)
    (dict(padding=2**30 - 8), r"padding=1073741816 makes the output \[N, K, P, Q\] = \[1, 8, 2147483636, "
                              r"2147483636\]: more bytes than a tensor can hold"),
    (dict(stride=2**70), r"stride must be at most 2\*\*63 - 1 \(an int64\), got \(1180591620717411303424, "),
    (dict(stride=(1, 2**63)), r"stride must be at most 2\*\*63 - 1"),
    (dict(dilation=2**64), r"dilation must be at most 2\*\*63 - 1"),
])
def test_sizes_past_the_index_math_are_named(kwargs, match, device):
    """Paddings, strides and dilations whose sizes the kernels' index math (int32 coordinates, int64 arguments)
    or a tensor cannot hold are refused naming the argument, where torch's overflow messages came out."""
    x, w = _xw(device)
    with pytest.raises(ValueError, match=match):
        tilegemm.conv2d(x, w, **kwargs)
    named = rf"^{next(iter(kwargs))}"  # the argument, first
    with pytest.raises(ValueError, match=named):
        tilegemm.nn.Conv2d(4, 8, 3, **kwargs).to(device)(x)
    if type(kwargs.get("padding")) is int and kwargs["padding"] >= 2**31:
        for mode in ("replicate", "circular"):  # padded before the product: named before F.pad too
            with pytest.raises(ValueError, match=r"^padding=\(\d+, \d+\) pads the 6x6 input"):
                tilegemm.nn.Conv2d(4, 8, 3, padding=kwargs["padding"], padding_mode=mode).to(device)(x)


def test_large_strides_and_dilations_that_fit_still_run(device):
    """A stride past the input or a dilation of a 1x1 kernel changes nothing however large (torch takes them): the
    size checks leave them be."""
    x, w = _xw(device)
    want = torch.nn.functional.conv2d(x.cpu(), w.cpu(), None, 2**40, 1).to(x.device)  # (cuDNN takes no such stride)
    torch.testing.assert_close(tilegemm.conv2d(x, w, None, 2**40, 1), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tilegemm.conv2d(x, w, None, 2**63 - 1, 1), want, rtol=1e-4, atol=1e-4)
    w1 = w[:, :, :1, :1].contiguous()
    torch.testing.assert_close(tilegemm.conv2d(x, w1, dilation=2**40), torch.nn.functional.conv2d(x, w1),
                               rtol=1e-4, atol=1e-4)


def test_numpy_integers_are_ints(device):
    """numpy's integers (read from a config, say) stand for ints, as F.conv2d takes them; a tensor does not."""
    np = pytest.importorskip("numpy")
    x = torch.randn(1, 4, 8, 8, device=device)
    w = torch.randn(6, 2, 3, 3, device=device)
    got = tilegemm.conv2d(x, w, None, np.int64(2), (np.int32(1), 1), [np.int64(1)], np.int64(2))
    want = torch.nn.functional.conv2d(x, w, None, 2, 1, 1, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match=r"stride must be an int or a pair of ints, got tensor\(1\)"):
        tilegemm.conv2d(x, w, None, torch.tensor(1), groups=2)
    for padding in (np.array([1, 1]), np.array(1.0), np.array([1])):  # named, not numpy's "only integer scalar arrays"
        with pytest.raises(TypeError, match=r"padding must be an int or a pair of ints, got array\("):
            tilegemm.conv2d(x, w, None, padding=padding, groups=2)
    torch.testing.assert_close(tilegemm.conv2d(x, w, None, padding=np.array(1), groups=2),  # a 0-d array is an int
                               torch.nn.functional.conv2d(x, w, None, padding=1, groups=2), rtol=1e-4, atol=1e-4)


def test_the_checks_trace_under_torch_compile(device):
    """torch.compile traces the argument checks (tuples and ints as nn.Conv2d holds them) in one graph."""
    x = torch.randn(1, 4, 8, 8, device=device)
    w = torch.randn(6, 4, 3, 3, device=device)

    def f(x, w):
        return tilegemm.conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, w)
    torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, None, 1, 1), rtol=1e-4, atol=1e-4)
    # the size checks over symbolic shapes (dynamic), and a padding mode's before F.pad
    conv = tilegemm.nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode="replicate").to(device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: tilegemm.conv2d(x, w, None, 1, (2, 1)), fullgraph=True, backend="eager",
                             dynamic=True)
    for n in (1, 3):
        xs = torch.randn(n, 4, 8 + n, 8, device=device)
        torch.testing.assert_close(compiled(xs, w), torch.nn.functional.conv2d(xs, w, None, 1, (2, 1)), rtol=1e-4,
                                   atol=1e-4)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(conv, fullgraph=True, backend="eager", dynamic=True)(x),
                                   torch.nn.Conv2d.forward(conv, x), rtol=1e-4, atol=1e-4)


def test_a_dynamic_batch_compiles_once(device):
    """The fake keeps symbolic sizes: a dynamic batch (and image size) is not specialized on, so new sizes compile
    nothing and torch.export takes a dynamic batch; it int()-ed each size, a recompile per batch, export refused."""
    w = torch.randn(6, 3, 3, 3, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: tilegemm.conv2d(x, w, None, 1, 1), fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n, h in ((2, 7), (5, 7), (4, 9)):
            x = torch.randn(n, 3, h, 8, device=device)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 2)
            torch.testing.assert_close(compiled(x), torch.nn.functional.conv2d(x, w, None, 1, 1), rtol=1e-4,
                                       atol=1e-4)
    conv = tilegemm.nn.Conv2d(3, 6, 3, padding=1).to(device)
    batch = torch.export.Dim("batch", max=64)
    ep = torch.export.export(conv, (torch.randn(2, 3, 8, 8, device=device),), dynamic_shapes=({0: batch},))
    x = torch.randn(5, 3, 8, 8, device=device)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), torch.nn.Conv2d.forward(conv, x), rtol=1e-4, atol=1e-4)


def _op(x, w, bias=None, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1, activation="none",
        precision="default", kernel="auto", out_dtype=None):
    return torch.ops.tilegemm.conv2d(x, w, bias, list(stride), list(padding), list(dilation), groups, activation,
                                     precision, kernel, out_dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stride=(0, 0)), ValueError, r"stride must be >= 1, got \(0, 0\)"),  # ZeroDivisionError before
    (dict(stride=(1,)), ValueError, "stride must be a list of 2 ints, got \\[1\\]"),  # IndexError before
    (dict(groups=0), ValueError, "groups must be >= 1"),  # ZeroDivisionError before
    (dict(padding=(-1, -1, -1, -1)), ValueError, "padding must be >= 0"),  # ran, reading outside x
    (dict(padding=(1, 1)), ValueError, r"padding must be a list of 4 ints \(top, bottom, left, right\)"),
    (dict(dtype=torch.float64), TypeError, "x has unsupported dtype float64"),  # failed inside the interpreter
    (dict(out_dtype=torch.int32), TypeError, "out_dtype must be None, fp16, bf16 or fp32, got int32"),  # ran
    (dict(x_shape=(4, 6, 6)), ValueError, "x must have 4 dims"),
    (dict(w_shape=(8, 3, 3, 3)), ValueError, "channel mismatch"),
    (dict(activation="tanh"), ValueError, "unknown activation 'tanh'"),
    (dict(precision="tf64"), ValueError, "unknown precision 'tf64'"),
    (dict(kernel="nope"), ValueError, "unknown conv2d kernel 'nope'"),
])
def test_the_registered_op_called_directly_checks_its_arguments(kwargs, error, match, device):
    # torch.ops.tilegemm.conv2d called directly: nothing before it checked the arguments
    x, w = _xw(device, kwargs.pop("x_shape", (1, 4, 6, 6)), kwargs.pop("w_shape", (8, 4, 3, 3)),
               kwargs.pop("dtype", torch.float32))
    with pytest.raises(error, match=match):
        _op(x, w, **kwargs)


@pytest.mark.parametrize("on", ["device", "meta"])
def test_the_registered_op_checks_its_arguments_on_meta_tensors_too(on, device):
    # the fake (meta tensors, torch.compile's trace) made a result of a call that is no convolution
    x, w = _xw(device if on == "device" else "meta", w_shape=(8, 3, 3, 3))
    with pytest.raises(ValueError, match="channel mismatch: x has C=4 channels"):
        _op(x, w)
    with pytest.raises(ValueError, match=r"padding must be a list of 4 ints"):
        _op(*_xw("meta"), padding=(1, 1))


def _dgrad(dy, w, x_shape, padding=(1, 1, 1, 1), groups=1):
    return torch.ops.tilegemm.conv2d_dgrad(dy, w, list(x_shape), False, [1, 1], list(padding), [1, 1], groups,
                                           "default")


def _wgrad(dy, x, w_shape, padding=(1, 1, 1, 1), groups=1):
    return torch.ops.tilegemm.conv2d_wgrad(dy, x, list(w_shape), [1, 1], list(padding), [1, 1], groups, "default")


@pytest.mark.parametrize("on", ["device", "meta"])
@pytest.mark.parametrize("call, match", [
    (lambda t: _dgrad(t(2, 5, 6, 6), t(5, 4, 3, 3), (2, 7, 6, 6)),
     r"x \[2, 7, 6, 6\] has C=7 channels, the weight \[5, 4, 3, 3\] takes 4 a group"),
    (lambda t: _dgrad(t(2, 5, 6, 6), t(5, 4, 3, 3), (2, 4, 9, 9)), r"dy is \[2, 5, 6, 6\], but .* make \[2, 5, 9, 9\]"),
    (lambda t: _dgrad(t(2, 5, 6, 6), t(5, 4, 3, 3), (2, 4, 6, 6), padding=(1, 1)), "padding must be a list of 4"),
    (lambda t: _wgrad(t(2, 5, 6, 6), t(2, 4, 6, 6), (6, 4, 3, 3)), r"dy is \[2, 5, 6, 6\], but .* make \[2, 6, 6, 6\]"),
    (lambda t: _wgrad(t(2, 6, 6, 6), t(2, 4, 6, 6), (6, 2, 3, 3), groups=4), "not divisible by groups=4"),
], ids=["dgrad channels", "dgrad size", "dgrad padding", "wgrad channels", "wgrad groups"])
def test_the_gradient_ops_called_directly_check_the_shapes_they_relate(on, call, match, device):
    # shapes that did not fit read channels or rows that do not exist and returned them
    dev = device if on == "device" else "meta"
    with pytest.raises(ValueError, match=match):
        call(lambda *shape: torch.randn(*shape, device=dev))


def test_the_registered_op_called_directly_still_runs(device):
    x, w = _xw(device, dtype=torch.float16)
    b = torch.randn(8, device=device, dtype=torch.float16)
    out = _op(x, w, b, padding=(1, 0, 0, 1), activation="relu", out_dtype=torch.float32)
    ref = torch.relu(torch.nn.functional.conv2d(torch.nn.functional.pad(x.float(), (0, 1, 1, 0)), w.float(),
                                                b.float()))
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-2, rtol=2e-2)
