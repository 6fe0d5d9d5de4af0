"""An untimed estimate of a pointer-kernel config's time on a problem, for shapes nothing was tuned near.

``auto`` picks a config without timing on the call path. Where a tuned shape class is near (the shipped
tables hold the sweeps' shapes), its config is taken (:func:`tilegemm.core.tuning.nearest`). Elsewhere a
neighbour's choice was made for another number of tiles: a 128x256 tile that fills the GPU at 4096^3 leaves
most SMs idle at 526x773, and no tuned neighbour splits K for such a product. There the configs of
``autotuned`` and ``split_k`` are ranked by this model instead (docs/rungs/auto.md, "Untimed choices"):

- **Waves.** ``programs = tiles x SPLIT_K`` run in ``ceil(programs / slots)`` waves, where ``slots`` is
  the SMs times the programs one SM holds (shared memory: the pipelined tiles).
- **A program** walks its K slice one step at a time; a step costs the slower of its MMA work at the
  tile's share of the SM's peak (:func:`mma_fraction`: small tiles use the tensor cores worse) and its
  operand bytes at the SM's share of L2 bandwidth, plus a fixed cost for the pipeline's fill and the
  epilogue. Programs that share an SM share its rates.
- **Rows not 16-byte aligned** are loaded without asynchronous copies, a step at a time into registers: a
  program then waits on each step's loads, and moves at most :data:`MISALIGNED_PROGRAM_GBPS` whatever else
  its SM runs (a rate per program, not per SM: several programs on an SM overlap their waits).
- **A K split** adds its planes' traffic: written by every slice, read back by the last-arriving program
  (one SM) or by a second launch spread over the GPU
  (:func:`tilegemm.ops.matmul.split_reduce.reduce_apart`).
- **A floor**: the operands and the output cross HBM at least once.

The constants are round numbers for an H100/H200-class GPU, scaled by the device's SMs, its vendor peak
rate for the dtype and its HBM bandwidth (:mod:`tilegemm.core.hardware`): what the model must get right is
the order of configs, not their times.
"""

from __future__ import annotations


import torch

from tilegemm.core import hardware
from tilegemm.core.runtime import cdiv
from tilegemm.ops.matmul.problem import rows_aligned
from tilegemm.ops.matmul.split_reduce import reduce_apart

# Fraction of the SM's vendor peak one program sustains by tile area (BLOCK_M x BLOCK_N), pointer kernels:
# from 128x256 (the tile that reaches about 650 TFLOPS of the H200's 989 at 4096^3) down to 16x64.
_MMA_FRACTION = ((32768, 0.66), (16384, 0.55), (8192, 0.42), (4096, 0.28), (2048, 0.17), (0, 0.08))
L2_PER_HBM = 2.2  # L2-to-SM bandwidth of the whole GPU, as a multiple of its HBM bandwidth
SM_GBPS = 110.0  # what one SM can pull from L2 when few SMs compete for it
LAST_ARRIVAL_GBPS = 12.0  # one program adding planes alone (184x168x14400: 33 planes of 64 KB in ~190 us)
PROGRAM_US = 1.0  # a program's fixed cost: the pipeline's fill and the epilogue
LAUNCH_US = 2.5  # a second launch (the split's reduction)
# What one program moves per step, at most, when its rows are not 16-byte aligned, by element size: such
# loads go a step at a time into registers, one element per load, so the program waits on them
# (latency-bound) and moves more where each load carries more bytes. Fitted on unseen misaligned products per
# dtype (docs/rungs/auto.md). The 1-byte rate (fp8, which is never padded: it only ranks the direct kernels'
# configs) is half the 16-bit one, not measured. The keys
# are the element sizes the op takes (its checks refuse others).
MISALIGNED_PROGRAM_GBPS = {1: 2.0, 2: 4.0, 4: 11.0}
SMEM_BYTES = 227 * 1024


def mma_fraction(bm: int, bn: int) -> float:
    area = bm * bn
    return next(f for a, f in _MMA_FRACTION if area >= a)


def estimate_us(M: int, N: int, K: int, batch: int, elem: int, out_elem: int, cfg: dict, *, sms: int,
                peak_tflops: float, hbm_gbps: float, aligned: bool = True) -> float:
    """Estimated microseconds of ``cfg`` (a grouped or split_k config) on an ``M x N x K`` product."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    split = cfg.get("SPLIT_K", 1)
    tiles = cdiv(M, bm) * cdiv(N, bn) * batch
    programs = tiles * split
    smem = (bm + bn) * bk * elem * max(cfg.get("num_stages", 3) - 1, 1)
    per_sm = max(1, min(4, SMEM_BYTES // max(smem, 1)))
    slots = sms * per_sm
    sharing = min(per_sm, cdiv(programs, sms))  # programs that run side by side on one SM
    active = min(programs, sms)
    steps = cdiv(cdiv(K, bk), split)
    mma_us = 2.0 * bm * bn * bk / (peak_tflops * 1e6 / sms * mma_fraction(bm, bn))
    sm_gbps = min(SM_GBPS, L2_PER_HBM * hbm_gbps / active)
    step_bytes = (bm + bn) * bk * elem
    step_us = max(mma_us, step_bytes / (sm_gbps * 1e3)) * sharing
    if not aligned:
        step_us = max(step_us, step_bytes / (MISALIGNED_PROGRAM_GBPS[elem] * 1e3))
    program_us = steps * step_us + PROGRAM_US
    total = cdiv(programs, slots) * program_us
    if split > 1:
        plane_bytes = 4.0 * split * M * N * batch
        if reduce_apart(dict(cfg, SPLIT_K=split)):
            total += 2 * plane_bytes / (L2_PER_HBM * hbm_gbps * 1e3) + LAUNCH_US
        else:
            total += split * bm * bn * 4.0 / (LAST_ARRIVAL_GBPS * 1e3)
    floor = ((M * K + K * N) * elem + M * N * out_elem) * batch / (hbm_gbps * 1e3)
    return max(total, floor)


def device_rates(p) -> tuple[int, float, float]:
    """(SMs, vendor peak TFLOPS for the problem's dtype, HBM GB/s) of the problem's device (round H100-class
    numbers for a GPU the table lacks, and on the CPU)."""
    name = torch.cuda.get_device_name(p.out.device) if p.out.is_cuda else None
    key = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "tf32"}.get(p.dtype, "fp8_e4m3")
    if p.dtype == torch.float32 and p.input_precision == "ieee":
        key = "fp32"
    peak = hardware.peak_tflops(name, key) or (989.0 if key in ("fp16", "bf16") else 495.0)
    return hardware.sm_count(p.out.device), peak, hardware.peak_gbps(name) or 3350.0


def problem_estimator(p, aligned: bool | None = None):
    """``estimate(cfg) -> us`` for a :class:`tilegemm.ops.matmul.problem.GemmProblem` on its device;
    ``aligned`` overrides whether its rows are 16-byte aligned (to price a padded copy of it)."""
    sms, peak, hbm = device_rates(p)
    aligned = rows_aligned(p) if aligned is None else aligned
    dims = (p.M, p.N, p.K, p.batch, p.a.element_size(), p.out.element_size())

    def estimate(cfg: dict) -> float:
        return estimate_us(*dims, cfg, sms=sms, peak_tflops=peak, hbm_gbps=hbm, aligned=aligned)

    return estimate


def fastest(options: list[dict], p) -> dict:
    """The option this model estimates fastest on problem ``p`` (autotuned's and split_k's untimed choice)."""
    return min(options, key=problem_estimator(p))
