"""tilegemm.nn.Linear as a drop-in for torch.nn.Linear: autocast, dtypes it refuses, state dicts, copies, odd inputs."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

from tilegemm.nn import Linear

from conftest import assert_rel_close


def _torch_twin(m: Linear) -> torch.nn.Linear:
    ref = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device,
                          dtype=m.weight.dtype)
    ref.load_state_dict(m.state_dict())
    return ref


@pytest.mark.parametrize("layer_dtype", [torch.float32, torch.bfloat16])
def test_autocast_runs_in_its_dtype_like_torch_linear(layer_dtype, device):
    # an fp32 layer gives the autocast dtype, a bf16 layer takes fp32 x (both cast), as torch.nn.Linear's do
    m = Linear(8, 3, activation="relu").to(device=device, dtype=layer_dtype)
    ref = _torch_twin(m)
    x = torch.randn(2, 4, 8, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.float16):
        out, want = m(x), ref(x)
    assert out.dtype == want.dtype == torch.float16 and out.shape == want.shape
    assert_rel_close(out.float(), F.relu(want.float()), 1e-2)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == layer_dtype


def test_float64_layer_runs_torchs_linear(device):
    # as tilegemm.nn.Conv2d after .double(): no kernel takes float64, torch's linear does (gradcheck works)
    m = Linear(4, 3, activation="silu").to(device).double()
    x = torch.randn(2, 4, device=device, dtype=torch.float64, requires_grad=True)
    want = F.silu(F.linear(x, m.weight, m.bias))
    assert torch.equal(m(x), want)
    assert torch.autograd.gradcheck(m, (x,))
    with pytest.raises(TypeError, match="x is fp32 but the layer is float64"):
        m(torch.randn(2, 4, device=device))


def test_state_dict_round_trip_and_copies_keep_the_activation(device):
    m = Linear(5, 3, activation="silu").to(device)
    ref = _torch_twin(m)
    back = Linear(5, 3, activation="silu").to(device)
    back.load_state_dict(ref.state_dict())
    x = torch.randn(4, 5, device=device)
    want = F.silu(ref(x)).detach()
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for other in (back, copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(buf, weights_only=False)):
        assert type(other) is Linear and other.activation == "silu"
        assert_rel_close(other(x).detach(), want, 1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_no_in_features_gives_the_bias_and_gradients_like_torch(bias, device):
    m = Linear(0, 3, bias=bias).to(device)
    ref = _torch_twin(m)
    x = torch.randn(2, 4, 0, device=device, requires_grad=True)
    out, want = m(x), ref(x)
    assert out.shape == want.shape == (2, 4, 3)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    if bias:
        want.sum().backward()
        torch.testing.assert_close(m.bias.grad, ref.bias.grad)


def test_vector_expanded_and_permuted_inputs(device):
    m = Linear(5, 3, activation="gelu").to(device)
    ref = _torch_twin(m)
    for x in (torch.randn(5, device=device), torch.randn(1, 1, 5, device=device).expand(2, 3, 5),
              torch.randn(5, 3, 4, device=device).permute(2, 1, 0), torch.randn(3, 4, 10, device=device)[..., ::2]):
        assert_rel_close(m(x).detach(), F.gelu(ref(x)).detach(), 1e-5)


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("make", [
    pytest.param(lambda m: torch.nn.utils.parametrizations.weight_norm(m), id="weight_norm"),
    pytest.param(lambda m: torch.nn.utils.parametrize.register_parametrization(m, "bias", _Doubled()), id="bias"),
])
def test_from_linear_of_a_parametrized_linear_keeps_its_parametrizations(make, device):
    # as Conv2d.from_conv: copy.copy refused a parametrized Linear ("Serialization of parametrized modules ...")
    from torch.nn.utils import parametrize

    lin = make(torch.nn.Linear(8, 4).to(device))
    new = Linear.from_linear(lin, activation="relu")
    assert isinstance(new, Linear) and parametrize.type_before_parametrizations(new) is Linear
    assert type(lin).__bases__[0] is torch.nn.Linear and new.state_dict().keys() == lin.state_dict().keys()
    x = torch.randn(3, 8, device=device)
    assert_rel_close(new(x), F.relu(lin(x)).detach().double(), 1e-5)
    new(x).sum().backward()  # the same original tensors get the gradients
    assert all(p.grad is not None for p in lin.parameters())
    kept = {k: len(v) for k, v in lin.parametrizations.items()}
    parametrize.register_parametrization(new, "weight", _Doubled())  # the original's lists stay as they were
    assert {k: len(v) for k, v in lin.parametrizations.items()} == kept


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_from_linear_refuses_a_module_whose_forward_it_would_not_run(device):
    """A subclass's own forward and an uninitialised lazy Linear are named, where the copy ran a plain product
    instead (or failed on a missing ``initialize_parameters``); an initialised lazy Linear converts."""
    for linear, match in ((_ScaledLinear(4, 3), "_ScaledLinear overrides torch.nn.Linear's forward"),
                          (torch.nn.LazyLinear(3), "LazyLinear has not made its parameters yet")):
        with pytest.raises(ValueError, match=match):
            Linear.from_linear(linear)
    lazy = torch.nn.LazyLinear(3, device=device)
    x = torch.randn(2, 4, device=device)
    ref = lazy(x)  # (now a plain nn.Linear)
    assert_rel_close(Linear.from_linear(lazy)(x), ref, 1e-5)


@pytest.mark.parametrize("x, error, match", [
    (torch.randn(3, 5), ValueError, r"in_features=6, out_features=4\) got input of shape \[3, 5\]: its last dim must "
                                    r"be 6"),
    (torch.tensor(1.0), ValueError, r"got input of shape \[\]"),
    (torch.randn(3, 6, dtype=torch.float16), TypeError, r"a module of dtype fp32 and got input of dtype fp16: convert "
                                                        r"the module \(\.to\(torch\.float16\)\)"),
    (torch.ones(2, 6, dtype=torch.int64), TypeError, "got input of dtype int64: give it floating-point input"),
    (torch.randn(2, 6, device="meta"), ValueError,
     r"has its weight on (cpu|cuda:\d) and got input on meta: move the module"),
], ids=["features", "0-d", "dtype", "int", "device"])
def test_refused_inputs_are_named_in_the_layers_terms(x, error, match):
    # (the product underneath names its operands a and b, and the weight transposed)
    with pytest.raises(error, match=match):
        Linear(6, 4)(x)
