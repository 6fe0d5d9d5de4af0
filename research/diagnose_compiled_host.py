"""Diagnosis (not a test): where does the host time of a compiled ResNet-50 forward through tilegemm go?

Builds torchvision's ResNet-50 (random weights, fp16, channels-last), converts a copy with
``tilegemm.nn.convert_``, compiles both with ``torch.compile(dynamic=False)`` and for each reports the host
time of one forward (calls queued back to back, the GPU never waited on), the GPU time (CUDA events over
the same calls), the host time of one forward issued into an empty queue, do_bench's median (as the bench),
how many conv2d op calls were keyed / replayed / recorded / ran their full path, and the top of a cProfile of
a few forwards.

    PYTHONPATH=src python3 research/diagnose_compiled_host.py [--batch 32] [--eager] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import io
import json
import os
import pstats
import time

import torch

import tilegemm
from tilegemm.models import resnet
from tilegemm.ops.conv2d import replay as conv_replay

counts = collections.Counter()


def instrument():
    key_fn, replayed_fn, record_fn = conv_replay.replay_key, conv_replay.replayed, conv_replay.record

    def replay_key(*a, **k):
        if torch.compiler.is_compiling():  # traced: counting here would break the graph
            return key_fn(*a, **k)
        key = key_fn(*a, **k)
        counts["key" if key is not None else "no key"] += 1
        if key is None:
            x, w, b = a[1], a[2], a[3]
            from tilegemm.core.launch import plain_call, recording_active

            counts[f"no key: plain_call={plain_call(x, w, b)} grad={torch.is_grad_enabled()} "
                   f"req={x.requires_grad},{w.requires_grad} types={type(x).__name__},{type(w).__name__} "
                   f"compiling={torch.compiler.is_compiling()} rec={recording_active()} "
                   f"dispatch={torch._C._len_torch_dispatch_stack()} "
                   f"fmode={torch._C._is_torch_function_mode_enabled()}"] += 1
        return key

    def replayed(key, tensors):
        out = replayed_fn(key, tensors)
        counts["hit" if out is not None else ("miss" if conv_replay._cache.get(key) is None else "declined")] += 1
        return out

    def record(key, run, tensors, out_format):
        n = len(conv_replay._cache.entries)
        out = record_fn(key, run, tensors, out_format)
        counts["recorded" if len(conv_replay._cache.entries) > n else "not kept"] += 1
        if len(conv_replay._cache.entries) == n:
            counts[f"not kept: out {tuple(out.shape)} strides {out.stride()} fmt {out_format}"] += 1
        return out

    conv_replay.replay_key, conv_replay.replayed, conv_replay.record = replay_key, replayed, record


def measure(fn, x, calls=20):
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        host = (time.perf_counter() - t) / calls * 1e3
        torch.cuda.synchronize()
        return host, start.elapsed_time(end) / calls


def host_alone(fn, x, calls=20):
    """Median host time of one forward issued into an idle GPU's empty queue (launches never block), ms."""
    times = []
    with torch.no_grad():
        for _ in range(calls):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def bench_ms(fn, x):
    import triton.testing

    with torch.no_grad():
        return triton.testing.do_bench(lambda: fn(x))


def profile(fn, x, calls=5):
    pr = cProfile.Profile()
    with torch.no_grad():
        pr.enable()
        for _ in range(calls):
            fn(x)
        pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(40)
    return s.getvalue() + "\n" + s2.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--explain", action="store_true", help="only compile and run tilegemm's model (for TORCH_LOGS)")
    args = ap.parse_args()
    torch.manual_seed(0)
    ref = resnet.resnet50().eval().to(device="cuda", dtype=torch.float16, memory_format=torch.channels_last)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref))
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    if args.explain:
        # run with TORCH_LOGS=graph_breaks,recompiles to see why
        fn = torch.compile(ours, dynamic=False)
        with torch.no_grad():
            for _ in range(3):
                fn(x)
        return
    instrument()
    report = {}
    for name, model, compiled in (("tilegemm eager", ours, False), ("cudnn eager", ref, False),
                                  ("tilegemm compiled", ours, True), ("cudnn compiled", ref, True)):
        fn = torch.compile(model, dynamic=False) if compiled else model
        with torch.no_grad():
            fn(x)
            fn(x)
        counts.clear()
        host, gpu = measure(fn, x)
        per_call = dict(counts)
        counts.clear()
        alone, timed = host_alone(fn, x), bench_ms(fn, x)
        prof = profile(fn, x)
        report[name] = dict(host_ms=round(host, 3), gpu_ms=round(gpu, 3), host_alone_ms=round(alone, 3),
                            do_bench_ms=round(timed, 3), counts_per_23_calls=per_call)
        with open(os.path.join(args.out, f"profile-{name.replace(' ', '-')}.txt"), "w") as f:
            f.write(prof)
        print(f"{name:18s} back to back: host {host:6.2f} ms gpu {gpu:6.2f} ms; one call's host {alone:6.2f} ms; "
              f"do_bench {timed:6.2f} ms  {per_call}", flush=True)
    with open(os.path.join(args.out, "compiled-host.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
