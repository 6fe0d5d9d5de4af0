"""MobileNetV2's forward layers, one process: tilegemm.conv2d with and without the matmul survey's choice (1x1
layers are GEMMs) against cuDNN, do_bench (L2 cleared, as the bench) and CUDA graphs (GPU time alone).

    PYTHONPATH=src python3 research/diagnose_mobilenet_fwd.py
"""

from __future__ import annotations


def main() -> None:
    import tilegemm
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.matmul import dispatch

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    real = dispatch.surveyed
    for case in bench_op("conv2d").cases("mobilenet"):
        d = case.dims
        s, p, gr = d["stride"], d["pad"], d["groups"]
        x = torch.randn(d["N"], d["C"], d["H"], d["W"], device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(d["K"], d["C"] // gr, d["R"], d["S"], device="cuda") * 0.05).half().contiguous(memory_format=cl)
        line = []
        for name, fn in (("cudnn", lambda: F.conv2d(x, w, None, s, p, 1, gr)),
                         ("ours", lambda: tilegemm.conv2d(x, w, None, s, p, 1, gr))):
            line.append(f"{name} ev {tt.do_bench(fn, rep=60) * 1e3:6.1f} gr {tt.do_bench_cudagraph(fn, rep=60) * 1e3:6.1f}")
        dispatch.surveyed = lambda prob: None
        try:
            from tilegemm.ops.conv2d import replay
            replay.clear()
            fn = lambda: tilegemm.conv2d(x, w, None, s, p, 1, gr)  # noqa: E731
            line.append(f"rules ev {tt.do_bench(fn, rep=60) * 1e3:6.1f} gr {tt.do_bench_cudagraph(fn, rep=60) * 1e3:6.1f}")
        finally:
            dispatch.surveyed = real
            replay.clear()
        print(f"{case.label:30s} " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
