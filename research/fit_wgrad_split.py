"""Which pixel split should the TMA weight gradient (``tma_wgrad.config``) take? Fitted on the timings of every
split 1..64 of ResNet-50's non-1x1-stride-1 layers (``research/compare_conv2d_grads.py --part wgrad --splits``,
H100, CUDA graphs) with no GPU: per layer and tile (64x64, 64x128) the former rule ``min(cdiv(sms, tiles),
patches // 8, 64)``, the shipped cost model (``tma_wgrad.config``, ``tma_wgrad.split_for``: ``rounds * (slice +
FILL) + PER_SLICE * (split - 1)``, a round being the programs that run at once), and the best split timed; geomeans
of best / rule, the model's constants also refitted leaving each layer out.

A split that was not timed reads from its timed neighbours: ``~`` interpolated between two in the same round
count, ``=`` the neighbour in the same round count, ``t`` the shipped config's time from ``wgrad-tiles.txt``.

    PYTHONPATH=src python3 research/fit_wgrad_split.py [--dir benchmarks/results/2026-11-24-h100/7b424ad]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from tilegemm.ops.conv2d.tma_wgrad import FILL, PER_SLICE, slots, split_for

FILLS = (0, 2, 4, 8, 16)
PER_SLICES = (0.5, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)


def gm(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def load(directory: str, sms: int) -> list[dict]:
    """Per layer and tile: geometry, tiles, patches, slots and the times by effective split."""
    from tilegemm.core.runtime import cdiv
    from tilegemm.ops.conv2d import tma_wgrad
    from tilegemm.ops.conv2d.configs import _patch
    from tilegemm.ops.conv2d.problem import geometry_of

    shipped = {}  # the shipped config's time (64x64 at the former rule), from the variants' run
    tiles_txt = os.path.join(directory, "wgrad-tiles.txt")
    if os.path.exists(tiles_txt):
        for line in open(tiles_txt):
            m = re.match(r"(\S+)\s+cuDNN\s+\S+\s+pointer\s+\S+ \(\S+\)\s+tma\s+([\d.]+)", line)
            if m:
                shipped[m[1]] = float(m[2])
    out = []
    for rec in json.load(open(os.path.join(directory, "wgrad-splits.json"))):
        n, c, h, w, k, r, s, st = map(int, re.match(r"n(\d+)c(\d+)h(\d+)w(\d+)k(\d+)r(\d+)s(\d+)/(\d+)",
                                                    rec["layer"]).groups())
        g = geometry_of((n, c, h, w), (k, c, r, s), [st, st], [r // 2] * 4, [1, 1], 1)
        patches = _patch(g, 128)[3]
        for bm, bn in ((64, 64), (64, 128)):
            times = {}
            for key, us in rec["us"].items():
                m = re.fullmatch(rf"{bm}x{bn} s(\d+)", key)
                if m:
                    split = cdiv(patches, cdiv(patches, int(m[1])))  # as run() launches it
                    times[split] = min(us, times.get(split, us))
            lay = dict(layer=rec["layer"], tile=f"{bm}x{bn}", cudnn=rec["cudnn_us"], patches=patches, sms=sms,
                       tiles=cdiv(g.Kg, bm) * cdiv(g.Cg, bn) * g.R * g.S,
                       slots=slots(sms, bm, bn), times=times,
                       shipped=shipped.get(rec["layer"]) if (bm, bn) == (64, 64) else None)
            assert split_for(lay["tiles"], patches, lay["slots"]) == tma_wgrad.config(g, sms, bm, bn)["SPLIT"]
            out.append(lay)
    return out


def time_at(lay: dict, split: int, former: bool = False) -> tuple[float, str]:
    """The time of ``split`` (an effective split), and how it was read (see the module's docstring)."""
    from tilegemm.core.runtime import cdiv

    t = lay["times"]
    if split in t:
        return t[split], ""
    if former and lay["shipped"] is not None:
        return lay["shipped"], "t"
    rounds = lambda s: cdiv(lay["tiles"] * s, lay["slots"])  # noqa: E731
    lo = max(s for s in t if s < split)
    hi = min((s for s in t if s > split), default=lo)
    if rounds(lo) == rounds(hi) == rounds(split) and hi != lo:
        return t[lo] + (t[hi] - t[lo]) * (split - lo) / (hi - lo), "~"
    near = [s for s in (lo, hi) if rounds(s) == rounds(split)] or [min((lo, hi), key=lambda s: abs(s - split))]
    return t[near[0]], "="


def rules(lay: dict, fill=None, per_slice=None) -> dict:
    from tilegemm.core.runtime import cdiv

    p, tiles = lay["patches"], lay["tiles"]
    former = max(1, min(cdiv(lay["sms"], tiles), p // 8, 64))
    kw = {} if fill is None else dict(fill=fill, per_slice=per_slice)
    new = split_for(tiles, p, lay["slots"], **kw)
    return dict(former=cdiv(p, cdiv(p, former)), new=cdiv(p, cdiv(p, new)))


def score(lays, fill, per_slice) -> float:
    return gm([min(lay["times"].values()) / time_at(lay, rules(lay, fill, per_slice)["new"])[0] for lay in lays])


def leave_one_out(lays, fills=FILLS) -> list[float]:
    """Each layer's best / rule with the constants fitted on the other layers (ties: the plateau's middle)."""
    out = []
    for i, lay in enumerate(lays):
        rest = lays[:i] + lays[i + 1:]
        grid = {(f, c): score(rest, f, c) for f in fills for c in PER_SLICES}
        top = max(grid.values())
        plateau = sorted(k for k, v in grid.items() if v >= top - 1e-9)
        f, c = plateau[len(plateau) // 2]
        out.append(min(lay["times"].values()) / time_at(lay, rules(lay, f, c)["new"])[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="benchmarks/results/2026-11-24-h100/7b424ad")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    from tilegemm.core.runtime import cdiv

    data = load(args.dir, args.sms)
    for tile in ("64x64", "64x128"):
        lays = [lay for lay in data if lay["tile"] == tile]
        print(f"\n{tile} tiles ({lays[0]['slots']} programs at once); times in us, best/rule in brackets")
        print(f"{'layer':27s} {'tiles':>5s} {'patches':>7s} | {'former':>15s} | {'new':>15s} | {'best':>10s}")
        former, new, cudnn = [], [], {"former": [], "new": []}
        for lay in lays:
            best_s = min(lay["times"], key=lay["times"].get)
            best = lay["times"][best_s]
            cols = []
            for name in ("former", "new"):
                s = rules(lay)[name]
                t, how = time_at(lay, s, former=name == "former")
                (former if name == "former" else new).append(best / t)
                cudnn[name].append(lay["cudnn"] / t)
                cols.append(f"{s:3d} {t:6.1f}{how:1s} ({best / t:.2f})")
            print(f"{lay['layer']:27s} {lay['tiles']:5d} {lay['patches']:7d} | {cols[0]} | {cols[1]} | "
                  f"{best_s:3d} {best:6.1f}")
        print(f"geomean best/rule: former {gm(former):.3f}, new {gm(new):.3f} (new/former {gm(new) / gm(former):.3f}x); "
              f"cuDNN/rule: former {gm(cudnn['former']):.3f}, new {gm(cudnn['new']):.3f}")
        if tile == "64x64":
            for what, fills in (("FILL, PER_SLICE", FILLS), ("PER_SLICE (FILL=4)", (4,))):
                loo = leave_one_out(lays, fills)
                print(f"leave-one-out, {what} refitted without the layer: {gm(loo):.3f}  "
                      + " ".join(f"{x:.2f}" for x in loo))
            print("in-sample geomean by FILL (rows) and PER_SLICE (columns):")
            print("      " + " ".join(f"{c:>5}" for c in PER_SLICES))
            for f in FILLS:
                print(f"{f:5d} " + " ".join(f"{score(lays, f, c):.3f}" for c in PER_SLICES))

    print("\n64x128 against 64x64, each at its best split, and the model's rounds at the new rule's split:")
    by = {(lay["layer"], lay["tile"]): lay for lay in data}
    gains = []
    for layer in dict.fromkeys(lay["layer"] for lay in data):
        a, b = by[layer, "64x64"], by[layer, "64x128"]
        rounds = [cdiv(x["tiles"] * rules(x)["new"], x["slots"]) for x in (a, b)]
        gains.append(min(a["times"].values()) / min(b["times"].values()))
        print(f"{layer:27s} 64x64 {min(a['times'].values()):6.1f}  64x128 {min(b['times'].values()):6.1f}  "
              f"({gains[-1]:.2f}x)  rounds {rounds[0]} / {rounds[1]}")
    print(f"64x128 / 64x64 at the best splits: geomean {gm(gains):.3f}x")
    print(f"(shipped constants: FILL={FILL}, PER_SLICE={PER_SLICE})")


if __name__ == "__main__":
    main()
