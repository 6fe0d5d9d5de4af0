"""1x1 layers that conv2d's ``auto`` runs as GEMMs: cuDNN against cuBLAS, ``tilegemm.matmul`` and the matmul rungs'
candidate configs on the same GEMM (GPU; a diagnosis, not a test).

``auto`` (``src/tilegemm/ops/conv2d/dispatch.py``) runs many single-group 1x1 convolutions as the GEMM
``[N*P*Q, C] x [C, K]`` on the channels-last view (the weight ``[K, C]`` read transposed; strided ones on the kept
pixels gathered first: ``gemm_1x1.py``). Where such a layer trails cuDNN, this says whether the GEMM itself is the
gap (cuDNN ahead of cuBLAS too) or tilegemm's choice of GEMM kernel (some config of the matmul rungs ahead of
``matmul-auto``). For each selected zoo layer (``src/tilegemm/ops/conv2d/zoo.json``; batch 32, fp16, channels-last
input and weight, no bias) it times:

- ``cudnn``: ``F.conv2d`` with ``torch.backends.cudnn.benchmark``;
- ``auto``: ``tilegemm.conv2d`` as ``auto`` routes it (the row records the route: ``dispatch.choose_kernel``,
  gemm_1x1's own branch, matmul's rung and the kernels launched);
- ``cublas``: ``F.linear`` on the ``[N*P*Q, C]`` view and the ``[K, C]`` weight;
- ``matmul-auto``: ``tilegemm.matmul`` on the same view and the weight transposed (gemm_1x1's call);
- every candidate config of the matmul rungs in ``--rungs`` for that GEMM (``tools/time_candidates.py``'s
  ``candidates`` and ``launcher``: ``persistent_tma``, its field with gluon_f16's configs and its K splits;
  ``split_k``; ``grouped``, the configs ``autotuned`` chooses among).

Strided layers' GEMMs (cublas, matmul-auto, candidates) run on the gathered pixels, the gather untimed; ``auto``
and ``cudnn`` include it. Each call's output is checked against an fp32 reference (the conv2d bench's bound,
``reference.tolerance``: 4e-3 for fp16) before it is timed; wrong or failing ones are recorded, not timed. Times
are CUDA-graph replays (up to 20 calls a graph, about 2 ms a replay, cycling through input sets that overflow L2
twice; the median of 5 rounds), ratio = cuDNN's time / the call's. Triton compiles run ahead in a pool of
processes (compiled, not launched; the cache on disk is shared). Layers: those ``auto`` sends to ``gemm_1x1`` with
TMA on an H200 (132 SMs), by kind (``small``: stride 1 over at most ``dispatch.GEMM_1X1_PIXELS`` output pixels and
more than one pixel an image; ``gluon``: stride 1 with a gluon_f16 tile; ``large``: the other stride-1 ones;
``strided``; ``one-pixel``: 1x1 images), each kind ordered so that any prefix spans its sizes. Writes ``--out``
after every layer, stops at ``--budget`` seconds, and prints a table last (per layer cuDNN's us and the ratios of
auto, cublas, matmul-auto and the best candidate; geomeans per column).

    PYTHONPATH=src:tools python3 tools/conv2d_pointwise_candidates.py --out $OUT/pointwise-candidates.json \
        [--budget 150] [--limit N] [--kinds small,gluon] [--layers 1920x192@14,1056x304@15,256x512@28/2] \
        [--rungs persistent_tma,split_k,grouped] [--max-candidates N] [--workers 12]

Five of the stride-1 1x1 layers on 7x7 to 17x17 images that trail cuDNN on the zoo sweep (0.58x-0.79x):

    PYTHONPATH=src:tools python3 tools/conv2d_pointwise_candidates.py \
        --layers 1920x192@14,1056x304@15,232x1392@10,288x672@14,2048x448@8 --out $OUT/pointwise-named.json

``--layers``: C x K @ image size (square), ``/S`` for a stride. ``--smoke``: a check that the tool runs, on the CPU
under Triton's interpreter (batch 1, at most 32 channels, 4x4 images, fp32, one call timed by the clock; the kinds
taken in turn; the pool's warm-up tasks run in-process instead):

    TRITON_INTERPRET=1 PYTHONPATH=src:tools python3 tools/conv2d_pointwise_candidates.py --smoke --limit 2 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools beside this file

from conv2d_depthwise_candidates import (  # noqa: E402 (the same timing, options and set-up)
    _spread, chosen_kinds, clock_us, common_arguments, geomean, graph_us, setting,
)

KINDS = ("small", "gluon", "large", "strided", "one-pixel")
RUNGS = ("persistent_tma", "split_k", "grouped")
DEFAULT_RUNGS = "persistent_tma,split_k,grouped"
SMS = 132  # the H200's SMs: the layer selection follows auto's rules there
BASELINES = ("cudnn", "auto", "cublas", "matmul-auto")
WARM_AHEAD = 3  # layers whose compiles are queued in the pool beside the one being timed
WARM_CHUNK = 3  # calls a warm-up task compiles (one layer's field spread over the pool)


def geometry(L: dict, batch: int):
    from tilegemm.ops.conv2d.problem import Geometry

    return Geometry(batch, L["C"], L["H"], L["W"], L["K"], 1, 1, 1, tuple(L["stride"]), (0, 0, 0, 0), (1, 1))


def kind(L: dict, batch: int = 32) -> str:
    if "kind" in L:  # a smoke-test copy keeps its layer's
        return L["kind"]
    from tilegemm.ops.conv2d import dispatch

    g = geometry(L, batch)
    if not g.is_pointwise:
        return "strided"
    if L["H"] * L["W"] == 1:
        return "one-pixel"
    if g.N * g.P * g.Q <= dispatch.GEMM_1X1_PIXELS:
        return "small"
    return "gluon" if dispatch.pointwise_gluon_tile(g, SMS) is not None else "large"


def on_gemm_route(L: dict, batch: int = 32) -> bool:
    """Whether conv2d's ``auto`` runs the layer through ``gemm_1x1`` on an H200 (TMA and gluon_f16 available)."""
    from tilegemm.ops.conv2d import dispatch

    if L["groups"] != 1 or (L["R"], L["S"]) != (1, 1) or list(L["padding"]) != [0, 0]:
        return False
    return dispatch.choose_kernel(geometry(L, batch), True, True, SMS, True, True) == "gemm_1x1"


def ordered_layers(kinds=KINDS, interleave: bool = False) -> list[dict]:
    """The zoo's layers on the GEMM route, kind by kind, each kind's sorted by flops then spread; ``interleave``:
    one of each kind in turn (the smoke run's order, so that a short prefix meets every kind)."""
    from tilegemm.ops.conv2d import zoo

    layers = [L for L in zoo.bench_layers() if on_gemm_route(L)]
    per_kind = [_spread(sorted((L for L in layers if kind(L) == k),
                               key=lambda L: (geometry(L, 32).flops(), L["C"], L["K"]))) for k in kinds]
    if not interleave:
        return [L for mine in per_kind for L in mine]
    return [mine[i] for i in range(max(map(len, per_kind), default=0)) for mine in per_kind if i < len(mine)]


def parse_layers(text: str) -> list[dict]:
    """``CxK@H[/S],...`` -> layer dicts (square images, stride S, default 1)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            chans, size = item.split("@")
            c, k = (int(v) for v in chans.lower().split("x"))
            h, _, s = size.partition("/")
            h, s = int(h), int(s or 1)
        except ValueError:
            raise ValueError(f"bad layer {item!r}: expected CxK@H or CxK@H/S, e.g. 1920x192@14") from None
        if min(c, k, h, s) < 1:
            raise ValueError(f"bad layer {item!r}: sizes must be positive")
        out.append(dict(C=c, K=k, H=h, W=h, R=1, S=1, stride=[s, s], padding=[0, 0], dilation=[1, 1], groups=1,
                        models=[]))
    return out


def label(L: dict, batch: int) -> str:
    s = L["stride"][0]
    return f"n{batch} {L['C']}->{L['K']} @{L['H']}x{L['W']}" + (f"/{s}" if s > 1 else "")


def shrink(L: dict) -> dict:
    """A smoke-test copy of ``L``: at most 32 channels each side (keeping their remainders mod 8), 4x4 images."""
    def small(c):
        return min(c, 24 + c % 8)

    return dict(L, C=small(L["C"]), K=small(L["K"]), H=min(L["H"], 4), W=min(L["W"], 4), kind=kind(L))


def short_name(rung: str, cfg: dict) -> str:
    """A compact name of a candidate: rung, tile, warps, stages, K split and flags."""
    tile = f"{cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')}" + (f"x{cfg['BLOCK_K']}" if "BLOCK_K" in cfg else "")
    head = "gluon" if cfg.get("GLUON_F16") else {"persistent_tma": "ptma", "split_k": "splitk"}.get(rung, rung)
    parts = [head, tile]
    if "num_warps" in cfg:
        parts.append(f"w{cfg['num_warps']}")
    stages = cfg.get("num_stages", cfg.get("STAGES"))
    if stages is not None:
        parts.append(f"s{stages}")
    if cfg.get("SPLIT_K", 1) != 1:
        parts.append(f"k{cfg['SPLIT_K']}")
    if cfg.get("SHARED_OUT"):
        parts.append("so")
    if cfg.get("FLATTEN") is False:
        parts.append("nf")
    if cfg.get("WARP_SPECIALIZE"):
        parts.append("ws")
    if cfg.get("GROUP_M", 8) != 8:
        parts.append(f"g{cfg['GROUP_M']}")
    if cfg.get("SERPENTINE"):
        parts.append("serp")
    if cfg.get("SLICES") is False:
        parts.append("atomic")
    return " ".join(parts)


def _host_descriptors_fit(p) -> bool:
    """Whether host-made TMA descriptors can describe ``p``'s operands and output (16-byte aligned bases and rows;
    ``persistent_tma.host_descriptors`` asserts it)."""
    from tilegemm.core.hardware import tma_aligned

    _, _, stride_a, stride_b = p.tma_view
    return tma_aligned(p.a, stride_a) and tma_aligned(p.b, stride_b) and tma_aligned(p.out, p.out_strides[1])


def field(p, rungs, most: int | None) -> dict:
    """{name: (rung, config)} of the candidate configs of ``rungs`` for GEMM problem ``p``; ``most``: at most this
    many of each rung."""
    from time_candidates import candidates

    out = {}
    for rung in rungs:
        host_desc = rung != "persistent_tma" or _host_descriptors_fit(p)
        for cfg in candidates(rung, p, [])[:most]:
            if cfg.get("HOST_DESC") and not host_desc:
                continue  # (host descriptors need what TMA describes: 16-byte aligned rows, ...)
            name = short_name(rung, cfg)
            n = 2
            while name in out:  # configs differing only in what the short name leaves out
                name = f"{short_name(rung, cfg)} #{n}"
                n += 1
            out[name] = (rung, cfg)
    return out


def gemm_problem(L: dict, batch: int, device: str = "cuda", dtype=torch.float16):
    """Layer ``L``'s GEMM problem on unwritten tensors (no GPU work): what its candidates are enumerated on."""
    from tilegemm.ops.matmul.problem import make_problems

    g = geometry(L, batch)
    M = g.N * g.P * g.Q
    a = torch.empty(M, g.C, device=device, dtype=dtype)
    b = torch.empty(g.K, g.C, device=device, dtype=dtype).t()
    out = torch.empty(M, g.K, device=device, dtype=dtype)
    return make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]


def warm_tasks(L: dict, batch: int, device: str, dtype, rungs, most, seen: set) -> list[list[str]]:
    """The calls of layer ``L`` whose compiles no earlier layer's tasks cover (``seen``, updated), in chunks of
    :data:`WARM_CHUNK`: one layer's field compiled across the pool."""
    g = geometry(L, batch)
    # what Triton specializes on beside the config: each GEMM size's divisibility by 16, and the stride; auto's
    # choices follow the sizes themselves
    shape = (g.N * g.P * g.Q % 16 == 0, g.K % 16 == 0, g.C % 16 == 0, g.stride)
    names = ["auto", "matmul-auto"] + list(field(gemm_problem(L, batch, device, dtype), rungs, most))
    keys = {n: (n, shape) + ((g.N * g.P * g.Q, g.K, g.C) if n in BASELINES else ()) for n in names}
    todo = [n for n in names if keys[n] not in seen]
    seen.update(keys[n] for n in todo)
    return [todo[i:i + WARM_CHUNK] for i in range(0, len(todo), WARM_CHUNK)]


def make_calls(L: dict, batch: int, device: str, sets: int, smoke: bool, rungs, most, empty: bool = False):
    """(reference [M, K] or None, {name: fn(i) -> output}, {candidate: (rung, config)}, route) of layer ``L`` on
    input set i. ``empty``: tensors left unwritten and no reference (for compiling only)."""
    import tilegemm
    from tilegemm.ops.matmul.problem import make_problems
    from time_candidates import launcher

    dtype = torch.float32 if smoke else torch.float16
    C, K, H, W = L["C"], L["K"], L["H"], L["W"]
    stride = tuple(L["stride"])
    g = geometry(L, batch)
    M = g.N * g.P * g.Q
    make = torch.empty if empty else torch.randn
    xs = [make(batch, C, H, W, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
          for _ in range(1 if empty else sets)]
    w = torch.empty(K, C, 1, 1, device=device, dtype=dtype) if empty else \
        (torch.randn(K, C, 1, 1, device=device) / C ** 0.5).to(dtype)
    w = w.contiguous(memory_format=torch.channels_last)  # (a 1x1 weight's bytes are the same either way)
    w2d = w.reshape(K, C)

    def rows(x):  # [N*P*Q, C]: a view stride 1, the kept pixels gathered (untimed) otherwise
        if stride == (1, 1):
            return x.permute(0, 2, 3, 1).reshape(M, C)
        return x[:, :, ::stride[0], ::stride[1]].permute(0, 2, 3, 1).contiguous().reshape(M, C)

    a = [rows(x) for x in xs]
    ref = None if empty else (a[0].float() @ w2d.float().t())
    precision = "ieee"
    outs = [torch.full((M, K), float("nan"), device=device, dtype=dtype) for _ in a]
    problems = [make_problems(ai, w2d.t(), oi, None, None, 1.0, 0.0, "none", precision, False)[0]
                for ai, oi in zip(a, outs)]
    calls = {
        "cudnn": lambda i: F.conv2d(xs[i], w, None, stride),
        "auto": lambda i: tilegemm.conv2d(xs[i], w, None, stride),
        "cublas": lambda i: F.linear(a[i], w2d),
        "matmul-auto": lambda i: tilegemm.matmul(a[i], w2d.t()),
    }
    cands = field(problems[0], rungs, most)
    for name, (rung, cfg) in cands.items():
        def run(i, rung=rung, cfg=cfg, poison=False):
            if poison:  # the checked call: NaN first, so an element this config leaves unwritten fails the check
                outs[i].fill_(float("nan"))
            launcher(rung, problems[i], dict(cfg))()
            return outs[i]

        calls[name] = run
    return ref, calls, cands, None if empty else route(g, problems[0])


def route(g, p) -> dict:
    """What ``auto`` decides for the layer without launching: conv2d's kernel (with TMA, 132 SMs), gemm_1x1's
    branch, and matmul's rung for the GEMM (the survey's choice where it speaks, else ``choose_kernel``)."""
    from tilegemm.ops.conv2d import dispatch, gemm_1x1
    from tilegemm.ops.matmul import dispatch as mdispatch

    out = dict(conv2d=dispatch.choose_kernel(g, True, True, SMS, True, True))
    tile = dispatch.pointwise_gluon_tile(g, SMS)
    M = g.N * g.P * g.Q
    if not g.is_pointwise:
        out["gemm_1x1"] = "gathered pixels, then tilegemm.matmul"
    elif tile is not None:
        out["gemm_1x1"] = f"gluon_f16 tile {tile} (BLOCK_M, BLOCK_N, BLOCK_K, STAGES)"
    elif gemm_1x1.takes_few_rows(M, g.C, g.K, p.a.element_size()):
        out["gemm_1x1"] = f"few_rows_product {gemm_1x1.few_rows_config(M, g.K, g.C, p.a.element_size(), SMS)}"
    else:
        out["gemm_1x1"] = "tilegemm.matmul"
    try:
        picked = mdispatch.surveyed(p)
        out["matmul"] = (dict(survey=picked[0], config=picked[1]) if picked is not None
                         else dict(rung=mdispatch.choose_kernel(p)))
    except Exception as exc:  # noqa: BLE001  (diagnosis: recorded)
        out["matmul"] = f"{type(exc).__name__}: {exc}"
    return out


def launched(fn) -> list[str] | None:
    """The kernels one call of ``fn(0)`` launches (name, grid, warps), from a recording of a warm call; None where
    the call cannot be recorded (under the interpreter, or a launch from outside tilegemm's launcher)."""
    from tilegemm.core.launch import recording

    with recording() as rec:
        fn(0)
    if not rec.launches:
        return None
    out = []
    for launch in rec.launches:
        meta = getattr(launch.compiled, "metadata", None)
        name = getattr(launch.compiled, "name", None) or getattr(meta, "name", "?")
        out.append(f"{name} grid={list(launch.grid)} warps={getattr(meta, 'num_warps', '?')}")
    return out


def warm(args) -> str:
    """Pool task: compile the named calls' kernels (None: all) for a layer without launching them (every Triton
    launch made a warm-up here: ``JITFunction.run`` with ``warmup``), so that Triton's cache on disk holds them."""
    from triton.runtime.jit import JITFunction

    L, batch, names, device, rungs, most = args
    real = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        return real(self, *a, grid=grid, warmup=True, **kw)

    if device != "cpu":  # (under the interpreter nothing compiles: the calls run once)
        JITFunction.run = compile_only
        # a pool process (spawned): no tuner may time launches that never run, nor save what it picked
        os.environ.update(TILEGEMM_TUNE="0", TILEGEMM_TUNING_CACHE="0")
    try:
        _, calls, _, _ = make_calls(L, batch, device, 1, device == "cpu", rungs, most, empty=device != "cpu")
        for name in calls if names is None else names:
            if name in ("cudnn", "cublas"):
                continue
            try:
                calls[name](0)
            except Exception:  # noqa: BLE001  (the main process meets it again and reports it)
                if device == "cpu":
                    raise
    finally:
        JITFunction.run = real
    return label(L, batch)


def summary(rows: list[dict]) -> str:
    cols = ("auto", "cublas", "matmul-auto")
    lines = [f"{'layer':30} {'kind':9} {'cudnn us':>8} " + " ".join(f"{c:>11}" for c in cols)
             + f" {'best':>6}  best candidate   (ratio = cudnn / x)"]
    for r in rows:
        best = r.get("best")
        lines.append(f"{r['label']:30} {r['kind']:9} {r['us'].get('cudnn', 0):8.1f} "
                     + " ".join(f"{r['ratio'].get(c, 0):11.3f}" for c in cols)
                     + f" {r['ratio'].get(best, 0) if best else 0:6.3f}  {best or '-'}")
    lines.append(f"{'geomean':30} {'':9} {'':8} "
                 + " ".join(f"{geomean(r['ratio'].get(c) for r in rows) or 0:11.3f}" for c in cols)
                 + f" {geomean(r['ratio'].get(r['best']) if r.get('best') else None for r in rows) or 0:6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap, KINDS)
    ap.add_argument("--layers", default=None, help="explicit layers instead of the zoo's: CxK@H[/S],... "
                    "(e.g. 1920x192@14,1056x304@15)")
    ap.add_argument("--rungs", default=DEFAULT_RUNGS, help="matmul rungs whose candidates are timed: "
                    + ",".join(RUNGS))
    ap.add_argument("--max-candidates", type=int, default=None, help="at most this many configs of each rung")
    args = ap.parse_args(argv)
    t0 = time.time()
    rungs = [r for r in args.rungs.split(",") if r]
    bad = [r for r in rungs if r not in RUNGS]
    if bad:
        ap.error(f"unknown rungs {bad}; known: {RUNGS}")
    if args.max_candidates is not None and args.max_candidates < 0:
        ap.error("--max-candidates must be at least 0")
    most = args.max_candidates
    if args.layers:
        try:
            layers = parse_layers(args.layers)
        except ValueError as err:
            ap.error(str(err))
    else:
        layers = ordered_layers(chosen_kinds(ap, args.kinds, KINDS), interleave=args.smoke)
    layers, smoke, device, batch, tol, meta, l2 = setting(
        ap, args, layers[: args.limit], shrink, "conv2d_pointwise_candidates", rungs=rungs, max_candidates=most)
    from tilegemm.ops.conv2d.reference import relative_error

    pool, pending, seen = None, {}, set()
    if not smoke and args.workers > 0 and layers:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(args.workers)

    def submit(L: dict) -> None:
        pending[label(L, batch)] = [pool.apply_async(warm, ((L, batch, names, "cuda", rungs, most),))
                                    for names in warm_tasks(L, batch, "cuda", torch.float16, rungs, most, seen)]

    rows = []
    stopped = None
    queued = 0
    for index, L in enumerate(layers):
        if time.time() - t0 > args.budget:
            stopped = f"budget: {len(rows)} of {len(layers)} layers"
            break
        name = label(L, batch)
        if pool is not None:
            while queued < min(len(layers), index + 1 + WARM_AHEAD):
                submit(layers[queued])
                queued += 1
            import multiprocessing as mp

            try:
                for job in pending.pop(name, []):
                    job.get(timeout=max(1.0, args.budget - (time.time() - t0)))
            except mp.TimeoutError:  # its compiles not done within the budget: stop rather than compile here
                stopped = f"budget, compiling: {len(rows)} of {len(layers)} layers"
                break
            except Exception as err:  # noqa: BLE001  (compiled here instead)
                print(f"{name}: warm-up: {type(err).__name__}: {err}", file=sys.stderr)
        if smoke:  # the pool's tasks, in-process (under the interpreter a warm-up compiles nothing)
            for names in warm_tasks(L, batch, "cpu", torch.float32, rungs, most, seen):
                warm((L, batch, names, "cpu", rungs, most))
        sets = 1
        if not smoke and l2:
            per_set = batch * L["C"] * L["H"] * L["W"] * 2
            sets = max(1, min(8, -(-2 * l2 // per_set)))
        ref, calls, cands, plan = make_calls(L, batch, device, sets, smoke, rungs, most)
        g = geometry(L, batch)
        row = dict(label=name, kind=kind(L), layer={k: L[k] for k in ("C", "K", "H", "W", "stride")},
                   gemm=dict(M=g.N * g.P * g.Q, N=g.K, K=g.C), models=L.get("models", []), sets=sets, route=plan,
                   us={}, ratio={}, error={}, failed={}, configs={n: c for n, (_, c) in cands.items()},
                   rung={n: r for n, (r, _) in cands.items()})
        ref4d = ref.view(g.N, g.P, g.Q, g.K).permute(0, 3, 1, 2)
        for cname, fn in calls.items():
            try:
                out = fn(0, poison=True) if cname in cands else fn(0)  # (the others return new outputs)
                err = relative_error(out, ref if out.dim() == 2 else ref4d)
                row["error"][cname] = err
                if not err <= tol:
                    row["failed"][cname] = f"relative error {err:.3e} > {tol:.1e}"
                    continue
                if cname in ("auto", "matmul-auto"):
                    row.setdefault("launched", {})[cname] = launched(fn)
                row["us"][cname] = clock_us(fn) if smoke else graph_us(fn, sets)
            except Exception as exc:  # noqa: BLE001  (recorded; the other candidates still run)
                row["failed"][cname] = f"{type(exc).__name__}: {str(exc)[:300]}"
        base = row["us"].get("cudnn")
        for cname, us in row["us"].items():
            if cname != "cudnn" and base:
                row["ratio"][cname] = base / us
        mine = {n: r for n, r in row["ratio"].items() if n in cands}
        row["best"] = max(mine, key=mine.get) if mine else None
        row["checked"] = sum(n in cands and n in row["error"] and n not in row["failed"] for n in row["error"])
        rows.append(row)
        del ref, calls
        best = row["best"]
        print(f"{name:30} {row['kind']:9} cudnn {base or 0:7.1f} us  auto {row['ratio'].get('auto', 0):5.2f}x  "
              f"cublas {row['ratio'].get('cublas', 0):5.2f}x  matmul-auto {row['ratio'].get('matmul-auto', 0):5.2f}x"
              f"  best {best} {row['ratio'].get(best, 0) if best else 0:5.2f}x  ({len(cands)} candidates"
              + (f", {len(row['failed'])} failed)" if row["failed"] else ")"), flush=True)
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
    return 0 if all(not (set(r["failed"]) & set(BASELINES)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
