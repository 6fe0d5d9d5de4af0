"""Does a strided data gradient replay, and what does a call cost the host? (console)

    PYTHONPATH=src python3 research/diagnose_dgrad_replay.py [--profile]

Per layer and gradient: whether the first call's launches were kept as a replay (and, if not, why the replay
could not be made), how many of 20 later calls recorded again (a replay that declines), host time a call, and
with --profile the top of a cProfile of the data gradient's calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import tilegemm  # noqa: F401
    import torch
    from tilegemm.core import launch as core_launch
    from tilegemm.ops.conv2d import replay
    from tilegemm.ops.conv2d.op import backward_data, backward_weight

    records = []
    original = replay.record

    def counting(key, run, tensors, out_format):
        records.append(key)
        return original(key, run, tensors, out_format)

    store = replay._cache.store

    def diagnosing(key, launches, tensors, shape=None, aliases_in_key=False):
        why = "kept"
        if not launches:
            why = "a launch could not be recorded"
        elif len(launches) > core_launch.ReplaySequence.MAX_LAUNCHES:
            why = f"{len(launches)} launches"
        else:
            try:
                made = [core_launch.Replay(one, tensors) for one in launches]
                if len(made) > 1:
                    core_launch.ReplaySequence(made)
                why += f" ({len(made)} launches; descriptors expanded in "
                why += f"{sum(r.expanded is not None for r in made)})"
            except LookupError as err:
                why = f"LookupError: {err}"
        counting.why = why
        store(key, launches, tensors, shape=shape, aliases_in_key=aliases_in_key)

    replay.record = counting
    replay._cache.store = diagnosing
    cl = torch.channels_last
    for (N, C, H, K, R, st, pad) in [(32, 256, 56, 512, 1, 2, 0), (32, 128, 56, 128, 3, 2, 1),
                                     (32, 128, 28, 512, 1, 1, 0), (32, 64, 56, 64, 3, 1, 1)]:
        x = torch.randn(N, C, H, H, device="cuda").half().contiguous(memory_format=cl)
        w = torch.randn(K, C, R, R, device="cuda").half().contiguous(memory_format=cl)
        P = (H + 2 * pad - R) // st + 1
        dy = torch.randn(N, K, P, P, device="cuda").half().contiguous(memory_format=cl)
        common = ([st, st], [pad] * 4, [1, 1], 1, "default")
        replay.clear()
        for name, f in (("dgrad", lambda: backward_data(dy, w, list(x.shape), True, *common)),
                        ("wgrad", lambda: backward_weight(dy, x, list(w.shape), *common))):
            records.clear()
            counting.why = "-"
            f()
            torch.cuda.synchronize()
            why = counting.why
            records.clear()
            t = time.perf_counter()
            for _ in range(20):
                f()
            host = (time.perf_counter() - t) / 20 * 1e6
            torch.cuda.synchronize()
            gpu = (time.perf_counter() - t) / 20 * 1e6
            print(f"n{N}c{C}h{H}k{K}r{R}/{st} {name}: first call: {why}; recorded again in {len(records)} of 20, "
                  f"host {host:.0f} us a call, with the GPU {gpu:.0f} us", flush=True)
            if args.profile and name == "dgrad":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    f()
                prof.disable()
                torch.cuda.synchronize()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(10)
                print("\n".join(s.getvalue().splitlines()[4:22]))


if __name__ == "__main__":
    main()
