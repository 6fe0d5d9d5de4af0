"""Exploration: fp8 with promotion, written in Gluon so the promotion add overlaps the next K step's MMAs.

Triton 3.6's ``tl.dot(..., max_num_imprecise_acc=BK)`` waits for a K step's MMAs to finish before adding
their partial sum into the fp32 accumulator, so the tensor cores idle during every add. Here each K step's
MMAs go into one of two partial tiles (p0, p1) and the add of one overlaps the MMAs of the other
(``warpgroup_mma_wait(1)``). OVERLAP=False waits for both (the same kernel without the overlap).

The kernel here is the first, non-persistent version (one program per 128x128 tile), kept as the control
with and without the overlap; ``gluon_pers_*`` time the library's persistent kernel
(``tilegemm.ops.matmul.gluon_fp8``) at three ring depths.

    PYTHONPATH=src python research/explore_fp8_gluon.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from tilegemm.ops.matmul.gluon_fp8 import _issue_mma, _load_step
@gluon.jit
def fp8_promoted_kernel(a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, stride_o, stride_sa, stride_sb,
                        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                        GROUP_M: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    LAG: gl.constexpr = 1 if OVERLAP else 0
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_a, 1], [BM, BK], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_b, 1], [BN, BK], b_layout)
    o_desc = tma.make_tensor_descriptor(out_ptr, [M, N], [stride_o, 1], [BM, BN], o_layout)

    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    width = GROUP_M * tiles_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m0 = pid_m * BM
    n0 = pid_n * BN

    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 32])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    p0 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    p1 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)

    steps = gl.cdiv(K, BK)
    producer = 0
    consumer = 0
    # Loads run STAGES - 2 steps ahead: the buffer a load overwrites was read by an MMA already waited for.
    for i in gl.static_range(STAGES - 2):
        producer = _load_step(producer, producer, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BK, producer < steps)
    producer = _load_step(producer, producer, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BK, producer < steps)
    consumer, p0 = _issue_mma(consumer, p0, ready, a_bufs, b_bufs, STAGES, 0, BM)
    for j in range((steps - 1) // 2):
        producer = _load_step(producer, producer, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BK, producer < steps)
        consumer, p1 = _issue_mma(consumer, p1, ready, a_bufs, b_bufs, STAGES, 0, BM)
        p0 = warpgroup_mma_wait(LAG, deps=(p0,))
        acc += p0
        producer = _load_step(producer, producer, a_desc, b_desc, m0, n0, ready, a_bufs, b_bufs, STAGES, BK, producer < steps)
        consumer, p0 = _issue_mma(consumer, p0, ready, a_bufs, b_bufs, STAGES, 0, BM)
        p1 = warpgroup_mma_wait(LAG, deps=(p1,))
        acc += p1
    if (steps - 1) % 2 == 1:
        consumer, t1 = _issue_mma(consumer, p1, ready, a_bufs, b_bufs, STAGES, 0, BM)
        r0 = warpgroup_mma_wait(1, deps=(p0,))
        acc += r0
        r1 = warpgroup_mma_wait(0, deps=(t1,))
        acc += r1
    else:
        r0 = warpgroup_mma_wait(0, deps=(p0,))
        acc += r0
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
    sa = gl.load(sa_ptr + offs_m * stride_sa, mask=offs_m < M, other=0.0)
    sb = gl.load(sb_ptr + offs_n * stride_sb, mask=offs_n < N, other=0.0)
    acc = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], o_layout)
    o_smem.store(acc.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [m0, n0], o_smem)
    tma.store_wait(pendings=0)


def gluon_fp8(a, w, sa, sb, bm=128, bn=128, stages=5, overlap=True, warps=8):
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    fp8_promoted_kernel[grid](a, w, out, sa, sb, M, N, K, a.stride(0), w.stride(0), out.stride(0),
                              sa.stride(0) if sa.dim() else 0, sb.stride(0) if sb.dim() else 0,
                              BM=bm, BN=bn, BK=128, STAGES=stages, GROUP_M=8, OVERLAP=overlap, num_warps=warps)
    return out


def gluon_fp8_persistent(a, w, sa, sb, stages=5):
    """The library's kernel (tilegemm.ops.matmul.gluon_fp8) through persistent_tma with a fixed config."""
    from tilegemm.ops.matmul import persistent_tma
    from tilegemm.ops.matmul.problem import make_problems

    out = torch.empty(a.shape[0], w.shape[0], device=a.device, dtype=torch.bfloat16)
    p = make_problems(a, w.T, out, None, None, 1.0, 0.0, "none", "ieee", False, scales=(sa, 0, sb, 0))[0]
    persistent_tma.run(p, dict(GLUON_FP8=True, STAGES=stages, num_warps=8))
    return out


def timed(fns: dict, rounds=3, rep=100, graph=False):
    runs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            if graph:
                runs[k].append(triton.testing.do_bench_cudagraph(f, rep=rep))
            else:
                runs[k].append(triton.testing.do_bench(f, warmup=25, rep=rep))
    return {k: statistics.median(v) for k, v in runs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launch cost)")
    args = ap.parse_args()
    import tilegemm
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    results = []
    for s in (int(x) for x in args.sizes.split(",")):
        M = N = K = s
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.tensor(0.75, device="cuda")
        sb = torch.tensor(1.25, device="cuda")
        ref = (a.float() @ w.float().T) * 0.75 * 1.25
        fns = {
            "scaled_mm": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16),
            "scaled_mm_fast": lambda: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
            "tilegemm_auto": lambda: tilegemm.matmul(a, w.T, scale_a=sa, scale_b=sb),
        }
        for stages in (4, 6):
            fns[f"gluon_s{stages}"] = (lambda st=stages: gluon_fp8(a, w, sa, sb, stages=st))
        for stages in (4, 5, 6):
            fns[f"gluon_pers_s{stages}"] = (lambda st=stages: gluon_fp8_persistent(a, w, sa, sb, stages=st))
        fns["gluon_s5_nooverlap"] = lambda: gluon_fp8(a, w, sa, sb, stages=5, overlap=False)
        errs = {}
        for k, f in fns.items():
            try:
                out = f().float()
                errs[k] = ((out - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001
                errs[k] = f"error {type(e).__name__}: {str(e)[:200]}"
        ok = {k: f for k, f in fns.items() if isinstance(errs[k], float)}
        ms = timed(ok, graph=args.graph)
        base = ms["scaled_mm"]
        for k in fns:
            row = dict(shape=[M, N, K], variant=k, rel_err=errs[k], graph=args.graph)
            if k in ms:
                row.update(ms=ms[k], ratio=base / ms[k], tflops=2 * M * N * K / ms[k] / 1e9)
            results.append(row)
            print(f"{s:6d} {k:22s} {row.get('ratio', 0):6.3f} {row.get('tflops', 0):8.1f} err={errs[k] if isinstance(errs[k], str) else f'{errs[k]:.2e}'}",
                  flush=True)
    if args.json:
        from tilegemm.core.hardware import git_commit

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    cuda=torch.version.cuda, git_commit=git_commit())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
