"""tilegemm.copy and tilegemm.rgb_to_grey: every element, every layout, clear errors."""

from __future__ import annotations

import pytest
import torch

import tilegemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(1,), (17,), (5000,), (3, 7), (2, 3, 4, 5)], ids=str)
def test_copy_contiguous(dtype, shape, device):
    x = (torch.randn(shape, device=device) * 50).to(dtype)
    out = tilegemm.copy(x)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, x)
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.randn(30, 40, device=d).t(),
        lambda d: torch.randn(5, 8, 9, device=d)[:, ::3, 1:],
        lambda d: torch.randn(2, 3, 4, 5, 6, device=d).permute(4, 2, 0, 3, 1),
        lambda d: torch.randn(7, device=d).expand(4, 7),
        lambda d: torch.arange(120, device=d).reshape(4, 5, 6)[..., ::2].transpose(0, 2),
    ],
    ids=["transposed", "sliced", "permuted-5d", "expanded", "flipped-int"],
)
def test_copy_strided(make, device):
    x = make(device)
    assert not x.is_contiguous()
    out = tilegemm.copy(x)
    assert out.is_contiguous() and torch.equal(out, x)


def test_copy_edge_cases(device):
    assert tilegemm.copy(torch.randn(0, 3, device=device)).shape == (0, 3)
    scalar = torch.tensor(2.5, device=device)
    assert torch.equal(tilegemm.copy(scalar), scalar)
    with pytest.raises(TypeError, match="complex"):
        tilegemm.copy(torch.randn(3, dtype=torch.complex64, device=device))
    with pytest.raises(ValueError, match="up to 6 dims"):
        tilegemm.copy(torch.randn([1] * 7, device=device))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        tilegemm.copy([1, 2])


def _grey_ref(img: torch.Tensor) -> torch.Tensor:
    f = img.to(torch.float32)
    g = 0.2989 * f[..., 0, :, :] + 0.5870 * f[..., 1, :, :] + 0.1140 * f[..., 2, :, :]
    if img.dtype == torch.uint8:
        return (g + 0.5).clamp(0, 255).to(torch.uint8)
    return g.to(img.dtype)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hw", [(1, 1), (17, 33), (64, 64), (3, 1000)], ids=str)
def test_grey_values(dtype, hw, device):
    H, W = hw
    img = (torch.randint(0, 256, (3, H, W), device=device, dtype=torch.uint8) if dtype == torch.uint8
           else torch.rand(3, H, W, device=device).to(dtype))
    out = tilegemm.rgb_to_grey(img)
    assert out.shape == (H, W) and out.dtype == dtype
    # uint8: off by one at exact .5 ties; floats: one ulp of the output (FMA vs separate roundings)
    tol = {torch.uint8: (0, 1), torch.bfloat16: (8e-3, 8e-3), torch.float16: (1e-3, 1e-3), torch.float32: (1e-6, 1e-6)}
    torch.testing.assert_close(out, _grey_ref(img), rtol=tol[dtype][0], atol=tol[dtype][1])


def test_grey_matches_the_float64_formula_within_rounding(device):
    img = torch.randint(0, 256, (3, 200, 300), device=device, dtype=torch.uint8)
    d = img.double()
    ref = (0.2989 * d[0] + 0.5870 * d[1] + 0.1140 * d[2]).round()
    diff = (tilegemm.rgb_to_grey(img).double() - ref).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # only exact .5 ties can differ


def test_grey_batched_and_strided(device):
    base = torch.randint(0, 256, (4, 3, 40, 50), device=device, dtype=torch.uint8)
    for img in (base, base[:, :, ::2, 1:], base.permute(0, 1, 3, 2), base[::2], base.unsqueeze(0).expand(2, 4, 3, 40, 50)):
        out = tilegemm.rgb_to_grey(img)
        assert out.shape == (*img.shape[:-3], *img.shape[-2:])
        torch.testing.assert_close(out, _grey_ref(img), rtol=0, atol=1)
    # batch dims that do not merge into one stride
    scattered = torch.randint(0, 256, (3, 5, 3, 8, 8), device=device, dtype=torch.uint8).transpose(0, 1)
    torch.testing.assert_close(tilegemm.rgb_to_grey(scattered), _grey_ref(scattered), rtol=0, atol=1)


def test_grey_errors(device):
    with pytest.raises(ValueError, match=r"shape \[\.\.\., 3, H, W\], got \[4, 8, 8\]"):
        tilegemm.rgb_to_grey(torch.rand(4, 8, 8, device=device))
    with pytest.raises(ValueError, match="got \\[8, 8\\]"):
        tilegemm.rgb_to_grey(torch.rand(8, 8, device=device))
    with pytest.raises(TypeError, match="int32"):
        tilegemm.rgb_to_grey(torch.ones(3, 8, 8, dtype=torch.int32, device=device))


def test_meta_tensors_give_meta_results():
    # shapes and dtypes without values, as tilegemm.matmul's (they had crashed inside Triton's launch)
    out = tilegemm.copy(torch.empty(3, 5, device="meta").t())
    assert out.is_meta and out.shape == (5, 3) and out.is_contiguous()
    grey = tilegemm.rgb_to_grey(torch.empty(2, 3, 8, 6, dtype=torch.uint8, device="meta"))
    assert grey.is_meta and grey.shape == (2, 8, 6) and grey.dtype == torch.uint8


def test_negative_views_are_read_as_their_values(device):
    # z.conj().imag is a negative view: its memory holds the values negated and a bit says so
    z = torch.randn(6, 7, dtype=torch.complex64, device=device)
    v = z.conj().imag
    assert v.is_neg()
    assert torch.equal(tilegemm.copy(v), v.resolve_neg())
    assert torch.equal(tilegemm.copy(v), v.resolve_neg())  # (a repeated call: on the GPU, the replayed launch)
    img = torch.rand(2, 3, 5, 4, dtype=torch.complex64, device=device).conj().imag
    ref = (0.2989 * img[:, 0] + 0.5870 * img[:, 1] + 0.1140 * img[:, 2]).resolve_neg()
    torch.testing.assert_close(tilegemm.rgb_to_grey(img), ref)
