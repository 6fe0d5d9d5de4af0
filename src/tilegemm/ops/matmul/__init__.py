"""Dense GEMM: ``activation(alpha * (a @ b) + beta * c + bias)``.

The rungs of the ladder, each a file beside this one, registered here by name. Nothing here imports
triton: a kernel module is imported when its kernel first runs.
"""

from tilegemm.registry import KernelSpec, register, register_pseudo


def _tma_requirement() -> str | None:
    # Imported when asked: the kernel module needs triton, and this package must not import it.
    from tilegemm.ops.matmul.persistent_tma import requires

    return requires()


register(KernelSpec(
    op="matmul", name="naive", order=10, target="tilegemm.ops.matmul.naive:run",
    summary="textbook tile kernel: one program per output tile, row-major launch order, fixed blocks",
))
register(KernelSpec(
    op="matmul", name="grouped", order=20, target="tilegemm.ops.matmul.grouped:run",
    summary="naive + grouped (swizzled) launch order, so programs running together share tiles in L2",
))
register(KernelSpec(
    op="matmul", name="autotuned", order=30, target="tilegemm.ops.matmul.autotuned:run",
    summary="grouped + block sizes, warps and pipeline stages chosen by timing per shape",
))
register(KernelSpec(
    op="matmul", name="split_k", order=40, target="tilegemm.ops.matmul.split_k:run",
    summary="for skinny problems: several programs split one tile's K loop and reduce with atomics",
))
register(KernelSpec(
    op="matmul", name="persistent_tma", order=50, target="tilegemm.ops.matmul.persistent_tma:run",
    requires=lambda: _tma_requirement(),
    summary="Hopper: one program per SM over tiles in grouped order, TMA tile loads/stores, split epilogue",
))
register_pseudo("matmul", "auto", "picks the best rung for the problem (the default)")

from tilegemm.ops.matmul.op import ACTIVATIONS, matmul  # noqa: E402

__all__ = ["ACTIVATIONS", "matmul"]
