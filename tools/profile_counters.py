"""Diagnosis: where a kernel's time goes next to cuBLAS's, from the clocks and hardware counters (GPU machine).

Three modes, each over cases such as ``fp8:8192`` (promoted e4m3: the warp-specialized Gluon kernel against
``torch._scaled_mm``) or ``fp16:4096`` / ``fp16:2048x4104x4096`` (``tilegemm.matmul``'s ``auto`` against
``torch.matmul``; M x N x K):

- ``clocks``: each kernel alone in a loop for ``--seconds``, the SM clock and board power sampled through
  NVML every 20 ms meanwhile; prints time per call, median clock and power. A kernel that draws more power
  (say, more L2 traffic) can run at a lower clock than its baseline under sustained load.
- ``bench``: ``triton.testing.do_bench`` medians (L2 cleared before each call, as ``tilegemm bench`` times),
  ``--rounds`` rounds in alternating order; prints each kernel's median and its ratio to the baseline.
- ``ncu``: each kernel once after warm-up, between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that
  ``ncu --profile-from-start off`` reads the counters of those launches only.

    PYTHONPATH=src:tools python3 tools/profile_counters.py clocks --cases fp8:8192,fp8:16384 --json out.json
    ncu --profile-from-start off --clock-control none --section SpeedOfLight -o rep \
        python3 tools/profile_counters.py ncu --cases fp8:4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
import triton
import triton.testing

import tilegemm
from tilegemm.core import tuning
from tilegemm.core.launch import ensure_allocator
from tilegemm.ops.matmul import persistent_tma
from tilegemm.ops.matmul.problem import make_problems




def parse_knobs(text: str) -> dict[str, dict]:
    """``"p1:PRODUCER_WARPS=1,g16sp:GROUP_M=16+SERPENTINE=1"`` -> {tag: {config key: int}}."""
    knobs = {}
    for item in filter(None, text.split(",")):
        tag, sets = item.split(":")
        knobs[tag] = {k: int(v) for k, v in (kv.split("=") for kv in sets.split("+"))}
    return knobs

def base_config(p) -> dict:
    """``persistent_tma``'s config for ``p``: the tuned (or shipped) one, else its first candidate."""
    return persistent_tma.tuned_config(p) or persistent_tma.candidates(p)[0]


def do_bench_rounds(fns: dict, rounds: int, rep: int = 200) -> dict[str, list[float]]:
    """``do_bench`` medians (ms) of each call, ``rounds`` rounds in alternating order."""
    times = {name: [] for name in fns}
    for rnd in range(rounds):
        for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            times[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=rep, return_mode="median"))
    return times


def calls(case: str, stages: int, knobs: dict | None = None):
    """{name: zero-argument call} for one case, each checked against an fp32 reference first. ``knobs``
    ({tag: config changes}) adds variants named ``tilegemm_<tag>``: for fp8 the warp-specialized kernel with
    those changes; for 16-bit cases ``persistent_tma``'s config for the shape with them (and that config
    unchanged as ``tilegemm_base``)."""
    kind, size = case.split(":")
    m, n, k = (int(d) for d in size.split("x")) if "x" in size else (int(size),) * 3
    if kind == "fp8":
        if not m == n == k:
            raise SystemExit(f"{case}: fp8 cases are square (fp8:N)")
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
        out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        p = make_problems(a, w.T, out, None, None, 1.0, 0.0, "none", "ieee", False, scales=(sa, 0, sb, 0))[0]
        cfg = dict(GLUON_FP8=True, WS=True, STAGES=stages, num_warps=4)
        fns = {"cublas": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16),
               "tilegemm": lambda: persistent_tma.run(p, cfg)}
        for tag, change in (knobs or {}).items():
            fns[f"tilegemm_{tag}"] = lambda c=dict(cfg, **change): persistent_tma.run(p, c)
        ref = (a.float() @ w.float().T) * (0.75 * 1.25)
    else:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[kind]
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        fns = {"cublas": lambda: torch.matmul(a, b),
               "tilegemm": lambda: tilegemm.matmul(a, b)}
        if knobs:
            # The variants change persistent_tma's config for this shape (the tuned one, or the first
            # candidate): run straight through the rung, into ``out``.
            p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
            base = base_config(p)
            print(f"{case}: persistent_tma base config {base}")
            # Replays of each recorded launch (as the tuners time), so the host's launch path does not count.
            fns["tilegemm_base"] = tuning.replaying(lambda c: persistent_tma.run(p, c), base)
            for tag, change in knobs.items():
                fns[f"tilegemm_{tag}"] = tuning.replaying(lambda c: persistent_tma.run(p, c), dict(base, **change))
        ref = a.float() @ b.float()
    for name in [k for k in fns if k.startswith("tilegemm")]:
        if out is not None:
            out.fill_(float("nan"))
        got = fns[name]()
        got = out if got is None else got
        torch.cuda.synchronize()
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (case, name, err)
    return fns


def sustained(fn, seconds: float) -> dict:
    """Run ``fn`` back to back for about ``seconds``; NVML samples the SM clock and power meanwhile."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))
            time.sleep(0.02)

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    batch = max(1, int(0.05 / max(time.perf_counter() - t, 1e-6)))
    thread = threading.Thread(target=sample)
    thread.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        n += batch
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    stop.set()
    thread.join()
    late = samples[len(samples) // 4:]  # past the clock's first reaction
    return dict(calls=n, us_per_call=start.elapsed_time(end) * 1e3 / n,
                sm_mhz=statistics.median(c for c, _ in late), power_w=statistics.median(p for _, p in late),
                sm_mhz_min=min(c for c, _ in late), samples=len(late))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("clocks", "ncu", "bench"))
    ap.add_argument("--rounds", type=int, default=6, help="bench mode: do_bench rounds, alternating orders")
    ap.add_argument("--cases", default="fp8:4096,fp8:16384")
    ap.add_argument("--stages", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json")
    ap.add_argument("--knobs", default="", help="variants, e.g. g4:GROUP_M=4,s6:STAGES=6,p1:PRODUCER_WARPS=1 (fp8), g12s:GROUP_M=12+SERPENTINE=1")
    args = ap.parse_args()
    knobs = parse_knobs(args.knobs)
    ensure_allocator()
    rows = []
    for case in args.cases.split(","):
        fns = calls(case, args.stages, knobs)
        if args.mode == "ncu":
            for fn in fns.values():
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for name, fn in fns.items():
                torch.cuda.nvtx.range_push(f"{case} {name}")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        if args.mode == "bench":
            times = do_bench_rounds(fns, args.rounds)
            base = statistics.median(times["cublas"])
            for name, ts in times.items():
                ms = statistics.median(ts)
                rows.append(dict(case=case, kernel=name, us=ms * 1e3, ratio=base / ms, runs=ts))
                print(f"{case:10s} {name:16s} {ms * 1e3:9.2f} us  {base / ms:6.3f}x cuBLAS  "
                      f"(rounds {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})", flush=True)
            continue
        for rnd in range(2):  # both orders, so neither kernel always runs on a warmer GPU
            for name in (list(fns) if rnd == 0 else list(fns)[::-1]):
                r = sustained(fns[name], args.seconds)
                rows.append(dict(case=case, kernel=name, round=rnd, **r))
                print(f"{case:10s} {name:9s} round {rnd}: {r['us_per_call']:9.2f} us/call  "
                      f"SM {r['sm_mhz']:6.0f} MHz (min {r['sm_mhz_min']:.0f})  {r['power_w']:6.1f} W", flush=True)
    if args.json and rows:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit(), mode=args.mode, stages=args.stages,
                    seconds=args.seconds, rounds=args.rounds)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
