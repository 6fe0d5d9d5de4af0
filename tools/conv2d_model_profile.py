"""Where a converted torchvision model's time goes (GPU): its kernels by CUDA time, tilegemm's model against cuDNN's.

Builds NAME as ``tilegemm bench --op conv2d --model NAME`` builds it (random weights, batch norms' statistics from
random batches, fp16 channels-last at the image size its weights expect), converts a copy with
``tilegemm.nn.convert_``, and profiles ``--steps`` calls of each model (``--mode infer``: a forward under no_grad;
``train``: a forward and backward, batch statistics) with ``torch.profiler``. Prints per side the total CUDA time a
step and the ``--top`` kernel names by time (names cut to 70 characters), so a gap to cuDNN reads as which
kernels take it. First both sides compute one step and tilegemm's logits (or gradients) are compared with cuDNN's:
a result off by more than 2e-2 (inference; training steps of random fp16 networks differ more, so only a result
as far as 1.0 from cuDNN's is refused) is not profiled.

    PYTHONPATH=src python3 tools/conv2d_model_profile.py convnext_tiny --mode train [--batch 32] [--top 20]
    PYTHONPATH=src python3 tools/conv2d_model_profile.py convnext_tiny --mode train --replays

``--replays``: after the profile, tilegemm's model runs ``--steps`` more steps counting, per family's replay cache
(``tilegemm.core.replay``), the calls that replayed a recorded one and those that took their full path (a key
recorded but declined, or none recorded yet), and the entries each cache holds: a step whose calls miss their
replays pays the full host path every time.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json

import torch
from torch.profiler import ProfilerActivity, profile

import tilegemm
from tilegemm.core.checks import relative_error
from tilegemm.models import torchvision_models as tvm
from tilegemm.models.bench import _train_deterministic


def _step(model, x, target, mode):
    if mode == "infer":
        with torch.no_grad():
            model(x)
    else:
        tvm.gradients(model, x, target, 1024.0)


def kernel_times(model, x, target, mode, steps):
    """{kernel name: CUDA microseconds a step} over ``steps`` profiled steps (after two warm-up steps)."""
    for _ in range(2):
        _step(model, x, target, mode)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(model, x, target, mode)
        torch.cuda.synchronize()
    times = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.device_time / steps  # us
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--mode", choices=("infer", "train"), default="train")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", help="write both sides' kernel times here (JSON)")
    ap.add_argument("--replays", action="store_true", help="then count tilegemm's replayed and full-path calls")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    image = tvm.image_size(args.model)
    base = tvm.calibrate_batch_norms(tvm.build(args.model).eval().cuda().to(memory_format=torch.channels_last), image)
    ref = base.half()
    ours = tilegemm.nn.convert_(copy.deepcopy(ref))
    if args.mode == "train":
        ref, ours = _train_deterministic(ref), _train_deterministic(ours)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, image, image, generator=gen).cuda().half()
    x = x.contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (args.batch,), generator=gen).cuda()
    # both sides compute the same step first (the profile of a wrong model would say nothing)
    if args.mode == "infer":
        with torch.no_grad():
            outs = [tvm.logits_of(m(x))[0].float() for m in (ref, ours)]
    else:
        outs = [tvm.gradients(m, x, target, 1024.0) for m in (ref, ours)]
    err = relative_error(outs[1], outs[0])
    print(f"tilegemm's {'logits' if args.mode == 'infer' else 'gradients'} against cuDNN's: relative error {err:.1e}")
    if not err < (2e-2 if args.mode == "infer" else 1.0):
        raise SystemExit(f"tilegemm's result differs from cuDNN's by {err:.1e}: not profiled")
    result = {}
    for side, model in (("cuDNN", ref), ("tilegemm", ours)):
        times = kernel_times(model, x, target, args.mode, args.steps)
        result[side] = dict(times)
        total = sum(times.values())
        print(f"== {args.model} {args.mode} batch {args.batch}, {side}: {total / 1000:.2f} ms of CUDA time a step, "
              f"{len(times)} kernel names")
        for name, t in times.most_common(args.top):
            print(f"  {t:9.1f} us {100 * t / total:5.1f}%  {name[:70]}")
    census = replay_census(ours, x, target, args.mode, args.steps) if args.replays else None
    if census is not None:
        print(f"== replays over {args.steps} steps of tilegemm's model (per family: replayed, full path, entries)")
        for name, (hits, misses, entries, missed) in sorted(census.items()):
            print(f"  {name:<16s} {hits / args.steps:7.1f} replayed {misses / args.steps:7.1f} full path a step, "
                  f"{entries} entries")
            for key in missed:
                print(f"      missed: {key[:160]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, mode=args.mode, batch=args.batch, kernels_us=result,
                           replays=census), f)


def replay_census(model, x, target, mode, steps) -> dict:
    """{family and call kind (the key's first element): (calls replayed, calls that took the full path, entries
    the family's cache holds, up to three of the keys missed)} over ``steps`` steps (after one warm-up step),
    counted around :meth:`tilegemm.core.replay.ReplayCache.replayed` and the calls it missed."""
    from tilegemm.core import replay

    _step(model, x, target, mode)
    torch.cuda.synchronize()
    counts = collections.defaultdict(lambda: [0, 0])
    missed = collections.defaultdict(dict)
    real = replay.ReplayCache.replayed

    def counted(self, key, tensors):
        out = real(self, key, tensors)
        kind = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else "?"
        counts[(self.name, kind)][out is None] += 1
        if out is None and len(missed[(self.name, kind)]) < 3:
            missed[(self.name, kind)][repr(key)] = None
        return out

    replay.ReplayCache.replayed = counted
    try:
        for _ in range(steps):
            _step(model, x, target, mode)
        torch.cuda.synchronize()
    finally:
        replay.ReplayCache.replayed = real
    return {f"{name}/{kind}": (hits, misses, replay.cache(name).count(), list(missed[(name, kind)]))
            for (name, kind), (hits, misses) in counts.items()}


if __name__ == "__main__":
    main()
