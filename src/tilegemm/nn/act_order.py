"""Act-order input orders absorbed by the layer before: :func:`absorb_act_order_`.

An act-order 4-bit weight multiplies ``x[..., perm]``, so each call first reorders its input (one gather launch;
docs/w4a16.md, "Act-order"). In a gated MLP, ``down_proj(act(gate_proj(x)) * up_proj(x))``, the down
projection's input is made column by column by the gate and up projections: give their output rows ``perm``'s
order and their product comes out reordered already, and ``down_proj`` takes it as it is. The values are the
same bit for bit (each output column is computed alone, and the reordered input is the one the gather made).
"""

from __future__ import annotations

import torch
from torch import nn

from tilegemm.nn.int4 import Int4Linear
from tilegemm.ops.w4a16.format import Int4Weight

__all__ = ["absorb_act_order_"]


def _rows_in_order(m: Int4Linear, perm: torch.Tensor) -> Int4Linear:
    """``m`` with its output rows (the weight's N) taken in ``perm``'s order: output j is ``m``'s output perm[j]."""
    w = m.weight
    cols = perm.to(w.qweight.device)
    new = Int4Weight(w.qweight[:, cols].contiguous(), w.scales[:, cols].contiguous(), w.zeros[:, cols].contiguous(),
                     w.group_size, w.shape, w.perm)
    out = Int4Linear.from_weight(new, None if m.bias is None else m.bias[cols])
    if m.bias is not None and m.bias.dtype != out.bias.dtype:  # (an fp32 module keeps an fp32 bias)
        out.bias = nn.Parameter(m.bias[cols].detach().clone(), requires_grad=False)
    return out.train(m.training)


def _natural_order(m: Int4Linear) -> Int4Linear:
    w = m.weight
    out = Int4Linear.from_weight(Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, None), None)
    out.bias = m.bias
    return out.train(m.training)


def _probe(module: nn.Module, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    with torch.no_grad():
        return module(x)


def absorb_act_order_(model: nn.Module, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                      ) -> nn.Module:
    """Move each act-order ``down_proj``'s input order into the ``gate_proj`` and ``up_proj`` before it; return
    ``model``.

    For every module holding the three names (``names``: gate, up, down) as :class:`Int4Linear`\\ s where down's
    weight has an act-order ``perm`` over inputs that the gate and up outputs make (their out_features its
    in_features): gate's and up's output rows are put in ``perm``'s order (weights, scales, zeros and bias;
    their own input orders stay) and down keeps its stored weight without ``perm``, so its calls no longer reorder
    their input. The module is then run on a random input before and after: where the outputs are not equal bit
    for bit (a forward that does more than ``down(act(gate(x)) * up(x))``, e.g. a norm over the intermediate
    features), the module is put back as it was and named in ``model.tilegemm_act_order_kept``. Modules whose
    parts are held under several names or have hooks are left alone.

    ``model.tilegemm_act_order_absorbed`` lists the modules changed. The state dict changes with them: the gate and
    up weights' rows are stored in the new order and down's ``perm`` is empty, a consistent 4-bit model that
    tilegemm saves and loads as any other (not the checkpoint's own layout). Run it before
    :func:`tilegemm.nn.fuse_projections_`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"absorb_act_order_ takes a torch.nn.Module, got {type(model).__name__}")
    names = tuple(names)
    if len(names) != 3 or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"names must be three attribute names (gate, up, down), got {names!r}")
    held: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        held[id(m)] = held.get(id(m), 0) + 1
    absorbed, kept = [], []
    for name, module in list(model.named_modules()):
        parts = [module._modules.get(n) for n in names]
        if any(type(p) is not Int4Linear for p in parts):
            continue
        gate, up, down = parts
        if not down.perm.numel() or gate.out_features != down.in_features or up.out_features != down.in_features:
            continue
        if any(held[id(p)] != 1 or p._forward_hooks or p._forward_pre_hooks for p in parts):
            continue
        dtype = gate.bias.dtype if gate.bias is not None else gate.scales.dtype
        before = _probe(module, gate.in_features, dtype, gate.qweight.device)
        perm = down.perm
        new = (_rows_in_order(gate, perm), _rows_in_order(up, perm), _natural_order(down))
        for n, p in zip(names, new):
            setattr(module, n, p)
        if torch.equal(_probe(module, gate.in_features, dtype, gate.qweight.device), before):
            absorbed.append(name)
            continue
        for n, p in zip(names, parts):  # a forward this does not fit: as it was
            setattr(module, n, p)
        kept.append(name)
    model.tilegemm_act_order_absorbed = absorbed
    model.tilegemm_act_order_kept = kept
    return model
