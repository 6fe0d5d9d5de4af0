"""tilegemm: Triton GPU kernels for the matrix-multiplication family.

Importing tilegemm does no GPU work and compiles nothing: kernels are imported, and the choice between
Triton's compiler and its interpreter is made, when a kernel first runs.
"""

from tilegemm.runtime import preselect

preselect()

from tilegemm.ops.guide import copy, rgb_to_grey  # noqa: E402
from tilegemm.ops.matmul import ACTIVATIONS, matmul  # noqa: E402
from tilegemm.registry import kernels  # noqa: E402
from tilegemm.runtime import interpreting  # noqa: E402

__version__ = "0.1.0"

__all__ = ["ACTIVATIONS", "__version__", "copy", "interpreting", "kernels", "matmul", "rgb_to_grey"]
