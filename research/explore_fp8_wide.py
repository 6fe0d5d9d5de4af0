"""Exploration: promoted fp8 on a 192x128 tile, three consumer warp groups with one partial tile each.

``gluon_fp8.matmul_fp8_ws_kernel`` gives each of its two consumer warp groups 64 rows of a 128x128 tile
and two partial tiles, so a warp group adds one K step's partial while its next step's MMAs run. The two
partials and the accumulator take about 205 registers a thread, which caps the tile at 128x128. cuBLAS's
promoted kernels on the H200 use larger tiles (128x160 at 16384^3, 144x128 at 8192^3) and, like
CUTLASS's fp8 mainloop, one partial per warp group: a warp group waits for its own K step's MMAs
before the add, and the tensor cores meanwhile run the other warp groups' MMAs.

Here: a producer warp group (gluon_f16's ``fill_ring``) and three consumer warp groups, 64 rows of a
192x128 tile each (a K step moves 40 KB for 192x128 outputs, 17% fewer bytes an output than 32 KB for
128x128). Each consumer issues its K step's MMAs into its partial (from zero), waits for them, frees the
slot and adds the partial into its accumulator: 128 registers of tiles a thread, within the 152 the three
consumers can each have beside the producer (3 x 128 x 152 + 128 x 40 <= 65536; the default partition
gets what is left). Same arithmetic and order of adds as the shipped kernel. Four 40 KB stages fit beside
the three 16 KB output buffers (Gluon takes power-of-two shared shapes only, so A's tile lies in three
64-row rings, one per consumer, and the ring has 4 stages).

First checked on odd shapes into NaN-poisoned outputs (per-row scales, e4m3 and e5m2), then timed
against ``torch._scaled_mm`` and ``tilegemm.matmul`` (the shipped kernel), replayed, in rounds.

    PYTHONPATH=src:tools python3 research/explore_fp8_wide.py --json out.json [--sizes 8192,16384]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from tilegemm.jit.helpers import epilogue_tile, tile_origin
from tilegemm.ops.matmul.gluon_f16 import host_descriptor

BLOCK_M, BLOCK_N, BLOCK_K = 192, 128, 128
ROWS = 64  # a consumer warp group's rows of the tile
CONSUMER_REGS = 152
PRODUCER_REGS = 40


@gluon.jit
def _producer(a_desc, b_desc, a0, a1, a2, b_bufs, ready, empty, M, N, K, programs,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):
    """gluon_f16's ``fill_ring`` with A's 192 rows as three 64-row boxes into three rings (Gluon takes only
    power-of-two TMA boxes and shared-memory shapes), one per consumer warp group."""
    nbytes: gl.constexpr = 3 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, programs):
        m0, n0 = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        for ks in range(steps):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            k0 = ks * BLOCK_K
            tma.async_copy_global_to_shared(a_desc, [m0, k0], bar, a0.index(slot))
            tma.async_copy_global_to_shared(a_desc, [m0 + 64, k0], bar, a1.index(slot))
            tma.async_copy_global_to_shared(a_desc, [m0 + 128, k0], bar, a2.index(slot))
            tma.async_copy_global_to_shared(b_desc, [n0, k0], bar, b_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, o_smem, ready, empty, o_desc, scale_a_ptr, scale_b_ptr, M, N, K,
              stride_sa, stride_sb, HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, WG: gl.constexpr):
    """Warp group ``WG``: the MMAs, promotion and epilogue of rows WG * 64 ... of every tile (its own ring of
    A rows ``a_bufs`` and output buffer ``o_smem``)."""
    ROW0: gl.constexpr = WG * 64
    o_ty: gl.constexpr = o_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_SMS):
        acc = gl.zeros((64, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        part = gl.zeros((64, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for ks in range(steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), part, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part,))
            mbarrier.arrive(empty.index(slot), count=1)
            acc += part
            count += 1
        m0, n0 = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        offs_m = m0 + ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        acc = epilogue_tile(acc, scale_a_ptr, scale_a_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                            0, 0, 0, stride_sa, stride_sb, 1.0, 0.0,
                            False, False, "none", HAS_SCALE_A, HAS_SCALE_B)
        tma.store_wait(pendings=0)
        o_smem.store(acc.to(o_ty))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [m0 + ROW0, n0], o_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def matmul_fp8_wide_kernel(
    a_desc, b_desc, o_desc, scale_a_ptr, scale_b_ptr, M, N, K, stride_sa, stride_sb,
    HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    a0 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 64, BLOCK_K], a_desc.layout)
    a1 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 64, BLOCK_K], a_desc.layout)
    a2 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 64, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    o0 = gl.allocate_shared_memory(o_desc.dtype, [64, BLOCK_N], o_desc.layout)
    o1 = gl.allocate_shared_memory(o_desc.dtype, [64, BLOCK_N], o_desc.layout)
    o2 = gl.allocate_shared_memory(o_desc.dtype, [64, BLOCK_N], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=3)  # the three consumer warp groups release a slot
    gl.warp_specialize([
        (_consumer, (a0, b_bufs, o0, ready, empty, o_desc, scale_a_ptr, scale_b_ptr, M, N, K,
                     stride_sa, stride_sb, HAS_SCALE_A, HAS_SCALE_B, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                     NUM_SMS, 0)),
        (_consumer, (a1, b_bufs, o1, ready, empty, o_desc, scale_a_ptr, scale_b_ptr, M, N, K,
                     stride_sa, stride_sb, HAS_SCALE_A, HAS_SCALE_B, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                     NUM_SMS, 1)),
        (_consumer, (a2, b_bufs, o2, ready, empty, o_desc, scale_a_ptr, scale_b_ptr, M, N, K,
                     stride_sa, stride_sb, HAS_SCALE_A, HAS_SCALE_B, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                     NUM_SMS, 2)),
        (_producer, (a_desc, b_desc, a0, a1, a2, b_bufs, ready, empty, M, N, K, NUM_SMS,
                     BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M)),
    ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def launch_args(a, w, out, sa, sb, stages=4, num_sms=132):
    assert stages in (2, 4), "shared-memory shapes are powers of two"
    """(kernel, grid, args, kwargs) for out = sa * sb * (a @ w.T): a [M, K] and w [N, K] fp8, K contiguous;
    sa per-row ([M]) or per-tensor, sb per-tensor."""
    M, K = a.shape
    N = w.shape[0]
    descs = (host_descriptor(a, [M, K], a.stride(0), [ROWS, BLOCK_K]),
             host_descriptor(w, [N, K], w.stride(0), [BLOCK_N, BLOCK_K]),
             host_descriptor(out, [M, N], out.stride(0), [ROWS, BLOCK_N]))
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    args = descs + (sa, sb, M, N, K, 1 if sa.dim() else 0, 1 if sb.dim() else 0)
    kwargs = dict(HAS_SCALE_A=True, HAS_SCALE_B=True, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                  STAGES=stages, GROUP_M=8, NUM_SMS=num_sms, CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return matmul_fp8_wide_kernel, (min(num_sms, tiles),), args, kwargs


def main():
    import tilegemm
    from tilegemm.core import tuning
    from tilegemm.core.hardware import sm_count
    from tilegemm.core.launch import launch

    from explore_f16_coop import timed

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="2048,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sms = sm_count(torch.device("cuda"))
    results, wrong = [], 0
    for M, N, K in [(192, 128, 128), (257, 264, 400), (1000, 520, 384), (17, 1040, 2048), (2048, 1920, 4096)]:
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            a = (torch.randn(M, K, device="cuda") * 2).to(dt)
            w = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
            sa = torch.rand(M, device="cuda") + 0.5
            sb = torch.tensor(0.75, device="cuda")
            ref = (a.double() @ w.double().T) * sa.double()[:, None] * 0.75
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch(*launch_args(a, w, out, sa, sb, num_sms=sms))
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ok = err < 1e-2 and not out.isnan().any().item()
            wrong += not ok
            results.append(dict(check=[M, N, K], dtype=str(dt), rel_err=err, ok=ok))
    print(f"checks: {len(results)}, wrong {wrong}", flush=True)
    table = []
    for s in (int(x) for x in args.sizes.split(",")):
        a = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        out = torch.empty(s, s, device="cuda", dtype=torch.bfloat16)
        fns = {"scaled_mm": lambda: torch._scaled_mm(a, w.T, one, one, out_dtype=torch.bfloat16),
               "auto": lambda: tilegemm.matmul(a, w.T, scale_a=one, scale_b=one)}
        for stages in (4,):
            la = launch_args(a, w, out, one, one, stages=stages, num_sms=sms)
            fns[f"wide_s{stages}"] = tuning.replaying(lambda c, la=la: launch(*la), {})
        ref = torch._scaled_mm(a, w.T, one, one, out_dtype=torch.float32)
        errs = {}
        for k, f in fns.items():
            if k.startswith("wide"):
                f(), f()
                out.fill_(float("nan"))
                f()
                got = out
            else:
                got = f()
            torch.cuda.synchronize()
            errs[k] = ((got.float() - ref).norm() / ref.norm()).item()
        ms = timed(fns, rounds=args.rounds)
        base = ms["scaled_mm"]
        row = {k: base / v for k, v in ms.items()}
        for k in fns:
            results.append(dict(shape=[s, s, s], variant=k, ms=ms[k], ratio=row[k], rel_err=errs[k],
                                tflops=2 * s**3 / ms[k] / 1e9))
        table.append((s, row, errs))
        print(f"{s:6d} " + " ".join(f"{k}={v:.3f}" for k, v in row.items())
              + "  errs " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()), flush=True)
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, wrong=wrong, results=results), f, indent=1)


if __name__ == "__main__":
    main()
