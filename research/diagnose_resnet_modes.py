"""Diagnosis (not a test): ResNet-50 inference through tilegemm and cuDNN in every way a user runs it.

Modes, each for both models (torchvision's ResNet-50, random weights, fp16, channels-last, eval):
``eager``; ``graph`` (the eager forward captured into one CUDA graph and replayed); ``compile``
(``torch.compile(dynamic=False)``, as the bench); ``compile-graph`` (``mode="reduce-overhead"``: the compiled
forward replayed from CUDA graphs by torch's own graph trees). Every output is compared with cuDNN's eager
output; times are do_bench medians (ms). With ``--profile`` a torch.profiler table of tilegemm's compiled
forward (host time by op) is written too.

    PYTHONPATH=src python3 research/diagnose_resnet_modes.py [--batches 32,256] [--out DIR] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import triton.testing

import tilegemm
import tilegemm.nn
from tilegemm.models import resnet


def runner(model, x, mode):
    """The bench's own forward of ``model(x)`` in ``mode`` (:func:`tilegemm.models.bench._forward`)."""
    from tilegemm.models.bench import _forward

    return _forward(model, x, mode)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--modes", default="eager,graph,compile,compile-graph")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    ref = resnet.resnet50().eval().to(device="cuda", dtype=torch.float16, memory_format=torch.channels_last)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16).contiguous(
            memory_format=torch.channels_last)
        with torch.no_grad():
            want = ref(x).clone()
        for mode in args.modes.split(","):
            times = {}
            for name, model in (("cudnn", ref), ("tilegemm", ours)):
                try:
                    with torch.no_grad():
                        fn = runner(model, x, mode)
                        for _ in range(3):
                            out = fn()
                        err = rel(out, want)
                        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                    times[name] = ms
                    rows.append(dict(batch=batch, mode=mode, model=name, ms=ms, rel_err=err))
                    print(f"b{batch:<4d} {mode:14s} {name:9s} {ms:7.3f} ms  {batch / ms * 1e3:8.0f} img/s  "
                          f"rel.err {err:.2e}", flush=True)
                except Exception as exc:  # noqa: BLE001 - a mode that fails is reported
                    rows.append(dict(batch=batch, mode=mode, model=name, error=repr(exc)[:400]))
                    print(f"b{batch:<4d} {mode:14s} {name:9s} FAILED {exc!r}"[:300], flush=True)
            if len(times) == 2:
                print(f"      {mode:14s} ratio (cuDNN / tilegemm) {times['cudnn'] / times['tilegemm']:.3f}")
            torch._dynamo.reset()
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            fn = torch.compile(ours, dynamic=False)
            with torch.no_grad():
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn(x)
                    torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            with open(os.path.join(args.out, f"profile-compiled-b{batch}.txt"), "w") as f:
                f.write(table)
            print(table[:3000])
            torch._dynamo.reset()
    with open(os.path.join(args.out, "resnet-modes.json"), "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name(), commit=os.environ.get("TILEGEMM_GIT_COMMIT")),
                  f, indent=1)


if __name__ == "__main__":
    main()
