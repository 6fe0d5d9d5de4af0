"""``tilegemm.w4a16``: the W4A16 family's API, ``tilegemm.ops.w4a16``, under its short name (``import tilegemm.w4a16``,
``from tilegemm.w4a16 import quantize``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tilegemm.ops.w4a16")  # the same module object, not a copy
