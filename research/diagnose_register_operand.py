"""Diagnosis on the GPU: which persistent_tma tf32 candidates with an operand through registers give wrong
tiles, in which layout, shape and epilogue (not a test; tests/test_persistent_tma_sm90.py has the test).

Each candidate, flattened and not, is forced on a few shapes into a NaN-poisoned output, three times, and
compared with an fp64 reference: the relative error of the whole result and the output tiles (of the
config's size) whose own relative error passes 1e-2 (3e-2 for fp8 with its bf16 output). Writes
``$OUT/diagnose-register-operand-<dtype>.json``. The candidates are those for K-major operands (the list
register-operand problems had before 54ccfd1), each flattened and unflattened.

    PYTHONPATH=src python3 research/diagnose_register_operand.py [--layouts NN,TN,TT] [--shapes 1000x776x520]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from tilegemm.core.checks import tile_errors
from tilegemm.core.hardware import machine_info
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import matmul_reference


def bad_tiles(out, ref, bm, bn, bound):
    """[tile row, tile column, error] of every tile whose relative error is not below ``bound``."""
    errs = tile_errors(out, ref, bm, bn)
    return [[i, j, errs[i, j].item()] for i, j in (~(errs < bound)).nonzero().tolist()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="NN,TN,TT")
    ap.add_argument("--shapes", default="1008x784x528,1024x1024x1024",
                    help="16-byte aligned rows for fp8 too (TMA needs them; persistent_tma.describable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="tf32", choices=["tf32", "fp8"], help="fp8: e4m3, per-tensor scales, bf16 out")
    args = ap.parse_args()
    persistent_tma.ensure_allocator()
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = (int(x) for x in shape.split("x"))
        for layout in args.layouts.split(","):
            torch.manual_seed(0)
            a = torch.randn(K, M, device="cuda").mT if layout[0] == "T" else torch.randn(M, K, device="cuda")
            b = torch.randn(N, K, device="cuda").mT if layout[1] == "T" else torch.randn(K, N, device="cuda")
            precision, out_dtype, scales = "tf32", torch.float32, (None, 0, None, 0)
            if args.dtype == "fp8":
                a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                precision, out_dtype = "ieee", torch.bfloat16
                one = torch.ones(1, device="cuda")
                scales = (one, 0, one, 0)
            c = torch.randn(M, N, device="cuda", dtype=out_dtype)
            bias = torch.randn(N, device="cuda", dtype=out_dtype)
            for epi in ("plain", "c+bias"):
                cc, bb, alpha, beta = (None, None, 1.0, 0.0) if epi == "plain" else (c, bias, 1.5, 0.5)
                ref = matmul_reference(a, b, c=cc, bias=bb, alpha=alpha, beta=beta)
                mode = make_problems(a, b, torch.empty(M, N, device="cuda", dtype=out_dtype), cc, bb, alpha, beta,
                                     "none", precision, False, scales)[0].mma_operands
                # The candidates as they were before 54ccfd1 (the fp8 list had one unflattened config; the
                # flattened/unflattened pair of each is tried below).
                cands = persistent_tma.hopper_configs(a.element_size(), "ab")
                for cfg in cands:
                    for flatten in (False, True):
                        cfg2 = dict(cfg, FLATTEN=flatten, WARP_SPECIALIZE=cfg.get("WARP_SPECIALIZE", 0) if not flatten else 0)
                        errs, tiles = [], []
                        try:
                            for _ in range(args.repeats):
                                out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
                                p = make_problems(a, b, out, cc, bb, alpha, beta, "none", precision, False, scales)[0]
                                persistent_tma.launch_config(p, cfg2)
                                torch.cuda.synchronize()
                                o = out.double()
                                errs.append(((o - ref).norm() / ref.norm()).item() if torch.isfinite(o).all()
                                            else float("inf"))
                                tiles.append(bad_tiles(out, ref, cfg["BLOCK_M"], cfg["BLOCK_N"], 3e-2 if args.dtype == "fp8" else 1e-2))
                        except Exception as e:  # noqa: BLE001 - diagnosis: record and go on
                            errs.append(f"error: {str(e)[:120]}")
                        row = dict(shape=shape, layout=layout, mode=mode, epilogue=epi, config=cfg2, errors=errs,
                                   bad_tiles=tiles)
                        rows.append(row)
                        worst = max((e for e in errs if isinstance(e, float)), default=float("nan"))
                        nbad = [len(t) for t in tiles]
                        print(f"{shape} {layout} {mode:5s} {epi:6s} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
                              f"w{cfg['num_warps']} s{cfg['num_stages']} ws{cfg.get('WARP_SPECIALIZE', 0)} "
                              f"flat={int(flatten)}: worst {worst:.1e} bad tiles {nbad}"
                              + ("" if all(isinstance(e, float) for e in errs) else f" {errs[-1]}"), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), f"diagnose-register-operand-{args.dtype}.json")
    with open(path, "w") as f:
        json.dump(dict(machine=machine_info().to_dict(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
