"""torchvision's classification models for ``tilegemm.nn.convert_``: built by name with random weights, each at the
image size its default weights expect, and a small ResNeXt for the interpreter.

The names and sizes come from the conv2d zoo's data file (:mod:`tilegemm.ops.conv2d.zoo`), so listing them
needs no torchvision; building a model does (``pip install 'tilegemm[models]'``), imported only by :func:`build`.
``tilegemm bench --op conv2d --model NAME`` (:class:`tilegemm.models.bench.TorchvisionBench`) and
``examples/torchvision_model.py`` run them.
"""

from __future__ import annotations

import torch
from torch import nn

from tilegemm.models.resnet import INSTALL


def names() -> list[str]:
    """The classification models whose convolutions the zoo holds (torchvision's, sorted)."""
    from tilegemm.ops.conv2d.zoo import load

    return sorted(load()["image_sizes"])


def image_size(name: str) -> int:
    """The square image side ``name``'s default weights expect (224 for most; Inception-v3 299)."""
    from tilegemm.ops.conv2d.zoo import load

    return load()["image_sizes"][name]


def check_name(name: str) -> None:
    """ValueError naming the choices for a name that is not one of :func:`names`."""
    if name not in names():
        raise ValueError(f"unknown torchvision classification model {name!r}; choose one of: {', '.join(names())}")


def require_torchvision() -> None:
    """ImportError naming the extra to install where torchvision is missing or does not import."""
    try:
        import torchvision.models  # noqa: F401
    except ImportError:
        raise ImportError(f"torchvision's models need torchvision: {INSTALL}") from None
    except Exception as err:  # a build whose compiled ops do not load in this torch
        raise ImportError(f"torchvision is installed but does not import ({type(err).__name__}: {err}); install "
                          f"the build matching torch {torch.__version__}: {INSTALL}") from None


def build(name: str) -> nn.Module:
    """torchvision's ``name`` with random weights (torchvision's init, from torch's generator: seed it first), in
    fp32 on the CPU, in training mode; ViTs built for :func:`image_size`."""
    check_name(name)
    require_torchvision()
    import warnings

    from torchvision import models

    kwargs = {"image_size": image_size(name)} if name.startswith("vit") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GoogLeNet's and Inception's notes on their default init
        return models.get_model(name, weights=None, **kwargs)


def tiny_resnext(num_classes: int = 10) -> nn.Module:
    """A stem and one ResNeXt bottleneck (8 groups of 2 channels in its 3x3, as ResNeXt's narrow groups) and a
    depthwise 3x3, at toy width: for the interpreter."""

    class Block(nn.Module):
        def __init__(self, c_in, width, groups, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, 2 * width, 1, bias=False), nn.BatchNorm2d(2 * width)
            self.down = nn.Sequential(nn.Conv2d(c_in, 2 * width, 1, stride, bias=False), nn.BatchNorm2d(2 * width))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            return torch.relu(self.bn3(self.conv3(y)) + self.down(x))

    return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), Block(8, 16, 8, 2),
                         nn.Conv2d(32, 32, 3, 1, 1, groups=32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, num_classes))


def logits_of(out) -> tuple[torch.Tensor, ...]:
    """The logits a model's forward returned: GoogLeNet and Inception-v3 in training mode also return their
    auxiliary heads' (a named tuple), every one of which a training step's loss takes."""
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(t for t in out if isinstance(t, torch.Tensor))


def gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
    """One training step's parameter gradients (cross-entropy on every logits head), flattened into one fp32
    vector in the parameters' order (zeros for a parameter the step does not reach). ``loss_scale``: the loss is
    multiplied by it before the backward pass and the gradients divided by it after, in fp32, as mixed-precision
    training scales it (``torch.amp.GradScaler``): fp16's gradients of a randomly initialised deep network fall
    below its normal range (6e-5), where few bits are left."""
    for p in model.parameters():
        p.grad = None
    loss = sum(nn.functional.cross_entropy(o.float(), target) for o in logits_of(model(x)))
    (loss * loss_scale).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()]) / loss_scale


def fp16_loss_scale(model: nn.Module, x: torch.Tensor, target: torch.Tensor, start: float = 2.0 ** 16) -> float:
    """The largest power of two up to ``start`` whose scaled step leaves every gradient of ``model`` finite
    (GradScaler's back-off, found once): 1.0 where even that overflows."""
    scale = start
    while scale > 1.0:
        if torch.isfinite(gradients(model, x, target, scale)).all():
            return scale
        scale /= 2
    return 1.0


def calibrate_batch_norms(model: nn.Module, image: int, batches: int = 4, batch: int = 8) -> nn.Module:
    """``model`` (in place) with its batch norms' running statistics set from ``batches`` random batches of
    ``image`` x ``image`` images, and every module back in the mode it was in. A randomly initialised network in
    eval mode normalises by the initial statistics (mean 0, variance 1), so activations grow layer by layer:
    EfficientNet and MobileNetV3 overflow fp16 at their logits, and a comparison of logits measures nothing.
    Dropout and stochastic depth stay off while it runs: they would draw on the global generator, so the
    statistics (and every result measured on them) would change from run to run."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return model
    modes = [(m, m.training) for m in model.modules()]
    momenta = [m.momentum for m in norms]
    p = next(model.parameters())
    gen = torch.Generator(device=p.device).manual_seed(0)
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
        model.train()
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
                m.eval()
        with torch.no_grad():
            for _ in range(batches):
                model(torch.randn(batch, 3, image, image, generator=gen, device=p.device, dtype=p.dtype)
                      .contiguous(memory_format=torch.channels_last))
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return model