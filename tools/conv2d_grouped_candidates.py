"""Grouped (not depthwise) convolutions of the zoo with few channels a group: cuDNN, today's ``auto`` and each
candidate kernel, every output checked against ``F.conv2d`` before it is timed (run on the GPU machine):

    PYTHONPATH=src python3 tools/conv2d_grouped_candidates.py --out $OUT/conv2d-grouped-candidates.json

    --budget SECONDS   stop starting layers (and candidates) after this long, compiles included (default 150)
    --most-channels N  layers of at most N channels a group (default 64)
    --part I/N         every N-th layer of the order from the I-th (several calls cover all 84 layers)
    --more             also the variants less likely to win (``packed64-s4``, ``direct-c64``)
    --smoke            under TRITON_INTERPRET=1 on the CPU: one tiny layer per channels-a-group bucket, every
                       candidate checked, times from one call (not GPU performance); checks the tool itself

The layers are ``src/tilegemm/ops/conv2d/zoo.json``'s grouped ones (groups > 1, not depthwise) at batch 32, fp16,
channels-last activations and weights (as ``model.to(memory_format=torch.channels_last)`` leaves them), no
bias, in buckets by channels a group, the worst kinds first (4, 8, 16, then 24 up) and taken round-robin over
the buckets, each bucket's largest layers first, so that a run cut by the budget still covers every bucket.
Each kernel is timed as CUDA-graph replays (:func:`tilegemm.bench.runner.graph_us_per_call`: GPU time, no
host; the L2 is not cleared between calls, for cuDNN alike), cuDNN with ``torch.backends.cudnn.benchmark``.
ratio = cuDNN time / the kernel's (above 1: faster than cuDNN).

Candidates (``grouped_packed``: several groups a tensor-core tile, the weight tile block-diagonal):
``packed64`` its default config (about 64 channels a tile); ``packed16`` (groups of at most 4) / ``packed32`` /
``packed128`` tiles of about 16 / 32 / 128 channels (128: 8 warps; fewer channels a tile waste fewer of the
block-diagonal tile's products); ``flat16`` / ``flat32`` tiles of about 16 / 32 channels (groups of at most
8 / 16) whose K steps hold several taps (``TAPS_FLAT``: 64-deep steps however few the channels);
``packed64-m64`` 64-pixel tiles; ``packed64-s4`` a 4-deep pipeline (``--more``); ``tma-gtD``:
``grouped_packed_tma`` (tma_implicit_gemm over D-group blocks with a block-diagonal weight written each call)
for the largest D dividing the groups with at most 64 and 128 channels a block; ``grouped_direct`` where it
takes the layer and ``auto`` does not already run it, and its CUDA-core tiles with more reuse: ``direct-m128``
(128 pixels a tile), ``direct-c64`` (about 64 channels a tile; ``--more``). A candidate that does not take a
layer is recorded with its reason.

The JSON (written after every layer): per layer its dims, models, ``auto``'s kernel, cuDNN's time, and per
candidate its time, ratio, relative error and config. Printed last: per bucket the geomean ratio of ``auto``
and of each layer's best candidate, and which candidate won how often.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tilegemm  # noqa: E402
from tilegemm.core.checks import relative_error  # noqa: E402
from tilegemm.core.registry import NotApplicable  # noqa: E402
from tilegemm.core.runtime import interpreting  # noqa: E402
from tilegemm.ops.conv2d import zoo  # noqa: E402
from tilegemm.ops.conv2d.checks import check_conv  # noqa: E402
from tilegemm.ops.conv2d.configs import grouped_packed_config, grouped_packed_tma_groups  # noqa: E402
from tilegemm.ops.conv2d.problem import ConvProblem  # noqa: E402
from tilegemm.ops.conv2d.reference import tolerance  # noqa: E402

CL = torch.channels_last
SCHEMA = "tilegemm-conv2d-grouped-candidates/1"
BUCKET_ORDER = (4, 8, 16, 2, 24, 32, 48, 56, 64)  # the worst kinds first (docs/conv2d.md, the zoo's first run)


def elapsed() -> float:
    return time.perf_counter() - START


def grouped_layers(most: int) -> list[dict]:
    """The zoo's grouped non-depthwise layers of at most ``most`` channels a group (input and output), round-robin
    over buckets of channels a group (:data:`BUCKET_ORDER` first, then the rest ascending), each bucket's
    layers by decreasing work."""
    buckets: dict[int, list] = {}
    for layer in zoo.bench_layers():
        G, C, K = layer["groups"], layer["C"], layer["K"]
        if G <= 1 or G == C or C // G > most or K // G > most:
            continue
        buckets.setdefault(C // G, []).append(layer)
    for rows in buckets.values():
        rows.sort(key=lambda l: -(l["K"] * l["H"] * l["W"] * l["C"] // l["groups"] * l["R"] * l["S"]
                                  // (l["stride"][0] * l["stride"][1])))
    order = [b for b in BUCKET_ORDER if b in buckets] + sorted(b for b in buckets if b not in BUCKET_ORDER)
    out, i = [], 0
    while any(i < len(buckets[b]) for b in order):
        out += [buckets[b][i] for b in order if i < len(buckets[b])]
        i += 1
    return out


def smoke_layer(layer: dict) -> dict:
    """A tiny version of ``layer`` for the interpreter: at most 3 groups, a 7x7 image (odd), its filter,
    stride and padding kept."""
    g = min(layer["groups"], 3)
    return dict(layer, C=layer["C"] // layer["groups"] * g, K=layer["K"] // layer["groups"] * g, groups=g,
                H=min(layer["H"], 7), W=min(layer["W"], 7))


def candidates(g, p, auto_kernel: str, more: bool) -> dict:
    """name -> (config or None, a function that runs the candidate once and returns its output); ``more``: the
    variants less likely to win too (a 4-deep pipeline, CUDA-core tiles of 64 channels)."""
    from tilegemm.ops.conv2d import grouped_direct, grouped_packed

    out = {}
    base = grouped_packed_config(g, torch.float16)
    variants = {"packed64": base}
    for name, per in (("packed16", 16), ("packed32", 32), ("packed128", 128)):
        if per == 16 and g.Cg > 4:
            continue  # 16 channels a tile: for the smallest groups only (4 groups of 4 in a 16x16 weight tile)
        cfg = grouped_packed_config(g, torch.float16, tile_channels=per)
        if per == 128:
            cfg.update(BLOCK_M=128, num_warps=8)
        if cfg["GT"] != base["GT"] or per == 128 and cfg != base:
            variants[name] = cfg
    if base["BLOCK_M"] != 64:
        variants["packed64-m64"] = dict(base, BLOCK_M=64)
    if more and not interpreting():
        variants["packed64-s4"] = dict(base, num_stages=4)
    # taps in the K steps (TAPS_FLAT): few groups a tile (fewer wasted products) in 64-deep steps all the same
    for name, per in (("flat16", 16), ("flat32", 32)):
        if max(g.Cg, g.Kg) <= per // 2:
            cfg = grouped_packed_config(g, torch.float16, tile_channels=per)
            variants[name] = dict(cfg, TAPS_FLAT=True)
    for name, cfg in variants.items():
        out[name] = (cfg, lambda cfg=cfg: grouped_packed.run(p, dict(cfg)))
    for per in (64, 128):
        gt = grouped_packed_tma_groups(g, per)
        name = f"tma-gt{gt}"
        if gt > 1 and name not in out:
            out[name] = (dict(GT=gt), lambda gt=gt: grouped_packed.run_tma(p, dict(GT=gt)))
    try:
        grouped_direct.check(g)
    except NotApplicable:
        return out
    if auto_kernel != "grouped_direct":
        out["grouped_direct"] = (None, lambda: grouped_direct.run(p))
    # CUDA-core tiles with more reuse: 128 pixels (each weight load feeds twice the pixels), or about 64 channels
    kgp = 1 << (g.Kg - 1).bit_length()
    for name, bm, per in (("direct-m128", 128, 32), ("direct-c64", 64, 64))[:2 if more else 1]:
        cfg = dict(BLOCK_M=bm, BLOCK_G=min(1 << (g.groups - 1).bit_length(), max(1, per // kgp)), num_warps=4)
        out[name] = (cfg, lambda cfg=cfg: grouped_direct.run(p, dict(cfg)))
    return out


def time_us(fn, smoke: bool) -> float:
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from tilegemm.bench.runner import graph_us_per_call

    return graph_us_per_call(fn)


def run_layer(layer: dict, batch: int, device: str, smoke: bool, budget: float, more: bool) -> dict:
    from tilegemm.ops.conv2d.dispatch import _auto_kernel

    torch.manual_seed(0)
    C, K, H, W, R, S, G = (layer[k] for k in ("C", "K", "H", "W", "R", "S", "groups"))
    stride, padding, dilation = tuple(layer["stride"]), tuple(layer["padding"]), tuple(layer["dilation"])
    x = torch.randn(batch, C, H, W, device=device).half().contiguous(memory_format=CL)
    w = (torch.randn(K, C // G, R, S, device=device) / math.sqrt(C // G * R * S)).half().contiguous(memory_format=CL)
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=G)
    ref = F.conv2d(x.float(), w.float(), None, **conv)
    g = check_conv(x, w, None, stride, padding, dilation, G)
    p = ConvProblem(x, w, None, g, torch.float16, CL, "none", "ieee", False)
    auto_kernel = _auto_kernel(p)
    row = dict(dims=dict(N=batch, C=C, K=K, H=H, W=W, R=R, S=S, stride=list(stride), padding=list(padding),
                         dilation=list(dilation), groups=G, Cg=C // G, Kg=K // G, P=g.P, Q=g.Q),
               models=layer.get("models", []), auto_kernel=auto_kernel, candidates={})
    tol = tolerance(torch.float16)

    def measure(fn):
        out = fn()
        err = relative_error(out, ref)
        if not err <= tol:
            return dict(error=f"relative error {err:.3e} > {tol:.1e}", err=err)
        us = time_us(fn, smoke)
        return dict(us=us, err=err)

    cudnn = measure(lambda: F.conv2d(x, w, None, **conv))
    row["cudnn_us"] = cudnn.get("us")
    row["cudnn_err"] = cudnn.get("err")
    runs = {"auto": (None, lambda: tilegemm.conv2d(x, w, None, **conv))}
    runs.update(candidates(g, p, auto_kernel, more))
    for name, (cfg, fn) in runs.items():
        if name != "auto" and elapsed() > budget:
            row["candidates"][name] = dict(skipped="budget")
            continue
        t = time.perf_counter()
        try:
            res = measure(fn)
        except NotApplicable as err:
            res = dict(skipped=str(err))
        except Exception as err:  # a candidate that fails is recorded, not fatal: the others still run
            res = dict(error=f"{type(err).__name__}: {err}", trace=traceback.format_exc(limit=3)[-800:])
        res["s"] = round(time.perf_counter() - t, 2)  # compile included on a first use
        if cfg is not None:
            res["config"] = cfg
        if res.get("us") and row["cudnn_us"]:
            res["ratio"] = row["cudnn_us"] / res["us"]
        row["candidates"][name] = res
    timed = {n: r for n, r in row["candidates"].items() if n != "auto" and "ratio" in r}
    if timed:
        best = max(timed, key=lambda n: timed[n]["ratio"])
        row["best"], row["best_ratio"] = best, timed[best]["ratio"]
    return row


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def table(rows: list[dict]) -> str:
    buckets: dict[int, list] = {}
    for r in rows:
        buckets.setdefault(r["dims"]["Cg"], []).append(r)
    lines = ["channels a group | layers | auto (geomean cuDNN/ours) | best candidate | wins",
             "---|---|---|---|---"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for cg in sorted(buckets):
        rs = buckets[cg]
        auto = geomean(r["candidates"].get("auto", {}).get("ratio") for r in rs)
        best = geomean(max(r.get("best_ratio") or 0, r["candidates"].get("auto", {}).get("ratio") or 0) or None
                       for r in rs)
        wins: dict[str, int] = {}
        for r in rs:
            if r.get("best"):
                wins[r["best"]] = wins.get(r["best"], 0) + 1
        lines.append(f"{cg} | {len(rs)} | {fmt(auto)} | {fmt(best)} | "
                     + ", ".join(f"{n} {c}" for n, c in sorted(wins.items(), key=lambda kv: -kv[1])))
    worst = sorted((r for r in rows if r.get("best_ratio")), key=lambda r: r["best_ratio"])[:5]
    if worst:
        lines.append("worst after the best candidate: " + "; ".join(
            f"{r['dims']['C']}/{r['dims']['groups']} {r['dims']['H']}x{r['dims']['W']} s{r['dims']['stride'][0]} "
            f"{r['best']} {r['best_ratio']:.2f}x (auto {fmt(r['candidates'].get('auto', {}).get('ratio'))})"
            for r in worst))
    return "\n".join(lines)


def write(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write (after every layer)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds, compiles included (default 150)")
    ap.add_argument("--most-channels", type=int, default=64, help="at most this many channels a group (64)")
    ap.add_argument("--batch", type=int, default=zoo.BATCH)
    ap.add_argument("--smoke", action="store_true", help="tiny layers under TRITON_INTERPRET=1 on the CPU")
    ap.add_argument("--part", default="0/1", help="I/N: every N-th layer of the order from the I-th (default 0/1)")
    ap.add_argument("--more", action="store_true", help="also the variants less likely to win")
    args = ap.parse_args(argv)
    if args.smoke and not interpreting():
        ap.error("--smoke runs under the interpreter: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    device = "cpu" if args.smoke else "cuda"
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # the fp32 reference exact to fp32
    part, parts = (int(v) for v in args.part.split("/"))
    if not 0 <= part < parts:
        ap.error("--part I/N needs 0 <= I < N")
    layers = grouped_layers(args.most_channels)[part::parts]
    if args.smoke:  # a layer a bucket, stride 1 and 2 in turn where the bucket has both
        by_cg: dict[int, list] = {}
        for layer in layers:
            by_cg.setdefault(layer["C"] // layer["groups"], []).append(layer)
        picked = []
        for j, rows in enumerate(by_cg.values()):
            pick = next((l for l in rows if l["stride"][0] == 1 + j % 2), rows[0])
            picked.append(smoke_layer(pick))
        layers, batch = picked, 1
    else:
        batch = args.batch
    doc = dict(schema=SCHEMA, device=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
               torch=torch.__version__, commit=os.environ.get("TILEGEMM_GIT_COMMIT"), smoke=args.smoke,
               batch=batch, dtype="fp16", memory_format="channels_last", timing="cuda-graph replays, GPU us",
               budget_s=args.budget, part=args.part, more=args.more, layers_total=len(layers), layers=[])
    for i, layer in enumerate(layers):
        if elapsed() > args.budget:
            doc["stopped"] = f"budget: {len(doc['layers'])} of {len(layers)} layers in {elapsed():.0f} s"
            break
        try:
            row = run_layer(layer, batch, device, args.smoke, args.budget, args.more)
        except Exception as err:  # a layer that cannot run (memory, cuDNN) is recorded; the others still run
            doc.setdefault("failed", []).append(dict(layer={k: layer[k] for k in zoo.FIELDS[:-2]},
                                                     error=f"{type(err).__name__}: {err}"))
            print(f"layer {i + 1} failed: {type(err).__name__}: {err}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        doc["layers"].append(row)
        doc["elapsed_s"] = round(elapsed(), 1)
        write(args.out, doc)
        auto = row["candidates"].get("auto", {})
        print(f"[{elapsed():6.1f}s] {i + 1}/{len(layers)} C{row['dims']['C']}/g{row['dims']['groups']} "
              f"(Cg {row['dims']['Cg']}) {row['dims']['H']}x{row['dims']['W']} s{row['dims']['stride'][0]}: "
              f"cuDNN {row['cudnn_us'] or 0:.1f} us, auto={row['auto_kernel']} "
              f"{auto.get('ratio') or 0:.2f}x, best {row.get('best')} {row.get('best_ratio') or 0:.2f}x",
              flush=True)
    doc["elapsed_s"] = round(elapsed(), 1)
    write(args.out, doc)
    print(table(doc["layers"]))
    if doc.get("stopped"):
        print(doc["stopped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
