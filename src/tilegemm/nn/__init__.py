"""Drop-in ``torch.nn`` modules whose forward and backward run tilegemm's kernels, and in-place conversion."""

from tilegemm.nn.conv import Conv2d
from tilegemm.nn.convert import convert_
from tilegemm.nn.int4 import Int4Linear, quantize_
from tilegemm.nn.linear import Linear
from tilegemm.nn.moe import install as _install_experts, quantize_experts_, register_experts

_install_experts()  # the "tilegemm" experts implementation of transformers' MoE blocks (imports no transformers)

__all__ = ["Conv2d", "Int4Linear", "Linear", "convert_", "quantize_", "quantize_experts_", "register_experts"]
