"""``tilegemm.copy`` and ``tilegemm.rgb_to_grey``: checks, output allocation, launch."""

from __future__ import annotations

import torch

from tilegemm import registry
from tilegemm.launch import ReplayCache, recording
from tilegemm.runtime import interpreting, new_output

GREY_WEIGHTS = (0.2989, 0.5870, 0.1140)
MAX_DIMS = 6


_replays = ReplayCache()


def _run(op: str, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch ``op``'s kernel, replaying the recorded launch when an identical call was seen before."""
    if interpreting() or type(x) is not torch.Tensor:
        registry.get(op, name).launcher()(x, out)
        return
    key = (op, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
    hit = _replays.get(key)
    if hit is not None:
        hit(x, out)
        return
    with recording() as rec:
        registry.get(op, name).launcher()(x, out)
    _replays.store(key, rec.launches, (x, out))


def _check_device(t: torch.Tensor, name: str) -> None:
    if not interpreting() and t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}, but a CUDA GPU is in use: move it to the GPU "
                         "(or set TILEGEMM_INTERPRET=1 to run Triton's interpreter on the CPU)")


def copy(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor equal to ``x`` (any shape up to 6 dims, any strides, any real dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise TypeError(f"copy does not support complex dtype {x.dtype}")
    if x.dim() > MAX_DIMS:
        raise ValueError(f"copy supports up to {MAX_DIMS} dims, got {x.dim()}")
    _check_device(x, "x")
    out = new_output(x.shape, x.dtype, x.device)
    if x.numel():
        _run("copy", "flat", x, out)
    return out


def rgb_to_grey(img: torch.Tensor) -> torch.Tensor:
    """``0.2989 R + 0.5870 G + 0.1140 B`` of a ``[..., 3, H, W]`` image, as ``[..., H, W]``.

    uint8 images give uint8, rounded to nearest; float images (fp16, bf16, fp32, fp64 as fp32 math)
    keep their dtype. Any strides.
    """
    if not isinstance(img, torch.Tensor):
        raise TypeError(f"img must be a torch.Tensor, got {type(img).__name__}")
    if img.dtype not in (torch.uint8, torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"rgb_to_grey takes uint8, float16, bfloat16 or float32 images, got {img.dtype}")
    if img.dim() < 3 or img.shape[-3] != 3:
        raise ValueError(f"rgb_to_grey needs an image of shape [..., 3, H, W], got {list(img.shape)}")
    _check_device(img, "img")
    out = new_output((*img.shape[:-3], *img.shape[-2:]), img.dtype, img.device)
    if out.numel():
        _run("grey", "planar", img, out)
    return out
