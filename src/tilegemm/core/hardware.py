"""What machine this is, and what it can do: GPU, peak rates, software versions, git commit (``bench``, ``info``);
the questions kernels ask before they run (:func:`why_not_tma`, :func:`why_not_gluon`, :func:`sm_count`,
:func:`compute_capability`). Importing it imports neither torch's CUDA nor triton."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tilegemm.core.runtime import interpreting

# Dense (no sparsity) vendor datasheet peaks: TFLOPS per dtype and memory bandwidth in TB/s.
# fp16/bf16/fp8 rates are with fp32 accumulation; "fp32" is plain CUDA-core fp32.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"H200", dict(fp16=989.4, bf16=989.4, tf32=494.7, fp32=66.9, fp8_e4m3=1978.9, fp8_e5m2=1978.9, tbps=4.8)),
    (r"H100.*NVL", dict(fp16=835.0, bf16=835.0, tf32=417.5, fp32=60.0, fp8_e4m3=1670.5, fp8_e5m2=1670.5, tbps=3.9)),
    (r"H100.*PCIe", dict(fp16=756.5, bf16=756.5, tf32=378.0, fp32=51.2, fp8_e4m3=1513.0, fp8_e5m2=1513.0, tbps=2.0)),
    (r"H100|H800", dict(fp16=989.4, bf16=989.4, tf32=494.7, fp32=66.9, fp8_e4m3=1978.9, fp8_e5m2=1978.9, tbps=3.35)),
    (r"A100.*80GB.*PCIe", dict(fp16=312.0, bf16=312.0, tf32=156.0, fp32=19.5, tbps=1.935)),
    (r"A100.*80GB", dict(fp16=312.0, bf16=312.0, tf32=156.0, fp32=19.5, tbps=2.039)),
    (r"A100", dict(fp16=312.0, bf16=312.0, tf32=156.0, fp32=19.5, tbps=1.555)),
    (r"\bL4\b", dict(fp16=121.0, bf16=121.0, tf32=60.0, fp32=30.3, fp8_e4m3=242.5, fp8_e5m2=242.5, tbps=0.3)),
    (r"RTX 4090", dict(fp16=165.2, bf16=165.2, tf32=82.6, fp32=82.6, fp8_e4m3=330.3, fp8_e5m2=330.3, tbps=1.008)),
]


# Shared memory one block may use on Hopper (sm_90): 227 KB of the SM's 228.
HOPPER_SMEM_PER_BLOCK = 227 * 1024


def ring_fits(bm: int, bn: int, bk: int, stages: int, out_bytes: int) -> bool:
    """Whether a ring of ``stages`` 16-bit operand slots (``[bm, bk]`` and ``[bn, bk]`` each) fits in a Hopper
    block's shared memory beside ``out_bytes`` of output buffer and 1 KB for the barriers."""
    return stages * (bm + bn) * bk * 2 + out_bytes + 1024 <= HOPPER_SMEM_PER_BLOCK


def peaks_for(gpu_name: str | None) -> dict[str, float]:
    """Datasheet peaks for a GPU name as torch reports it; empty when the GPU is not in the table."""
    if not gpu_name:
        return {}
    for pattern, peaks in _PEAKS:
        if re.search(pattern, gpu_name):
            return dict(peaks)
    return {}


def peak_tflops(gpu_name: str | None, dtype_key: str) -> float | None:
    return peaks_for(gpu_name).get(dtype_key)


def peak_gbps(gpu_name: str | None) -> float | None:
    tbps = peaks_for(gpu_name).get("tbps")
    return tbps * 1000.0 if tbps else None


@dataclass
class MachineInfo:
    backend: str
    interpreter: bool
    gpu: str | None = None
    sm_count: int | None = None
    l2_bytes: int | None = None
    memory_bytes: int | None = None
    compute_capability: str | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str = ""
    triton: str = ""
    numpy: str = ""
    python: str = field(default_factory=platform.python_version)
    tilegemm: str = ""
    git_commit: str | None = None
    timestamp: str = ""
    peaks: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def git_commit() -> str | None:
    """The commit of the tilegemm checkout (``TILEGEMM_GIT_COMMIT`` wins: copies of a tree lack .git)."""
    if os.environ.get("TILEGEMM_GIT_COMMIT"):
        return os.environ["TILEGEMM_GIT_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def machine_info() -> MachineInfo:
    import numpy
    import torch
    import triton

    from tilegemm.core import __version__

    interp = interpreting()
    info = MachineInfo(
        backend="Triton interpreter (CPU)" if interp else "CUDA",
        interpreter=interp,
        torch=torch.__version__,
        triton=triton.__version__,
        numpy=numpy.__version__,
        tilegemm=__version__,
        git_commit=git_commit(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        cuda=torch.version.cuda,
    )
    if not interp and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.gpu = props.name
        info.sm_count = props.multi_processor_count
        info.l2_bytes = getattr(props, "L2_cache_size", None)
        info.memory_bytes = props.total_memory
        info.compute_capability = f"{props.major}.{props.minor}"
        info.driver = _driver_version()
        info.peaks = peaks_for(props.name)
    return info


def host_memory_available() -> int | None:
    """Bytes of host memory free for a new allocation without swapping (Linux's MemAvailable; else the free
    physical pages), or None where neither can be read. Under the interpreter every tensor lives there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


_sm_counts: dict = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (cached); 4 under the interpreter, so grids stay small there."""
    if interpreting() or getattr(device, "type", "cuda") != "cuda":
        return 4
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _sm_counts.get(index)
    if n is None:
        n = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_smem_per_block: dict = {}
# Shared memory a block may opt into by compute capability, where torch's device properties do not say (CUDA's
# cudaDevAttrMaxSharedMemoryPerBlockOptin; docs/rungs/split_k.md); other NVIDIA GPUs take the smallest of these
_SMEM_OPTIN_BY_CC = {(7, 0): 96 * 1024, (7, 2): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
                     (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): HOPPER_SMEM_PER_BLOCK}
_SMEM_ROCM = 64 * 1024  # an AMD GPU's LDS a workgroup (its reported capability is not NVIDIA's)


def smem_per_block(device) -> int:
    """Bytes of shared memory one block may take on a CUDA device (the opt-in limit Triton checks a launch
    against; cached per device); Hopper's under the interpreter or off CUDA, where the GPU's configs are built for
    sm_90."""
    return _smem_of(device)[0]


def _smem_of(device) -> tuple[int, int]:
    """(:func:`smem_per_block`, compute capability major) of ``device``."""
    if interpreting() or getattr(device, "type", "cuda") != "cuda":
        return HOPPER_SMEM_PER_BLOCK, 9
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    known = _smem_per_block.get(index)
    if known is None:
        props = torch.cuda.get_device_properties(index)
        n = getattr(props, "shared_memory_per_block_optin", 0)
        if not n:
            n = _SMEM_ROCM if getattr(torch.version, "hip", None) else \
                _SMEM_OPTIN_BY_CC.get((props.major, props.minor), 64 * 1024)
        known = _smem_per_block[index] = (n, props.major)
    return known


def pipeline_fits(bm: int, bn: int, bk: int, elem: int, stages: int, device) -> bool:
    """Whether a ``tl.dot`` kernel's software pipeline of ``[bm, bk]`` and ``[bn, bk]`` tiles of ``elem``-byte
    elements fits in a block's shared memory on ``device``: Triton buffers ``stages - 1`` steps before Hopper and,
    for wgmma tiles, all ``stages`` on it (counted so there for every tile)."""
    limit, major = _smem_of(device)
    return (bm + bn) * bk * elem * (stages if major >= 9 else max(stages - 1, 1)) <= limit


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the current GPU, or None under the interpreter or without one."""
    if interpreting():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def tma_aligned(t, *strides: int) -> bool:
    """Whether TMA can describe ``t`` with these strides (elements): a 16-byte aligned base and 16-byte strides."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in strides)


def why_not_tma() -> str | None:
    """None where TMA kernels can run (a Hopper or newer GPU, or the interpreter); otherwise why not."""
    if interpreting():
        return None
    cc = compute_capability()
    if cc is None or cc[0] < 9:
        return "needs a Hopper (sm_90) or newer GPU for TMA"
    return None


def why_not_gluon() -> str | None:
    """None where the Gluon kernels can run: an sm_90 GPU under Triton 3.6 (Gluon has no interpreter)."""
    if interpreting():
        return "Gluon kernels have no interpreter: they need an sm_90 GPU"
    if compute_capability() != (9, 0):
        return "needs an sm_90 (Hopper) GPU: the Gluon kernels are written for it"
    import triton  # here, not at the top: importing tilegemm imports no triton

    if not triton.__version__.startswith("3.6."):
        return f"written against Triton 3.6's Gluon API, found Triton {triton.__version__}"
    return None
