"""tilegemm.nn.fold_batchnorm_ (and convert_(fold_batchnorm=True)): in eval mode each folded convolution applies the
batch norm after it and the activation after that; in training mode every module computes what torch's does. Which
pairs fold (torch.fx's graph, or a Sequential's neighbours), which do not, the cache of folded parameters, state
dicts, copies, gradients."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tilegemm.nn import Conv2d, convert_, fold_batchnorm_
from tilegemm.nn.fold import FoldedActivation, FoldedBatchNorm2d

from conftest import assert_rel_close


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interpreter's warning
        yield


def _randomize_norms(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Batch norms with statistics and affine parameters far from the identity's, so a fold that did nothing fails."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            with torch.no_grad():
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 2 - 1)
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
                if m.weight is not None:
                    m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    return model


class Block(torch.nn.Module):
    """A residual block as ResNet writes it (a ReLU module shared by three calls), a downsampling Sequential and a
    head of conv, batch norm and SiLU."""

    def __init__(self, act: torch.nn.Module | None = None):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.relu = torch.nn.ReLU(inplace=True)
        self.down = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 1, stride=1, bias=False), torch.nn.BatchNorm2d(16))
        self.head = torch.nn.Sequential(torch.nn.Conv2d(16, 8, 1), torch.nn.BatchNorm2d(8), act or torch.nn.SiLU())

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        y = self.relu(y + self.down(x))
        return self.head(y)


def _pair(device, act=None, seed=0):
    torch.manual_seed(seed)
    ref = _randomize_norms(Block(act), seed).to(device)
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True)
    return ref, folded


def test_eval_applies_the_norms_and_the_activation(device):
    ref, folded = _pair(device)
    assert folded.tilegemm_folded == [("conv1", "bn1", None), ("conv2", "bn2", None), ("down.0", "down.1", None),
                                      ("head.0", "head.1", "head.2")]
    assert isinstance(folded.bn1, FoldedBatchNorm2d) and isinstance(folded.head[2], FoldedActivation)
    assert type(folded.relu) is torch.nn.ReLU  # shared by three calls: kept as it is
    assert "batch norm folded with silu" in repr(folded.head[0])
    ref.eval(), folded.eval()
    x = torch.randn(2, 8, 7, 9, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)
        assert_rel_close(folded(x), ref(x).double(), 1e-5)  # the second call: the kept parameters


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_folded_modules_run_no_norm_and_no_activation_op(device):
    _, folded = _pair(device)
    folded.eval()
    x = torch.randn(1, 8, 5, 5, device=device)
    with torch.no_grad():
        folded(x)  # folds and keeps the parameters
        with _OpNames() as ops:
            folded(x)
    assert not [n for n in ops.names if "batch_norm" in n or "silu" in n or n.startswith("rsqrt")], ops.names


def test_training_mode_is_torchs(device):
    ref, folded = _pair(device)
    ref = ref.double()  # the reference in fp64: on a GPU torch's fp32 convolution gradients may run in tf32
    ref.train(), folded.train()
    x = torch.randn(1, 8, 6, 6, device=device)
    out_ref, out = ref(x.double()), folded(x)
    assert_rel_close(out, out_ref, 1e-5)
    out_ref.square().sum().backward()
    out.square().sum().backward()
    # all gradients as one vector: a convolution's bias before a training-mode batch norm gets a zero gradient
    # up to rounding, which no relative bound per tensor can hold
    grads = torch.cat([p.grad.flatten() for p in folded.parameters()])
    assert_rel_close(grads, torch.cat([p.grad.flatten() for p in ref.parameters()]), 1e-4)
    for (name, b_ref), (_, b) in zip(ref.named_buffers(), folded.named_buffers()):
        torch.testing.assert_close(b, b_ref.to(b.dtype), msg=name)  # running statistics updated alike
    # back in eval mode the folded parameters come from the updated statistics (their updates bump no version)
    ref.eval(), folded.eval()
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x.double()), 1e-5)


def test_eval_gradients_flow_through_the_fold(device):
    ref, folded = _pair(device)
    ref = ref.double()  # the reference in fp64: on a GPU torch's fp32 convolution gradients may run in tf32
    ref.eval(), folded.eval()
    x = torch.randn(1, 8, 6, 6, device=device)
    xr, xf = x.double().requires_grad_(), x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    folded(xf).square().sum().backward()
    assert_rel_close(xf.grad, xr.grad, 1e-4)
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), folded.named_parameters()):
        assert_rel_close(p.grad, p_ref.grad, 1e-4)


def test_state_dict_copies_and_changed_parameters(device):
    ref, folded = _pair(device)
    assert folded.state_dict().keys() == ref.state_dict().keys()
    ref.eval(), folded.eval()
    x = torch.randn(1, 8, 5, 6, device=device)
    with torch.no_grad():
        folded(x)
        # another model's state: the kept folded parameters are not used again
        other = _randomize_norms(Block(), seed=5).to(device).eval()
        folded.load_state_dict(other.state_dict())
        assert_rel_close(folded(x), other(x).double(), 1e-5)
        folded.bn2.running_var.mul_(3.0)  # an in-place change of one statistic
        other.bn2.running_var.mul_(3.0)
        assert_rel_close(folded(x), other(x).double(), 1e-5)
        twin = copy.deepcopy(folded)
        assert twin.conv2._tilegemm_fold.norm is twin.bn2 and twin.head[2].fold.norm is twin.head[1]
        buf = io.BytesIO()
        torch.save(folded, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert loaded.conv1._tilegemm_fold.norm is loaded.bn1
        for model in (twin, loaded):
            assert_rel_close(model(x), other(x).double(), 1e-5)


def test_weights_swapped_by_functional_call_are_not_served_from_the_cache(device):
    # torch.func.functional_call puts a new weight in each call; a freed one's address, reused by the next, with
    # the same version must not match the kept folded parameters
    ref, folded = _pair(device)
    ref.eval(), folded.eval()
    x = torch.randn(1, 8, 5, 6, device=device)
    base = ref.conv1.weight.detach()
    with torch.no_grad():
        for i in range(4):
            w = base * (i + 1)
            got = torch.func.functional_call(folded, {"conv1.weight": w}, (x,))
            assert_rel_close(got, torch.func.functional_call(ref, {"conv1.weight": w}, (x,)).double(), 1e-5)
            del w, got


def test_a_model_made_in_inference_mode(device):
    # its parameters are inference tensors, which have no version counter: folded again at each call
    with torch.inference_mode():
        ref, folded = _pair(device)
        ref.eval(), folded.eval()
        x = torch.randn(1, 8, 5, 6, device=device)
        assert_rel_close(folded(x), ref(x).double(), 1e-5)
        folded.bn2.running_var.mul_(3.0), ref.bn2.running_var.mul_(3.0)
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


@pytest.mark.parametrize("act, fused", [(torch.nn.ReLU(), "relu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
                                        (torch.nn.LeakyReLU(0.01), "leaky_relu"), (torch.nn.LeakyReLU(0.2), None),
                                        (torch.nn.Hardswish(), None)])
def test_activation_kinds(act, fused, device):
    ref, folded = _pair(device, act)
    assert folded.tilegemm_folded[-1] == ("head.0", "head.1", "head.2" if fused else None)
    assert folded.head[0]._tilegemm_fold.activation == fused
    ref.eval(), folded.eval()
    x = torch.randn(1, 8, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


class TwoReaders(torch.nn.Module):
    """conv1's output read by its batch norm and by the sum; bn2 called twice; conv3 with an activation of its own."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 4, 1)
        self.bn2 = torch.nn.BatchNorm2d(4)
        self.conv3 = Conv2d(4, 4, 1, activation="relu")
        self.bn3 = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        a = self.conv1(x)
        y = self.bn1(a) + a
        y = self.bn2(self.bn2(self.conv2(y)))
        return self.bn3(self.conv3(y))


def test_pairs_that_do_not_fold(device):
    ref = _randomize_norms(TwoReaders()).to(device).eval()
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True)
    assert folded.tilegemm_folded == []
    assert not any(isinstance(m, FoldedBatchNorm2d) for m in folded.modules())
    x = torch.randn(1, 4, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


def test_a_norm_replaced_after_folding_is_applied_once(device):
    # SyncBatchNorm.convert_sync_batchnorm (a DDP setup) replaces every batch norm, the folded ones too: the
    # convolutions stop folding, and the new norms normalize (in eval mode without a process group, as torch's)
    ref, folded = _pair(device)
    ref = torch.nn.SyncBatchNorm.convert_sync_batchnorm(ref).eval()
    folded = torch.nn.SyncBatchNorm.convert_sync_batchnorm(folded).eval()
    assert not any(isinstance(m, FoldedBatchNorm2d) for m in folded.modules())
    assert not folded.head[0]._tilegemm_fold.active()
    x = torch.randn(2, 8, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)
    # a convolution swapped out after folding: its norm normalizes again
    _, folded = _pair(device)
    folded.eval()
    folded.conv1 = copy.deepcopy(folded.conv1)
    folded.conv1.__dict__.pop("_tilegemm_fold")
    ref.eval()
    with torch.no_grad():
        assert_rel_close(folded(x), _pair(device)[0].eval()(x).double(), 1e-5)


def test_an_activation_replaced_after_folding_is_not_applied_by_the_convolution(device):
    # head's SiLU is in the convolution's epilogue: replaced afterwards, the model must run the new module alone
    ref, folded = _pair(device)
    assert ("head.0", "head.1", "head.2") in folded.tilegemm_folded
    ref.head[2], folded.head[2] = torch.nn.Identity(), torch.nn.Identity()
    ref.eval(), folded.eval()
    x = torch.randn(2, 8, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


def test_hooks_added_after_folding_see_and_change_what_torchs_modules_would(device):
    # a hook put on a folded module afterwards ends its fold: it sees the convolution's own output, and what it
    # changes goes through the norm and the activation (they had been applied by the convolution already)
    ref, folded = _pair(device)
    ref.eval(), folded.eval()
    x = torch.randn(2, 8, 5, 5, device=device)

    def ablate(module, args, out):
        out = out.clone()
        out[:, 0] = 0
        return out

    seen = {}
    for name, hook in (("conv1", ablate), ("bn1", None), ("relu", None)):
        handles = []
        for model in (ref, folded):
            module = getattr(model, name) if name != "relu" else model.head[2]
            if hook is None:  # a pre-hook adding one, then a read-only hook recording the input
                handles.append(module.register_forward_pre_hook(lambda m, a: (a[0] + 1.0,)))
                handles.append(module.register_forward_hook(lambda m, a, o, k=id(model): seen.__setitem__(k, o)))
            else:
                handles.append(module.register_forward_hook(hook))
        with torch.no_grad():
            assert_rel_close(folded(x), ref(x).double(), 1e-5)
        if hook is None:
            assert_rel_close(seen[id(folded)], seen[id(ref)].double(), 1e-5)
        for h in handles:
            h.remove()
    with torch.no_grad():  # the hooks gone, folded again
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


def test_modules_called_outside_the_traced_forward_compute_torchs(device):
    # a pair from the traced graph folds only while the model's own forward runs: the convolution called alone, or
    # a Sequential slice of the chain, computes what torch's modules do
    ref, folded = _pair(device)
    ref.eval(), folded.eval()
    x, y = torch.randn(2, 8, 5, 5, device=device), torch.randn(2, 16, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded.head[0](y), ref.head[0](y).double(), 1e-5)
        assert_rel_close(folded.head[:2](y), ref.head[:2](y).double(), 1e-5)
        assert_rel_close(folded.head(y), ref.head(y).double(), 1e-5)
        assert_rel_close(folded.bn1(folded.conv1(x)), ref.bn1(ref.conv1(x)).double(), 1e-5)
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


def test_hooks_shared_modules_and_other_norms_are_left(device):
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4),  # hooked norm
                                torch.nn.Conv2d(4, 4, 1), torch.nn.SyncBatchNorm(4),  # another class
                                torch.nn.Conv2d(4, 6, 1), torch.nn.BatchNorm2d(6), torch.nn.ReLU())
    model[1].register_forward_hook(lambda m, i, o: None)
    shared = torch.nn.ReLU()
    model.add_module("again", shared)
    model[6] = shared  # the activation held twice: the norm before it folds, the activation stays a module
    convert_(model, fold_batchnorm=True)
    assert model.tilegemm_folded == [("4", "5", None)]
    assert type(model[1]) is torch.nn.BatchNorm2d and type(model[3]) is torch.nn.SyncBatchNorm


def test_a_norm_without_running_statistics_normalizes_by_the_batch(device):
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4, track_running_stats=False),
                                torch.nn.ReLU())
    ref = copy.deepcopy(model).to(device).eval()
    folded = convert_(model.to(device), fold_batchnorm=True).eval()
    assert folded.tilegemm_folded == [("0", "1", "2")]  # structurally folded, but never applied
    x = torch.randn(2, 4, 6, 6, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


class Untraceable(torch.nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it, so the Sequential neighbours fold."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.conv = torch.nn.Conv2d(8, 8, 1)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.body(x)
        if y.sum() > 0:
            y = y * 2
        return self.bn(self.conv(y))


def test_the_sequential_rule_where_fx_cannot_trace(device):
    ref = _randomize_norms(Untraceable()).to(device).eval()
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True)
    assert folded.tilegemm_folded == [("body.0", "body.1", "body.2")]  # not conv -> bn, which no Sequential holds
    x = torch.randn(1, 4, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


class Taps(torch.nn.Module):
    """Untraceable (a branch on the input's size) and calling its Sequential's children one by one, keeping each
    output: the Sequential rule's pair must not fold where the Sequential's own forward does not run it."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.BatchNorm2d(6),
                                            torch.nn.ReLU())

    def forward(self, x, whole=False):
        if x.shape[-1] % 2:
            x = torch.nn.functional.pad(x, (0, 1))
        if whole:
            return [self.features(x)]
        taps = []
        for layer in self.features:
            x = layer(x)
            taps.append(x)
        return taps


def test_the_sequential_rule_folds_only_inside_the_sequentials_forward(device):
    ref = _randomize_norms(Taps()).to(device).eval()
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True)
    assert folded.tilegemm_folded == [("features.0", "features.1", "features.2")]
    x = torch.randn(1, 4, 5, 5, device=device)
    with torch.no_grad():
        for got, want in zip(folded(x), ref(x)):  # the raw convolution, the norm's output, the activation's
            assert_rel_close(got, want.double(), 1e-5)
        assert_rel_close(folded(x, whole=True)[0], ref(x, whole=True)[0].double(), 1e-5)
        with pytest.raises(RuntimeError, match="boom"):  # a forward that raises leaves the count where it was
            folded.features.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(RuntimeError("boom")))
            folded(x, whole=True)
        folded.features._forward_hooks.popitem()
        for got, want in zip(folded(x), ref(x)):
            assert_rel_close(got, want.double(), 1e-5)
    assert_rel_close(copy.deepcopy(folded)(x, whole=True)[0], ref(x, whole=True)[0].double(), 1e-5)


class TrainOnlyNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn(self.conv(x)) if self.training else self.conv(x)


def test_a_forward_that_skips_the_norm_in_eval_mode_is_traced_as_it_runs_folded(device):
    ref = _randomize_norms(TrainOnlyNorm()).to(device)  # in training mode when folded
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True)
    assert folded.tilegemm_folded == [] and folded.training and folded.conv.training
    ref.eval(), folded.eval()
    x = torch.randn(1, 4, 5, 5, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x), ref(x).double(), 1e-5)


def test_fp16(device):
    ref, folded = _pair(device)
    ref.eval(), folded.half().eval()
    x = torch.randn(2, 8, 6, 6, device=device)
    with torch.no_grad():
        assert_rel_close(folded(x.half()), ref(x).double(), 2e-2)


def test_refusals_and_a_second_fold():
    with pytest.raises(TypeError, match="fold_batchnorm_ takes a torch.nn.Module"):
        fold_batchnorm_("model")
    _, folded = _pair("cpu")
    assert fold_batchnorm_(folded).tilegemm_folded == []  # folded already: nothing more
    # plain torch convolutions are not folded (the fold runs in tilegemm's convolutions)
    plain = _randomize_norms(Block())
    assert fold_batchnorm_(plain).tilegemm_folded == []


def test_compiled_fullgraph_in_both_modes(device):
    ref = _randomize_norms(torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                               torch.nn.ReLU())).to(device)
    folded = convert_(copy.deepcopy(ref), fold_batchnorm=True)
    # on the CPU aot_eager (as the suite's other CPU compiles): one graph a mode is the point, not inductor's C++
    compiled = torch.compile(folded, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    x = torch.randn(2, 4, 5, 5, device=device)
    ref.eval(), folded.eval()
    with torch.no_grad():
        assert_rel_close(compiled(x), ref(x).double(), 1e-5)
    ref.train(), folded.train()
    assert_rel_close(compiled(x), ref(x).double(), 1e-5)
    torch.testing.assert_close(folded[1].running_mean, ref[1].running_mean)


def test_an_activation_set_or_changed_after_folding_ends_the_fold(device):
    # the epilogue would apply the activation folded (or none) where the model now asks for another
    torch.manual_seed(0)
    x = torch.randn(1, 4, 5, 5, device=device)
    model = _randomize_norms(torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.BatchNorm2d(6),
                                                 torch.nn.LeakyReLU())).to(device).eval()
    ref = copy.deepcopy(model)
    folded = convert_(copy.deepcopy(model), fold_batchnorm=True)
    assert folded.tilegemm_folded == [("0", "1", "2")]
    with torch.no_grad():
        folded[2].act.negative_slope = ref[2].negative_slope = 0.3  # no longer the epilogue's leaky_relu
        assert_rel_close(folded(x), ref(x).double(), 1e-5)
        folded[0].activation = "relu"  # relu before the norm now
        want = ref[2](ref[1](torch.relu(ref[0](x))))
        assert_rel_close(folded(x), want.double(), 1e-5)
