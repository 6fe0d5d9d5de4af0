"""Whole models on tilegemm's layers: what ``examples/`` run and ``tilegemm bench --model`` times.

- :mod:`.llama`: a Llama-architecture ``transformers`` model (Llama-3-8B shapes or a tiny config), greedy decoding
  with a static KV cache, eager, replayed from a CUDA graph or compiled; needs ``transformers``.
- :mod:`.resnet`: torchvision's ResNet-50 (needs ``torchvision``) and a two-block ResNet for the interpreter.
- :mod:`.bench`: the bench adapters of both (``--op w4a16 --model llama``, ``--op conv2d --model resnet50``).

``pip install 'tilegemm[models]'`` brings both libraries. Nothing here is imported by ``import tilegemm``, and
these modules import transformers and torchvision only inside the functions that need them.
"""
