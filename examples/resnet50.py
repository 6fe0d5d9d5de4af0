"""ResNet-50 on tilegemm's convolutions: ``tilegemm.nn.convert_`` on torchvision's model (random weights).

    python examples/resnet50.py                 # GPU: fp16 channels-last inference at batch 32 and 256
    python examples/resnet50.py --tiny          # CI: a two-block ResNet under Triton's interpreter, no timing

Prints (1) output agreement with the cuDNN model, (2) inference images/s of both, eager and under
``torch.compile(mode="reduce-overhead")`` (CUDA graphs: no host time per layer), and (3) one training step's
gradients, tilegemm's and cuDNN's (fp32, tf32 off) against the same model's in fp64 (worst relative errors
over the parameters). Needs ``pip install tilegemm[models]`` (torchvision) except --tiny. The models are
``tilegemm.models.resnet``'s; ``tilegemm bench --op conv2d --model resnet50`` times the same inference in four
modes.
"""

from __future__ import annotations

import argparse
import copy
import sys

import tilegemm  # first: it settles Triton's backend (compiler or interpreter) before triton is imported

import torch
from torch import nn

from tilegemm.models import resnet
from tilegemm.models.resnet import relative_error


def make_model(tiny: bool) -> nn.Module:
    try:
        return resnet.make_model(tiny)
    except ImportError:
        sys.exit("this example needs torchvision: pip install 'tilegemm[models]' (or run with --tiny)")


def inference(args, device) -> None:
    torch.manual_seed(0)
    dtype = torch.float16 if device == "cuda" else torch.float32
    ref = make_model(args.tiny).eval().to(device=device, dtype=dtype, memory_format=torch.channels_last)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref))
    side = 16 if args.tiny else 224
    x = torch.randn(2 if args.tiny else 32, 3, side, side, device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        err = relative_error(ours(x), ref(x))
    print(f"inference output vs cuDNN ({str(dtype)[6:]}, channels-last): relative error {err:.2e}")
    if args.tiny:
        return
    from triton.testing import do_bench

    torch.backends.cudnn.benchmark = True
    graphed = [torch.compile(m, mode="reduce-overhead") for m in (ours, ref)]  # CUDA graph trees

    def step(fn, xb):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(xb)

    print(f"{'':>6s} {'eager':>25s} {'torch.compile(mode=reduce-overhead)':>37s}")
    print(f"{'batch':>6s} {'tilegemm':>12s} {'cuDNN':>12s} {'tilegemm':>18s} {'cuDNN':>18s}   (images/s)")
    for batch in args.batches:
        xb = torch.randn(batch, 3, side, side, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            calls = [lambda: ours(xb), lambda: ref(xb)] + [lambda g=g: step(g, xb) for g in graphed]
            rates = [batch / (do_bench(call, warmup=50, rep=300, return_mode="median") * 1e-3) for call in calls]
        print(f"{batch:>6d} {rates[0]:>12.0f} {rates[1]:>12.0f} {rates[2]:>18.0f} {rates[3]:>18.0f}")


def training_step(args, device) -> None:
    """One training step's gradients, tilegemm against cuDNN, both in fp32 (tf32 off) and both against the same
    model in fp64: a random ResNet-50's batch-norm gradients are ill-conditioned enough that cuDNN's own fp32
    gradients miss fp64 by about 2e-2 (docs/conv2d.md), so tilegemm's are held to within
    twice cuDNN's error of the fp64 ones (plus 1e-4), not to cuDNN's fp32 values."""
    torch.manual_seed(1)
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")  # fp32 on both sides: the comparison is about the kernels
    ref = make_model(args.tiny).train().to(device=device, memory_format=torch.channels_last)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref))
    exact = copy.deepcopy(ref).double()
    side = 16 if args.tiny else 224
    x = torch.randn(2 if args.tiny else 8, 3, side, side, device=device).contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (x.shape[0],), device=device)
    for model, inp in ((ref, x), (ours, x), (exact, x.double())):
        nn.functional.cross_entropy(model(inp), target).backward()
    rows = [(relative_error(p.grad, e.grad), relative_error(q.grad, e.grad), name)
            for (name, p), q, e in zip(ours.named_parameters(), ref.parameters(), exact.parameters())]
    worst = max(rows, key=lambda r: r[0] / (2 * r[1] + 1e-4))  # nearest to the bound
    print(f"training step, fp32 against fp64: worst gradient relative error tilegemm {max(r[0] for r in rows):.2e}, "
          f"cuDNN {max(r[1] for r in rows):.2e}; closest call {worst[2]} ({worst[0]:.2e} against cuDNN's {worst[1]:.2e})")
    if any(ours_err > 2 * cudnn_err + 1e-4 for ours_err, cudnn_err, _ in rows):
        sys.exit("gradients disagree with cuDNN's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a two-block ResNet at 16x16, batch 2, no timing")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=None,
                        help="batch sizes timed (default 32,256; not with --tiny, which times nothing)")
    args = parser.parse_args()
    device = "cpu" if tilegemm.interpreting() else "cuda"
    if device == "cpu" and not args.tiny:
        parser.error("no CUDA GPU: kernels would run under Triton's interpreter; use --tiny")  # (exit 2)
    if args.tiny and args.batches:
        parser.error("--batches sets the batches timed; --tiny times nothing")
    args.batches = args.batches or [32, 256]
    inference(args, device)
    training_step(args, device)


if __name__ == "__main__":
    main()
