"""The first kernels of any Triton course: a copy and an RGB-to-grey conversion.

Both are memory-bound: their measure is GB/s against torch's own copy. Registered as the op families
``copy`` and ``grey`` so that the bench reads them like any other kernel.
"""

from tilegemm.core.registry import KernelSpec, OpSpec, register, register_op

register_op(OpSpec(
    name="copy", summary="copy a tensor (the guide's first kernel), GB/s against torch's copy",
    bench="tilegemm.ops.guide.bench:CopyBench",
))
register_op(OpSpec(
    name="grey", summary="RGB to grey conversion, GB/s against a torch copy of the same bytes",
    bench="tilegemm.ops.guide.bench:GreyBench",
))

register(KernelSpec(
    op="copy", name="flat", order=10, target="tilegemm.ops.guide.kernels:copy_flat",
    summary="one program per block of the flattened tensor, 16-byte accesses; strided inputs gathered",
))
register(KernelSpec(
    op="grey", name="planar", order=10, target="tilegemm.ops.guide.kernels:grey_planar",
    summary="one program per block of pixels, reading the R, G and B planes and writing one",
))

from tilegemm.ops.guide.api import copy, rgb_to_grey  # noqa: E402

__all__ = ["copy", "rgb_to_grey"]
