"""The conv2d bench adapter: the CLI runs it under the interpreter; forward and backward modes check out, in
both memory formats."""

from __future__ import annotations

import pytest

from tilegemm.bench.base import BenchError, bench_op
from tilegemm.bench.runner import run_bench
from tilegemm.cli import main
from tilegemm.ops.conv2d.bench import mobilenet_v2_layers, resnet50_layers


@pytest.fixture
def untimed(monkeypatch):
    """Under the interpreter a timed call repeats the check's call of the same kernel on the same inputs (no replays
    there), so the rows' times are made up instead: every kernel still runs and is checked once. The timing loop
    itself is tests/bench's (test_bench_cli.py)."""
    from tilegemm.bench import runner
    from tilegemm.core.runtime import interpreting

    if interpreting():
        monkeypatch.setattr(runner, "time_samples", lambda fn, warmup_ms, rep_ms, cuda_graph: [1.0])


def test_cli_bench_conv2d_runs(untimed):
    assert main(["bench", "--op", "conv2d", "--quiet", "--no-save"]) == 0


@pytest.mark.parametrize("memory_format", ["channels_last", "nchw"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "dgrad", "wgrad"])
def test_modes_check_out(mode, memory_format, monkeypatch, untimed):
    from tilegemm.ops.conv2d import bench as conv_bench

    op = bench_op("conv2d")
    cases = [op.parse_shape("2,8,7,7,8,3,3,2,1"), op.parse_shape("1,8,6,6,8,3,3,1,1,8")]
    seen = []  # the layouts the baseline was handed
    baseline = conv_bench.Conv2dBench.baseline
    monkeypatch.setattr(conv_bench.Conv2dBench, "baseline", lambda self, inputs, dtype:
                        seen.append(inputs["x"].stride(1) == 1) or baseline(self, inputs, dtype))
    result = run_bench(op, cases, "fp16", ["implicit_gemm", "auto"], rep_ms=1.0, warmup_ms=0.0,
                       options=dict(mode=mode, memory_format=memory_format))
    assert result.meta["memory_format"] == memory_format
    assert seen and set(seen) == {memory_format == "channels_last"}  # C = 8 channels: the two layouts differ
    rows = {(r.shape, r.kernel): r for r in result.rows}
    for case in cases:
        assert rows[(case.label, "auto")].status == "ok", rows[(case.label, "auto")].message
        # the backward has no kernel choice: only auto runs
        assert rows[(case.label, "implicit_gemm")].status == ("ok" if mode == "fwd" else "unavailable")
    flops = op.work(cases[0], "fp16", dict(mode=mode))
    assert flops == 2.0 * 2 * 4 * 4 * 8 * 8 * 9 * (2 if mode == "bwd" else 1)


def test_one_gradient_modes_time_that_gradient_alone(device):
    """--mode dgrad / wgrad: tilegemm's result and the baseline's hold that gradient only (the check compares
    them with the float64 reference of that gradient), and together they are bwd's."""
    op = bench_op("conv2d")
    case = op.parse_shape("2,8,7,7,16,3,3,2,1")
    parts = {}
    for mode in ("dgrad", "wgrad", "bwd"):
        inputs = op.precompile_inputs(case, "fp32", device, dict(mode=mode))
        ours, base = op.run("auto", inputs, "fp32"), op.baseline(inputs, "fp32")
        assert ours.shape == base.shape
        parts[mode] = ours.numel()
    assert parts["dgrad"] == 2 * 8 * 7 * 7 and parts["wgrad"] == 16 * 8 * 9
    assert parts["bwd"] == parts["dgrad"] + parts["wgrad"]


def test_sweeps_hold_the_real_layers():
    op = bench_op("conv2d")
    # ResNet-50: 53 convolutions, 23 distinct ones; the stem is 7x7/2 over 3 channels
    assert len(resnet50_layers()) == 53
    resnet = op.cases("resnet50")
    assert len(resnet) == 23 and resnet[0].dims == dict(N=32, C=3, H=224, W=224, K=64, R=7, S=7, stride=2, pad=3,
                                                         groups=1)
    # MobileNetV2: 17 depthwise convolutions, each 3x3 over all of its channels
    depthwise = [layer for layer in mobilenet_v2_layers() if layer[5] > 1]
    assert len(depthwise) == 17 and all(layer[0] == layer[2] == layer[5] and layer[3] == 3 for layer in depthwise)
    assert all(c.dims["N"] == 64 for c in op.cases("mobilenet"))


def test_odd_sweep_holds_layers_the_padded_route_takes():
    from tilegemm.ops.conv2d.dispatch import choose_kernel, pads_channels
    from tilegemm.ops.conv2d.problem import Geometry

    cases = bench_op("conv2d").cases("odd")
    assert 8 <= len(cases) <= 12 and len({c.label for c in cases}) == len(cases)
    routes = []
    for c in cases:
        d = c.dims
        assert d["N"] == 32 and (d["C"] // d["groups"]) % 16  # every layer's channels a group need padding
        g = Geometry(32, d["C"], d["H"], d["W"], d["K"], d["R"], d["S"], d["groups"], (d["stride"],) * 2,
                     (d["pad"],) * 4, (1, 1))
        assert pads_channels(g)
        routes.append((d["groups"] > 1, choose_kernel(g, True, tma=True)))
    # grouped layers (groups of 24 and 48) take grouped_packed, the others the padded TMA route, the 1x1 a GEMM
    assert all(r == "grouped_packed" for grouped, r in routes if grouped) and any(grouped for grouped, _ in routes)
    plain = [r for grouped, r in routes if not grouped]
    assert plain.count("tma_implicit_gemm") == len(plain) - 1 and plain.count("gemm_1x1") == 1


@pytest.mark.parametrize("text", ["1,2,3", "2,8,7,7,8,3,3,1,1,3", "2,8,2,2,8,5,5", "a,b,c,d,e,f,g"])
def test_bad_shapes(text):
    with pytest.raises(BenchError, match="malformed conv2d shape"):
        bench_op("conv2d").parse_shape(text)


def test_bad_mode():
    with pytest.raises(BenchError, match="--mode must be one of fwd, bwd, dgrad, wgrad"):
        bench_op("conv2d").check_options(dict(mode="both"), "fp16")
    with pytest.raises(BenchError, match="--memory-format must be channels_last or nchw"):
        bench_op("conv2d").check_options(dict(memory_format="nhwc"), "fp16")
    with pytest.raises(BenchError, match="--memory-format does not apply to --op matmul"):
        bench_op("matmul").check_options(dict(memory_format="nchw"), "fp16")


def test_cli_bench_conv2d_nchw_runs(tmp_path, untimed):
    import json

    out = tmp_path / "nchw.json"
    # a small dense 3x3 case (the full sweep runs above; test_modes_check_out runs NCHW's grouped case)
    assert main(["bench", "--op", "conv2d", "--quiet", "--no-save", "--memory-format", "nchw", "--json", str(out),
                 "--shape", "1,8,5,5,8,3,3,1,1"]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["memory_format"] == "nchw"
    assert [r["status"] for r in data["rows"] if r["kernel"] == "auto"] == ["ok"]
