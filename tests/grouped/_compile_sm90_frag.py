# Appended to conftest.SM90 by test_grouped_frag_compiled.py: compiles kernel ``frag`` of grouped_w4a16 for sm_90 on
# CPU tensors shaped as each variant's launch (no GPU), and reports what the PTX and ptxas say.
import json, re, sys
import torch
from unittest import mock

from tilegemm.ops.grouped import frag

report = {}
for name, v in json.loads(sys.argv[1]).items():
    dt = getattr(torch, v["dtype"])
    E, M, N, K = v["emnk"]  # N: the output's columns (gated: the weight holds 2N rows)
    gated = v.get("gated", False)
    rows = 2 * (-(-N // 16) * 16) if gated else N
    group = v.get("group", 128)
    x = torch.empty(M, K, dtype=dt)
    fw = torch.empty(E, -(-rows // 256) * 16, -(-K // 128) * 2, 32, 4, dtype=torch.int32)
    group_k = K if group == -1 else group
    fzs = torch.empty(E, -(-fw.shape[2] * 64 // group_k), fw.shape[1], 8, 4, dtype=dt)  # as pack_fragments pads
    out = torch.empty(M, N, dtype=dt)
    offs = torch.empty(E, dtype=torch.int32)
    bias = {None: None, "n": torch.empty(2 * N if gated else N, dtype=dt),
            "en": torch.empty(E, 2 * N if gated else N, dtype=dt)}[v.get("bias")]
    # the workspace from the CPU (its planes are never touched offline)
    with mock.patch.object(frag, "split_workspace", lambda dev, floats, counters, tag=None: (
            torch.empty(floats, dtype=torch.float32), torch.empty(counters, dtype=torch.int32))):
        kernel, grid, args, kwargs, _ = frag.launch_args(x, fw, fzs, bias, out, offs, N, K, group_k, v["act"],
                                                         gated, v["cfg"])
    sig, constexprs, attrs = specialized_signature(kernel, args, kwargs)
    compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
    report[name] = dict(
        grid=list(grid),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        waits=re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
        lop3=len(re.findall(r"lop3\.b32", ptx)),
        cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)),
        atomics=len(re.findall(r"atom\.", ptx)),
        shared=compiled.metadata.shared,
        registers=[int(n) for n in re.findall(r"Used (\d+) registers", info)],
        serialized="serialized" in info,
        spills=[int(n) for n in re.findall(r"(\d+) bytes spill stores", info)],
        split=kwargs["SPLIT_K"], group32=bool(kwargs.get("GROUP32")), compact=kwargs["COMPACT"],
    )
print(json.dumps(report))
