"""Drop-in ``torch.nn`` modules whose forward and backward run tilegemm's kernels, and in-place conversion."""

from tilegemm.nn.conv import Conv2d
from tilegemm.nn.convert import convert_
from tilegemm.nn.linear import Linear

__all__ = ["Conv2d", "Linear", "convert_"]
