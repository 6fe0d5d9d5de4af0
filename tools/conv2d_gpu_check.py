"""Check and time tilegemm.conv2d on the GPU: ResNet-50 (batch 32) and MobileNetV2 (batch 64) layers, fp16 and
bf16, NCHW and channels-last, forward and backward (grad x + grad weight), against cuDNN.

    python tools/conv2d_gpu_check.py --out conv2d_check.json [--sweeps resnet50,mobilenet] [--dtypes fp16,bf16]

Correctness: relative error against cuDNN in fp32 (tf32 off) for both memory formats of x (the weight
channels-last, as a converted model has it), and the memory formats of the output and both gradients: those torch
gives, channels-last where x or the weight is (``problem.output_format``). Timing (channels-last only,
triton.testing.do_bench medians): tilegemm vs cuDNN in benchmark mode (``torch.backends.cudnn.benchmark = True``);
ratio = cuDNN time / tilegemm time (> 1: tilegemm faster). Writes every row as JSON to --out and prints a short
table last. Stops timing (still checking) past --budget seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON file to write")
    parser.add_argument("--sweeps", default="resnet50,mobilenet")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds after which timing stops (default 200)")
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep in ms (default 40)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: the tiny sweep in fp16 under Triton's interpreter, checks only (tests the script)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.sweeps, args.dtypes, args.budget = "tiny", "fp16", -1.0

    import tilegemm  # first: it settles Triton's backend before triton is imported

    import torch
    import torch.nn.functional as F
    from tilegemm.bench.base import bench_op
    from tilegemm.core.checks import relative_error
    from tilegemm.ops.conv2d.op import backward_data, backward_weight
    from tilegemm.ops.conv2d.problem import DgradCall, WgradCall, channels_last, output_format, wgrad_format
    from tilegemm.ops.conv2d.reference import tolerance

    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and (not torch.cuda.is_available() or tilegemm.interpreting()):
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    start = time.time()
    op = bench_op("conv2d")
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    rows = []
    cl = torch.channels_last

    def cudnn_bwd(dy, x, w, conv):
        s, p = [conv["stride"]] * 2, [conv["padding"]] * 2
        return torch.ops.aten.convolution_backward(dy, x, w, None, s, p, [1, 1], False, [0, 0], conv["groups"],
                                                   [True, True, False])[:2]

    def ours_bwd(dy, x, w, conv):
        common = dict(stride=[conv["stride"]] * 2, padding=[conv["padding"]] * 4, dilation=[1, 1],
                      groups=conv["groups"], precision="default")
        # the layouts autograd's backward asks for: the layer's (channels-last where x or the weight is)
        layer_cl = output_format(x, w) == cl
        dx = backward_data(DgradCall(dy=dy, weight=w, x_shape=list(x.shape), x_channels_last=layer_cl, **common))
        return dx, backward_weight(WgradCall(dy=dy, x=x, w_shape=list(w.shape), w_channels_last=channels_last(w),
                                             **common))

    for sweep in args.sweeps.split(","):
        for case in op.cases(sweep):
            d = case.dims
            conv = dict(stride=d["stride"], padding=d["pad"], groups=d["groups"])
            flops = op.work(case, "fp16", {"mode": "fwd"})
            for dname in args.dtypes.split(","):
                dtype = dtypes[dname]
                tol = tolerance(dtype)
                torch.manual_seed(0)
                x = torch.randn(d["N"], d["C"], d["H"], d["W"], device=device, dtype=dtype).contiguous(memory_format=cl)
                fan_in = d["C"] // d["groups"] * d["R"] * d["S"]
                w = (torch.randn(d["K"], d["C"] // d["groups"], d["R"], d["S"], device=device) / fan_in**0.5).to(dtype)
                w = w.contiguous(memory_format=cl)  # as model.to(memory_format=channels_last) leaves it (and the bench)
                torch.backends.cudnn.allow_tf32 = False
                ref = F.conv2d(x.float(), w.float(), None, **conv)
                dy = torch.randn(ref.shape, device=device, dtype=dtype).contiguous(memory_format=cl)
                ref_dx, ref_dw = cudnn_bwd(dy.float(), x.float(), w.float(), conv)
                torch.backends.cudnn.allow_tf32 = True
                row = dict(sweep=sweep, shape=case.label, dims=d, dtype=dname, tolerance=tol)
                ok = True
                for fmt_name, fmt in (("nhwc", cl), ("nchw", torch.contiguous_format)):
                    xf, dyf = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
                    try:
                        out = tilegemm.conv2d(xf, w, None, **conv)
                        err = relative_error(out, ref)
                        # torch's layouts: an NCHW x with the channels-last weight is a channels-last layer
                        layer = output_format(xf, w)
                        kept = out.is_contiguous(memory_format=layer)
                        dx, dw = ours_bwd(dyf, xf, w, conv)
                        errs = (err, relative_error(dx, ref_dx), relative_error(dw, ref_dw))
                        row[f"{fmt_name}_err"] = dict(fwd=errs[0], dgrad=errs[1], wgrad=errs[2])
                        row[f"{fmt_name}_format_kept"] = kept and dx.is_contiguous(memory_format=layer) and \
                            dw.is_contiguous(memory_format=wgrad_format(xf, w.shape, channels_last(w)))
                        ok = ok and max(errs) <= tol and row[f"{fmt_name}_format_kept"]
                    except Exception as exc:  # noqa: BLE001 - reported per row
                        row[f"{fmt_name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        ok = False
                row["ok"] = ok
                if ok and time.time() - start < args.budget:
                    from triton.testing import do_bench

                    torch.backends.cudnn.benchmark = True
                    t = {
                        "fwd_ours": do_bench(lambda: tilegemm.conv2d(x, w, None, **conv), warmup=10, rep=args.rep),
                        "fwd_cudnn": do_bench(lambda: F.conv2d(x, w, None, **conv), warmup=10, rep=args.rep),
                        "bwd_ours": do_bench(lambda: ours_bwd(dy, x, w, conv), warmup=10, rep=args.rep),
                        "bwd_cudnn": do_bench(lambda: cudnn_bwd(dy, x, w, conv), warmup=10, rep=args.rep),
                    }
                    row["ms"] = t
                    row["fwd_ratio"] = t["fwd_cudnn"] / t["fwd_ours"]
                    row["bwd_ratio"] = t["bwd_cudnn"] / t["bwd_ours"]
                    row["fwd_tflops"] = flops * 1e-9 / t["fwd_ours"]
                    row["bwd_tflops"] = 2 * flops * 1e-9 / t["bwd_ours"]
                    row["cudnn_fwd_tflops"] = flops * 1e-9 / t["fwd_cudnn"]
                rows.append(row)
                print(f"{time.time() - start:6.1f}s {sweep:9s} {case.label:28s} {dname} ok={ok} "
                      f"fwd={row.get('fwd_ratio', float('nan')):.2f}x bwd={row.get('bwd_ratio', float('nan')):.2f}x",
                      flush=True)

    meta = dict(gpu=None if args.dry_run else torch.cuda.get_device_name(), torch=torch.__version__, seconds=time.time() - start)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def geomean(values):
        values = [v for v in values if v and v > 0]
        return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")

    print(f"\n{'sweep':9s} {'dtype':5s} {'correct':>8s} {'fwd geo':>8s} {'fwd worst':>10s} {'bwd geo':>8s} "
          f"{'bwd worst':>10s} {'timed':>6s}")
    for sweep in args.sweeps.split(","):
        for dname in args.dtypes.split(","):
            sel = [r for r in rows if r["sweep"] == sweep and r["dtype"] == dname]
            timed = [r for r in sel if "fwd_ratio" in r]
            fwd = [r["fwd_ratio"] for r in timed]
            bwd = [r["bwd_ratio"] for r in timed]
            print(f"{sweep:9s} {dname:5s} {sum(r['ok'] for r in sel):>4d}/{len(sel):<3d} {geomean(fwd):8.2f} "
                  f"{min(fwd, default=float('nan')):10.2f} {geomean(bwd):8.2f} {min(bwd, default=float('nan')):10.2f} "
                  f"{len(timed):>6d}")
    print(f"wrote {args.out}; {time.time() - start:.0f}s")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
