"""Does a strided data gradient replay, and what does a call cost the host? (console)

    PYTHONPATH=src:research python3 research/diagnose_dgrad_replay.py
"""

from __future__ import annotations

import time


def main() -> None:
    import tilegemm  # noqa: F401
    import torch
    from tilegemm.ops.conv2d import replay
    from tilegemm.ops.conv2d.op import backward_data, backward_weight

    cl = torch.channels_last
    for (N, C, H, K, R, st, pad) in [(32, 256, 56, 512, 1, 2, 0), (32, 128, 56, 128, 3, 2, 1), (32, 128, 28, 512, 1, 1, 0),
                                     (32, 64, 56, 64, 3, 1, 1)]:
        x = torch.randn(N, C, H, H, device="cuda").half().contiguous(memory_format=cl)
        w = torch.randn(K, C, R, R, device="cuda").half().contiguous(memory_format=cl)
        P = (H + 2 * pad - R) // st + 1
        dy = torch.randn(N, K, P, P, device="cuda").half().contiguous(memory_format=cl)
        common = ([st, st], [pad] * 4, [1, 1], 1, "default")
        replay.clear()
        for name, f in (("dgrad", lambda: backward_data(dy, w, list(x.shape), True, *common)),
                        ("wgrad", lambda: backward_weight(dy, x, list(w.shape), *common))):
            f()
            torch.cuda.synchronize()
            n0 = replay.count()
            t = time.perf_counter()
            for _ in range(20):
                f()
            host = (time.perf_counter() - t) / 20 * 1e6
            torch.cuda.synchronize()
            gpu = (time.perf_counter() - t) / 20 * 1e6
            print(f"n{N}c{C}h{H}k{K}r{R}/{st} {name}: recorded {n0} -> {replay.count()}, host {host:.0f} us a call, "
                  f"with the GPU {gpu:.0f} us", flush=True)


if __name__ == "__main__":
    main()
