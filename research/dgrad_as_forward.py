"""Open question (GPU): the data-gradient route of depthwise and few-channels-a-group layers
(``dispatch.dgrad_as_forward``: forward convolutions of dy with the flipped weight, one a stride phase) shipped on
these layer times; its eager training step was slower on ConvNeXt-T than the direct kernels' (``--model``): why?

Times, on the zoo's stride-1 such layers (batch 32, channels-last; every layer, spread over the kinds, within
``--budget`` seconds), cuDNN's data gradient, tilegemm's with the route off and on, each checked against cuDNN's
fp32 gradient, as CUDA graphs; a table of cuDNN time / ours and geomeans per kind last (halves: even and odd
layers).

    PYTHONPATH=src:tools python3 research/dgrad_as_forward.py [--budget 150] [--dtype fp16] [--out F.json]
    PYTHONPATH=src:tools python3 research/dgrad_as_forward.py --model convnext_tiny   # a training step, on and off
    PYTHONPATH=src:tools python3 research/dgrad_as_forward.py --strided               # strided layers, by phases

``--strided``: the zoo's strided such layers, whose data gradient the route runs as four phase convolutions (its
size rule applied, as at stride 1: "forward" is what ``auto`` runs).

``--model NAME``: a converted torchvision model's training step (batch 32, fp16, as
``tools/conv2d_model_profile.py`` builds it) with the route on and off in turns, and cuDNN's: wall milliseconds a
step (eager, the host in the loop) and CUDA milliseconds a step (the profiler's kernel times).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from conv2d_depthwise_candidates import geomean, graph_us
from tilegemm.core.checks import relative_error
from tilegemm.ops.conv2d import dispatch, zoo
from tilegemm.ops.conv2d.configs import takes_grouped_direct
from tilegemm.ops.conv2d.problem import DgradCall, geometry_of


def layers() -> list[dict]:
    out = []
    for L in zoo.bench_layers():
        if list(L["stride"]) != [1, 1] or L["groups"] == 1:
            continue
        g = _geo(L, 32)
        if (g.is_depthwise and g.K == g.C) or takes_grouped_direct(g):
            L["kind"] = (f"dw{L['R']}x{L['S']}" if g.is_depthwise else f"g{g.Cg}")
            out.append(L)
    # spread: round-robin over kinds so that a budget cut keeps every kind
    kinds: dict[str, list] = {}
    for L in out:
        kinds.setdefault(L["kind"], []).append(L)
    spread = []
    while any(kinds.values()):
        for k in list(kinds):
            if kinds[k]:
                spread.append(kinds[k].pop(0))
    return spread


def strided_layers() -> list[dict]:
    out = []
    for L in zoo.bench_layers():
        if list(L["stride"]) == [1, 1] or L["groups"] == 1 or list(L["dilation"]) != [1, 1]:
            continue
        g = _geo(L, 32)
        if (g.is_depthwise and g.K == g.C) or takes_grouped_direct(g):
            L["kind"] = f"dw{L['R']}x{L['S']}s{L['stride'][0]}" if g.is_depthwise else f"g{g.Cg}s{L['stride'][0]}"
            out.append(L)
    return out


def _geo(L: dict, batch: int):
    pad = L["padding"]
    return geometry_of((batch, L["C"], L["H"], L["W"]), (L["K"], L["C"] // L["groups"], L["R"], L["S"]),
                       L["stride"], [pad[0], pad[0], pad[1], pad[1]], L["dilation"], L["groups"])


def run_layer(L: dict, batch: int, dtype: torch.dtype) -> dict:
    """One layer's row: cuDNN's data gradient, then tilegemm's direct kernel and ``auto`` with the route's kinds on,
    each checked against cuDNN's fp32 gradient."""
    g = _geo(L, batch)
    pad = list(L["padding"])
    x_shape = [batch, g.C, g.H, g.W]
    w = torch.randn(g.K, g.Cg, g.R, g.S, device="cuda", dtype=dtype) / (g.Cg * g.R * g.S) ** 0.5
    dy = [torch.randn(batch, g.K, g.P, g.Q, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
          for _ in range(2)]
    x = torch.empty(x_shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)

    def cudnn(i, dt=None):
        yy, ww, xx = (dy[i], w, x) if dt is None else (dy[i].to(dt), w.to(dt), x.to(dt))
        return torch.ops.aten.convolution_backward(yy, xx, ww, None, L["stride"], pad, L["dilation"], False,
                                                   [0, 0], g.groups, [True, False, False])[0]

    def auto(i):
        return dispatch.dgrad(DgradCall(dy[i], w, x_shape, True, list(g.stride), list(g.padding),
                                        list(g.dilation), g.groups, "ieee"))

    def with_kinds(kinds):
        def run(i):
            dispatch.DGRAD_AS_FORWARD_KINDS = kinds
            return auto(i)
        return run

    ref = cudnn(0, torch.float32)
    row = dict(layer=f"{g.C}->{g.K} {g.R}x{g.S} s{g.stride[0]} {g.H}x{g.W} g{g.groups} p{pad[0]} d{L['dilation'][0]}",
               kind=L["kind"], models=L.get("models"), cudnn_us=graph_us(cudnn, 2))
    for name, fn in (("direct", with_kinds(())), ("forward", with_kinds(("depthwise", "grouped")))):
        try:
            err = relative_error(fn(0).float(), ref)
        except Exception as e:  # noqa: BLE001 - a phase the forward refuses: recorded, not fatal
            row[name], row[f"{name}_err"] = None, f"{type(e).__name__}: {e}"[:200]
            continue
        row[f"{name}_err"] = err
        row[name] = row["cudnn_us"] / graph_us(fn, 2) if err < 1e-2 else None
    return row


def model_ab(name: str, rounds: int = 3, steps: int = 8) -> dict:
    import copy
    import statistics

    import tilegemm
    from conv2d_model_profile import kernel_times
    from tilegemm.core import replay
    from tilegemm.models import torchvision_models as tvm
    from tilegemm.models.bench import _train_deterministic

    torch.manual_seed(0)
    image = tvm.image_size(name)
    base = tvm.calibrate_batch_norms(tvm.build(name).eval().cuda().to(memory_format=torch.channels_last), image)
    ref = _train_deterministic(base.half())
    ours = _train_deterministic(tilegemm.nn.convert_(copy.deepcopy(base.half())))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, image, image, generator=gen).cuda().half().contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (32,), generator=gen).cuda()

    def wall(model):
        for _ in range(2):
            tvm.gradients(model, x, target, 1024.0)
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            tvm.gradients(model, x, target, 1024.0)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    sides = {"cudnn": (ref, None), "on": (ours, ("depthwise", "grouped")), "off": (ours, ())}
    walls = {k: [] for k in sides}
    for _ in range(rounds):
        for k, (model, kinds) in sides.items():
            if kinds is not None:
                dispatch.DGRAD_AS_FORWARD_KINDS = kinds
                replay.clear()
            walls[k].append(wall(model))
    row = dict(model=name)
    for k, (model, kinds) in sides.items():
        if kinds is not None:
            dispatch.DGRAD_AS_FORWARD_KINDS = kinds
            replay.clear()
        row[f"{k}_wall_ms"] = min(walls[k])
        row[f"{k}_cuda_ms"] = sum(kernel_times(model, x, target, "train", 3).values()) / 1e3
    print(f"{name}: wall ms cuDNN {row['cudnn_wall_ms']:.2f}, off {row['off_wall_ms']:.2f}, on {row['on_wall_ms']:.2f}"
          f"; CUDA ms cuDNN {row['cudnn_cuda_ms']:.2f}, off {row['off_cuda_ms']:.2f}, on {row['on_cuda_ms']:.2f}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="a torchvision model's training step, on and off (repeatable)")
    ap.add_argument("--strided", action="store_true", help="the strided layers (the route's stride phases)")
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    if args.model:
        rows = [model_ab(m) for m in args.model]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(models=rows), f, indent=1)
        return
    start, rows = time.time(), []
    todo = strided_layers() if args.strided else layers()
    for L in todo:
        if time.time() - start > args.budget:
            break
        rows.append(run_layer(L, args.batch, dtype))
        r = rows[-1]
        print(f"{r['layer']:<34s} {r['kind']:<6s} {r['cudnn_us']:7.1f}us direct "
              + (f"{r['direct']:.2f}" if r["direct"] else "WRONG") + " forward "
              + (f"{r['forward']:.2f}" if r["forward"] else "WRONG"), flush=True)
    print(f"{len(rows)} of {len(todo)} layers; cuDNN time / ours, geomean (direct, auto with the route):")
    for k in [*dict.fromkeys(r["kind"] for r in rows), "all"]:
        mine = [r for r in rows if k == "all" or r["kind"] == k]
        print(f"  {k:<6s} {len(mine):3d}  direct {geomean(r['direct'] for r in mine) or 0:.3f}x"
              f"  forward {geomean(r['forward'] for r in mine) or 0:.3f}x"
              f"  worst {min((r['forward'] or 0) for r in mine):.2f}x")  # (0: a wrong or refused one)
    for half in (0, 1):
        mine = rows[half::2]
        print(f"  half {half} {len(mine):3d}  direct {geomean(r['direct'] for r in mine) or 0:.3f}x"
              f"  forward {geomean(r['forward'] for r in mine) or 0:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(dtype=args.dtype, batch=args.batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
