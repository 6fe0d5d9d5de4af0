"""Any torchvision classification model on tilegemm's convolutions: ``tilegemm.nn.convert_`` on it (random weights).

    python examples/torchvision_model.py resnext50_32x4d          # GPU: fp16 channels-last, batch 32 and 1
    python examples/torchvision_model.py convnext_tiny --batches 32,1,256
    python examples/torchvision_model.py resnext50_32x4d --tiny   # CI: a small ResNeXt under the interpreter
    python examples/torchvision_model.py mobilenet_v3_large --fold  # batch norms folded (convert_(fold_batchnorm=True))

Prints (1) output agreement with the cuDNN model, (2) inference images/s of both, eager and under
``torch.compile`` (no CUDA graphs: the host's time per layer counts), and (3) one training step's gradients,
tilegemm's and cuDNN's (fp32, tf32 off) against the same model's in fp64 (worst relative errors over the
parameters; tilegemm's held to twice cuDNN's plus 1e-4). Each model runs at the image size its default weights
expect (Inception-v3 299, EfficientNet-B7 600, ...). Needs ``pip install tilegemm[models]`` (torchvision) except
--tiny. ``tilegemm bench --op conv2d --model NAME`` times the same inference and training step in its rows.
"""

from __future__ import annotations

import argparse
import copy
import sys

import tilegemm  # first: it settles Triton's backend (compiler or interpreter) before triton is imported

import torch
from torch import nn

from tilegemm.models import torchvision_models as tvm
from tilegemm.models.bench import _train_deterministic
from tilegemm.models.resnet import relative_error


def make_model(name: str, tiny: bool) -> nn.Module:
    if tiny:
        return tvm.tiny_resnext()
    try:
        return tvm.build(name)
    except ImportError as err:
        sys.exit(f"this example needs torchvision: {err} (or run with --tiny)")


def inference(args, device, side) -> None:
    torch.manual_seed(0)
    dtype = torch.float16 if device == "cuda" else torch.float32
    # batch norms' statistics from random batches first: at their initial ones a random network's activations grow
    # until fp16 overflows (EfficientNet, MobileNetV3)
    ref = make_model(args.model, args.tiny).to(device=device, memory_format=torch.channels_last)
    ref = tvm.calibrate_batch_norms(ref, side).eval().to(dtype=dtype)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref), fold_batchnorm=args.fold)
    if args.fold:
        print(f"fold_batchnorm: {len(ours.tilegemm_folded)} batch norms folded into the convolutions before them")
    x = torch.randn(2 if args.tiny else 32, 3, side, side, device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        err = relative_error(ours(x), ref(x))
    print(f"{args.model if not args.tiny else 'small ResNeXt'} at {side}x{side}: inference output vs cuDNN "
          f"({str(dtype)[6:]}, channels-last): relative error {err:.2e}")
    if args.tiny:
        return
    from triton.testing import do_bench

    torch.backends.cudnn.benchmark = True
    compiled = [torch.compile(m, dynamic=False) for m in (ours, ref)]
    print(f"{'':>6s} {'eager':>25s} {'torch.compile':>37s}")
    print(f"{'batch':>6s} {'tilegemm':>12s} {'cuDNN':>12s} {'tilegemm':>18s} {'cuDNN':>18s}   (images/s)")
    for batch in args.batches:
        xb = torch.randn(batch, 3, side, side, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            calls = [lambda: ours(xb), lambda: ref(xb)] + [lambda c=c: c(xb) for c in compiled]
            rates = [batch / (do_bench(call, warmup=50, rep=300, return_mode="median") * 1e-3) for call in calls]
        print(f"{batch:>6d} {rates[0]:>12.0f} {rates[1]:>12.0f} {rates[2]:>18.0f} {rates[3]:>18.0f}"
              f"   ratio eager {rates[0] / rates[1]:.2f}x, compiled {rates[2] / rates[3]:.2f}x")


def training_step(args, device, side) -> None:
    """One training step's gradients (dropout and stochastic depth off, batch norms on the batch's statistics),
    tilegemm against cuDNN, both fp32 (tf32 off) and both against the fp64 model's."""
    torch.manual_seed(1)
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")  # fp32 on both sides: the comparison is about the kernels
    ref = _train_deterministic(make_model(args.model, args.tiny).to(device=device, memory_format=torch.channels_last))
    ours = _train_deterministic(tilegemm.nn.convert_(copy.deepcopy(ref), fold_batchnorm=args.fold))
    exact = _train_deterministic(copy.deepcopy(ref).double())
    x = torch.randn(2 if args.tiny else 8, 3, side, side, device=device).contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (x.shape[0],), device=device)
    for model, inp in ((ref, x), (ours, x), (exact, x.double())):
        tvm.gradients(model, inp, target)
    rows = [(relative_error(p.grad, e.grad), relative_error(q.grad, e.grad), name)
            for (name, p), q, e in zip(ours.named_parameters(), ref.parameters(), exact.parameters())
            if e.grad is not None and e.grad.norm() > 0]
    worst = max(rows, key=lambda r: r[0] / (2 * r[1] + 1e-4))  # nearest to the bound
    print(f"training step, fp32 against fp64: worst gradient relative error tilegemm {max(r[0] for r in rows):.2e}, "
          f"cuDNN {max(r[1] for r in rows):.2e}; closest call {worst[2]} ({worst[0]:.2e} against cuDNN's {worst[1]:.2e})")
    if any(ours_err > 2 * cudnn_err + 1e-4 for ours_err, cudnn_err, _ in rows):
        sys.exit("gradients disagree with cuDNN's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a torchvision classification model: " + ", ".join(tvm.names()))
    parser.add_argument("--tiny", action="store_true", help="a small ResNeXt at 16x16, batch 2, no timing")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[32, 1])
    parser.add_argument("--fold", action="store_true",
                        help="fold the batch norms into the convolutions for inference (convert_(fold_batchnorm=True); "
                             "a training step is unchanged)")
    args = parser.parse_args()
    try:
        tvm.check_name(args.model)
    except ValueError as err:
        parser.error(str(err))
    device = "cpu" if tilegemm.interpreting() else "cuda"
    if device == "cpu" and not args.tiny:
        parser.error("no CUDA GPU: kernels would run under Triton's interpreter; use --tiny")  # (exit 2)
    side = 16 if args.tiny else tvm.image_size(args.model)
    inference(args, device, side)
    training_step(args, device, side)


if __name__ == "__main__":
    main()
