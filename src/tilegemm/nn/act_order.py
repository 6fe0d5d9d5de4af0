"""Act-order input orders absorbed by the layer before: :func:`absorb_act_order_`.

An act-order 4-bit weight multiplies ``x[..., perm]``, so each call first reorders its input (one gather launch;
docs/w4a16.md, "Act-order"). In a gated MLP, ``down_proj(act(gate_proj(x)) * up_proj(x))``, the down
projection's input is made column by column by the gate and up projections: give their output rows ``perm``'s
order and their product comes out reordered already, and ``down_proj`` takes it as it is. The values are the
same up to the order a kernel sums a column in (each output column is computed alone, and the reordered input is
the one the gather made).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict

import torch
import torch.nn.modules.module as module_hooks
from torch import nn

from tilegemm.nn.hooks import has_forward_hooks, has_hooks
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
    if m.bias is not None:
        out.bias.requires_grad_(m.bias.requires_grad)  # a bias being trained stays trainable
    return out.train(m.training)


def _natural_order(m: Int4Linear) -> Int4Linear:
    w = m.weight
    out = Int4Linear.from_weight(Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, None), None)
    out.bias = m.bias
    return out.train(m.training)


def _expert_columns(module, perm: torch.Tensor, gated: bool) -> torch.Tensor:
    """[E, N] indices of a stacked up-side weight's output rows giving each expert's intermediate features in
    ``perm[e]``'s order: gate and up halves one after the other, or interleaved (gate j at 2j, up j at 2j + 1)
    where the block says ``is_concatenated = False``."""
    if not gated:
        return perm
    width = perm.shape[1]
    if getattr(module, "is_concatenated", True):
        return torch.cat([perm, perm + width], dim=1)
    return torch.stack([2 * perm, 2 * perm + 1], dim=-1).flatten(1)


def _absorb_experts(module) -> bool:
    """A transformers experts block's act-order down experts absorbed by its up side (True), or nothing to do."""
    from tilegemm.nn.moe import _bias, _int4, install_int4_experts_

    up_name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    up, down = _int4(module, up_name), _int4(module, "down_proj")
    if up is None or down is None or down.perm is None:
        return False
    cols = _expert_columns(module, down.perm, up_name == "gate_up_proj").to(up.qweight.device)
    if cols.shape[1] != up.shape[1]:
        return False

    def take(t):  # [E, rows, N] -> its columns in cols' order, expert by expert
        return torch.gather(t, 2, cols[:, None, :].expand(-1, t.shape[1], -1)).contiguous()

    new_up = Int4Weight(take(up.qweight), take(up.scales), take(up.zeros), up.group_size, up.shape, up.perm)
    new_down = Int4Weight(down.qweight, down.scales, down.zeros, down.group_size, down.shape, None)
    bias = _bias(module, up_name)
    install_int4_experts_(module, {up_name: new_up, "down_proj": new_down})
    if bias is not None:
        with torch.no_grad():
            bias.copy_(torch.gather(bias, 1, cols))
    return True


@contextlib.contextmanager
def _evaluating(module: nn.Module):
    """``module`` in eval mode, then its own training flags again: a training-mode forward draws dropout masks
    (two runs never agree) and updates running statistics."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def _unhooked(module: nn.Module):
    """``module`` and its submodules without their forward hooks, and no global module forward hooks
    (``register_module_forward_hook`` / ``_pre_hook``), then with them again: a probe is no forward of the user's,
    so hooks that record or change activations must not see it."""
    saved = [(m, m._forward_hooks, m._forward_pre_hooks) for m in module.modules()]
    for m, _, _ in saved:
        m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
    # The global dicts emptied in place, not replaced: torch's handles (and whoever imported the dicts) hold
    # these objects. (A forward on another thread meanwhile misses them too: they are process-wide.)
    global_dicts = (module_hooks._global_forward_hooks, module_hooks._global_forward_pre_hooks)
    held = [list(d.items()) for d in global_dicts]
    for d in global_dicts:
        d.clear()
    try:
        yield
    finally:
        for m, hooks, pre_hooks in saved:
            m._forward_hooks, m._forward_pre_hooks = hooks, pre_hooks
        for d, items in zip(global_dicts, held):
            added = list(d.items())  # (registered meanwhile: kept, after the older ones)
            d.clear()
            d.update(items)
            d.update(added)


def _probe_experts(module, dtype, device) -> torch.Tensor | None:
    """The experts block on a few tokens routed to several experts (transformers' experts call)."""
    from tilegemm.nn.moe import _int4

    E, hidden = _int4(module, "down_proj").shape[:2]
    g = torch.Generator().manual_seed(0)
    k = min(2, E)
    x = (0.25 * torch.randn(2 * E, hidden, generator=g)).to(device=device, dtype=dtype)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2 * E)]).to(device)
    weights = torch.rand(2 * E, k, generator=g).to(device=device, dtype=dtype)
    try:
        with torch.no_grad(), _evaluating(module), _unhooked(module):
            return module(x, index, weights)
    except Exception:  # noqa: BLE001 - as _probe
        return None


def _same(a, b) -> bool:
    """Equal up to rounding (a relative error within 2^-10, fp16's): a reordered product may sum a column in
    another order (the interpreter's BLAS does, by the column's place in a block), where a forward that does not
    fit the reordering is off by the order of its values. NaN where the other has NaN."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.is_meta or b.is_meta:
        return False  # (no output, or one without values: nothing to compare)
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num().double(), b.nan_to_num().double()
    return bool((a - b).norm() <= 2 ** -10 * a.norm())


def _probe(module: nn.Module, width: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The module's output on a random ``[1, 2, width]`` input (transformers' MLPs read batch and sequence from
    the shape), or None where the forward cannot run on it (other arguments, a meta device)."""
    x = torch.randn(1, 2, width, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    try:
        with torch.no_grad(), _evaluating(module), _unhooked(module):
            return module(x)
    except Exception:  # noqa: BLE001 - a forward the probe cannot run is one this cannot check
        return None


@torch.inference_mode(False)  # the tensors made here are normal ones, as the model's: it still loads state dicts
def absorb_act_order_(model: nn.Module, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                      ) -> nn.Module:
    """Move each act-order ``down_proj``'s input order into the ``gate_proj`` and ``up_proj`` before it; return
    ``model``. The same for transformers' MoE experts blocks holding 4-bit experts (each expert's order into its
    rows of ``gate_up_proj``, or ``up_proj``).

    For every module holding the three names (``names``: gate, up, down) as :class:`Int4Linear`\\ s where down's
    weight has an act-order ``perm`` over inputs that the gate and up outputs make (their out_features its
    in_features): gate's and up's output rows are put in ``perm``'s order (weights, scales, zeros and bias;
    their input. The module is then run on a random input before and after, in eval mode: where the outputs differ by more than
    rounding (a forward that does more than ``down(act(gate(x)) * up(x))``, e.g. a norm with a weight over the
    intermediate features), or the forward does not run on a random ``[1, 2, hidden]`` input (other arguments, a meta
    device), the module is put back as it was and named in ``model.tilegemm_act_order_kept``. Modules whose
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
    absorbed, kept, joined = [], [], []
    for name, module in list(model.named_modules()):
        parts = [module._modules.get(n) for n in names]
        if any(type(p) is not Int4Linear for p in parts):
            if type(parts[2]) is Int4Linear and parts[2].perm.numel() \
                    and any(type(p).__name__ == "ProjectionPart" for p in parts[:2]):
                joined.append(name)  # (gate and up joined already: their rows are the joined layer's)
            continue
        gate, up, down = parts
        if not down.perm.numel() or gate.out_features != down.in_features or up.out_features != down.in_features:
            continue
        # (the parts are replaced: their hooks, backward ones too, would be dropped)
        if any(held[id(p)] != 1 or has_hooks(p) for p in parts):
            continue
        dtype = gate.bias.dtype if gate.bias is not None else gate.scales.dtype
        before = _probe(module, gate.in_features, dtype, gate.qweight.device)
        if not isinstance(before, torch.Tensor) or before.is_meta:  # nothing to check the change against
            kept.append(name)
            continue
        perm = down.perm
        new = (_rows_in_order(gate, perm), _rows_in_order(up, perm), _natural_order(down))
        for n, p in zip(names, new):
            setattr(module, n, p)
        if _same(_probe(module, gate.in_features, dtype, gate.qweight.device), before):
            absorbed.append(name)
            continue
        for n, p in zip(names, parts):  # a forward this does not fit: as it was
            setattr(module, n, p)
        kept.append(name)
    from tilegemm.nn.moe import _int4

    # transformers' experts blocks holding 4-bit experts (their layout flags and the down weight's 4-bit parts)
    blocks = [(n, m) for n, m in model.named_modules()
              if "tilegemm_down_proj_qweight" in m._buffers and all(hasattr(m, a) for a in ("has_gate", "is_concatenated"))]
    for name, module in blocks:
        down = _int4(module, "down_proj")
        if down is None or down.perm is None or _forward_hooked(module):
            continue
        dtype = down.scales.dtype
        before = _probe_experts(module, dtype, down.qweight.device)
        if not isinstance(before, torch.Tensor) or before.is_meta:  # as for the MLPs above
            kept.append(name)
            continue
        saved = {n: t for n, t in module._buffers.items()}
        bias_name = ("gate_up_proj" if module.has_gate else "up_proj") + "_bias"
        saved_bias = getattr(module, bias_name).detach().clone() if getattr(module, "has_bias", False) else None
        if not _absorb_experts(module):
            continue
        if _same(_probe_experts(module, dtype, down.qweight.device), before):
            absorbed.append(name)
            continue
        from tilegemm.nn.moe import _drop_fragments, make_fragments_

        module._buffers.clear()  # as it was
        module._buffers.update(saved)
        if saved_bias is not None:
            with torch.no_grad():
                getattr(module, bias_name).copy_(saved_bias)
        _drop_fragments(module)
        make_fragments_(module)
        kept.append(name)
    if joined:  # the values are right either way; each call of those down projections still reorders its input
        warnings.warn(f"absorb_act_order_: the gate and up projections of {joined[:3]}"
                      f"{' and more' if len(joined) > 3 else ''} are joined already (fuse_projections_), so their "
                      f"down projections keep their input orders: absorb first, then join", stacklevel=2)
    model.tilegemm_act_order_absorbed = absorbed
    model.tilegemm_act_order_kept = kept
    return model


def _forward_hooked(module: nn.Module) -> bool:  # (the block stays: its backward hooks stay with it)
    return has_forward_hooks(module)
