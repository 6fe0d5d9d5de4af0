"""Small 1x1 convolutions on a GPU: host and GPU microseconds a call of tilegemm.conv2d against F.conv2d.

    PYTHONPATH=src python3 tools/conv2d_small_1x1.py --out $OUT/small-1x1.json [--calls 1000] [--no-sweep] [--extra]

Layers (fp16, batch 32, channels-last x and weight, the bias as the zoo's layer has it): the SE block's 348 -> 3712
on a one-pixel image (bias), 888 -> 84 on one pixel (bias), 48 -> 48 at 28x28 and 320 -> 320 at 14x14 (``--extra``:
64 -> 1536 on one pixel, aligned, and 1392 -> 384 at 10x10). For each:

- ``F.conv2d``: cuDNN (``cudnn.benchmark`` on), as a user calls it;
- ``auto``: ``tilegemm.conv2d`` as it routes the layer, replayed (the first call records);
- ``few_rows``: the call with ``kernel="gemm_1x1"`` and its few-rows route forced on (one launch of split_k's
  kernel with ``gemm_1x1.few_rows_config``; where ``auto`` takes it already, the two rows are the same route);
- unless ``--no-sweep``, ``sweep BMxBNxBK/split``: GPU time only, of ``gemm_1x1.few_rows_product`` with other
  tiles split by the same rule (the host path is the forced route's).

``host``: bench.runner.host_us_per_call (back-to-back calls, one sync: the host's time, or the GPU's where that
is longer); ``gpu``: bench.runner.graph_us_per_call (20 calls in one CUDA graph); ``launches``: the launches the
kept replay makes (0: the call was not kept). Every candidate's output is checked against F.conv2d in fp32 before
it is timed (relative error at most 4e-3). About a minute on an H200 (most of it compiling); the table is last.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.bench.runner import graph_us_per_call, host_us_per_call
from tilegemm.core.hardware import sm_count
from tilegemm.core.launch import ReplaySequence
from tilegemm.core.replay import cache
from tilegemm.ops.conv2d import checks, dispatch, gemm_1x1

CL = torch.channels_last
DEVICE = "cuda"  # (a CPU smoke run under the interpreter sets "cpu" and its own timers)
TOLERANCE = 4e-3

LAYERS = [  # (label, N, C, H, K, bias)
    ("348->3712 1x1", 32, 348, 1, 3712, True),
    ("888->84 1x1", 32, 888, 1, 84, True),
    ("48->48 28x28", 32, 48, 28, 48, False),
    ("320->320 14x14", 32, 320, 14, 320, False),
]
EXTRA = [
    ("64->1536 1x1", 32, 64, 1, 1536, True),
    ("1392->384 10x10", 32, 1392, 10, 384, False),
]


class forced_few_rows:
    """Within it, gemm_1x1 takes its few-rows route for every stride-1 1x1 product, and the replays recorded
    inside are dropped on the way in and out (the replay key does not say which route recorded them)."""

    def __enter__(self):
        self.saved = gemm_1x1.takes_few_rows
        gemm_1x1.takes_few_rows = lambda *args: True
        cache("conv2d").clear()

    def __exit__(self, *exc):
        gemm_1x1.takes_few_rows = self.saved
        cache("conv2d").clear()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def kept_launches(x, w, b, kernel="auto") -> int:
    hit = cache("conv2d").get(checks.forward_key(x, w, b, 1, 0, 1, 1, "none", None, kernel))
    return 0 if hit is None else len(hit.replays) if isinstance(hit, ReplaySequence) else 1


def sweep_configs(M: int, N: int, K: int, sms: int) -> list[dict]:
    """The rule's config, then other tiles split by the same rule: narrower and wider output tiles, 32-wide K
    steps, and rows by half (at least 16)."""
    rule = gemm_1x1.few_rows_config(M, N, K, 2, sms)
    bm = rule["BLOCK_M"]
    variants = [dict(), dict(block_n=32), dict(block_n=128), dict(step_bytes=64), dict(block_m=max(16, bm // 2))]
    out = []
    for v in variants:
        cfg = gemm_1x1.few_rows_config(M, N, K, 2, sms, **v)
        if cfg not in out:
            out.append(cfg)
    return out


def name_of(cfg: dict) -> str:
    return f"sweep {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}/{cfg['SPLIT_K']}"


def measure(label, N, C, H, K, bias, calls, sweep) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(N, C, H, H, device=DEVICE, dtype=torch.float16).contiguous(memory_format=CL)
    w = (torch.randn(K, C, 1, 1, device=DEVICE) / C ** 0.5).half().contiguous(memory_format=CL)
    b = torch.randn(K, device=DEVICE, dtype=torch.float16) if bias else None
    ref = F.conv2d(x.float(), w.float(), None if b is None else b.float())
    rows = []

    def add(candidate, fn, launches=None, host=True, config=None):
        err = rel_err(fn(), ref)
        if not err <= TOLERANCE:
            rows.append(dict(layer=label, candidate=candidate, status="wrong", rel_err=err))
            print(f"  {candidate}: WRONG, relative error {err:.2e}")
            return
        row = dict(layer=label, candidate=candidate, status="ok", rel_err=err,
                   host_us=host_us_per_call(fn, calls) if host else None, gpu_us=graph_us_per_call(fn),
                   launches=launches() if launches else None, config=config)
        rows.append(row)
        host_text = "-" if row["host_us"] is None else f"{row['host_us']:.1f} us"
        print(f"  {candidate}: host {host_text}, gpu {row['gpu_us']:.1f} us, launches {row['launches']}, "
              f"rel err {err:.1e}")

    print(f"== {label}: route {dispatch._auto_kernel(problem_of(x, w, b))}")
    with torch.no_grad():
        add("F.conv2d", lambda: F.conv2d(x, w, b))
        cache("conv2d").clear()
        add("auto", lambda: tilegemm.conv2d(x, w, b), lambda: kept_launches(x, w, b))
        with forced_few_rows():
            add("few_rows", lambda: tilegemm.conv2d(x, w, b, kernel="gemm_1x1"),
                lambda: kept_launches(x, w, b, "gemm_1x1"),
                config=gemm_1x1.few_rows_config(N * H * H, K, C, 2, sm_count(x.device)))
        if sweep:
            a2d = x.permute(0, 2, 3, 1).reshape(N * H * H, C)
            b2d = w.reshape(K, C).t()
            out = torch.empty(N, K, H, H, device=DEVICE, dtype=torch.float16, memory_format=CL)
            o2d = out.permute(0, 2, 3, 1).view(N * H * H, K)
            for cfg in sweep_configs(N * H * H, K, C, sm_count(x.device)):
                def product(cfg=cfg):
                    gemm_1x1.few_rows_product(a2d, b2d, b, "none", "ieee", False, torch.float16, o2d, cfg)
                    return out

                add(name_of(cfg), product, host=False, config=cfg)
    return rows


def problem_of(x, w, b):
    from tilegemm.ops.conv2d.problem import ConvCall, ConvProblem, memory_format_of

    c = ConvCall(x, w, b, [1, 1], [0, 0, 0, 0], [1, 1], 1, "none", "default", "auto")
    return ConvProblem(x, w, b, c.geometry(), x.dtype, memory_format_of(x), "none", "ieee", False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--calls", type=int, default=1000, help="calls per host timing")
    parser.add_argument("--no-sweep", action="store_true", help="leave out the tile sweep (GPU time only)")
    parser.add_argument("--extra", action="store_true", help="add an aligned one-pixel layer and 1392 -> 384")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    start = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for layer in LAYERS + (EXTRA if args.extra else []):
        rows += measure(*layer, args.calls, not args.no_sweep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print(f"\n{time.time() - start:.0f} s. us a call; x cuDNN: F.conv2d's time over the candidate's (above 1: faster)")
    print(f"{'layer':17s} {'candidate':22s} {'host':>7s} {'gpu':>7s} {'launch':>6s} {'host x':>7s} {'gpu x':>6s}")
    base = {r["layer"]: r for r in rows if r["candidate"] == "F.conv2d" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['layer']:17s} {r['candidate']:22s} WRONG (rel err {r['rel_err']:.1e})")
            continue
        cudnn = base.get(r["layer"])
        host = "" if r["host_us"] is None else f"{r['host_us']:7.1f}"
        hx = "" if r["host_us"] is None or cudnn is None else f"{cudnn['host_us'] / r['host_us']:7.2f}"
        gx = "" if cudnn is None else f"{cudnn['gpu_us'] / r['gpu_us']:6.2f}"
        launches = "" if r["launches"] is None else str(r["launches"])
        print(f"{r['layer']:17s} {r['candidate']:22s} {host:>7s} {r['gpu_us']:7.1f} {launches:>6s} {hx:>7s} {gx:>6s}")


if __name__ == "__main__":
    main()
