"""The walking depthwise weight gradient compiled offline for sm_90 (fp16, channels-last, batch 32, split 4) at the
layers named in the JSON argument ([[C, H, R, S, stride(, filter rows a program or null(, column runs))], ...]):
prints {"C-HxH-RxS-sN(-rROWS)(-cCOLS)": {"regs", "spill",
"fma", "loads", "vec", "shared"}}, ``shared`` counting the shared-memory instructions between the loop's label and
its back edge."""
import collections, json, re, sys
import torch
from tilegemm.ops.conv2d import depthwise as dw
from tilegemm.ops.conv2d import configs as cfgs
from tilegemm.ops.conv2d.problem import geometry_of

captured = []
dw.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, grid, args, kwargs))
cfgs.interpreting = lambda: False
out = {}
for C, H, R, S, st, *more in json.loads(sys.argv[1]):
    rows = [r for r in more[:1] if r is not None]
    cols = dict(COLS=more[1]) if len(more) > 1 else {}
    x = torch.empty(32, C, H, H, dtype=torch.float16).to(memory_format=torch.channels_last)
    w = torch.empty(C, 1, R, S, dtype=torch.float16)
    g = geometry_of(x.shape, w.shape, (st, st), (R // 2, R // 2, S // 2, S // 2), (1, 1), C)
    dy = torch.empty(32, C, g.P, g.Q, dtype=torch.float16).to(memory_format=torch.channels_last)
    cfg = cfgs.depthwise_wgrad_walk_config(g, torch.float16, *rows)
    dw.wgrad(dy, x, g, torch.float16, dict(cfg, SPLIT=4, **cols))
    kernel, grid, args, kwargs = captured[-1]
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig, ce, at = specialized_signature(kernel, args, kw)
    _, ptx, info = compile_sm90(kernel, sig, ce, at, kwargs["num_warps"], kwargs["num_stages"], gluon=False)
    lines = ptx.splitlines()
    # the innermost loop: from the last label named a loop header ('.lr.ph') to the branch back to it
    head = max(i for i, line in enumerate(lines) if re.match(r"\$L__BB\d+_\d+:.*lr\.ph", line))
    label = lines[head].split(":")[0]
    back = next(i for i in range(head + 1, len(lines)) if re.search(r"bra(\.uni)?\s+" + re.escape(label) + ";", lines[i]))
    body = "\n".join(lines[head:back])
    out[f"{C}-{H}x{H}-{R}x{S}-s{st}" + "".join(f"-r{r}" for r in rows) + "".join(f"-c{c}" for c in cols.values())] = dict(
        regs=int(re.search(r"Used (\d+) registers", info).group(1)),
        spill=sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", info)),
        fma=len(re.findall(r"\bfma\.rn\.f32\b", body)),
        loads=dict(collections.Counter(re.findall(r"\bld\.global\.\S+", body))),
        vec=kw["BLOCK_N"] * kw["BLOCK_P"] // (32 * kwargs["num_warps"]),
        shared=len(re.findall(r"\b(?:ld|st)\.shared|bar\.sync", body)))
print(json.dumps(out))
