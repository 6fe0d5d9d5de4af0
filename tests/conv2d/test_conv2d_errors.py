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
    ((6, 6), (8, 4, 3, 3), {}, ValueError, r"x must have 4 dims, got shape \[6, 6\]"),
    ((1, 4, 6, 6), (8, 4, 3), {}, ValueError, "weight must have 4 dims"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(activation="tanh"), ValueError, "unknown activation 'tanh'"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(kernel="winograd"), ValueError, "unknown conv2d kernel 'winograd'"),
    ((1, 4, 6, 6), (8, 4, 3, 3), dict(precision="double"), ValueError, "unknown precision 'double'"),
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
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        tilegemm.conv2d(x.tolist(), w)
    with pytest.raises(ValueError, match=r"bias must have shape \[K\] = \[8\], got \[7\]"):
        tilegemm.conv2d(x, w, torch.randn(7, device=device))
    with pytest.raises(TypeError, match="dtypes differ: x is fp32, bias is fp16"):
        tilegemm.conv2d(x, w, torch.randn(8, device=device, dtype=torch.float16))



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


def test_the_checks_trace_under_torch_compile(device):
    """torch.compile traces the argument checks (tuples and ints as nn.Conv2d holds them) in one graph."""
    x = torch.randn(1, 4, 8, 8, device=device)
    w = torch.randn(6, 4, 3, 3, device=device)

    def f(x, w):
        return tilegemm.conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, w)
    torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, None, 1, 1), rtol=1e-4, atol=1e-4)
