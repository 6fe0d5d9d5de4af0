"""Whole models on tilegemm's layers: what ``examples/`` run and ``tilegemm bench --model`` times.

- :mod:`.llama`: a Llama-architecture ``transformers`` model (Llama-3-8B shapes or a tiny config), greedy decoding
  with a static KV cache, eager, replayed from a CUDA graph or compiled; needs ``transformers``.
- :mod:`.resnet`: torchvision's ResNet-50 (needs ``torchvision``) and a two-block ResNet for the interpreter.
- :mod:`.pretrained`: :func:`from_pretrained`, a 4-bit GPTQ/AWQ/compressed-tensors checkpoint directory as its
  ``transformers`` model on :class:`tilegemm.nn.Int4Linear` (needs ``transformers`` and ``safetensors``).
- :mod:`.bench`: the bench adapters of both (``--op w4a16 --model llama``, ``--op conv2d --model resnet50``).

``pip install 'tilegemm[models]'`` brings these libraries. Nothing here is imported by ``import tilegemm``
(``tilegemm.nn.load_quantized_`` imports :mod:`.pretrained` on first use), and these modules import
transformers, safetensors and torchvision only inside the functions that need them.
"""

import torch

from tilegemm.models import pretrained

__all__ = ["from_pretrained"]


def from_pretrained(path, dtype: torch.dtype = torch.float16, device=None, *, device_mesh=None, tp_plan="auto",
                    fuse_projections: bool = False, model_class=None, experts_implementation=None):
    """The ``transformers`` causal-LM of the quantized (GPTQ, AWQ, AutoRound or compressed-tensors) checkpoint
    directory ``path``, every quantized Linear a :class:`tilegemm.nn.Int4Linear`
    (:func:`tilegemm.models.pretrained.from_pretrained` says what it takes
    and raises). ``device_mesh`` (a 1-D ``DeviceMesh``): tensor-parallel, each rank reading only its shard of every
    split tensor, split as ``tp_plan`` says (``"auto"``: the config's ``base_model_tp_plan``; or a dict of module
    names or patterns to ``"colwise"`` / ``"rowwise"``; docs/parallel.md). ``fuse_projections=True``: then
    :func:`tilegemm.nn.absorb_act_order_` and :func:`tilegemm.nn.fuse_projections_` (q/k/v and gate/up one product
    each; not with ``device_mesh``). ``model_class``: what builds the model from its config (a transformers auto
    class or model class; default ``AutoModelForCausalLM``). ``experts_implementation``: what the model is built with
    (transformers' ``experts_implementation=``; ``"tilegemm"`` puts 16-bit experts blocks on tilegemm's grouped
    kernels too; a warning names MoE blocks it cannot reach and the ``tilegemm.nn.convert_`` that can)."""
    if not isinstance(fuse_projections, bool):  # (a truthy string such as "no" would join them unnoticed)
        raise TypeError(f"fuse_projections must be True or False, got {fuse_projections!r}")
    if fuse_projections and device_mesh is not None:
        raise ValueError("fuse_projections=True joins whole weights, device_mesh splits them: use one or the other")
    if device_mesh is None:
        model = pretrained.from_pretrained(path, dtype, device, model_class, experts_implementation)
        if fuse_projections:
            from tilegemm.nn import absorb_act_order_, fuse_projections_

            fuse_projections_(absorb_act_order_(model))
        return model
    from tilegemm.parallel import from_pretrained_sharded  # imports torch.distributed.tensor: only when asked

    return from_pretrained_sharded(path, device_mesh, tp_plan, dtype=dtype, device=device, model_class=model_class,
                                   experts_implementation=experts_implementation)
