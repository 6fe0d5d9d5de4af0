"""Where the host time of one small tilegemm.matmul goes (run on the GPU machine)."""

import cProfile
import io
import pstats

import torch
import triton

import tilegemm
from tilegemm.bench.runner import host_us_per_call as per_call_us
from tilegemm.ops.matmul import grouped
from tilegemm.ops.matmul.configs import fixed_config
from tilegemm.ops.matmul.problem import make_problems


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
prof = cProfile.Profile()
prof.enable()
for _ in range(3000):
    tilegemm.matmul(a, b, kernel="grouped")
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
print("\n".join(s.getvalue().splitlines()[:45]))
