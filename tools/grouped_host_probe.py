"""Host time per call of the grouped family at decode sizes (run on the GPU machine):

    PYTHONPATH=src python tools/grouped_host_probe.py

For ``tilegemm.grouped_mm`` and ``tilegemm.w4a16.grouped_matmul`` on Qwen3-30B-A3B's gate/up product at one token
(8 rows over 128 experts, K 2048, N 1536, bf16; routing of the grouped bench) and on a tiny decode step (8 rows
over 16 experts, K 256, N 128: the bench's host probe), microseconds per call of:

- ``fresh``: the full Python path (checks, problem, config, Triton's launch), the replay key forced to None;
- ``replay``: the host fast path (the first call records, the timed ones replay);
- ``F.grouped_mm``: torch's own (on the dequantized weight for the 4-bit row).

``host`` is bench.runner.host_us_per_call (1000 back-to-back calls, one sync: the host's time, or the GPU's where
that is longer); ``gpu`` is the same call's GPU time from a CUDA graph of 20 calls. Then a cProfile top 15 of
1000 replayed calls of each.
"""

import cProfile
import io
import math
import pstats

import torch

import tilegemm
from tilegemm.bench.runner import graph_us_per_call as gpu_us, host_us_per_call
from tilegemm.core.replay import cache
from tilegemm.ops.grouped import api
from tilegemm.ops.grouped.bench import PROBE_SIZES, group_sizes




class fresh_path:
    """Within it, the grouped calls take the full path every time (no replay key, nothing recorded)."""

    def __enter__(self):
        self.saved = api.replay_key, api.int4_replay_key
        api.replay_key = api.int4_replay_key = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        api.replay_key, api.int4_replay_key = self.saved


def problem(sizes, K, N):
    E = len(sizes)
    x = torch.randn(sum(sizes), K, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)  # [E, N, K], as stored
    offs = torch.tensor(sizes).cumsum(0).to(device="cuda", dtype=torch.int32)
    w4 = tilegemm.w4a16.quantize(weight, group_size=128)
    return x, weight.transpose(1, 2), w4, tilegemm.w4a16.dequantize(w4).transpose(1, 2), offs


def rows(label, sizes, K, N):
    """Print the table of one problem; return its two tilegemm calls."""
    x, b, w4, deq, offs = problem(sizes, K, N)
    ours = {"grouped_mm": lambda: tilegemm.grouped_mm(x, b, offs=offs),
            "w4a16.grouped_matmul": lambda: tilegemm.w4a16.grouped_matmul(x, w4, offs)}
    theirs = {"grouped_mm": lambda: torch.nn.functional.grouped_mm(x, b, offs=offs),
              "w4a16.grouped_matmul": lambda: torch.nn.functional.grouped_mm(x, deq, offs=offs)}
    print(f"\n{label}: {sum(sizes)} rows over {len(sizes)} experts ({sum(1 for s in sizes if s)} non-empty), "
          f"K {K}, N {N}, bf16")
    print(f"{'call':24s} {'path':14s} {'host us':>8s} {'gpu us':>8s}")
    for name, fn in ours.items():
        with fresh_path():
            fresh = host_us_per_call(fn)
        cache("grouped").clear()
        fn()  # recorded
        recorded = cache("grouped").count() == 1
        replay = host_us_per_call(fn)
        gpu = gpu_us(fn)
        print(f"{name:24s} {'fresh':14s} {fresh:8.1f} {gpu:8.1f}")
        print(f"{name:24s} {'replay' if recorded else 'NOT RECORDED':14s} {replay:8.1f} {gpu:8.1f}")
        try:
            base = host_us_per_call(theirs[name])
            print(f"{name:24s} {'F.grouped_mm':14s} {base:8.1f} {gpu_us(theirs[name]):8.1f}")
        except RuntimeError as err:  # (torch's kernel refuses this GPU or layout)
            print(f"{name:24s} {'F.grouped_mm':14s} refused: {err}")
    return ours


def profile(name, fn, n: int = 1000) -> None:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(f"\ncProfile, {n} replayed calls of {name} (sorted by own time):")
    print("\n".join(line for line in s.getvalue().splitlines()[:40] if line.strip()))


def main() -> None:
    torch.manual_seed(0)
    calls = rows("decode", group_sizes(1, 128, 8), 2048, 1536)  # Qwen3-30B-A3B's gate/up at one token
    rows("tiny", list(PROBE_SIZES), 256, 128)
    cache("grouped").clear()
    for name, fn in calls.items():
        profile(name, fn)


if __name__ == "__main__":
    main()
