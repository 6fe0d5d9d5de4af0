"""The device queries the configs are built from: shared memory a block may take."""
import types

import pytest
import torch

from tilegemm.core import hardware


@pytest.mark.parametrize("reported, cc, expected", [
    (232448, (9, 0), 232448),  # torch reports the opt-in limit: taken as it is
    (0, (8, 9), 99 * 1024),  # a torch that does not: by compute capability (RTX 4090, L40S)
    (0, (8, 0), 163 * 1024),  # A100
    (0, (7, 5), 48 * 1024),  # older GPUs: the limit without opt-in
])
def test_shared_memory_a_block_may_take(monkeypatch, reported, cc, expected):
    props = types.SimpleNamespace(major=cc[0], minor=cc[1])
    if reported:
        props.shared_memory_per_block_optin = reported
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    monkeypatch.setattr(hardware, "_smem_per_block", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert hardware.smem_per_block(torch.device("cuda", 3)) == expected
    props.major = 1  # cached per device index: asked once
    assert hardware.smem_per_block(torch.device("cuda", 3)) == expected


def test_shared_memory_off_cuda_is_hoppers():
    # under the interpreter or for CPU tensors the GPU's configs are built as for sm_90
    assert hardware.smem_per_block(torch.device("cpu")) == hardware.HOPPER_SMEM_PER_BLOCK


def test_pipeline_fits_counts_the_buffered_stages(monkeypatch):
    monkeypatch.setattr(hardware, "smem_per_block", lambda device: 99 * 1024)
    assert not hardware.pipeline_fits(16, 128, 128, 2, 4, "cuda")  # 3 x 36 KB = 108 KB
    assert hardware.pipeline_fits(16, 64, 256, 2, 3, "cuda")  # 2 x 40 KB
    assert hardware.pipeline_fits(128, 128, 64, 2, 4, "cuda")  # 3 x 32 KB = 96 KB
