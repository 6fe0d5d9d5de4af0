"""Depthwise forward candidates on the zoo's depthwise layers, timed against cuDNN and today's ``auto`` (GPU).

For each of the zoo's 227 depthwise layers (``src/tilegemm/ops/conv2d/zoo.json``; batch 32, fp16, channels-last,
no bias), ordered so the kinds that lose most come first (strided, then stride-1 5x5, 7x7, odd channel counts,
1024 channels or more, the other 3x3s; within a kind spread over the sizes): cuDNN (``F.conv2d`` with
``torch.backends.cudnn.benchmark``), ``auto`` (``tilegemm.conv2d``) and each candidate config of the depthwise
kernels that takes the layer (``depthwise_strided_rows_kernel`` at 8, 4 and 2 elements a thread, pipelined or
not; ``depthwise_strided_tile_kernel`` by filter size; ``depthwise_rows_kernel`` at 2 elements a thread, and on
stride-1 filters past 3x3 (5x5, 7x7) also at 1 and 2 with the weight read tap-major; ``depthwise_window_kernel`` (every
stride-1 filter, 3x3 included) at 4 and 8 columns a thread of one channel, 2 of two, 4 and 8 with the next row loaded ahead, registers capped
or not: see ``CANDIDATES``; 3 to 11 a layer). Each candidate's output is checked against ``F.conv2d`` (the
conv2d bench's fp16 bound, ``reference.tolerance``) before it is timed; all are timed as CUDA-graph replays (up
to 20 calls a graph, about 2 ms a replay, rotating through input sets that overflow L2 twice; the median of 5 rounds of
replays), ratio = cuDNN's time / the candidate's. Triton compiles run ahead in a pool of processes (compiled,
not launched; the cache on disk is shared), so timing waits on few. Writes ``--out`` (JSON) after every layer
and stops at ``--budget`` seconds; prints a table last: per kind, the geomean ratio of ``auto`` and of each
layer's best candidate, and each candidate's geomean over the layers it ran.

    PYTHONPATH=src python3 tools/conv2d_depthwise_candidates.py --out $OUT/depthwise-candidates.json
        [--budget 150] [--limit N] [--workers 12] [--kinds strided,5x5] [--candidates rows2,win8t]

The stride-1 5x5 and 7x7 layers only (57: 12 7x7, 45 5x5; 7x7 first), every candidate that takes them (rows2,
rows2t, rows1t, win4t, win4ta, win8t, win8ta, win2v2t; win8t-r128, srows2 and tile7 on 7x7), ``auto`` and cuDNN,
in under 4 minutes:

    PYTHONPATH=src python3 tools/conv2d_depthwise_candidates.py --filter large-s1 --budget 200 \
        --out $OUT/depthwise-large-s1.json

``--smoke``: a check that the tool runs, on the CPU under Triton's interpreter (batch 1, at most 16 channels
and 8x8 images, one call timed by the clock; the pool's warm-up path runs in-process instead):

    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/conv2d_depthwise_candidates.py --smoke --limit 3 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

KINDS = ("strided", "5x5", "7x7", "odd-C", "large-C", "3x3")

# name -> (config, whether it takes a layer). The strided row kernel's flat form at 8 elements a thread (16-byte
# fp16 loads; 3x3 filters: 72 weight registers, 147 in all on sm_90), 4 (up to 5x5: 166), 2 on 4 warps (any
# filter up to 7x7: 145), pipelined (Triton's pipeliner, 3 stages) at 8 and 4; its tile form (depthwise_strided_tile_kernel: a thread's channels
# keep their weights for 2 columns: 3x3 16 outputs a thread in 202 registers, 5x5 8 in 228 with 8-byte
# vectors, 7x7 4 in 198 with 4-byte ones); the stride-1 row kernel at 2 elements a thread (fewer weights in
# registers than auto's 4: 96 registers at 5x5 against 172). Register counts: ptxas for sm_90, fp16.
#
# Stride-1 filters past 3x3 (the row kernel up to 7x7 by config; the window kernel; docs/conv2d.md, "Depthwise
# window kernel"): "t" reads the weight rewritten tap-major (a second launch, coalesced weight loads). rows2 at 7x7
# 164 registers, rows1 (one element a thread) 96; win4 (4 columns a thread, one channel) 72 at 5x5 and 110 at 7x7,
# win8 109 and 146, win2v2 (2 columns of 2 channels, 4-byte loads) 163 at 7x7; "a": the next row's window loaded
# ahead (135 at 7x7 and QT 4, 233 at QT 8 uncapped). maxnreg caps ptxas (Triton's option): win4ta in 128 (four
# programs an SM), win8ta in 168 (three) and win8t-r128 (7x7) in 128, none spilling at 7x7. The window configs are
# configs.depthwise_window_tile's for the layer (its column groups and channel block follow the image's width and
# the channels), these its keywords. The strided kernels' 5x5 configs
# lost to rows2 on every stride-1 5x5 layer (2f092e8/): they run on strided layers only.
def _s1(L: dict) -> bool:
    return L["stride"] == [1, 1] and L["dilation"] == [1, 1]


def _large_s1(L: dict) -> bool:
    return _s1(L) and 9 < L["R"] * L["S"] <= 49


def _window_s1(L: dict) -> bool:  # the window kernel's stride-1 layers, 3x3 included
    return _s1(L) and 1 < L["R"] * L["S"] <= 49


CANDIDATES = {
    "srows8": (dict(BLOCK=512, STAGES=1, num_warps=2), lambda L: L["R"] * L["S"] <= 9),
    "srows4": (dict(BLOCK=256, STAGES=1, num_warps=2), lambda L: L["R"] * L["S"] <= 9 or
               (not _s1(L) and L["R"] * L["S"] <= 25)),
    "srows8-pipe": (dict(BLOCK=512, STAGES=3, num_warps=2), lambda L: L["R"] * L["S"] <= 9),
    "srows4-pipe": (dict(BLOCK=256, STAGES=3, num_warps=2), lambda L: not _s1(L) and 9 < L["R"] * L["S"] <= 25),
    "srows2": (dict(BLOCK=256, STAGES=1, num_warps=4), lambda L: L["R"] * L["S"] > 25 or
               (not _s1(L) and L["R"] * L["S"] > 9)),
    "tile3": (dict(BLOCK_Q=32, BLOCK_C=32, VEC=8, STAGES=1, num_warps=2), lambda L: L["R"] * L["S"] <= 9),
    "tile5": (dict(BLOCK_Q=16, BLOCK_C=32, VEC=4, STAGES=1, num_warps=2),
              lambda L: not _s1(L) and 9 < L["R"] * L["S"] <= 25),
    "tile7": (dict(BLOCK_Q=16, BLOCK_C=16, VEC=2, STAGES=1, num_warps=2), lambda L: L["R"] * L["S"] > 25),
    "rows2": (dict(BLOCK=256, ROWS_PER=32, num_warps=4), lambda L: _s1(L) and L["R"] * L["S"] <= 49),
    "rows2t": (dict(BLOCK=256, ROWS_PER=32, num_warps=4, TAP_MAJOR=True), _large_s1),
    "rows1t": (dict(BLOCK=128, ROWS_PER=32, num_warps=4, TAP_MAJOR=True), _large_s1),
    "win4t": (dict(qt=4), _window_s1),
    "win4ta": (dict(qt=4, ahead=True, maxnreg=128), _window_s1),
    "win8t": (dict(qt=8), _window_s1),
    "win8t-r128": (dict(qt=8, maxnreg=128), lambda L: _large_s1(L) and L["R"] * L["S"] > 25),
    "win8ta": (dict(qt=8, ahead=True, maxnreg=168), _window_s1),
    "win2v2t": (dict(qt=2, vec=2), _window_s1),
}


def kind(layer: dict) -> str:
    if "kind" in layer:  # a smoke-test copy keeps its layer's
        return layer["kind"]
    if layer["stride"] != [1, 1]:
        return "strided"
    taps = layer["R"] * layer["S"]
    if taps >= 49:
        return "7x7"
    if taps >= 25:
        return "5x5"
    if layer["C"] % 8:
        return "odd-C"
    if layer["C"] >= 1024:
        return "large-C"
    return "3x3"


def _spread(items: list) -> list:
    """``items`` (sorted) reordered so that any prefix covers their range: both ends, then midpoints, breadth
    first."""
    if len(items) < 3:
        return list(items)
    order, spans = [0, len(items) - 1], [(0, len(items) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return [items[i] for i in order]


def ordered_layers(kinds=KINDS) -> list[dict]:
    from tilegemm.ops.conv2d import zoo

    layers = [L for L in zoo.bench_layers() if L["groups"] == L["C"] > 1 and L["K"] % L["C"] == 0]
    out = []
    for k in kinds:
        mine = sorted((L for L in layers if kind(L) == k), key=lambda L: (L["C"] * L["H"] * L["W"], L["C"]))
        out += _spread(mine)
    return out


def label(L: dict, batch: int) -> str:
    (sh, sw), (ph, pw) = L["stride"], L["padding"]
    return f"n{batch}c{L['C']}h{L['H']}w{L['W']}r{L['R']}s{L['S']}/{sh}x{sw}p{ph}x{pw}"


def shrink(L: dict) -> dict:
    """A smoke-test copy of ``L``: at most 16 channels (more where the count is not a multiple of 8, keeping its
    remainder) and 8x8 images."""
    c = min(L["C"], 16 + L["C"] % 8)
    return dict(L, C=c, K=c * (L["K"] // L["C"]), groups=c, H=min(L["H"], 8), W=min(L["W"], 8), kind=kind(L))


def out_rows(L: dict) -> int:
    return (L["H"] + 2 * L["padding"][0] - L["dilation"][0] * (L["R"] - 1) - 1) // L["stride"][0] + 1


SELECTED: set | None = None  # --candidates: the names timed (None: all)


def candidate_names(L: dict) -> list[str]:
    return [name for name, (_, takes) in CANDIDATES.items() if takes(L) and (SELECTED is None or name in SELECTED)]


def _config(name: str, L: dict, smoke: bool) -> dict:
    cfg = dict(CANDIDATES[name][0])
    if "qt" in cfg:  # the window kernel: configs.depthwise_window_tile's for the layer
        from tilegemm.ops.conv2d.configs import depthwise_window_tile
        from tilegemm.ops.conv2d.problem import geometry_of

        (ph, pw), dil = L["padding"], list(L["dilation"])
        g = geometry_of((1, L["C"], L["H"], L["W"]), (L["K"], 1, L["R"], L["S"]), list(L["stride"]),
                        [ph, ph, pw, pw], dil, L["C"])
        window = depthwise_window_tile(g, torch.float16, **cfg)
        if smoke:
            window.update(BLOCK_G=2, BLOCK_C=16, WINDOW_ROWS=4)
        return window
    if smoke:  # interpreter: small blocks, one row group or a few
        if "BLOCK" in cfg:
            cfg["BLOCK"] = 32
        else:
            cfg.update(BLOCK_Q=4, BLOCK_C=16)
        if "ROWS_PER" in cfg:
            cfg["ROWS_PER"] = 4
    if "ROWS_PER" in cfg:
        from tilegemm.ops.conv2d.configs import _DEPTHWISE_PIPELINE_ROWS

        pipe = out_rows(L) >= _DEPTHWISE_PIPELINE_ROWS  # auto's loop form for the image's height
        cfg.update(PIPELINE=pipe, STAGES=3 if pipe and not smoke else 1)
    else:
        cfg["STRIDED_ROWS"] = 4 if smoke else 8 if L["stride"][0] > 1 else 16
    return cfg


def make_calls(L: dict, batch: int, device: str, sets: int, smoke: bool, empty: bool = False):
    """(inputs, weight, reference, {name: fn(i)}) of layer ``L``: cuDNN, auto and each candidate, input set i.
    ``empty``: tensors left unwritten and no reference (for compiling only)."""
    import tilegemm
    from tilegemm.ops.conv2d import depthwise
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

    dtype = torch.float32 if smoke else torch.float16
    C, K, H, W, R, S = (L[k] for k in ("C", "K", "H", "W", "R", "S"))
    stride, (ph, pw), dil = tuple(L["stride"]), L["padding"], tuple(L["dilation"])
    if empty:  # no GPU work at all
        xs = [torch.empty(batch, C, H, W, device=device, dtype=dtype, memory_format=torch.channels_last)]
        w = torch.empty(K, 1, R, S, device=device, dtype=dtype)
        ref = None
    else:
        xs = [torch.randn(batch, C, H, W, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
              for _ in range(sets)]
        w = (torch.randn(K, 1, R, S, device=device) / (R * S) ** 0.5).to(dtype)
        ref = F.conv2d(xs[0].float(), w.float(), None, stride, (ph, pw), dil, C)
    g = geometry_of(xs[0].shape, w.shape, list(stride), [ph, ph, pw, pw], list(dil), C)
    problems = [ConvProblem(x, w, None, g, dtype, torch.channels_last, "none", "ieee", False) for x in xs]
    calls = {
        "cudnn": lambda i: F.conv2d(xs[i], w, None, stride, (ph, pw), dil, C),
        "auto": lambda i: tilegemm.conv2d(xs[i], w, None, stride, (ph, pw), dil, C),
    }
    for name in candidate_names(L):
        cfg = _config(name, L, smoke)
        calls[name] = (lambda c: lambda i: depthwise.run(problems[i], dict(c)))(cfg)
    return xs, w, ref, calls


def warm(args) -> str:
    """Pool task: compile each named call's kernels for a layer without launching them (Triton's ``warmup``;
    nothing runs on the GPU beside the timing), so that Triton's cache on disk holds them."""
    from tilegemm.ops.conv2d import depthwise

    def compile_only(kernel, grid, a, kw, keep=(), stream=None):
        return kernel.warmup(*a, grid=grid, **kw)

    L, batch, names, device = args
    real, depthwise.launch = depthwise.launch, compile_only
    try:
        _, _, _, calls = make_calls(L, batch, device, 1, device == "cpu", empty=True)
        for name in names:
            try:
                calls[name](0)
            except Exception:  # noqa: BLE001  (the main process meets it again and reports it)
                if device == "cpu":
                    raise
    finally:
        depthwise.launch = real
    return label(L, batch)


def graph_us(fn, sets: int, rounds: int = 5, most_calls: int = 20) -> float:
    """Median over ``rounds`` of the GPU microseconds a call of ``fn(i)`` takes in replays of one CUDA graph of
    calls cycling through ``sets`` input sets (a warm call on a side stream first): as many calls, up to
    ``most_calls``, as make about 2 ms a replay, so a large layer costs little of the budget."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(sets):
            fn(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(0)
        end.record()
    end.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    once = max(1.0, start.elapsed_time(end) * 1e3)  # us, the host's launch time included
    calls = max(sets, min(most_calls, int(2000 / once)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            fn(c % sets)
    graph.replay()
    torch.cuda.synchronize()
    reps = 4 if calls >= 8 else 2
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * calls))
    return statistics.median(times)


def clock_us(fn) -> float:
    start = time.perf_counter()
    fn(0)
    return (time.perf_counter() - start) * 1e6


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summary(rows: list[dict]) -> str:
    lines = [f"{'kind':10} {'layers':>6} {'auto':>7} {'best':>7}  best candidates"]
    for k in KINDS:
        mine = [r for r in rows if r["kind"] == k]
        if not mine:
            continue
        wins: dict[str, int] = {}
        for r in mine:
            if r.get("best"):
                wins[r["best"]] = wins.get(r["best"], 0) + 1
        auto = geomean(r["ratio"].get("auto") for r in mine)
        best = geomean(r["ratio"].get(r["best"]) if r.get("best") else None for r in mine)
        lines.append(f"{k:10} {len(mine):6d} {auto or 0:7.3f} {best or 0:7.3f}  "
                     + ", ".join(f"{n} x{c}" for n, c in sorted(wins.items(), key=lambda t: -t[1])))
    auto_all = geomean(r["ratio"].get("auto") for r in rows)
    best_all = geomean(r["ratio"].get(r["best"]) if r.get("best") else None for r in rows)
    lines.append(f"{'all':10} {len(rows):6d} {auto_all or 0:7.3f} {best_all or 0:7.3f}  (ratio = cuDNN / it)")
    lines.append("")
    lines.append(f"{'candidate':12} {'layers':>6} {'geomean':>8} {'auto on them':>12} {'worst':>7} {'<0.8x':>6}")
    for name in ["auto"] + list(CANDIDATES):
        got = [(r["ratio"][name], r["ratio"].get("auto")) for r in rows if r["ratio"].get(name)]
        if got:
            lines.append(f"{name:12} {len(got):6d} {geomean(a for a, _ in got):8.3f} "
                         f"{geomean(b for _, b in got) or 0:12.3f} {min(a for a, _ in got):7.3f} "
                         f"{sum(a < 0.8 for a, _ in got):6d}")
    return "\n".join(lines)


def common_arguments(ap: argparse.ArgumentParser, kinds) -> None:
    """The options the conv2d candidates tools share (this one and conv2d_pointwise_candidates.py)."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds from the start; stops after the layer "
                    "running then")
    ap.add_argument("--limit", type=int, default=None, help="at most this many layers")
    ap.add_argument("--kinds", default=",".join(kinds), help="kinds of layer, in order: " + ",".join(kinds))
    ap.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 4)),
                    help="processes compiling ahead (0: none)")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny layers: that the tool runs")


def chosen_kinds(ap: argparse.ArgumentParser, text: str, known) -> list[str]:
    """``--kinds``'s names, each one of ``known`` (else the parser's error)."""
    kinds = [k for k in text.split(",") if k]
    bad = [k for k in kinds if k not in known]
    if bad:
        ap.error(f"unknown kinds {bad}; known: {known}")
    return kinds


def setting(ap: argparse.ArgumentParser, args, layers: list, shrink_layer, tool: str, **meta):
    """What a candidates tool's run is: (layers, smoke, device, batch, tolerance, meta, L2 bytes). A smoke run
    (interpreter, CPU) takes each layer shrunk, batch 1 and fp32; a GPU run batch 32 and fp16."""
    smoke = args.smoke
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--smoke runs under Triton's interpreter: set TRITON_INTERPRET=1")
        layers = [shrink_layer(L) for L in layers]
    elif not torch.cuda.is_available():
        ap.error("no CUDA GPU: run with --smoke (and TRITON_INTERPRET=1) on a CPU")
    batch = 1 if smoke else 32
    torch.backends.cudnn.benchmark = True
    from tilegemm.ops.conv2d.reference import tolerance

    tol = tolerance(torch.float32 if smoke else torch.float16)
    meta = dict(tool=tool, batch=batch, dtype="fp32" if smoke else "fp16", layout="channels_last", smoke=smoke,
                budget_s=args.budget, **meta, tolerance=tol,
                timing="CUDA-graph replays, median of 5 rounds" if not smoke else "one call, host clock (interpreter)")
    l2 = 0
    if not smoke:
        import triton

        props = torch.cuda.get_device_properties(0)
        meta.update(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                    triton=triton.__version__)
        l2 = getattr(props, "L2_cache_size", 0) or 0
    return layers, smoke, "cpu" if smoke else "cuda", batch, tol, meta, l2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap, KINDS)
    ap.add_argument("--filter", default=None, help="a preset of layers: 'large-s1' = the stride-1 5x5 and 7x7 "
                    "layers (--kinds 7x7,5x5), 7x7 first")
    ap.add_argument("--candidates", default=None, help="comma-separated candidate names to time (default: all "
                    "that take a layer): " + ",".join(CANDIDATES))
    args = ap.parse_args(argv)
    t0 = time.time()
    global SELECTED
    if args.filter is not None:
        if args.filter != "large-s1":
            ap.error(f"unknown --filter {args.filter!r}; known: large-s1")
        args.kinds = "7x7,5x5"
    SELECTED = None
    if args.candidates:
        SELECTED = set(args.candidates.split(","))
        bad = sorted(SELECTED - set(CANDIDATES))
        if bad:
            ap.error(f"unknown candidates {bad}; known: {list(CANDIDATES)}")
    layers = ordered_layers(chosen_kinds(ap, args.kinds, KINDS))[: args.limit]
    layers, smoke, device, batch, tol, meta, l2 = setting(
        ap, args, layers, shrink, "conv2d_depthwise_candidates", candidates={n: CANDIDATES[n][0] for n in CANDIDATES})
    from tilegemm.ops.conv2d.reference import relative_error

    pool = None
    pending = {}
    if not smoke and args.workers > 0:
        import multiprocessing as mp

        seen = set()
        pool = mp.get_context("spawn").Pool(args.workers)
        for L in layers:  # one task a layer, naming the calls whose kernels an earlier task does not compile
            from tilegemm.ops.conv2d.implicit_gemm import _divisor

            P = out_rows(L)
            Q = (L["W"] + 2 * L["padding"][1] - L["dilation"][1] * (L["S"] - 1) - 1) // L["stride"][1] + 1
            shape = (L["R"], L["S"], tuple(L["stride"]), tuple(L["dilation"]), _divisor(L["C"]),
                     (Q * L["K"]) % 16 == 0, (P * Q * L["K"]) % 16 == 0, (L["W"] * L["C"]) % 16 == 0,
                     P >= 48)
            # a candidate's config may follow the layer (the window kernel's blocks), and tap-major weights
            # specialize on K's divisibility: both part of what one compile covers
            keys = {n: (n, shape, L["K"] % 16 == 0,
                        json.dumps(_config(n, L, False), sort_keys=True) if n in CANDIDATES else "")
                    for n in ["auto"] + candidate_names(L)}
            names = [n for n, key in keys.items() if key not in seen]
            seen.update(keys[n] for n in names)
            pending[label(L, batch)] = pool.apply_async(warm, ((L, batch, names, "cuda"),)) if names else None

    rows = []
    stopped = None
    for L in layers:
        if time.time() - t0 > args.budget:
            stopped = f"budget: {len(rows)} of {len(layers)} layers"
            break
        name = label(L, batch)
        job = pending.get(name)
        if job is not None:
            import multiprocessing as mp

            try:
                job.get(timeout=max(1.0, args.budget - (time.time() - t0)))
            except mp.TimeoutError:  # its compiles not done within the budget: stop rather than compile here
                stopped = f"budget, compiling: {len(rows)} of {len(layers)} layers"
                break
            except Exception as err:  # noqa: BLE001  (compiled here instead)
                print(f"{name}: warm-up: {type(err).__name__}: {err}", file=sys.stderr)
        if smoke:  # the pool's path, once (under the interpreter a warm-up compiles nothing)
            warm((L, batch, ["auto"] + candidate_names(L), "cpu"))
        sets = 1
        if not smoke and l2:
            per_set = batch * L["C"] * L["H"] * L["W"] * 2
            sets = max(1, min(8, -(-2 * l2 // per_set)))
        xs, w, ref, calls = make_calls(L, batch, device, sets, smoke)
        row = dict(label=name, kind=kind(L), layer={k: L[k] for k in ("C", "K", "H", "W", "R", "S", "stride",
                                                                      "padding", "dilation")},
                   models=L["models"], us={}, ratio={}, error={}, failed={},
                   configs={n: _config(n, L, smoke) for n in candidate_names(L)})
        for cname, fn in calls.items():
            try:
                out = fn(0)
                err = relative_error(out, ref)
                row["error"][cname] = err
                if not err <= tol:
                    row["failed"][cname] = f"relative error {err:.3e} > {tol:.1e}"
                    continue
                row["us"][cname] = clock_us(fn) if smoke else graph_us(fn, sets)
            except Exception as exc:  # noqa: BLE001  (recorded; the other candidates still run)
                row["failed"][cname] = f"{type(exc).__name__}: {str(exc)[:300]}"
        base = row["us"].get("cudnn")
        for cname, us in row["us"].items():
            if cname != "cudnn" and base:
                row["ratio"][cname] = base / us
        cands = {n: r for n, r in row["ratio"].items() if n in CANDIDATES}
        row["best"] = max(cands, key=cands.get) if cands else None
        rows.append(row)
        del xs, w, ref, calls
        best = row["best"]
        print(f"{name:34} {row['kind']:8} cudnn {base or 0:8.1f} us  auto {row['ratio'].get('auto', 0):5.2f}x  "
              f"best {best} {row['ratio'].get(best, 0) if best else 0:5.2f}x"
              + (f"  failed: {sorted(row['failed'])}" if row["failed"] else ""), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta, elapsed_s=time.time() - t0, stopped=stopped, layers=rows), f, indent=1)
    if pool is not None:
        pool.terminate()
    with open(args.out, "w") as f:
        json.dump(dict(meta, elapsed_s=time.time() - t0, stopped=stopped, layers=rows), f, indent=1)
    if stopped:
        print(f"stopped at the {stopped}")
    print(f"{len(rows)} layers in {time.time() - t0:.0f} s; {args.out}")
    print(summary(rows))
    return 0 if all(not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
