"""tilegemm: Triton GPU kernels for the matrix-multiplication family.

Importing tilegemm does no GPU work and compiles nothing: kernels are imported, and the choice between
Triton's compiler and its interpreter is made, when a kernel first runs.
"""

from tilegemm.core.runtime import preselect

preselect()

from tilegemm import ops  # noqa: E402

ops.load()

from tilegemm.core.registry import kernels  # noqa: E402
from tilegemm.core.runtime import interpreting  # noqa: E402
from tilegemm.ops.guide import copy, rgb_to_grey  # noqa: E402
from tilegemm.ops.matmul import ACTIVATIONS, matmul  # noqa: E402
from tilegemm.ops import w4a16  # noqa: E402
from tilegemm.ops.conv2d import conv2d  # noqa: E402
from tilegemm.ops.grouped import grouped_mm  # noqa: E402
from tilegemm import nn  # noqa: E402

from tilegemm.core import __version__  # noqa: E402

__all__ = ["ACTIVATIONS", "__version__", "conv2d", "copy", "grouped_mm", "interpreting", "kernels", "matmul", "nn",
           "rgb_to_grey", "w4a16"]


def __getattr__(name: str):
    import importlib

    # The learning kit's modules, importable as tilegemm.puzzles and tilegemm.debug too; loaded on first use.
    if name in ("puzzles", "debug"):
        return importlib.import_module(f"tilegemm.learn.{name}")
    # tilegemm.models (transformers, torchvision) and tilegemm.parallel (torch.distributed): reachable as
    # attributes, imported on first use so that `import tilegemm` pulls in neither.
    if name in ("models", "parallel"):
        return importlib.import_module(f"tilegemm.{name}")
    raise AttributeError(f"module 'tilegemm' has no attribute {name!r}")
