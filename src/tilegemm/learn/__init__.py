"""The learning kit: Triton-Puzzles 10-12 with their exact signatures (:mod:`tilegemm.learn.puzzles`) and the
interpreter's debug helpers (:mod:`tilegemm.learn.debug`). The guide's first kernels, copy and RGB-to-grey,
are the op family :mod:`tilegemm.ops.guide`."""
