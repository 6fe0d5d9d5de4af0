"""Open question (GPU): do wider K steps pay on dense layers whose channels step 16 at a time?

``tma_implicit_gemm`` steps through C/groups 64, 32 or 16 channels at a time, the widest dividing it; a group of
48, 80 or 112 channels steps 16 deep. ``auto`` now pads such a layer's weight (only: the input is read in place) to
``configs.wide_group`` channels, 48 -> 64 (``dispatch.widens_steps``, ``padded.run(p, wide=True)``), on the ground
of the strided 1x1 layers' ragged steps (1.7x-2.3x on 16-wide steps); those layers read 0.40x-0.81x cuDNN.

Times, for the zoo's layers of 16 x odd channels a group (one group, more than one tap; batch 32, channels-last,
fp16 unless ``--dtype``; every layer within ``--budget`` seconds, the largest first), cuDNN's forward, ``auto``
with the wide route off (16-wide steps) and forced on, each checked against cuDNN's fp32 output first, as CUDA
graphs; each row says whether the shipped rule (``widens_steps``: horizontal stride 1, a least amount of work)
takes the layer and which route ran; then the geomeans over all and over the rule's layers (halves: even and odd
layers, for a rule fitted on one and read on the other).

    PYTHONPATH=src:tools python3 research/wide_steps.py [--budget 150] [--dtype fp16] [--out F.json]
    PYTHONPATH=src:tools python3 research/wide_steps.py --dgrad   # the data gradients the rule widens

``--dgrad``: the stride-1 data gradients ``dispatch._dgrad_widens`` takes (16 x odd output channels: dy read in
place, the flipped weight padded), cuDNN's against ``auto``'s with that rule off and on.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from conv2d_depthwise_candidates import geomean, graph_us
from tilegemm.core.checks import relative_error
from tilegemm.ops.conv2d import configs, dispatch, padded, zoo
from tilegemm.ops.conv2d.problem import ConvCall, DgradCall, geometry_of


def _geo(L: dict, batch: int):
    pad = L["padding"]
    return geometry_of((batch, L["C"], L["H"], L["W"]), (L["K"], L["C"] // L["groups"], L["R"], L["S"]),
                       L["stride"], [pad[0], pad[0], pad[1], pad[1]], L["dilation"], L["groups"])


def _candidate(g) -> bool:
    """A layer the wide route could take (the rule's shape conditions without its stride and size guards)."""
    return g.groups == 1 and g.R * g.S > 1 and configs.wide_group(g.Cg) > g.Cg


def layers(batch: int) -> list[dict]:
    """The zoo's candidate layers (non-stems run by the TMA kernel), the most work first."""
    out = [L for L in zoo.bench_layers() if _candidate(_geo(L, batch))
           and dispatch.choose_kernel(_geo(L, batch), True, True, 132) == "tma_implicit_gemm"]
    return sorted(out, key=lambda L: -_geo(L, batch).P * _geo(L, batch).Q * L["K"] * L["C"] * L["R"] * L["S"])


def run_layer(L: dict, batch: int, dtype: torch.dtype) -> dict:
    g = _geo(L, batch)
    pad = list(L["padding"])
    cl = torch.channels_last
    xs = [torch.randn(batch, g.C, g.H, g.W, device="cuda", dtype=dtype).contiguous(memory_format=cl)
          for _ in range(2)]
    w = (torch.randn(g.K, g.Cg, g.R, g.S, device="cuda", dtype=dtype) / (g.Cg * g.R * g.S) ** 0.5)
    w = w.contiguous(memory_format=cl)

    def cudnn(i, dt=None):
        xx, ww = (xs[i], w) if dt is None else (xs[i].to(dt), w.to(dt))
        return F.conv2d(xx, ww, None, L["stride"], pad, L["dilation"], g.groups)

    def auto(wide: bool):
        def run(i):
            dispatch.widens_steps = (lambda g: True) if wide else (lambda g: False)
            return dispatch.forward(ConvCall(xs[i], w, None, list(g.stride), list(g.padding), list(g.dilation),
                                             g.groups, "none", "ieee", "auto"))
        return run

    ref = cudnn(0, torch.float32)
    row = dict(layer=f"{g.C}->{g.K} {g.R}x{g.S} s{g.stride[0]} {g.H}x{g.W} p{pad[0]} d{L['dilation'][0]}",
               models=L.get("models"), rule=rule(g), cudnn_us=graph_us(cudnn, 2))
    _compare(row, ref, auto, "run")
    dispatch.widens_steps = rule
    return row


def _compare(row: dict, ref: torch.Tensor, auto, entry: str) -> None:
    """Each of ``auto(False)`` and ``auto(True)`` checked against ``ref`` and timed into ``row`` (cuDNN time / its
    time; None where wrong or failing), with whether it ran padded's ``entry`` widened."""
    real = getattr(padded, entry)
    for name, fn in (("narrow", auto(False)), ("wide", auto(True))):
        ran = []
        setattr(padded, entry, lambda *a, **k: ran.append(k.get("wide", False)) or real(*a, **k))
        try:
            err = relative_error(fn(0).float(), ref)
            row[f"{name}_route"] = "wide" if any(ran) else "direct"
            row[f"{name}_err"] = err
            row[name] = row["cudnn_us"] / graph_us(fn, 2) if err < 1e-2 else None
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row[name], row[f"{name}_err"] = None, f"{type(e).__name__}: {e}"[:200]
        finally:
            setattr(padded, entry, real)


def _dgrad_candidate(g) -> bool:
    """A stride-1 layer whose data gradient the wide route could take (16 x odd output channels)."""
    return g.stride == (1, 1) and _candidate(dispatch._as_dgrad_forward(g))


def dgrad_layers(batch: int) -> list[dict]:
    """The zoo's candidate data gradients (layers run by the TMA kernel), the most work first."""
    out = [L for L in zoo.bench_layers() if _dgrad_candidate(_geo(L, batch))
           and dispatch.choose_kernel(_geo(L, batch), True, True, 132) == "tma_implicit_gemm"]
    return sorted(out, key=lambda L: -_geo(L, batch).P * _geo(L, batch).Q * L["K"] * L["C"] * L["R"] * L["S"])


def run_dgrad(L: dict, batch: int, dtype: torch.dtype) -> dict:
    g = _geo(L, batch)
    pad = list(L["padding"])
    cl = torch.channels_last
    x_shape = [batch, g.C, g.H, g.W]
    dys = [torch.randn(batch, g.K, g.P, g.Q, device="cuda", dtype=dtype).contiguous(memory_format=cl)
           for _ in range(2)]
    w = (torch.randn(g.K, g.Cg, g.R, g.S, device="cuda", dtype=dtype) / (g.Cg * g.R * g.S) ** 0.5)
    x = torch.empty(x_shape, device="cuda", dtype=dtype).contiguous(memory_format=cl)

    def cudnn(i, dt=None):
        yy, ww, xx = (dys[i], w, x) if dt is None else (dys[i].to(dt), w.to(dt), x.to(dt))
        return torch.ops.aten.convolution_backward(yy, xx, ww, None, L["stride"], pad, L["dilation"], False,
                                                   [0, 0], g.groups, [True, False, False])[0]

    def auto(wide: bool):
        def run(i):
            dispatch._dgrad_widens = _dgrad_candidate if wide else (lambda g: False)
            return dispatch.dgrad(DgradCall(dys[i], w, x_shape, True, list(g.stride), list(g.padding),
                                            list(g.dilation), g.groups, "ieee"))
        return run

    ref = cudnn(0, torch.float32)
    row = dict(layer=f"dgrad {g.C}->{g.K} {g.R}x{g.S} {g.H}x{g.W} p{pad[0]} d{L['dilation'][0]}",
               models=L.get("models"), rule=dgrad_rule(g), cudnn_us=graph_us(cudnn, 2))
    _compare(row, ref, auto, "dgrad")
    dispatch._dgrad_widens = dgrad_rule
    return row


rule = dispatch.widens_steps
dgrad_rule = dispatch._dgrad_widens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--dgrad", action="store_true", help="the data gradients the rule widens")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    start, rows = time.time(), []
    todo = dgrad_layers(args.batch) if args.dgrad else layers(args.batch)
    for L in todo:
        if time.time() - start > args.budget:
            break
        rows.append((run_dgrad if args.dgrad else run_layer)(L, args.batch, dtype))
        r = rows[-1]
        print(f"{r['layer']:<36s} {'rule' if r['rule'] else '    '} {r['cudnn_us']:7.1f}us narrow "
              + (f"{r['narrow']:.2f}" if r["narrow"] else "WRONG") + " wide "
              + (f"{r['wide']:.2f}" if r["wide"] else "WRONG"), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(dtype=args.dtype, batch=args.batch, rows=rows), f, indent=1)
    print(f"{len(rows)} of {len(todo)} layers; cuDNN time / ours, geomean:")
    ruled = [r for r in rows if r["rule"]]
    for name, mine in (("all", rows), ("half 0", rows[0::2]), ("half 1", rows[1::2]), ("rule's", ruled)):
        print(f"  {name:<7s} {len(mine):3d}  narrow {geomean(r['narrow'] for r in mine) or 0:.3f}x"
              f"  wide {geomean(r['wide'] for r in mine) or 0:.3f}x"
              f"  worst {min([(r['wide'] or 0) for r in mine] or [0]):.2f}x")


if __name__ == "__main__":
    main()
