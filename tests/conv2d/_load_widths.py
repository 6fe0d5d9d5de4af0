"""Load widths of the conv2d kernels compiled offline for sm_90 (a ResNet-50 3x3 layer, fp16, channels-last)."""
import re, sys, collections
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tilegemm
from tilegemm.ops.conv2d import implicit_gemm as ig
from tilegemm.ops.conv2d import configs as cfgs
from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of, memory_format_of

captured = []
ig.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, grid, args, kwargs))
cfgs.interpreting = lambda: False

N, C, H, W, K, R = 32, 64, 56, 56, 64, 3
x = torch.empty(N, C, H, W, dtype=torch.float16).to(memory_format=torch.channels_last)
w = torch.empty(K, C, R, R, dtype=torch.float16).to(memory_format=torch.channels_last)
g = geometry_of(x.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)
p = ConvProblem(x, w, None, g, torch.float16, memory_format_of(x), "none", "ieee", False)
ig.run(p)
kernel, grid, args, kwargs = captured[-1]
kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
sig, ce, at = specialized_signature(kernel, args, kw)
ptx = triton.compile(ASTSource(kernel, sig, ce, at), target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))).asm["ptx"]
ops = collections.Counter(re.findall(r"\b(cp\.async\.\S+|ld\.global\.\S+|st\.global\.\S+|mma\.\S+|wgmma\.\S+)", ptx))
fwd = dict(ops)

def count(kernel, args, kwargs):
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig, ce, at = specialized_signature(kernel, args, kw)
    ptx = triton.compile(ASTSource(kernel, sig, ce, at), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))).asm["ptx"]
    return dict(collections.Counter(re.findall(r"\b(cp\.async\.c[ag]\S+|ld\.global\.\S+|st\.global\.\S+|wgmma\.mma\S+|mma\.sync\S+)", ptx)))

dy = torch.empty(N, K, H, W, dtype=torch.float16).to(memory_format=torch.channels_last)
ig.dgrad(dy, w, x.shape, torch.channels_last, g, "ieee", False)
dgrad = count(captured[-1][0], captured[-1][2], captured[-1][3])
# the stride-2 data gradient, per stride phase (a ResNet-50 downsampling 3x3 layer)
gs = geometry_of(x.shape, w.shape, (2, 2), (1, 1, 1, 1), (1, 1), 1)
dys = torch.empty(N, K, gs.P, gs.Q, dtype=torch.float16).to(memory_format=torch.channels_last)
ig.dgrad(dys, w, x.shape, torch.channels_last, gs, "ieee", False)
assert captured[-1][3]["PHASED"]
dgrad_phased = count(captured[-1][0], captured[-1][2], captured[-1][3])
ig.wgrad(dy, x, g, "ieee", False, torch.float16)
wgrad = count(captured[-1][0], captured[-1][2], captured[-1][3])
from tilegemm.ops.conv2d import depthwise as dw
dw.launch = ig.launch
xd = torch.empty(64, 192, 28, 28, dtype=torch.float16).to(memory_format=torch.channels_last)
wd = torch.empty(192, 1, 3, 3, dtype=torch.float16).to(memory_format=torch.channels_last)
gd = geometry_of(xd.shape, wd.shape, (2, 2), (1, 1, 1, 1), (1, 1), 192)  # strided: the pixel kernel
from tilegemm.ops.conv2d.configs import depthwise_fwd_config  # (auto runs strided ones on the strided row kernel)
dw.run(ConvProblem(xd, wd, None, gd, torch.float16, memory_format_of(xd), "none", "ieee", False),
       depthwise_fwd_config(gd, torch.float16))
depthwise = count(captured[-1][0], captured[-1][2], captured[-1][3])
rows = {}
from tilegemm.ops.conv2d.configs import depthwise_rows_config  # (auto runs 8-31 rows on the strided row kernel)
for size in (28, 56):  # stride 1: the row kernel, loads held in registers (28 rows) and pipelined (56)
    xd = torch.empty(64, 192, size, size, dtype=torch.float16).to(memory_format=torch.channels_last)
    gd = geometry_of(xd.shape, wd.shape, (1, 1), (1, 1, 1, 1), (1, 1), 192)
    dw.run(ConvProblem(xd, wd, None, gd, torch.float16, memory_format_of(xd), "none", "ieee", False),
           depthwise_rows_config(gd, torch.float16))
    rows[size] = count(captured[-1][0], captured[-1][2], captured[-1][3])
# 88 channels (a pixel stride Triton does not know to be a multiple of 8), stride 2: the pixel kernel, and the
# strided row kernel flat (8 elements a thread) and in tiles
x88 = torch.empty(64, 88, 56, 56, dtype=torch.float16).to(memory_format=torch.channels_last)
w88 = torch.empty(88, 1, 3, 3, dtype=torch.float16)
g88 = geometry_of(x88.shape, w88.shape, (2, 2), (1, 1, 1, 1), (1, 1), 88)
p88 = ConvProblem(x88, w88, None, g88, torch.float16, memory_format_of(x88), "none", "ieee", False)
dw.run(p88, depthwise_fwd_config(g88, torch.float16))
depthwise_88 = count(captured[-1][0], captured[-1][2], captured[-1][3])
dw.run(p88, dict(BLOCK=512, STRIDED_ROWS=8, STAGES=1, num_warps=2))
strided_rows = count(captured[-1][0], captured[-1][2], captured[-1][3])
dw.run(p88, dict(BLOCK_Q=32, BLOCK_C=32, VEC=8, STRIDED_ROWS=8, STAGES=1, num_warps=2))
strided_tile = count(captured[-1][0], captured[-1][2], captured[-1][3])
import json
print(json.dumps(dict(fwd=fwd, dgrad=dgrad, dgrad_phased=dgrad_phased, wgrad=wgrad, depthwise=depthwise,
                      depthwise_rows=rows[28], depthwise_rows_pipelined=rows[56], depthwise_88=depthwise_88,
                      strided_rows=strided_rows, strided_tile=strided_tile)))
