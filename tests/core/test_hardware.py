"""The device queries the configs are built from: shared memory a block may take."""
import types

import pytest
import torch

from tilegemm.core import hardware


@pytest.mark.parametrize("reported, cc, hip, expected", [
    (232448, (9, 0), None, 232448),  # torch reports the opt-in limit: taken as it is
    (0, (8, 9), None, 99 * 1024),  # a torch that does not: by compute capability (RTX 4090, L40S)
    (0, (8, 0), None, 163 * 1024),  # A100
    (0, (7, 5), None, 64 * 1024),  # T4
    (0, (12, 1), None, 64 * 1024),  # unknown: the least of the known
    (0, (9, 0), "6.4", 64 * 1024),  # ROCm: its capability is not NVIDIA's
])
def test_shared_memory_a_block_may_take(monkeypatch, reported, cc, hip, expected):
    props = types.SimpleNamespace(major=cc[0], minor=cc[1])
    if reported:
        props.shared_memory_per_block_optin = reported
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    monkeypatch.setattr(hardware, "_smem_per_block", {})
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or props)
    assert hardware.smem_per_block(torch.device("cuda", 3)) == expected
    assert hardware.smem_per_block(torch.device("cuda", 3)) == expected
    assert asked == [3]  # cached per device index: asked once


def test_shared_memory_off_cuda_is_hoppers():
    # under the interpreter or for CPU tensors the GPU's configs are built as for sm_90
    assert hardware.smem_per_block(torch.device("cpu")) == hardware.HOPPER_SMEM_PER_BLOCK


def test_pipeline_fits_counts_the_buffered_stages(monkeypatch):
    # before Hopper Triton buffers stages - 1 steps; on Hopper a wgmma tile buffers all of them
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (99 * 1024, 8))
    assert not hardware.pipeline_fits(16, 128, 128, 2, 4, "cuda")  # 3 x 36 KB = 108 KB
    assert hardware.pipeline_fits(16, 64, 256, 2, 3, "cuda")  # 2 x 40 KB
    assert hardware.pipeline_fits(128, 128, 64, 2, 4, "cuda")  # 3 x 32 KB = 96 KB
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (227 * 1024, 9))
    assert hardware.pipeline_fits(64, 64, 128, 2, 6, "cuda")  # 6 x 32 KB = 192 KB
    assert not hardware.pipeline_fits(64, 128, 128, 2, 5, "cuda")  # 5 x 48 KB = 240 KB
