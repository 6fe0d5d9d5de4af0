"""Checks of a loaded model against the tensors the tests' checkpoint writer stored (``ckpt_writer``'s reference
state dict), shared by the loader's test files."""

from __future__ import annotations

import torch

from tilegemm.nn import Int4Linear


def assert_loaded_exactly(model, reference) -> None:
    """The checkpoint read as written: every Int4Linear holds exactly the writer's dequantized weight, every other
    parameter the stored tensor. For tests of how settings are read, where a forward under the interpreter would
    run kernels on layers of a kind the other tests run."""
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    for n, m in int4.items():
        assert torch.equal(m.dequantize().cpu(), reference[f"{n}.weight"]), n
    for n, p in model.named_parameters():
        if n.rpartition(".")[0] not in int4:
            assert torch.equal(p.cpu(), reference[n]), n
