"""Op families, one package each. Importing a family's package registers its ops and kernels.

Adding a family is one folder under ``tilegemm/ops/`` whose ``__init__`` calls
:func:`tilegemm.core.registry.register_op` and :func:`~tilegemm.core.registry.register`, and one entry here.
Family packages import no triton: kernel modules are imported when a kernel first runs.
"""

import importlib

FAMILIES = ("guide", "matmul", "w4a16", "conv2d", "grouped")


def load() -> None:
    """Import every family's package (each registers itself once)."""
    for family in FAMILIES:
        importlib.import_module(f"tilegemm.ops.{family}")
