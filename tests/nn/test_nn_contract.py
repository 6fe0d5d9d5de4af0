"""tilegemm.nn behaves like torch.nn where torch defines the behaviour, else raises a clear TypeError/ValueError at
once: the cases a new user met (quantize_'s group sizes and skipped layers, fp32 models, empty layers, meta
modules, unknown activations), then property tests over Linear, Conv2d, Int4Linear, convert_ and quantize_."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch.nn.functional as F

from conftest import CLEAR, HERE, rel_err_of_sums
from tilegemm.core.activations import torch_activation
from tilegemm.nn import Conv2d, Int4Linear, Linear, convert_, quantize_, quantize_experts_
from tilegemm.nn.convert import ConversionNote
from tilegemm.ops.matmul.reference import relative_error
from tilegemm import w4a16
from tilegemm.ops.w4a16 import dequantize



pytestmark = pytest.mark.usefixtures("tensors_here")  # inputs made where the kernels run
FAST = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


# --- quantize_ -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [48, 17, 96, 0, "128", True])
def test_quantize_refuses_a_group_size_it_cannot_use(group_size):
    model = torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="group_size"):
        quantize_(model, group_size=group_size)
    assert type(model[0]) is torch.nn.Linear


def test_quantize_warns_about_the_layers_it_keeps():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 12), torch.nn.Linear(12, 128),
                                torch.nn.Linear(128, 8))
    with pytest.warns(ConversionNote, match=r"0: in_features = 64 .* group_size = 128") as caught:
        quantize_(model)
    assert len(caught) == 1 and "2: in_features = 12" in str(caught[0].message)
    assert [type(m) for m in model] == [torch.nn.Linear] * 3 + [Int4Linear]
    assert [name for name, _ in model.tilegemm_skipped] == ["0", "1", "2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_(torch.nn.Sequential(torch.nn.Linear(64, 4)), warn=False)


@pytest.mark.parametrize("thing,error", [(torch.zeros(3), TypeError), (None, TypeError),
                                         (torch.nn.Linear(128, 4), ValueError)])
def test_quantize_takes_a_model(thing, error):
    with pytest.raises(error, match="quantize_"):
        quantize_(thing)


def test_quantize_experts_takes_a_model():
    with pytest.raises(TypeError, match="quantize_experts_ takes a torch.nn.Module, got NoneType"):
        quantize_experts_(None)  # (it raised AttributeError on named_modules)


@pytest.mark.parametrize("transform", ["convert_", "quantize_", "quantize_experts_"])
def test_a_filter_that_is_not_callable_is_named(transform):
    # it raised "'int' object is not callable" from inside the walk, naming no argument
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    fn = {"convert_": convert_, "quantize_": quantize_, "quantize_experts_": quantize_experts_}[transform]
    with pytest.raises(TypeError, match=f"{transform}: filter must be a callable .* got int"):
        fn(model, filter=3)
    assert type(model[0]) is torch.nn.Linear


_FLAGS = [("convert_", f) for f in ("conv", "linear", "moe", "warn", "fold_batchnorm")] + [
    ("quantize_", "symmetric"), ("quantize_", "warn")]


@pytest.mark.parametrize("transform,flag", _FLAGS)
@pytest.mark.parametrize("value", ["no", None, 2.0])
def test_flags_take_only_booleans(transform, flag, value):
    # linear="no" is truthy: convert_ converted the Linears it was meant to keep, saying nothing; symmetric="no"
    # chose quantize_'s symmetric form, refused only after the MoE blocks were converted
    model = torch.nn.Sequential(torch.nn.Linear(128, 8))
    fn = {"convert_": convert_, "quantize_": quantize_}[transform]
    with pytest.raises(TypeError, match=f"{transform}: {flag} must be True or False, got {value!r}"):
        fn(model, **{flag: value})
    assert type(model[0]) is torch.nn.Linear


def test_an_fp32_model_takes_its_own_input_after_quantize():
    model = torch.nn.Sequential(torch.nn.Linear(128, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 128)
    quantize_(model, group_size=128)
    out = model(x)
    assert out.dtype == torch.float32 and out.shape == (3, 4)
    w = dequantize(model[0].weight).float()
    ref = torch.relu(x.half().float() @ w.T + model[0].bias.float())
    assert relative_error(model[1](model[0](x)), ref) < 4e-3


def test_int4_linear_in_fp32_works_like_a_torch_module():
    m = Int4Linear(128, 8, dtype=torch.float32)
    assert m.bias.dtype == torch.float32
    assert m(torch.randn(2, 128)).dtype == torch.float32
    half = Int4Linear(128, 8)
    assert half(torch.randn(2, 128, dtype=torch.float16)).dtype == torch.float16
    f = half.float()  # scales stay 16-bit (the kernels read them so); the module now takes fp32 input
    assert f.scales.dtype == torch.float16 and f.bias.dtype == torch.float32
    assert f(torch.randn(2, 128)).dtype == torch.float32
    assert f.half()(torch.randn(2, 128, dtype=torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("bias", [True, False])
def test_an_fp32_int4_linear_takes_activations_and_products_past_the_16_bit_range(bias):
    # the kernels take 16-bit activations: an fp32 module scales each row into their range and back, so activations
    # of 1e5 (inf in fp16) and products past 65504 stay finite and right, as in torch's fp32 Linear; inf, NaN and
    # zero rows go as they are
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 24, bias=bias)
    m = Int4Linear.from_linear(lin, 64)
    x = torch.randn(6, 256)
    x[0] *= 1e5  # activations past fp16's range
    x[1] = 300.0  # activations in range, products past it
    x[2] *= 1e-6  # small activations: kept in range too
    x[3] = 0.0
    x[4, 7] = float("inf")
    x[5] *= 1.5 * 2.0**127 / x[5].abs().max()  # a largest magnitude past 2^127: its power of two at 2^127
    w = dequantize(m.weight).double()
    ref = x.double() @ w.T + (m.bias.double() if bias else 0)
    out = m(x)
    assert out.dtype == torch.float32
    for row in (0, 1, 2, 3, 5):
        assert torch.isfinite(out[row]).all() and relative_error(out[row], ref[row]) < 2e-3, row
    assert torch.equal(out[4].isnan(), ref[4].isnan()) and torch.equal(out[4].isinf(), ref[4].isinf())
    # asked for gradients: torch's fp32 product of the dequantized weight, finite where fp16 intermediates were not
    xg = torch.cat([x[:4], x[5:]]).requires_grad_(True)
    xg.data[1] = 1000.0
    g = torch.full((xg.shape[0], 24), 100.0)
    (m(xg) * g).sum().backward()
    want = g.double() @ w
    assert torch.isfinite(xg.grad).all() and relative_error(xg.grad, want) < 1e-5


def test_an_fp32_int4_linear_keeps_products_of_large_weights_finite():
    # a row of x scaled to at most 1 still gives products past 65504 where a weight row's magnitudes sum past it
    # (200 x 512 = 102400 here): the rows are scaled down further by the weight's bound, so the product is finite and
    # right as in torch's fp32 Linear; a layer of ordinary weights keeps its scaling (the same bits as before)
    lin = torch.nn.Linear(512, 8, bias=False)
    lin.weight.data.fill_(200.0)
    lin.weight.data[1] *= -1
    m = Int4Linear.from_linear(lin, 128)
    x = torch.ones(3, 512)
    x[1] = torch.linspace(-1, 1, 512)
    x[2] *= 1e3
    ref = x.double() @ dequantize(m.weight).double().T
    out = m(x)
    assert torch.isfinite(out).all() and relative_error(out, ref) < 2e-3
    torch.manual_seed(0)
    small = Int4Linear.from_linear(torch.nn.Linear(256, 16, bias=False), 64)
    xs = torch.randn(4, 256)
    scale = torch.exp2(torch.ceil(torch.log2(xs.abs().amax(-1, keepdim=True))))
    assert torch.equal(small(xs), w4a16.matmul((xs / scale).half(), small.weight).float() * scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_fp32_int4_linear_keeps_its_other_columns_beside_a_bad_scale(bad):
    # the weight's bound leaves out a row whose scales are not finite: its outputs are NaN or inf as before, and
    # the other rows' outputs stay exact (a NaN bound made every output NaN, an inf one flushed them to 0)
    torch.manual_seed(0)
    m = Int4Linear.from_linear(torch.nn.Linear(128, 16, bias=False), 64)
    x = torch.randn(3, 128)
    good = m(x)
    m.scales[0, 3] = bad
    out = m(x)
    others = [c for c in range(16) if c != 3]
    assert torch.equal(out[:, others], good[:, others])
    assert not torch.isfinite(out[:, 3]).all()


def test_an_fp32_int4_linear_names_an_input_on_another_device():
    # the weight's bound is a tensor on the weight's device: x on another is refused by name before the two meet
    m = Int4Linear(64, 8, group_size=32, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match=r"tensors are on different devices: x on (cpu|cuda:\d), w on meta"):
        m(torch.randn(2, 64))


def test_the_weight_bound_is_kept_per_weight_and_follows_its_changes():
    from tilegemm.nn.int4 import _row_sum_exponent

    m = Int4Linear.from_linear(torch.nn.Linear(512, 8, bias=False), 128)
    first = _row_sum_exponent(m.weight)
    assert first.item() == 0 and _row_sum_exponent(m.weight) is first  # (kept: no ops a call)
    m.scales.fill_(200.0 / 8)  # in place: the version moves, the bound is made again
    assert _row_sum_exponent(m.weight).item() == torch.ceil(torch.log2(torch.tensor(512 * 8 * 25.0))).item() - 15
    stacked = w4a16.quantize(torch.cat([torch.ones(1, 8, 128), torch.full((1, 8, 128), 1000.0)]), 32)
    # the groups summed, not the experts: expert 1's rows sum to about 128 x 1000 (> 2^15 by 2^2)
    assert _row_sum_exponent(stacked).item() == 2


def test_the_weight_bound_follows_a_swap_of_the_scales_storage():
    # `.data =` keeps the tensor and its version: the bound of the old values gave inf outputs
    from tilegemm.nn.int4 import _row_sum_exponent

    m = Int4Linear.from_linear(torch.nn.Linear(512, 8, bias=False), 128)
    assert _row_sum_exponent(m.weight).item() == 0
    m.scales.data = torch.full_like(m.scales, 200.0 / 8)
    assert _row_sum_exponent(m.weight).item() == torch.ceil(torch.log2(torch.tensor(512 * 8 * 25.0))).item() - 15


def test_an_fp32_int4_linear_made_under_inference_mode_runs():
    # a server that loads its model under inference_mode: its buffers keep no version counter to read
    with torch.inference_mode():
        m = Int4Linear.from_linear(torch.nn.Linear(64, 8), 32).float()
        x = torch.randn(3, 64)
        assert torch.isfinite(m(x)).all()
    with torch.no_grad():
        y = m(x)
    ref = x @ m.dequantize().float().T + m.bias.float()
    assert (y - ref).norm() / ref.norm() < 2e-3


def test_an_fp32_int4_linear_asked_for_gradients_takes_what_torch_takes():
    # the gradient path is torch's own fp32 product, which takes a nested x: the dense check is the kernels' path's
    m = Int4Linear.from_linear(torch.nn.Linear(64, 8), 32)
    x = torch.nested.nested_tensor([torch.randn(3, 64), torch.randn(2, 64)], requires_grad=True)
    out = m(x)
    assert out.is_nested
    with torch.no_grad(), pytest.raises(TypeError, match="x is a nested tensor"):
        m(x.detach())


def test_a_nested_input_is_refused_by_name_by_the_dense_layer():
    for x in (torch.nested.nested_tensor([torch.randn(3, 6), torch.randn(2, 6)]),
              torch.nested.nested_tensor([torch.randn(2, 3, 6), torch.randn(2, 2, 6)])):
        with pytest.raises(TypeError, match="x is a nested tensor"):
            Linear(6, 4)(x)


def test_quantize_twice_keeps_the_4_bit_layers_and_says_so():
    # a 4-bit weight is not requantized (it would round rounded values) whatever group size is asked: each such layer
    # is kept and named, with what gives a 16-bit model to quantize afresh; a 16-bit layer beside them is quantized
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).half()
    quantize_(model, group_size=128, filter=lambda name, m: name == "0")
    first = model[0].qweight.clone()
    with pytest.warns(ConversionNote, match=r"kept 1 layer.*0: already 4-bit \(group_size 128\).*dequantized_copy"):
        quantize_(model, group_size=32, symmetric=True)
    assert torch.equal(model[0].qweight, first) and model[0].group_size == 128
    assert isinstance(model[2], Int4Linear) and model[2].group_size == 32
    assert [n for n, _ in model.tilegemm_skipped] == ["0"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_int4_linear_refuses_a_dtype_it_cannot_hold(dtype):
    with pytest.raises(TypeError, match="dtype"):
        Int4Linear(128, 8, dtype=dtype)


# --- empty layers, as torch has them --------------------------------------------------------------------


def test_a_converted_linear_without_inputs_returns_its_bias():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Initializing zero-element tensors is a no-op"
        model = torch.nn.Sequential(torch.nn.Linear(0, 4))
    ref = model(torch.randn(2, 0))
    convert_(model)
    assert isinstance(model[0], Linear)
    torch.testing.assert_close(model(torch.randn(2, 0)), ref)
    torch.testing.assert_close(model(torch.randn(3, 2, 0)), ref[0].expand(3, 2, 4))


@pytest.mark.parametrize("group_size", [128, -1])
def test_int4_linear_without_inputs_returns_its_bias(group_size):
    m = Int4Linear(0, 4, group_size=group_size)
    with torch.no_grad():
        m.bias.copy_(torch.arange(4.0))
    out = m(torch.randn(2, 0, dtype=torch.float16))
    torch.testing.assert_close(out, torch.arange(4.0, dtype=torch.float16).expand(2, 4))
    lin = Int4Linear.from_linear(torch.nn.Linear(0, 3, bias=False), group_size)
    assert torch.equal(lin(torch.randn(5, 0)), torch.zeros(5, 3))


# --- activations checked when the module is made --------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: Linear(4, 4, activation="tanh"), lambda: Conv2d(2, 2, 3, activation="tanh"),
                                  lambda: Linear.from_linear(torch.nn.Linear(4, 4), activation="tanh"),
                                  lambda: Conv2d.from_conv(torch.nn.Conv2d(2, 2, 1), activation=1)])
def test_an_unknown_activation_fails_at_construction(make):
    with pytest.raises((TypeError, ValueError), match="activation"):
        make()


# --- the meta device: models are built there before loading or sharding ------------------------------------


def test_modules_work_on_the_meta_device():
    x = torch.empty(2, 3, 8, device="meta")
    assert Linear(8, 5, device="meta", activation="relu")(x).shape == (2, 3, 5)
    conv = Conv2d(3, 6, 3, padding=1, device="meta")
    assert conv(torch.empty(2, 3, 7, 7, device="meta")).shape == (2, 6, 7, 7)
    q = Int4Linear(128, 5, device="meta")
    out = q(torch.empty(2, 128, device="meta", dtype=torch.float16))
    assert out.device.type == "meta" and out.shape == (2, 5)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(128, 16), torch.nn.Linear(16, 4))
    quantize_(model, warn=False)
    assert isinstance(model[0], Int4Linear) and model[0].qweight.device.type == "meta"
    assert model(torch.empty(3, 128, device="meta")).shape == (3, 4)
    convert_(model)
    assert model(torch.empty(3, 128, device="meta")).shape == (3, 4)


# --- properties: equal to torch.nn, or a clear error --------------------------------------------------------


def _ref(m, x):
    ref = copy.deepcopy(m).double()
    ref.__class__ = torch.nn.Conv2d if isinstance(m, torch.nn.Conv2d) else torch.nn.Linear
    return ref(x.double())


@FAST
@given(i=st.sampled_from([0, 1, 3, 17]), o=st.sampled_from([0, 1, 4]), lead=st.sampled_from([(), (1,), (2,), (2, 0)]),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
       x_dtype_same=st.integers(0, 5), activation=st.sampled_from([None, "relu", "silu", "tanh"]),
       device=st.sampled_from([HERE, "meta"]))
def test_linear_equals_torch_or_raises_clearly(i, o, lead, bias, dtype, x_dtype_same, activation, device):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = Linear(i, o, bias=bias, dtype=dtype, device=device, activation=activation)
    except CLEAR:
        assert activation == "tanh", "a valid Linear was refused"
        return
    assert activation != "tanh"
    x_dtype = dtype if x_dtype_same else torch.float32 if dtype != torch.float32 else torch.float16
    x = torch.randn(*lead, i).to(device=device, dtype=x_dtype)
    try:
        with torch.no_grad():
            out = m(x)
    except CLEAR:
        assert x_dtype != dtype, "a valid call was refused"
        return
    assert x_dtype == dtype, "torch refuses this call; tilegemm took it"
    assert out.shape == (*lead, o) and out.dtype == dtype and out.device.type == device
    if device != "meta":
        ref = torch_activation(_ref(m, x), activation or "none")
        terms = x.double().abs() @ m.weight.double().abs().T + (m.bias.double().abs() if bias else 0)
        assert rel_err_of_sums(out, ref, terms, i) <= (1e-4 if dtype == torch.float32 else 4e-3)


@FAST
@given(n=st.sampled_from([1, 2]), c=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 2, 4]),
       size=st.sampled_from([1, 3, 6]), ks=st.sampled_from([1, 2, 3]), stride=st.sampled_from([1, 2]),
       padding=st.sampled_from([0, 1, "same", "valid"]), groups=st.sampled_from([1, 2]),
       mode=st.sampled_from(["zeros", "reflect", "circular"]), unbatched=st.booleans(),
       device=st.sampled_from([HERE, HERE, "meta"]))
def test_conv2d_module_equals_torch_or_raises_clearly(n, c, k, size, ks, stride, padding, groups, mode, unbatched,
                                                      device):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    kw = dict(stride=stride, padding=padding, groups=groups, padding_mode=mode)
    try:
        torch_conv = torch.nn.Conv2d(c, k, ks, **kw)
    except CLEAR:
        with pytest.raises(CLEAR):
            Conv2d(c, k, ks, **kw)
        return
    ref_conv = copy.deepcopy(torch_conv).double()
    m = Conv2d.from_conv(torch_conv).to(device)
    x = torch.randn(c, size, size) if unbatched else torch.randn(n, c, size, size)
    try:
        ref = ref_conv(x.double())
    except RuntimeError as err:  # input smaller than the kernel, reflect padding wider than the input, ...
        try:
            m(x.to(device))
        except CLEAR:
            return
        except RuntimeError as ours:  # torch's own error, raised by the same F.pad: torch's behaviour
            assert str(ours).split(" of input")[0] == str(err).split(" of input")[0]  # (meta prints the size)
            return
        pytest.fail("a call torch refuses was taken")
    out = m(x.to(device))
    assert out.shape == ref.shape and out.device.type == device
    if device != "meta":
        terms = F.conv2d(F.pad(x.double(), ref_conv._reversed_padding_repeated_twice, mode=mode).abs()
                         if mode != "zeros" else x.double().abs(), ref_conv.weight.abs(), None,
                         stride, 0 if mode != "zeros" else ref_conv.padding, 1, groups)
        assert rel_err_of_sums(out, ref, terms, c // groups * ks * ks) <= 1e-4


@FAST
@given(k=st.sampled_from([0, 8, 64, 128, 256]), n=st.sampled_from([1, 8]), group_size=st.sampled_from([32, 128, -1]),
       lead=st.sampled_from([(), (1,), (3,), (0,)]), dtype=st.sampled_from([torch.float16, torch.float32]),
       bias=st.booleans())
def test_int4_linear_equals_its_dequantized_weight_or_raises_clearly(k, n, group_size, lead, dtype, bias):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    linear = torch.nn.Linear(k, n, bias=bias, dtype=dtype) if k else torch.nn.Linear(0, n, bias=bias, dtype=dtype)
    try:
        m = Int4Linear.from_linear(linear, group_size)
    except CLEAR:
        assert k and group_size != -1 and k % group_size, "a valid layer was refused"
        return
    x = torch.randn(*lead, k, dtype=dtype)
    out = m(x)
    assert out.shape == (*lead, n) and out.dtype == dtype
    w = dequantize(m.weight).double()
    ref = x.half().double() @ w.T + (m.bias.double() if bias else 0)
    terms = x.half().double().abs() @ w.abs().T + (m.bias.double().abs() if bias else 0)
    assert rel_err_of_sums(out, ref, terms, k) <= 4e-3


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(widths=st.lists(st.sampled_from([8, 12, 32, 64, 128]), min_size=2, max_size=3),
       group_size=st.sampled_from([32, 64, 128, 48, -1]), dtype=st.sampled_from([torch.float16, torch.float32]),
       device=st.sampled_from([HERE, "meta"]))
def test_quantize_and_convert_keep_the_model_working_or_raise_clearly(widths, group_size, dtype, device):
    torch.manual_seed(0)  # the same values each time hypothesis draws this example
    layers = [torch.nn.Linear(a, b, dtype=dtype, device=device) for a, b in zip(widths, widths[1:])]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(2, widths[0], dtype=dtype).to(device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionNote)
            quantize_(model, group_size=group_size)
    except CLEAR:
        assert group_size == 48
        return
    assert group_size != 48
    for name, layer in zip(map(str, range(len(layers))), model):
        fits = layer.in_features % (layer.in_features if group_size == -1 else group_size) == 0 and \
            layer.in_features % 8 == 0
        assert isinstance(layer, Int4Linear) == fits, name
        assert (name in dict(model.tilegemm_skipped)) == (not fits)
    out = model(x)
    assert out.shape == (2, widths[-1]) and out.dtype == dtype
    convert_(model, warn=False)
    again = model(x)
    assert again.shape == out.shape
    if device != "meta":
        assert relative_error(again, out) <= 1e-2


def test_symbolic_trace_of_converted_and_quantized_linears(device):
    """torch.fx.symbolic_trace records tilegemm's Linear and Int4Linear as call_module nodes, as it records
    torch.nn's layers (their forwards branch on the input's shape, which a Proxy does not have); the traced module
    computes what the model does."""
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        four = quantize_(copy.deepcopy(dense).half(), group_size=32)
        convert_(dense)
    for model, x in ((dense, torch.randn(2, 3, 64, device=device)),
                     (four, torch.randn(5, 64, device=device, dtype=torch.float16))):
        gm = torch.fx.symbolic_trace(model)
        assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "call_module", "call_module",
                                                  "output"]
        with torch.no_grad():
            assert torch.equal(gm(x), model(x))


def test_symbolic_trace_of_a_layer_itself_is_refused_by_name(device):
    """A traced tilegemm layer is a call_module node of its module; the model traced being the layer itself, there
    is no such module: refused naming the layer and what traces, not an AttributeError on the module ''."""
    import torch.fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        four = quantize_(torch.nn.Sequential(torch.nn.Linear(64, 32)).half(), group_size=32)[0]
    for layer in (convert_(torch.nn.Sequential(torch.nn.Linear(64, 32)))[0], four):
        with pytest.raises(torch.fx.proxy.TraceError, match=f"{type(layer).__name__} itself.*torch.nn.Sequential"):
            torch.fx.symbolic_trace(layer)
        torch.fx.symbolic_trace(torch.nn.Sequential(layer))  # held by a module: traced
