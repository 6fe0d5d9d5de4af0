"""The flattened-row depthwise forwards against cuDNN and the pixel kernel: the per-row form
(``research/depthwise_flat.py``, any stride) and the rolled forms (stride 1; shipped as
``tilegemm.ops.conv2d.depthwise.depthwise_rows_kernel``, timed through it with a config forced).

For each layer (MobileNetV2's depthwise layers at batch 64, plus 5x5 and dilated ones no sweep holds) this
times from CUDA graphs (GPU time alone): cuDNN channels-last, ``tilegemm.conv2d`` (``auto``), and every config
of BLOCK x warps x ROWS_PER x ROLL x STAGES (``--blocks``, ``--rows``, ``--rolls``, ``--stages``; ROLL 0 the
per-row form, 1 and 2 the rolled ones, stride-1 undilated layers only). Each variant is checked against an
fp32 ``F.conv2d`` first; a wrong or failing one is recorded, never ranked. Prints each layer's five best configs
with their DRAM rate (input + output bytes over the time) and writes ``--out`` after every layer.

    PYTHONPATH=src:research python3 research/explore_depthwise_flat.py --out depthwise-flat.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default=None, help="names from research/explore_depthwise.py (default: all)")
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--rolls", default="0,1,2", help="ROLL forms for stride-1 layers (0: per row, 1: rolled "
                    "through Triton's pipeliner, 2: rolled with loads STAGES rows ahead in registers)")
    ap.add_argument("--blocks", default="256x2,512x4,1024x8,512x2", help="BLOCKxwarps")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; layers after it are skipped")
    args = ap.parse_args()

    import depthwise_flat
    from explore_depthwise import LAYERS  # name: (N, C, H, W, R, stride, dilation)
    from graph_timing import checked_graph_us, depthwise_case, print_variants
    import tilegemm
    import torch
    import torch.nn.functional as F
    from tilegemm.core.hardware import machine_info
    from tilegemm.ops.conv2d import depthwise

    torch.backends.cudnn.benchmark = True
    start = time.time()
    results = []
    rows_list = [int(r) for r in args.rows.split(",")]
    stages_list = [int(s) for s in args.stages.split(",")]
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    for name in (args.layers.split(",") if args.layers else LAYERS):
        if time.time() - start > args.budget:
            print(f"budget spent: {name} and after skipped")
            break
        N, C, H, W, R, st, d = LAYERS[name]
        x, w, ref, moved, pad, problem = depthwise_case(LAYERS[name])
        row = dict(layer=name, dims=LAYERS[name], bytes=moved, variants={}, flat=[])

        def timed(fn):
            return checked_graph_us(fn, ref)

        row["variants"]["cuDNN"] = timed(lambda: F.conv2d(x, w, None, st, pad, d, C))
        row["variants"]["auto"] = timed(lambda: tilegemm.conv2d(x, w, None, st, pad, d, C))
        rolls = [int(v) for v in args.rolls.split(",")] if st == 1 and d == 1 else [0]
        for (block, warps), rows, roll, stages in itertools.product(blocks, rows_list, rolls, stages_list):
            cfg = dict(BLOCK=block, num_warps=warps, ROWS_PER=rows, ROLL=roll, STAGES=stages)
            if roll:  # the rolled forms: the shipped kernel (1: Triton's pipeliner, 2: loads held in registers)
                shipped = dict(BLOCK=block, num_warps=warps, ROWS_PER=rows, PIPELINE=roll == 1, STAGES=stages)
                fn = (lambda cfg=shipped: depthwise.run(problem, cfg))
            else:
                fn = (lambda cfg=cfg: depthwise_flat.run(x, w, None, (st, st), (pad, pad), (d, d), cfg))
            row["flat"].append(dict(config=cfg, **timed(fn)))
        results.append(row)
        base = row["variants"]["cuDNN"].get("us")
        print(f"== {name} ({moved / 1e6:.1f} MB)")
        print_variants(row["variants"], moved)
        ok = sorted((c for c in row["flat"] if "us" in c), key=lambda c: c["us"])
        for c in ok[:5]:
            print(f"  flat {c['us']:8.1f} us {base / c['us']:5.2f}x {moved / c['us'] / 1e6:5.2f} TB/s {c['config']}")
        bad = [c for c in row["flat"] if "error" in c]
        if bad:
            print(f"  flat: {len(bad)} failed, first {bad[0]['config']}: {bad[0]['error'][:160]}")
        with open(args.out, "w") as f:  # after every layer: a run cut short keeps what it measured
            json.dump(dict(machine=machine_info().to_dict(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
