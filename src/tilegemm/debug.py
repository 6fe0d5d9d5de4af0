"""``tilegemm.debug``: the learning kit's ``tilegemm.learn.debug`` under its short name
(``import tilegemm.debug``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tilegemm.learn.debug")  # the same module object, not a copy
