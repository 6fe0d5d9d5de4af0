"""``tilegemm.puzzles``: the learning kit's ``tilegemm.learn.puzzles`` under its short name
(``import tilegemm.puzzles``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tilegemm.learn.puzzles")  # the same module object, not a copy
