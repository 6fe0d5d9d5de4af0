"""Drop-in ``torch.nn`` modules whose forward and backward run tilegemm's kernels, and in-place conversion."""

from tilegemm.nn.conv import Conv2d
from tilegemm.nn.convert import convert_
from tilegemm.nn.int4 import Int4Linear, quantize_
from tilegemm.nn.linear import Linear
from tilegemm.models.pretrained import load_quantized_  # noqa: E402 (loads a GPTQ/AWQ checkpoint into a model)

__all__ = ["Conv2d", "Int4Linear", "Linear", "convert_", "load_quantized_", "quantize_"]
