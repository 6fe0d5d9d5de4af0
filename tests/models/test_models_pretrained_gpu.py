"""from_pretrained on the GPU at Llama-3-8B's shapes (4 of its layers, random 4-bit values from the tests' writer):
peak memory while loading within 1.3x the loaded int4 model, and logits that agree with the same model holding
the dequantized weights."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _model_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [[], ["--act-order", "--v2", "--asym"], ["--method", "awq"],
                                   ["--method", "compressed-tensors", "--act-order", "--asym"]])
def test_llama3_8b_shapes_load_within_the_memory_bound(tmp_path, flags):
    from tilegemm.models import from_pretrained
    from tilegemm.models.pretrained import dequantized_copy

    spec = importlib.util.spec_from_file_location("write_w4_checkpoint", os.path.join(ROOT, "tools",
                                                                                      "write_w4_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = tmp_path / "ckpt"
    assert tool.main(["--out", str(path), "--layers", "4", "--shard-gb", "1", *flags]) == 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = from_pretrained(path)  # CUDA: the default where there is one
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    held = _model_bytes(model)
    assert all(t.device.type == "cuda" for t in [*model.parameters(), *model.buffers()])
    print(f"{flags}: int4 model {held / 2**30:.2f} GiB, loading peak {peak / 2**30:.2f} GiB ({peak / held:.2f}x)")
    assert peak <= 1.3 * held, (peak, held)
    dense = dequantized_copy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits.float(), dense(input_ids=ids).logits.float()
    err = float((a - b).norm() / b.norm())
    assert torch.isfinite(a).all() and err < 2e-2, err  # the bench's bound for the decode step
