"""Every distinct convolution of torchvision's classification models, read from the models themselves.

    python tools/conv2d_zoo_layers.py                 # writes src/tilegemm/ops/conv2d/zoo.json
    python tools/conv2d_zoo_layers.py --check         # regenerates and compares with the committed file

Each model is built with ``weights=None``, its tensors on the meta device (no memory, no arithmetic), and run once on two
images of the size its default weights expect (``weights.transforms().crop_size``: 224 for most, 299 for
Inception-v3, 240-600 for EfficientNet-B1..B7, 384-480 for EfficientNetV2, 256 for Swin-V2, 384 for
RegNetY-128GF, 518 for ViT-H/14), in training mode so that auxiliary heads (GoogLeNet, Inception-v3) run too.
A forward hook on every ``nn.Conv2d`` records its input's shape and the module's hyper-parameters. The layers are
de-duplicated over all models (each remembers the models it comes from) and written sorted, so the bench's
``zoo`` sweep (:mod:`tilegemm.ops.conv2d.bench`) needs no torchvision at run time. Needs torchvision
(``pip install 'tilegemm[models]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "src" / "tilegemm" / "ops" / "conv2d" / "zoo.json"
SCHEMA = "tilegemm-conv2d-zoo/1"
# The families of torchvision's classification models (torchvision.models.list_models(module=models)) whose
# convolutions the sweep holds; a name starts with one of these.
FAMILIES = ("resnet", "resnext", "wide_resnet", "regnet", "convnext", "efficientnet", "mobilenet", "mnasnet",
            "shufflenet", "squeezenet", "densenet", "googlenet", "inception", "vgg", "alexnet", "vit", "swin",
            "maxvit")
FIELDS = ("C", "K", "H", "W", "R", "S", "stride", "padding", "dilation", "groups", "padding_mode", "bias")


def model_names() -> list[str]:
    """torchvision's classification models of :data:`FAMILIES`, sorted."""
    from torchvision import models

    return sorted(n for n in models.list_models(module=models) if n.startswith(FAMILIES))


def image_size(name: str) -> int:
    """The square image side the model's default weights expect (the crop of their transforms)."""
    from torchvision import models

    crop = models.get_model_weights(name).DEFAULT.transforms().crop_size
    return int(crop[0] if isinstance(crop, (list, tuple)) else crop)


def _padding(module: torch.nn.Conv2d) -> list[int]:
    """(top/bottom, left/right) zero padding; a string padding resolved as F.conv2d does (symmetric here)."""
    if isinstance(module.padding, str):
        left, right, top, bottom = module._reversed_padding_repeated_twice
        if top != bottom or left != right:
            raise ValueError(f"asymmetric padding {module.padding!r} in {module}")
        return [int(top), int(left)]
    return [int(p) for p in module.padding]


@contextlib.contextmanager
def _meta_tensors():
    """Parameters and buffers moved to the meta device as modules register them (not every model builds under
    ``torch.device("meta")``: RegNet computes its widths with tensors it reads back)."""
    module = torch.nn.Module
    register_parameter, register_buffer = module.register_parameter, module.register_buffer

    def parameter(self, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), param.requires_grad)
        register_parameter(self, name, param)

    def buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, None if tensor is None else tensor.to("meta"), persistent)

    module.register_parameter, module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        module.register_parameter, module.register_buffer = register_parameter, register_buffer


def layers_of(name: str) -> list[dict]:
    """The convolutions (without ``models``) that one forward of ``name`` runs, in call order (repeats kept)."""
    from torchvision import models

    side = image_size(name)
    kwargs = {"image_size": side} if name.startswith("vit") else {}  # ViT's position embedding fixes its size
    found: list[dict] = []

    def hook(module, inputs, output):
        _, C, H, W = inputs[0].shape
        found.append(dict(C=int(C), K=module.out_channels, H=int(H), W=int(W), R=module.kernel_size[0],
                          S=module.kernel_size[1], stride=list(module.stride), padding=_padding(module),
                          dilation=list(module.dilation), groups=module.groups, padding_mode=module.padding_mode,
                          bias=module.bias is not None))

    import warnings

    with _meta_tensors(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GoogLeNet's and Inception's notes on their default init
        model = models.get_model(name, weights=None, **kwargs).train()
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.register_forward_hook(hook)
        model(torch.empty(2, 3, side, side, device="meta"))  # two: batch norm in training mode wants more than one value
    return found


def key(layer: dict) -> tuple:
    """The sort and identity key of a layer: its fields in :data:`FIELDS` order."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in (layer[f] for f in FIELDS))


def zoo(names: list[str] | None = None) -> dict:
    """The file's content: every distinct layer of ``names`` (default :func:`model_names`) with its models."""
    import torchvision

    names = model_names() if names is None else names
    merged: dict[tuple, dict] = {}
    for name in names:
        for layer in layers_of(name):
            entry = merged.setdefault(key(layer), dict(layer, models=[]))
            if name not in entry["models"]:
                entry["models"].append(name)
    layers = [merged[k] for k in sorted(merged)]
    for layer in layers:
        layer["models"].sort()
    return dict(schema=SCHEMA, torchvision=torchvision.__version__.split("+")[0],
                note="torchvision's classification models built with weights=None, one image of the size their "
                     "default weights expect (image_sizes), training mode (auxiliary heads included); every "
                     "nn.Conv2d's input shape read by a forward hook; de-duplicated; sorted by "
                     + ", ".join(FIELDS),
                image_sizes={n: image_size(n) for n in names}, layers=layers)


def dumps(content: dict) -> str:
    """The file's text: one layer a line, so a diff shows which layers changed."""
    head = {k: v for k, v in content.items() if k != "layers"}
    lines = [json.dumps(layer, separators=(", ", ": ")) for layer in content["layers"]]
    text = json.dumps(head, indent=1)[:-2] + ',\n "layers": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"
    assert json.loads(text) == content
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args()
    text = dumps(zoo())
    if args.check:
        same = Path(args.out).read_text() == text
        print("zoo.json is up to date" if same else "zoo.json differs from the models: regenerate it")
        return 0 if same else 1
    Path(args.out).write_text(text)
    content = json.loads(text)
    print(f"wrote {args.out}: {len(content['layers'])} distinct convolutions of {len(content['image_sizes'])} models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
