"""Is examples/resnet50.py's fp32 training-step disagreement tilegemm's or the problem's conditioning?

One training step of torchvision's ResNet-50 (random weights, batch 8, train mode) in fp32 with tf32 off, three
ways: cuDNN in fp32, cuDNN in fp64 (the reference), tilegemm in fp32 (``tilegemm.nn.convert_``). Prints, per
parameter with the worst errors, the relative error of cuDNN-fp32 and of tilegemm-fp32 against fp64: if cuDNN's own
fp32 gradients miss fp64 by as much, the example's threshold is too tight for the problem, not a kernel bug.

    PYTHONPATH=src:research python3 research/diagnose_resnet_grads.py
"""

from __future__ import annotations

import copy


def main() -> None:
    import tilegemm
    import torch
    import torchvision
    from torch import nn

    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(1)
    ref = torchvision.models.resnet50(num_classes=10).train().to(device="cuda", memory_format=torch.channels_last)
    ours = tilegemm.nn.convert_(copy.deepcopy(ref))
    r64 = copy.deepcopy(ref).double()
    x = torch.randn(8, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (8,), device="cuda")
    for model, inp in ((ref, x), (ours, x), (r64, x.double())):
        nn.functional.cross_entropy(model(inp), target).backward()

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))

    rows = []
    for (name, p64), p32, pt in zip(r64.named_parameters(), ref.parameters(), ours.parameters()):
        rows.append((rel(pt.grad, p64.grad), rel(p32.grad, p64.grad), name))
    rows.sort(reverse=True)
    print(f"{'parameter':40s} {'tilegemm fp32':>14s} {'cuDNN fp32':>12s}   (relative error against cuDNN fp64)")
    for ours_err, cudnn_err, name in rows[:12]:
        print(f"{name:40s} {ours_err:14.2e} {cudnn_err:12.2e}")
    worst_ours = max(r[0] for r in rows)
    worst_cudnn = max(r[1] for r in rows)
    print(f"worst: tilegemm {worst_ours:.2e}, cuDNN fp32 {worst_cudnn:.2e}")


if __name__ == "__main__":
    main()
