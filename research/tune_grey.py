"""Time rgb_to_grey variants through the public call, against torch's copy of the same bytes (GPU machine)."""

import torch
import triton.testing

import tilegemm
from tilegemm.ops.guide import api, kernels

variants = [dict(STREAM=s, num_warps=w, block_bytes=b) for s in (False, True) for w in (8, 16) for b in (4096, 8192)]
for side in (2048, 4096, 8192):
    img = torch.randint(0, 256, (3, side, side), device="cuda", dtype=torch.uint8)
    same = torch.empty(2, side, side, device="cuda", dtype=torch.uint8)
    base = triton.testing.do_bench(lambda: same.clone(), warmup=25, rep=200, return_mode="median")
    line = [f"{side:5d}: copy {base * 1e3:6.1f}us"]
    for v in variants:
        kernels.GREY_TUNING.update(v)
        api._replays.clear()
        tilegemm.rgb_to_grey(img)
        ms = triton.testing.do_bench(lambda: tilegemm.rgb_to_grey(img), warmup=25, rep=200, return_mode="median")
        line.append(f"{'S' if v['STREAM'] else '-'}w{v['num_warps']}b{v['block_bytes']} {base / ms:.3f}")
    print("  ".join(line))
