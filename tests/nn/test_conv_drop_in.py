"""tilegemm.nn.Conv2d as a drop-in where torch's nn.Conv2d works: from_conv on parametrized convs and with
hooks, ``.double()``, torch.autocast, torch.fx.symbolic_trace and one-element stride/padding lists after
convert_."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from tilegemm.nn import Conv2d, Linear, convert_

from conftest import assert_rel_close


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convert_'s notes and the interpreter's warning
        yield


def _convert(model):
    return convert_(model)


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("make", [
    pytest.param(lambda c: torch.nn.utils.parametrizations.weight_norm(c), id="weight_norm"),
    pytest.param(lambda c: parametrize.register_parametrization(c, "bias", _Doubled()), id="bias-doubled"),
])
def test_from_conv_of_a_parametrized_conv_keeps_its_parametrizations(make, device):
    conv = make(torch.nn.Conv2d(4, 6, 3, padding=1).to(device))
    new = Conv2d.from_conv(conv, activation="relu")
    assert isinstance(new, Conv2d) and parametrize.is_parametrized(new)
    assert parametrize.type_before_parametrizations(new) is Conv2d
    assert type(conv).__bases__[0] is torch.nn.Conv2d  # the original is untouched
    assert new.state_dict().keys() == conv.state_dict().keys()
    x = torch.randn(2, 4, 6, 6, device=device)
    assert_rel_close(new(x), F.relu(conv(x)).detach().double(), 1e-5)
    # the same parametrizations: the original tensors they hold get the new module's gradients
    new(x).sum().backward()
    originals = [p for p in conv.parameters()]
    assert all(p.grad is not None for p in originals)
    # adding or removing a parametrization on the new module leaves the original's class and parametrizations
    before = conv(x).detach()
    kept = {k: len(v) for k, v in conv.parametrizations.items()}
    parametrize.register_parametrization(new, "bias", _Doubled())
    assert {k: len(v) for k, v in conv.parametrizations.items()} == kept
    for name in list(new.parametrizations.keys()):  # (leaving one parametrized tensor would write its original)
        parametrize.remove_parametrizations(new, name, leave_parametrized=not new.parametrizations[name].is_tensor)
    assert type(new) is Conv2d and not hasattr(new, "parametrizations")
    assert {k: len(v) for k, v in conv.parametrizations.items()} == kept
    torch.testing.assert_close(conv(x), before)


@pytest.mark.parametrize("make", [
    pytest.param(lambda c: torch.nn.utils.parametrizations.weight_norm(c), id="weight_norm"),
    pytest.param(lambda c: torch.nn.utils.parametrizations.spectral_norm(c), id="spectral_norm"),
])
def test_convert_swaps_a_parametrized_conv(make, device):
    """torch gives a parametrized conv a subclass of its own (ParametrizedConv2d): convert_ swaps it as the plain
    nn.Conv2d it is (from_conv keeps the parametrizations); it was kept as 'a subclass whose forward may differ'."""
    torch.manual_seed(0)
    ref = make(torch.nn.Conv2d(4, 6, 3, padding=1).to(device)).eval()
    torch.manual_seed(0)
    model = convert_(torch.nn.Sequential(make(torch.nn.Conv2d(4, 6, 3, padding=1).to(device))).eval())
    assert model.tilegemm_skipped == []
    assert isinstance(model[0], Conv2d) and parametrize.is_parametrized(model[0])
    x = torch.randn(2, 4, 6, 6, device=device)
    assert_rel_close(model(x), ref(x).detach().double(), 1e-5)


def test_convert_swaps_a_parametrized_linear_and_names_a_parametrized_subclass(device):
    """A parametrized Linear is swapped (Linear.from_linear keeps the parametrizations); a parametrized subclass of
    nn.Conv2d is kept, named by its own class, not as 'torch.nn.utils.parametrize.ParametrizedConv2d'."""
    class _MyConv(torch.nn.Conv2d):
        pass

    torch.manual_seed(0)
    lin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4).to(device))
    x = torch.randn(3, 4, device=device)
    ref = lin(x).detach().double()
    model = torch.nn.Sequential(lin, torch.nn.utils.parametrizations.weight_norm(_MyConv(4, 4, 1).to(device)))
    reasons = dict(convert_(model, warn=False).tilegemm_skipped)
    assert "0" not in reasons and isinstance(model[0], Linear) and parametrize.is_parametrized(model[0], "weight")
    assert_rel_close(model[0](x), ref, 1e-5)
    assert reasons["1"].startswith(f"{_MyConv.__module__}.{_MyConv.__qualname__} is a subclass of torch.nn.Conv2d")


def test_from_conv_with_a_hook_based_weight_norm(device):
    conv = torch.nn.utils.weight_norm(torch.nn.Conv2d(4, 6, 3).to(device))  # a forward pre-hook sets .weight
    new = Conv2d.from_conv(conv)
    x = torch.randn(1, 4, 6, 6, device=device)
    assert_rel_close(new(x), conv(x).detach().double(), 1e-5)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_from_linear_and_from_conv_copy_the_hook_dicts(kind, device):
    # the hook dicts (and the other dicts and sets) are the new module's own: had they been the original's objects,
    # a hook added to the converted layer would fire on the original too, and a buffer registered on one would
    # change the other's
    if kind == "linear":
        base, cls, x = torch.nn.Linear(8, 4).to(device), Linear, torch.randn(2, 8, device=device)
        new_of = Linear.from_linear
    else:
        base, cls, x = torch.nn.Conv2d(4, 6, 3).to(device), Conv2d, torch.randn(1, 4, 6, 6, device=device)
        new_of = Conv2d.from_conv
    before = []
    base.register_forward_hook(lambda m, i, o: before.append(type(m)))
    new = new_of(base)
    on_new, on_base = [], []
    new.register_forward_hook(lambda m, i, o: on_new.append(type(m)))
    new.register_forward_pre_hook(lambda m, i: on_new.append("pre"))
    base.register_forward_hook(lambda m, i, o: on_base.append(type(m)))
    base(x)
    assert on_new == [] and on_base == [type(base)]
    new(x)
    assert on_new == ["pre", cls] and on_base == [type(base)]
    assert before == [type(base), cls]  # a hook the module had before carries over
    assert new.weight is base.weight  # the parameters are shared
    for key, value in vars(base).items():
        if isinstance(value, (dict, set)):
            assert vars(new)[key] is not value, key
    new.register_buffer("extra", torch.zeros(1), persistent=False)
    assert "extra" not in base._buffers and "extra" not in base._non_persistent_buffers_set


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_double_after_convert_runs_torch_conv(padding_mode, device):
    model = _convert(torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1, padding_mode=padding_mode)))
    model[0].activation = "silu"
    model.to(device).double()
    x = torch.randn(2, 4, 7, 7, device=device, dtype=torch.float64, requires_grad=True)
    out = model(x)
    ref = F.silu(torch.nn.Conv2d._conv_forward(model[0], x, model[0].weight, model[0].bias))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert model[0].weight.grad.dtype == torch.float64


def test_autocast_on_a_converted_model(device):
    x = torch.randn(1, 4, 8, 8, device=device)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 4, 2, stride=2), torch.nn.Conv2d(4, 4, 3, padding=1))
    ref = ref.to(device)
    model = _convert(torch.nn.Sequential(*ref))  # the same modules' parameters
    with torch.autocast(device, dtype=torch.bfloat16):
        want = ref(x)
        got = model(x)
    assert isinstance(model[1], Conv2d)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert_rel_close(got, want.double(), 3e-2)


def test_symbolic_trace_of_a_converted_model(device):
    model = _convert(torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3), torch.nn.ReLU())).to(device)
    gm = torch.fx.symbolic_trace(model)
    ops = [n.op for n in gm.graph.nodes]
    assert ops.count("call_function") == 1 and ops.count("get_attr") == 2  # the conv, its weight and bias
    x = torch.randn(1, 4, 8, 8, device=device)
    torch.testing.assert_close(gm(x), model(x))


def test_one_element_lists_after_convert(device):
    ref = torch.nn.Conv2d(4, 6, 3, stride=[2], padding=[1], dilation=(1,)).to(device)
    model = _convert(torch.nn.Sequential(ref))
    x = torch.randn(1, 4, 9, 9, device=device)
    assert isinstance(model[0], Conv2d)
    assert_rel_close(model(x), F.conv2d(x.double(), ref.weight.double(), ref.bias.double(), 2, 1), 1e-5)


@pytest.mark.parametrize("make, x", [(lambda: torch.nn.Linear(8, 4), (2, 8)),
                                     (lambda: torch.nn.Conv2d(3, 4, 3), (1, 3, 6, 6))])
def test_a_hook_handle_taken_before_convert_removes_it_after(make, x, device):
    # convert_ hands the layer's hook dicts themselves to its replacement, as quantize_ does: from_linear /
    # from_conv copy them, so the caller's handle removed the hook from the discarded layer only
    model = torch.nn.Sequential(make().to(device))
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, o: seen.append(type(m)))
    convert_(model)
    x = torch.randn(*x, device=device)
    model(x)
    assert seen == [type(model[0])] and type(model[0]) in (Conv2d, Linear)
    handle.remove()
    model(x)
    assert seen == [type(model[0])]


class _ScaledConv(torch.nn.Conv2d):
    def forward(self, x):
        return 2 * super().forward(x)


def test_from_conv_refuses_a_module_whose_forward_it_would_not_run(device):
    """A subclass's own forward (QAT's fake-quantized weight), a forward set on the instance and an uninitialised
    lazy conv are named, where the copy ran plain convolution instead (or failed on a missing
    ``initialize_parameters``); a parametrized nn.Conv2d and tilegemm's own Conv2d still convert."""
    qat = torch.ao.nn.qat.Conv2d(2, 3, 1, qconfig=torch.ao.quantization.get_default_qat_qconfig())
    for conv, match in ((_ScaledConv(2, 3, 1), "_ScaledConv overrides torch.nn.Conv2d's forward"),
                        (qat, "qat.modules.conv.Conv2d overrides torch.nn.Conv2d's forward"),
                        (torch.nn.LazyConv2d(3, 1), "LazyConv2d has not made its parameters yet")):
        with pytest.raises(ValueError, match=match):
            Conv2d.from_conv(conv)
    conv = torch.nn.Conv2d(2, 3, 1)
    conv.forward = lambda x: x
    with pytest.raises(ValueError, match="forward was replaced on the instance"):
        Conv2d.from_conv(conv)
    lazy = torch.nn.LazyConv2d(3, 1)
    lazy(torch.randn(1, 2, 4, 4))  # (now a plain nn.Conv2d)
    assert isinstance(Conv2d.from_conv(lazy), Conv2d)
    relu = Conv2d.from_conv(Conv2d.from_conv(torch.nn.Conv2d(2, 3, 1)), activation="relu")
    relu = relu.to(device)
    assert relu.activation == "relu" and (relu(torch.randn(1, 2, 4, 4, device=device)) >= 0).all()
