"""Int4Linear's kept fragment layout (what the fragment kernel reads instead of qweight, scales and zeros) follows
its parts: written in place, swapped, replaced, loaded, moved, copied, under torch.func and torch.compile. The
fragment kernel runs only on a Hopper GPU, so on the CPU the checks read the Int4Weight the layer hands to
``w4a16.matmul``: its fragments are those of the parts it carries (or none), and those parts are the layer's."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from conftest import assert_rel_close
from tilegemm.nn import Int4Linear
from tilegemm.ops.w4a16 import api
from tilegemm.ops.w4a16.format import Int4Weight, dequantize

# the layout as a Hopper GPU keeps it, on every device (the kept layout's life beside the parts)
pytestmark = pytest.mark.usefixtures("keep_fragments")


def _layer(device, group_size=32):
    torch.manual_seed(0)
    return Int4Linear.from_linear(nn.Linear(64, 24, dtype=torch.float16), group_size=group_size).to(device)


def _fresh(w: Int4Weight):
    """The fragment layout of ``w``'s parts, made now."""
    return Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape).fragments()


def _assert_current(layer: Int4Linear, w: Int4Weight | None = None, made: bool = True):
    """``w`` (default: ``layer.weight``) carries the layer's own parts and, where ``made``, a fragment layout equal
    to theirs (else none at all)."""
    w = layer.weight if w is None else w
    assert w.qweight is layer.qweight and w.scales is layer.scales and w.zeros is layer.zeros
    if not made:
        assert w._frag is None
        return
    assert w._frag is not None
    assert all(torch.equal(a, b) for a, b in zip(w._frag, _fresh(w))), "stale fragments"


def _assert_output(layer: Int4Linear, x: torch.Tensor, parts=None):
    """The layer's output is the product of the weight its current parts (or ``parts``) stand for."""
    parts = dict(qweight=layer.qweight, scales=layer.scales, zeros=layer.zeros) if parts is None else parts
    w = Int4Weight(parts["qweight"], parts["scales"], parts["zeros"], layer.group_size,
                   (layer.out_features, layer.in_features))
    want = x.double() @ dequantize(w).double().T + layer.bias.double()
    y = layer(x) if parts is None else torch.func.functional_call(layer, parts, (x,))
    assert_rel_close(y, want, 2e-3)


@pytest.fixture
def handed(monkeypatch):
    """The Int4Weights Int4Linear hands to w4a16.matmul, in order."""
    seen = []
    real = api.matmul

    def spy(x, w, *args, **kwargs):
        seen.append(w)
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(api, "matmul", spy)
    return seen


def _write(layer: Int4Linear, how: str) -> None:
    with torch.no_grad():
        if how == "scales.mul_":
            layer.scales.mul_(2)
        elif how == "zeros.add_":
            layer.zeros.add_(1).clamp_(max=15)
        elif how == "qweight.copy_":
            layer.qweight.copy_(layer.qweight.flip(1))
        elif how == "scales.data":  # a new storage, no new version
            layer.scales.data = layer.scales.data * 3
        elif how == "assigned":
            layer.scales = layer.scales * 0.5
        else:
            raise AssertionError(how)


@pytest.mark.parametrize("how", ["scales.mul_", "zeros.add_", "qweight.copy_", "scales.data", "assigned"])
def test_fragments_follow_parts_changed_in_place_or_replaced(how, device, handed):
    layer = _layer(device)
    x = torch.randn(2, 64, dtype=torch.float16, device=device)
    _assert_current(layer)
    _write(layer, how)
    _assert_current(layer)  # remade of the parts as they are now
    _assert_output(layer, x)
    _assert_current(layer, handed[-1])
    kept = layer.fweight
    assert layer.weight._frag[0] is kept  # remade once, then kept while the parts stay as they are


def test_functional_call_with_other_parts(device, handed):
    layer = _layer(device)
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    own = layer.scales
    with torch.no_grad():
        for i in range(3):  # new tensors each call: a freed one's address and version reused must not match
            parts = dict(qweight=layer.qweight.flip(0).clone(), scales=own * (i + 2), zeros=layer.zeros.clone())
            _assert_output(layer, x, parts)
            w = handed[-1]
            assert w.scales is parts["scales"] and w.qweight is parts["qweight"]
            assert w._frag is None or all(torch.equal(a, b) for a, b in zip(w._frag, _fresh(w)))
            del parts, w
            handed.clear()
    assert layer.scales is own
    _assert_current(layer)  # the layer's own parts again
    _assert_output(layer, x)


def test_functional_call_with_the_layers_own_buffers_keeps_its_fragments(device, handed):
    layer = _layer(device)
    kept = layer.fweight
    x = torch.randn(1, 64, dtype=torch.float16, device=device)
    torch.func.functional_call(layer, dict(layer.named_buffers()), (x,))
    assert handed[-1]._frag[0] is kept and layer.fweight is kept


def test_a_torch_func_transform_gets_no_stale_layout(device, handed):
    # vmap cannot repack (the packing would be batched): the call runs without the layout, the next plain call
    # remakes it
    layer = _layer(device)
    with torch.no_grad():
        layer.scales.mul_(2)
    xs = torch.randn(3, 2, 64, dtype=torch.float16, device=device)
    ys = torch.func.vmap(layer)(xs)
    w = handed[-1]  # no layout, or (on Hopper, made by the product for its own weight) one of its parts
    assert w._frag is None or all(torch.equal(a, b) for a, b in zip(w._frag, _fresh(w)))
    assert_rel_close(ys, xs.double() @ dequantize(layer._weight()).double().T + layer.bias.double(), 2e-3)
    _assert_current(layer)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_remakes_them(assign, device):
    layer, other = _layer(device), _layer(device)
    with torch.no_grad():
        other.scales.mul_(3)
    layer.load_state_dict(other.state_dict(), assign=assign)
    _assert_current(layer)
    _assert_output(layer, torch.randn(2, 64, dtype=torch.float16, device=device))


def test_moves_and_conversions_carry_them_without_remaking(device):
    # .to() / .half() / .float() convert the layout with the parts (the same values, moved or cast): the converted
    # layout stands for the converted parts, and nothing is packed again
    layer = _layer("cpu").bfloat16()
    for step in (lambda m: m.to(device), lambda m: m.half(), lambda m: m.float(), lambda m: m.bfloat16()):
        layer = step(layer)
        kept = layer.fweight
        _assert_current(layer)
        assert layer.fweight is kept
    assert layer.scales.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_their_fragments(how):
    layer = _layer("cpu")
    if how == "deepcopy":
        twin = copy.deepcopy(layer)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(layer))
    else:
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    kept = twin.fweight
    _assert_current(twin)
    assert twin.fweight is kept  # known to stand for the copied parts: not made again
    with torch.no_grad():
        twin.scales.mul_(2)
    _assert_current(twin)
    _assert_current(layer)  # the original is its own


def test_copy_of_a_stale_layer_remakes_its_layout():
    # a layer whose parts were written after its layout was made is copied knowing it: the copy remakes it
    layer = _layer("cpu")
    with torch.no_grad():
        layer.zeros.add_(1).clamp_(max=15)
    twin = copy.deepcopy(layer)
    _assert_current(twin)


def test_inference_tensors_replaced(device, handed):
    # made under inference_mode: no version counter to see an in-place write by, but a replaced part is seen
    with torch.inference_mode():
        layer = _layer(device)
        x = torch.randn(2, 64, dtype=torch.float16, device=device)
        _assert_current(layer)
        layer.scales = layer.scales * 2
        _assert_current(layer)
        _assert_output(layer, x)


@pytest.fixture
def read(monkeypatch):
    """The fragment layout each product run reads (the problem the op or plain call runs, a compiled graph's calls
    included): "kept" (a module's), "made" (for this call: packed, which no graph may do) or None; a layout that is
    not the parts' own fails. The fragment kernel runs only on Hopper: here the layout is asked for as there,
    checked, then left out of the product, which runs on the parts."""
    import dataclasses

    from tilegemm.ops.w4a16 import dispatch, fragment_records

    seen = []
    real = dispatch.forward

    def forward(p):
        if p.fweight is None:
            seen.append(None)
        else:
            K = p.qweight.shape[0] * 8
            fresh = Int4Weight(p.qweight, p.scales, p.zeros, -1 if p.group_k == K else p.group_k,
                               (p.qweight.shape[1], K)).fragments()
            assert torch.equal(p.fweight, fresh[0]) and torch.equal(p.fzs, fresh[1]), "a stale layout was read"
            seen.append("kept" if fragment_records._live(id(p.fweight)) else "made")
        return real(dataclasses.replace(p, fweight=None, fzs=None))

    monkeypatch.setattr(dispatch, "frag_usable", lambda group_k, device, K: dispatch.fits_fragments(group_k, K))
    monkeypatch.setattr(dispatch, "forward", forward)
    monkeypatch.setattr(api, "replay_key", lambda *args: None)  # every call through dispatch (no replay: GPU)
    return seen


def test_compiled_layer_reads_fragments_only_while_they_stand_for_the_parts_it_is_called_with(device, read):
    # A graph carries the kept layout only where it stood for the parts when traced (else none: packing is no graph
    # work, and the product runs on the parts), and the op reads it, when the graph runs, only while it stands for
    # the parts the graph is called with: not after a part was written (the graph is not traced again), nor for
    # other parts given to functional_call
    torch.compiler.reset()
    x = torch.randn(2, 64, dtype=torch.float16, device=device)
    with torch.no_grad():
        layer = _layer(device)
        layer.scales.mul_(2)  # written before tracing
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        _assert_product(compiled(x), layer, x)
        assert read == [None]
        layer(x)  # an eager call remakes the layout
        read.clear()
        _assert_product(compiled(x), layer, x)
        assert read == ["kept"]
        layer.zeros.add_(1).clamp_(max=15)  # written after tracing
        read.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):
            _assert_product(compiled(x), layer, x)
        assert read == [None]
        layer(x)
        own = dict(qweight=layer.qweight, scales=layer.scales, zeros=layer.zeros)
        other = dict(own, scales=layer.scales * 3)
        call = torch.compile(lambda parts, t: torch.func.functional_call(layer, parts, (t,)), fullgraph=True,
                             backend="eager")
        read.clear()
        _assert_product(call(own, x), layer, x)
        _assert_product(call(other, x), layer, x, other)
        assert read == ["kept", None]
    torch.compiler.reset()


def test_a_block_compiled_on_its_own_reads_each_layers_layout(device, read):
    # a repeated block compiled on its own (regional compilation): each layer reads its own layout (the graph is
    # traced for each layer: docs/w4a16.md, "The fragment layout ...")
    torch.compiler.reset()
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    layers = [_layer(device) for _ in range(3)]
    for i, layer in enumerate(layers):
        with torch.no_grad():
            layer.scales.mul_(1 + i)
        layer(x)  # remade of the written parts
    step = torch.compile(lambda layer, t: layer(t), fullgraph=True, backend="eager")
    read.clear()
    with torch.no_grad():
        for layer in layers:
            _assert_product(step(layer, x), layer, x)
    assert read == ["kept"] * 3
    torch.compiler.reset()


def _assert_product(y, layer, x, parts=None):
    """``y`` is the product of the weight ``layer``'s parts (or ``parts``) stand for, with its bias."""
    parts = dict(qweight=layer.qweight, scales=layer.scales, zeros=layer.zeros) if parts is None else parts
    w = Int4Weight(parts["qweight"], parts["scales"], parts["zeros"], layer.group_size,
                   (layer.out_features, layer.in_features))
    assert_rel_close(y, x.double() @ dequantize(w).double().T + layer.bias.double(), 2e-3)


def test_weight_is_checked_again_only_after_its_parts_change(monkeypatch):
    # A decode step asks each layer for its weight: the checks run once for the parts the fragment record stands
    # for, and again after anything the record or the rest of the key sees changes (a part written or replaced,
    # another perm); the weight given either way holds the layer's current parts.
    checked = []
    real = Int4Linear._weight
    monkeypatch.setattr(Int4Linear, "_weight", lambda self, *a: (checked.append(1), real(self, *a))[1])
    layer = _layer("cpu")
    checked.clear()
    first, again = layer.weight, layer.weight
    assert len(checked) == 1 and again is not first
    for w in (first, again):
        _assert_current(layer, w)
        assert w.perm is None and w.shape == (24, 64) and w.group_size == 32

    def changed(change) -> None:
        before = len(checked)
        change()
        _assert_current(layer)
        assert len(checked) > before, change
        after = len(checked)
        _assert_current(layer)
        assert len(checked) == after

    changed(lambda: layer.scales.detach().mul_(2))
    changed(lambda: setattr(layer, "scales", layer.scales.clone()))
    changed(lambda: setattr(layer, "perm", torch.randperm(64)))  # (an act-order layer's input order)
    assert layer.weight.perm is layer.perm
    layer.perm = torch.full((3,), 0)  # a wrong perm is named, not passed over
    with pytest.raises(ValueError, match="perm must be int64"):
        layer.weight
    clone = pickle.loads(pickle.dumps(Int4Linear.from_weight(_layer("cpu")._weight())))
    clone.weight
    _assert_current(copy.deepcopy(clone))


def test_two_storage_swaps_in_a_row_are_seen():
    # .data = bumps no version, and the second new storage may take the first one's freed address (the record
    # holds weak references to the storages, which expire when they are freed). The second storage is asked of the
    # allocator until it gives that address back, where it does (torch 2.11's CPU allocator at once; 2.13's may
    # not, and the swaps are checked all the same).
    layer = _layer("cpu")
    layer.weight
    first = layer.scales.data_ptr()
    layer.scales.data = layer.scales.data * 2
    pool = [layer.scales.data * 3]
    while pool[-1].data_ptr() != first and len(pool) < 200:
        pool.append(torch.empty_like(pool[0]).copy_(pool[0]))
    layer.scales.data = pool[-1]
    assert layer.scales._version == 0  # (no write the record could see)
    _assert_current(layer)


def test_the_op_reads_a_recorded_layout_only_while_it_stands():
    # what the ops ask when they run (a compiled graph's calls): a caller's own layout as given; a layer's while
    # its record stands for the parts given; else none, or where the fragment kernel is named, the parts' own
    from tilegemm.ops.w4a16.op import fragment_layout

    layer = _layer("cpu")
    parts, layout = (layer.qweight, layer.scales, layer.zeros), (layer.fweight, layer.fzs)
    group_k = layer._weight().group_k
    assert fragment_layout(*parts, *layout, group_k, "auto") == layout
    own = Int4Weight(*parts, layer.group_size, (24, 64)).fragments()
    assert fragment_layout(*parts, *own, group_k, "auto") == own  # (no record: the caller's to keep)
    other = (layer.qweight, layer.scales * 2, layer.zeros)
    assert fragment_layout(*other, *layout, group_k, "auto") == (None, None)
    with torch.no_grad():
        layer.zeros.add_(1).clamp_(max=15)
    assert fragment_layout(*parts, *layout, group_k, "auto") == (None, None)
    made = fragment_layout(*parts, *layout, group_k, "frag_wgmma")
    assert made[0] is not layer.fweight and all(torch.equal(a, b) for a, b in zip(made, _fresh(layer._weight())))


def test_compiled_layers_never_read_a_stale_layout(device, read):
    # the fixture fails any layout that is not the parts' own: a layout two layers share whose other layer (and
    # record) is gone, and a written layer moved (.to() makes new tensors of every buffer), then compiled
    import gc

    x = torch.randn(2, 64, dtype=torch.float16, device=device)
    a = _layer(device)
    a(x)
    b = Int4Linear.from_weight(a.weight)  # the same parts and layout
    del b
    gc.collect()
    with torch.no_grad():
        a.scales.mul_(2)
        torch.compiler.reset()
        _assert_product(torch.compile(a, fullgraph=True, backend="eager")(x), a, x)
        a = _layer(device)
        a(x)
        a.scales.mul_(2)
        a._apply(lambda t: t.clone())  # (what a move to another device does to each tensor)
        torch.compiler.reset()
        _assert_product(torch.compile(a, fullgraph=True, backend="eager")(x), a, x)
    assert len(read) == 4  # (two eager calls, two compiled: none read a stale layout)
    torch.compiler.reset()


def test_dropped_layers_leave_no_layout_ids_behind(monkeypatch):
    # a process making and dropping 4-bit layers (a server reloading models) kept an id per dropped layout
    import gc

    from tilegemm.ops.w4a16 import fragment_records as records

    monkeypatch.setattr(records, "_LIVE", {})
    monkeypatch.setattr(records, "_SWEEP_MIN", 8)
    monkeypatch.setattr(records, "_SWEEP_AT", 8)
    parts = (torch.zeros(8, 4, dtype=torch.int32), torch.ones(2, 4), torch.zeros(2, 4))
    layout = torch.empty(3)
    held = records.record(parts, (layout,), 32)  # a layer still held keeps its id
    for _ in range(40):
        rec = records.record(parts, (torch.empty(3), torch.empty(2)), 32)
        del rec
    gc.collect()
    assert len(records._LIVE) <= 16
    assert id(layout) in records._LIVE and held[-1] in records._live(id(layout))
