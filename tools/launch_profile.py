"""Where the host time of small tilegemm calls goes (run on the GPU machine).

    python3 tools/launch_profile.py [matmul] [w4a16]    (both when none is named)

matmul: one 64x64 fp16 tilegemm.matmul against torch.matmul, a direct compiled launch and cProfile's view.
w4a16: w4a16.matmul on a 1280 x 1152 weight at M = 1 (auto: the fragment kernel on Hopper) and M = 4096 (auto:
dequant_cublas) against F.linear with the dense fp16 weight, each replayed and with the fast path off, then a
cProfile of 1000 replayed M = 1 calls.
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import triton

import tilegemm
from tilegemm.bench.runner import host_us_per_call as per_call_us
from tilegemm.ops.matmul import grouped
from tilegemm.ops.matmul.configs import fixed_config
from tilegemm.ops.matmul.problem import make_problems


def profile(fn, calls: int, lines: int) -> None:
    """cProfile of ``calls`` calls of ``fn``, the top ``lines`` functions by their own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(lines)
    print(s.getvalue().rstrip())


def matmul_section() -> None:
    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.float16)
    p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False)[0]
    cfg = fixed_config(torch.float16)
    args, flags = p.kernel_args(), p.kernel_flags()
    g = (triton.cdiv(64, cfg["BLOCK_M"]) * triton.cdiv(64, cfg["BLOCK_N"]), 1)
    kernel = grouped.matmul_grouped_kernel
    compiled = kernel[g](*args, **flags, **cfg)
    params = list(args) + [{**flags, **cfg}[name] for name in kernel.arg_names[len(args):]]
    runner = compiled[(g[0], 1, 1)]
    stream = torch.cuda.current_stream().cuda_stream
    rows = {
        "torch.matmul": per_call_us(lambda: torch.matmul(a, b)),
        "torch.empty": per_call_us(lambda: torch.empty(64, 64, device="cuda", dtype=torch.float16)),
        "triton kernel[grid](...)": per_call_us(lambda: kernel[g](*args, **flags, **cfg)),
        "CompiledKernel runner": per_call_us(lambda: runner(*params)),
        "CompiledKernel runner, stream given": per_call_us(lambda: runner(*params, stream=stream)),
        "make_problems": per_call_us(lambda: make_problems(a, b, out, None, None, 1.0, 1.0, "none", "ieee", False)),
        "tilegemm.matmul grouped": per_call_us(lambda: tilegemm.matmul(a, b, kernel="grouped")),
        "tilegemm.matmul auto": per_call_us(lambda: tilegemm.matmul(a, b)),
        "tilegemm.matmul split_k": per_call_us(lambda: tilegemm.matmul(a, b, kernel="split_k")),
        "tilegemm.copy 64x64": per_call_us(lambda: tilegemm.copy(a)),
    }
    for name, us in rows.items():
        print(f"{name:40s} {us:7.1f} us")
    profile(lambda: tilegemm.matmul(a, b, kernel="grouped"), 3000, 22)


def host_only_us(fn, calls: int = 200) -> float:
    """Wall time per call of ``fn`` with the GPU idle at the start and no sync in the timed loop: the host's own
    time while the launch queue does not fill (a few hundred calls), for calls whose GPU time exceeds it."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def w4a16_section() -> None:
    from tilegemm import w4a16
    from tilegemm.ops.w4a16 import api, dispatch, op

    N, K = 1280, 1152
    dense = torch.randn(N, K, device="cuda", dtype=torch.float16)
    w = w4a16.quantize(dense, 128)
    keyed = api.replay_key
    print(f"\nw4a16.matmul on {N} x {K} (group 128, fp16) against F.linear with the dense fp16 weight")
    print(f"{'call':52s} {'back to back':>12s} {'host only':>10s}   (us per call)")
    for M in (1, 4096):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        chosen = dispatch.choose(M, dispatch.frag_usable(w.group_k, x.device, K))
        rows = {f"F.linear M={M}": lambda: torch.nn.functional.linear(x, dense),
                f"w4a16.matmul M={M} ({chosen}), replayed": lambda: w4a16.matmul(x, w)}
        for name, fn in rows.items():
            print(f"{name:52s} {per_call_us(fn):12.1f} {host_only_us(fn):10.1f}")
        api.replay_key = lambda *args: None  # the full path: checks, problem, dispatch, Triton's launch wrapper
        try:
            fn = rows[f"w4a16.matmul M={M} ({chosen}), replayed"]
            print(f"{f'w4a16.matmul M={M} ({chosen}), fast path off':52s} {per_call_us(fn):12.1f} "
                  f"{host_only_us(fn):10.1f}")
        finally:
            api.replay_key = keyed
    print(f"kept: {op.REPLAYS.count()} whole calls, {op.DEQUANTS.count()} dequantizations "
          "(back to back: max(host, GPU); host only: no sync in the loop)")
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    w4a16.matmul(x, w)
    print("\ncProfile of 1000 replayed w4a16.matmul calls at M=1:")
    profile(lambda: w4a16.matmul(x, w), 1000, 15)


sections = {"matmul": matmul_section, "w4a16": w4a16_section}
for name in sys.argv[1:] or list(sections):
    if name not in sections:
        sys.exit(f"unknown section {name!r}; known: {', '.join(sections)}")
    sections[name]()
