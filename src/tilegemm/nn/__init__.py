"""Drop-in ``torch.nn`` modules whose forward and backward run tilegemm's kernels, and in-place conversion."""

from tilegemm.nn.conv import Conv2d
from tilegemm.nn.convert import convert_
from tilegemm.nn.int4 import Int4Linear, quantize_
from tilegemm.nn.linear import Linear

__all__ = ["Conv2d", "Int4Linear", "Linear", "convert_", "load_quantized_", "quantize_"]


def __getattr__(name: str):
    # load_quantized_ (a GPTQ/AWQ checkpoint directory into a model) lives in tilegemm.models.pretrained, which
    # `import tilegemm` leaves unimported (the models package stays lazy): imported on first use.
    if name == "load_quantized_":
        from tilegemm.models.pretrained import load_quantized_

        return load_quantized_
    raise AttributeError(f"module 'tilegemm.nn' has no attribute {name!r}")
