"""Load and store widths of the depthwise gradients compiled offline for sm_90 (fp16, channels-last, 3x3), at the
channel counts named in the JSON argument: prints {C: {"dgrad": {op: count}, "wgrad": {op: count}}}."""
import collections, json, re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tilegemm.ops.conv2d import depthwise as dw
from tilegemm.ops.conv2d import configs as cfgs
from tilegemm.ops.conv2d.problem import geometry_of

captured = []
dw.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, grid, args, kwargs))
cfgs.interpreting = lambda: False


def count(kernel, args, kwargs):
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig, ce, at = specialized_signature(kernel, args, kw)
    ptx = triton.compile(ASTSource(kernel, sig, ce, at), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=kwargs.get("num_warps", 4),
                                      num_stages=kwargs.get("num_stages", 2))).asm["ptx"]
    return dict(collections.Counter(re.findall(r"\b(ld\.global\.\S+|st\.global\.\S+)", ptx)))


out = {}
for C in json.loads(sys.argv[1]):
    x = torch.empty(32, C, 28, 28, dtype=torch.float16).to(memory_format=torch.channels_last)
    w = torch.empty(C, 1, 3, 3, dtype=torch.float16)
    g = geometry_of(x.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), C)
    dy = torch.empty(32, C, 28, 28, dtype=torch.float16).to(memory_format=torch.channels_last)
    dw.dgrad(dy, w, x.shape, torch.channels_last, g)
    dgrad = count(*[captured[-1][i] for i in (0, 2, 3)])
    dw.wgrad(dy, x, g, torch.float16)
    wgrad = count(*[captured[-1][i] for i in (0, 2, 3)])
    out[C] = dict(dgrad=dgrad, wgrad=wgrad)
print(json.dumps(out))
