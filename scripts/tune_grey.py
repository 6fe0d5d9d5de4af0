"""Time grey_kernel block/warp variants against torch's copy of the same bytes (GPU machine)."""

import torch
import triton
import triton.testing

import tilegemm  # noqa: F401  (settles the backend)
from tilegemm.ops.guide.api import GREY_WEIGHTS
from tilegemm.ops.guide.kernels import grey_kernel

for side in (2048, 4096, 8192):
    img = torch.randint(0, 256, (1, 3, side, side), device="cuda", dtype=torch.uint8)
    out = torch.empty(1, side * side, device="cuda", dtype=torch.uint8)
    same = torch.empty(2, side, side, device="cuda", dtype=torch.uint8)
    base = triton.testing.do_bench(lambda: same.clone(), warmup=25, rep=200, return_mode="median")
    line = [f"{side:5d}: copy {base * 1e3:6.1f}us"]
    for block in (4096, 8192, 16384, 32768):
        for warps in (4, 8, 16):
            grid = (triton.cdiv(side * side, block), 1)

            def run():
                grey_kernel[grid](img, out, side, side, img.stride(0), img.stride(1), img.stride(2), img.stride(3),
                                  out.stride(0), *GREY_WEIGHTS, PLANES_CONTIGUOUS=True, IS_UINT8=True,
                                  BLOCK=block, num_warps=warps)

            run()
            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
            line.append(f"b{block}/w{warps} {base / ms:.2f}")
    print("  ".join(line))
