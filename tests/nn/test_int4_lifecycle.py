"""Int4Linear and quantize_ through a model's life: state dicts that do or do not fit, dtype conversions, shared
and hooked layers, autocast, 4-bit experts under .float()/.half()."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_rel_close
from tilegemm.nn import Int4Linear


def _ref(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    y = x.double() @ layer.dequantize().double().T
    return y if layer.bias is None else y + layer.bias.double()


# --- Int4Linear.load_state_dict -------------------------------------------------------------------------------


def test_state_dict_of_another_shape_is_refused_naming_keys_and_shapes():
    dst = Int4Linear.from_linear(nn.Linear(64, 16, dtype=torch.float16), group_size=32)
    src = Int4Linear.from_linear(nn.Linear(64, 32, dtype=torch.float16), group_size=32)
    x = torch.randn(3, 64, dtype=torch.float16)
    before = dst(x).clone()
    kept = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"qweight \[8, 32\].*Int4Linear\(in_features=64, out_features=16") as err:
        dst.load_state_dict(src.state_dict())
    assert "size mismatch for qweight" in str(err.value) and "[8, 16]" in str(err.value)
    # the layer keeps its shapes and still computes what it did
    assert {k: tuple(v.shape) for k, v in dst.state_dict().items()} == {k: tuple(v.shape) for k, v in kept.items()}
    assert torch.equal(dst(x), before)


@pytest.mark.parametrize("groups", [3, 5])
def test_state_dict_whose_groups_do_not_split_k_is_refused(groups):
    dst = Int4Linear(128, 16, group_size=32)
    sd = dst.state_dict()
    sd["scales"] = torch.ones(groups, 16, dtype=torch.float16)
    sd["zeros"] = torch.ones(groups, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=rf"{groups} groups do not split in_features = 128"):
        dst.load_state_dict(sd)
    assert dst.scales.shape == (4, 16) and dst.group_size == 32


@pytest.mark.parametrize("built_group", [32, 128])
def test_state_dict_keeps_the_module_scale_dtype(built_group):
    # a bf16 state dict into an fp16 module: its scales stay fp16 whatever group size the module was built with
    src = Int4Linear.from_linear(nn.Linear(128, 16, dtype=torch.bfloat16), group_size=32)
    dst = Int4Linear(128, 16, group_size=built_group, dtype=torch.float16)
    dst.load_state_dict(src.state_dict())
    assert dst.scales.dtype == dst.zeros.dtype == torch.float16 and dst.group_size == 32
    x = torch.randn(2, 128, dtype=torch.float16)
    y = dst(x)
    assert y.dtype == torch.float16
    assert_rel_close(y, _ref(dst, x), 2e-3)
    assert_rel_close(y, _ref(src, x), 2e-2)  # the same weight, its scales rounded to fp16
