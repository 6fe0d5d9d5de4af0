"""The ``zoo`` sweep's data file (every distinct convolution of torchvision's classification models) and its
bench cases: the file is consistent on its own, and where torchvision imports, a few models' layers read again
from the models themselves are the file's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tilegemm.ops.conv2d import zoo
from tilegemm.ops.conv2d.problem import geometry_of

TOOL = Path(__file__).resolve().parents[2] / "tools" / "conv2d_zoo_layers.py"
FAMILIES = ("resnet", "resnext", "wide_resnet", "regnet", "convnext", "efficientnet", "efficientnet_v2",
            "mobilenet_v2", "mobilenet_v3", "mnasnet", "shufflenet", "squeezenet", "densenet", "googlenet",
            "inception", "vgg", "alexnet", "vit", "swin", "maxvit")


def _tool():
    spec = importlib.util.spec_from_file_location("conv2d_zoo_layers", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchvision_works() -> bool:
    try:
        import torchvision.models  # noqa: F401
    except Exception:  # not installed, or a build whose C ops do not load in this torch
        return False
    return True


def test_file_is_sorted_distinct_and_valid():
    content = zoo.load()
    assert content["schema"] == zoo.SCHEMA
    layers = content["layers"]
    assert len(layers) > 1000
    keys = [tuple(tuple(v) if isinstance(v, list) else v for v in (layer[f] for f in zoo.FIELDS)) for layer in layers]
    assert keys == sorted(keys), "layers must be sorted by their fields"
    assert len(set(keys)) == len(keys), "layers must be distinct"
    sizes = content["image_sizes"]
    for layer in layers:
        assert set(layer) == set(zoo.FIELDS) | {"models"}
        for f in ("C", "K", "H", "W", "R", "S", "groups"):
            assert isinstance(layer[f], int) and layer[f] >= 1, (f, layer)
        for f in ("stride", "dilation"):
            assert len(layer[f]) == 2 and min(layer[f]) >= 1, (f, layer)
        assert len(layer["padding"]) == 2 and min(layer["padding"]) >= 0
        assert layer["C"] % layer["groups"] == 0 and layer["K"] % layer["groups"] == 0
        assert layer["padding_mode"] in ("zeros", "reflect", "replicate", "circular")
        assert isinstance(layer["bias"], bool)
        assert layer["models"] and layer["models"] == sorted(set(layer["models"]))
        assert set(layer["models"]) <= set(sizes), layer["models"]
        g = geometry_of((1, layer["C"], layer["H"], layer["W"]), (layer["K"], layer["C"] // layer["groups"],
                        layer["R"], layer["S"]), layer["stride"], [layer["padding"][0]] * 2 + [layer["padding"][1]] * 2,
                        layer["dilation"], layer["groups"])
        assert g.P >= 1 and g.Q >= 1, layer


def test_file_covers_the_families_named():
    sizes = zoo.load()["image_sizes"]
    for family in FAMILIES:
        assert any(name.startswith(family) for name in sizes), family
    assert sizes["resnet50"] == 224 and sizes["inception_v3"] == 299  # each model at its weights' size
    layers = zoo.load()["layers"]
    # the cliff of the issue: ResNeXt-50's 3x3 with 4 channels a group
    assert any(lay["C"] == 128 and lay["groups"] == 32 and lay["H"] == 56 and "resnext50_32x4d" in lay["models"]
               for lay in layers)
    # the patch embeddings of the vision transformers
    assert any(lay["R"] == 16 and lay["stride"] == [16, 16] and "vit_b_16" in lay["models"] for lay in layers)
    assert any(lay["R"] == 4 and lay["stride"] == [4, 4] and "swin_t" in lay["models"] for lay in layers)


def test_sweep_parts_split_the_whole():
    from tilegemm.bench.base import BenchError, bench_op

    op = bench_op("conv2d")
    whole = op.cases("zoo")
    assert len(whole) == len(zoo.bench_layers())
    labels = [c.label for c in whole]
    assert len(set(labels)) == len(labels), "a label names one convolution"
    parts = [op.cases(f"zoo:{i}/4") for i in range(4)]
    assert sorted(c.label for p in parts for c in p) == sorted(labels)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    for bad in ("zoo:4/4", "zoo:1", "zoo:a/b", "zoo:-1/2"):
        with pytest.raises(BenchError, match="zoo:I/N"):
            op.cases(bad)


def test_sweep_kinds_split_the_whole():
    from tilegemm.bench.base import BenchError, bench_op

    op = bench_op("conv2d")
    labels = sorted(c.label for c in op.cases("zoo"))
    by_kind = {k: op.cases(f"zoo:{k}") for k in zoo.KINDS}
    assert sorted(c.label for cases in by_kind.values() for c in cases) == labels  # each layer in one kind
    assert all(by_kind.values())
    stems = [c.dims for c in by_kind["stem"]]
    assert all(d["C"] <= 8 and d["groups"] == 1 and d["R"] * d["S"] > 1 for d in stems)
    assert {"3->64 7x7"} <= {f"{d['C']}->{d['K']} {d['R']}x{d['S']}" for d in stems}  # ResNet's
    assert all(d["groups"] == d["C"] for d in (c.dims for c in by_kind["depthwise"]))
    assert all(d["R"] == d["S"] == 1 and d["groups"] == 1 for d in (c.dims for c in by_kind["pointwise"]))
    halves = [op.cases(f"zoo:depthwise:{i}/2") for i in range(2)]
    assert sorted(c.label for h in halves for c in h) == sorted(c.label for c in by_kind["depthwise"])
    for bad in ("zoo:stems", "zoo:stem:2/2", "zoo:Stem:0/1"):
        with pytest.raises(BenchError, match="malformed sweep"):
            op.cases(bad)
    with pytest.raises(BenchError, match="unknown kind 'conv'; the kinds: stem, depthwise"):
        op.cases("zoo:conv:0/2")


def test_cases_carry_the_layer_geometry():
    from tilegemm.bench.base import bench_op
    from tilegemm.ops.conv2d.bench import _out_size

    op = bench_op("conv2d")
    cases = op.cases("zoo")
    rect = [c for c in cases if c.dims["R"] != c.dims["S"]]
    assert rect, "Inception's 1x7 and 7x1 layers"
    for case in rect[:5] + cases[:50]:
        d = case.dims
        conv = op._conv(d)
        g = geometry_of((d["N"], d["C"], d["H"], d["W"]), (d["K"], d["C"] // d["groups"], d["R"], d["S"]),
                        conv["stride"], [conv["padding"][0]] * 2 + [conv["padding"][1]] * 2, conv["dilation"],
                        d["groups"])
        assert _out_size(d) == (g.P, g.Q)
        assert d["N"] == 32 and d["models"]
        assert op.work(case, "fp16", {"mode": "fwd"}) == g.flops()


def test_bench_layers_merge_bias_variants():
    layers = zoo.bench_layers()
    assert len({zoo.geometry_key(lay) for lay in layers}) == len(layers)
    models = {m for lay in zoo.load()["layers"] for m in lay["models"]}
    assert models == {m for lay in layers for m in lay["models"]}


@pytest.mark.skipif(not _torchvision_works(), reason="torchvision does not import here: the file's own checks "
                    "above still run")
@pytest.mark.parametrize("name", ["resnext50_32x4d", "inception_v3", "vit_b_16"])
def test_tool_reproduces_the_models_layers(name):
    tool = _tool()
    found = tool.layers_of(name)
    assert tool.image_size(name) == zoo.load()["image_sizes"][name]
    want = {tool.key(lay) for lay in zoo.load()["layers"] if name in lay["models"]}
    assert {tool.key(lay) for lay in found} == want


def test_tool_writes_what_the_file_holds():
    # the writer's format round-trips the committed file (regenerating it needs torchvision: tools/ docstring)
    tool = _tool()
    text = Path(zoo.resources.files("tilegemm.ops.conv2d").joinpath("zoo.json")).read_text()
    assert tool.dumps(json.loads(text)) == text


def test_model_entry_training_step_under_the_interpreter(tmp_path, monkeypatch):
    # --op conv2d --model NAME for a torchvision model: the tiny sweep's small ResNeXt (a grouped 3x3 of 2
    # channels a group, on grouped_direct) runs one training step; its gradients checked against fp64's
    from tilegemm.bench import runner
    from tilegemm.bench.runner import BASELINE
    from tilegemm.cli import main
    from tilegemm.core.runtime import interpreting
    from tilegemm.models.bench import TorchvisionBench

    if not interpreting():
        pytest.skip("the GPU runs the full-size models (tools/gpu_cycle.sh zoo-models)")
    # 8x8 images, not 16x16: the same layers and kernels (the grouped 3x3 on 4x4 pixels), a quarter of the
    # pixels for the interpreter to run
    monkeypatch.setattr(TorchvisionBench, "TINY_IMAGE", 8)
    # a timed call would repeat each row's checked step on the same inputs: the times are made up instead (the
    # timing loop is tests/bench's)
    monkeypatch.setattr(runner, "time_samples", lambda fn, warmup_ms, rep_ms, cuda_graph: [1.0])
    path = tmp_path / "r.json"
    assert main(["bench", "--op", "conv2d", "--model", "resnext50_32x4d", "--shape", "2,train", "--quiet",
                 "--no-save", "--json", str(path), "--kernels", "auto,fold"]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["op"] == "conv2d:resnext50_32x4d" and data["meta"]["model"] == "resnext50_32x4d"
    rows = data["rows"]
    assert {r["dims"]["image"] for r in rows} == {8}
    # row fold: batch norms folded for eval mode, so a training step is torch's (the batch's statistics)
    assert [(r["shape"], r["kernel"]) for r in rows] == [("b2 train", BASELINE), ("b2 train", "auto"),
                                                         ("b2 train", "fold")]
    for r in rows:
        assert r["status"] == "ok" and r["rel_err"] <= r["tolerance"] == 1e-3, r  # fp32 (the CPU's default)


def test_model_entry_refuses_clearly():
    from tilegemm.bench.base import BenchError, bench_op
    from tilegemm.core.runtime import interpreting

    op = bench_op("conv2d")
    with pytest.raises(BenchError, match="choose resnet50 or a torchvision classification model: alexnet"):
        op.model_bench("resnext50")
    bench = op.model_bench("inception_v3")
    assert bench.name == "conv2d:inception_v3" and bench.GPU_IMAGE == 299
    if interpreting() or not _torchvision_works():
        want = "need torchvision|needs a CUDA GPU|does not import"
        with pytest.raises(BenchError, match=want):
            bench.cases("images")
    assert op.model_bench("resnet50").name == "conv2d:resnet50"  # its own entry, as before


def test_model_entry_bound_widens_to_twice_cudnns_error_only_where_finite():
    # a case whose cuDNN result overflowed (relative_error: inf) keeps the table's bound: inf would pass anything
    from tilegemm.bench.base import bench_op

    bench = bench_op("conv2d").model_bench("resnext50_32x4d")
    for train, table in ((False, bench.INFERENCE_TOLERANCE), (True, bench.TRAIN_TOLERANCE)):
        bench._train = train
        bench._cudnn_err = 0.0
        assert bench.tolerance("fp16") == table["fp16"]
        bench._cudnn_err = table["fp16"]  # cuDNN's own error above half the bound: twice it
        assert bench.tolerance("fp16") == 2 * table["fp16"]
        bench._cudnn_err = float("inf")
        assert bench.tolerance("fp16") == table["fp16"]


def test_batch_norm_calibration_is_seeded_and_leaves_each_module_in_its_mode():
    # dropout ahead of a batch norm drew on the global generator: statistics (and results) changed run to run
    from tilegemm.models.torchvision_models import calibrate_batch_norms

    def calibrated(global_seed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Dropout(0.5), torch.nn.BatchNorm2d(4))
        model.train()
        model[1].eval()  # a mixed mode (as the bench's training step leaves a model): kept
        torch.manual_seed(global_seed)
        calibrate_batch_norms(model, 8, batches=2, batch=2)
        assert [m.training for m in model] == [True, False, True] and model.training
        return model[2].running_mean.clone(), model[2].running_var.clone()

    (mean, var), (mean2, var2) = calibrated(1), calibrated(2)
    assert mean.abs().sum() > 0 and not torch.equal(var, torch.ones(4))  # set from the batches
    assert torch.equal(mean, mean2) and torch.equal(var, var2)


def test_model_entry_case_survives_a_failing_baseline(monkeypatch):
    # cuDNN's model failing where prepare() measures its error (a torch.compile error, memory) leaves the table's
    # bound: the runner's check reports it in the baseline's row and tilegemm's rows run, as before that measure
    from tilegemm.bench.base import bench_op

    bench = bench_op("conv2d").model_bench("resnext50_32x4d")
    case = next(c for c in bench.cases("tiny") if c.dims["mode"] == "eager")

    def failing(inputs, dtype):
        raise RuntimeError("the baseline failed")

    monkeypatch.setattr(bench, "baseline", failing)
    bench._cudnn_err = 1.0  # a previous case's
    prepared = bench.prepare(case, "fp32", "cpu", 1, {})
    assert prepared.sets and bench.tolerance("fp32") == bench.INFERENCE_TOLERANCE["fp32"]
