"""Drop-in ``torch.nn`` modules whose forward and backward run tilegemm's kernels, and in-place conversion."""

from tilegemm.nn.act_order import absorb_act_order_
from tilegemm.nn.conv import Conv2d
from tilegemm.nn.convert import convert_
from tilegemm.nn.fold import fold_batchnorm_
from tilegemm.nn.fuse import fuse_projections_
from tilegemm.nn.int4 import Int4Linear, quantize_
from tilegemm.nn.linear import Linear
from tilegemm.nn.moe import install as _install_experts, quantize_experts_, register_experts

_install_experts()  # the "tilegemm" experts implementation of transformers' MoE blocks (imports no transformers)

__all__ = ["ColwiseParallel", "Conv2d", "absorb_act_order_", "ExpertsTensorParallel", "Int4Linear", "Linear", "RowwiseParallel", "convert_", "fold_batchnorm_", "fuse_projections_", "load_quantized_",
           "quantize_", "quantize_experts_", "register_experts"]


def __getattr__(name: str):
    # load_quantized_ (a GPTQ/AWQ/compressed-tensors checkpoint directory into a model) lives in
    # tilegemm.models.pretrained, which `import tilegemm` leaves unimported (the models package stays lazy):
    # imported on first use.
    if name == "load_quantized_":
        from tilegemm.models.pretrained import load_quantized_

        return load_quantized_
    # The tensor-parallel styles live in tilegemm.parallel, imported on first use: it imports
    # torch.distributed.tensor, which `import tilegemm` must not pay for (docs/parallel.md).
    if name in ("ColwiseParallel", "ExpertsTensorParallel", "RowwiseParallel"):
        import tilegemm.parallel

        return getattr(tilegemm.parallel, name)
    raise AttributeError(f"module 'tilegemm.nn' has no attribute {name!r}")
