"""Whole models on tilegemm's layers: what ``examples/`` run and ``tilegemm bench --model`` times.

- :mod:`.llama`: a Llama-architecture ``transformers`` model (Llama-3-8B shapes or a tiny config), greedy decoding
  with a static KV cache, eager, replayed from a CUDA graph or compiled; needs ``transformers``.
- :mod:`.resnet`: torchvision's ResNet-50 (needs ``torchvision``) and a two-block ResNet for the interpreter.
- :mod:`.pretrained`: :func:`from_pretrained`, a 4-bit GPTQ/AWQ checkpoint directory as its ``transformers`` model
  on :class:`tilegemm.nn.Int4Linear` (needs ``transformers`` and ``safetensors``).
- :mod:`.bench`: the bench adapters of both (``--op w4a16 --model llama``, ``--op conv2d --model resnet50``).

``pip install 'tilegemm[models]'`` brings these libraries. Nothing here is imported by ``import tilegemm``
(``tilegemm.nn.load_quantized_`` imports :mod:`.pretrained` on first use), and these modules import
transformers, safetensors and torchvision only inside the functions that need them.
"""

from tilegemm.models.pretrained import from_pretrained

__all__ = ["from_pretrained"]
