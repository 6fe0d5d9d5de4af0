"""The conv2d kernels' loads, compiled for sm_90 without a GPU: 16-byte loads, no 2-byte ones.

Sizes are not specialized on (a new image size compiles nothing), so the kernels must say what the host
knows of them (DIV_C / DIV_K / DIV, masks written as ``offs // DIV < bound // DIV``, group offsets with
``tl.multiple_of``); without that every load of a ResNet-50 3x3 layer was a 2-byte ``ld.global.b16`` with no
``cp.async`` pipelining, and the depthwise kernel's too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SM90, compile_offline

SCRIPT = SM90 + (Path(__file__).parent / "_load_widths.py").read_text()


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return compile_offline(tmp_path_factory.mktemp("conv2d-ptx"), SCRIPT, [], timeout=600)


@pytest.mark.parametrize("kernel", ["fwd", "dgrad", "dgrad_phased", "wgrad"])
def test_implicit_gemm_kernels_load_16_bytes_at_a_time(counts, kernel):
    ops = counts[kernel]
    assert ops.get("cp.async.cg.shared.global", 0) > 0, f"{kernel}: no 16-byte cp.async: {ops}"
    assert not any(op.startswith("ld.global.b16") for op in ops), f"{kernel}: 2-byte loads: {ops}"
    assert any(op.startswith("wgmma") for op in ops), f"{kernel}: no wgmma: {ops}"


@pytest.mark.parametrize("kernel", ["fwd", "dgrad", "dgrad_phased"])
def test_implicit_gemm_outputs_store_16_bytes_at_a_time(counts, kernel):
    # the channel masks of the epilogue must say what the host knows of the (unspecialized) channel counts:
    # written as offs < Cg, every fp16 output element was its own 2-byte st.global.b16 (the strided data
    # gradient ran 4-5x slower than its loads and MMAs allow)
    ops = counts[kernel]
    assert not any(op.startswith("st.global.b16") for op in ops), f"{kernel}: 2-byte stores: {ops}"
    assert any(op.startswith("st.global.v4") for op in ops), f"{kernel}: no 16-byte stores: {ops}"


@pytest.mark.parametrize("kernel", ["depthwise", "depthwise_88"])
def test_depthwise_loads_its_channels_16_bytes_at_a_time(counts, kernel):
    # 88 channels too: the pixel strides reach the kernel in units of 8 elements (a stride of 88 as a plain
    # integer made every load and store 2 bytes wide)
    ops = counts[kernel]
    assert not any(op.startswith("st.global.b16") for op in ops), f"2-byte stores: {ops}"
    assert ops.get("ld.global.v4.b32", 0) > 0, f"no 16-byte loads of the activations: {ops}"
    # the weight too: read tap-major, a tap's channels are consecutive (in [K, 1, R, S] order each channel's
    # weight was its own 2-byte load, more load instructions than the activations' and the forward's limit)
    assert not any(op.startswith("ld.global.b16") for op in ops), f"2-byte loads: {ops}"


@pytest.mark.parametrize("kernel", ["depthwise_rows", "depthwise_rows_pipelined"])
def test_depthwise_rows_load_and_store_each_threads_run_at_once(counts, kernel):
    # depthwise_rows_kernel: four elements a thread (8 bytes of fp16) per load and store in its loop; the only
    # 2-byte loads are the weights, once a program (R*S taps x 4 elements), gathered from [K, 1, R, S]
    ops = counts[kernel]
    vector = ops.get("ld.global.v2.b32", 0) + ops.get("cp.async.ca.shared.global", 0)
    assert vector > 0, f"{kernel}: no 8-byte loads of the activations: {ops}"
    assert ops.get("ld.global.b16", 0) <= 9 * 4, f"{kernel}: 2-byte loads beyond the weights: {ops}"
    assert any(op.startswith("st.global.v2") for op in ops), f"{kernel}: no 8-byte stores: {ops}"
    assert not any(op.startswith("st.global.b16") for op in ops), f"{kernel}: 2-byte stores: {ops}"
    if kernel.endswith("pipelined"):
        assert ops.get("cp.async.ca.shared.global", 0) > 0, f"{kernel}: not pipelined through cp.async: {ops}"


@pytest.mark.parametrize("kernel", ["strided_rows", "strided_tile"])
def test_strided_depthwise_rows_load_16_bytes_at_a_time(counts, kernel):
    # depthwise_strided_rows/tile_kernel at 88 channels, stride 2, 8 channels a thread: its loop's loads and
    # stores 16 bytes wide; the only 2-byte loads are the weights, once a program (9 taps x 8 channels)
    ops = counts[kernel]
    assert ops.get("ld.global.v4.b32", 0) > 0, f"{kernel}: no 16-byte loads of the activations: {ops}"
    assert ops.get("ld.global.b16", 0) <= 9 * 8, f"{kernel}: 2-byte loads beyond the weights: {ops}"
    assert any(op.startswith("st.global.v4") for op in ops), f"{kernel}: no 16-byte stores: {ops}"
    assert not any(op.startswith("st.global.b16") for op in ops), f"{kernel}: 2-byte stores: {ops}"
