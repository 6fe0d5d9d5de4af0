"""Registers, spills and load widths of the stride-1 depthwise candidates for large filters compiled offline for sm_90
(fp16, channels-last, batch 32): depthwise_rows_kernel and depthwise_window_kernel at the configs named in the
JSON argument ({name: [C, H, R, config]}); prints {name: {"regs", "spill", "loads"}}."""
import collections, json, re, sys
import torch
from tilegemm.ops.conv2d import depthwise as dw
from tilegemm.ops.conv2d import configs as cfgs
from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

captured = []
dw.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, grid, args, kwargs))
cfgs.interpreting = lambda: False
out = {}
for name, (C, H, R, cfg) in json.loads(sys.argv[1]).items():
    x = torch.empty(32, C, H, H, dtype=torch.float16).to(memory_format=torch.channels_last)
    w = torch.empty(C, 1, R, R, dtype=torch.float16)
    pad = R // 2
    g = geometry_of(x.shape, w.shape, (1, 1), (pad, pad, pad, pad), (1, 1), C)
    dw.run(ConvProblem(x, w, None, g, torch.float16, torch.channels_last, "none", "ieee", False), cfg)
    kernel, grid, args, kwargs = captured[-1]
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "maxnreg")}
    sig, ce, at = specialized_signature(kernel, args, kw)
    more = {"maxnreg": kwargs["maxnreg"]} if "maxnreg" in kwargs else {}
    _, ptx, info = compile_sm90(kernel, sig, ce, at, kwargs.get("num_warps", 4), gluon=False, **more)
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", info))
    loads = dict(collections.Counter(re.findall(r"\bld\.global\.\S+", ptx)))
    out[name] = dict(kernel=kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, regs=regs,
                     spill=spill, loads=loads)
print(json.dumps(out))
