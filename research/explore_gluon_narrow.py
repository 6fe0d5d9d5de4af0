"""Does gluon_f16 with a K step and an N tile cut to the layer run MobileNetV2's narrow 1x1 layers faster?

``gluon_f16`` (persistent, warp-specialized, TMA-store epilogue) took ResNet-50's wide 1x1 layers from 0.77x to
1.09x of cuDNN, but on the narrow ones it wastes its tile: a 64-wide K step over 16-32 channels (TMA fills
the rest with zeros, the MMAs still run) and 128 output channels a tile over 16-32 (32 -> 16 at 112x112:
44.7 us against cuDNN's 26.8; 24 -> 144 at 56x56 42.7 / 29.0; 16 -> 96 73.2 / 58.4;
``2026-11-25-h200/cec87aa/pointwise.json``). The kernel is generic over BLOCK_K and BLOCK_N; only the host side
fixes BLOCK_K = 64 and the shipped tiles. This times (CUDA graphs) cuDNN, ``tilegemm.conv2d`` (``auto``) and
gluon_f16 with BLOCK_K in 16/32/64 and BLOCK_N in 16..256 (as wide as the layer's output channels and
narrower), 128- and 256-row tiles, the deepest ring that fits; every variant checked against cuDNN first.
Writes ``--out`` after every layer; prints each layer's best five.

``--compile-only`` compiles every config for sm_90 without a GPU (and reports PTX facts), to check before a
GPU run that the kernel takes them.

    PYTHONPATH=src:research python3 research/explore_gluon_narrow.py --out narrow.json
    PYTHONPATH=src:research:tests TILEGEMM_INTERPRET=0 python3 research/explore_gluon_narrow.py --compile-only
"""

from __future__ import annotations

import argparse
import json

LAYERS = {  # name: (N, C, H, K): MobileNetV2's narrow 1x1 layers at batch 64, and ResNet-50's 64 -> 256
    "32->16@112": (64, 32, 112, 16),
    "16->96@112": (64, 16, 112, 96),
    "24->144@56": (64, 24, 56, 144),
    "144->24@56": (64, 144, 56, 24),
    "96->24@56": (64, 96, 56, 24),
    "32->192@28": (64, 32, 28, 192),
    "192->32@28": (64, 192, 28, 32),
    "144->32@28": (64, 144, 28, 32),
    "resnet-64->256@56": (32, 64, 56, 256),
    "resnet-64->64@56": (32, 64, 56, 64),
    "resnet-256->64@56": (32, 256, 56, 64),
}


def pow2_at_least(n: int) -> int:
    p = 16
    while p < n:
        p *= 2
    return p


def configs(C: int, K: int) -> list[dict]:
    """gluon_f16 configs for a C -> K layer: K steps from the channels' power of two down to 16 (at most 64),
    N tiles from the output's power of two (at most 256) down to 16, 128 or 256 rows, the deepest ring that fits
    beside an unshared output buffer."""
    from tilegemm.core.hardware import HOPPER_SMEM_PER_BLOCK

    out = []
    bks = sorted({min(64, pow2_at_least(C)), min(32, pow2_at_least(C)), 16}, reverse=True)
    bns = sorted({min(256, pow2_at_least(K)), min(128, pow2_at_least(K)), min(64, pow2_at_least(K))}, reverse=True)
    for bm in (256, 128):
        for bn in bns:
            if bm * bn > 256 * 128:
                continue
            for bk in bks:
                stages = 8
                while stages > 2 and stages * (bm + bn) * bk * 2 + bm * bn * 2 + 1024 > HOPPER_SMEM_PER_BLOCK:
                    stages -= 1
                out.append(dict(GLUON_F16=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                                SHARED_OUT=False, num_warps=4))
    return out


def launch_args(p, cfg: dict, num_sms: int):
    """``gluon_f16.launch_args`` with the K step of ``cfg`` (the shipped one fixes 64)."""
    from tilegemm.ops.matmul import gluon_f16

    kernel, grid, args, kwargs = gluon_f16.launch_args(p, cfg, num_sms)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a, b = (gluon_f16.host_descriptor(*box) for box in p.tma_boxes(bm, bn, bk))
    return kernel, grid, (a, b) + tuple(args[2:]), dict(kwargs, BLOCK_K=bk)


def compile_only(layers: dict) -> None:
    """Compile every layer's configs for sm_90 (no GPU) and print what the PTX says."""
    import re

    import torch
    from conftest import SM90  # tests/conftest.py: signature helpers and compile_sm90
    from tilegemm.ops.matmul import gluon_f16
    from tilegemm.ops.matmul.problem import make_problems

    helpers: dict = {}
    exec(SM90, helpers)  # noqa: S102 - the test suite's own offline-compile helpers
    seen = set()
    for name, (N, C, H, K) in layers.items():
        M = N * H * H
        a = torch.empty(M, C, dtype=torch.float16)
        b = torch.empty(K, C, dtype=torch.float16).T
        p = make_problems(a, b, torch.empty(M, K, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee",
                          False)[0]
        for cfg in configs(C, K):
            key = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["STAGES"])
            if key in seen:
                continue
            seen.add(key)
            kernel, _, args, kwargs = launch_args(p, cfg, 132)
            sig, constexprs, attrs = helpers["launch_signature"](kernel, args, kwargs)
            try:
                compiled, ptx, info = helpers["compile_sm90"](kernel, sig, constexprs, attrs, 4)
            except Exception as e:  # noqa: BLE001 - exploration: report and go on
                print(f"{name} {key}: FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info)]
            print(f"{name} {key}: {len(re.findall(r'wgmma.mma_async', ptx))} wgmma, shared {compiled.metadata.shared}"
                  f", spills {max(spills) if spills else '?'}")
    del gluon_f16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    layers = {name: LAYERS[name] for name in args.layers.split(",")}
    if args.compile_only:
        compile_only(layers)
        return

    import tilegemm
    import torch
    import torch.nn.functional as F
    from graph_timing import checked_graph_us, pointwise_case, print_variants
    from tilegemm.core.hardware import machine_info, sm_count
    from tilegemm.core.launch import launch
    from tilegemm.ops.matmul.persistent_tma import ensure_allocator
    from tilegemm.ops.matmul.problem import make_problems

    torch.backends.cudnn.benchmark = True
    ensure_allocator()
    sms = sm_count(torch.device("cuda"))
    results = []
    for name, (N, C, H, K) in layers.items():
        x, w, ref, moved, x2d, w2d, ref2d = pointwise_case(N, C, H, K)
        row = dict(layer=name, dims=[N, C, H, K], bytes=moved, variants={}, gluon=[])

        timed = checked_graph_us

        row["variants"]["cuDNN"] = timed(lambda: F.conv2d(x, w), ref)
        row["variants"]["auto"] = timed(lambda: tilegemm.conv2d(x, w), ref)
        M = x2d.shape[0]
        for cfg in configs(C, K):
            def gluon(cfg=cfg):
                out = torch.empty(M, K, device="cuda", dtype=torch.float16)
                p = make_problems(x2d, w2d, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
                launch(*launch_args(p, cfg, sms))
                return out

            row["gluon"].append(dict(config=cfg, **timed(gluon, ref2d)))
        results.append(row)
        base = row["variants"]["cuDNN"].get("us")
        print(f"== {name} ({moved / 1e6:.1f} MB)")
        print_variants(row["variants"], moved, width=8)
        ok = sorted((c for c in row["gluon"] if "us" in c), key=lambda c: c["us"])
        for c in ok[:5]:
            cf = c["config"]
            print(f"  gluon {cf['BLOCK_M']}x{cf['BLOCK_N']}x{cf['BLOCK_K']} s{cf['STAGES']} {c['us']:8.1f} us "
                  f"{base / c['us']:5.2f}x")
        bad = [c for c in row["gluon"] if "error" in c]
        if bad:
            print(f"  {len(bad)} failed, first {bad[0]['config']}: {bad[0]['error'][:120]}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(machine=machine_info().to_dict(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
