"""tilegemm.nn: Conv2d and Linear as drop-ins for torch's, and convert_ swapping them into a model."""

from __future__ import annotations

import warnings

import pytest
import torch

import tilegemm
from tilegemm.nn import Conv2d, Linear, convert_
from tilegemm.nn.convert import ConversionNote

from conftest import assert_rel_close


def _ref_module(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's torch forward in float64 (its parameters copied)."""
    import copy

    ref = copy.deepcopy(m).double()
    ref.__class__ = torch.nn.Conv2d if isinstance(m, torch.nn.Conv2d) else torch.nn.Linear
    return ref(x.double())


@pytest.mark.parametrize("kwargs", [
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=8, kernel_size=(3, 2), stride=2, padding="valid", groups=2, bias=False),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4, padding_mode="reflect"),
    dict(in_channels=4, out_channels=6, kernel_size=3, padding="same", padding_mode="circular"),
])
def test_conv2d_matches_torch(kwargs, device):
    torch.manual_seed(0)
    m = Conv2d(**kwargs).to(device)
    x = torch.randn(2, 4, 7, 6, device=device)
    assert_rel_close(m(x).detach(), _ref_module(m, x).detach(), 1e-5)
    assert set(m.state_dict()) == set(torch.nn.Conv2d(**kwargs).state_dict())


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
def test_conv2d_padding_modes_give_torchs_memory_format(padding_mode, device):
    # torch's circular F.pad returns NCHW from a channels-last input, and torch's module an NCHW output: the same
    # here, eager and traced alike
    torch.manual_seed(0)
    m = Conv2d(4, 6, 3, padding=1, padding_mode=padding_mode).to(device)
    x = torch.randn(2, 4, 7, 6, device=device).contiguous(memory_format=torch.channels_last)
    ref = torch.nn.Conv2d(4, 6, 3, padding=1, padding_mode=padding_mode).to(device)
    ref.load_state_dict(m.state_dict())
    want = ref(x)
    for out in (m(x), torch.fx.symbolic_trace(m)(x)):
        assert out.stride() == want.stride()
        assert_rel_close(out.detach(), _ref_module(m, x).detach(), 1e-5)


def test_conv2d_from_conv_shares_parameters_and_trains(device):
    conv = torch.nn.Conv2d(3, 5, 3, padding=1).to(device)
    m = Conv2d.from_conv(conv, activation="relu")
    assert m.weight is conv.weight and m.bias is conv.bias
    x = torch.randn(2, 3, 6, 6, device=device).contiguous(memory_format=torch.channels_last)
    out = m(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_rel_close(out.detach(), torch.relu(_ref_module(conv, x)).detach(), 1e-5)
    out.square().sum().backward()
    xr = x.double()
    wr, br = conv.weight.detach().double().requires_grad_(), conv.bias.detach().double().requires_grad_()
    torch.nn.functional.conv2d(xr, wr, br, padding=1).relu().square().sum().backward()
    assert_rel_close(conv.weight.grad, wr.grad, 1e-5)
    assert_rel_close(conv.bias.grad, br.grad, 1e-5)
    assert "activation=relu" in repr(m)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_linear_matches_torch_with_leading_dims(activation, device):
    lin = Linear(12, 7, activation=activation).to(device)
    x = torch.randn(2, 3, 12, device=device, requires_grad=True)
    out = lin(x)
    assert out.shape == (2, 3, 7)
    ref = _ref_module(lin, x)
    if activation:
        ref = torch.nn.functional.gelu(ref)
    assert_rel_close(out.detach(), ref.detach(), 2e-5)
    out.sum().backward()
    xr = x.detach().double().requires_grad_()
    wr, br = lin.weight.detach().double().requires_grad_(), lin.bias.detach().double().requires_grad_()
    y = torch.nn.functional.linear(xr, wr, br)
    (torch.nn.functional.gelu(y) if activation else y).sum().backward()
    for got, want in ((x.grad, xr.grad), (lin.weight.grad, wr.grad), (lin.bias.grad, br.grad)):
        assert_rel_close(got, want, 2e-5)


def test_linear_from_linear_shares_parameters(device):
    base = torch.nn.Linear(5, 3, bias=False).to(device)
    lin = Linear.from_linear(base)
    assert lin.weight is base.weight and lin.bias is None
    x = torch.randn(4, 5, device=device)
    assert_rel_close(lin(x).detach(), _ref_module(base, x).detach(), 2e-5)
    with pytest.raises(TypeError, match="from_linear takes a torch.nn.Linear"):
        Linear.from_linear(torch.nn.Conv2d(1, 1, 1))
    with pytest.raises(TypeError, match="from_conv takes a torch.nn.Conv2d"):
        Conv2d.from_conv(base)



def test_linear_takes_a_tensor(device):
    """A list is refused by name, where it raised AttributeError on ndim (or on dtype for a float64 layer)."""
    with pytest.raises(TypeError, match="tilegemm.nn.Linear takes a torch.Tensor, got list"):
        Linear(5, 3).to(device)([1.0] * 5)
    with pytest.raises(TypeError, match="tilegemm.nn.Linear takes a torch.Tensor, got list"):
        Linear(5, 3).double()([1.0] * 5)


class _MyConv(torch.nn.Conv2d):
    pass


def _model(device):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), _MyConv(8, 8, 1)),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
    ).to(device)


def test_convert_swaps_in_place_and_keeps_outputs(device):
    torch.manual_seed(0)
    model = _model(device)
    x = torch.randn(2, 3, 7, 7, device=device)
    want = model(x).detach()
    with pytest.warns(ConversionNote, match=r"2.1: \S*\._MyConv is a subclass of torch.nn.Conv2d, not torch.nn.Conv2d "
                                            r"itself: its forward may differ"):
        assert convert_(model) is model
    assert isinstance(model[0], Conv2d) and isinstance(model[2][0], Conv2d) and isinstance(model[5], Linear)
    assert type(model[2][1]) is _MyConv
    assert model.tilegemm_skipped == [("2.1", f"{_MyConv.__module__}._MyConv is a subclass of torch.nn.Conv2d, not "
                                              f"torch.nn.Conv2d itself: its forward may differ from torch.nn.Conv2d's")]
    assert_rel_close(model(x).detach(), want, 1e-5)


def test_convert_options(device):
    model = _model(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_(model, linear=False, warn=False)
    assert isinstance(model[0], Conv2d) and type(model[5]) is torch.nn.Linear
    model = _model(device)
    convert_(model, conv=False, warn=False)
    assert type(model[0]) is torch.nn.Conv2d and isinstance(model[5], Linear)
    model = _model(device)
    convert_(model, filter=lambda name, m: name != "0", warn=False)
    assert type(model[0]) is torch.nn.Conv2d and isinstance(model[2][0], Conv2d)
    model = _model(device).double()
    convert_(model, warn=False)
    skipped = dict(model.tilegemm_skipped)
    assert set(skipped) == {"0", "2.0", "2.1", "5"}
    assert skipped["0"].startswith("weight dtype float64") and skipped["5"].startswith("weight dtype float64")
    with pytest.raises(TypeError, match="convert_ takes a torch.nn.Module"):
        convert_([1])


def test_exported_at_top_level():
    assert tilegemm.nn.Conv2d is Conv2d and tilegemm.conv2d is not None
    assert set(tilegemm.kernels("conv2d")) == {"tma_implicit_gemm", "implicit_gemm", "gemm_1x1", "depthwise",
                                                "grouped_direct", "grouped_packed", "grouped_packed_tma",
                                                "auto"}


def test_conv2d_module_backward_calls_the_gradient_functions_directly(monkeypatch, device):
    """Outside tracing the backward of a tilegemm.nn.Conv2d (Parameters as weight and bias) skips the
    registered gradient ops, whose dispatch costs host time, and calls the gradient functions."""
    from tilegemm.ops.conv2d import op

    called = []
    for name in ("backward_data", "backward_weight"):
        real = getattr(op, name)
        monkeypatch.setattr(op, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    conv = tilegemm.nn.Conv2d(4, 8, 3, padding=1).to(device)
    x = torch.randn(2, 4, 6, 6, device=device, requires_grad=True)
    conv(x).square().sum().backward()
    assert called == ["backward_data", "backward_weight"]
    ref = torch.nn.Conv2d(4, 8, 3, padding=1).double()
    ref.load_state_dict(conv.state_dict())
    xr = x.detach().cpu().double().requires_grad_()
    ref(xr).square().sum().backward()
    tol = 1e-4 if device == "cpu" else 5e-3  # fp32 convolutions may run as tf32 on a GPU, as torch's do
    assert_rel_close(x.grad.cpu(), xr.grad, tol)
    assert_rel_close(conv.weight.grad.cpu(), ref.weight.grad, tol)


@pytest.mark.gpu
def test_modules_replay_their_inference_calls():
    """nn.Linear with a bias and nn.Conv2d (Parameters) under no_grad record once and replay afterwards."""
    from tilegemm.ops.conv2d import op as conv_replay
    from tilegemm.core.replay import cache
    mm_replay = cache("matmul")

    lin = tilegemm.nn.Linear(256, 384).cuda().half()
    conv = tilegemm.nn.Conv2d(32, 64, 3, padding=1).cuda().half().to(memory_format=torch.channels_last)
    mm_replay.clear()
    conv_replay.REPLAYS.clear()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 256, device="cuda", dtype=torch.float16)
            assert_rel_close(lin(x), torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double()), 4e-3)
            xc = torch.randn(2, 32, 9, 9, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
            ref = torch.nn.functional.conv2d(xc.double(), conv.weight.double(), conv.bias.double(), padding=1)
            assert_rel_close(conv(xc), ref, 4e-3)
    assert mm_replay.count() == 1 and conv_replay.REPLAYS.count() == 1


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_conv2d_forward_reads_a_parametrized_or_reassigned_weight(device):
    """The forward takes the weight and bias from the parameter dict; one that is not there (a parametrization,
    a plain tensor assigned in its place) is read as ``self.weight`` / ``self.bias``, as torch's forward reads it."""
    import torch.nn.utils.parametrize as parametrize

    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 5, device=device)
    m = Conv2d(4, 6, 3, padding=1).to(device)
    parametrize.register_parametrization(m, "weight", _Doubled())
    parametrize.register_parametrization(m, "bias", _Doubled())
    w, b = m.weight.detach().double(), m.bias.detach().double()
    ref = torch.nn.functional.conv2d(x.double(), w, b, padding=1)
    assert_rel_close(m(x).detach(), ref, 1e-5)
    plain = Conv2d(4, 6, 3, padding=1, bias=False).to(device)
    del plain.weight
    plain.weight = torch.randn(6, 4, 3, 3, device=device)  # a plain attribute, not a Parameter
    ref = torch.nn.functional.conv2d(x.double(), plain.weight.double(), None, padding=1)
    assert_rel_close(plain(x).detach(), ref, 1e-5)


def test_convert_names_what_it_keeps_in_full():
    # QAT's Conv2d is named by its module path (a bare name read "Conv2d subclasses Conv2d"); a lazy conv asks
    # for a first run
    import torch.ao.nn.qat as nnqat

    qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    model = torch.nn.Sequential(nnqat.Conv2d(4, 6, 3, qconfig=qconfig), torch.nn.LazyConv2d(6, 3))
    convert_(model, warn=False)
    assert model.tilegemm_skipped == [
        ("0", "torch.ao.nn.qat.modules.conv.Conv2d is a subclass of torch.nn.Conv2d, not torch.nn.Conv2d itself: "
              "its forward may differ from torch.nn.Conv2d's"),
        ("1", "torch.nn.modules.conv.LazyConv2d has not made its parameters yet (a lazy module): run the model once "
              "on an input, then convert")]
    model(torch.randn(1, 4, 9, 9))  # materialized: the lazy conv is a torch.nn.Conv2d now, and converts
    convert_(model, warn=False)
    assert isinstance(model[1], Conv2d) and [n for n, _ in model.tilegemm_skipped] == ["0"]


def test_convert_gives_a_shared_module_one_replacement_under_every_name(device):
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.b = self.a  # one conv under two names of one parent

        def forward(self, x):
            return self.b(self.a(x))

    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    model = torch.nn.ModuleDict(dict(twice=Twice(), p=torch.nn.Sequential(conv), q=torch.nn.Sequential(conv)))
    model = model.to(device)
    x = torch.randn(2, 4, 6, 6, device=device)
    want = model["twice"](x).detach()
    convert_(model)
    assert isinstance(model["twice"].a, Conv2d) and model["twice"].a is model["twice"].b
    assert isinstance(model["p"][0], Conv2d) and model["p"][0] is model["q"][0]
    assert_rel_close(model["twice"](x).detach(), want, 1e-5)
    model["p"][0].weight = torch.nn.Parameter(torch.zeros_like(conv.weight))  # a change through one name shows
    assert bool((model["q"][0].weight == 0).all())                             # through the other


def test_quantize_names_what_it_keeps():
    from tilegemm.nn import quantize_

    model = torch.nn.Sequential(Linear(64, 32, activation="relu"), torch.nn.LazyLinear(8))
    quantize_(model, group_size=32, warn=False)
    assert model.tilegemm_skipped == [
        ("0", "tilegemm.nn.Linear with activation='relu' (Int4Linear fuses no activation)"),
        ("1", "torch.nn.modules.linear.LazyLinear has not made its parameters yet (a lazy module): run the model "
              "once on an input, then quantize")]


def test_convert_keeps_layers_whose_forward_was_replaced_on_the_instance():
    # transformers' tensor-parallel plan and accelerate's device_map hooks set `forward` on the instance: a
    # converted copy would keep running it, so convert_ leaves such a layer as it is and says why
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(8, 4))
    calls = []
    for layer in (model[0], model[1]):
        original = layer.forward

        def hooked(*args, _original=original, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        layer.forward = hooked
    convert_(model, warn=False)
    assert type(model[0]) is torch.nn.Linear and type(model[1]) is torch.nn.Conv2d and isinstance(model[2], Linear)
    reasons = dict(model.tilegemm_skipped)
    assert set(reasons) == {"0", "1"} and all("replaced on the instance" in r for r in reasons.values())
    model[0](torch.randn(2, 8))
    assert calls == [1]


def test_convert_keeps_a_conv_whose_conv_forward_was_replaced_on_the_instance():
    import torch.nn.functional as F

    conv = torch.nn.Conv2d(4, 4, 3)
    conv._conv_forward = lambda x, w, b: F.conv2d(x, w * 0, b)  # what the module's forward computes with
    model = torch.nn.Sequential(conv, torch.nn.Conv2d(4, 4, 1))
    convert_(model, warn=False)
    assert model[0] is conv and isinstance(model[1], Conv2d)
    assert "_conv_forward was replaced on the instance" in dict(model.tilegemm_skipped)["0"]


def test_convert_leaves_a_spectral_norm_layers_state_as_it_was():
    # reading the weight of a spectral-normed layer in training runs a power iteration (its u and v change)
    layer = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Conv2d(4, 6, 3))
    model = torch.nn.Sequential(layer).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_(model, warn=False)
    after = model.state_dict()
    assert isinstance(model[0], Conv2d) and all(torch.equal(before[k], after[k]) for k in before)


def test_convert_names_the_attention_projection_it_cannot_swap(device):
    # nn.MultiheadAttention (ViT's encoder) feeds out_proj's weight to F.multi_head_attention_forward and never
    # calls the module: it is kept with that reason (not "its forward may differ"), the MLP after it is swapped
    from tilegemm.nn import quantize_
    from tilegemm.nn.convert import MHA_OUT_PROJ_KEPT

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(32, 2, batch_first=True)
            self.mlp = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.mlp(self.attn(x, x, x, need_weights=False)[0])

    model = Block().to(device)
    x = torch.randn(2, 5, 32, device=device)
    want = model(x).detach()
    with pytest.warns(ConversionNote, match=r"attn.out_proj: the output projection of a torch.nn.MultiheadAttention"):
        convert_(model)
    assert model.tilegemm_skipped == [("attn.out_proj", MHA_OUT_PROJ_KEPT)] and isinstance(model.mlp, Linear)
    assert_rel_close(model(x).detach(), want, 1e-5)
    quantize_(model, group_size=32, warn=False)
    assert ("attn.out_proj", MHA_OUT_PROJ_KEPT) in model.tilegemm_skipped


def test_quantized_encoder_layer_runs_its_4_bit_layers_in_inference(device):
    # torch's inference fast path for TransformerEncoderLayer (eval, no autograd) passes linear1's and linear2's
    # weights to one fused op, which took no 4-bit weight (TypeError from inside torch): the quantized layer takes
    # its module path, which calls them, and gives the output of torch's layer on the dequantized weights
    import copy

    from tilegemm.nn import quantize_
    from tilegemm.nn.int4 import Int4Linear

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).half().to(device).eval()
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ref = copy.deepcopy(model)
    quantize_(model, group_size=32, warn=False)
    for e, e_ref in zip(model.layers, ref.layers):
        for name in ("linear1", "linear2"):
            assert isinstance(getattr(e, name), Int4Linear)
            getattr(e_ref, name).weight.data = tilegemm.w4a16.dequantize(getattr(e, name).weight).half()
    x = torch.randn(2, 5, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        got, want = model(x), ref(x)
    assert_rel_close(got, want.double(), 5e-3)


def test_quantized_encoder_with_a_padding_mask_keeps_dense_tensors(device):
    # with a padding mask in inference a TransformerEncoder built with enable_nested_tensor (its default) turns the
    # batch into a nested tensor for its fused layers, which a 4-bit layer cannot read (torch's internal error from
    # inside Int4Linear): quantize_ turns that conversion off where a layer of the encoder is 4-bit
    import copy

    from tilegemm.nn import quantize_

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).half().to(device).eval()
    model = torch.nn.TransformerEncoder(layer, 2)
    assert model.use_nested_tensor
    ref = copy.deepcopy(model)
    ref.use_nested_tensor = False  # the reference in dense tensors too: padded positions are compared below
    quantize_(model, group_size=32, warn=False)
    assert not model.use_nested_tensor
    for e, e_ref in zip(model.layers, ref.layers):
        for name in ("linear1", "linear2"):
            getattr(e_ref, name).weight.data = tilegemm.w4a16.dequantize(getattr(e, name).weight).half()
    x = torch.randn(2, 5, 64, device=device, dtype=torch.float16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device=device)
    with torch.no_grad():
        got, want = model(x, src_key_padding_mask=mask), ref(x, src_key_padding_mask=mask)
    assert_rel_close(got[0], want[0].double(), 5e-3)
    assert_rel_close(got[1, :3], want[1, :3].double(), 5e-3)
