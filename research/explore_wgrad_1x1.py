"""The 1x1 layers' weight gradient is the GEMM ``dw[K, C] = dy^T[K, NPQ] @ x[NPQ, C]`` (A column-major: a TN
product with a long reduction and few output tiles). Per layer: cuDNN's weight gradient against
``tilegemm.matmul`` with each rung that applies, GPU time alone (CUDA graphs), fp16, channels-last.

    PYTHONPATH=src python3 research/explore_wgrad_1x1.py [--sweep resnet50] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os


def auto_pick(a, b) -> str:
    """What ``auto`` runs for ``a @ b`` (fp16): the survey's (rung, config), or the rules' rung."""
    import torch
    from tilegemm.ops.matmul import dispatch
    from tilegemm.ops.matmul.problem import make_problems

    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
    p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False)[0]
    picked = dispatch.surveyed(p)
    if picked is not None:
        return f"survey {picked[0]} {picked[1]}"
    return f"rules {dispatch.choose_kernel(p)} (split pays: {dispatch._split_pays(p) if p.M > 128 else '-'})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", default="resnet50")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import tilegemm
    import torch
    import triton.testing as tt
    from tilegemm.bench.base import bench_op

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    rungs = ["auto", "autotuned", "split_k", "persistent_tma", "gluon_f16"]
    rows = []
    for case in bench_op("conv2d").cases(args.sweep):
        d = case.dims
        if d["R"] != 1 or d["stride"] != 1 or d["groups"] != 1:
            continue
        N, C, H, W, K = d["N"], d["C"], d["H"], d["W"], d["K"]
        x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(K, C, 1, 1, device="cuda") * 0.05).half().contiguous(memory_format=cl)
        dy = torch.randn(N, K, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        a = dy.permute(0, 2, 3, 1).reshape(N * H * W, K).t()  # [K, NPQ], column-major
        b = x.permute(0, 2, 3, 1).reshape(N * H * W, C)  # [NPQ, C]
        ref = (a.float() @ b.float())
        conv_args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *conv_args,  # noqa: E731
                                                           [False, True, False])[1]
        row = dict(layer=case.label, mnk=[K, C, N * H * W], auto_picks=auto_pick(a, b),
                   cudnn_us=tt.do_bench_cudagraph(cudnn, rep=40) * 1e3,
                   torch_us=tt.do_bench_cudagraph(lambda: a @ b, rep=40) * 1e3)
        for rung in rungs:
            try:
                out = tilegemm.matmul(a, b, kernel=rung)
                err = float((out.float() - ref).norm() / ref.norm())
                us = tt.do_bench_cudagraph(lambda: tilegemm.matmul(a, b, kernel=rung), rep=40) * 1e3
                row[rung] = dict(us=us, err=err)
            except Exception as exc:  # noqa: BLE001 - a rung that does not apply is a result too
                row[rung] = dict(error=str(exc)[:120])
        rows.append(row)
        line = "  ".join(f"{r} {row[r]['us']:6.1f}" if "us" in row[r] else f"{r} -" for r in rungs)
        print(f"{case.label:28s} {K}x{C}x{N * H * W:<7d} auto: {row['auto_picks']}", flush=True)
        print(f"{'':28s} {'':20s} cuDNN {row['cudnn_us']:6.1f} torch {row['torch_us']:6.1f}  "
              f"{line}", flush=True)
    for r in rungs:
        v = [row["cudnn_us"] / row[r]["us"] for row in rows if "us" in row[r]]
        if v:
            print(f"{r}: cuDNN / it {math.exp(sum(map(math.log, v)) / len(v)):.2f}x over {len(v)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "wgrad-1x1.json"), "w") as f:
            json.dump(dict(commit=os.environ.get("TILEGEMM_GIT_COMMIT"), gpu=torch.cuda.get_device_name(),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
