"""ResNets for ``tilegemm.nn.convert_``: torchvision's ResNet-50 (random weights) and a two-block ResNet small
enough for Triton's interpreter.

``examples/resnet50.py`` runs them; ``tilegemm bench --op conv2d --model resnet50``
(:class:`tilegemm.models.bench.ResNet50Bench`) times their inference. torchvision is imported only by
:func:`resnet50` (``pip install 'tilegemm[models]'``).
"""

from __future__ import annotations

import torch
from torch import nn

INSTALL = "pip install 'tilegemm[models]'"


def tiny_resnet(num_classes: int = 10) -> nn.Module:
    """ResNet-50's stem and one bottleneck (with its downsample shortcut), at toy width: for the interpreter."""

    class Bottleneck(nn.Module):
        def __init__(self, c_in, width, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width)
            self.downsample = nn.Sequential(nn.Conv2d(c_in, 4 * width, 1, stride, bias=False), nn.BatchNorm2d(4 * width))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            return torch.relu(self.bn3(self.conv3(y)) + self.downsample(x))

    return nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         Bottleneck(8, 4, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def resnet50() -> nn.Module:
    """torchvision's ResNet-50 with random weights (torchvision's init, from torch's generator: seed it first)."""
    try:
        import torchvision
    except ImportError:
        raise ImportError(f"ResNet-50 needs torchvision: {INSTALL}") from None
    return torchvision.models.resnet50(weights=None)


def make_model(tiny: bool) -> nn.Module:
    """The two-block ResNet (``tiny``) or torchvision's ResNet-50, in fp32 on the CPU, in training mode."""
    return tiny_resnet() if tiny else resnet50()


def relative_error(out, ref) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms), computed in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
