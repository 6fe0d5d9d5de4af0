"""Diagnosis (not a test): why does ``tilegemm bench --op conv2d --model resnet50`` time tilegemm's compiled
ResNet-50 at batch 32 2.3x slower than ``research/diagnose_resnet_modes.py`` does (8.5 against 3.7 ms)?

Runs the bench's own case (``b32 compile``) through :func:`tilegemm.bench.runner.run_bench` with the conv2d op's
replay path instrumented (``research/diagnose_compiled_host.py``'s counters: calls keyed, replayed, recorded,
and why a call got no key), then again with the bench's precision context replaced by a no-op, then the same
compiled model timed bare (do_bench over ``fn(x)``, as the modes diagnosis).

    PYTHONPATH=src:research python3 research/diagnose_compiled_bench.py [--batch 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch

from diagnose_compiled_host import counts, instrument
from tilegemm.bench.runner import run_bench
from tilegemm.models import bench as model_bench


def one(op, case, label):
    counts.clear()
    result = run_bench(op, [case], "fp16", ["auto"], warmup_ms=25, rep_ms=100, sweep="inference")
    rows = {r.kernel: r.ms for r in result.rows}
    calls = dict(counts)
    print(f"{label:28s} baseline {rows.get('baseline', 0):7.3f} ms  tilegemm {rows.get('auto', 0):7.3f} ms  "
          f"conv2d calls: {calls}", flush=True)
    return dict(label=label, ms=rows, counts=calls)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    instrument()
    op = model_bench.ResNet50Bench(batches=(args.batch,))
    case = op.custom_case(args.batch, "compile")
    out = [one(op, case, "as the bench")]
    op.baseline_context = lambda dtype: contextlib.nullcontext()
    out.append(one(op, case, "no precision context"))
    prepared = op.prepare(case, "fp16", "cuda", 1, {})
    import triton.testing

    fn = prepared.sets[0]["ours"]
    with torch.no_grad():
        fn()
        counts.clear()
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    print(f"{'bare do_bench':28s} tilegemm {ms:7.3f} ms  conv2d calls: {dict(counts)}", flush=True)
    out.append(dict(label="bare", ms=ms, counts=dict(counts)))
    with open(os.path.join(args.out, "compiled-bench.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
