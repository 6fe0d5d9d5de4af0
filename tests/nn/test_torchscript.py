"""TorchScript and tilegemm.nn: torch.jit.script refuses every module class by name (directly and as a submodule),
pointing to torch.compile and torch.export; torch.jit.trace records the modules and the traced module computes
what the eager one does."""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings

import pytest
import torch
from torch import nn

import tilegemm.nn as tnn
from tilegemm.nn.moe import StackedExperts


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # (TracerWarnings of the ops' checks, ConversionNotes)
        warnings.simplefilter("ignore")
        yield


def _module_classes() -> list[type]:
    """Every torch.nn.Module subclass defined in a tilegemm.nn submodule."""
    found = []
    for info in pkgutil.iter_modules(tnn.__path__, "tilegemm.nn."):
        for value in vars(importlib.import_module(info.name)).values():
            if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == info.name:
                found.append(value)
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


CLASSES = _module_classes()


def _refusal(cls: type) -> str:
    return re.escape(f"{cls.__module__}.{cls.__qualname__} does not support TorchScript") + \
        r".*torch\.compile or torch\.export"


def test_the_classes_found():
    names = {c.__qualname__ for c in CLASSES}
    assert {"Conv2d", "Linear", "Int4Linear", "FusedProjections", "ProjectionPart", "FoldedBatchNorm2d",
            "FoldedActivation", "SparseMoeBlock", "StackedExperts", "Llama4MoeBlock", "JetMoeBlock"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_every_class_refuses_script_by_name(cls):
    # a bare instance: the refusal comes before anything of the module is read (some are made from a model only)
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    with pytest.raises(RuntimeError, match=_refusal(cls)):
        torch.jit.script(module)
    with pytest.raises(RuntimeError, match=_refusal(cls)):
        torch.jit.script(nn.Sequential(nn.ReLU(), module))


def _layers() -> dict[str, nn.Module]:
    return {"Linear": tnn.Linear(8, 4, activation="relu"), "Conv2d": tnn.Conv2d(2, 4, 3),
            "Int4Linear": tnn.Int4Linear.from_linear(nn.Linear(32, 8).half(), group_size=32)}


@pytest.mark.parametrize("name", ["Linear", "Conv2d", "Int4Linear"])
def test_layers_refuse_script_directly_and_inside_a_model(name):
    layer = _layers()[name]
    with pytest.raises(RuntimeError, match=_refusal(type(layer))):
        torch.jit.script(layer)

    class Parent(nn.Module):  # a model of the user's, the layer held under a nested Sequential
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Identity(), layer)

        def forward(self, x):
            return self.body(x)

    with pytest.raises(RuntimeError, match=_refusal(type(layer))):
        torch.jit.script(Parent())


def test_a_parametrized_layer_is_named_by_its_own_class():
    linear = nn.utils.parametrizations.weight_norm(nn.Linear(8, 4))
    layer = tnn.Linear.from_linear(linear)
    assert type(layer) is not tnn.Linear  # (torch's parametrized subclass)
    with pytest.raises(RuntimeError, match=_refusal(tnn.Linear)):
        torch.jit.script(nn.Sequential(layer))


def _assert_traced_is_eager(module, example: tuple, fresh: tuple, device):
    with torch.no_grad():
        module(*example)  # an eager call first: what it keeps (replays, folds) must not become the trace's constants
        traced = torch.jit.trace(module, example, check_trace=False)
        tol = {} if device == "cpu" else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(traced(*fresh), module(*fresh), **tol)
    return traced


@pytest.mark.parametrize("name", ["Linear", "Conv2d", "Int4Linear"])
def test_trace_gives_the_eager_output(name, device):
    layer = _layers()[name].to(device)
    shape = {"Linear": (3, 8), "Conv2d": (1, 2, 5, 5), "Int4Linear": (3, 32)}[name]
    dtype = torch.float16 if name == "Int4Linear" else torch.float32
    x, x2 = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
    _assert_traced_is_eager(layer, (x,), (x2,), device)


def test_trace_of_folded_batch_norms_reads_the_statistics_at_each_call(device):
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model = tnn.convert_(model, fold_batchnorm=True).to(device).eval()
    assert model.tilegemm_folded
    x, x2 = (torch.randn(1, 2, 5, 5, device=device) for _ in range(2))
    traced = _assert_traced_is_eager(model, (x,), (x2,), device)
    with torch.no_grad():
        model[1].running_mean.add_(1.0)  # the traced module shares the buffers: it must fold the new statistics
        torch.testing.assert_close(traced(x2), model(x2), **({} if device == "cpu" else dict(rtol=2e-3, atol=2e-3)))


def test_trace_of_stacked_experts_follows_the_routing_of_each_call(device):
    experts = StackedExperts(torch.randn(3, 8, 4), torch.randn(3, 4, 4), nn.SiLU(), is_transposed=False).to(device)

    def inputs(chosen):
        return (torch.randn(4, 4, device=device), torch.tensor(chosen, device=device).reshape(4, 1),
                torch.rand(4, 1, device=device))

    _assert_traced_is_eager(experts, inputs([0, 0, 1, 1]), inputs([2, 2, 2, 0]), device)
